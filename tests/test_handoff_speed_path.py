"""The hand-off's fast path crosses bit for bit: the update written once in its wire dtype into a
file allocated and mapped while the round trains, the delta formed a piece at a time (from the
global model's file mapped ahead, or read a piece at a time), a bf16 model of several pieces per
tensor; and the weights digest that replaced hashing every byte. One rank here (a real gloo
group of one); the resume, overlap and downlink references have their own tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from site_trainer import handoff, layout, update_pack
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig
from site_trainer.session import Session
from site_trainer.weights_digest import BLOCK_BYTES, WeightsDigest

# tensors that span several of update_pack's pieces, and one whose size is no multiple of anything
SHAPES = [(3 * update_pack.PIECE_BYTES // 2 + 777,), (1000, 1023), (5,), ()]


class Bf16Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in SHAPES)


def _cfg(tmp_path) -> TrainerConfig:
    return TrainerConfig(site=SiteConfig(id="s", partition=0), workload=WorkloadConfig(task="slm"), num_partitions=1,
                         socket=str(tmp_path / "s.sock"), workdir=str(tmp_path))


def _finite_words(rng, shape) -> np.ndarray:
    return np.asarray(rng.integers(0, 2**16, size=shape, dtype=np.uint16) & np.uint16(0xBFFF))  # no NaN/Inf patterns


def _delta_reference(new: np.ndarray, glob: np.ndarray) -> np.ndarray:
    """The delta as a whole tensor: float32 difference of the bf16 values, rounded to bf16 once."""
    t = torch.from_numpy(new.copy()).view(torch.bfloat16).float()
    g = torch.from_numpy(glob.copy()).view(torch.bfloat16).float()
    return (t - g).to(torch.bfloat16).view(torch.uint16).numpy()


@pytest.mark.parametrize("kind", ["delta", "weights"])
def test_bf16_update_crosses_bit_for_bit(single_rank_group, tmp_path, kind):
    model = Bf16Model()
    sess = Session(model, _cfg(tmp_path))
    rng = np.random.default_rng(0)
    glob = {f"w.{i}": _finite_words(rng, s) for i, s in enumerate(SHAPES)}
    new = {k: _finite_words(rng, v.shape) for k, v in glob.items()}
    h = handoff.write_arrays(glob, "speed-global")
    seen = {}

    def body(rnd):
        seen["loaded"] = {k: layout.to_wire(t.detach()).copy() for k, t in layout.named_tensors(model).items()}
        seen["premapped"] = sess._current.premapped is not None
        with torch.no_grad():
            for k, t in layout.named_tensors(model).items():
                t.copy_(torch.from_numpy(new[k]).view(torch.bfloat16))
        rnd.report(num_examples=1)

    try:
        reply = sess.serve_one("Train", {"round": 1, "global": h.to_json(), "config": {"update_kind": kind}}, body)
        assert reply["ok"], reply
        for k in glob:  # the model in: every bit of the relay's file
            np.testing.assert_array_equal(seen["loaded"][k], glob[k])
        assert seen["premapped"] == (kind == "delta")
        with handoff.Reader(handoff.Handle.from_json(reply["update"])) as upd:
            for k in glob:
                got = upd[k]
                assert got.dtype == np.uint16 and got.shape == glob[k].shape
                want = _delta_reference(new[k], glob[k]) if kind == "delta" else new[k]
                np.testing.assert_array_equal(got, want)
        handoff.release(reply["update"]["path"])
        expect = WeightsDigest()
        for k in glob:
            expect.update(torch.from_numpy(new[k]))
        assert reply["rank_digests"] == [expect.hexdigest()]
    finally:
        handoff.release(h.path)


def test_delta_of_a_float32_global_without_the_mapping(tmp_path):
    """The fallback path (global read a piece at a time, update written with pwrite) gives the same
    bits as the whole-tensor formula, a float32 global first rounded to bf16."""
    rng = np.random.default_rng(1)
    shape = SHAPES[0]
    t = torch.from_numpy(_finite_words(rng, shape)).view(torch.bfloat16)
    g32 = rng.normal(size=shape).astype(np.float32)
    spec = layout.TensorSpec("x", torch.bfloat16, shape)
    gh = handoff.write_arrays({"x": g32}, "speed-g32")
    try:
        with handoff.Reader(gh) as reader, handoff.Writer({"x": ("<u2", shape)}, "speed-upd") as writer:
            update_pack.UpdatePacker(writer, {"x": spec}, reader).delta("x", t)
        with handoff.Reader(writer.handle) as out:
            got = out["x"]
        want = (t.float() - torch.from_numpy(g32).to(torch.bfloat16).float()).to(torch.bfloat16)
        np.testing.assert_array_equal(got, want.view(torch.uint16).numpy())
    finally:
        handoff.release(gh.path)
        handoff.release(writer.handle.path)


def test_allocated_writer_maps_writes_in_place_and_lets_go(tmp_path):
    rng = np.random.default_rng(2)
    arrays = {"a": rng.normal(size=(3, 5000)).astype(np.float32), "b": np.arange(7, dtype=np.uint16)}
    w = handoff.Writer({k: (v.dtype.str, v.shape) for k, v in arrays.items()}, "speed-alloc", allocate=True)
    try:
        assert w.target("a") is not None and w.allocate_s is not None
        w.write("a", arrays["a"])
        w.write_range("b", 4, arrays["b"][2:])
        w.write_range("b", 0, arrays["b"][:2])
        w.close()
        assert w.target("a") is None  # the mapping is gone with the close
        with handoff.Reader(w.handle) as r:
            for k, v in arrays.items():
                np.testing.assert_array_equal(r[k], v)
        with pytest.raises(ValueError, match="outside"):
            with handoff.Writer({"a": ("<f4", (2,))}, "speed-alloc", allocate=True) as w2:
                w2.write_range("a", 4, np.zeros(2, dtype=np.float32))
    finally:
        handoff.release(w.handle.path)
        handoff.release(w2.handle.path)


def test_weights_digest_is_exact_about_bytes_and_free_of_how_they_are_cut():
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=5 * BLOCK_BYTES + 123, dtype=np.uint8)
    whole = WeightsDigest()
    whole.update(torch.from_numpy(raw))
    pieces = WeightsDigest()
    pieces.update(torch.from_numpy(raw[:2 * BLOCK_BYTES]), last=False)
    pieces.update(torch.from_numpy(raw[2 * BLOCK_BYTES:]))
    assert whole.hexdigest() == pieces.hexdigest()
    as_bf16 = WeightsDigest()  # the same bytes through another dtype: the same digest
    as_bf16.update(torch.from_numpy(raw[:-1].copy()).view(torch.bfloat16))
    as_bytes = WeightsDigest()
    as_bytes.update(torch.from_numpy(raw[:-1].copy()))
    assert as_bf16.hexdigest() == as_bytes.hexdigest()
    for pos in (0, BLOCK_BYTES + 17, len(raw) - 1):  # one bit anywhere, in a block or in the tail
        flipped = raw.copy()
        flipped[pos] ^= 1
        d = WeightsDigest()
        d.update(torch.from_numpy(flipped))
        assert d.hexdigest() != whole.hexdigest(), pos
    swapped = raw.copy()  # two blocks trade places: the sums' order changes
    swapped[:BLOCK_BYTES], swapped[BLOCK_BYTES:2 * BLOCK_BYTES] = raw[BLOCK_BYTES:2 * BLOCK_BYTES], raw[:BLOCK_BYTES]
    d = WeightsDigest()
    d.update(torch.from_numpy(swapped))
    assert d.hexdigest() != whole.hexdigest()
    split = WeightsDigest()  # the same bytes as two tensors: their boundary counts
    split.update(torch.from_numpy(raw[:BLOCK_BYTES]))
    split.update(torch.from_numpy(raw[BLOCK_BYTES:]))
    assert split.hexdigest() != whole.hexdigest()
    with pytest.raises(ValueError, match="whole 4 KiB blocks"):
        WeightsDigest().update(torch.from_numpy(raw[:100]), last=False)
