"""The Trainer callback (site_trainer/hf_callback.py): each of the example's scripts, the Hugging Face
Trainer one (examples/compliance_sft/train_with_trainer.py) and the TRL SFTTrainer one
(examples/compliance_sft/train_sft.py), run by torchrun on 2 gloo ranks (DDP) as a site whose
federation workload is the built-in `hf-causal-lm` task (`sites[].script`), driven over the site's
socket as the coordinator's relay drives it: the manifest is the task's, the global adapters are
loaded before each round's steps, `local_steps` optimizer steps per round, the update comes back
with every rank agreeing, evaluation on request, and a stop ends `trainer.train()` on every rank.
And, in-process, the Trainer arguments that conflict with federation are adjusted or refused."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from federation.ops.launcher import Supervisor, wait_trainers
from hf_models import compliance_data, tiny_llama
from trainer_calls import call, far_from, update_of
from site_trainer import endpoint, workloads
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig

pytestmark = pytest.mark.slow(seconds=90)

EXAMPLE = ROOT / "examples" / "compliance_sft"
SCRIPTS = {"trainer": EXAMPLE / "train_with_trainer.py", "sft": EXAMPLE / "train_sft.py"}  # Trainer, TRL SFTTrainer
LOCAL_STEPS = 3


def workload(base: Path, chats: Path) -> WorkloadConfig:
    return WorkloadConfig(task="hf-causal-lm", options={
        "model_dir": str(base), "format": "chat", "data": str(chats / "{site}" / "train.jsonl"),
        "val_data": str(chats / "{site}" / "val.jsonl"), "seq_len": 256,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0}})


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def service(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp(f"cb-{request.param}")
    base = tiny_llama(tmp / "base", chat=True)
    compliance_data().write_site(tmp / "chats" / "s", 0, rows=80)
    wl = workload(base, tmp / "chats")
    site = SiteConfig(id="s", ranks=2, partition=0, local_steps=LOCAL_STEPS, batch_size=2, lr=0.01,
                      script=str(SCRIPTS[request.param]))
    cfg = TrainerConfig(site=site, workload=wl, num_partitions=1, rounds=4, socket=str(tmp / "s.sock"),
                        workdir=str(tmp / "s"))
    path = tmp / "trainer.json"
    path.write_text(cfg.model_dump_json())
    sup = Supervisor(tmp)
    proc = sup.start("trainer", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 "-m", "site_trainer", "--config", str(path)], {"OMP_NUM_THREADS": "1"})
    try:
        wait_trainers({"s": proc}, {"s": cfg.socket}, 180, lambda _: None)
        yield cfg, wl, proc, tmp
    finally:
        sup.close()


def test_trainer_script_site_serves_rounds_and_stops(service):
    cfg, wl, proc, tmp = service
    info = endpoint.call(cfg.socket, "Info", {}, timeout_s=30)
    assert info["manifest"] == workloads.manifest(wl, 0)  # the script's PeftModel is the task's model
    assert info["loop"] == "script" and info["ranks"] == 2 and info["num_examples"] > 0

    # round 1 from a global model far from the initial one: the reply is a few steps away from it
    far = far_from(workloads.initial_weights(wl, 0))
    r1 = call(cfg, "Train", far, round=1, config={"update_kind": "weights"})
    assert r1["ok"], r1
    w1 = update_of(r1)
    assert set(w1) == set(far) and all(".lora_" in k for k in w1)
    moved = max(np.abs(w1[k] - far[k]).max() for k in far)
    assert 0 < moved < 0.1  # trained from the global it was sent (far is 0.5 away from the initial)
    assert len(r1["rank_digests"]) == 2 and len(set(r1["rank_digests"])) == 1  # both ranks hold the same
    m1 = r1["metrics"]
    assert m1["steps"] == LOCAL_STEPS and m1["global_step"] == LOCAL_STEPS and np.isfinite(m1["loss"])
    assert m1["lr"] == pytest.approx(cfg.site.lr)  # the site's lr reaches the Trainer (constant schedule)
    assert r1["num_examples"] == info["num_examples"]  # the ranks' shares add up to the site's rows

    # an evaluation between rounds trains nothing; the next round goes on from its own global, as a delta
    ev = call(cfg, "Evaluate", w1, round=1)
    assert ev["ok"] and ev["num_examples"] > 0 and np.isfinite(ev["metrics"]["eval_loss"])
    r2 = call(cfg, "Train", w1, round=2, config={"local_steps": 2})
    assert r2["ok"], r2
    assert r2["metrics"]["steps"] == 2 and r2["metrics"]["global_step"] == LOCAL_STEPS + 2
    delta = update_of(r2)
    assert 0 < max(np.abs(d).max() for d in delta.values()) < 0.1

    assert endpoint.call(cfg.socket, "Stop", {}, timeout_s=10)["stopping"]
    assert proc.popen.wait(timeout=120) == 0  # trainer.train() returned on both ranks, which exited cleanly
    out = (tmp / "logs" / "trainer.log").read_text()
    assert "rank 0: federation ended" in out and "rank 1: federation ended" in out
    assert not Path(cfg.socket).exists()


# ---- in-process: the arguments that conflict with federation ----------------------------------------
def test_conflicting_trainer_arguments_are_adjusted_or_refused(tmp_path):
    from transformers import TrainingArguments

    from site_trainer.hf_callback import ENDLESS_STEPS, FederationArgsError, check_args, planned_steps

    cfg = TrainerConfig(site=SiteConfig(id="s", partition=0, local_steps=5), workload=WorkloadConfig(task="digits"),
                        num_partitions=1, rounds=7, socket=str(tmp_path / "s.sock"), workdir=str(tmp_path))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=100, lr_scheduler_type="cosine", report_to=[],
                             use_cpu=True)
    notes = check_args(args, cfg)
    assert args.max_steps == ENDLESS_STEPS and planned_steps(cfg) == 35
    assert any("max_steps=100 is replaced" in n for n in notes) and any("over the federation's 35 steps" in n
                                                                        for n in notes)
    with pytest.raises(FederationArgsError, match="load_best_model_at_end"):
        check_args(TrainingArguments(output_dir=str(tmp_path), load_best_model_at_end=True, eval_strategy="steps",
                                     save_strategy="steps", report_to=[], use_cpu=True), cfg)
    with pytest.raises(FederationArgsError, match="reduce_lr_on_plateau"):
        check_args(TrainingArguments(output_dir=str(tmp_path), lr_scheduler_type="reduce_lr_on_plateau",
                                     eval_strategy="steps", report_to=[], use_cpu=True), cfg)


def test_the_schedule_is_placed_by_round_number(tmp_path):
    """A site sampled in rounds 1 and 4 only starts round 4 where every site does: step 3 x local_steps
    of the federation's schedule (linear warm-up and decay over rounds x local_steps)."""
    import torch
    from transformers import get_scheduler

    from site_trainer.hf_callback import FederatedCallback, planned_steps

    cfg = TrainerConfig(site=SiteConfig(id="s", partition=0, local_steps=5), workload=WorkloadConfig(task="digits"),
                        num_partitions=1, rounds=8, socket=str(tmp_path / "s.sock"), workdir=str(tmp_path))
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=0.1)
    horizon = planned_steps(cfg)
    sched = get_scheduler("linear", optimizer=opt, num_warmup_steps=4, num_training_steps=horizon)

    def lr_at(step: int) -> float:
        return 0.1 * (step / 4 if step < 4 else (horizon - step) / (horizon - 4))

    cb = FederatedCallback.__new__(FederatedCallback)  # only the schedule's part: no session
    cb.cfg, cb.trainer = cfg, type("T", (), {"lr_scheduler": sched})()
    for rnd in (1, 4, 2):
        cb._place_schedule(rnd)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at((rnd - 1) * 5))
        opt.step()
        sched.step()  # the Trainer's step: the round's second step gets the next value
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at((rnd - 1) * 5 + 1))
