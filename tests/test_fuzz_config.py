"""The YAML config loader's contract is ConfigError with a message, for any file. Fuzzing found
inputs that broke it (tests/fuzzing/config_targets.py, FIXED_BUGS, each with its fix); each is
replayed here so that it stays fixed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fuzzing.config_targets import FIXED_BUGS, alias_bomb, config_error

IN_PROCESS = [b for b in FIXED_BUGS.values() if b.id != "config-alias-expansion"]


@pytest.mark.parametrize("bug", IN_PROCESS, ids=[b.id for b in IN_PROCESS])
def test_fixed_config_bug_is_a_config_error(bug, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from federation.config.schema import load_config

    path = tmp_path / "config.yaml"
    path.write_bytes(bug.example)
    with pytest.raises(config_error()) as err:
        load_config(path)
    assert str(err.value).strip()


def test_alias_bomb_is_refused_within_bounds(tmp_path: Path) -> None:
    """A 250-byte billion-laughs file (7 levels; the documented example has 9), loaded in a child
    allowed 64 MiB of address space above its imports: the contract is a ConfigError within that
    (today: MemoryError, as the error message alone would be 78 MB; at 9 levels, ~25 GB)."""
    path = tmp_path / "bomb.yaml"
    path.write_bytes(alias_bomb(7))
    child = textwrap.dedent(f"""
        import resource
        from federation.config.schema import ConfigError, load_config
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), vm + (64 << 20)))
        try:
            load_config({str(path)!r})
        except ConfigError as err:
            print("ConfigError", len(str(err)))
    """)
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 0 and r.stdout.startswith("ConfigError"), r.stderr[-2000:]


def test_fixed_bug_examples_are_rejected_not_crashes() -> None:
    """Through the fuzz runner too: each former bug's example is now a plain rejection."""
    from fuzzing import registry  # noqa: F401
    from fuzzing.harness import REGISTRY, run_one

    target = REGISTRY["config-yaml"]
    for bug in IN_PROCESS:
        outcome = run_one(target, bug.example, check_alloc=False)
        assert outcome.kind == "rejected", (bug.id, outcome)
