"""Long fuzzing run over every registered decoder (tests/fuzzing/registry.py); `make soak` runs it.

    .venv/bin/python tests/fuzz_soak.py                         # 100,000 inputs per decoder
    .venv/bin/python tests/fuzz_soak.py --inputs 2000 envelope-blob secagg-advert
    .venv/bin/python tests/fuzz_soak.py --replay envelope-blob runs/fuzz/crashes/envelope-blob/x.bin

Each decoder runs in its own child process under an address-space limit (RLIMIT_AS), so an
allocation a hostile header asked for fails instead of swapping the machine. The parent watches
each child's progress: a child that stops advancing for --stall seconds (a hang the in-process
timer could not interrupt, e.g. inside one C call) or dies (a signal, the memory limit) counts as
a crash of the input it was working on, which is saved, and a new child carries on with the rest.
Crashing inputs go to <out>/crashes/<decoder>/ with their traceback. Exit status 1 if any crashed.

Prints one line per decoder, then `FUZZ decoders=<n> inputs=<total> crashes=<n>` last.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzzing import registry  # noqa: E402,F401  (registers every decoder)
from fuzzing.harness import REGISTRY, Outcome, Target, fuzz, input_bytes, run_one, save_input, seeds_of  # noqa: E402

MAX_INFLIGHT = 1 << 20  # bytes of the in-flight input kept where the parent can read it


@dataclass
class Shared:
    """What a child shows its parent while it runs: inputs done, and the input in flight."""

    done: Any = field(default_factory=lambda: mp.Value("q", 0, lock=False))
    size: Any = field(default_factory=lambda: mp.Value("q", 0, lock=False))
    buf: Any = field(default_factory=lambda: mp.Array("B", MAX_INFLIGHT, lock=False))

    def keep(self, data: Any) -> None:
        raw = input_bytes(data)[:MAX_INFLIGHT]
        self.size.value = len(raw)
        self.buf[: len(raw)] = raw
        self.done.value += 1

    def inflight(self) -> bytes:
        return bytes(self.buf[: self.size.value])


def child(name: str, inputs: int, batch: int, first: bool, rlimit: int, out: str, trace: bool, shared: Shared,
          conn: Any) -> None:
    if rlimit:
        resource.setrlimit(resource.RLIMIT_AS, (rlimit, rlimit))
    target = REGISTRY[name]
    seeds = seeds_of(target)
    totals: Counter[str] = Counter()
    crashes = known = done = 0

    def on_crash(data: Any, outcome: Outcome) -> None:
        save_input(Path(out) / "crashes", target, data, outcome)

    while done < inputs:
        n = min(batch, inputs - done)
        tally = fuzz(target, n, on_crash=on_crash, check_alloc=trace, seeds=seeds, explicit=first,
                     observe=shared.keep)
        first = False
        if tally.inputs == 0:
            break  # the strategy cannot produce new inputs
        done += tally.inputs
        totals.update(tally.outcomes)
        crashes += tally.crash_count
        known += tally.known_count
        conn.send(("progress", done, crashes, known, dict(totals)))
    conn.send(("done", done, crashes, known, dict(totals)))


@dataclass
class Job:
    target: Target
    goal: int
    done: int = 0
    crashes: int = 0
    known: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    restarts: int = 0
    proc: Any = None
    conn: Any = None
    shared: Any = None
    base: tuple[int, int, int, Counter[str]] = (0, 0, 0, Counter())  # totals of children before this one
    last_done: int = 0
    last_change: float = 0.0
    started: float = 0.0
    finished: bool = False


def start(job: Job, args: argparse.Namespace, ctx: Any) -> None:
    job.shared = Shared()
    parent, kid = ctx.Pipe(duplex=False)
    job.conn = parent
    job.base = (job.done, job.crashes, job.known, Counter(job.outcomes))
    job.proc = ctx.Process(target=child, name=f"fuzz-{job.target.name}", daemon=True,
                           args=(job.target.name, job.goal - job.done, args.batch, job.restarts == 0,
                                 args.rlimit_gib << 30, args.out, not args.no_trace_alloc, job.shared, kid))
    job.proc.start()
    kid.close()
    job.last_done, job.last_change = 0, time.monotonic()
    if not job.started:
        job.started = time.monotonic()


def absorb(job: Job) -> None:
    while job.conn.poll():
        try:
            kind, done, crashes, known, outcomes = job.conn.recv()
        except EOFError:
            return
        d0, c0, k0, o0 = job.base
        job.done, job.crashes, job.known = d0 + done, c0 + crashes, k0 + known
        job.outcomes = o0 + Counter(outcomes)
        if kind == "done":
            job.finished = True
        elif job.done < job.goal:
            rate = job.done / max(1e-9, time.monotonic() - job.started)
            print(f"FUZZ {job.target.name} {job.done}/{job.goal} crashes={job.crashes} rate={rate:.0f}/s "
                  f"eta={(job.goal - job.done) / max(rate, 1e-9):.0f}s", flush=True)


def lost_input(job: Job, why: str, args: argparse.Namespace) -> None:
    """The child died or stalled: its input in flight is a crash; carry on in a new child."""
    data = job.shared.inflight()
    path = save_input(Path(args.out) / "crashes", job.target, data, Outcome("crash", why, f"child {why}"))
    job.done = job.base[0] + job.shared.done.value  # every input it took, the lost one included
    job.crashes += 1
    job.outcomes[f"crash:{why}"] += 1
    job.restarts += 1
    print(f"FUZZ {job.target.name}: {why}; input saved to {path}", flush=True)


def report(job: Job) -> str:
    o = job.outcomes
    acc = sum(v for k, v in o.items() if k.startswith("accepted"))
    rej = sum(v for k, v in o.items() if k.startswith("rejected"))
    reasons = Counter({k.split(":", 1)[1]: v for k, v in o.items() if k.startswith("rejected")})
    top = ", ".join(f"{k}={v}" for k, v in reasons.most_common(4))
    rate = job.done / job.seconds if job.seconds else 0.0
    line = (f"FUZZ {job.target.name} inputs={job.done} accepted={acc} rejected={rej} crashes={job.crashes}"
            f" known={job.known} seconds={job.seconds:.0f} rate={rate:.0f}/s reasons: {top}")
    crashed = [f"{k}={v}" for k, v in o.items() if k.startswith(("crash", "known"))]
    return line + (f" | {' '.join(crashed)}" if crashed else "")


def replay(name: str, path: str) -> None:
    target = REGISTRY[name]
    outcome = run_one(target, target.load_seed(Path(path).read_bytes()))
    print(f"{outcome.kind}: {outcome.label}\n{outcome.detail}")
    sys.exit(1 if outcome.crashed else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="*", help=f"decoders (default: all {len(REGISTRY)})")
    ap.add_argument("--inputs", type=int, default=100_000, help="generated inputs per decoder")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="decoders fuzzed at once")
    ap.add_argument("--batch", type=int, default=5_000, help="inputs per hypothesis run (progress granularity)")
    ap.add_argument("--stall", type=float, default=120.0, help="seconds without progress that count as a hang")
    ap.add_argument("--rlimit-gib", type=int, default=4, help="address-space limit of each child (0: none)")
    ap.add_argument("--out", default="runs/fuzz", help="where crashing inputs are saved")
    ap.add_argument("--no-trace-alloc", action="store_true", help="skip the per-input allocation check (faster)")
    ap.add_argument("--replay", nargs=2, metavar=("DECODER", "FILE"), help="run one saved input and report")
    args = ap.parse_args()
    if args.replay:
        replay(*args.replay)
    names = args.targets or sorted(REGISTRY)
    unknown = sorted(set(names) - set(REGISTRY))
    if unknown:
        ap.error(f"unknown decoders {unknown}; registered: {sorted(REGISTRY)}")
    ctx = mp.get_context("fork")
    pending = [Job(REGISTRY[n], args.inputs) for n in names]
    running: list[Job] = []
    finished: list[Job] = []
    started = time.monotonic()
    print(f"FUZZ soak: {len(names)} decoders x {args.inputs} inputs, {args.jobs} at a time, "
          f"address space <= {args.rlimit_gib} GiB per child, allocation check "
          f"{'off' if args.no_trace_alloc else 'on'}", flush=True)
    while pending or running:
        while pending and len(running) < args.jobs:
            job = pending.pop(0)
            start(job, args, ctx)
            running.append(job)
        time.sleep(0.5)
        for job in list(running):
            absorb(job)
            now = time.monotonic()
            if job.shared.done.value != job.last_done:
                job.last_done, job.last_change = job.shared.done.value, now
            alive = job.proc.is_alive()
            if job.finished or (not alive and job.proc.exitcode == 0):
                job.proc.join()
                absorb(job)
            elif not alive:
                lost_input(job, f"died-exit{job.proc.exitcode}", args)
            elif now - job.last_change > args.stall:
                job.proc.kill()
                job.proc.join()
                absorb(job)
                lost_input(job, "stalled", args)
            else:
                continue
            job.seconds = now - job.started
            if job.done < job.goal and not job.finished and job.restarts < 20:
                start(job, args, ctx)  # a new child for the inputs that are left
                continue
            running.remove(job)
            finished.append(job)
            print(report(job), flush=True)
    total = sum(j.done for j in finished)
    crashes = sum(j.crashes for j in finished)
    known = sum(j.known for j in finished)
    print(f"FUZZ known={known} (documented open bugs outside the code under test; none today) "
          f"wall={time.monotonic() - started:.0f}s", flush=True)
    print(f"FUZZ decoders={len(finished)} inputs={total} crashes={crashes}", flush=True)
    sys.exit(1 if crashes else 0)


if __name__ == "__main__":
    main()
