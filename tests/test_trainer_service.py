"""The site trainer service on its own: torchrun, 2 ranks, driven over its Unix socket."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from federation.ops.launcher import Supervisor, wait_trainers
from trainer_calls import call, update_of
from site_trainer import endpoint, workloads
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc")
    wl = WorkloadConfig(task="digits", options={"hidden": 16})
    cfg = TrainerConfig(site=SiteConfig(id="s", ranks=2, partition=0, local_steps=3, batch_size=8, grad_accum=2),
                        workload=wl, num_partitions=2, socket=str(tmp / "s.sock"), workdir=str(tmp / "s"))
    path = tmp / "trainer.json"
    path.write_text(cfg.model_dump_json())
    sup = Supervisor(tmp)
    proc = sup.start("trainer", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 "-m", "site_trainer", "--config", str(path)], {"OMP_NUM_THREADS": "1"})
    try:
        wait_trainers({"s": proc}, {"s": cfg.socket}, 120, lambda _: None)
        yield cfg, workloads.initial_weights(wl, 0), proc
    finally:
        sup.close()






def _export(cfg) -> dict[str, np.ndarray]:
    reply = endpoint.call(cfg.socket, "Export", {"timeout_s": 60}, timeout_s=60)
    return update_of({"update": reply["model"]})  # copied out, the file unlinked


def test_export_shows_the_model_the_trainer_holds(service):
    """`Export` (every rank streams its part): before any round, the model the trainer built, bit for
    bit the coordinator's starting model (same workload, same seed: round 1 need not send it); after a
    round, the weights it trained to."""
    cfg, init, _ = service
    first = _export(cfg)
    assert list(first) == list(init) and all(first[k].dtype == init[k].dtype for k in init)
    assert all(np.array_equal(first[k], init[k]) for k in init)
    w = update_of(call(cfg, "Train", init, round=1, config={"update_kind": "weights"}, timeout_s=60))
    after = _export(cfg)
    assert all(np.array_equal(after[k], w[k]) for k in init) and any(not np.array_equal(w[k], init[k]) for k in init)


def test_train_returns_a_real_delta_and_ranks_agree(service):
    cfg, init, _ = service
    reply = call(cfg, "Train", init, round=1, config={"update_kind": "delta"}, timeout_s=60)
    delta = update_of(reply)
    assert set(delta) == set(init)
    assert all(float(np.abs(d).max()) > 0 for d in delta.values())  # every tensor moved
    assert len(reply["rank_digests"]) == 2 and len(set(reply["rank_digests"])) == 1
    m = reply["metrics"]
    assert m["steps"] == 3 and m["samples_seen"] == 3 * 2 * 8 * 2  # steps x accum x batch x ranks
    assert reply["num_examples"] > 0 and np.isfinite(m["loss"])


def test_weights_update_kind_returns_trained_weights(service):
    cfg, init, _ = service
    w = update_of(call(cfg, "Train", init, round=2, config={"update_kind": "weights"}, timeout_s=60))
    assert any(not np.allclose(w[k], init[k]) for k in init)
    # weights, not a delta: a few small steps leave them near where they started, whereas a delta
    # (near zero) would be about the whole model away from the global weights
    moved = np.sqrt(sum(float(((w[k] - init[k]) ** 2).sum()) for k in init))
    size = np.sqrt(sum(float((init[k] ** 2).sum()) for k in init))
    assert 0 < moved < 0.5 * size, (moved, size)


@pytest.mark.parametrize("mutate,needle", [
    (lambda a: {k: v for k, v in list(a.items())[1:]}, "does not match"),
    (lambda a: {k: (v[:1] if i == 0 else v) for i, (k, v) in enumerate(a.items())}, "expected"),
    (lambda a: {k: v.astype(np.float64) for k, v in a.items()}, "expected"),
    (lambda a: {k: np.full_like(v, np.nan) for k, v in a.items()}, "NaN"),
])
def test_bad_global_model_is_refused_and_service_survives(service, mutate, needle):
    cfg, init, _ = service
    with pytest.raises(endpoint.TrainerError, match=needle):
        call(cfg, "Train", mutate(init), round=3, timeout_s=60)
    assert call(cfg, "Evaluate", init, timeout_s=60)["ok"]  # still serving


def test_info_reports_the_manifest_the_coordinator_expects(service):
    cfg, init, _ = service
    info = endpoint.call(cfg.socket, "Info", {}, timeout_s=10)
    assert info["manifest"] == workloads.manifest(cfg.workload, 0)
    assert [n for n, *_ in info["manifest"]["exchanged"]] == list(init)
    assert info["parallelism"] == "ddp" and info["workload"] == "digits" and info["ranks"] == 2


def test_stop_ends_every_rank_cleanly(service):
    """Last in this module: Stop (like SIGTERM) ends the loop on every rank between rounds; the
    trainer exits 0 and leaves neither its socket nor hand-off files behind."""
    cfg, init, proc = service
    left = Path(call(cfg, "Train", init, round=9, timeout_s=60)["update"]["path"])  # the trainer releases it later
    assert left.exists()
    assert endpoint.call(cfg.socket, "Stop", {}, timeout_s=10)["stopping"]
    assert proc.popen.wait(timeout=60) == 0
    assert not Path(cfg.socket).exists() and not Path(cfg.socket + ".ready").exists()
    assert not left.exists()
