"""The bulk channel's RPC surface: method names, message encodings and gRPC options, for both ends.

Generic gRPC handlers over bytes (no generated code), like the trainer endpoint. Control messages
are small JSON documents; a chunk message is the chunk's index (8 bytes, big-endian) followed by
its bytes, one gRPC message per chunk, so gRPC does the framing and flow control:

  Ping    unary   {}                                      -> {site, federation, run, round}
  Begin   unary   {run, round, root, size, chunk, digests}-> {missing: [chunk indices]}   (an upload)
  Put     client-streaming chunk messages, metadata       -> {missing: [...]}             (root, run, round)
  Get     server-streaming {root, chunks: [...] | null}   -> header {size, chunk, digests}, then chunks
"""

from __future__ import annotations

import json
from typing import Any

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
]
PUT_HEADER = "sovfl-put"  # Put's metadata key: JSON {run, round, root}


def encode(obj: Any) -> bytes:
    """A control message."""
    return json.dumps(obj, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """A JSON object from the other end (ValueError if it is not one)."""
    if len(data) > 4 << 20:
        raise ValueError("control message over 4 MiB")
    obj = json.loads(bytes(data).decode())
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
