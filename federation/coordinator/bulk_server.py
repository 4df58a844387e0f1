"""The coordinator's end of the bulk data path: a gRPC server with mutual TLS (protocol/bulk.py).

Sites authenticate with the client certificate of their provisioned bundle: the TLS handshake
refuses any certificate the federation CA did not sign, and every call then checks the party in
the certificate (a site of this federation, not revoked). It serves the blobs the coordinator
offers (the model of a stage's messages, `offer`) and takes the blobs sites upload (their
updates): each uploaded chunk is checked against the digests announced for its blob as it lands
and written straight to a file under WORKDIR/bulk at its place, so memory never holds an upload
and a broken transfer resumes with the chunks still missing. `take` hands the driver a verified
blob as a read-only memory map; nothing partial is ever handed over. Uploads are accepted for
the current run and round only (`window`): a stream of a past round or of another run is refused.

Every refusal has a stable code (`bulk_<code>`), is counted (`refusals`, into the round's
rejections) and is said to the site in the gRPC status.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import shutil
import threading
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509

from crypto.pki import CoordinatorBundle, TrustStore
from federation.coordinator.link_probe_server import probe_handlers
from federation.protocol import bulk_rpc as rpc
from federation.protocol.bulk import Blob, BulkRefused
from federation.protocol.malloc_policy import trim_freed

# gRPC's threads free a chunk-sized message per step, and glibc keeps the pages in their arenas
# until the round ends; a trim every few chunks gives them back.
TRIM_EVERY = 8

log = logging.getLogger("sovfl.bulk")


@dataclass
class _Upload:
    site: str
    run: int
    round: int
    size: int
    chunk: int
    digests: list[bytes]
    path: Path
    fd: int
    have: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def missing(self) -> list[int]:
        return [i for i in range(len(self.digests)) if i not in self.have]


class BulkServer:
    """Serves offered blobs and takes uploads, for one coordinator run."""

    def __init__(self, bundle: CoordinatorBundle, workdir: Path, address: str, workers: int = 16):
        self.bundle, self.address = bundle, address
        self.trust: TrustStore = bundle.trust()
        self.dir = Path(workdir) / "bulk"
        shutil.rmtree(self.dir, ignore_errors=True)  # uploads of an earlier run are of no use to this one
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_id, self.round = -1, -1
        self.offered: dict[str, Blob] = {}
        self.uploads: dict[tuple[str, str], _Upload] = {}  # (site, root) -> upload
        self.refusals: Counter[str] = Counter()
        self.bytes_in = self.bytes_out = 0
        self._landed = 0  # chunks written, all uploads: every TRIM_EVERY of them, glibc gives freed pages back
        self._lock = threading.Lock()
        # site, round, figures: a site's evaluation of the round's model before its reply (round_hooks.EvalHook.report)
        self.on_report: Callable[[str, int, dict[str, float]], None] | None = None
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bulk"),
                                   options=rpc.SERVER_OPTIONS)
        methods = {
            "Ping": grpc.unary_unary_rpc_method_handler(self._ping, rpc.identity, rpc.identity),
            "Begin": grpc.unary_unary_rpc_method_handler(self._begin, rpc.identity, rpc.identity),
            "Put": grpc.stream_unary_rpc_method_handler(self._put, rpc.identity, rpc.identity),
            "Get": grpc.unary_stream_rpc_method_handler(self._get, rpc.identity, rpc.identity),
            "Report": grpc.unary_unary_rpc_method_handler(self._report, rpc.identity, rpc.identity),
            **probe_handlers(self._site, self._abort),  # the link probe (link_probe_server.py)
        }
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(rpc.SERVICE, methods)])
        creds = grpc.ssl_server_credentials([(bundle.tls_key.read_bytes(), bundle.tls_cert.read_bytes())],
                                            root_certificates=bundle.ca_cert.read_bytes(), require_client_auth=True)
        self.port = self._server.add_secure_port(address, creds)
        if not self.port:
            raise OSError(f"the bulk data server cannot listen on {address} (in use?)")

    def start(self) -> "BulkServer":
        """Serve (on the server's own threads); returns self."""
        self._server.start()
        return self

    def stop(self) -> None:
        """Stop serving and delete every upload's file."""
        self._server.stop(grace=1.0).wait(5)
        self.withdraw()
        with self._lock:
            for up in self.uploads.values():
                _close(up)
            self.uploads.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- what the driver does ---------------------------------------------------------------------
    def window(self, run_id: int, rnd: int) -> None:
        """Uploads are taken for round `rnd` of run `run_id` from now on (and no other)."""
        self.run_id, self.round = run_id, rnd

    def offer(self, blob: Blob) -> str:
        """Serve `blob` to the sites until `withdraw`; its root. The blob is spilled to a file under
        WORKDIR/bulk first (unless it was written there) and served from there, so the coordinator
        does not hold a serialized copy of the model while the stage waits for the sites' updates."""
        root = blob.root
        with self._lock:
            if root in self.offered:
                if self.offered[root] is not blob:
                    blob.close()  # the same bytes again (a file BlobWriter wrote: deleted)
                return root
        try:
            if blob.path is None:  # not yet on disk (bulk_path.offer_arrays writes its blob's file itself)
                blob.spill(str(self.dir / f"offer-{root[:16]}"))
        except OSError as err:  # a full or read-only disk: serve it from memory, as it is
            log.warning("bulk data path: cannot spill blob %s to %s (%s); serving it from memory", root[:12],
                        self.dir, err)
        with self._lock:
            self.offered[root] = blob
        return root

    def withdraw(self) -> None:
        """Stop serving what was offered (the stage is over) and delete the files."""
        with self._lock:
            blobs, self.offered = list(self.offered.values()), {}
        for blob in blobs:
            blob.close()

    def take(self, site: str, root: str, size: int, chunk: int) -> memoryview:
        """The verified blob `site` uploaded as `root`, a read-only map of its file (BulkRefused:
        never uploaded by this site, incomplete, or of another size; the caller counts it)."""
        with self._lock:
            up = self.uploads.get((site, root))
        if up is None:
            raise BulkRefused("missing", f"site {site} uploaded no blob {root[:12]} in this round")
        if (up.size, up.chunk) != (size, chunk):
            raise BulkRefused("size_mismatch", f"blob {root[:12]} is {up.size} bytes, the reply says {size}")
        with up.lock:
            if up.missing:
                raise BulkRefused("incomplete", f"blob {root[:12]} from {site}: {len(up.missing)} of "
                                   f"{len(up.digests)} chunk(s) never arrived (truncated stream)")
        if size == 0:
            return memoryview(b"")
        with open(up.path, "rb") as f:
            return memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))

    def release(self, site: str, root: str) -> None:
        """Forget an upload (its file is deleted; a map of it stays readable until dropped)."""
        with self._lock:
            up = self.uploads.pop((site, root), None)
        if up is not None:
            _close(up)

    def release_all(self) -> None:
        """Forget every upload (a round is over)."""
        with self._lock:
            ups, self.uploads = list(self.uploads.values()), {}
        for up in ups:
            _close(up)

    def take_refusals(self) -> Counter[str]:
        """The refusals counted since the last call, as `bulk_<code>` counts."""
        with self._lock:
            out, self.refusals = Counter({f"bulk_{k}": v for k, v in self.refusals.items()}), Counter()
        return out

    # ---- the RPCs ---------------------------------------------------------------------------------
    def _refuse(self, code: str, detail: str) -> BulkRefused:
        with self._lock:
            self.refusals[code] += 1
        log.warning("bulk data path: refused (%s): %s", code, detail)
        return BulkRefused(code, detail)

    def _abort(self, context: grpc.ServicerContext, err: BulkRefused, status=grpc.StatusCode.PERMISSION_DENIED):
        context.abort(status, f"{err.reason}: {err.detail}")

    def _site(self, context: grpc.ServicerContext) -> str:
        """The site this call's client certificate names, if it is one of ours and not revoked."""
        pems = context.auth_context().get("x509_pem_cert") or []
        if not pems:
            raise self._refuse("no_client_cert", "no client certificate")
        cert = x509.load_pem_x509_certificate(pems[0])
        uris = []
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            uris = san.get_values_for_type(x509.UniformResourceIdentifier)
        except x509.ExtensionNotFound:
            pass
        prefix = f"spiffe://sovfl-{self.trust.federation_id}/site/"
        names = [u[len(prefix):] for u in uris if u.startswith(prefix)]
        if not names:
            raise self._refuse("wrong_federation", f"certificate names no site of federation {self.trust.federation_id}: {uris}")
        site = names[0]
        rec = self.trust.lookup(site)
        if rec is None:
            raise self._refuse("unknown_site", f"site {site!r} is not in the federation registry")
        if rec.revoked or cert.serial_number in self.trust.revoked_serials:
            raise self._refuse("revoked", f"site {site!r} is revoked")
        return site

    def _ping(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            site = self._site(context)
        except BulkRefused as err:
            self._abort(context, err)
        return rpc.encode({"site": site, "federation": self.trust.federation_id, "run": self.run_id,
                           "round": self.round})

    def _report(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """A site's evaluation figures for the open round, ahead of its reply (which still carries
        them, signed, for the metrics line): handed to `on_report`. Refused, and counted, when the
        caller is not a site of ours, the round is not the open one or the figures are not numbers."""
        try:
            site = self._site(context)
            body = rpc.decode(request)
            self._check_window(site, int(body["run"]), int(body["round"]))
            figures = report_figures(body["metrics"])
        except BulkRefused as err:
            self._abort(context, err)
        except (KeyError, TypeError, ValueError, OverflowError) as err:
            self._abort(context, self._refuse("bad_report", f"an evaluation report that is not "
                                              f"{{run, round, metrics: {{eval_loss, num_val_examples}}}}: {err}"),
                        grpc.StatusCode.INVALID_ARGUMENT)
        if self.on_report is not None:
            self.on_report(site, int(body["round"]), figures)
        return rpc.encode({})

    def _check_window(self, site: str, run: int, rnd: int) -> None:
        if run != self.run_id:
            raise self._refuse("stale_run", f"site {site}: upload for run {run}, this run is {self.run_id}")
        if rnd != self.round:
            raise self._refuse("stale_round", f"site {site}: upload for round {rnd}, round {self.round} is open")

    def _begin(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            site = self._site(context)
            try:
                begin = rpc.parse_begin(request)
            except BulkRefused as err:
                raise self._refuse(err.code, f"site {site}: {err.detail}") from None
            run, rnd, root, size, chunk, digests = (begin.run, begin.round, begin.root, begin.size, begin.chunk,
                                                    begin.digests)
            self._check_window(site, run, rnd)
            free = shutil.disk_usage(self.dir).free
            with self._lock:
                up = self.uploads.get((site, root))
                if up is None:
                    if size > free:
                        raise self._refuse("no_space", f"site {site}: {size} bytes do not fit the {free} free")
                    path = self.dir / f"{site}-{run}-{rnd}-{root[:16]}"
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                    os.ftruncate(fd, size)
                    up = self.uploads[(site, root)] = _Upload(site, run, rnd, size, chunk, digests, path, fd)
        except BulkRefused as err:
            self._abort(context, err)
        return rpc.encode({"missing": up.missing})

    def _put(self, requests, context: grpc.ServicerContext) -> bytes:
        try:
            site = self._site(context)
            meta = dict(context.invocation_metadata())
            try:
                head = rpc.decode(meta[rpc.PUT_HEADER].encode())
                run, rnd, root = int(head["run"]), int(head["round"]), str(head["root"])
            except (ValueError, KeyError, TypeError) as err:
                raise self._refuse("bad_request", f"site {site}: unreadable Put header ({type(err).__name__})") from None
            self._check_window(site, run, rnd)
            with self._lock:
                up = self.uploads.get((site, root))
            if up is None or (up.run, up.round) != (run, rnd):
                raise self._refuse("not_begun", f"site {site}: Put for blob {root[:12]} without its Begin")
            for msg in requests:
                try:
                    index, data = rpc.check_chunk(msg, up.size, up.chunk, up.digests)
                except BulkRefused as err:
                    raise self._refuse(err.code, f"site {site}, blob {root[:12]}: {err.detail}") from None
                os.pwrite(up.fd, data, index * up.chunk)
                with up.lock:
                    up.have.add(index)
                with self._lock:
                    self.bytes_in += len(data)
                    self._landed += 1
                    trim = self._landed % TRIM_EVERY == 0
                del msg, data
                if trim:
                    trim_freed()
        except BulkRefused as err:
            self._abort(context, err)
        finally:
            trim_freed()
        with up.lock:
            return rpc.encode({"missing": up.missing})

    def _get(self, request: bytes, context: grpc.ServicerContext):
        try:
            site = self._site(context)
            try:
                req = rpc.decode(request)
                root = str(req["root"])
                wanted = req.get("chunks")
                wanted = None if wanted is None else [int(i) for i in wanted]
            except (ValueError, KeyError, TypeError, OverflowError) as err:
                raise self._refuse("bad_request", f"site {site}: unreadable Get ({type(err).__name__})") from None
            with self._lock:
                blob = self.offered.get(root)
            if blob is None:
                raise self._refuse("not_offered", f"site {site}: blob {root[:12]} is not offered now (stage over?)")
            indices = range(blob.count) if wanted is None else wanted
            if any(not 0 <= i < blob.count for i in indices):
                raise self._refuse("chunk_out_of_range", f"site {site}: asked for chunks beyond the blob's {blob.count}")
        except BulkRefused as err:
            self._abort(context, err)
        yield rpc.encode({"size": blob.size, "chunk": blob.chunk, "digests": [d.hex() for d in blob.digests]})
        for i in indices:
            try:
                piece = blob.piece(i)
            except OSError:  # withdrawn while this stream read it: the stage is over
                self._abort(context, self._refuse("not_offered", f"site {site}: blob {root[:12]} was withdrawn"))
            with self._lock:
                self.bytes_out += len(piece)
            yield rpc.chunk_message(i, piece)
        trim_freed()


def report_figures(metrics: object) -> dict[str, float]:
    """The figures of an evaluation report: a finite `eval_loss`, `num_val_examples` >= 0 and, if
    given, a finite `eval_accuracy` (ValueError, TypeError or KeyError otherwise)."""
    if not isinstance(metrics, dict):
        raise TypeError("metrics is not an object")
    out = {"eval_loss": float(metrics["eval_loss"]), "num_val_examples": float(int(metrics["num_val_examples"]))}
    if "eval_accuracy" in metrics:
        out["eval_accuracy"] = float(metrics["eval_accuracy"])
    if not all(math.isfinite(v) for v in out.values()) or out["num_val_examples"] < 0:
        raise ValueError(f"figures must be finite, examples >= 0: {out}")
    return out


def _close(up: _Upload) -> None:
    try:
        os.close(up.fd)
    except OSError:
        pass
    try:
        up.path.unlink()
    except OSError:
        pass
