"""The bulk channel's RPC surface: method names, message encodings and gRPC options, for both ends.

Generic gRPC handlers over bytes (no generated code), like the trainer endpoint. Control messages
are small JSON documents; a chunk message is the chunk's index (8 bytes, big-endian) followed by
its bytes, one gRPC message per chunk, so gRPC does the framing and flow control:

  Ping    unary   {}                                      -> {site, federation, run, round}
  Begin   unary   {run, round, root, size, chunk, digests}-> {missing: [chunk indices]}   (an upload)
  Put     client-streaming chunk messages, metadata       -> {missing: [...]}             (root, run, round)
  Get     server-streaming {root, chunks: [...] | null}   -> header {size, chunk, digests}, then chunks
  Report  unary   {run, round, metrics}                   -> {}   (the site's evaluation of the round's
                  model, sent as soon as it is done: the reply that carries it comes after the local steps)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from federation.protocol.bulk import BulkRefused, Ref, check_manifest, chunk_len, digests_of

SERVICE = "sovfl.Bulk"
MAX_MESSAGE = 80 << 20  # a chunk (at most 64 MiB) plus its index, with room

# one TCP connection per stream (parallel streams fill a long fat link where one HTTP/2 connection
# stalls on its window); large HTTP/2 windows and keepalives for long transfers
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.http2.lookahead_bytes", 16 << 20),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 20_000),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),  # a second coordinator on the same port must fail, not share it
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # a fixed receive window per stream, not one that BDP probing grows: the coordinator's memory
    # for N sites' uploads stays bounded by N x streams x the window, and 4 streams x 8 MiB / RTT
    # still fill a 1 Gbit/s link at 50 ms
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 8 << 20),
]
PUT_HEADER = "sovfl-put"  # Put's metadata key: JSON {run, round, root}


def encode(obj: Any) -> bytes:
    """A control message."""
    return json.dumps(obj, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """A JSON object from the other end (ValueError if it is not one)."""
    if len(data) > 4 << 20:
        raise ValueError("control message over 4 MiB")
    try:
        obj = json.loads(bytes(data).decode())
    except RecursionError:  # json's parser recurses once per nesting level
        raise ValueError("control message nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError("control message is not a JSON object")
    return obj


def chunk_message(index: int, data) -> bytes:
    """One chunk on the wire."""
    return b"".join((index.to_bytes(8, "big"), data))


def parse_chunk(msg: bytes) -> tuple[int, memoryview]:
    """(index, bytes) of a chunk message (ValueError if it has no index)."""
    if len(msg) < 8:
        raise ValueError("chunk message shorter than its index")
    view = memoryview(msg)
    return int.from_bytes(view[:8], "big"), view[8:]


def identity(data: bytes) -> bytes:
    """gRPC's (de)serializer for messages that are bytes already."""
    return data


@dataclass(frozen=True)
class Begin:
    """An upload as a site announces it: its (run, round), the blob's name, size and chunk digests."""

    run: int
    round: int
    root: str
    size: int
    chunk: int
    digests: list[bytes]

    def encode(self) -> bytes:
        """The Begin request."""
        return encode({"run": self.run, "round": self.round, "root": self.root, "size": self.size,
                       "chunk": self.chunk, "digests": [d.hex() for d in self.digests]})


def parse_begin(data: bytes) -> Begin:
    """A site's Begin request, its digests checked against the blob's name (BulkRefused)."""
    try:
        req = decode(data)
        begin = Begin(int(req["run"]), int(req["round"]), str(req["root"]), int(req["size"]), int(req["chunk"]),
                      [bytes.fromhex(d) for d in req["digests"]])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OverflowError) as err:
        raise BulkRefused("bad_request", f"unreadable Begin ({type(err).__name__})") from None
    check_manifest(begin.root, begin.size, begin.chunk, begin.digests)
    return begin


def parse_get_header(data: bytes, ref: Ref) -> list[bytes]:
    """The chunk digests the coordinator's Get stream starts with, checked against `ref` (BulkRefused)."""
    try:
        head = decode(data)
        size, chunk = int(head["size"]), int(head["chunk"])
        digests = [bytes.fromhex(d) for d in head["digests"]]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OverflowError) as err:
        raise BulkRefused("bad_request", f"unreadable Get header ({type(err).__name__})") from None
    if (size, chunk) != (ref.size, ref.chunk):
        raise BulkRefused("size_mismatch", f"blob {ref.root[:12]} is served as {size} bytes in chunks of {chunk}")
    check_manifest(ref.root, size, chunk, digests)
    return digests


def check_chunk(msg: bytes, size: int, chunk: int, digests: list[bytes]) -> tuple[int, memoryview]:
    """(index, bytes) of a chunk message of the blob `digests` describe, checked: inside the blob, of
    its chunk's length, hashing to its digest (BulkRefused)."""
    try:
        index, data = parse_chunk(msg)
    except ValueError as err:
        raise BulkRefused("bad_chunk", str(err)) from None
    if not 0 <= index < len(digests):
        raise BulkRefused("chunk_out_of_range", f"chunk {index} of a blob of {len(digests)}")
    if len(data) != chunk_len(size, index, chunk):
        raise BulkRefused("chunk_size", f"chunk {index} is {len(data)} bytes, expected {chunk_len(size, index, chunk)}")
    if digests_of([data])[0] != digests[index]:
        raise BulkRefused("chunk_digest", f"chunk {index} does not hash to its announced digest (tampered or corrupted)")
    return index, data
