"""Every decoder of another party's bytes holds its contract (tests/fuzzing/harness.py): a clean,
counted rejection with a reason for every malformed input; never another exception, a hang or an
unbounded allocation. A few hundred generated inputs each here; `make soak` runs 100,000 each.

SOVFL_FUZZ_EXAMPLES raises the count here (e.g. to chase a bug with pytest's shrinking output).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from fuzzing import registry  # noqa: F401  (registers every decoder)
from fuzzing.claims import claims
from fuzzing.harness import REGISTRY, corpus_files, fuzz, run_one, seeds_of

EXAMPLES = int(os.environ.get("SOVFL_FUZZ_EXAMPLES", "200"))
NAMES = sorted(REGISTRY)


@pytest.mark.parametrize("name", NAMES)
def test_genuine_encodings_are_accepted(name: str) -> None:
    """The real encoders' output decodes: the fuzz targets reach the real checks, and the crypto
    fixes kept the behaviour for valid input."""
    target = REGISTRY[name]
    seeds = list(target.seeds())
    assert seeds, f"{name} has no seeds from its encoder"
    for seed in seeds:
        outcome = run_one(target, seed)
        assert outcome.kind == "accepted", f"{name}: a genuine encoding was {outcome.kind}: {outcome.label}"


@pytest.mark.parametrize("name", NAMES)
def test_corpus_replays_without_crash(name: str) -> None:
    """Committed seeds and the regression input of every bug found so far."""
    target = REGISTRY[name]
    files = corpus_files(name)
    assert files, f"no corpus for {name}: run tests/fuzzing/make_corpus.py"
    for path in files:
        outcome = run_one(target, target.load_seed(path.read_bytes()))
        assert not outcome.crashed, f"{path.name}: {outcome.label}\n{outcome.detail}"
        if path.name.startswith("regress-"):
            assert outcome.kind == "rejected", f"{path.name} is now {outcome.kind}"
        if path.name.startswith("known-"):  # an open bug outside the code under test
            assert outcome.kind == "known", f"{path.name} is now {outcome.kind}"


@pytest.mark.parametrize("name", NAMES)
def test_generated_inputs_hold_the_contract(name: str) -> None:
    target = REGISTRY[name]
    tally = fuzz(target, EXAMPLES)  # raises (shrunk, with the input) on the first crash
    assert tally.inputs >= EXAMPLES
    rejected = sum(v for k, v in tally.outcomes.items() if k.startswith(("rejected", "known")))
    assert rejected >= tally.inputs // 4, f"{name}: too few inputs were malformed to test anything: {tally.outcomes}"


def _warm(names: set[str]) -> None:
    for name in names:  # fixtures (keys, the SecAgg round) are built once, outside any measurement
        for seed in seeds_of(REGISTRY[name])[:1]:
            run_one(REGISTRY[name], seed, check_alloc=False)


@pytest.mark.parametrize("what, name, make", claims(), ids=[c[0] for c in claims()])
def test_size_claims_are_refused_before_allocation(what: str, name: str, make) -> None:  # type: ignore[no-untyped-def]
    data = make()
    _warm({name})
    tracemalloc.start()
    try:
        outcome = run_one(REGISTRY[name], data, check_alloc=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert outcome.kind == "rejected", f"{what}: {outcome.kind} {outcome.label}\n{outcome.detail}"
    assert peak < 8 << 20, f"{what}: {peak} bytes allocated while refusing it"


def test_size_claims_under_an_address_space_limit() -> None:
    """The same inputs in a child process that cannot map 1 GiB more than it has after its setup: an
    allocation of the claimed size would fail there instead of being overcommitted lazily."""
    script = Path(__file__).parent / "fuzzing" / "claims.py"
    r = subprocess.run([sys.executable, str(script), str(1 << 30)], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok ") == len(claims()), r.stdout
