"""Seeded fault injection against the coordinator; `make soak` runs it after the fuzzing.

    .venv/bin/python tests/fault_soak.py                     # 20 kills over a 15-round digits run
    .venv/bin/python tests/fault_soak.py --kills 3 --rounds 5 --seed 1

One uninterrupted `sovfl simulate` run is the reference. The same configuration then runs again,
and a schedule drawn from --seed SIGKILLs the coordinator (ServerApp, SuperLink and SuperExec) at
a random moment of the rounds, whatever it is doing (a train stage, aggregation, the checkpoint
write, the metrics line); after each kill the run goes on with `sovfl simulate --resume`. A kill
lands before the first round of an attempt finishes as often as not, so the run can take more kills
than rounds.

Prints one line per kill, then
`RESULT kills=<n> rounds=<n> lost_rounds=<n> final_hash_equal=<true|false>`: lost_rounds counts
rounds that had completed (their metrics line written) before a kill but were run again after it;
final_hash_equal compares the final global model of the interrupted run with the reference's, bit
for bit. Exit status 1 unless lost_rounds is 0 and the hashes are equal.

Sites here run SGD on digits, whose rounds are deterministic (site batch sampling is seeded per
round), which is what makes a bit-for-bit comparison meaningful. Only the coordinator is killed:
restarting a site's trainer or SuperNode is not built yet.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]

from faults import kill_coordinator, rounds_done  # noqa: E402
from federation.coordinator.checkpoint import CheckpointStore  # noqa: E402
from federation.ops.launcher import marked_pids  # noqa: E402
from federation.protocol.downlink_steps import model_digest  # noqa: E402


def config(directory: Path, rounds: int) -> Path:
    site = {"ranks": 1, "local_steps": 3, "batch_size": 16, "lr": 0.1}
    path = directory / "soak.yaml"
    path.write_text(yaml.safe_dump({
        "federation": {"name": "soak", "rounds": rounds, "quorum": 2, "evaluate": False, "strategy": "fedadam",
                       "deadlines": {"connect_s": 90, "round_s": 60, "trainer_start_s": 120}},
        "workload": {"task": "digits", "options": {"hidden": 16}},
        "sites": [{"id": name, "partition": i, **site} for i, name in enumerate(("paris", "berlin"))],
    }, sort_keys=False))
    return path


def sovfl(args: list[str], marker: str) -> subprocess.Popen:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "SOVFL_RUN_MARKER": marker}
    return subprocess.Popen([sys.executable, "-m", "federation.ops.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)


def final_digest(run: Path) -> str:
    ckpt = CheckpointStore(run / "checkpoints").latest()
    return model_digest(ckpt.arrays["model"]) if ckpt else "none"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="where the two runs go (default: a temporary directory)")
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="sovfl-fault-soak-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    path = config(work, args.rounds)
    marker = uuid.uuid4().hex
    rng = np.random.default_rng(args.seed)
    t0 = time.monotonic()

    ref = sovfl(["simulate", str(path), "--workdir", str(work / "reference")], marker)
    out, _ = ref.communicate()
    if ref.returncode != 0:
        print(out, file=sys.stderr)
        print("fault soak: the reference run failed", file=sys.stderr)
        return 1
    round_s = float(np.mean([float(x) for x in re.findall(r" in ([0-9.]+)s$", out, re.M)] or [10.0]))
    print(f"reference: {args.rounds} rounds in {time.monotonic() - t0:.0f}s (about {round_s:.1f}s a round)", flush=True)

    run, kills, lost, attempt = work / "run", 0, 0, 0
    while True:
        attempt += 1
        resume = ["--resume", str(run)] if attempt > 1 else []
        if resume and (run / "progress.log").exists():  # so that the wait below reads the new attempt's
            (run / "progress.log").rename(run / f"progress.attempt{attempt - 1}.log")
        proc = sovfl(["simulate", str(path), "--workdir", str(run), *resume], marker)
        if kills >= args.kills:
            out, _ = proc.communicate()
            break
        # the kill: a random moment once the rounds are under way (sites discovered)
        progress = run / "progress.log"
        while proc.poll() is None and not (progress.exists() and "sites: " in progress.read_text()):
            time.sleep(0.05)
        if proc.poll() is not None:
            out, _ = proc.communicate()
            break  # finished (or failed) before the kill
        time.sleep(float(rng.uniform(0.0, 1.5 * round_s)))
        done_before = rounds_done(run)
        victims = kill_coordinator(run, marker)
        if not victims or proc.poll() is not None:
            out, _ = proc.communicate()
            break
        kills += 1
        proc.communicate(timeout=180)
        ckpt = CheckpointStore(run / "checkpoints").latest()
        resumed_from = ckpt.round if ckpt else 0
        redone = max(0, (done_before[-1] if done_before else 0) - resumed_from)
        lost += redone
        print(f"kill {kills}: {len(victims)} process(es) after round {done_before[-1] if done_before else 0} "
              f"completed; resuming from round {resumed_from} (lost {redone})", flush=True)
    leftover = marked_pids(marker)
    rounds = rounds_done(run)
    equal = proc.returncode == 0 and rounds == list(range(1, args.rounds + 1)) and \
        final_digest(run) == final_digest(work / "reference")
    if proc.returncode != 0:
        print(out, file=sys.stderr)
    if leftover:
        print(f"fault soak: {len(leftover)} process(es) left behind: {leftover}", file=sys.stderr)
    print(f"fault soak: {attempt} attempt(s) in {time.monotonic() - t0:.0f}s; metrics rounds {rounds}; runs in {work}")
    print(f"RESULT kills={kills} rounds={len(rounds)} lost_rounds={lost} final_hash_equal={str(equal).lower()}")
    return 0 if equal and lost == 0 and not leftover else 1


if __name__ == "__main__":
    sys.exit(main())
