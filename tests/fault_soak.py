"""Seeded fault injection against the coordinator and the sites; `make soak` runs it after the fuzzing.

    .venv/bin/python tests/fault_soak.py                     # 20 kills over a 15-round digits run
    .venv/bin/python tests/fault_soak.py --kills 4 --rounds 6 --seed 1

A `sovfl simulate` run (3 sites, digits, SecAgg+ with threshold 2, the int8 codec with error
feedback) is SIGKILLed by a schedule drawn from --seed. A coordinator kill lands at a random moment
of its rounds, whatever it is doing (a SecAgg stage, the train stage, aggregation, the checkpoint
write, the metrics line); each kill line names the stage the coordinator entered last (stages are
announced on entry). Aggregation and the checkpoint write last milliseconds, which a random moment
seldom hits, so in a share of the attempts (--target-share) the coordinator kill is aimed at one of
them: the ServerApp's stage hook (federation/protocol/testing_hooks.py) holds it on entering that
stage of a round drawn from the seed, and it is killed there. A site kill lands as the coordinator
enters a stage drawn from the seed (SITE_STAGES) of the round after the last one completed, so the
schedule a seed draws is the same however fast the rounds run. Each kill hits one of:
- the coordinator (ServerApp, SuperLink and SuperExec): the run goes on with `sovfl simulate --resume`;
- a site's SuperNode, or one of a site's trainer ranks: nothing is done by hand, the run's site
  supervisor restarts it (federation/ops/site_supervisor.py; ranks resume from the site's local
  checkpoint, sites[].checkpoint_every: 1). Site kills stop 5 rounds before the end (half the rounds in a
  short run), so every killed site has rounds left to come back in, and the coordinator is held
  entering the last round until every killed site serves again (`wait_back`).
A kill lands before the first round of an attempt finishes as often as not, so the run can take
more kills than rounds.

What equality means. A site that is down misses the rounds it is down for, so the killed run's
final model is legitimately not the one of a run where nothing died. The reference is therefore
run after the killed one, uninterrupted, with the same seed and with each site told to sit out
exactly the rounds it missed in the killed run (node config `absent-rounds`,
federation/protocol/testing_hooks.py): both runs then aggregate the same sites in every round, and
final_hash_equal compares their final global models bit for bit. That equality shows coordinator
resumes are exact (a rerun SecAgg round has fresh keys and masks, and each site encodes from the
residual its first attempt started from) and restarted sites contribute exactly the update an
unbroken site would have (their state comes back from the local checkpoint and site store, nothing
from the dead process). Sites here run SGD on digits, whose rounds are deterministic (batch sampling
is seeded per round), and the stochastic rounding is seeded (SEEDED, a test hook).

Prints one line per kill, then
`RESULT kills=<n> rounds=<n> lost_rounds=<n> final_hash_equal=<true|false>`: kills counts every
kind (the line before it splits them); lost_rounds counts rounds that had completed (their metrics
line written) before a coordinator kill but were run again after it (a site kill never reruns a
round: the round in flight goes on without that site). Exit status 1 unless lost_rounds is 0, the
hashes are equal, every killed site contributed again after its kill, and no process is left.
"""

from __future__ import annotations

import argparse
import json
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

from faults import (kill_coordinator, kill_site_rank, kill_supernode, release_stage, rounds_done, stage_entries,  # noqa: E402
                    stage_hook_env, supernode_starts, wait_site_back, wait_supernode_back)
from federation.config.schema import Deadlines  # noqa: E402
from federation.coordinator.checkpoint import CheckpointStore  # noqa: E402
from federation.ops.launcher import marked_pids  # noqa: E402
from federation.protocol.downlink_steps import model_digest  # noqa: E402

SITES = ("paris", "berlin", "madrid")
CLIP = 0.5
# test hook: stochastic rounding (codec and SecAgg fixed point) seeded by site and round, so that two
# runs can be compared bit for bit (federation/site/codec_mod.py); production draws it from the OS
SEEDED = {"SOVFL_TEST_CODEC_SITE_SEED": "7"}
KINDS = ("coordinator", "supernode", "rank")
SITE_KILLS_STOP = 5  # no site kill once fewer rounds than this are left
TARGETS = ("aggregate", "checkpoint")  # brief stages a random moment seldom hits: held there by the stage hook
SITE_STAGES = ("round start", "secagg stage 3", "secagg stage 4")  # where a site kill lands (on entry, not held)
LAST_ROUND_STAGE = "round start"  # an attempt without a target is held entering its last round, before the
# round asks its sites for anything (late joiners, SecAgg+ setups): see wait_back


def config(directory: Path, rounds: int) -> Path:
    site = {"ranks": 1, "local_steps": 3, "batch_size": 16, "lr": 0.1, "checkpoint_every": 1}
    path = directory / "soak.yaml"
    path.write_text(yaml.safe_dump({
        "federation": {"name": "soak", "rounds": rounds, "quorum": 1, "evaluate": False, "strategy": "fedadam",
                       "codec": f"int8:clip={CLIP}", "error_feedback": True,
                       "secagg": {"enabled": True, "threshold": 2, "clip": CLIP},
                       "deadlines": {"connect_s": 90, "round_s": 60, "trainer_start_s": 120},
                       "site_restarts": {"max_restarts": 100, "backoff_s": 0.5}},
        "workload": {"task": "digits", "options": {"hidden": 16}},
        "sites": [{"id": name, "partition": i, **site} for i, name in enumerate(SITES)],
    }, sort_keys=False))
    return path


def _popen(argv: list[str], marker: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, **SEEDED, **(extra_env or {}), "FLWR_TELEMETRY_ENABLED": "0", "SOVFL_RUN_MARKER": marker}
    return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=env)


def sovfl(args: list[str], marker: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    return _popen(["-m", "federation.ops.cli", *args], marker, extra_env)


def current_stage(hook: Path, since: int) -> tuple[str, str]:
    """(round and stage, stage) the coordinator announced last (federation/protocol/testing_hooks.py),
    "start-up" when it announced none after the first `since` entries (the earlier attempts')."""
    entries = stage_entries(hook)
    if len(entries) <= since:
        return "start-up", "start-up"
    return f"round {entries[-1]['round']} {entries[-1]['stage']}", entries[-1]["stage"]


def simulate_absent(path: Path, workdir: Path, absent: dict[str, list[int]], marker: str) -> subprocess.Popen:
    """An uninterrupted `simulate` whose sites sit out the given rounds (the reference). Its deadlines
    are twice the killed run's: nothing here is waited out (a site sitting out answers at once), and
    they do not enter the computation, while a deadline missed on a loaded machine would make the
    reference aggregate other sites than the killed run."""
    cfg = yaml.safe_load(path.read_text())
    deadlines = {**Deadlines().model_dump(), **cfg["federation"].get("deadlines", {})}
    cfg["federation"]["deadlines"] = {k: 2 * v for k, v in deadlines.items()}
    path = path.with_name(f"reference-{path.name}")
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    node_config = {site: {"absent-rounds": ",".join(map(str, rounds))} for site, rounds in absent.items() if rounds}
    code = ("import sys; from federation.ops.launcher import simulate, result_line; "
            f"r = simulate({str(path)!r}, {str(workdir)!r}, node_config={node_config!r}); "
            "print(result_line(r)); sys.exit(0 if r.get('status') == 'ok' else 1)")
    return _popen(["-c", code], marker)


def final_digest(run: Path) -> str:
    ckpt = CheckpointStore(run / "checkpoints").latest()
    return model_digest(ckpt.arrays["model"]) if ckpt else "none"


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def round_seconds(run: Path) -> float:
    """The mean round time so far (all attempts' progress logs), 8 s before any round finished."""
    times = [float(x) for log in run.glob("progress*.log")
             for x in re.findall(r" in ([0-9.]+)s$", log.read_text(), re.M)]
    return float(np.mean(times)) if times else 8.0


def entered(hook: Path, since: int, target: tuple[int, str], proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until this attempt's coordinator announces entering `target` (round, stage prefix), where
    the stage hook holds it if it is the attempt's pause; False if it exits or does not get there
    within `timeout_s`."""
    end = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < end:
        if any(e["round"] == target[0] and e["stage"].startswith(target[1]) for e in stage_entries(hook)[since:]):
            return True
        time.sleep(0.1)
    return False


def kill_site(kind: str, site: str, marker: str) -> int | None:
    """SIGKILL a site's SuperNode or one of its ranks; None when it is down already (restarting)."""
    try:
        return kill_supernode(marker, site) if kind == "supernode" else kill_site_rank(marker, site)
    except LookupError:
        return None


def wait_back(run: Path, marker: str, kills: list[tuple[str, str, int, float]], hook: Path) -> None:
    """Let the coordinator, held entering the last round, go on once every site killed in the run
    serves again: its restarted SuperNode active at the SuperLink, its restarted ranks ready. A
    restart takes longer than a digits round on a loaded machine, and a site still restarting when
    the last round starts could not show it is back. A site that is not back in time is said; the
    run goes on, and the rejoin check then fails."""
    for kind, site, starts, at in kills:
        try:
            if kind == "supernode":
                wait_supernode_back(run, site, starts)
            else:
                socket = json.loads((run / "sites" / site / "trainer.json").read_text())["socket"]
                wait_site_back(marker, site, Path(socket), at)
        except AssertionError as err:
            print(f"fault soak: {err}", flush=True)
    release_stage(hook)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--site-share", type=float, default=0.5, help="the share of kills aimed at sites")
    ap.add_argument("--target-share", type=float, default=0.4,
                    help="the share of attempts whose coordinator kill is held for in aggregation or the checkpoint "
                         "write (the stage hook pauses the ServerApp there) instead of landing at a random moment")
    ap.add_argument("--workdir", help="where the two runs go (default: a temporary directory)")
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="sovfl-fault-soak-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    path = config(work, args.rounds)
    marker = uuid.uuid4().hex
    rng = np.random.default_rng(args.seed)
    share = args.site_share / 2
    stop = min(SITE_KILLS_STOP, max(2, args.rounds // 2))
    t0 = time.monotonic()

    run, lost, attempt = work / "run", 0, 0
    counts = dict.fromkeys(KINDS, 0)
    hook = work / "stages.jsonl"  # the stages the coordinator enters (test hook), to name where each kill landed
    stages: dict[str, int] = {}
    site_kills: list[tuple[str, int]] = []  # (site, rounds completed when it was killed)
    restarts: list[tuple[str, str, int, float]] = []  # (kind, site, its SuperNode's starts, time) of each site kill
    out, first_round = "", 1
    while True:
        attempt += 1
        resume = ["--resume", str(run)] if attempt > 1 else []
        if resume and (run / "progress.log").exists():  # so that the wait below reads the new attempt's
            (run / "progress.log").rename(run / f"progress.attempt{attempt - 1}.log")
        since = len(stage_entries(hook))
        target = None  # (round, stage) where this attempt's coordinator kill lands, the ServerApp held there
        if sum(counts.values()) < args.kills and rng.random() < args.target_share:
            target = (min(args.rounds, first_round + int(rng.integers(0, 2))), str(rng.choice(TARGETS)))
        pause = f"{target[0]}:{target[1]}" if target else f"{args.rounds}:{LAST_ROUND_STAGE}"
        proc = sovfl(["simulate", str(path), "--workdir", str(run), *resume], marker, stage_hook_env(hook, pause))
        progress = run / "progress.log"
        while proc.poll() is None and not (progress.exists() and "sites: " in progress.read_text()):
            time.sleep(0.05)
        next_attempt = False
        while proc.poll() is None and not next_attempt and sum(counts.values()) < args.kills:
            kind = str(rng.choice(KINDS, p=[1 - 2 * share, share, share])) if target is None else "coordinator"
            site = str(rng.choice(SITES))
            if kind != "coordinator":
                done_before = rounds_done(run)
                aim = ((done_before[-1] if done_before else 0) + 1, str(rng.choice(SITE_STAGES)))
                if aim[0] - 1 > args.rounds - stop:
                    continue  # too late: the site could not show it is back
                entered(hook, since, aim, proc, 3 * round_seconds(run) + 120)
            elif target is None:
                time.sleep(float(rng.uniform(0.0, 1.5 * round_seconds(run))))
            is_held = target is not None and entered(hook, since, target, proc, 3 * round_seconds(run) + 120)
            if target is not None and not is_held:
                print(f"fault soak: the coordinator did not enter round {target[0]} {target[1]}; killing it where it is",
                      flush=True)
            done_before = rounds_done(run)
            last = done_before[-1] if done_before else 0
            if proc.poll() is not None:
                break
            where, stage = current_stage(hook, since)
            # a stage is announced on entry: unless held there, the coordinator is in it or past it
            where, stage = (f"held in {where}", f"held in {stage}") if is_held else (f"last entered {where}", stage)
            if kind != "coordinator":
                if last > args.rounds - stop:
                    continue  # too late: the site could not show it is back
                starts, at = supernode_starts(run, site), time.time()
                pid = kill_site(kind, site, marker)
                if pid is None:
                    continue  # that process is being restarted right now: draw again
                restarts.append((kind, site, starts, at))
                counts[kind] += 1
                stages[stage] = stages.get(stage, 0) + 1
                site_kills.append((site, last))
                print(f"kill {sum(counts.values())}: {kind} of site {site} (pid {pid}) after round {last} completed, "
                      f"coordinator {where}", flush=True)
                continue
            victims = kill_coordinator(run, marker)
            if not victims or proc.poll() is not None:
                break
            counts[kind] += 1
            stages[stage] = stages.get(stage, 0) + 1
            proc.communicate(timeout=180)
            ckpt = CheckpointStore(run / "checkpoints").latest()
            resumed_from = ckpt.round if ckpt else 0
            first_round = resumed_from + 1
            redone = max(0, last - resumed_from)
            lost += redone
            print(f"kill {sum(counts.values())}: coordinator ({len(victims)} process(es)) {where}, after round "
                  f"{last} completed; resuming from round {resumed_from} (lost {redone})", flush=True)
            next_attempt = True
        if next_attempt:
            continue
        if proc.poll() is None:
            wait_back(run, marker, restarts, hook)
        out, _ = proc.communicate()
        break
    ok = proc.returncode == 0
    if not ok:
        print(out, file=sys.stderr)
    lines = metrics(run)
    rounds = [x["round"] for x in lines]
    absent = {s: [x["round"] for x in lines if s not in x["sites"]] for s in SITES}
    rejoined = all(any(s in x["sites"] for x in lines if x["round"] > after) for s, after in site_kills)
    print(f"killed run: {attempt} attempt(s), {time.monotonic() - t0:.0f}s; metrics rounds {rounds}; rounds each "
          f"site missed: {absent}; every killed site contributed again: {rejoined}", flush=True)

    ref = simulate_absent(path, work / "reference", absent, marker)
    ref_out, _ = ref.communicate()
    if ref.returncode != 0:
        print(ref_out, file=sys.stderr)
        print("fault soak: the reference run failed", file=sys.stderr)
    ref_absent = {s: [x["round"] for x in metrics(work / "reference") if s not in x["sites"]] for s in SITES}
    same_sites = ref_absent == absent
    equal = ok and ref.returncode == 0 and same_sites and rounds == list(range(1, args.rounds + 1)) and \
        final_digest(run) == final_digest(work / "reference")
    leftover = marked_pids(marker)
    if leftover:
        print(f"fault soak: {len(leftover)} process(es) left behind: {leftover}", file=sys.stderr)
    if not same_sites:
        print(f"fault soak: the reference aggregated other sites than the killed run: {ref_absent} vs {absent}",
              file=sys.stderr)
    kills = sum(counts.values())
    print(f"fault soak: {kills} kill(s): " + ", ".join(f"{k} {v}" for k, v in counts.items())
          + f"; {time.monotonic() - t0:.0f}s in all; runs in {work}")
    print("fault soak: kills by the coordinator's stage (held in: held there on entering it; otherwise the stage "
          "it entered last): " + ", ".join(f"{k} {v}" for k, v in sorted(stages.items())))
    print(f"RESULT kills={kills} rounds={len(rounds)} lost_rounds={lost} final_hash_equal={str(equal).lower()}")
    return 0 if equal and lost == 0 and rejoined and not leftover else 1


if __name__ == "__main__":
    sys.exit(main())
