"""`sovfl export RUN_DIR --out DIR [--merge]`: a run directory (its checkpoint and workload.json, as the
coordinator writes them) turned into files other tools load, and clear errors for what is missing.
The end-to-end run of the Hugging Face task exports its real run too (tests/test_e2e_hf.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from federation.config.schema import parse_config
from federation.coordinator.checkpoint import save_checkpoint
from federation.coordinator.run_record import record_workload
from federation.ops.cli import main
from hf_models import llama_dir  # noqa: F401 - fixture
from site_trainer import workloads


def _run_dir(tmp_path: Path, workload: dict, seed: int = 3, change=None) -> tuple[Path, dict]:
    """A run directory as the coordinator leaves it: workload.json and round 2's checkpoint."""
    cfg = parse_config({"federation": {"seed": seed}, "workload": workload, "sites": [{"id": "a", "partition": 0}]})
    run = tmp_path / "run"
    run.mkdir()
    record_workload(run, cfg)
    weights = workloads.initial_weights(cfg.workload, seed)
    weights = {k: change(k, v) if change else v for k, v in weights.items()}
    save_checkpoint(run / "checkpoints", 1, {k: v * 0 for k, v in weights.items()}, {})
    save_checkpoint(run / "checkpoints", 2, weights, {})
    return run, weights


def test_a_task_exports_its_state_dict_as_safetensors(tmp_path, capsys):
    from safetensors.torch import load_file

    run, weights = _run_dir(tmp_path, {"task": "user_tasks:Toy", "options": {"d": 8}},
                            change=lambda k, v: v + np.float32(0.5))
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    assert "round 2" in capsys.readouterr().out
    state = load_file(tmp_path / "out" / "model.safetensors")
    for k, v in weights.items():  # the adapters from the checkpoint
        np.testing.assert_array_equal(state[k].numpy(), v)
    base = workloads.coordinator_model(workloads.WorkloadConfig(task="user_tasks:Toy", options={"d": 8}), 3)[0]
    for k, v in base.state_dict().items():  # the frozen base as the task builds it
        if k not in weights and k in state:
            assert torch.equal(state[k], v), k
    assert main(["export", str(run), "--out", str(tmp_path / "r1"), "--round", "1"]) == 0
    assert all((load_file(tmp_path / "r1" / "model.safetensors")[k] == 0).all() for k in weights)


def test_a_script_workload_exports_its_model_factory_with_the_run_weights(tmp_path):
    from safetensors.torch import load_file

    workload = {"script": str(Path(__file__).parent / "session_script.py"), "model": "user_tasks:make_model",
                "options": {"features": 8, "classes": 3}}
    run, weights = _run_dir(tmp_path, workload, change=lambda k, v: v - np.float32(1))
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    state = load_file(tmp_path / "out" / "model.safetensors")
    assert set(state) == set(weights)
    for k, v in weights.items():
        np.testing.assert_array_equal(state[k].numpy(), v)


def test_clear_errors_for_what_is_missing(tmp_path, capsys):
    def err(*args: str) -> str:
        assert main(["export", *args, "--out", str(tmp_path / "o")]) == 1
        return capsys.readouterr().err

    assert "no such run directory" in err(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    assert "no checkpoint" in err(str(tmp_path / "empty")) and "completed no round" in err(str(tmp_path / "empty"))
    run, _ = _run_dir(tmp_path, {"task": "user_tasks:Toy"})
    assert "this run has rounds 1, 2" in err(str(run), "--round", "7")
    (run / "workload.json").unlink()
    assert "no workload.json" in err(str(run)) and "--config FILE" in err(str(run))
    (run / "workload.json").write_text(json.dumps({"workload": {"task": "user_tasks:Toy", "options": {"d": 4}}}))
    assert "has shape (8,)" in err(str(run)) or "has shape (2, 8)" in err(str(run))


def test_lora_adapter_and_merged_model_from_a_run(tmp_path, llama_dir):  # noqa: F811
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    workload = {"task": "hf-causal-lm", "options": {"model_dir": str(llama_dir), "data": "/nowhere/*.txt",
                                                    "seq_len": 32, "lora": {"r": 4, "alpha": 8}}}
    rng = np.random.default_rng(0)
    run, weights = _run_dir(tmp_path, workload, change=lambda k, v: (v + rng.normal(0, 0.05, v.shape)).astype(v.dtype))
    assert main(["export", str(run), "--out", str(tmp_path / "adapter")]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    for k, v in weights.items():  # peft stores the adapter names without the adapter's own name
        np.testing.assert_array_equal(adapter[k.replace(".default", "")].numpy(), v)
    tok = AutoTokenizer.from_pretrained(tmp_path / "adapter", local_files_only=True)
    ids = tok("def main():\n    return", return_tensors="pt")["input_ids"]
    with_adapter = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter", local_files_only=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, with_adapter(ids).logits, rtol=0, atol=1e-4)
    out = merged.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 6 and tok.decode(out[0, ids.shape[1]:])
    base, got = load_file(llama_dir / "model.safetensors"), merged.state_dict()
    for k in weights:
        if ".lora_A." in k:
            prefix = k.split(".lora_A.")[0]
            name = prefix.removeprefix("base_model.model.") + ".weight"
            ba = torch.from_numpy(weights[f"{prefix}.lora_B.default.weight"] @ weights[k])
            torch.testing.assert_close(got[name], base[name] + 2.0 * ba, rtol=0, atol=1e-6)
