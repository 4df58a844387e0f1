"""The trainer service under ZeRO as real processes: crash and resume from a sharded local
checkpoint, and a multi-node site (2 nodes x 1 rank, torchrun c10d rendezvous on loopback)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import numpy as np

from federation.ops.launcher import OWNER, Supervisor, free_port, marked_pids, wait_trainers
from site_trainer import endpoint, handoff, workloads
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig
from site_trainer.launch import torchrun_argv

SLM = WorkloadConfig(task="slm", options={"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16,
                                          "corpus_bytes_per_site": 20_000})
ENV = {"OMP_NUM_THREADS": "1"}


def _config(tmp: Path, name: str, wl: WorkloadConfig, **site) -> tuple[TrainerConfig, Path]:
    s = {"id": name, "ranks": 2, "partition": 0, "local_steps": 3, "batch_size": 4, "grad_accum": 2, **site}
    cfg = TrainerConfig(site=SiteConfig(**s), workload=wl, num_partitions=2, socket=str(tmp / f"{name}.sock"),
                        workdir=str(tmp / name))
    Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
    path = Path(cfg.workdir) / "trainer.json"
    path.write_text(cfg.model_dump_json())
    return cfg, path


def _call(cfg: TrainerConfig, method: str, arrays: dict, **extra) -> dict:
    h = handoff.write_arrays(arrays, "test")
    try:
        return endpoint.call(cfg.socket, method, {"global": h.to_json(), "timeout_s": 120, **extra}, timeout_s=120)
    finally:
        handoff.release(h.path)


def _take(handle: dict) -> dict[str, np.ndarray]:
    h = handoff.Handle.from_json(handle)
    try:
        return {k: np.array(v) for k, v in handoff.map_arrays(h).items()}
    finally:
        handoff.release(h.path)


def _put_state(cfg: TrainerConfig, state: dict) -> None:
    h = handoff.write_arrays(state, "state")
    try:
        assert endpoint.call(cfg.socket, "PutState", {"state": h.to_json()}, timeout_s=30)["ok"]
    finally:
        handoff.release(h.path)


def _wait_checkpoint(cfg: TrainerConfig, round_no: int, timeout: float = 60) -> Path:
    latest = Path(cfg.workdir) / "checkpoints" / "latest"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError):
            name = latest.read_text().strip()
            if name.startswith(f"round_{round_no:06d}"):
                return latest.parent / name
        time.sleep(0.1)
    raise AssertionError(f"no local checkpoint of round {round_no} within {timeout}s")


def test_killed_site_resumes_bit_identically_from_local_checkpoint(tmp_path):
    """Round 1, checkpoint, SIGKILL of every rank, restart, round 2: the same weights, bit for bit,
    as a site that was never interrupted; optimizer (AdamW moments), sampling streams and the
    site-private state (codec residuals) all came back."""
    site = {"parallelism": "zero3", "optimizer": "adamw", "lr": 1e-2, "checkpoint_every": 1}
    cfg_a, path_a = _config(tmp_path, "steady", SLM, **site)
    cfg_b, path_b = _config(tmp_path, "crashy", SLM, **site)
    init = workloads.initial_weights(SLM, 0)
    residual1 = {"residual": np.linspace(0, 1, 7, dtype=np.float32)}
    sup_a, sup_b = Supervisor(tmp_path / "a"), Supervisor(tmp_path / "b")
    try:
        procs = {"steady": sup_a.start("t", torchrun_argv(cfg_a.site, str(path_a)), ENV),
                 "crashy": sup_b.start("t", torchrun_argv(cfg_b.site, str(path_b)), ENV)}
        wait_trainers(procs, {"steady": cfg_a.socket, "crashy": cfg_b.socket}, 180, lambda _: None)
        firsts = {}
        for cfg in (cfg_a, cfg_b):
            r1 = _call(cfg, "Train", init, round=1, with_state=True, config={"update_kind": "weights"})
            firsts[cfg.site.id] = _take(r1["update"])
            _put_state(cfg, residual1)  # what the relay does after encoding with the residuals
        for k in init:
            np.testing.assert_array_equal(firsts["steady"][k], firsts["crashy"][k])
        w1 = firsts["steady"]
        ckpt = _wait_checkpoint(cfg_b, 1)
        assert sorted(p.name for p in ckpt.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]
        for pid in marked_pids(sup_b.owner, OWNER):  # the crash: no rank gets to clean up
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        sup_b.procs[0].popen.wait(timeout=30)
        sup_b.procs.clear()
        Path(cfg_b.socket + ".ready").unlink()
        proc = sup_b.start("t2", torchrun_argv(cfg_b.site, str(path_b)), ENV)
        wait_trainers({"crashy": proc}, {"crashy": cfg_b.socket}, 180, lambda _: None)
        assert "resumed from local checkpoint" in proc.log.read_text()
        seconds = {}
        for cfg in (cfg_a, cfg_b):
            r2 = _call(cfg, "Train", w1, round=2, with_state=True, config={"update_kind": "weights"})
            seconds[cfg.site.id] = (_take(r2["update"]), _take(r2["state"]), r2["rank_digests"])
        (wa, _, da), (wb, sb, db) = seconds["steady"], seconds["crashy"]
        for k in init:
            np.testing.assert_array_equal(wa[k], wb[k])
        assert max(float(np.abs(wa[k] - w1[k]).max()) for k in init) > 0  # round 2 trained
        np.testing.assert_array_equal(sb["residual"], residual1["residual"])
        assert da == db and len(set(da)) == 1
    finally:
        sup_a.close()
        sup_b.close()


def test_two_node_site_over_c10d_rendezvous(tmp_path):
    """Two torchrun 'nodes' of one rank each, joined by c10d rendezvous on loopback: node 0 serves
    the endpoint (whatever order the nodes joined in), both ranks train under ZeRO-2."""
    port = free_port()
    cfg, path = _config(tmp_path, "mn", SLM, ranks=1, nnodes=2,
                        rdzv_endpoint=f"127.0.0.1:{port}", parallelism="zero2")
    sup = Supervisor(tmp_path)
    try:
        node1 = sup.start("node1", torchrun_argv(cfg.site, str(path), node_rank=1), ENV)  # joins first
        time.sleep(1.0)
        node0 = sup.start("node0", torchrun_argv(cfg.site, str(path), node_rank=0), ENV)
        wait_trainers({"mn": node0}, {"mn": cfg.socket}, 180, lambda _: None)
        assert node1.alive()
        init = workloads.initial_weights(cfg.workload, 0)
        reply = _call(cfg, "Train", init, round=1, config={"update_kind": "delta"})
        delta = _take(reply["update"])
        assert all(float(np.abs(d).max()) > 0 for d in delta.values())
        assert len(reply["rank_digests"]) == 2 and len(set(reply["rank_digests"])) == 1
        assert reply["metrics"]["samples_seen"] == 3 * 2 * 4 * 2  # steps x accum x batch x ranks
        assert endpoint.call(cfg.socket, "Info", {}, timeout_s=10)["ranks"] == 2
        assert "trainer ready with 2 rank(s)" in node0.log.read_text()
        assert "trainer ready" not in node1.log.read_text()
    finally:
        sup.close()
