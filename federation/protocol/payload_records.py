"""Payload <-> Flower records: arrays go into an ArrayRecord (Flower chunks them), metadata into a
ConfigRecord. Both sides call these, so a payload has one wire form. numpy + flwr only (the
ClientApp imports this)."""

from __future__ import annotations

from io import BytesIO

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from federation.protocol.pipeline import Payload

_ALLOWED_KINDS = set("fiub")  # numeric and bool dtypes only; never objects


def to_array(a: np.ndarray) -> Array:
    """`a` as a Flower Array, the .npy bytes `Array(ndarray)` makes, in one copy (not three)."""
    a = np.require(a, requirements="C")  # not ascontiguousarray: that makes a 0-d array 1-d
    header = BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(a))
    return Array(dtype=str(a.dtype), shape=tuple(a.shape), stype="numpy.ndarray",
                 data=b"".join((header.getvalue(), memoryview(a).cast("B") if a.size else b"")))


def array_view(arr: Array) -> np.ndarray:
    """A read-only view of an Array's data, without the copy `Array.numpy()` makes. For arrays a
    site made itself (its own update between two mods); replies from others go through `numpy()`."""
    buf = BytesIO(memoryview(arr.data)[:4096].tobytes())
    major, _ = np.lib.format.read_magic(buf)
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(buf)
    if fortran or dtype.kind not in _ALLOWED_KINDS:
        raise ValueError(f"array of {dtype} (fortran={fortran}) is not a plain numeric array")
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(arr.data, dtype=dtype, count=count, offset=buf.tell()).reshape(shape)


def to_records(payload: Payload, arrays_key: str = "arrays", meta_key: str = "meta") -> RecordDict:
    """The payload as two records of one message: `arrays_key` (arrays) and `meta_key` (metadata)."""
    return RecordDict({
        arrays_key: ArrayRecord({k: to_array(v) for k, v in payload.arrays.items()}),
        meta_key: ConfigRecord(dict(payload.meta)),
    })


def from_records(rd: RecordDict, arrays_key: str = "arrays", meta_key: str = "meta", copy: bool = True) -> Payload:
    """The payload `to_records` wrote (absent records read as empty); `copy=False` gives read-only
    views into the message (see `array_view`)."""
    rec = rd.array_records.get(arrays_key)
    arrays = {k: (v.numpy() if copy else array_view(v)) for k, v in rec.items()} if rec is not None else {}
    meta = dict(rd.config_records[meta_key]) if meta_key in rd.config_records else {}
    return Payload(arrays, meta)


def array_bytes(rec: ArrayRecord) -> int:
    """Bytes of an ArrayRecord's data as serialized for the wire (the .npy headers included)."""
    return sum(len(a.data) for a in rec.values())


def record_bytes(rd: RecordDict) -> int:
    """Bytes of array data in a whole message (what the round's byte counts add up)."""
    return sum(array_bytes(rec) for rec in rd.array_records.values())
