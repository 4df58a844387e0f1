"""A site's end of the bulk data path: uploads its update's blob, downloads the model's
(protocol/bulk.py; the coordinator's end is coordinator/bulk_server.py).

Mutual TLS with the site's provisioned client certificate, the server checked against the
federation CA. A blob moves on `streams` parallel streams, each on its own TCP connection (one
HTTP/2 connection is held back by its flow-control window on a long fat link), each stream
taking every `streams`-th missing chunk. A stream that breaks (reset, server restarting, a 5xx
of a proxy) costs only its chunks in flight: the transfer asks which chunks are still missing and
goes on with those, with backoff, until the deadline; then it says what failed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from crypto.pki import SiteBundle
from federation.protocol import bulk_rpc as rpc
from federation.protocol.bulk import Blob, BulkRefused, Ref, chunk_count
from federation.protocol.malloc_policy import trim_freed

STREAMS = 4
TRIM_EVERY = 8  # chunks a stream moves between two trims of freed memory (protocol/malloc_policy.py)
_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


class BulkUnavailable(RuntimeError):
    """The coordinator's data path could not be used within the deadline; the message says why."""


class BulkClient:
    """Transfers of one ClientApp process (one message) to and from the coordinator."""

    def __init__(self, address: str, bundle: SiteBundle, streams: int = STREAMS,
                 progress: Callable[[str], None] | None = None):
        self.address, self.streams = address, max(1, streams)
        self._creds = grpc.ssl_channel_credentials(
            root_certificates=bundle.ca_cert.read_bytes(), private_key=bundle.tls_key.read_bytes(),
            certificate_chain=bundle.tls_cert.read_bytes())
        self._channels: list[grpc.Channel] = []
        self.progress = progress or (lambda line: None)
        self.retries = 0

    def close(self) -> None:
        """Close the channels (the process ends with the message anyway)."""
        for ch in self._channels:
            ch.close()
        self._channels = []

    def _channel(self, i: int) -> grpc.Channel:
        while len(self._channels) <= i:
            self._channels.append(grpc.secure_channel(self.address, self._creds, options=rpc.CHANNEL_OPTIONS))
        return self._channels[i]

    def _stub(self, i: int, kind: str, method: str):
        make = getattr(self._channel(i), kind)
        return make(f"/{rpc.SERVICE}/{method}", request_serializer=rpc.identity, response_deserializer=rpc.identity)

    def stub(self, i: int, kind: str, method: str):
        """A callable for `method` of the data path on stream `i`'s channel (the link probe's RPCs)."""
        return self._stub(i, kind, method)

    def ping(self, timeout_s: float = 10.0) -> dict:
        """Who the coordinator's data path says we are (raises grpc.RpcError)."""
        return rpc.decode(self._stub(0, "unary_unary", "Ping")(b"{}", timeout=timeout_s, wait_for_ready=False))

    def report(self, run: int, rnd: int, metrics: dict[str, float], timeout_s: float = 5.0) -> None:
        """Send the site's evaluation of round `rnd`'s model ahead of its reply (one try: the reply
        carries the figures anyway; raises grpc.RpcError)."""
        self._stub(0, "unary_unary", "Report")(rpc.encode({"run": run, "round": rnd, "metrics": metrics}),
                                               timeout=timeout_s, wait_for_ready=False)

    # ---- retries ----------------------------------------------------------------------------------
    def _retrying(self, what: str, deadline: float, attempt: Callable[[], bool]) -> None:
        """Run `attempt` (True: done) until it is done or `deadline`; transient gRPC errors back off."""
        wait, last = 0.2, "no attempt"
        while True:
            try:
                if attempt():
                    return
                last = "chunks still missing after a full pass"
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                detail = err.details() if hasattr(err, "details") else str(err)
                if code not in _TRANSIENT:
                    refused = (detail or "").split(":", 1)
                    raise BulkRefused(refused[0].removeprefix("bulk_") if len(refused) == 2 else "refused",
                                      f"{what}: the coordinator refused: {detail}") from None
                last = f"{code.name if code else 'error'}: {detail}"
            left = deadline - time.monotonic()
            if left <= 0:
                raise BulkUnavailable(f"{what} to {self.address} did not complete before the deadline ({last})")
            self.retries += 1
            self.progress(f"bulk data path: {what}: {last}; retrying in {min(wait, left):.1f}s")
            time.sleep(min(wait, left))
            wait = min(wait * 2, 5.0)

    # ---- upload -----------------------------------------------------------------------------------
    def upload(self, blob: Blob, run: int, rnd: int, deadline_s: float) -> None:
        """Upload `blob` for (run, round) before `deadline_s` from now (BulkRefused, BulkUnavailable)."""
        deadline = time.monotonic() + deadline_s
        begin = rpc.Begin(run, rnd, blob.root, blob.size, blob.chunk, blob.digests).encode()
        head = ((rpc.PUT_HEADER, rpc.encode({"run": run, "round": rnd, "root": blob.root}).decode()),)

        def attempt() -> bool:
            left = max(1.0, deadline - time.monotonic())
            missing = rpc.decode(self._stub(0, "unary_unary", "Begin")(begin, timeout=left))["missing"]
            if not missing:
                return True
            lanes = [missing[k::self.streams] for k in range(self.streams) if missing[k::self.streams]]

            def send(k: int) -> None:
                stream = (rpc.chunk_message(i, blob.piece(i)) for i in lanes[k])
                self._stub(k, "stream_unary", "Put")(stream, timeout=left, metadata=head)

            with ThreadPoolExecutor(len(lanes)) as pool:
                for f in [pool.submit(send, k) for k in range(len(lanes))]:
                    f.result()
            return not rpc.decode(self._stub(0, "unary_unary", "Begin")(begin, timeout=left))["missing"]

        self._retrying(f"upload of {blob.size / 1e6:.1f} MB", deadline, attempt)

    # ---- download ---------------------------------------------------------------------------------
    def download(self, ref: Ref, deadline_s: float) -> bytearray:
        """The blob `ref` names, every chunk checked against the digests that hash to its name."""
        out = bytearray(ref.size)
        view = memoryview(out)

        def put(offset: int, data) -> None:
            view[offset:offset + len(data)] = data

        self._download(ref, deadline_s, put)
        return out

    def download_into(self, ref: Ref, deadline_s: float, fd: int) -> None:
        """The blob `ref` names written into the open file `fd` (at least `ref.size` bytes long),
        each chunk written once it is checked: the process holds only the chunks in flight."""
        def put(offset: int, data) -> None:
            view, done = memoryview(data).cast("B"), 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)

        self._download(ref, deadline_s, put)

    def _download(self, ref: Ref, deadline_s: float, put: Callable[[int, memoryview], None]) -> None:
        deadline = time.monotonic() + deadline_s
        missing = set(range(chunk_count(ref.size, ref.chunk)))

        def fetch(k: int, chunks: list[int] | None, left: float) -> None:
            stream = self._stub(k, "unary_stream", "Get")(
                rpc.encode({"root": ref.root, "chunks": chunks}), timeout=left)
            digests = rpc.parse_get_header(next(stream), ref)
            for n, msg in enumerate(stream, 1):
                index, data = rpc.check_chunk(msg, ref.size, ref.chunk, digests)
                put(index * ref.chunk, data)
                missing.discard(index)
                del msg, data
                if n % TRIM_EVERY == 0:
                    trim_freed()

        def attempt() -> bool:
            left = max(1.0, deadline - time.monotonic())
            todo = sorted(missing)
            lanes = [todo[k::self.streams] for k in range(self.streams) if todo[k::self.streams]]
            with ThreadPoolExecutor(len(lanes)) as pool:
                for f in [pool.submit(fetch, k, lane, left) for k, lane in enumerate(lanes)]:
                    f.result()
            return not missing

        self._retrying(f"download of {ref.size / 1e6:.1f} MB", deadline, attempt)
