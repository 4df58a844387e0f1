"""A message's small records as one Flower object: fewer requests for every message, both ways.

Flower moves a message as a tree of content-addressed objects: the message, its RecordDict, each
record, each Array of an ArrayRecord. Each object is one request on every leg of the message's
way (the ServerApp's push to the SuperLink, the SuperNode's pull, the ClientApp's pull from its
SuperNode, and back), two at a time (flwr 1.41's `FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES` and
`..._PULLS`), and a request to a busy SuperLink costs tens of milliseconds whatever its size. A
train message with SecAgg+, attestation, terms and the audit head is 18 objects, most of them a
few hundred bytes; packed it is three: the message, its RecordDict and one ConfigRecord (`PACKED`)
holding the other records as Flower's own protobuf encoding (flwr.common.serde).

`pack` leaves out of the pack an ArrayRecord above `record_max` bytes of arrays, and any record
that would take the pack past `pack_max`, so that a large model still travels as Flower's objects
(deduplicated across a stage's messages, each Array its own request) or on the data path; a
message with fewer than two records to pack is left as it is. `unpack` restores the records
exactly (the same keys, types, values and Array bytes) before anything reads them: around the
ServerApp's Grid (coordinator/pack_grid.py) and around the ClientApp (site/pack_mod.py).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from federation.protocol import message_keys as keys
from federation.protocol.payload_records import array_bytes
from federation.protocol.pipeline import UpdateRejected

RECORD_MAX = 1 << 20  # an ArrayRecord with more array bytes than this stays its own objects
PACK_MAX = 4 << 20  # the pack's bytes at most: below the largest object Flower makes itself (a 5 MB Array chunk)
FIELD = "records"  # in the PACKED ConfigRecord: the packed records' protobuf
ORDER = "order"  # in the PACKED ConfigRecord: every record's key, in the message's order


class PackError(UpdateRejected):
    """A packed message cannot be unpacked (corrupt, or a key both packed and not): `pack_unreadable`."""

    def __init__(self, detail: str):
        super().__init__("pack_unreadable", detail)


def pack(rd: RecordDict, record_max: int = RECORD_MAX, pack_max: int = PACK_MAX) -> RecordDict:
    """`rd` with its small records in one PACKED ConfigRecord (module docstring), or `rd` itself
    when fewer than two records would go in."""
    if keys.PACKED in rd:
        return rd
    chosen, total = {}, 0
    for size, key, rec in sorted(((_size(r), k, r) for k, r in rd.items()), key=lambda t: t[0]):
        if isinstance(rec, ArrayRecord) and size > record_max:
            continue
        if total + size > pack_max:
            break
        chosen[key], total = rec, total + size
    if len(chosen) < 2:
        return rd
    blob = recorddict_to_proto(RecordDict(chosen)).SerializeToString()
    out = RecordDict({k: v for k, v in rd.items() if k not in chosen})
    out[keys.PACKED] = ConfigRecord({FIELD: blob, ORDER: list(rd.keys())})
    return out


def unpack(rd: RecordDict) -> RecordDict:
    """`rd` with a PACKED record's records back in their place (`rd` itself without one)."""
    rec = rd.config_records.get(keys.PACKED)
    if rec is None:
        return rd
    blob = rec.get(FIELD)
    if not isinstance(blob, bytes):
        raise PackError(f"the '{keys.PACKED}' record has no bytes under '{FIELD}'")
    try:
        proto = ProtoRecordDict()
        proto.ParseFromString(blob)
        packed = recorddict_from_proto(proto)
    except Exception as err:  # protobuf's DecodeError, or a record Flower cannot rebuild
        raise PackError(f"the '{keys.PACKED}' record does not decode: {type(err).__name__}: {err}") from None
    rest = {k: v for k, v in rd.items() if k != keys.PACKED}
    both = sorted(set(rest) & set(packed))
    if both:
        raise PackError(f"record(s) {', '.join(both)} both packed and beside the pack")
    records = {**rest, **dict(packed.items())}
    order = [k for k in rec.get(ORDER) or [] if k in records]
    return RecordDict({k: records[k] for k in [*dict.fromkeys(order), *records]})


def _size(rec) -> int:
    """About how many bytes a record adds to the pack (ArrayRecords: their arrays' bytes)."""
    if isinstance(rec, ArrayRecord):
        return array_bytes(rec)
    return sum(_value_size(v) for v in rec.values()) + 16 * len(rec)


def _value_size(v) -> int:
    if isinstance(v, (bytes, str)):
        return len(v)
    if isinstance(v, list):
        return sum(_value_size(x) for x in v)
    return 8
