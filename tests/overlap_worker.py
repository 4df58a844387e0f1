"""Worker for tests/test_overlap.py, run under torchrun (2 ranks, gloo): federation.overlap in the
site trainer. Not a test module itself.

`python -m torch.distributed.run --nproc-per-node=2 tests/overlap_worker.py OUT.npz WORKDIR` runs
every case once per parallelism; rank 0 saves the arrays and replies the test checks into OUT.npz
as `<parallelism>/<case>/<name>` (replies' metrics as JSON under `.../metrics`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from site_trainer import endpoint, handoff
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig
from site_trainer.local_trainer import LocalTrainer
from site_trainer.workloads import initial_weights
from group_exit import leave

DIGITS = WorkloadConfig(task="digits", options={"hidden": 16})


def trainer(strategy: str, workdir: str, socket: str = "/nonexistent", cosine: bool = False) -> LocalTrainer:
    schedule = {"lr_schedule": "cosine", "warmup_steps": 2, "min_lr": 1e-4} if cosine else {}
    site = SiteConfig(id="t", ranks=2, partition=0, batch_size=8, local_steps=4, optimizer="adamw", lr=1e-2,
                      parallelism=strategy, **schedule)
    return LocalTrainer(TrainerConfig(site=site, workload=DIGITS, num_partitions=2, socket=socket, workdir=workdir,
                                      rounds=5 if cosine else None))


def shifted(model: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
    """A stand-in for the coordinator's next global model: the initial one moved by a known amount."""
    return {n: (a + np.float32(0.01 * k) * np.sin(np.arange(a.size, dtype=np.float32)).reshape(a.shape)).astype(
        np.float32) for n, a in model.items()}


class Requests:
    """Collective requests through the session's request path (`serve_one`), as the endpoint serves them."""

    def __init__(self, t: LocalTrainer):
        self.t = t

    def __call__(self, method: str, rnd: int, model: dict[str, np.ndarray], **config) -> dict:
        h = handoff.write_arrays(model, f"overlap-{rnd}") if self.t.rank == 0 else None
        request = {"round": rnd, "config": config, **({"global": h.to_json()} if h else {})}
        try:
            reply = self.t.run_request(method, request)
            if self.t.rank != 0:
                return {}
            assert reply["ok"], reply
            if "update" in reply:
                upd = reply.pop("update")
                reply["arrays"] = {n: np.array(a) for n, a in handoff.map_arrays(handoff.Handle.from_json(upd)).items()}
                handoff.release(upd["path"])
            return reply
        finally:
            if h is not None:
                handoff.release(h.path)


def main(out_path: str, workdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, np.ndarray] = {}
    w1 = initial_weights(DIGITS, 0)

    def keep(key: str, value) -> None:
        if rank != 0:
            return
        if isinstance(value, dict) and all(isinstance(v, np.ndarray) for v in value.values()):
            for n, a in value.items():
                out[f"{key}/{n}"] = a
        else:
            out[key] = np.array(json.dumps(value))

    for strategy in ("ddp", "zero3"):
        p = f"{strategy}/"
        # the fold: θ_start = w2 + (θ_now − θ_1), through an evaluation of w2 in between
        t = trainer(strategy, f"{workdir}/{strategy}-fold")
        ask = Requests(t)
        r1 = ask("Train", 1, w1, overlap=True, update_kind="delta")
        keep(p + "fold/r1_delta", r1.get("arrays", {}))
        keep(p + "fold/theta1", t.full_state())
        keep(p + "fold/taken", [t.session.run_background(3), t.session.run_background(3)])  # budget: 4
        keep(p + "fold/theta_now", t.full_state())
        w2 = shifted(w1, 2)
        ev = ask("Evaluate", 2, w2)
        keep(p + "fold/eval", ev.get("metrics", {}))
        r2 = ask("Train", 2, w2, overlap=True, update_kind="weights", local_steps=4)  # 4 of 4 already taken
        keep(p + "fold/r2_weights", r2.get("arrays", {}))
        keep(p + "fold/r2_metrics", r2.get("metrics", {}))
        # then: 2 background steps, round 3 trains 6 - 2 more; its update is the delta from w3
        keep(p + "cont/taken", [t.session.run_background(2)])
        w3 = shifted(w1, 3)
        r3 = ask("Train", 3, w3, overlap=True, update_kind="delta", local_steps=6)
        keep(p + "cont/r3_delta", r3.get("arrays", {}))
        keep(p + "cont/r3_metrics", r3.get("metrics", {}))
        keep(p + "cont/theta3", t.full_state())
        # stale progress: background steps for round 4, but the next request is round 6: discarded
        keep(p + "stale/taken", [t.session.run_background(3)])
        w6 = shifted(w1, 6)
        r6 = ask("Train", 6, w6, overlap=True, update_kind="weights", local_steps=0)
        keep(p + "stale/r6_weights", r6.get("arrays", {}))
        keep(p + "stale/r6_metrics", r6.get("metrics", {}))
        # a round trained again (the coordinator resumed and reruns round 7): the progress after it is discarded
        w7 = shifted(w1, 7)
        ask("Train", 7, w7, overlap=True, update_kind="delta", local_steps=2)
        keep(p + "rerun/taken", [t.session.run_background(1)])
        r7 = ask("Train", 7, w7, overlap=True, update_kind="weights", local_steps=0)
        keep(p + "rerun/r7_weights", r7.get("arrays", {}))
        keep(p + "rerun/r7_metrics", r7.get("metrics", {}))
        # overlap_max_steps_factor 2.5: background steps go past the round's local_steps (4), up to 10; the
        # learning rate (cosine) of the steps after the 4th stays that of round 2's 4th step
        t = trainer(strategy, f"{workdir}/{strategy}-long", cosine=True)
        ask = Requests(t)
        long = {"overlap": True, "overlap_max_steps_factor": 2.5}
        ask("Train", 1, w1, update_kind="delta", local_steps=4, **long)
        keep(p + "long/theta1", t.full_state())
        taken, lrs, positions = [], [], []
        for _ in range(11):  # one more than the cap
            taken.append(t.session.run_background(1))
            lrs.append(t.optimizer.param_groups[0]["lr"])
            positions.append(t.sched_step)
        keep(p + "long/taken", taken + [t.session.run_background(5)])
        keep(p + "long/lrs", lrs)
        keep(p + "long/positions", positions)
        keep(p + "long/theta_now", t.full_state())
        r2 = ask("Train", 2, shifted(w1, 2), update_kind="weights", local_steps=4, **long)  # 10 taken, 0 more
        keep(p + "long/r2_weights", r2.get("arrays", {}))
        keep(p + "long/r2_metrics", r2.get("metrics", {}))
        # then 7 background steps (of 10 allowed) for a round of 3: it trains none and answers the delta from w3
        keep(p + "long/more", [t.session.run_background(7)])
        keep(p + "long/theta_now3", t.full_state())
        r3 = ask("Train", 3, shifted(w1, 3), update_kind="delta", local_steps=3, **long)
        keep(p + "long/r3_delta", r3.get("arrays", {}))
        keep(p + "long/r3_metrics", r3.get("metrics", {}))
        keep(p + "long/theta3", t.full_state())
        # the cap follows the answered round: 3 x 2.5 -> 7; stale progress past the cap is still discarded
        keep(p + "long/stale", [t.session.run_background(9)])
        r5 = ask("Train", 5, shifted(w1, 5), update_kind="weights", local_steps=1, **long)
        keep(p + "long/r5_metrics", r5.get("metrics", {}))
        # overlap without background steps changes nothing: two trainers, one with overlap, one without
        for case, overlap in (("on", True), ("off", False)):
            t = trainer(strategy, f"{workdir}/{strategy}-{case}")
            ask = Requests(t)
            ask("Train", 1, w1, overlap=overlap, update_kind="delta")
            r = ask("Train", 2, shifted(w1, 2), overlap=overlap, update_kind="weights")
            keep(p + f"plain-{case}/r2_weights", r.get("arrays", {}))
            keep(p + f"plain-{case}/info", {"step_s_estimate": t.session.info().get("step_s_estimate")})
        # the step timed at start-up (round_target_s's figure for round 1) changes nothing a round sees:
        # a trainer built without it answers the same rounds bit for bit
        timed_step = LocalTrainer._time_step
        LocalTrainer._time_step = lambda self: None
        try:
            t = trainer(strategy, f"{workdir}/{strategy}-untimed")
        finally:
            LocalTrainer._time_step = timed_step
        ask = Requests(t)
        ask("Train", 1, w1, overlap=False, update_kind="delta")
        r = ask("Train", 2, shifted(w1, 2), overlap=False, update_kind="weights")
        keep(p + "untimed/r2_weights", r.get("arrays", {}))
        keep(p + "untimed/info", {"step_s_estimate": t.session.info().get("step_s_estimate")})

    # the served loop: background steps between requests through the endpoint (ddp)
    socket = f"{workdir}/served.sock"
    t = trainer("ddp", f"{workdir}/served", socket)
    if rank == 0:
        replies: list = []
        thread = threading.Thread(target=client, args=(socket, w1, replies, Path(workdir)))
        thread.start()
    t.serve()
    if rank == 0:
        thread.join()
        for i, reply in enumerate(replies):
            keep(f"served/r{i + 1}_metrics", reply)
        np.savez(out_path, **out)
    leave()  # group_exit.py


def client(socket: str, w1: dict, replies: list, workdir: Path) -> None:
    """Rank 0's other thread, as the ClientApp: round 1, wait until the ranks took their whole
    background budget (Info), round 2, stop."""
    try:
        while not Path(socket + ".ready").exists():
            time.sleep(0.05)
        # round 2 answers with overlap_max_steps_factor 2: the ranks then take 8 background steps, not 4
        budgets = {1: 4, 2: 8}
        for rnd, model in ((1, w1), (2, shifted(w1, 2)), (3, shifted(w1, 3))):
            h = handoff.write_arrays(model, f"served-{rnd}")
            config = {"overlap": True, "update_kind": "delta", **({"overlap_max_steps_factor": 2.0} if rnd == 2 else {})}
            reply = endpoint.call(socket, "Train", {"round": rnd, "global": h.to_json(), "timeout_s": 120,
                                                   "config": config}, timeout_s=120)
            handoff.release(h.path)
            handoff.release(reply["update"]["path"])
            replies.append(reply["metrics"])
            while rnd in budgets:
                info = endpoint.call(socket, "Info", {}, timeout_s=30)
                if info["background_steps"] == info["background_budget"] == budgets[rnd]:
                    time.sleep(0.3)  # the ranks are idle now: the cap holds (the reply says how many were taken)
                    break
                time.sleep(0.05)
    finally:
        endpoint.call(socket, "Stop", {}, timeout_s=30)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
