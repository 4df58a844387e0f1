"""Payload <-> Flower records: arrays go into an ArrayRecord (Flower chunks them), metadata into a
ConfigRecord. Both sides call these, so a payload has one wire form. numpy + flwr only (the
ClientApp imports this)."""

from __future__ import annotations

import math
import threading
import tokenize
from io import BytesIO

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from federation.protocol.bulk import ref_bytes
from federation.protocol.pipeline import Payload, UpdateRejected

_ALLOWED_KINDS = set("fiub")  # numeric and bool dtypes only; never objects


def npy_parts(a: np.ndarray) -> tuple[np.ndarray, bytes, memoryview | bytes]:
    """(`a` C-contiguous, its .npy header, its data): the two pieces of the bytes `to_array` joins,
    for a writer that streams them instead (the data path's offer file, coordinator/bulk_path.py)."""
    a = np.require(a, requirements="C")  # not ascontiguousarray: that makes a 0-d array 1-d
    header = BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(a))
    return a, header.getvalue(), memoryview(a).cast("B") if a.size else b""


def to_array(a: np.ndarray) -> Array:
    """`a` as a Flower Array, the .npy bytes `Array(ndarray)` makes, in one copy (not three)."""
    a, header, data = npy_parts(a)
    return Array(dtype=str(a.dtype), shape=tuple(a.shape), stype="numpy.ndarray", data=b"".join((header, data)))


class MalformedRecord(UpdateRejected):
    """An Array of a received record is not a plain numeric .npy array of the size its header claims
    (counted as `malformed_array`). Raised before anything of the claimed size is allocated."""

    def __init__(self, key: str, detail: str):
        super().__init__("malformed_array", f"array {key!r}: {detail}")


_MAX_HEADER = 1 << 16  # .npy v1 headers are < 64 KiB; ours are < 200 bytes
_MAX_DIMS = 32
# what numpy's header parser raises on hostile text (it runs Python's tokenizer and literal_eval)
_HEADER_ERRORS = (ValueError, TypeError, SyntaxError, EOFError, RecursionError, MemoryError, tokenize.TokenError)
# ... and that literal_eval is not thread-safe on CPython 3.11 (gh-106905: two threads building ASTs
# at once raise "SystemError: AST constructor recursion depth mismatch"). The coordinator parses
# replies on several fold threads (coordinator/reply_folds.py): one header at a time.
_HEADER_LOCK = threading.Lock()


def parse_array(arr: Array, key: str = "", copy: bool = True) -> np.ndarray:
    """The numpy array an Array carries, checked before anything is allocated: its .npy header must
    be a plain numeric dtype (never objects) with a shape whose size is exactly the data that follows,
    and agree with the Array's own dtype and shape fields. Why not `Array.numpy()`: np.load allocates
    the size the header claims before it reads a byte, so 100 hostile bytes could ask for 4 TiB.
    `copy=False` gives a read-only view into the message. Raises MalformedRecord."""
    if arr.stype != "numpy.ndarray" or not isinstance(arr.data, (bytes, bytearray, memoryview)):
        raise MalformedRecord(key, f"serialization type {arr.stype!r} is not numpy.ndarray")
    data = memoryview(arr.data).cast("B")
    buf = BytesIO(data[:_header_end(data)].tobytes())  # the header only: not 64 KiB per small array
    try:
        with _HEADER_LOCK:
            version = np.lib.format.read_magic(buf)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf, max_header_size=_MAX_HEADER)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(buf, max_header_size=_MAX_HEADER)
            else:
                raise ValueError(f".npy version {version} (1.0 and 2.0 are read)")
    except _HEADER_ERRORS as err:
        raise MalformedRecord(key, f"not a .npy array ({type(err).__name__}: {str(err)[:120]})") from None
    if dtype.kind not in _ALLOWED_KINDS or dtype.hasobject or dtype.subdtype is not None:
        raise MalformedRecord(key, f"dtype {dtype} is not a plain numeric dtype")
    if len(shape) > _MAX_DIMS or any(d < 0 for d in shape):
        raise MalformedRecord(key, f"shape {shape[:8]} is not a valid array shape")
    count = math.prod(shape)  # Python ints: no overflow to a small number
    if count * dtype.itemsize != len(data) - buf.tell():
        raise MalformedRecord(key, f"header claims {shape} {dtype} ({count * dtype.itemsize} bytes) but "
                              f"{len(data) - buf.tell()} bytes follow")
    if str(arr.dtype) != str(dtype) or tuple(arr.shape) != tuple(shape):
        raise MalformedRecord(key, f"Array fields say {arr.dtype} {tuple(arr.shape)}, its data {dtype} {shape}")
    out = np.frombuffer(data, dtype=dtype, count=count, offset=buf.tell())
    out = out.reshape(shape[::-1]).transpose() if fortran else out.reshape(shape)
    return np.array(out, order="C") if copy else out


def _header_end(data: memoryview) -> int:
    """Where a .npy header claims to end (magic, version, length field), at most _MAX_HEADER."""
    lengths = {1: (10, 8, 10), 2: (12, 8, 12)}.get(data[6] if len(data) > 6 else 0)
    if lengths is None:
        return min(len(data), 16)  # not a version numpy reads: read_magic says so
    fixed, lo, hi = lengths
    return min(fixed + int.from_bytes(bytes(data[lo:hi]), "little"), _MAX_HEADER)


def array_view(arr: Array, key: str = "") -> np.ndarray:
    """A read-only view of an Array's data, without the copy `Array.numpy()` makes (checked as
    `parse_array` checks it; MalformedRecord)."""
    return parse_array(arr, key, copy=False)


def to_records(payload: Payload, arrays_key: str = "arrays", meta_key: str = "meta") -> RecordDict:
    """The payload as two records of one message: `arrays_key` (arrays) and `meta_key` (metadata)."""
    return RecordDict({
        arrays_key: ArrayRecord({k: to_array(v) for k, v in payload.arrays.items()}),
        meta_key: ConfigRecord(dict(payload.meta)),
    })


def from_records(rd: RecordDict, arrays_key: str = "arrays", meta_key: str = "meta", copy: bool = True) -> Payload:
    """The payload `to_records` wrote (absent records read as empty); `copy=False` gives read-only
    views into the message. Every array is checked before it is allocated (`parse_array`): a
    malformed one raises MalformedRecord, an UpdateRejected the round counts."""
    rec = rd.array_records.get(arrays_key)
    arrays = {k: parse_array(v, k, copy) for k, v in rec.items()} if rec is not None else {}
    meta = dict(rd.config_records[meta_key]) if meta_key in rd.config_records else {}
    return Payload(arrays, meta)


def array_bytes(rec: ArrayRecord) -> int:
    """Bytes of an ArrayRecord's data as serialized for the wire (the .npy headers included)."""
    return sum(len(a.data) for a in rec.values())


def record_bytes(rd: RecordDict) -> int:
    """Bytes of array data in a whole message (what the round's byte counts add up)."""
    return sum(array_bytes(rec) for rec in rd.array_records.values())


def sent_bytes(rd: RecordDict) -> int:
    """Bytes of array data a message moves: `record_bytes`, plus what its references stand for
    (protocol/bulk.py: Arrays that travel beside the message, on the data path)."""
    return record_bytes(rd) + ref_bytes(rd)
