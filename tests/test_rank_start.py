"""What a trainer rank costs to start: a one-rank site runs without torchrun's agent (a torch
import, ~1.5 s of CPU), and a digits rank reads its images without importing sklearn and scipy
(~0.9 s). (torch's optimizers import torch._dynamo, ~1 s, in every rank: not ours to avoid.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from conftest import ROOT
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig
from site_trainer.launch import trainer_argv
from site_trainer.tasks import digits

# Modules a digits rank has no use for: ~0.9 s of CPU per rank to import.
UNUSED = ("sklearn", "scipy")

RANK = textwrap.dedent("""
    import json, os, sys, threading, time
    from pathlib import Path
    from site_trainer import endpoint, handoff, service, workloads
    from site_trainer.config import TrainerConfig

    cfg = TrainerConfig.model_validate_json(Path(sys.argv[1]).read_text())
    out = {}

    def client():
        end = time.monotonic() + 120
        while not os.path.exists(cfg.socket + ".ready") and time.monotonic() < end:
            time.sleep(0.05)
        h = handoff.write_arrays(workloads.initial_weights(cfg.workload, 0), "test")
        try:
            reply = endpoint.call(cfg.socket, "Train", {"global": h.to_json(), "timeout_s": 60}, timeout_s=60)
            out["ok"], out["examples"] = reply["ok"], reply["num_examples"]
            handoff.release(handoff.Handle.from_json(reply["update"]).path)
        finally:
            handoff.release(h.path)
            out["loaded"] = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
            endpoint.call(cfg.socket, "Stop", {}, timeout_s=10)

    threading.Thread(target=client, daemon=True).start()
    service.standalone_env(cfg)
    service.run(cfg)
    print(json.dumps(out))
""")


def test_digits_arrays_are_sklearns_without_importing_it(monkeypatch):
    from sklearn.datasets import load_digits

    want_x, want_y = load_digits(return_X_y=True)
    assert digits.bundled_digits_csv() is not None
    for found in (digits.bundled_digits_csv, lambda: None):  # the bundled file, and sklearn's loader
        monkeypatch.setattr(digits, "bundled_digits_csv", found)
        x, y = digits.load_digits_arrays()
        assert np.array_equal(x, want_x) and np.array_equal(y, want_y) and y.dtype == want_y.dtype


def test_one_rank_site_trains_without_torchrun_and_without_unused_imports(tmp_path):
    cfg = TrainerConfig(site=SiteConfig(id="s", ranks=1, partition=0, local_steps=2, batch_size=8),
                        workload=WorkloadConfig(task="digits", options={"hidden": 8}), num_partitions=2,
                        socket=str(tmp_path / "s.sock"), workdir=str(tmp_path / "s"))
    path = tmp_path / "trainer.json"
    path.write_text(cfg.model_dump_json())
    assert "torch.distributed.run" not in trainer_argv(cfg.site, str(path))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RANK, str(path), json.dumps(UNUSED)], capture_output=True,
                          text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["examples"] > 0
    assert out["loaded"] == [], f"a digits rank imported {out['loaded']}: import them where they are used"


def test_standalone_env_is_set_only_for_a_one_rank_site_outside_torchrun(monkeypatch):
    from site_trainer import service

    two = TrainerConfig(site=SiteConfig(id="s", ranks=2, partition=0), workload=WorkloadConfig(task="digits"),
                        num_partitions=1, socket="/tmp/x.sock", workdir="/tmp/x")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    service.standalone_env(two)  # a two-rank site started without torchrun: nothing is made up
    assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
    one = two.model_copy(update={"site": SiteConfig(id="s", ranks=1, partition=0)})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29555")
    service.standalone_env(one)  # under torchrun (RANK set): torchrun's values stay
    assert os.environ["MASTER_PORT"] == "29555" and "MASTER_ADDR" not in os.environ
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("MASTER_PORT")
    service.standalone_env(one)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("0", "1", "0")
