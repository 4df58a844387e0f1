"""Flower's FedAvg as shipped (train, then evaluate, every round) over a minimal NumPy ClientApp.

The ServerApp times each round from the moment FedAvg configures training to the moment it has
aggregated the evaluation, and takes each reply's own `work_s` (the ClientApp's time in its
handler), so benchmarks/round_latency.py can subtract the slowest site's work from the round.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

client = ClientApp()
server = ServerApp()


def _reply(msg: Message, arrays: ArrayRecord | None, t0: float, **metrics: float) -> Message:
    content = RecordDict({"metrics": MetricRecord({"num-examples": 100, **metrics,
                                                   "work_s": time.perf_counter() - t0})})
    if arrays is not None:
        content["arrays"] = arrays
    return Message(content, reply_to=msg)


@client.train()
def train(msg: Message, context: Context) -> Message:
    t0 = time.perf_counter()
    arrays = msg.content["arrays"]
    new = {k: Array(v.numpy() + np.float32(1e-3)) for k, v in arrays.items()}
    return _reply(msg, ArrayRecord(new), t0, train_loss=0.0)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    t0 = time.perf_counter()
    total = sum(float(np.abs(v.numpy()).sum()) for v in msg.content["arrays"].values())
    return _reply(msg, None, t0, eval_loss=total)


class TimedFedAvg(FedAvg):
    """FedAvg unchanged, with the round's wall time and the slowest reply's work recorded."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.rounds: dict[int, dict] = {}

    def configure_train(self, server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
        self.rounds[server_round] = {"start": time.monotonic()}
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):  # type: ignore[no-untyped-def]
        replies = list(replies)
        self.rounds[server_round]["train_s"] = time.monotonic() - self.rounds[server_round]["start"]
        self.rounds[server_round]["train_work_s"] = _slowest(replies)
        self.rounds[server_round]["train_replies"] = len(replies)
        return super().aggregate_train(server_round, replies)

    def aggregate_evaluate(self, server_round, replies):  # type: ignore[no-untyped-def]
        replies = list(replies)
        out = super().aggregate_evaluate(server_round, replies)
        r = self.rounds[server_round]
        r.update(eval_work_s=_slowest(replies), eval_replies=len(replies), round_s=time.monotonic() - r.pop("start"))
        return out


def _slowest(replies: list[Message]) -> float:
    return max((float(m.content["metrics"]["work_s"]) for m in replies if m.has_content()), default=0.0)


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    shapes = json.loads(str(cfg["shapes"]))
    n = int(cfg["sites"])
    # random weights when bytes matter: Flower stores 5 MiB chunks by content, so a zero model would
    # travel as one chunk (benchmarks/large_update.py)
    rng = np.random.default_rng(0) if int(cfg.get("random-init", 0)) else None
    initial = ArrayRecord({f"p{i}": Array(rng.standard_normal(s, dtype=np.float32) if rng else np.zeros(s, np.float32))
                           for i, s in enumerate(shapes)})
    strategy = TimedFedAvg(min_train_nodes=n, min_evaluate_nodes=n, min_available_nodes=n)
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=int(cfg["rounds"]),
                   timeout=float(cfg.get("timeout", 120)))
    part = f"{cfg['out']}.part"  # renamed when whole: the benchmark reads the file as soon as it exists
    with open(part, "w") as f:
        json.dump({"rounds": strategy.rounds}, f)
    os.replace(part, str(cfg["out"]))
