"""FSDP through the Trainer callback: a Trainer script whose TrainingArguments ask for FSDP2
(`fsdp="full_shard auto_wrap"`, `fsdp_config.fsdp_version=2`: Trainer's own accelerate integration)
runs as a site under torchrun and is driven over the site's socket as the coordinator's relay drives it.

- On GPUs (nccl, up to 2 ranks): accelerate shards the model (its parameters become DTensors) and the
  session loads the global adapters into the shards and gathers the whole update.
- On CPU (2 gloo ranks; what `make test` runs): accelerate does not shard. It chooses FSDP only for
  accelerator types (`DistributedType.FSDP` is set for MULTI_GPU/XPU/NPU/... alone, accelerate/state.py),
  so gloo ranks run DDP (MULTI_CPU). The callback says so in the site's log, and the rounds are right.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT
from hf_models import compliance_data, tiny_llama
from trainer_calls import call, far_from, update_of
from site_trainer import endpoint, workloads
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig

pytestmark = pytest.mark.slow(seconds=60)

GPUS = torch.cuda.device_count()
RANKS = min(2, GPUS) if GPUS else 2
SCRIPT = Path(__file__).resolve().parent / "hf_fsdp_script.py"


def test_trainer_fsdp_request_through_the_callback(tmp_path):
    base = tiny_llama(tmp_path / "base", chat=True)
    compliance_data().write_site(tmp_path / "chats" / "s", 0, rows=60)
    wl = WorkloadConfig(task="hf-causal-lm", options={
        "model_dir": str(base), "format": "chat", "data": str(tmp_path / "chats" / "{site}" / "train.jsonl"),
        "val_data": str(tmp_path / "chats" / "{site}" / "val.jsonl"), "seq_len": 256,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0}})
    site = SiteConfig(id="s", ranks=RANKS, partition=0, local_steps=2, batch_size=2, lr=0.01, script=str(SCRIPT),
                      backend="nccl" if GPUS else "gloo", pii={"enabled": False})  # synthetic rows: nothing to scrub
    cfg = TrainerConfig(site=site, workload=wl, num_partitions=1, rounds=2, socket=str(tmp_path / "s.sock"),
                        workdir=str(tmp_path / "s"))
    path = tmp_path / "trainer.json"
    path.write_text(cfg.model_dump_json())
    log = tmp_path / "trainer.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                                                 os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc-per-node={RANKS}", "-m", "site_trainer", "--config", str(path)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # a start-up limit, not a measurement
        while not Path(cfg.socket).exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        info = endpoint.call(cfg.socket, "Info", {}, timeout_s=120)
        assert info["manifest"] == workloads.manifest(wl, 0) and info["ranks"] == RANKS

        far = far_from(workloads.initial_weights(wl, 0))
        r1 = call(cfg, "Train", far, round=1, config={"update_kind": "weights"})
        assert r1["ok"], r1
        w1 = update_of(r1)
        assert set(w1) == set(far) and all(w1[k].shape == far[k].shape for k in far)  # whole tensors, not shards
        assert 0 < max(np.abs(w1[k] - far[k]).max() for k in far) < 0.1  # trained from the global it was sent
        assert len(set(r1["rank_digests"])) == 1 and r1["metrics"]["steps"] == 2
        ev = call(cfg, "Evaluate", w1, round=1)
        assert ev["ok"] and np.isfinite(ev["metrics"]["eval_loss"])
        assert endpoint.call(cfg.socket, "Stop", {}, timeout_s=10)["stopping"]
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    text = log.read_text()
    # one line per rank, but the ranks share the output: two lines may arrive joined
    ended = re.findall(r"rank \d+: federation ended; .*?dtensor=(?:True|False)", text)
    assert len(ended) == RANKS, text[-4000:]
    if GPUS:  # sharded by accelerate's FSDP2
        assert all("fsdp_enabled=True" in x and "distributed_type=FSDP" in x and "dtensor=True" in x for x in ended)
    else:  # accelerate's CPU ranks: DDP, and the site's log says why
        assert all("fsdp_enabled=False" in x and "distributed_type=MULTI_CPU" in x and "dtensor=False" in x
                   for x in ended), ended
        assert "TrainingArguments.fsdp is set but accelerate runs MULTI_CPU, not FSDP" in text
