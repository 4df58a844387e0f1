"""Round latency on a real loopback deployment: Flower's own FedAvg against ours, all protections on.

Both sides run on the same kind of deployment, started by the same launcher code
(federation/ops/launcher.py): a real `flower-superlink` (TLS with the provisioned coordinator
certificate, SuperNode authentication, runtime dependency installation off) and one real
`flower-supernode` per site (TLS, provisioned auth key), on loopback, in one run of this script:

- ours: `sovfl simulate` on a digits config with SecAgg+ (ring auto-chosen), attested admission
  (dev issuer) and evaluation on; each site's trainer is a real torchrun process;
- Flower: `flwr run` of benchmarks/flower_fedavg_app (flwr.serverapp.strategy.FedAvg as shipped,
  which trains then evaluates every round, and a minimal NumPy ClientApp), on the same number of
  sites and the same parameter shapes (read from our run's checkpoint).

Overhead per round = round wall time (the coordinator's own clock) minus the slowest site's local
work (ours: the trainer calls, from the metrics line's `timing.site_work_s`; Flower: the
ClientApp handler's time, slowest train reply plus slowest evaluate reply). Round trips per site
per round come from our coordinator's message count (`messages` in the metrics lines), rounds 2
onwards (round 1 also carries site discovery). The first round of each side warms caches and is
kept in the medians (both sides pay it).

    .venv/bin/python benchmarks/round_latency.py [--rounds 5] [--sites 3] [--hidden 64] [--warm-clientapps N]

Flower's side always runs Flower's own executor (a fresh `flwr-clientapp` per message) and its
SuperNodes as Flower ships them (a 3 s sleep after an empty pull, a 0.5 s reply check: flwr has no
setting for either); ours runs the warm ClientApp executor (federation.warm_clientapps), or
Flower's with `--warm-clientapps 0`, and its SuperNodes through federation/ops/supernode_main.py
(federation.supernode_polls: the sleep short after each reply, the reply check at 0.05 s).

Our messages are also split into their parts (federation/protocol/message_cost.py: launch,
startup with our own imports, handler, return), median over every site's message of rounds 2+.

Last line: `RESULT ours_overhead_s=<median> flower_overhead_s=<median> overhead_ratio=<ours/flower>
round_trips=<per site per round> msg_total_s=.. msg_launch_s=.. msg_startup_s=.. msg_app_import_s=..
msg_handler_s=.. msg_return_s=..` (the msg_ fields with the message split only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._flower_deployment import run_anchor  # noqa: E402
from federation.coordinator.checkpoint import load_checkpoint  # noqa: E402
from federation.config.schema import load_config  # noqa: E402
from federation.ops import launcher  # noqa: E402

ANCHOR_APP = Path(__file__).parent / "flower_fedavg_app"


def our_config(path: Path, sites: int, rounds: int, hidden: int, local_steps: int,
               warm_clientapps: int | None = None) -> Path:
    cfg = {
        "federation": {
            **({} if warm_clientapps is None else {"warm_clientapps": warm_clientapps}),
            "name": "round-latency", "rounds": rounds, "quorum": max(2, sites - 1), "update_kind": "delta",
            "evaluate": True,
            "deadlines": {"connect_s": 120, "round_s": 120, "evaluate_s": 120, "secagg_stage_s": 60,
                          "trainer_start_s": 300},
            "secagg": {"enabled": True, "threshold": 2, "clip": 0.5},
            "attestation": {"enabled": True, "dev_issuer": True},
        },
        "workload": {"task": "digits", "options": {"hidden": hidden}},
        "sites": [{"id": f"site{i}", "ranks": 1, "partition": i, "local_steps": local_steps, "batch_size": 16,
                   "lr": 0.1} for i in range(sites)],
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_ours(workdir: Path, config: Path) -> list[dict]:
    """Our federation through `sovfl simulate`'s code; its metrics lines."""
    launcher.simulate(config, workdir / "ours", progress=lambda line: print(f"  [ours] {line}", flush=True))
    return [json.loads(x) for x in (workdir / "ours" / "metrics.jsonl").read_text().splitlines() if x.strip()]


def model_shapes(workdir: Path) -> list[list[int]]:
    _, model, _ = load_checkpoint(workdir / "ours" / "checkpoints")  # the newest good checkpoint
    return [list(model[k].shape) for k in sorted(model)]


def run_flower(workdir: Path, config: Path, shapes: list[list[int]], rounds: int, database: bool = True,
               timeout_s: float = 120, random_init: bool = False) -> dict:
    """Flower's FedAvg on a deployment started like ours (TLS, SuperNode auth, same flags; the
    SuperLink's state in memory without `database`); each stage waits up to `timeout_s`."""
    shapes_text = json.dumps(shapes, separators=(",", ":"))  # no spaces: --run-config splits on them
    cfg = load_config(config)
    run_config = (f'shapes="{shapes_text}" rounds={rounds} sites={len(cfg.sites)} timeout={timeout_s:g} '
                  f"random-init={int(random_init)}")
    return run_anchor(workdir, ANCHOR_APP, list(cfg.sites), run_config, 120 + rounds * 3 * timeout_s,
                      database=database)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=2048,
                    help="digits MLP hidden width: 2048 gives 153k parameters, about `make demo`'s model")
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--warm-clientapps", type=int, default=None,
                    help="our sites' warm ClientApp workers (default: the config's default; 0: Flower's executor)")
    args = ap.parse_args()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="round-latency-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = our_config(workdir / "ours.yaml", args.sites, args.rounds, args.hidden, args.local_steps,
                        args.warm_clientapps)

    t0 = time.monotonic()
    lines = run_ours(workdir, config)
    ours_wall = time.monotonic() - t0
    shapes = model_shapes(workdir)
    n_params = sum(int(np.prod(s)) for s in shapes)
    t0 = time.monotonic()
    flower = run_flower(workdir, config, shapes, args.rounds)
    flower_wall = time.monotonic() - t0

    print(f"# {args.sites} sites, {n_params:,} float32 parameters, {args.rounds} rounds each; workdir {workdir}")
    print(f"# ours: SecAgg+ (ring auto), attested admission (dev issuer), evaluation on; run {ours_wall:.0f}s")
    print(f"# flower: flwr.serverapp.strategy.FedAvg (train + evaluate per round), NumPy ClientApp; run {flower_wall:.0f}s")
    print(f"{'round':>5} {'ours round_s':>12} {'work_s':>7} {'overhead':>8} {'msgs/site':>9}   "
          f"{'flower round_s':>14} {'work_s':>7} {'overhead':>8}")
    ours_over, flower_over, trips = [], [], []
    prev: dict[str, int] = {}
    for line in lines:
        rnd = line["round"]
        t = line.get("timing", {})
        over = line["round_s"] - t.get("site_work_s", 0.0)
        ours_over.append(over)
        msgs = line.get("messages", {})
        if rnd == args.rounds and "final_eval_stage" in line:  # the run's last line adds the final evaluation
            msgs = {k: v - 1 for k, v in msgs.items()}
        per_site = [v - prev.get(k, 0) for k, v in msgs.items()]
        prev = dict(msgs)
        if rnd > 1:
            trips.extend(per_site)
        f = flower["rounds"].get(str(rnd), {})
        f_work = f.get("train_work_s", 0.0) + f.get("eval_work_s", 0.0)
        f_over = f.get("round_s", float("nan")) - f_work
        flower_over.append(f_over)
        print(f"{rnd:5d} {line['round_s']:12.2f} {t.get('site_work_s', 0.0):7.2f} {over:8.2f} "
              f"{max(per_site, default=0):9d}   {f.get('round_s', float('nan')):14.2f} {f_work:7.2f} {f_over:8.2f}")
    stages = lines[-1].get("timing", {}).get("stages", [])
    if stages:
        print("# our last round, per stage: " + "; ".join(
            f"{s['stage']}: {s['seconds']:.2f}s (push {s.get('push_s', 0):.2f}, wait {s.get('wait_s', 0):.2f}, "
            f"slowest reply {s.get('slowest_reply_s', 0):.2f})" for s in stages))
    cost = message_parts(lines)
    if cost:
        print("# ours per message, rounds 2+, median over sites and stages (federation/protocol/message_cost.py): "
              + ", ".join(f"{k} {v:.2f}s" for k, v in cost.items()))
    ours_med, flower_med = statistics.median(ours_over), statistics.median(flower_over)
    round_trips = max(trips, default=0)
    print(f"RESULT ours_overhead_s={ours_med:.2f} flower_overhead_s={flower_med:.2f} "
          f"overhead_ratio={ours_med / flower_med:.2f} round_trips={round_trips} "
          + " ".join(f"msg_{k}={v:.2f}" for k, v in cost.items()))


def message_parts(lines: list[dict]) -> dict[str, float]:
    """The median of each part of our messages' seconds over every site's message of rounds 2+."""
    parts: dict[str, list[float]] = {}
    for line in lines:
        if line["round"] < 2:
            continue
        for stage in line.get("timing", {}).get("stages", []):
            for c in (stage.get("messages") or {}).values():
                for k, v in c.items():
                    parts.setdefault(k, []).append(v)
    order = ("total_s", "launch_s", "startup_s", "app_import_s", "handler_s", "return_s")
    return {k: statistics.median(parts[k]) for k in order if parts.get(k)}


if __name__ == "__main__":
    main()
