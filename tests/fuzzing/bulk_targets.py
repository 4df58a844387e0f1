"""Adapters for the bulk data path's decoders (federation/protocol/bulk.py, bulk_rpc.py): what the
coordinator reads of a site's upload (Begin, chunks), what a site reads of the coordinator's Get
stream, and the references either side finds in a Flower message."""

from __future__ import annotations

from typing import Any

import numpy as np

from federation.protocol import bulk_rpc as rpc
from federation.protocol.bulk import Blob, Ref, offload

from .protocol_targets import records_of

_CHUNK = 64 << 10  # the smallest chunk size a manifest may name: small seeds, several chunks


def _blob() -> Blob:
    data = np.random.default_rng(11).integers(0, 256, 3 * _CHUNK + 100, dtype=np.uint8).tobytes()
    return Blob([data], _CHUNK)


def _ref() -> Ref:
    b = _blob()
    return Ref(b.root, b.size, b.chunk, 0, b.size, "numpy.ndarray")


def decode_bulk_ref(data: bytes) -> object:
    """A reference Array's data, as either end reads it."""
    return Ref.decode(data)


def bulk_ref_seeds() -> list[bytes]:
    return [_ref().encode()]


def decode_bulk_begin(data: bytes) -> object:
    """A site's Begin, as the coordinator's data path reads it."""
    return rpc.parse_begin(data)


def bulk_begin_seeds() -> list[bytes]:
    b = _blob()
    return [rpc.Begin(3, 2, b.root, b.size, b.chunk, b.digests).encode()]


def decode_bulk_get_header(data: bytes) -> object:
    """The first message of the coordinator's Get stream, as a site reads it."""
    return rpc.parse_get_header(data, _ref())


def bulk_get_header_seeds() -> list[bytes]:
    b = _blob()
    return [rpc.encode({"size": b.size, "chunk": b.chunk, "digests": [d.hex() for d in b.digests]})]


def decode_bulk_chunk(data: bytes) -> object:
    """A chunk message of the fixed blob, as the coordinator (upload) and a site (download) check it."""
    b = _blob()
    return rpc.check_chunk(data, b.size, b.chunk, b.digests)


def bulk_chunk_seeds() -> list[bytes]:
    b = _blob()
    return [rpc.chunk_message(i, bytes(b.piece(i))) for i in (0, b.count - 1)]


def decode_bulk_refs(data: bytes) -> Any:
    """The references of a whole message (Flower's records), resolved as the driver and bulk_mod
    resolve them (here from the one blob this party holds; any other is `missing`)."""
    from federation.protocol.bulk import BulkRefused, resolve

    rd = records_of(data)
    held = _refs_blob()

    def fetch(ref: Ref) -> bytes:
        if (ref.root, ref.size, ref.chunk) != (held.root, held.size, held.chunk):
            raise BulkRefused("missing", f"no blob {ref.root[:12]} of {ref.size} bytes here")
        return b"".join(bytes(held.piece(i)) for i in range(held.count))

    resolve(rd, fetch)
    return rd


def _refs_message() -> tuple[Blob, Any]:
    from flwr.app import ArrayRecord, RecordDict

    from federation.protocol.payload_records import to_array

    rd = RecordDict({"global": ArrayRecord({"w": to_array(np.ones(300_000, np.float32)),
                                            "b": to_array(np.ones(3, np.float32))})})
    return offload(rd)


def _refs_blob() -> Blob:
    return _refs_message()[0]


def bulk_refs_seeds() -> list[bytes]:
    from flwr.common.serde import recorddict_to_proto

    return [recorddict_to_proto(_refs_message()[1]).SerializeToString()]


def decode_link_probe_report(data: bytes) -> object:
    """A site's link figures (its STATUS `link_probe`, a string), as the coordinator reads them."""
    from federation.protocol.link_probe import parse_figures

    return parse_figures(data.decode("utf-8", "replace"))


def link_probe_report_seeds() -> list[bytes]:
    from federation.protocol.link_probe import LinkFigures

    return [LinkFigures("bulk", 31.2, 99.8, 100.1, 6_000_000, 6_100_000, 1, False, 3).to_json().encode(),
            LinkFigures("flower", 6900.0, 11.2, 13.4, 4 << 20, 4 << 20, 1, True, 0).to_json().encode()]
