"""The site's end of the link probe on the bulk data path (protocol/link_probe.py).

Measures what an update's transfer will see: the same channels (mutual TLS, one TCP connection per
stream). On one stream by default (`ProbeSettings.streams`): parallel streams into one bottleneck
compete for its queue, and a stream stalled by a loss leaves the others idle at the end of a short
measurement, which made four streams read 42-82 Mbit/s on the shaped 100 Mbit/s link where one
stream reads 100; a transfer's parallel streams reach at least what one stream does. Every channel is opened first (its TCP
and TLS handshakes are not the link's rate), then the round-trip time is the least of small echoes
(a stall in either end's scheduler only ever adds to an echo, so the least is the path's own, as
TCP's min-RTT estimate takes it), then each direction moves zeros on every stream at once, starting small and growing until
one measurement lasts `seconds` (or reaches `max_bytes`: the rate is then a lower bound, said by
`capped`), and the better of two measurements of that size counts. The coordinator's side only counts and echoes, so the rates are the client's view: the
time from the calls to their answers, less the answer's round trip.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from flwr.app import ArrayRecord

from federation.protocol import bulk_rpc as rpc
from federation.protocol import message_keys as keys
from federation.protocol import link_probe as lp
from federation.protocol.payload_records import to_array
from federation.site.bulk_client import BulkClient


def _timed(streams: int, call: Callable[[int, int], None], nbytes: int) -> float:
    """Seconds for `call(stream, share)` on every stream at once, the bytes split evenly."""
    shares = [nbytes // streams + (1 if k < nbytes % streams else 0) for k in range(streams)]
    with ThreadPoolExecutor(streams) as pool:
        t0 = time.perf_counter()
        for f in [pool.submit(call, k, shares[k]) for k in range(streams)]:
            f.result()
        return time.perf_counter() - t0


def _measure(streams: int, call: Callable[[int, int], None], settings: lp.ProbeSettings,
             rtt_s: float) -> tuple[float, int, bool]:
    """(Mbit/s, bytes measured, capped) of one direction: the size grows until one measurement lasts
    `seconds` (or reaches `max_bytes`: capped), then the same size is measured once more and the
    better of the two counts, so that a stall (a retransmission timeout is 200 ms) does not stand
    for the link."""
    # 1 MiB first (8 s on a 1 Mbit/s link): smaller first sizes made a 20 Mbit/s link read 11 once,
    # the growth then stopping at sizes a stall dominates
    n = min(settings.max_bytes, max(streams * lp.PROBE_CHUNK, 1 << 20))
    while True:
        took = _timed(streams, call, n)
        if took >= settings.seconds or n >= settings.max_bytes:
            capped = took < settings.seconds
            return lp.rate_mbit(n, min(took, _timed(streams, call, n)), rtt_s), n, capped
        n = lp.next_size(n, took, settings.seconds, settings.max_bytes)


def probe(client: BulkClient, settings: lp.ProbeSettings, rnd: int = 0, timeout_s: float = 60.0) -> lp.LinkFigures:
    """The link's figures through `client`'s data path (raises grpc.RpcError if it is not there)."""
    streams = settings.streams or client.streams
    echo = [client.stub(k, "unary_unary", lp.ECHO) for k in range(streams)]
    for k in range(streams):  # connect every stream's channel (handshakes are not the link's rate)
        echo[k](b"{}", timeout=timeout_s)
    rtts = []
    for _ in range(settings.pings):
        t = time.perf_counter()
        echo[0](b"{}", timeout=timeout_s)
        rtts.append(time.perf_counter() - t)
    rtt_s = min(rtts)
    sink = [client.stub(k, "stream_unary", lp.SINK) for k in range(streams)]
    source = [client.stub(k, "unary_stream", lp.SOURCE) for k in range(streams)]
    zeros = memoryview(bytes(lp.PROBE_CHUNK))

    def up(k: int, nbytes: int) -> None:
        def chunks():
            left = nbytes
            while left > 0:
                yield zeros[:min(left, lp.PROBE_CHUNK)].tobytes() if left < lp.PROBE_CHUNK else zeros.obj
                left -= lp.PROBE_CHUNK
        got = rpc.decode(sink[k](chunks(), timeout=timeout_s)).get("bytes")
        if got != nbytes:
            raise RuntimeError(f"the coordinator counted {got} of the {nbytes} probe bytes sent")

    def down(k: int, nbytes: int) -> None:
        got = sum(len(m) for m in source[k](rpc.encode({"bytes": nbytes, "chunk": lp.PROBE_CHUNK}), timeout=timeout_s))
        if got != nbytes:
            raise RuntimeError(f"{got} of the {nbytes} probe bytes asked for came down")

    up_mbit, up_bytes, up_capped = _measure(streams, up, settings, rtt_s)
    down_mbit, down_bytes, down_capped = _measure(streams, down, settings, rtt_s)
    return lp.LinkFigures("bulk", rtt_s * 1e3, up_mbit, down_mbit, up_bytes, down_bytes, streams,
                          up_capped or down_capped, rnd)


def answer(client: BulkClient | None, request, rnd: int, reply_content) -> dict:
    """The STATUS fields that answer a PROBE record (`request`): on the data path (`client`), the
    link's figures measured now; off it, the bytes a Flower-path probe asks to carry back (an
    Array of `flower_up_bytes` zeros in the reply; the coordinator times the messages). A probe
    that fails says why in `link_probe_error`; the message is answered either way."""
    try:
        settings = lp.ProbeSettings.from_record(request)
        up = int(request.get("flower_up_bytes", 0) or 0)
        if not 0 <= up <= lp.MAX_PROBE_BYTES:
            raise lp.LinkProbeError(f"flower_up_bytes {up} out of range [0, 1 GiB]")
    except (lp.LinkProbeError, TypeError, ValueError, OverflowError) as err:
        return {"link_probe_error": f"bad probe request: {err}"}
    if up:
        reply_content[keys.PROBE_PAYLOAD] = ArrayRecord({"zeros": to_array(np.zeros(up, dtype=np.uint8))})
        return {}
    if client is None or request.get("flower"):
        return {}
    try:
        return {lp.STATUS_KEY: probe(client, settings, rnd).to_json()}
    except Exception as err:  # any failure: the probe says so, the message goes on
        detail = err.details() if hasattr(err, "details") else str(err)
        return {"link_probe_error": f"the data path probe failed ({type(err).__name__}: {str(detail)[:200]})"}
