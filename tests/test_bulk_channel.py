"""The bulk data path's channel: real gRPC server and clients on loopback, mutual TLS with provisioned
certificates, and each refusal by its reason (wrong CA, revoked site, tampered chunk, replayed
stream, truncated stream, foreign blob)."""

from __future__ import annotations

import os
from pathlib import Path

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
from federation.ops.supervisor import free_port


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
    srv = BulkServer(CoordinatorBundle.load(root / "coordinator"), tmp_path, f"127.0.0.1:{free_port()}").start()
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


def test_an_offer_that_cannot_be_spilled_is_served_from_memory(pki, server):
    blob, data = blob_of(CHUNK + 5)
    saved, server.dir = server.dir, server.dir / "missing" / "dir"  # the spill's open fails
    try:
        server.offer(blob)
    finally:
        server.dir = saved
    assert blob.path is None and blob.buffers
    c = client(pki[0], "paris", server)
    assert bytes(c.download(Ref(blob.root, blob.size, blob.chunk, 0, blob.size, "x"), deadline_s=60)) == data
    c.close()
    server.withdraw()


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
    the heap and keeps them resident once a later allocation sits above them. In a fresh process:
    this one's other threads and earlier allocations would blur the figure."""
    import subprocess
    import sys

    script = """
import numpy as np
from federation.protocol.malloc_policy import return_freed_tensors
assert return_freed_tensors()
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024
big = np.ones(30 << 18, np.float32); del big  # 30 MiB, freed: what raises glibc's own threshold
arrays = [np.ones(1 << 20, np.float32) for _ in range(16)]  # 16 x 4 MiB
keep = np.ones(1 << 16, np.float32)  # allocated above them
held = rss(); del arrays
print((held - rss()) >> 20)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 48, out.stdout  # MiB given back of the 64 freed


def test_wrong_ca_is_refused_at_the_handshake(pki, server):
    c = client(pki[1], "paris", server)  # a client certificate of another federation's CA
    with pytest.raises(grpc.RpcError) as err:
        c.ping(timeout_s=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    blob, _ = blob_of(1000)
    with pytest.raises(BulkUnavailable):
        c.upload(blob, 7, 1, deadline_s=2)
    assert not server.uploads


def test_revoked_site_is_refused(pki, server):
    c = client(pki[0], "oslo", server)
    blob, _ = blob_of(1000)
    with pytest.raises(BulkRefused) as err:
        c.upload(blob, 7, 1, deadline_s=10)
    assert err.value.code == "revoked"
    assert server.take_refusals()["bulk_revoked"] >= 1


def test_an_evaluation_report_reaches_the_driver_only_from_a_site_of_the_open_round(pki, server):
    # Report: a site's evaluation figures ahead of its reply (coordinator/evaluation.py EvalAnnouncer)
    heard = []
    server.on_report = lambda site, rnd, figures: heard.append((site, rnd, figures))
    paris = client(pki[0], "paris", server)
    paris.report(7, 1, {"eval_loss": 2.5, "num_val_examples": 40, "eval_accuracy": 0.25})
    assert heard == [("paris", 1, {"eval_loss": 2.5, "num_val_examples": 40.0, "eval_accuracy": 0.25})]
    refused = {"stale_round": (7, 2, {"eval_loss": 1.0, "num_val_examples": 4}),
               "stale_run": (8, 1, {"eval_loss": 1.0, "num_val_examples": 4}),
               "bad_report": (7, 1, {"eval_loss": float("nan"), "num_val_examples": 4})}
    for code, (run, rnd, figures) in refused.items():
        with pytest.raises(grpc.RpcError) as err:
            paris.report(run, rnd, figures)
        assert code in err.value.details()
    for missing in ({"eval_loss": 1.0}, {"num_val_examples": -1, "eval_loss": 1.0}, [1.0]):
        with pytest.raises(grpc.RpcError) as err:
            paris.report(7, 1, missing)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad_report" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client(pki[0], "oslo", server).report(7, 1, {"eval_loss": 1.0, "num_val_examples": 4})
    assert "revoked" in err.value.details()
    assert len(heard) == 1  # nothing refused reached the driver, and every refusal is counted
    counted = server.take_refusals()
    assert counted["bulk_bad_report"] == 4 and counted["bulk_stale_round"] == counted["bulk_stale_run"] == 1
    assert counted["bulk_revoked"] == 1
    paris.close()


def test_tampered_chunk_is_refused_and_never_counts(pki, server):
    blob, data = blob_of(2 * CHUNK + 10)
    c = client(pki[0], "paris", server, streams=1)
    begin = rpc.encode({"run": 7, "round": 1, "root": blob.root, "size": blob.size, "chunk": blob.chunk,
                        "digests": [d.hex() for d in blob.digests]})
    c._stub(0, "unary_unary", "Begin")(begin, timeout=10)
    bad = bytearray(blob.piece(1))
    bad[100] ^= 1
    head = ((rpc.PUT_HEADER, rpc.encode({"run": 7, "round": 1, "root": blob.root}).decode()),)
    with pytest.raises(grpc.RpcError) as err:
        c._stub(0, "stream_unary", "Put")(iter([rpc.chunk_message(1, bytes(bad))]), timeout=10, metadata=head)
    assert "bulk_chunk_digest" in err.value.details()
    with pytest.raises(BulkRefused) as took:
        server.take("paris", blob.root, blob.size, blob.chunk)
    assert took.value.code == "incomplete"
    assert server.take_refusals()["bulk_chunk_digest"] == 1
    c.upload(blob, 7, 1, deadline_s=30)  # the honest upload goes on with what is missing
    assert bytes(server.take("paris", blob.root, blob.size, blob.chunk)) == data


def test_truncated_stream_is_never_handed_over(pki, server):
    blob, _ = blob_of(3 * CHUNK)
    c = client(pki[0], "paris", server, streams=1)
    begin = rpc.encode({"run": 7, "round": 1, "root": blob.root, "size": blob.size, "chunk": blob.chunk,
                        "digests": [d.hex() for d in blob.digests]})
    c._stub(0, "unary_unary", "Begin")(begin, timeout=10)
    head = ((rpc.PUT_HEADER, rpc.encode({"run": 7, "round": 1, "root": blob.root}).decode()),)
    reply = rpc.decode(c._stub(0, "stream_unary", "Put")(iter([rpc.chunk_message(0, blob.piece(0))]), timeout=10,
                                                         metadata=head))
    assert reply["missing"] == [1, 2]
    with pytest.raises(BulkRefused) as took:
        server.take("paris", blob.root, blob.size, blob.chunk)
    assert took.value.code == "incomplete"


def test_replayed_stream_of_another_round_or_run_is_refused(pki, server):
    blob, _ = blob_of(5000)
    c = client(pki[0], "paris", server)
    c.upload(blob, 7, 1, deadline_s=10)
    server.window(7, 2)  # the next round: the same stream again is a replay
    with pytest.raises(BulkRefused) as err:
        c.upload(blob, 7, 1, deadline_s=10)
    assert err.value.code == "stale_round"
    with pytest.raises(BulkRefused) as err:
        c.upload(blob, 6, 2, deadline_s=10)
    assert err.value.code == "stale_run"


def test_a_blob_of_another_site_is_not_taken_as_ours(pki, server):
    blob, _ = blob_of(5000)
    client(pki[0], "berlin", server).upload(blob, 7, 1, deadline_s=10)
    with pytest.raises(BulkRefused) as err:
        server.take("paris", blob.root, blob.size, blob.chunk)
    assert err.value.code == "missing"


def test_chunk_beyond_the_announced_size_is_refused(pki, server):
    blob, _ = blob_of(1000)
    c = client(pki[0], "paris", server, streams=1)
    begin = rpc.encode({"run": 7, "round": 1, "root": blob.root, "size": blob.size, "chunk": blob.chunk,
                        "digests": [d.hex() for d in blob.digests]})
    c._stub(0, "unary_unary", "Begin")(begin, timeout=10)
    head = ((rpc.PUT_HEADER, rpc.encode({"run": 7, "round": 1, "root": blob.root}).decode()),)
    for msg, code in ((rpc.chunk_message(5, b"x" * 10), "bulk_chunk_out_of_range"),
                      (rpc.chunk_message(0, bytes(blob.piece(0)) + b"extra"), "bulk_chunk_size")):
        with pytest.raises(grpc.RpcError) as err:
            c._stub(0, "stream_unary", "Put")(iter([msg]), timeout=10, metadata=head)
        assert code in err.value.details()


def test_offload_and_resolve_a_message(pki, server):
    big = np.arange(600_000, dtype=np.float32)
    rd = RecordDict({"global": ArrayRecord({"w": to_array(big), "b": to_array(np.ones(3, np.float32))}),
                     "config": ConfigRecord({"round": 1})})
    blob, out = offload(rd)
    assert rd["global"]["w"].stype == "numpy.ndarray"  # the original is left as it was
    assert set(refs(out)) == {blob.root} and len(out["global"]["b"].data) < 1000
    server.offer(blob)
    c = client(pki[0], "berlin", server)
    n = resolve(out, lambda ref: c.download(ref, 30))
    assert n == blob.size
    np.testing.assert_array_equal(parse_array(out["global"]["w"]), big)
    np.testing.assert_array_equal(parse_array(out["global"]["b"]), np.ones(3, np.float32))


def test_malformed_reference_is_refused_by_name():
    for data in (b"not json", b'{"root": "zz", "size": 1, "chunk": 1, "offset": 0, "length": 1, "stype": "x"}',
                 os.urandom(64)):
        with pytest.raises(BulkRefused) as err:
            Ref.decode(data)
        assert err.value.reason == "bulk_ref_malformed"
