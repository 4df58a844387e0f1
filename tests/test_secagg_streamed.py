"""SecAgg+ masking from the trainer's hand-off file, a chunk at a time, into a file: the
masked chunks, their manifest and the unmasked sum are bit for bit those of masking the update whole
(real crypto, real server), an update with NaN or Inf is refused before any mask is drawn, and the
masked upload of a ~300 MiB update runs in a fresh process within the chunk window's memory (a
peak resident set read from the kernel: a memory assertion, not a timed one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import RecordDict

from conftest import secagg_to_stage3
from crypto.secagg import ChunkManifest, SecAggClient, SecAggConfig, ring
from crypto.secagg.prg import PIECE_WORDS
from federation.ops.supervisor import free_port
from federation.protocol.bulk import REF_STYPE, resolve
from federation.protocol.codecs import UpdateError, UpdateSpec
from federation.protocol.message_keys import SECAGG_CHUNKS
from federation.protocol.secagg_records import chunk_key
from federation.site.masked_stream import UpdateValues, mask_to_file, writer_for
from federation.site.secagg_mod import chunk_array
from site_trainer import handoff

ROOT = Path(__file__).resolve().parents[1]


def _update(seed: int = 4) -> dict[str, np.ndarray]:
    """Tensors whose sorted order is not the file's order, of every dtype an update travels in."""
    rng = np.random.default_rng(seed)
    bf16 = (rng.standard_normal(70001).astype(np.float32).view(np.uint32) >> 16).astype("<u2")  # raw bf16 words
    return {"z.w": rng.normal(0, 0.4, (300, 701)).astype(np.float32),  # spans several pieces and chunks
            "a.bf16": bf16, "m.f64": rng.normal(0, 0.3, 12345), "b.scalar": np.array(0.25, np.float32),
            "c.empty": np.zeros((0, 3), np.float32), "q.f16": rng.normal(0, 0.2, 999).astype(np.float16)}


def _reader(arrays: dict[str, np.ndarray]) -> handoff.Reader:
    handle = handoff.write_arrays(arrays, tag="test-secagg-update")
    try:
        return handoff.Reader(handle)
    finally:
        handoff.release(handle.path)  # the descriptor keeps it readable, as in the ClientApp


def _twins(client: SecAggClient) -> SecAggClient:
    return SecAggClient.from_state(client.config, client.to_state())


def test_update_values_read_from_the_file_are_the_flattened_update():
    arrays = _update()
    want = UpdateSpec.of(arrays).flatten(arrays)
    with _reader(arrays) as reader:
        values = UpdateValues(reader)
        assert values.length == want.shape[0]
        values.check_finite()
        for off, n in [(0, 5), (3, 210300), (210299, 70003), (want.shape[0] - 7, 7), (0, want.shape[0]), (10, 0)]:
            got = values.read(off, n)
            assert got.dtype == np.float32 and np.array_equal(got, want[off:off + n]), (off, n)
        assert np.array_equal(values.whole(), want)
        with pytest.raises(ValueError, match="outside"):
            values.read(want.shape[0] - 1, 2)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_an_update_with_nan_or_inf_is_refused_by_tensor_before_masking(bad):
    arrays = _update()
    arrays["m.f64"][7000] = bad
    with _reader(arrays) as reader, pytest.raises(UpdateError, match=r"\['m.f64'\] contain NaN or Inf"):
        UpdateValues(reader).check_finite()
    with _reader({"i": np.arange(4, dtype=np.int32)}) as reader, pytest.raises(UpdateError, match="floating point"):
        UpdateValues(reader)


@pytest.mark.parametrize("bits,chunk_bytes", [(32, 1 << 20), (21, 8000), (17, 65536)])
def test_masked_from_the_file_is_bit_for_bit_the_whole_masking(tmp_path, bits, chunk_bytes):
    """One client masks its update from the hand-off file into a file, a twin (the same round state)
    masks the same update whole as before; the chunks, their .npy bytes and the manifest are equal,
    and the server's unmasked sum (with two other clients masking whole) is the exact encoded sum."""
    arrays = _update()
    x = UpdateSpec.of(arrays).flatten(arrays)
    p = x.shape[0]
    cfg = SecAggConfig(threshold=2, neighbours="auto", clip=1.0, bits=bits, chunk_bytes=chunk_bytes)
    ctx, clients, srv = secagg_to_stage3(cfg, [4, 7, 9], p, weight_bound=50)
    others = {i: np.random.default_rng(i).normal(0, 0.5, p).astype(np.float32) for i in (7, 9)}
    weights = {4: 13, 7: 50, 9: 1}
    twin = _twins(clients[4])

    # whole, as secagg_mod.on_train masks an update that is not in a file
    req = srv.masked_input_request(4)
    whole, whole_manifest = {}, ChunkManifest()
    for off, words in twin.masked_input(req, x, weights[4], rng=np.random.default_rng(11)):
        packed = ring.pack_words(words, bits)
        whole[chunk_key(off)] = chunk_array(packed)
        whole_manifest.add(off, words.shape[0], packed)
    assert len(whole) >= 2  # several chunks (of several pieces at 32 bits), a ragged last one

    with _reader(arrays) as reader:
        values = UpdateValues(reader)
        writer = writer_for(clients[4], values, bits, "t4", directory=tmp_path)
        assert os.path.getsize(writer.path) == writer.size  # reserved before any mask is drawn
        masked, manifest = mask_to_file(clients[4], req, values, weights[4], writer, rng=np.random.default_rng(11))
    try:
        assert manifest == whole_manifest.encode()
        inline = masked.inline_records()
        assert list(inline.keys()) == list(whole.keys())
        for k, arr in whole.items():
            got = (inline[k].dtype, tuple(inline[k].shape), inline[k].stype)
            assert got == (arr.dtype, tuple(arr.shape), arr.stype)
            assert bytes(inline[k].data) == bytes(arr.data), k
        assert masked.packed_bytes == sum(len(a.data) - 128 for a in whole.values())  # .npy headers of 128 bytes
        # the references resolve, from the blob as the coordinator receives it, to the same Arrays
        rd = RecordDict({SECAGG_CHUNKS: masked.records()})
        assert all(a.stype == REF_STYPE for a in rd.array_records[SECAGG_CHUNKS].values())
        with open(masked.blob.path, "rb") as f:
            blob = f.read()
        resolve(rd, lambda ref: blob)
        for k, arr in whole.items():
            assert bytes(rd.array_records[SECAGG_CHUNKS][k].data) == bytes(arr.data), k

        # the coordinator's unmasking is unchanged: the streamed client's chunks enter the real sum
        for k, arr in inline.items():
            packed = np.frombuffer(bytes(arr.data)[128:], np.uint8)
            count = min(srv.params.chunk_words, p + 1 - int(k))
            srv.add_masked_chunk(4, int(k), ring.unpack_words(packed, bits, count))
        for i in (7, 9):
            for off, words in clients[i].masked_input(srv.masked_input_request(i), others[i], weights[i],
                                                      rng=np.random.default_rng(i)):
                srv.add_masked_chunk(i, off, words)
        for i in srv.close_masked_input():
            srv.receive_unmask(i, clients[i].unmask(srv.unmask_request(i)))
        res = srv.finish()
        codec = srv.params.codec
        want = codec.encode(x, weights[4], np.random.default_rng(11)).astype(np.uint64)
        for i in (7, 9):
            want += codec.encode(others[i], weights[i], np.random.default_rng(i))
        assert np.array_equal(res.ring_sum, (want % (1 << bits)).astype(np.uint32))
    finally:
        masked.close()
    assert not os.path.exists(writer.path)


def test_masked_input_from_asks_for_pieces_in_order_and_checks_what_it_gets():
    cfg = SecAggConfig(threshold=2, clip=1.0, bits=32, chunk_bytes=1 << 20)
    p = 3 * PIECE_WORDS + 5
    x = np.random.default_rng(0).normal(0, 0.5, p).astype(np.float32)
    ctx, clients, srv = secagg_to_stage3(cfg, [1, 2], p)
    asked = []

    def read(off, n):
        asked.append((off, n))
        return x[off:off + n]

    list(clients[1].masked_input_from(srv.masked_input_request(1), p, read, 1))
    assert asked[0][0] == 0 and all(n <= PIECE_WORDS for _, n in asked)
    assert all(a[0] + a[1] == b[0] for a, b in zip(asked, asked[1:])) and sum(n for _, n in asked) == p
    gen = clients[2].masked_input_from(srv.masked_input_request(2), p, lambda off, n: np.zeros(n, np.int64), 1)
    with pytest.raises(ValueError, match="expected .* floats"):
        next(gen)


_SITE = r"""
import json, sys, threading, time
import numpy as np
from crypto.pki import SiteBundle
from crypto.secagg import SecAggClient, SecAggConfig
from federation.protocol.malloc_policy import return_freed_tensors
from federation.site.bulk_client import BulkClient
from federation.site.masked_stream import UpdateValues, mask_to_file, writer_for
from site_trainer import handoff

return_freed_tensors()  # as the ClientApp does at import

address, bundle_dir, update_json, state_path = sys.argv[1:5]
with open(state_path) as f:
    st = json.load(f)
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024
peak = [0]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)
client = SecAggClient.from_state(SecAggConfig.model_validate_json(st["config"]), bytes.fromhex(st["state"]))
request = bytes.fromhex(st["request"])
bulk = BulkClient(address, SiteBundle.load(bundle_dir), streams=4)
bulk.ping()  # channels, TLS and gRPC's threads up before the baseline
reader = handoff.Reader(handoff.Handle.from_json(json.loads(update_json)))
base = rss()
t = threading.Thread(target=sample, daemon=True); t.start()
values = UpdateValues(reader)
values.check_finite()
writer = writer_for(client, values, st["bits"], "paris")
masked, manifest = mask_to_file(client, request, values, 3, writer)
bulk.upload(masked.blob, 7, 1, deadline_s=300)
stop.set(); t.join()
print(json.dumps({"base": base, "peak": peak[0], "root": masked.blob.root, "size": masked.blob.size,
                  "chunks": len(masked.chunks)}))
masked.close()
"""


@pytest.mark.slow(seconds=60)
def test_masked_upload_of_a_300mb_update_runs_in_chunk_window_memory(tmp_path):
    """Mask a 300 MiB float32 update from its hand-off file in a 32-bit ring (300 MiB of masked
    words), upload it to the real data path: the ClientApp's functions, in a fresh process."""
    from crypto.pki import CoordinatorBundle, provision
    from federation.coordinator.bulk_server import BulkServer
    from federation.protocol.bulk import CHUNK

    pki = tmp_path / "pki"
    provision(pki, ["paris"], hosts=("127.0.0.1", "localhost"))
    size, piece = 300 << 20, 15 << 20
    rng = np.random.default_rng(2)
    writer = handoff.Writer({f"t{i:02d}": ("<f4", (piece // 4,)) for i in range(size // piece)}, tag="test-300mb")
    with writer:
        for i in range(size // piece):
            writer.write(f"t{i:02d}", rng.normal(0, 0.3, piece // 4).astype(np.float32))
    p = size // 4
    cfg = SecAggConfig(threshold=2, clip=1.0, bits=32)
    ctx, clients, srv = secagg_to_stage3(cfg, [1, 2], p, weight_bound=10)
    state = tmp_path / "state.json"  # secret, as context.state holds it in the ClientApp
    state.write_text(json.dumps({"config": cfg.model_dump_json(), "state": clients[1].to_state().hex(),
                                 "request": srv.masked_input_request(1).hex(), "bits": srv.params.codec.bits}))
    port = free_port()
    server = BulkServer(CoordinatorBundle.load(pki / "coordinator"), tmp_path / "coord", f"127.0.0.1:{port}").start()
    try:
        server.window(7, 1)
        out = subprocess.run([sys.executable, "-c", _SITE, f"127.0.0.1:{port}", str(pki / "sites" / "paris"),
                              json.dumps(writer.handle.to_json()), str(state)],
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        taken = server.take("paris", got["root"], got["size"], CHUNK)  # every chunk arrived and verified
        assert len(taken) == got["size"] > size  # 32-bit words of 75M values, plus the .npy headers
        del taken
    finally:
        server.stop()
        handoff.release(writer.handle.path)
    assert got["chunks"] == -(-(p + 1) // cfg.chunk_words(32))
    above = got["peak"] - got["base"]
    # The window: the encoder's piece (0.5 MiB of values, 1 MiB of float64 scratch, 4 MiB of mask
    # keystream buffers), one chunk's words and its packed copy (2 x 4 MiB), the finiteness pass's
    # 16 MiB read, the blob's digests (8 chunks, 32 MiB), the upload's 4 streams x (16 MiB of gRPC
    # lookahead + 2 x 4 MiB messages), 64 MiB for the allocator between two trims. The update is
    # 300 MiB, its masked words 300 MiB more: masked whole, the ClientApp held both and more.
    # Measured: 95-97 MiB above the baseline at 300 MiB, 91 at 150 and 95 at 600 (flat: a window).
    window = 16 + 8 + 16 + 32 + 4 * (16 + 2 * 4) + 64
    assert above < window << 20, f"{above / 2**20:.0f} MiB above the baseline for a 300 MiB update"
