"""The coordinator's fold from spilled updates (the coordinator's memory at scale): the same mean as the
in-memory WeightedMean bit for bit, independent of arrival order, FedAvg applied in place, and
sealed updates opened chunk by chunk with a tampered chunk leaving nothing in the sum. Real
provisioned keys, real envelopes, real PlainRound."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

import federation.coordinator.spilled_mean as spilled_mean
from crypto.envelope import DecryptionFailed, DigestMismatch, ReplayGuard, make_envelope, open_envelope, open_envelope_stream
from crypto.pki import CoordinatorBundle, SiteBundle, provision
from federation.config.schema import FederationConfig
from federation.coordinator.aggregate import ServerOptimizer, WeightedMean
from federation.coordinator.plain_round import PlainRound
from federation.coordinator.spilled_mean import SpilledMean
from federation.coordinator.strategy import Reply, RoundInput
from federation.ops.inprocess import task_identity
from federation.protocol import message_keys as keys
from federation.protocol.codecs.base import bf16_to_float32
from federation.protocol.payload_records import to_records
from federation.protocol.pipeline import RoundContext, UpdateRejected
from federation.protocol.wire_dtypes import to_master
from federation.site.protection_mod import SiteProtection

SPEC = {"w": ("<f4", (37, 11)), "b": ("<u2", (300,)), "s": ("<f4", ())}  # float32, bf16 words, a scalar


def _update(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    bf16 = (rng.standard_normal(300).astype(np.float32).view(np.uint32) >> 16).astype("<u2")
    return {"w": rng.standard_normal((37, 11)).astype(np.float32) * 10 ** rng.uniform(-3, 3),
            "b": bf16, "s": np.array(rng.standard_normal(), np.float32)}


def _reference(updates: list[tuple[str, dict, int]]) -> dict:
    """WeightedMean, the formula the fold keeps, over the updates in the given order."""
    m = WeightedMean()
    for _, u, n in updates:
        m.add(to_master(u, SPEC), n)
    return m.result()


@pytest.fixture(autouse=True)
def small_slices(monkeypatch):
    monkeypatch.setattr(spilled_mean, "SLICE", 64)  # many slices per tensor, and a tensor's last one short


def test_fold_is_weightedmean_bit_for_bit_and_order_free(tmp_path):
    updates = [(f"site{i}", _update(i), n) for i, n in enumerate((3, 1000, 7, 1))]
    want = _reference(updates)  # site order = sorted order: the fold's
    for perm in itertools.permutations(updates):
        sm = SpilledMean(SPEC, tmp_path)
        for site, u, n in perm:
            sm.add_arrays(site, to_master(u, SPEC), n)
        got = sm.result()
        for k in want:
            assert got[k].dtype == np.float32 and got[k].tobytes() == want[k].tobytes(), k
        assert list(tmp_path.iterdir()) == []  # the files went with the mean


@pytest.mark.parametrize("kind,lr", [("delta", 1.0), ("delta", 0.7), ("weights", 1.0), ("weights", 0.5)])
def test_fedavg_in_place_is_the_optimizer_step(tmp_path, kind, lr):
    updates = [(f"s{i}", _update(10 + i), 5 + i) for i in range(3)]
    model = to_master(_update(99), SPEC)
    want = ServerOptimizer("fedavg", kind, lr).step({k: v.copy() for k, v in model.items()}, _reference(updates))
    sm = SpilledMean(SPEC, tmp_path)
    for site, u, n in updates:
        sm.add_arrays(site, to_master(u, SPEC), n)
    arrays = {k: v for k, v in model.items()}
    got = ServerOptimizer("fedavg", kind, lr).step(model, sm, consume=True, in_place=True)
    assert got is not model  # a new model object: the downlink's caches follow it
    for k in want:
        assert got[k].tobytes() == want[k].tobytes(), k
    assert got["w"] is arrays["w"]  # written into the old model's array: no second model in memory


@pytest.mark.parametrize("kind,lr", [("delta", 0.7), ("weights", 1.0), ("weights", 0.5)])
def test_dense_fedavg_in_place_is_the_optimizer_step(kind, lr):
    """The SecAgg round's dense mean, applied in place by the driver: the same model."""
    model = to_master(_update(97), SPEC)
    mean = to_master(_update(96), SPEC)
    want = ServerOptimizer("fedavg", kind, lr).step({k: v.copy() for k, v in model.items()}, dict(mean))
    w = model["w"]
    got = ServerOptimizer("fedavg", kind, lr).step(model, dict(mean), consume=True, in_place=True)
    assert got is not model and got["w"] is w
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)


def test_fedadam_takes_the_dense_mean(tmp_path):
    updates = [(f"s{i}", _update(20 + i), 2) for i in range(2)]
    model = to_master(_update(98), SPEC)
    want = ServerOptimizer("fedadam", "delta", 0.1).step(model, _reference(updates))
    sm = SpilledMean(SPEC, tmp_path)
    for site, u, n in updates:
        sm.add_arrays(site, to_master(u, SPEC), n)
    got = ServerOptimizer("fedadam", "delta", 0.1).step(model, sm)
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)


# ---- the streaming open ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    out = tmp_path_factory.mktemp("pki")
    provision(out, ["site0", "site1"])
    return out


def test_stream_open_gives_what_open_envelope_gives_and_refuses_a_tampered_chunk(pki):
    site, coord = SiteBundle.load(pki / "sites" / "site0"), CoordinatorBundle.load(pki / "coordinator")
    payload = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 17, dtype=np.uint8)
    env = make_envelope(payload, signing_key=site.sign_key, federation_id=coord.federation_id, run_id=1,
                        round=1, site="site0", seal_to=site.coordinator_seal_public, chunk_size=4096)
    kw = dict(trust=coord.trust(), federation_id=coord.federation_id, run_id=1, round=1,
              recipient_key=coord.seal_key, require_sealed=True)
    got = np.zeros_like(payload)
    ranges = []
    h = open_envelope_stream(env, lambda off, b: got.__setitem__(slice(off, off + len(b)), np.frombuffer(b, np.uint8)),
                             workers=2, done_with=lambda lo, hi: ranges.append((lo, hi)), **kw)
    assert h.site == "site0" and got.tobytes() == payload.tobytes()
    assert got.tobytes() == open_envelope(env, **kw).payload.tobytes()
    assert ranges[0][0] == 0 and ranges[-1][1] == len(env.body)  # every body byte reported read
    body = np.array(env.body)
    body[2 * 4096 + 100] ^= 1  # the third chunk
    bad = type(env)(env.header, env.signature, body)
    with pytest.raises(DecryptionFailed):
        open_envelope_stream(bad, lambda off, b: None, **kw)
    plain = make_envelope(payload, signing_key=site.sign_key, federation_id=coord.federation_id, run_id=1,
                          round=1, site="site0", chunk_size=4096)
    body = np.array(plain.body)
    body[5000] ^= 1
    with pytest.raises(DigestMismatch):  # signed, not sealed: the tree digest over every chunk catches it
        open_envelope_stream(type(plain)(plain.header, plain.signature, body), lambda off, b: None,
                             **{**kw, "require_sealed": False})


def _reply(name: str, node: int, wire, n: int) -> Reply:
    with task_identity(1):
        rd = to_records(wire, keys.UPDATE, keys.UPDATE_META)
        rd[keys.STATUS] = ConfigRecord({"site": name, "ok": True, "num_examples": n})
        return Reply(name, node, Message(rd, dst_node_id=node, message_type="train"))


def _plain_round(pki, tmp_path, seal=True):
    fed = FederationConfig.model_validate({"name": "t", "seal": seal})
    coord = CoordinatorBundle.load(pki / "coordinator")
    ctx = RoundContext(coord.federation_id, 1, 1, "")
    model = to_master(_update(50), SPEC)
    inp = RoundInput(ctx, [1, 2], {}, model, SPEC, lambda d: (lambda node: RecordDict()), lambda line: None)
    return PlainRound(fed, coord, ReplayGuard(), spill_dir=tmp_path / "spill"), inp, ctx, coord


def _sealed(pki, name: str, ctx: RoundContext, u: dict, seal=True):
    from federation.protocol.pipeline import Payload
    return SiteProtection(SiteBundle.load(pki / "sites" / name), seal).encode(Payload(u, {}), ctx.for_site(name))


@pytest.mark.parametrize("seal", [True, False])
def test_plain_round_streams_sealed_updates_and_a_tampered_one_leaves_the_sum_untouched(pki, tmp_path, seal):
    rnd, inp, ctx, coord = _plain_round(pki, tmp_path, seal)
    fed_id = coord.federation_id
    ctx = RoundContext(fed_id, 1, 1, "")
    u0, u1 = _update(1), _update(2)
    st = rnd.begin(inp)
    assert st.stream is not None
    rnd.receive_update(st, _reply("site0", 1, _sealed(pki, "site0", ctx, u0, seal), 4))
    wire = _sealed(pki, "site1", ctx, u1, seal)
    wire.arrays["envelope"] = wire.arrays["envelope"].copy()
    wire.arrays["envelope"][len(wire.arrays["envelope"]) // 2] ^= 0x10  # one chunk of the 2nd site's envelope
    rnd.receive_update(st, _reply("site1", 2, wire, 6))
    out = rnd.finish(st)
    reason = "decrypt_failed" if seal else "digest_mismatch"
    assert out.rejections == {reason: 1} and out.failed["site1"].startswith(f"rejected {reason}")
    assert out.count == 1 and sorted(p.name.split("-")[0] for p in (tmp_path / "spill").iterdir()) == ["site0"]
    mean = out.mean.result()
    want = _reference([("site0", u0, 4)])
    assert all(mean[k].tobytes() == want[k].tobytes() for k in want)  # site0 alone, bit for bit
    assert list((tmp_path / "spill").iterdir()) == []


def test_plain_round_stream_refuses_bad_tensors_by_reason(pki, tmp_path):
    rnd, inp, ctx, coord = _plain_round(pki, tmp_path)
    st = rnd.begin(inp)
    ctx = RoundContext(coord.federation_id, 1, 1, "")
    nan = _update(3)
    nan["w"][5, 5] = np.nan
    rnd.receive_update(st, _reply("site0", 1, _sealed(pki, "site0", ctx, nan), 4))
    short = _update(4)
    short["b"] = short["b"][:10]
    rnd.receive_update(st, _reply("site1", 2, _sealed(pki, "site1", ctx, short), 4))
    out = rnd.finish(st)
    assert out.rejections == {"non_finite": 1, "wrong_shape": 1} and out.mean is None and out.count == 0
    assert list((tmp_path / "spill").iterdir()) == []


def test_plain_round_stream_matches_the_in_memory_fold(pki, tmp_path):
    """Sealed and streamed, two sites, bf16 words among the tensors: the mean is WeightedMean's."""
    rnd, inp, ctx, coord = _plain_round(pki, tmp_path)
    st = rnd.begin(inp)
    ctx = RoundContext(coord.federation_id, 1, 1, "")
    ups = [("site1", _update(7), 9), ("site0", _update(8), 2)]  # arriving out of sorted order
    for i, (name, u, n) in enumerate(ups):
        rnd.receive_update(st, _reply(name, i + 1, _sealed(pki, name, ctx, u), n))
    out = rnd.finish(st)
    assert out.count == 2 and not out.rejections
    want = _reference(sorted(ups, key=lambda t: t[0]))
    got = out.mean.result()
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)
    assert bf16_to_float32(ups[0][1]["b"]).dtype == got["b"].dtype  # bf16 words averaged as float32


def test_tied_tensors_are_not_stepped_twice(tmp_path):
    """Two names over one buffer (tied weights): the step is not written in place."""
    buf = np.ones(8, np.float32)
    model = {"a": buf, "b": buf}
    spec = {"a": ("<f4", (8,)), "b": ("<f4", (8,))}
    sm = SpilledMean(spec, tmp_path)
    sm.add_arrays("s", {"a": np.full(8, 2, np.float32), "b": np.full(8, 2, np.float32)}, 1)
    got = ServerOptimizer("fedavg", "delta", 1.0).step(model, sm, in_place=True)
    assert got["a"].tolist() == [3.0] * 8 and got["b"].tolist() == [3.0] * 8 and buf.tolist() == [1.0] * 8
    got = ServerOptimizer("fedavg", "delta", 1.0).step(model, {"a": np.ones(8, np.float32), "b": np.ones(8, np.float32)},
                                                       in_place=True)
    assert got["a"].tolist() == [2.0] * 8 and buf.tolist() == [1.0] * 8


def test_checkpoint_file_is_written_tensor_by_tensor_and_is_safetensors_bytes(tmp_path):
    from safetensors.numpy import load

    from federation.coordinator.checkpoint import encode_arrays, write_arrays
    rng = np.random.default_rng(0)
    arrays = {"b": rng.standard_normal((3, 5)).astype(np.float32), "a": np.arange(7, dtype=np.int64),
              "c": np.array(2.5, np.float32), "d": np.zeros((0, 3), np.float32), "e": np.array([1, 2], "<u2"),
              "f": np.array([True, False]), "g": rng.standard_normal((4, 6)).astype(np.float32)[:, ::2],
              "h": np.arange(3, dtype=np.uint8), "i": np.arange(3, dtype=np.float64), "j": np.arange(2, dtype=np.uint64),
              "k": np.arange(3, dtype=np.int32), "l": np.arange(3, dtype=np.float16), "m": np.arange(3, dtype=np.uint32),
              "n": np.arange(3, dtype=np.int8), "o": np.arange(3, dtype=np.int16)}
    entry = write_arrays(tmp_path / "x.safetensors", arrays)
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert raw == encode_arrays(arrays) and entry["bytes"] == len(raw)
    import hashlib
    assert entry["sha256"] == hashlib.sha256(raw).hexdigest()
    back = load(raw)
    assert all(back[k].dtype == arrays[k].dtype and np.array_equal(back[k], arrays[k]) for k in arrays)


def test_stream_path_fuzz_hostile_but_signed_layouts_and_flipped_bytes(pki, tmp_path):
    """A few hundred hostile inputs through the streamed path: signed layouts that lie (offsets past
    the payload, huge shapes, wrong dtypes, junk JSON) and flipped envelope bytes. Each is refused by
    a reason and counted; nothing is left on disk; no exception escapes the round."""
    import json

    from federation.protocol.envelope_layout import as_payload
    from federation.protocol.pipeline import Payload
    rng = np.random.default_rng(7)
    rnd, inp, _, coord = _plain_round(pki, tmp_path, seal=True)
    site = SiteBundle.load(pki / "sites" / "site0")
    good = _update(5)
    layout = [[k, v.dtype.str, list(v.shape), 0] for k, v in good.items()]
    total = sum(v.nbytes for v in good.values())

    def hostile_meta(i: int) -> bytes:
        lay = [list(e) for e in layout]
        off = 0
        for e in lay:
            e[3] = off
            off += int(np.prod(e[2], dtype=np.int64)) * np.dtype(e[1]).itemsize
        e = lay[int(rng.integers(len(lay)))]
        kind = i % 7
        if kind == 0:
            e[3] = int(rng.integers(total, 2**62))
        elif kind == 1:
            e[2] = [int(rng.integers(1, 2**31)), int(rng.integers(1, 2**31))]
        elif kind == 2:
            e[1] = str(rng.choice(["|O", "<c8", "S4", "<f4x", "<i8"]))
        elif kind == 3:
            e[0] = "other"
        elif kind == 4:
            lay = lay[:-1]
        elif kind == 5:
            return bytes(rng.integers(0, 256, int(rng.integers(0, 40)), dtype=np.uint8))
        else:
            e[2] = [-1]
        return json.dumps({"layout": lay, "meta": {}}).encode()

    refused = 0
    for i in range(140):
        st = rnd.begin(inp)
        ctx = RoundContext(coord.federation_id, 1, 1, "site0")
        body = np.concatenate([np.ascontiguousarray(v).reshape(-1).view(np.uint8) for v in good.values()])
        env = make_envelope(body, signing_key=site.sign_key, federation_id=coord.federation_id, run_id=1, round=1,
                            site="site0", seal_to=site.coordinator_seal_public, meta=hostile_meta(i), chunk_size=4096)
        rnd.replay = ReplayGuard()
        st.stream.replay = rnd.replay
        rnd.receive_update(st, _reply("site0", 1, as_payload(env), 3))
        refused += sum(st.out.rejections.values())
        assert list((tmp_path / "spill").iterdir()) == []
    for i in range(60):  # flipped bytes anywhere in a genuine sealed envelope
        st = rnd.begin(inp)
        st.stream.replay = ReplayGuard()
        wire = _sealed(pki, "site0", RoundContext(coord.federation_id, 1, 1, ""), good)
        arr = wire.arrays["envelope"].copy()
        arr[int(rng.integers(len(arr)))] ^= int(rng.integers(1, 256))
        wire = Payload({"envelope": arr}, dict(wire.meta))
        rnd.receive_update(st, _reply("site0", 1, wire, 3))
        assert sum(st.out.rejections.values()) == 1 and st.mean.count == 0
        assert list((tmp_path / "spill").iterdir()) == []
    assert refused == 140


def test_a_full_spill_disk_refuses_the_update_by_name_and_the_round_goes_on(pki, tmp_path, monkeypatch):
    import errno

    import federation.coordinator.envelope_opener as opener
    rnd, inp, _, coord = _plain_round(pki, tmp_path)
    st = rnd.begin(inp)
    ctx = RoundContext(coord.federation_id, 1, 1, "")
    wire0, wire1 = _sealed(pki, "site0", ctx, _update(1)), _sealed(pki, "site1", ctx, _update(2))

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(opener.os, "pwrite", full)
        rnd.receive_update(st, _reply("site0", 1, wire0, 4))
    rnd.receive_update(st, _reply("site1", 2, wire1, 4))
    out = rnd.finish(st)
    assert out.rejections == {"spill_failed": 1} and "free disk space" in out.failed["site0"] and out.count == 1
    assert [p.name.split("-")[0] for p in (tmp_path / "spill").iterdir()] == ["site1"]
