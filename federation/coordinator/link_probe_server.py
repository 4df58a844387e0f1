"""The coordinator's end of the link probe on the bulk data path (protocol/link_probe.py).

Three handlers the bulk server registers beside its own (same mutual-TLS port, same check of the
caller's certificate): an echo for the round-trip time, a sink that counts what a site streams up,
a source that streams zeros down. They hold nothing: a probe costs the coordinator no memory
beyond one chunk per stream and touches no upload or offered blob.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from federation.protocol import bulk_rpc as rpc
from federation.protocol import link_probe as lp
from federation.protocol.bulk import BulkRefused

_ZEROS = bytes(lp.PROBE_CHUNK)


def probe_handlers(site_of: Callable[[grpc.ServicerContext], str],
                   abort: Callable[[grpc.ServicerContext, BulkRefused], None]) -> dict:
    """The probe's method handlers; `site_of` names the calling site (BulkRefused if it is none of
    ours), `abort` ends the call with the refusal."""

    def allowed(context) -> bool:
        try:
            site_of(context)
            return True
        except BulkRefused as err:
            abort(context, err)
            return False

    def echo(request: bytes, context) -> bytes:
        allowed(context)
        return b"{}"

    def sink(requests, context) -> bytes:
        allowed(context)
        total = 0
        for msg in requests:
            total += len(msg)
            if total > lp.MAX_PROBE_BYTES:  # a probe is bounded; a stream that goes on is not one
                abort(context, BulkRefused("bad_request", f"probe upload beyond {lp.MAX_PROBE_BYTES} bytes"))
                return b""
        return rpc.encode({"bytes": total})

    def source(request: bytes, context):
        allowed(context)
        try:
            req = rpc.decode(request)
            n, chunk = int(req["bytes"]), int(req.get("chunk", lp.PROBE_CHUNK))
        except (ValueError, KeyError, TypeError, OverflowError) as err:
            abort(context, BulkRefused("bad_request", f"unreadable probe request ({type(err).__name__})"))
            return
        if not (0 <= n <= lp.MAX_PROBE_BYTES and 1 <= chunk <= lp.PROBE_CHUNK):
            abort(context, BulkRefused("bad_request", f"probe of {n} bytes in chunks of {chunk}: out of range"))
            return
        view = memoryview(_ZEROS)
        while n > 0:
            k = min(n, chunk)
            yield bytes(view[:k]) if k < len(_ZEROS) else _ZEROS
            n -= k

    return {
        lp.ECHO: grpc.unary_unary_rpc_method_handler(echo, rpc.identity, rpc.identity),
        lp.SINK: grpc.stream_unary_rpc_method_handler(sink, rpc.identity, rpc.identity),
        lp.SOURCE: grpc.unary_stream_rpc_method_handler(source, rpc.identity, rpc.identity),
    }
