"""What experiment tracking costs a round: the same short digits federation (`sovfl simulate`'s
code path, real processes) with tracking off and with TensorBoard, MLflow (local SQLite) and W&B
(offline) on at the coordinator and at every site, interleaved off/on so that machine load hits
both alike.

Round time: the median of metrics.jsonl's `round_s` over the rounds after the first (the first
holds the trainers' and trackers' start-up). Site train time: the median of the sites' `train_call_s`
(their training loops, where the per-step tracking runs). Also the cost on the training path
itself, measured in-process and free of the federation's noise: the coordinator's per-line cost
(flatten + queue) and a site's per-step cost (`StepTracking.step`, flushes included), both with
all three trackers behind their queues, measured once the trackers have started.

Last line: RESULT round_time_ratio=<on/off> train_time_ratio=<on/off> coordinator_us_per_round=<us>
site_us_per_step=<us>   (target: round_time_ratio <= 1.02)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from federation.ops import launcher  # noqa: E402
from site_trainer.config import TrainerConfig  # noqa: E402
from site_trainer.step_tracking import step_tracking  # noqa: E402
from tracking.config import TrackingConfig  # noqa: E402
from tracking.flatten import flat_metrics  # noqa: E402
from tracking.tracker import RunInfo  # noqa: E402
from tracking.writer import open_session  # noqa: E402

BACKENDS = [{"kind": "tensorboard"}, {"kind": "mlflow"}, {"kind": "wandb"}]
STARTUP_S = 10.0  # the in-process measures start once the trackers have imported their libraries and opened


def config(path: Path, rounds: int, steps: int, tracking: bool, process: bool) -> Path:
    track = {"tracking": {"backends": BACKENDS, "process": process}} if tracking else {}
    sites = [{"id": name, "partition": i, "local_steps": steps, "batch_size": 16, "lr": 0.1, **track}
             for i, name in enumerate(["paris", "frankfurt"])]
    path.write_text(yaml.safe_dump({
        "federation": {"name": "tracking-cost", "rounds": rounds, "quorum": 2,
                       "deadlines": {"connect_s": 180, "round_s": 180, "trainer_start_s": 300}, **track},
        "workload": {"task": "digits", "options": {"hidden": 32}}, "sites": sites}))
    return path


def federation(tmp: Path, name: str, rounds: int, steps: int, tracking: bool, process: bool) -> tuple[float, float]:
    """One run: (median round_s, median site train_call_s) over the rounds after the first."""
    run = tmp / name
    result = launcher.simulate(config(tmp / f"{name}.yaml", rounds, steps, tracking, process), run, lambda line: None,
                               insecure=True)
    if result.get("status") != "ok":
        raise SystemExit(f"{name}: the federation failed: {result}")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1:]
    return (statistics.median(x["round_s"] for x in lines),
            statistics.median(s["train_call_s"] for x in lines for s in x["sites"].values()))


def coordinator_cost(tmp: Path, line: dict, n: int, process: bool) -> float:
    """Microseconds per metrics line on the coordinator's side of the queue."""
    session = open_session(TrackingConfig(backends=BACKENDS, queue_records=n + 10, close_timeout_s=600, process=process),
                           RunInfo("coordinator", tmp, "b"))
    time.sleep(STARTUP_S)
    t0 = time.perf_counter()
    for rnd in range(1, n + 1):
        session.metrics(flat_metrics(line), rnd)
    took = time.perf_counter() - t0
    if any(session.close().values()):  # every record written: the figure is of a tracker that kept up
        raise SystemExit("the coordinator's trackers dropped records in the measure")
    return took / n * 1e6


def site_cost(tmp: Path, n: int, process: bool) -> float:
    """Microseconds per optimizer step that StepTracking adds to rank 0's loop."""
    site = {"id": "s", "partition": 0, "tracking": {"backends": BACKENDS, "queue_records": n, "close_timeout_s": 600,
                                                    "process": process}}
    cfg = TrainerConfig(site=site, workload={"task": "digits"}, num_partitions=1, socket=str(tmp / "s.sock"),
                        workdir=str(tmp / "site"))
    tracking = step_tracking(cfg, 0, torch.device("cpu"))
    total = torch.tensor([2.3 * 16, 16.0], dtype=torch.float64)
    time.sleep(STARTUP_S)
    t0 = time.perf_counter()
    for step in range(1, n + 1):
        tracking.step(step, total, 0.1, 0.01)
    took = time.perf_counter() - t0
    tracking.flush()
    if any(tracking.session.close().values()):
        raise SystemExit("the site's trackers dropped records in the measure")
    return took / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="local steps per round")
    ap.add_argument("--repeats", type=int, default=2, help="off/on pairs (medians of all)")
    ap.add_argument("--threads", action="store_true", help="trackers as threads in each party's process "
                                                           "(tracking.process: false) instead of helper processes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sovfl-bench-") as d:
        tmp = Path(d)
        off, on = [], []
        for i in range(args.repeats):
            off.append(federation(tmp, f"off{i}", args.rounds, args.steps, False, not args.threads))
            on.append(federation(tmp, f"on{i}", args.rounds, args.steps, True, not args.threads))
            print(f"  pair {i}: round_s off {off[-1][0]:.3f} on {on[-1][0]:.3f}; site train_s off {off[-1][1]:.3f} "
                  f"on {on[-1][1]:.3f}", flush=True)
        line = json.loads((tmp / "on0" / "metrics.jsonl").read_text().splitlines()[-1])
        c_us = coordinator_cost(tmp / "c", line, 200, not args.threads)
        s_us = site_cost(tmp, 2000, not args.threads)
        r_off, r_on = statistics.median(x[0] for x in off), statistics.median(x[0] for x in on)
        t_off, t_on = statistics.median(x[1] for x in off), statistics.median(x[1] for x in on)
        print(f"round_s: off {r_off:.3f}, on {r_on:.3f}; site train_s: off {t_off:.3f}, on {t_on:.3f}; "
              f"on the path: {c_us:.0f} us per metrics line ({len(flat_metrics(line))} figures), "
              f"{s_us:.1f} us per optimizer step")
        print(f"RESULT round_time_ratio={r_on / r_off:.3f} train_time_ratio={t_on / t_off:.3f} "
              f"coordinator_us_per_round={c_us:.0f} site_us_per_step={s_us:.1f}")


if __name__ == "__main__":
    main()
