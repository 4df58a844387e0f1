"""Ring arithmetic, mask expansion and the fixed-point codec (with its error bound)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.secagg import ring
from crypto.secagg.encoding import FixedPointCodec
from crypto.secagg.errors import SecAggConfigError
from crypto.secagg.prg import MaskExpander, expand

bits_st = st.integers(ring.MIN_BITS, ring.MAX_BITS)
words = st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(bits=bits_st, a=words, data=st.data())
def test_ring_ops_match_integer_arithmetic(bits: int, a: list[int], data: st.DataObject) -> None:
    b = data.draw(st.lists(st.integers(0, (1 << 32) - 1), min_size=len(a), max_size=len(a)))
    m = 1 << bits
    A, B = np.array(a, np.uint32), np.array(b, np.uint32)
    assert ring.add(A, B, bits).tolist() == [(x + y) % m for x, y in zip(a, b)]
    assert ring.sub(A, B, bits).tolist() == [(x - y) % m for x, y in zip(a, b)]
    assert ring.neg(A, bits).tolist() == [(-x) % m for x in a]
    assert ring.add(ring.sub(A, B, bits), B, bits).tolist() == [x % m for x in a]


@settings(max_examples=40, deadline=None)
@given(key=st.binary(min_size=32, max_size=32), n=st.integers(1, 300), off=st.integers(0, 50), cut=st.integers(1, 64))
def test_masks_have_random_access_and_chunking_does_not_matter(key: bytes, n: int, off: int, cut: int) -> None:
    whole = expand(key, off + n)
    ex = MaskExpander(4 * (1 + cut % 5))  # pieces smaller and larger than the chunks
    parts = [ex.keystream(key, o, min(cut, off + n - o)) for o in range(off, off + n, cut)]
    assert np.array_equal(np.concatenate(parts), whole[off:])


def test_apply_masks_adds_every_signed_mask() -> None:
    keys = [bytes([i]) * 32 for i in range(3)]
    signs = [1, -1, 1]
    out = np.arange(1001, dtype=np.uint32)
    MaskExpander(64).apply_masks(out[7:], list(zip(keys, signs)), 7)
    want = np.arange(1001, dtype=np.uint32)[7:]
    for k, s in zip(keys, signs):
        want = ring.add(want, expand(k, 994, 7), 32) if s > 0 else ring.sub(want, expand(k, 994, 7), 32)
    assert np.array_equal(out[7:], want)


def test_pairwise_masks_cancel_in_the_ring() -> None:
    key = bytes(range(32))
    a = np.zeros(1000, np.uint32)
    b = np.arange(1000, dtype=np.uint32)
    ex = MaskExpander(64)
    for o in range(0, 1000, 256):
        ex.apply_masks(a[o : o + 256], [(key, +1)], o)
        ex.apply_masks(b[o : o + 256], [(key, -1)], o)
    assert np.array_equal(ring.add(a, b, 32), np.arange(1000, dtype=np.uint32))


def _codec(bits: int = 32, n: int = 5, w: int = 100, clip: float = 2.0) -> FixedPointCodec:
    return FixedPointCodec.for_round(clip, bits, w, n)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.integers(16, 32),
    n=st.integers(1, 8),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
def test_decoded_mean_is_within_the_stated_bound(bits: int, n: int, seed: int, data: st.DataObject) -> None:
    max_w = data.draw(st.integers(1, 50))
    codec = FixedPointCodec.for_round(1.5, bits, max_w, n)
    rng = np.random.default_rng(seed)
    m = data.draw(st.integers(1, n))  # contributors may be fewer than the clients counted
    xs = [rng.uniform(-3, 3, 64).astype(np.float32) for _ in range(m)]
    ws = [data.draw(st.integers(1, max_w)) for _ in range(m)]
    total = np.zeros(65, np.uint32)
    for x, w in zip(xs, ws):
        total = ring.add(total, codec.encode(x, w, rng), bits)
    assert int(total[-1]) == sum(ws)
    dec = codec.decode(total)
    want = sum(w * np.clip(x.astype(np.float64), -1.5, 1.5) for x, w in zip(xs, ws)) / sum(ws)
    assert np.max(np.abs(dec - want)) <= codec.error_bound(m, sum(ws))


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(16, 32), n=st.integers(1, 6), seed=st.integers(0, 2**32), data=st.data())
def test_out_of_range_inputs_encode_exactly_as_their_clipped_values(bits: int, n: int, seed: int,
                                                                     data: st.DataObject) -> None:
    """Clipping is detected from the encoded words, not scanned for: the result must be bit-for-bit
    that of clipping first (same noise), for values just past the range, far past it and +-inf."""
    max_w = data.draw(st.integers(1, 50))
    codec = FixedPointCodec.for_round(1.0, bits, max_w, n)
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 1.0, 300)
    picks = rng.choice(300, size=data.draw(st.integers(0, 40)), replace=False)
    x[picks] = rng.choice([1.0 + 1e-7, -1.0 - 1e-7, 1.5, -7.0, 1e30, -1e30, np.inf, -np.inf], size=picks.size)
    x = x.astype(np.float32)
    w = data.draw(st.integers(0, max_w))
    got = codec.encode(x, w, np.random.default_rng(seed))
    assert np.array_equal(got, codec.encode(np.clip(x, -1.0, 1.0), w, np.random.default_rng(seed)))
    assert got[:-1].max(initial=0) <= w * codec.levels


def test_extreme_inputs_do_not_wrap() -> None:
    n, w = 7, 33
    codec = _codec(bits=20, n=n, w=w)
    rng = np.random.default_rng(0)
    x = np.array([np.inf, 1e9, 2.0, -2.0, -np.inf], np.float32)
    enc = [codec.encode(x, w, rng) for _ in range(n)]
    total = np.sum(np.stack(enc).astype(np.uint64), axis=0)
    assert total.max() < 1 << 20  # the integer sum itself is below 2^b: no wraparound
    dec = codec.decode(total.astype(np.uint32))
    assert np.allclose(dec, [2, 2, 2, -2, -2], atol=codec.error_bound(n, n * w))


def test_float32_inputs_at_the_clip_bound_do_not_wrap() -> None:
    """32-bit ring, weight * levels ~ 5e8: x * scale must be formed in float64 (in float32, -clip
    rounds below -half and the word wraps to ~2^32)."""
    codec = FixedPointCodec.for_round(0.5, 32, 1000, 4)
    x = np.array([-0.5, 0.5, -0.5, 0.25], np.float32)  # in range: encoded without the clip pass
    enc = codec.encode(x, 506, np.random.default_rng(0))
    assert int(enc[:-1].max()) <= 506 * codec.levels
    assert np.allclose(codec.decode(enc), x, atol=codec.error_bound(1, 506))


@pytest.mark.parametrize("bits,w,n,max_w", [(8, 1, 1, 1), (32, 1000, 10, 1000)])
def test_stochastic_rounding_is_unbiased(bits: int, w: int, n: int, max_w: int) -> None:
    """Coarse grid (255 levels), and a 32-bit ring where w * L * x needs float64: computed in
    float32 it would round to 24 bits and lose the stochastic rounding altogether."""
    codec = FixedPointCodec.for_round(1.0, bits, max_w, n)
    x = np.full(20000, 0.3217, np.float32)
    enc = codec.encode(x, w, np.random.default_rng(1))
    exact = (float(x[0]) + 1.0) * w * codec.levels / 2.0  # the unrounded encoding
    assert abs(float(np.mean(enc[:-1], dtype=np.float64)) - exact) < 0.05  # 0.05 unit: ~14 sigma
    assert np.unique(enc[:-1]).tolist() == [int(exact), int(exact) + 1]  # the two neighbouring levels only


def test_codec_rejects_what_cannot_work() -> None:
    with pytest.raises(SecAggConfigError, match="cannot hold"):
        FixedPointCodec.for_round(1.0, 8, 1000, 10)
    codec = _codec()
    with pytest.raises(ValueError, match="weight"):
        codec.encode(np.zeros(3, np.float32), 101, np.random.default_rng())
    with pytest.raises(ValueError, match="weight"):
        codec.encode(np.zeros(3, np.float32), 1.5, np.random.default_rng())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(np.array([np.nan], np.float32), 1, np.random.default_rng())


@settings(max_examples=80, deadline=None)
@given(bits=bits_st, data=st.data())
def test_words_pack_at_the_ring_width_and_unpack_exactly(bits: int, data: st.DataObject) -> None:
    vals = data.draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=0, max_size=70))
    w = np.array(vals, np.uint32)
    packed = ring.pack_words(w, bits)
    assert packed.dtype == np.uint8 and packed.shape[0] == (len(vals) * bits + 7) // 8  # b bits per value
    assert ring.unpack_words(packed, bits, len(vals)).tolist() == vals
    if len(vals) * bits % 8:  # a set padding bit is refused: one word vector, one encoding
        bad = packed.copy()
        bad[-1] |= np.uint8(0x80)
        with pytest.raises(ValueError, match="padding"):
            ring.unpack_words(bad, bits, len(vals))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), w=st.integers(1, 5000), levels=st.sampled_from([2, 14, 254, 65534]),
       clip=st.sampled_from([0.01, 0.5, 3.0]))
def test_the_auto_ring_is_the_narrowest_whose_sum_cannot_wrap(n: int, w: int, levels: int, clip: float) -> None:
    """bits unset: the round's ring comes from the codec's levels, the largest weight and the
    number of sites; n sites at the extreme (every value at the top level, weight W) sum to
    n * W * L < 2^b, and one bit less could wrap (unless at the 8-bit floor)."""
    from crypto.secagg import SecAggConfig

    try:
        codec = SecAggConfig(clip=clip, max_weight=5000).codec(n, w, levels)
    except SecAggConfigError:
        assert (n * w * levels).bit_length() > ring.MAX_BITS  # refused only when no ring is wide enough
        return
    top = n * w * levels
    assert top < 1 << codec.bits and codec.levels == levels and codec.max_weight == w
    assert codec.bits == ring.MIN_BITS or top >= 1 << (codec.bits - 1)
    x = np.array([clip, -clip, clip, 0.0], np.float32)
    enc = [codec.encode(x, w, np.random.default_rng(i)) for i in range(n)]
    total = np.sum(np.stack(enc).astype(np.uint64), axis=0)
    assert int(total.max()) <= top < 1 << codec.bits  # the integer sum itself stays in the ring
    assert np.allclose(codec.decode(total.astype(np.uint32)), [clip, -clip, clip, 0.0], atol=codec.error_bound(n, n * w))


def test_extreme_inputs_through_a_masked_round_in_the_auto_ring_do_not_wrap() -> None:
    """A real SecAgg+ round (masks, dropout) in the auto-chosen 18-bit ring, every site at +clip
    with the largest weight: the unmasked sum decodes to +clip exactly, not to a wrapped value."""
    from crypto.secagg import SecAggConfig, new_context
    from crypto.secagg.simulation import run_round

    cfg = SecAggConfig(threshold=3, neighbours="auto", clip=0.5, max_weight=200, chunk_bytes=64)
    ids = [3, 8, 13, 21, 34]
    updates = {i: np.full(37, 0.5, np.float32) for i in ids}
    sim = run_round(cfg, new_context("wrap", 1), updates, {i: 200 for i in ids}, drop_after={13: 2}, value_levels=254)
    assert sim.server.params.codec.bits == (5 * 200 * 254).bit_length() == 18
    assert np.allclose(sim.result.decode(), 0.5, atol=1e-6)
