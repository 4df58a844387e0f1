"""The bulk data path's channel: real gRPC server and clients on loopback, mutual TLS with provisioned
certificates, and each refusal by its reason (wrong CA, revoked site, tampered chunk, replayed
stream, truncated stream, foreign blob)."""

from __future__ import annotations

import os
import socket

import grpc
import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from crypto.pki import CoordinatorBundle, SiteBundle, provision, revoke
from federation.coordinator.bulk_server import BulkServer
from federation.protocol import bulk_rpc as rpc
from federation.protocol.bulk import CHUNK, Blob, BulkRefused, Ref, offload, refs, resolve
from federation.protocol.payload_records import parse_array, to_array
from federation.site.bulk_client import BulkClient, BulkUnavailable


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    provision(root, ["paris", "berlin", "oslo"], hosts=("127.0.0.1", "localhost"))
    other = tmp_path_factory.mktemp("other-pki")
    provision(other, ["paris"], hosts=("127.0.0.1", "localhost"))
    revoke(root, "oslo")
    return root, other


@pytest.fixture
def server(pki, tmp_path):
    root, _ = pki
    srv = BulkServer(CoordinatorBundle.load(root / "coordinator"), tmp_path, f"127.0.0.1:{_port()}").start()
    srv.window(7, 1)
    yield srv
    srv.stop()


def client(pki_root, site: str, srv: BulkServer, streams: int = 3) -> BulkClient:
    return BulkClient(f"127.0.0.1:{srv.port}", SiteBundle.load(pki_root / "sites" / site), streams=streams)


def blob_of(nbytes: int, seed: int = 0) -> tuple[Blob, bytes]:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    half = nbytes // 3
    return Blob([data[:half], data[half:]]), data  # two buffers: a chunk straddles them


def test_upload_take_and_download_round_trip(pki, server):
    blob, data = blob_of(3 * CHUNK + 12345)
    c = client(pki[0], "paris", server)
    c.upload(blob, 7, 1, deadline_s=60)
    got = server.take("paris", blob.root, blob.size, blob.chunk)
    assert bytes(got) == data
    server.offer(blob)  # served from a file under WORKDIR/bulk: the blob lets go of its buffers
    assert blob.buffers == [] and os.path.exists(blob.path)
    assert bytes(c.download(Ref(blob.root, blob.size, blob.chunk, 0, blob.size, "x"), deadline_s=60)) == data
    assert c.ping()["site"] == "paris"
    spilled = blob.path
    server.withdraw()  # the stage is over: the file is gone and the blob is no longer served
    assert not os.path.exists(spilled)
    with pytest.raises(BulkRefused, match="not_offered"):
        c.download(Ref(blob.root, blob.size, blob.chunk, 0, blob.size, "x"), deadline_s=3)
    c.close()


def test_a_spilled_blob_serves_the_same_chunks(tmp_path):
    blob, data = blob_of(2 * CHUNK + 7)
    pieces = [bytes(blob.piece(i)) for i in range(blob.count)]
    root = blob.root
    blob.spill(str(tmp_path / "b"))
    assert [bytes(blob.piece(i)) for i in range(blob.count)] == pieces and b"".join(pieces) == data
    assert blob.root == root
    blob.close()
    assert not (tmp_path / "b").exists()


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_tensor_memory_goes_back_to_the_system():
    """With the threshold fixed, freed model-sized arrays leave the process. Without it (measured:
    0 MB back) glibc raises its threshold after a large block is freed, serves the next arrays from
    the heap and keeps them resident once a later allocation sits above them."""
    from federation.protocol.malloc_policy import return_freed_tensors

    assert return_freed_tensors()

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024

    big = np.ones(30 << 18, np.float32)  # 30 MiB, freed: what raises glibc's own threshold
    del big
    arrays = [np.ones(1 << 20, np.float32) for _ in range(16)]  # 16 x 4 MiB
    keep = np.ones(1 << 16, np.float32)  # allocated above them
    held = rss()
    del arrays
    assert rss() < held - (48 << 20)
    del keep
