"""The fuzzing contract and its runner, shared by `make test` (a few hundred inputs per decoder)
and `make soak` (100,000 and more, see tests/fuzz_soak.py).

A decoder reads bytes (or text, or a parsed document) from another party. Its contract:

- it returns (the input is valid), or raises one of its documented rejection types with a
  non-empty message; the rejection's ``reason`` attribute (or, lacking one, its class name) is
  the label it is counted under;
- anything else is a crash: another exception, a rejection without a message, a call that runs
  past ``HANG_S`` seconds (checked by an interval timer in-process, and by the soak's parent
  process from outside), or a call whose peak resident memory grows by more than
  ``ALLOC_BASE + ALLOC_PER_BYTE * len(input)`` (a header that claims 2**40 elements must be refused
  before anything of that size is allocated). The peak is the kernel's (VmHWM, reset before each
  call through /proc/self/clear_refs): it sees numpy and OpenSSL buffers too, and unlike
  tracemalloc it does not slow deep recursion down by the depth of the stack. The soak adds an
  address-space limit per process; tests/test_fuzz_decoders.py checks 2**40 claims with
  tracemalloc and under RLIMIT_AS.

A target is registered once (tests/fuzzing/registry.py) and both runners pick it up.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import signal
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

CORPUS_DIR = Path(__file__).resolve().parents[1] / "fuzz_corpus"
HANG_S = 20.0  # generous: every decoder here answers in milliseconds; a hang is a bug, not noise
ALLOC_BASE = 48 << 20  # bytes any single call may allocate regardless of its input size
ALLOC_PER_BYTE = 64  # and per input byte (parsed Python objects are ~10-50x their text)


class Hang(BaseException):
    """Raised into a decoder that ran past its time budget (BaseException: not swallowable)."""


@dataclass(frozen=True)
class Target:
    """One decoder under the contract.

    decode: takes one input (bytes unless the strategy says otherwise) and returns or raises.
    rejects: the documented rejection types.
    seeds: valid encodings made by the real encoders (besides tests/fuzz_corpus/<name>/*.bin).
    strategy: hypothesis strategy of inputs given the seeds (default: mutations of the seeds,
      mixed with random bytes).
    known: maps (input, exception) to the id of a documented open bug outside this package, or
      None; such failures are counted as `known`, not as crashes (each has a strict xfail test).
    load_seed / dump_seed: a corpus file's bytes to an input and back (default: as is).
    """

    name: str
    decode: Callable[[Any], object]
    rejects: tuple[type[BaseException], ...]
    seeds: Callable[[], Sequence[Any]] = lambda: ()
    strategy: Callable[[Sequence[Any]], st.SearchStrategy[Any]] | None = None
    known: Callable[[Any, BaseException], str | None] | None = None
    load_seed: Callable[[bytes], Any] = bytes
    dump_seed: Callable[[Any], bytes] = bytes
    max_size: int = 1 << 16


REGISTRY: dict[str, Target] = {}


def register(name: str, decode: Callable[[Any], object], rejects: type[BaseException] | tuple[type[BaseException], ...],
             **options: Any) -> Target:
    """Add a decoder to both fuzz runners: ``register("name", decode, ErrorType, seeds=...)``."""
    if name in REGISTRY:
        raise ValueError(f"fuzz target {name!r} registered twice")
    target = Target(name, decode, rejects if isinstance(rejects, tuple) else (rejects,), **options)
    REGISTRY[name] = target
    return target


# -- one input ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    kind: str  # "accepted", "rejected", "known" or "crash"
    label: str  # the rejection reason, the known bug id, or what crashed
    detail: str = ""

    @property
    def crashed(self) -> bool:
        return self.kind == "crash"


def reason_of(exc: BaseException) -> str:
    return str(getattr(exc, "reason", "") or type(exc).__name__)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise Hang into the running code after ``seconds`` (main thread only; Python-level code)."""

    def fire(signum: int, frame: Any) -> None:
        raise Hang(f"no answer within {seconds:g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def input_size(data: Any) -> int:
    if isinstance(data, (bytes, bytearray, memoryview, str)):
        return len(data)
    return len(input_bytes(data))


def input_bytes(data: Any) -> bytes:
    """An input as bytes to save: itself if bytes, else a repr that never fails (huge ints, depth)."""
    if isinstance(data, bytes):
        return data
    return _repr(data, 0, set()).encode("utf-8", "backslashreplace")


def _repr(x: Any, depth: int, seen: set[int]) -> str:
    if isinstance(x, int) and not isinstance(x, bool):
        return hex(x) if x.bit_length() > 10_000 else repr(x)
    if isinstance(x, (list, tuple, dict, set)):
        if depth > 100 or id(x) in seen:
            return "..."
        seen = seen | {id(x)}
        if isinstance(x, dict):
            pairs = (f"{_repr(k, depth + 1, seen)}: {_repr(v, depth + 1, seen)}" for k, v in x.items())
            return "{" + ", ".join(pairs) + "}"
        inner = ", ".join(_repr(v, depth + 1, seen) for v in x)
        shapes = {list: f"[{inner}]", tuple: f"({inner},)", set: f"{{{inner}}}"}
        return shapes.get(type(x), f"{type(x).__name__}({inner})")
    try:
        return repr(x)
    except Exception:  # an object whose repr fails is still an input
        return f"<{type(x).__name__}>"


class PeakMemory:
    """Growth of the process's peak resident set over one call (Linux; None elsewhere)."""

    def __init__(self) -> None:
        self.base = 0

    @staticmethod
    def available() -> bool:
        try:
            PeakMemory._reset()
            return True
        except OSError:
            return False

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    @staticmethod
    def _status() -> dict[str, int]:
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":")
                    out[key] = int(value.split()[0]) * 1024
        return out

    def __enter__(self) -> "PeakMemory":
        self._reset()
        self.base = self._status()["VmRSS"]
        return self

    def growth(self) -> int:
        return self._status()["VmHWM"] - self.base


_METER = PeakMemory.available()


def run_one(target: Target, data: Any, *, check_alloc: bool = True) -> Outcome:
    """Feed one input to the decoder and classify what happened against the contract."""
    meter = PeakMemory().__enter__() if check_alloc and _METER else None
    try:
        with time_limit(HANG_S):
            target.decode(data)
        outcome = Outcome("accepted", "ok")
    except Hang as exc:
        outcome = _unexpected(target, data, exc, "hang")
    except target.rejects as exc:
        outcome = (Outcome("rejected", reason_of(exc)) if str(exc).strip()
                   else Outcome("crash", f"{type(exc).__name__} without a message"))
    except Exception as exc:  # the contract is broken: classify, never swallow silently
        outcome = _unexpected(target, data, exc, type(exc).__name__)
    if meter is not None and outcome.kind != "crash":
        peak, budget = meter.growth(), ALLOC_BASE + ALLOC_PER_BYTE * input_size(data)
        if peak > budget:
            exc = MemoryError(f"peak memory grew by {peak} bytes > budget {budget} for a {input_size(data)}-byte input")
            outcome = _unexpected(target, data, exc, "allocation")
    return outcome


def _unexpected(target: Target, data: Any, exc: BaseException, label: str) -> Outcome:
    known = target.known(data, exc) if target.known is not None else None
    if known:
        return Outcome("known", known, f"{type(exc).__name__}: {exc}"[:300])
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    return Outcome("crash", label, tb)


# -- inputs: corpus, seeds, strategy ---------------------------------------------------------


def corpus_files(name: str) -> list[Path]:
    """seed-*.bin (genuine encodings), regress-*.bin (fixed bugs) and known-*.bin (open bugs
    outside the code under test: replayed, never mutated, so the soak does not dwell on them)."""
    d = CORPUS_DIR / name
    return sorted(d.glob("*.bin")) if d.is_dir() else []


def seeds_of(target: Target) -> list[Any]:
    """Committed corpus first (seeds and regressions), then fresh encodings not already in it."""
    out = [target.load_seed(p.read_bytes()) for p in corpus_files(target.name) if not p.name.startswith("known-")]
    known = {input_bytes(s) for s in out}
    return out + [s for s in target.seeds() if input_bytes(s) not in known]


def strategy_of(target: Target, seeds: Sequence[Any]) -> st.SearchStrategy[Any]:
    from .mutate import mutated_bytes

    if target.strategy is not None:
        return target.strategy(seeds)
    return mutated_bytes(seeds, max_size=target.max_size)


def save_input(directory: Path, target: Target, data: Any, outcome: Outcome) -> Path:
    """Write a failing input (bytes as is, anything else as its repr) with its traceback."""
    raw = input_bytes(data)
    path = directory / target.name / f"{outcome.label}-{hashlib.sha256(raw).hexdigest()[:16]}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    path.with_suffix(".txt").write_text(f"{outcome.kind}: {outcome.label}\n{outcome.detail}\n")
    return path


# -- a run of many inputs ----------------------------------------------------------------------


@dataclass
class Tally:
    """What one decoder did with a run of inputs."""

    name: str
    inputs: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    crashes: list[tuple[Any, Outcome]] = field(default_factory=list)  # the first few, for the report
    crash_count: int = 0
    known_count: int = 0
    seconds: float = 0.0

    def add(self, data: Any, outcome: Outcome, keep: int = 5) -> None:
        self.inputs += 1
        self.outcomes[f"{outcome.kind}:{outcome.label}"] += 1
        if outcome.kind == "known":
            self.known_count += 1
        if outcome.crashed:
            self.crash_count += 1
            if len(self.crashes) < keep:
                self.crashes.append((data, outcome))


def fuzz(target: Target, max_examples: int, *, on_crash: Callable[[Any, Outcome], None] | None = None,
         check_alloc: bool = True, seeds: Sequence[Any] | None = None, explicit: bool = True,
         observe: Callable[[Any], None] | None = None) -> Tally:
    """Run hypothesis over the target: the corpus as explicit examples, then generated inputs.

    Without ``on_crash`` the first crash raises AssertionError, so hypothesis shrinks it and pytest
    shows the smallest failing input; with it, crashes are recorded and the run goes on.
    ``observe`` sees each input before the decoder does (the soak keeps the one in flight).
    """
    seeds = seeds_of(target) if seeds is None else list(seeds)
    tally = Tally(target.name)

    def body(data: Any) -> None:
        if observe is not None:
            observe(data)
        outcome = run_one(target, data, check_alloc=check_alloc)
        if outcome.crashed and on_crash is None:
            raise AssertionError(f"{target.name}: {outcome.label} on input {input_bytes(data)[:2000]!r}\n{outcome.detail}")
        tally.add(data, outcome)
        if outcome.crashed and on_crash is not None:
            on_crash(data, outcome)

    test = given(strategy_of(target, seeds))(body)
    if explicit:
        for seed in reversed(seeds[:64]):
            test = example(seed)(test)
    phases = [Phase.explicit, Phase.generate] if explicit else [Phase.generate]
    if on_crash is None:
        phases.append(Phase.shrink)
    test = settings(max_examples=max_examples, deadline=None, database=None, phases=phases, derandomize=False,
                    suppress_health_check=list(HealthCheck), print_blob=False)(test)
    started = time.perf_counter()
    logging.disable(logging.WARNING)  # decoders log each rejection (and insecure-dev each use): not here
    try:
        test()
    finally:
        logging.disable(logging.NOTSET)
    tally.seconds = time.perf_counter() - started
    return tally
