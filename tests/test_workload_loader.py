"""Finding a workload: every bad reference or option is refused before anything starts, with a
message naming the field, what was found and the fix; good ones build through one interface."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch

from conftest import write_config
from federation.config.schema import ConfigError, load_config
from site_trainer import workload_loader
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig
from site_trainer.workload import TaskContext
from site_trainer.workload_loader import WorkloadError

BAD_TASKS = [
    ("not importable", "no_such_pkg.tasks:Legal", ["workload.task", "cannot import module 'no_such_pkg.tasks'",
                                                   "ModuleNotFoundError", "pip install"]),
    ("no such attribute", "user_tasks:Legal", ["workload.task", "has no attribute 'Legal'", "Blobs",
                                               "fix the name after the ':'"]),
    ("not a task", "user_tasks:NotATask", ["not a subclass of site_trainer.workload.Task",
                                           "build_model, build_data and loss"]),
    ("a function", "user_tasks:make_model", ["is a function", "workload.script"]),
    ("misses a method", "user_tasks:NoLoss", ["(NoLoss) does not implement loss"]),
    ("unknown name", "imagenet", ["'imagenet' is neither a registered workload", "digits", "slm",
                                  "sovereign_fl.workloads", "pkg.module:Class"]),
    ("empty attribute", "user_tasks:", ["is not an import path", "'pkg.module:Name'"]),
]


@pytest.mark.parametrize("label,ref,needles", BAD_TASKS, ids=[b[0] for b in BAD_TASKS])
def test_bad_task_reference_is_refused_with_the_fix(label, ref, needles):
    with pytest.raises(ValueError) as err:
        WorkloadConfig(task=ref)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_registered_entry_point_that_fails_to_import(monkeypatch):
    broken = metadata.EntryPoint(name="legal", value="vanished_pkg.tasks:Legal", group=workload_loader.GROUP)
    real = workload_loader.registered
    monkeypatch.setattr(workload_loader, "registered", lambda: {**real(), "legal": broken})
    with pytest.raises(WorkloadError, match=r"workload 'legal' is registered \(vanished_pkg.tasks:Legal\) but does not "
                                            r"import \(ModuleNotFoundError.*reinstall the package"):
        workload_loader.task_class("legal")


def test_options_are_validated_by_the_tasks_own_model_naming_each_field():
    with pytest.raises(ValueError) as err:
        WorkloadConfig(task="digits", options={"hidden": 0, "partitoin": "iid"})
    text = str(err.value)
    assert "workload.options.hidden: Input should be greater than or equal to 1" in text
    assert "workload.options.partitoin: Extra inputs are not permitted" in text
    assert "task 'digits'" in text
    with pytest.raises(ValueError, match=r"workload.options.classes: Input should be greater than or equal to 2 "
                                         r"\(task 'user_tasks:Blobs'"):
        WorkloadConfig(task="user_tasks:Blobs", options={"classes": 1})


def test_errors_name_the_file_when_loaded_from_yaml(tmp_path):
    data = {"workload": {"task": "slm", "options": {"n_layer": 0}}, "sites": [{"id": "a", "partition": 0}]}
    path = write_config(tmp_path / "w.yaml", data)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value) and "workload.options.n_layer: Input should be greater than or equal to 1" \
        in str(err.value)


def test_flat_form_and_stale_strategy_say_how_to_rewrite(tmp_path):
    flat = {"workload": {"name": "digits", "hidden": 32}, "sites": [{"id": "a", "partition": 0}]}
    with pytest.raises(ConfigError, match=r"write `workload: \{task: digits, options: \{hidden: 32\}\}`"):
        load_config(write_config(tmp_path / "flat.yaml", flat))
    stale = {"workload": {"task": "digits"}, "sites": [{"id": "a", "partition": 0, "strategy": "zero2"}]}
    with pytest.raises(ConfigError, match=r"sites.0: strategy: 'zero2' on a site was renamed parallelism"):
        load_config(write_config(tmp_path / "stale.yaml", stale))


def _trainer_config(tmp_path, wl: WorkloadConfig, **site) -> TrainerConfig:
    return TrainerConfig(site=SiteConfig(id="paris", partition=0, **site), workload=wl, num_partitions=1,
                         socket=str(tmp_path / "s.sock"), workdir=str(tmp_path))


def test_per_site_options_merge_over_the_workloads_and_are_checked(tmp_path):
    wl = WorkloadConfig(task="user_tasks:Blobs", options={"features": 4, "hidden": 8})
    cfg = _trainer_config(tmp_path, wl, workload_options={"shift": 1.5})
    assert cfg.options == {"features": 4, "hidden": 8, "shift": 1.5}
    task = workload_loader.build_task(wl, TaskContext(role="site"), cfg.options)
    assert (task.options.features, task.options.shift) == (4, 1.5)
    with pytest.raises(ValueError, match=r"sites\[paris\].workload_options \(merged over workload.options\).hidden: "
                                         r"Input should be greater than or equal to 1"):
        _trainer_config(tmp_path, wl, workload_options={"hidden": 0})
    nested = {"lora": {"r": 8, "alpha": 16}}
    from site_trainer.config import merge_options

    assert merge_options(nested, {"lora": {"r": 4}}) == {"lora": {"r": 4, "alpha": 16}}


def test_cosine_schedule_needs_the_runs_length(tmp_path):
    wl = WorkloadConfig(task="digits")
    with pytest.raises(ValueError, match="lr_schedule 'cosine' needs the run's length"):
        _trainer_config(tmp_path, wl, lr_schedule="cosine")
    cfg = TrainerConfig(site=SiteConfig(id="p", partition=0, lr_schedule="cosine"), workload=wl, num_partitions=1,
                        rounds=3, socket="s", workdir=str(tmp_path))
    assert cfg.rounds == 3


def test_script_workloads_need_a_model_factory_and_an_existing_script(tmp_path):
    with pytest.raises(ValueError, match="a script workload needs model"):
        WorkloadConfig(script="train.py")
    with pytest.raises(ValueError, match=r"workload.model: 'user_tasks:Blobs' must accept one argument"):
        WorkloadConfig(script="train.py", model="user_tasks:Blobs")
    with pytest.raises(ValueError, match="give either task .* or script"):
        WorkloadConfig(task="digits", script="train.py", model="user_tasks:make_model")
    wl = WorkloadConfig(script="missing.py", model="user_tasks:make_model", args=["--epochs", "1"])
    assert wl.script == str((tmp_path.cwd() / "missing.py").resolve()) and wl.name == "missing.py"
    with pytest.raises(ValueError, match=r"workload.script: .*missing.py does not exist on site paris"):
        _trainer_config(tmp_path, wl)
    here = WorkloadConfig.model_validate({"script": "t.py", "model": "user_tasks:make_model"},
                                         context={"config_dir": str(tmp_path)})
    assert here.script == str(tmp_path / "t.py")  # relative to the configuration file's directory


def test_builtins_are_ordinary_tasks_found_by_entry_point():
    eps = workload_loader.registered()
    assert {"digits", "slm", "hf-causal-lm"} <= set(eps)
    for name in ("digits", "slm"):
        cls = workload_loader.task_class(name)
        assert eps[name].value == f"{cls.__module__}:{cls.__qualname__}"
        task = cls(cls.Options(), TaskContext(role="site", partition=1, num_partitions=2))
        torch.manual_seed(0)
        model = task.build_model()
        data = task.build_data()
        batch = data.train.take(torch.arange(4))
        loss = task.loss(model, batch)
        assert loss.dim() == 0 and torch.isfinite(loss)
        ev = task.evaluate(model, data.val.take(torch.arange(3)))
        assert ev["examples"] == 3 and float(ev["loss"].detach()) > 0


def test_readme_task_is_complete(tmp_path, monkeypatch):
    """The declarative task of README.md's "Train your own model" runs as printed."""
    import re
    import sys
    import types

    import numpy as np

    from conftest import ROOT

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Train your own model"):]
    code = re.search(r"```python\n(# mypkg/tasks.py\n.*?)```", section, re.S).group(1)
    module = types.ModuleType("readme_tasks")
    exec(compile(code, "README.md", "exec"), module.__dict__)  # noqa: S102 - our own README
    monkeypatch.setitem(sys.modules, "readme_tasks", module)
    z = tmp_path / "legal.npz"
    rng = np.random.default_rng(0)
    np.savez(z, x=rng.normal(size=(50, 300)).astype(np.float32), y=rng.integers(0, 4, size=50))
    wl = WorkloadConfig(task="readme_tasks:Legal", options={"data": str(z), "hidden": 16})
    task = workload_loader.build_task(wl, TaskContext(role="site"))
    data = task.build_data()
    assert (len(data.train), len(data.val)) == (45, 5)
    loss = task.loss(task.build_model(), data.train.take(torch.arange(8)))
    assert torch.isfinite(loss)
    code_lines = [ln for ln in code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(code_lines) <= 35  # "a complete declarative task of about 30 lines"


def test_slm_in_bfloat16_builds_trains_and_exchanges_bf16_weights():
    """`dtype: bfloat16` (a large run's setting): every weight is bf16 as built (never whole in
    float32), a loss and its gradients are finite, and the weights travel as raw bf16 words."""
    from site_trainer import layout

    cls = workload_loader.task_class("slm")
    with pytest.raises(ValueError, match="dtype"):
        WorkloadConfig(task="slm", options={"dtype": "float16"})
    task = cls(cls.Options(dtype="bfloat16"), TaskContext(role="site", partition=0, num_partitions=2))
    torch.manual_seed(0)
    model = task.build_model()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    loss = task.loss(model, task.build_data().train.take(torch.arange(4)))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert layout.wire_dtype(torch.bfloat16) == "<u2"
