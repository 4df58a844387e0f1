"""Structure-aware input strategies: mutate valid encodings instead of hoping random bytes parse.

Each generated input is (a seed, a short byte "program"): the program is read op by op, like
libFuzzer's FuzzedDataProvider, so hypothesis draws two values per input instead of dozens (its
per-draw cost dominated the first version) and still shrinks a failure to a short program.

- bytes: AFL-style edits of a seed (bit flips, byte sets, "interesting" big-endian integers written
  over any 1/2/4/8 bytes, so every length or count field sees 0, 2**32 - 1, 2**40, 2**64 - 1, ...;
  inserts, deletes, truncation, repeated slices, splices with another seed), or random bytes;
- JSON: edits of the parsed document (replace, drop, add, wrap a node) with hostile values (huge
  and non-finite numbers, lone surrogates, wrong types, deep nesting), re-serialized, sometimes
  with byte edits on top.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

INTERESTING = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 1,
               2**32, 2**40, 2**48, 2**63 - 1, 2**63, 2**64 - 1)
PROGRAM = st.binary(min_size=1, max_size=48)


class Reader:
    """Reads a program's bytes as numbers; past the end it reads zeros (every program is valid)."""

    def __init__(self, program: bytes):
        self.p, self.i = program, 0

    def more(self) -> bool:
        return self.i < len(self.p)

    def u(self, n: int = 1) -> int:
        v = int.from_bytes(self.p[self.i:self.i + n].ljust(n, b"\0"), "big")
        self.i += n
        return v

    def pick(self, items: Sequence[Any]) -> Any:
        return items[self.u() % len(items)]

    def raw(self, n: int) -> bytes:
        out = self.p[self.i:self.i + n]
        self.i += n
        return out


def apply_byte_program(data: bytes, program: bytes, seeds: Sequence[bytes], max_size: int = 1 << 16) -> bytes:
    buf, r = bytearray(data), Reader(program)
    while r.more():
        kind, at = r.u() % 8, r.u(3) % (len(buf) + 1)
        if kind == 0 and buf:  # flip a bit
            buf[at % len(buf)] ^= 1 << (r.u() % 8)
        elif kind == 1 and buf:  # set a byte
            buf[at % len(buf)] = r.u()
        elif kind == 2:  # an interesting integer over 1, 2, 4 or 8 bytes (length and count fields)
            width = (1, 2, 4, 8)[r.u() % 4]
            buf[at:at + width] = (r.pick(INTERESTING) % (1 << (8 * width))).to_bytes(width, "big")
        elif kind == 3:  # insert
            buf[at:at] = r.raw(r.u() % 16 + 1)
        elif kind == 4:  # delete
            del buf[at:at + r.u() % 64 + 1]
        elif kind == 5:  # truncate
            del buf[at:]
        elif kind == 6:  # repeat a slice (grows lists whose count was also edited)
            piece = bytes(buf[at:at + r.u() % 72 + 1])
            buf[at:at] = piece * (r.u() % 40 + 1)
        elif kind == 7 and seeds:  # splice the tail of another seed
            other = seeds[r.u() % len(seeds)]
            buf[at:] = other[r.u(3) % (len(other) + 1):]
        if len(buf) > max_size:
            del buf[max_size:]
    return bytes(buf)


def mutated_bytes(seeds: Sequence[Any], max_size: int = 1 << 16) -> st.SearchStrategy[bytes]:
    """Edits of the seeds (three draws in four) or random bytes."""
    raw = [s for s in seeds if isinstance(s, bytes)]
    random = st.binary(max_size=min(max_size, 2048))
    if not raw:
        return random
    edits = st.builds(apply_byte_program, st.sampled_from(raw), PROGRAM, st.just(raw), st.just(max_size))
    return st.one_of(edits, edits, edits, random)


# -- JSON ---------------------------------------------------------------------------------------


class Deep:
    """Stands for a deeply nested JSON array; written out as raw text after json.dumps."""

    def __init__(self, depth: int):
        self.depth = depth

    def __repr__(self) -> str:
        return f"Deep({self.depth})"


_MARK = "\u0000sovfl-deep:"
HOSTILE_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2**31, 2**53 + 1, 2**63, 2**64, 10**30, -(10**30), 10**4000, 0.5, -0.0, 1e308,
    -1e308, float("inf"), float("-inf"), float("nan"), 253402300799, 253402300800, -62135596800, 4102444800,
    "", "none", "ES256", "EdDSA", "HS256", "eat-jwt", "insecure-dev", "site-a", "a.b", "x" * 5000, "AAAA", "=",
    "..", "\u00e9", "\ud800", "\udfff", "true", "null", "1e999", "\x00", [], {}, [None], {"": None},
    Deep(50), Deep(500), Deep(5000), Deep(100_000),
)


def hostile_value(r: Reader) -> Any:
    """A hostile JSON value: from the table, or a string or integer made of the program's bytes."""
    k = r.u()
    if k < 200:  # a copy: edits must never reach the table (or make cycles through it)
        return copy.copy(HOSTILE_VALUES[k % len(HOSTILE_VALUES)])
    if k < 225:
        return r.raw(r.u() % 24).decode("utf-8", "surrogateescape")  # lone surrogates included
    if k < 250:
        return int.from_bytes(r.raw(r.u() % 12 + 1), "big", signed=True)
    return [hostile_value(r), hostile_value(r)] if k % 2 else {_key(hostile_value(r))[:20]: hostile_value(r)}


def _nodes(doc: Any, path: tuple[Any, ...] = (), seen: set[int] | None = None) -> list[tuple[Any, ...]]:
    seen = set() if seen is None else seen
    out = [path]
    if isinstance(doc, (dict, list)) and id(doc) not in seen and len(path) < 24:
        seen.add(id(doc))
        for k, v in (doc.items() if isinstance(doc, dict) else enumerate(doc)):
            out += _nodes(v, (*path, k), seen)
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _key(value: Any) -> str:
    """A dict key made from a hostile value (whose str may be huge, deep, or refuse to exist)."""
    if isinstance(value, (list, dict, set, frozenset, Deep)):
        return type(value).__name__
    try:
        return str(value)[:40]
    except ValueError:  # an int beyond the str conversion limit
        return "int"


def apply_json_program(doc: Any, program: bytes, values: Any = hostile_value, cycles: bool = False) -> Any:
    """Tree edits of a copy of ``doc`` (dicts, lists, scalars): set, drop, add, wrap (and make a
    cycle, which only YAML can express, when ``cycles``)."""
    doc, r = copy.deepcopy(doc), Reader(program)
    while r.more():
        kind = r.u() % (5 if cycles else 4)
        paths = _nodes(doc)
        path = paths[r.u(2) % len(paths)]
        node = _get(doc, path)
        if kind == 1:  # drop
            if path:
                del _get(doc, path[:-1])[path[-1]]
            continue
        if kind == 2:  # add
            if isinstance(node, dict):
                node[_key(values(r))] = values(r)
            elif isinstance(node, list):
                node.append(values(r))
            continue
        if kind == 4:  # cycle
            if isinstance(node, list):
                node.append(node)
            elif isinstance(node, dict):
                node["self"] = node
            continue
        new = values(r) if kind == 0 else ([node] if r.u() % 2 else {"x": node})
        if path:
            _get(doc, path[:-1])[path[-1]] = new
        else:
            doc = new
    return doc


def dump_json(doc: Any, ascii_only: bool = True) -> bytes:
    """json.dumps that also writes Deep markers and lets lone surrogates through as invalid UTF-8."""

    def default(obj: Any) -> Any:
        if isinstance(obj, Deep):
            return f"{_MARK}{obj.depth}"
        raise TypeError(type(obj).__name__)

    text = json.dumps(doc, default=default, ensure_ascii=ascii_only, separators=(",", ":"))
    for mark in (f'"{_MARK}', '"\\u0000sovfl-deep:'):
        while (i := text.find(mark)) >= 0:
            j = text.index('"', i + 1)
            depth = int(text[i + len(mark):j])
            text = text[:i] + "[" * depth + "]" * depth + text[j + 1:]
    return text.encode("utf-8", "surrogatepass")


def _json_edit(doc: Any, program: bytes, raw: Sequence[bytes], max_size: int) -> bytes:
    """Tree edits; then, if the program's first byte says so, byte edits of the serialization."""
    out = dump_json(apply_json_program(doc, program[1:]), ascii_only=not program[0] & 1)
    return apply_byte_program(out, program[-6:], raw, max_size) if program[0] & 6 == 6 else out


def mutated_json(seeds: Sequence[Any], max_size: int = 1 << 16) -> st.SearchStrategy[bytes]:
    """JSON documents: tree edits of the seeds (each seed is JSON bytes), sometimes with byte edits
    on top; plus plain byte edits and random bytes."""
    docs = []
    for s in seeds:
        try:
            docs.append(json.loads(s))
        except (ValueError, TypeError, RecursionError):
            continue
    raw = [s for s in seeds if isinstance(s, bytes)]
    if not docs:
        return mutated_bytes(raw, max_size)
    tree = st.builds(_json_edit, st.sampled_from(docs), PROGRAM, st.just(raw), st.just(max_size))
    return st.one_of(tree, tree, tree, mutated_bytes(raw, max_size))


def as_text(data: bytes) -> str:
    """Wire bytes as the str a receiver would hold: invalid UTF-8 becomes lone surrogates."""
    return data.decode("utf-8", "surrogateescape")
