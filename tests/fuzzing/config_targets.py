"""The YAML experiment config as a fuzz target: `load_config` on file text, `parse_config` on parsed
documents. Its contract is ConfigError with a message, never another exception.

The loader is called through its public functions only (`federation.config.schema.load_config` /
`parse_config`), imported lazily so this module never breaks the rest of the fuzz registry. The
loader bugs fuzzing found are fixed; FIXED_BUGS keeps each with its input, symptom and fix, and
tests/test_fuzz_config.py replays them: a recurrence is a crash, never `known`.
"""

from __future__ import annotations

import copy
import datetime as dt
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from .mutate import PROGRAM, Deep, Reader, apply_json_program, hostile_value, mutated_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


_warm = False


def _config() -> Any:
    """The loader, warmed once: validating a workload imports its task (and torch) on first use, a
    one-time cost that the per-call allocation bound must not charge to whichever input comes first."""
    global _warm
    import federation.config.schema as config

    if not _warm:
        _warm = True
        for path in sorted(CONFIGS.glob("*.yaml")):
            try:
                config.load_config(path)
            except config.ConfigError:
                pass
    return config


def config_error() -> type[Exception]:
    return _config().ConfigError


def alias_bomb(levels: int) -> bytes:
    """Billion laughs: each anchor lists the previous one 9 times (9**levels copies once expanded)."""
    return b"".join(b"a%d: &a%d [%s]\n" % (i, i, b",".join([b"*a%d" % (i - 1)] * 9) if i else b"lol,lol")
                    for i in range(levels + 1)) + b"sites: *a%d\n" % levels


@dataclass(frozen=True)
class KnownBug:
    id: str
    symptom: str
    example: bytes
    fix: str


FIXED_BUGS = {b.id: b for b in [
    KnownBug("config-not-utf8", "UnicodeDecodeError escapes load_config",
             b"sites: [\xff]\n",
             "read_text(encoding='utf-8') inside the try that maps errors to ConfigError (catch UnicodeDecodeError)"),
    KnownBug("config-deep-nesting", "RecursionError escapes load_config (PyYAML's recursive composer) and parse_config "
             "(the repr of a deeply nested value in _format_errors); PyYAML's scanner is also quadratic in the depth",
             b"sites: " + b"[" * 5000 + b"]" * 5000 + b"\n",
             "catch RecursionError around yaml.safe_load and model_validate, bound the text's '[' and '{' before "
             "parsing, and repr values with reprlib in _format_errors"),
    KnownBug("config-int-digits", "ValueError (int max_str_digits) escapes as a plain ValueError, not a ConfigError: "
             "from PyYAML's int constructor, and from the repr of a huge int in _format_errors (parse_config)",
             b"federation: {seed: " + b"9" * 5000 + b"}\nsites: [{id: a, partition: 0}]\n",
             "catch ValueError around yaml.safe_load and raise ConfigError; repr values with reprlib (never raises)"),
    KnownBug("config-alias-expansion", "a YAML alias bomb (9 anchors of 9 aliases, 300 bytes) is loaded as a "
             "shared structure, then validation errors repr every expanded copy: the message grows 9x per level "
             "(level 6: 35 MB in 0.3 s; level 9: ~25 GB, out of memory)",
             alias_bomb(9),
             "load with a SafeLoader subclass that counts composed nodes including alias re-uses and refuses "
             "documents above a bound (e.g. 100k nodes); and shorten e['input'] with reprlib in _format_errors"),
]}


def known_failure(data: Any, exc: BaseException) -> str | None:
    """No open loader bug is known: every failure other than ConfigError is a crash."""
    return None


# -- load_config(text) --------------------------------------------------------------------------

_tmp: Path | None = None


def decode_yaml(data: bytes) -> object:
    """The file a user (or another party shipping configs) handed in, through load_config."""
    global _tmp
    if _tmp is None:
        _tmp = Path(tempfile.mkdtemp(prefix="sovfl-fuzz-config-")) / f"fuzz-{os.getpid()}.yaml"
    _tmp.write_bytes(data)
    return _config().load_config(_tmp)


def yaml_seeds() -> list[bytes]:
    return [p.read_bytes() for p in sorted(CONFIGS.glob("*.yaml"))]


_SCALARS = st.sampled_from([
    b"9" * 5000, b"0x" + b"f" * 5000, b".nan", b"-.inf", b"1e999", b"190:20:30", b"0o777", b"0b1010", b"~", b"",
    b"!!binary aGVsbG8=", b"!!set {a, b}", b"!!timestamp 2001-12-14", b"!!float 1", b"!custom x",
    b"!!python/object:os.system {}", b"<<: *nope", b"'\xff'", b'"\\ud800"', b"&x [*x]", b"yes", b"2001-01-01",
])


def _bomb(depth: int, fanout: int, key: bytes) -> bytes:
    lines = [b"b0: &b0 [lol, lol]"]
    lines += [b"b%d: &b%d [%s]" % (i, i, b",".join([b"*b%d" % (i - 1)] * fanout)) for i in range(1, depth + 1)]
    return b"\n".join(lines) + b"\n" + key + b": *b%d\n" % depth


def _with_scalar(doc: bytes, at: int, scalar: bytes) -> bytes:
    lines = doc.splitlines(keepends=True) or [b""]
    i = at % len(lines)
    head, sep, _ = lines[i].partition(b": ")
    lines[i] = head + sep + scalar + b"\n" if sep else lines[i]
    return b"".join(lines)


def yaml_strategy(seeds: Sequence[Any]) -> st.SearchStrategy[bytes]:
    """Byte edits of real configs; real configs with one value replaced by a hostile scalar; dumps of
    edited documents; small alias bombs (up to 9**5 copies) and nesting (to 600) under a real key.
    Bigger bombs and deeper nesting are the known bugs, pinned by tests/test_fuzz_config.py: here
    they would only spend the soak's time (PyYAML's scanner is quadratic in the nesting depth)."""
    raw = [s for s in seeds if isinstance(s, bytes)]
    docs = [d for d in (_safe_load(s) for s in raw) if isinstance(d, dict)]
    keys = st.sampled_from([b"sites", b"federation", b"workload", b"unknown_key"])
    return st.one_of(
        mutated_bytes(raw),
        st.builds(_with_scalar, st.sampled_from(raw), st.integers(0, 255), _SCALARS),
        st.builds(_dump_edited, st.sampled_from(docs), PROGRAM),
        st.builds(lambda s, b: s + b"\n" + b, st.sampled_from(raw),
                  st.builds(_bomb, st.integers(1, 5), st.integers(2, 9), keys)),
        st.builds(lambda k, d: k + b": " + b"[" * d + b"]" * d + b"\n", keys, st.sampled_from([5, 50, 600])),
    )


def _dump_edited(doc: Any, program: bytes) -> bytes:
    """A config document with tree edits, as YAML text (deep nesting written as flow sequences)."""

    def marked(v: Any) -> Any:  # Deep anywhere -> a plain-scalar marker (deeper: the known bug)
        if isinstance(v, Deep):
            return f"SOVFLDEEP{min(v.depth, 600)}X"
        if isinstance(v, dict):
            return {k: marked(x) for k, x in v.items()}
        return [marked(x) for x in v] if isinstance(v, list) else v

    text = yaml.safe_dump(marked(apply_json_program(doc, program)), allow_unicode=True)
    text = re.sub(r"SOVFLDEEP(\d+)X", lambda m: "[" * int(m.group(1)) + "]" * int(m.group(1)), text)
    return text.encode("utf-8", "surrogatepass")


def _safe_load(data: bytes) -> Any:
    try:
        return yaml.safe_load(data)
    except (yaml.YAMLError, ValueError, RecursionError):
        return None


# -- parse_config(document) ---------------------------------------------------------------------

_YAML_ONLY = (dt.date(2001, 1, 1), dt.datetime(2001, 12, 14, 21, 59, 43, tzinfo=dt.timezone.utc), b"\xff\x00",
              10**5000, -(2**70), {1, 2}, frozenset())


def yaml_value(r: Reader) -> Any:
    """What yaml.safe_load can produce that JSON cannot (dates, bytes, sets, huge ints), or a
    hostile JSON value; deep nesting as real nested lists."""
    if r.u() < 40:
        return copy.copy(r.pick(_YAML_ONLY))
    v = hostile_value(r)
    if isinstance(v, Deep):
        out: list[Any] = []
        for _ in range(v.depth):
            out = [out]
        return out
    return v


def doc_strategy(docs: Sequence[Any]) -> st.SearchStrategy[Any]:
    """Edited config documents: wrong types, unknown keys, huge numbers, deep nesting, cycles."""
    edited = st.builds(lambda d, p: apply_json_program(d, p, yaml_value, cycles=True), st.sampled_from(list(docs)),
                       PROGRAM)
    return st.one_of(edited, edited, edited, st.builds(lambda p: yaml_value(Reader(p)), PROGRAM))


def decode_doc(doc: Any) -> object:
    return _config().parse_config(doc, "<fuzzed document>")


def doc_seeds() -> list[Any]:
    return [d for d in (_safe_load(s) for s in yaml_seeds()) if isinstance(d, dict)]


def doc_from_corpus(data: bytes) -> Any:
    return _safe_load(data)


def doc_to_corpus(doc: Any) -> bytes:
    return yaml.safe_dump(doc, sort_keys=False).encode()
