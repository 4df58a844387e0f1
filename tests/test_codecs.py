"""Codec library: round trips, error-feedback bookkeeping, bounds, shared seeds, configs, SecAgg."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from federation.protocol.codecs import (
    CodecConfig,
    CodecConfigError,
    CodecRound,
    CodecStateError,
    Encoded,
    MetadataError,
    ProtectionConfigError,
    UpdateError,
    UpdateSpec,
    pack_bits,
    parse_codec,
    shared_indices,
    unpack_bits,
    validate_for_protection,
)
from federation.protocol.codecs.bitpack import rice_decode, rice_encode

ALL_SPECS = [
    "identity",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "int16",
    "int8:clip=2.0",
    "int4:clip=2.0",
    "topk:0.05",
    "topk:0.05:index=int32",
    "randk:0.1",
    "topk:0.01+int8",
    "topk:0.005+int4",
    "randk:0.1+int8:clip=2.0",
    "randk:0.1+int4:clip=2.0",
    "topk:0.1+bf16",
]


def make_update(seed: int = 0, scale: float = 0.5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "layer1.weight": (rng.standard_normal((40, 31)) * scale).astype(np.float32),
        "layer1.bias": (rng.standard_normal(31) * scale).astype(np.float32),
        "head.weight": (rng.standard_t(3, (31, 10)) * scale).astype(np.float32),  # heavy tails
    }


def flat(update: dict[str, np.ndarray]) -> np.ndarray:
    return UpdateSpec.of(update).flatten(update)


def test_import_stays_free_of_torch_and_flwr() -> None:
    code = (
        "import sys, federation.protocol.codecs; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'flwr')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_round_trip_shapes_bytes_and_metadata(spec: str) -> None:
    update = make_update()
    codec = parse_codec(spec)
    enc, state = codec.encode(update, None, CodecRound(1, 99, site_seed=1))
    assert state == {}
    out = codec.decode(enc, UpdateSpec.of(update), CodecRound(1, 99))
    assert set(out) == set(update)
    for name, arr in update.items():
        assert out[name].shape == arr.shape and out[name].dtype == np.float32
    assert enc.nbytes == sum(a.nbytes for a in enc.arrays.values())
    assert enc.dense_nbytes == 4 * sum(a.size for a in update.values())
    assert enc.compression_ratio == pytest.approx(enc.dense_nbytes / enc.nbytes)
    # Everything maps onto Flower records: 1-D numpy arrays and scalar metadata, nothing pickled.
    assert all(isinstance(a, np.ndarray) and a.ndim == 1 for a in enc.arrays.values())
    assert all(type(v) in (int, float, str) for v in enc.meta.values())


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if s != "identity"])
def test_residual_holds_exactly_what_was_not_sent(spec: str) -> None:
    codec = parse_codec(spec, error_feedback=True)
    layout = UpdateSpec.of(make_update())
    state: dict[str, np.ndarray] = {}
    for rnd in range(1, 4):
        update = make_update(seed=rnd)
        enc, new_state = codec.encode(update, state, CodecRound(rnd, 1234, site_seed=5))
        decoded = flat(codec.decode(enc, layout))
        old = flat(state) if state else np.zeros(layout.numel, np.float32)
        np.testing.assert_allclose(flat(update) + old, decoded + flat(new_state), rtol=0, atol=1e-5)
        assert all(v.dtype == np.float32 for v in new_state.values())
        state = new_state


def test_without_error_feedback_topk_sends_the_largest_magnitudes() -> None:
    update = make_update()
    x = flat(update)
    enc, state = parse_codec("topk:0.05").encode(update, {"ignored": np.zeros(1)}, CodecRound(1, 1))
    assert state == {}
    decoded = flat(parse_codec("topk:0.05").decode(enc, UpdateSpec.of(update)))
    kept = np.flatnonzero(decoded)
    k = round(0.05 * x.size)
    assert kept.size == k
    assert np.abs(x[kept]).min() >= np.sort(np.abs(x))[-k]
    np.testing.assert_array_equal(decoded[kept], x[kept])


@pytest.mark.parametrize("spec", ["int8", "int4", "int16", "int8:block=7", "topk:0.2+int4"])
def test_block_quantizer_error_is_below_the_block_scale(spec: str) -> None:
    """Documented bound: |decoded - x| < s per element, s = max|x| over its block / qmax."""
    update = make_update(3)
    layout = UpdateSpec.of(update)
    codec = parse_codec(spec)
    enc, _ = codec.encode(update, None, CodecRound(1, 1, site_seed=3))
    x, d = flat(update), flat(codec.decode(enc, layout))
    if codec.sparsifier is not None:
        idx = codec.sparsifier.support(enc.arrays, enc.meta, layout.numel, None)
        assert np.count_nonzero(np.delete(d, idx)) == 0
        x, d = x[idx], d[idx]
    block = codec.config.block_size
    expected = np.abs(np.pad(x, (0, -x.size % block))).reshape(-1, block).max(1) / codec.values.qmax
    np.testing.assert_allclose(enc.arrays["scales"], expected, rtol=1e-6)
    scales = np.repeat(enc.arrays["scales"], block)[: x.size]
    assert (np.abs(d - x) < scales).all()


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_clip_quantizer_error_bound_and_clipping(bits: int) -> None:
    clip = 1.0
    codec = parse_codec(f"int{bits}:clip={clip}")
    update = make_update(4, scale=0.8)
    enc, _ = codec.encode(update, None, CodecRound(1, 1, site_seed=4))
    x, d = flat(update), flat(codec.decode(enc, UpdateSpec.of(update)))
    scale = clip / (2 ** (bits - 1) - 1)
    inside = np.abs(x) <= clip
    assert inside.sum() > 100 and (~inside).sum() > 10
    assert (np.abs(d - x)[inside] < scale * (1 + 1e-6)).all()
    assert (np.abs(d[~inside]) <= clip + 1e-6).all()
    assert (np.abs(np.abs(d[~inside]) - clip) < scale * (1 + 1e-6)).all()


@pytest.mark.parametrize("spec", ["int8", "int4", "int4:clip=1.0", "randk:0.5+int8:clip=1.0"])
def test_stochastic_rounding_is_unbiased(spec: str) -> None:
    """Mean over T independent encodings converges to x: per element within 6 sigma, and the
    overall mean error within 5 sigma, where sigma uses the worst-case rounding std scale/2."""
    rng = np.random.default_rng(0)
    update = {"w": (rng.uniform(-0.9, 0.9, 600)).astype(np.float32)}
    layout = UpdateSpec.of(update)
    codec = parse_codec(spec)
    trials = 300
    total = np.zeros(600)
    for t in range(trials):
        enc, _ = codec.encode(update, None, CodecRound(7, 7, site_seed=t))
        total += flat(codec.decode(enc, layout))
    x = update["w"].astype(np.float64)
    if codec.sparsifier is not None:
        idx = shared_indices(7, 7, 600, codec.sparsifier.k(600))
        x = x[idx]
        total = total[idx]
    if codec.config.clip is None:
        blocks = np.abs(np.pad(x, (0, -x.size % 128))).reshape(-1, 128).max(1)
        scale = np.repeat(blocks / codec.values.qmax, 128)[: x.size]
    else:
        scale = np.full(x.size, codec.config.clip / codec.values.qmax)
    err = total / trials - x
    sigma = scale / 2 / np.sqrt(trials)
    assert (np.abs(err) < 6 * sigma).all()
    assert abs(err.mean()) < 5 * np.sqrt((sigma**2).sum()) / x.size


def test_fp16_and_bf16_relative_error_bounds() -> None:
    update = make_update(5)
    x = flat(update)
    normal = np.abs(x) >= 2**-14
    for spec, rel in (("fp16", 2**-11), ("bf16", 2**-8)):
        codec = parse_codec(spec)
        enc, _ = codec.encode(update, None, CodecRound(1, 1))
        d = flat(codec.decode(enc, UpdateSpec.of(update)))
        assert (np.abs(d - x)[normal] <= rel * np.abs(x)[normal]).all()


def test_bf16_rounds_to_nearest_even_like_torch() -> None:
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    ulp = 2.0**-7
    ties = np.array([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 2 + 2 * ulp / 2 * 3], dtype=np.float32)
    rng = np.random.default_rng(1)
    spread = rng.standard_normal(10_000) * 10.0 ** rng.integers(-20, 20, 10_000)
    values = np.concatenate([ties, spread.astype(np.float32)])
    codec = parse_codec("bf16")
    enc, _ = codec.encode({"v": values}, None, CodecRound(1, 1))
    ours = enc.arrays["values"]
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    assert codec.decode(enc, UpdateSpec.of({"v": values}))["v"][0] == 1.0  # tie -> even mantissa
    # Near float32 max the rounding would give Inf; it is clamped to the largest finite bf16.
    big = {"v": np.array([3.4e38, -3.4e38], dtype=np.float32)}
    enc, _ = codec.encode(big, None, CodecRound(1, 1))
    assert np.isfinite(codec.decode(enc, UpdateSpec.of(big))["v"]).all()


def test_fp16_clamps_instead_of_overflowing_and_error_feedback_keeps_the_excess() -> None:
    update = {"v": np.array([1e6, -1e6, 1.0], dtype=np.float32)}
    codec = parse_codec("fp16", error_feedback=True)
    enc, state = codec.encode(update, None, CodecRound(1, 1))
    d = codec.decode(enc, UpdateSpec.of(update))["v"]
    assert np.isfinite(d).all() and d[0] == 65504.0
    assert state["v"][0] == pytest.approx(1e6 - 65504.0)


# --- shared-seed random-k -------------------------------------------------------------------------


def test_random_k_same_seed_same_indices_on_every_site() -> None:
    codec = parse_codec("randk:0.1+int8:clip=2.0")
    layout = UpdateSpec.of(make_update())
    supports = []
    for site in range(3):
        update = make_update(seed=100 + site)  # different data per site
        enc, _ = codec.encode(update, None, CodecRound(5, 2024, site_seed=site))
        assert set(enc.arrays) == {"values"}  # no indices on the wire
        supports.append(codec.sparsifier.support(enc.arrays, enc.meta, layout.numel, CodecRound(5, 2024)))
    for s in supports[1:]:
        np.testing.assert_array_equal(s, supports[0])
    idx = supports[0]
    assert idx.size == codec.sparsifier.k(layout.numel)
    assert (np.diff(idx) > 0).all() and idx[0] >= 0 and idx[-1] < layout.numel


def test_random_k_changes_with_round_and_seed_and_is_uniform() -> None:
    n, k = 5000, 500
    base = shared_indices(11, 1, n, k)
    assert not np.array_equal(base, shared_indices(11, 2, n, k))
    assert not np.array_equal(base, shared_indices(12, 1, n, k))
    np.testing.assert_array_equal(base, shared_indices(11, 1, n, k))
    assert not base.flags.writeable  # cached arrays are shared, so read-only
    counts = np.zeros(n)
    for rnd in range(200):
        counts[shared_indices(3, rnd, n, k)] += 1
    # each coordinate picked with probability k/n = 0.1: mean 20, binomial std ~4.2
    assert counts.mean() == pytest.approx(20)
    assert counts.min() > 0 and counts.max() < 45
    assert abs(counts[: n // 2].sum() - counts[n // 2 :].sum()) < 0.05 * counts.sum()


def test_random_k_indices_are_pinned_across_numpy_versions() -> None:
    """Raw Philox output is a stable stream; if this changes, sites on different numpy versions
    would pick different coordinates and SecAgg sums would be garbage."""
    idx = shared_indices(42, 7, 1_000_000, 10)
    assert idx.tolist() == PINNED_RANDK


PINNED_RANDK = [142258, 169881, 236497, 246550, 283060, 341895, 623042, 668105, 800342, 895668]


def test_random_k_rejects_replayed_round() -> None:
    codec = parse_codec("randk:0.1")
    update = make_update()
    enc, _ = codec.encode(update, None, CodecRound(3, 77))
    with pytest.raises(MetadataError, match="stale or replayed"):
        codec.decode(enc, UpdateSpec.of(update), CodecRound(4, 78))


# --- bit packing ----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(width=st.integers(0, 40), data=st.data())
def test_pack_bits_round_trip(width: int, data: st.DataObject) -> None:
    count = data.draw(st.integers(0, 300))
    hi = 2**width - 1
    values = np.array(data.draw(st.lists(st.integers(0, hi), min_size=count, max_size=count)), dtype=np.uint64)
    packed = pack_bits(values, width)
    assert packed.nbytes == (count * width + 7) // 8
    np.testing.assert_array_equal(unpack_bits(packed, width, count), values)


@settings(max_examples=80, deadline=None)
@given(st.sets(st.integers(0, 99_999), max_size=400))
def test_rice_delta_coding_round_trip(index_set: set[int]) -> None:
    idx = np.array(sorted(index_set), dtype=np.int64)
    unary, low, r = rice_encode(idx)
    np.testing.assert_array_equal(rice_decode(unary, low, r, idx.size, 100_000), idx)


def test_rice_coding_beats_int32_indices() -> None:
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(1_000_000, 5_000, replace=False))
    unary, low, _ = rice_encode(idx)
    bits_per_index = 8 * (unary.nbytes + low.nbytes) / idx.size
    assert bits_per_index < 10  # vs 32 for int32; mean gap 200 -> ~log2(200) + 1.6 bits


# --- configs and protection -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("identity", "identity"),
        ("none", "identity"),
        ("FP16", "fp16"),
        ("int8", "int8:block=128"),
        ("int4:block=64", "int4:block=64"),
        ("int8:clip=0.05", "int8:clip=0.05"),
        ("topk:1%", "topk:0.01:index=delta"),
        ("topk:0.01:index=int32+int8", "topk:0.01:index=int32+int8:block=128"),
        ("randk:0.1+int8:clip=0.5", "randk:0.1+int8:clip=0.5"),
        ("randk:0.1+identity", "randk:0.1"),
    ],
)
def test_spec_strings_parse_to_canonical_form(text: str, canonical: str) -> None:
    codec = parse_codec(text, error_feedback=True)
    assert codec.spec == canonical
    assert codec.error_feedback
    assert parse_codec(canonical).spec == canonical  # canonical form is a fixed point
    assert CodecConfig.model_validate(text).spec == canonical


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("gzip", "unknown codec stage"),
        ("int8+topk:0.1", "sparsify first"),
        ("topk", "needs a fraction"),
        ("topk:2", "fraction must be in"),
        ("topk:abc", "not a number"),
        ("int8:block=64:clip=1", "not both"),
        ("int8:bits=3", "unknown option"),
        ("int8+int4", "at most one quantizer"),
        ("topk:0.1+", "empty"),
        ("int8:block=0", "block_size"),
        ("int8:clip=-1", "clip"),
    ],
)
def test_bad_spec_strings_raise_config_errors(text: str, fragment: str) -> None:
    with pytest.raises(CodecConfigError, match=fragment):
        parse_codec(text)


def test_codec_config_is_a_pydantic_model_usable_in_a_parent_schema() -> None:
    class RunConfig(BaseModel):
        codec: CodecConfig = CodecConfig()

    cfg = RunConfig.model_validate({"codec": "topk:0.01+int8"})
    assert cfg.codec.sparsifier == "topk" and cfg.codec.quantizer == "int8"
    cfg = RunConfig.model_validate({"codec": {"quantizer": "int8", "clip": 0.1, "error_feedback": True}})
    assert cfg.codec.build().spec == "int8:clip=0.1" and cfg.codec.linear_under_masks
    with pytest.raises(Exception, match="clip applies to int quantizers"):
        CodecConfig(quantizer="bf16", clip=1.0)


@pytest.mark.parametrize(
    "spec", ["identity", "int8:clip=0.1", "int16:clip=1", "randk:0.1", "randk:0.1+int8:clip=0.5", "randk:0.05+int4:clip=0.5"]
)
def test_secagg_accepts_linear_codecs(spec: str) -> None:
    assert validate_for_protection(spec, "secagg").linear_under_masks


@pytest.mark.parametrize(
    ("spec", "reason", "nearest"),
    [
        ("topk:0.01+int8", "top-k picks different coordinates", "randk:0.01+int8:clip=<C>"),
        ("topk:0.01", "top-k", "randk:0.01"),
        ("int8", "per-block scales", "int8:clip=<C>"),
        ("randk:0.1+int4", "per-block scales", "randk:0.1+int4:clip=<C>"),
        ("bf16", "bit patterns", "int16:clip=<C>"),
        ("fp16", "bit patterns", "int16:clip=<C>"),
    ],
)
def test_secagg_rejects_non_linear_codecs_naming_alternatives(spec: str, reason: str, nearest: str) -> None:
    with pytest.raises(ProtectionConfigError) as info:
        validate_for_protection(parse_codec(spec), "secagg")
    message = str(info.value)
    assert reason in message and "sealed" in message and "randk:<F>+int8:clip=<C>" in message
    assert info.value.alternatives[0] == nearest
    for protection in ("none", "sealed"):
        assert validate_for_protection(spec, protection).spec == parse_codec(spec).spec  # type: ignore[arg-type]


def test_unknown_protection_mode_is_a_config_error() -> None:
    with pytest.raises(CodecConfigError, match="protection must be"):
        validate_for_protection("identity", "tls")  # type: ignore[arg-type]


# --- downlink, state and input validation ---------------------------------------------------------


@pytest.mark.parametrize("spec", ["topk:0.05+int8", "bf16", "randk:0.2+int8:clip=0.5"])
def test_downlink_global_delta_uses_the_same_codec(spec: str) -> None:
    """The coordinator encodes the global delta with its own error-feedback state; every site
    decodes it with the codec built from the same spec. The site's model equals the
    coordinator's model minus the coordinator's residual, at every round."""
    server_codec = parse_codec(spec, error_feedback=True)
    site_codec = parse_codec(spec)  # sites need no state to decode
    server_model = {k: np.zeros_like(v) for k, v in make_update().items()}
    site_model = {k: v.copy() for k, v in server_model.items()}
    layout = UpdateSpec.of(server_model)
    server_state: dict[str, np.ndarray] = {}
    for rnd in range(1, 6):
        delta = make_update(rnd, scale=0.1)
        server_model = {k: server_model[k] + delta[k] for k in delta}
        ctx = CodecRound(rnd, 1000 + rnd)
        enc, server_state = server_codec.encode(delta, server_state, ctx)
        received = site_codec.decode(enc, layout, ctx)
        site_model = {k: site_model[k] + received[k] for k in received}
        np.testing.assert_allclose(flat(site_model) + flat(server_state), flat(server_model), atol=1e-5)


def test_error_feedback_state_must_match_the_update() -> None:
    codec = parse_codec("topk:0.1", error_feedback=True)
    update = make_update()
    with pytest.raises(CodecStateError, match="reset the codec state"):
        codec.encode(update, {"other": np.zeros(3, np.float32)}, CodecRound(1, 1))
    bad = {k: np.zeros(v.shape[:-1] + (v.shape[-1] + 1,), np.float32) for k, v in update.items()}
    with pytest.raises(CodecStateError, match="reset the codec state"):
        codec.encode(update, bad, CodecRound(1, 1))


def test_unusable_updates_are_rejected_on_the_site() -> None:
    codec = parse_codec("int8")
    with pytest.raises(UpdateError, match="NaN or Inf"):
        codec.encode({"w": np.array([1.0, np.nan], np.float32)}, None, CodecRound(1, 1))
    with pytest.raises(UpdateError, match="floating point"):
        codec.encode({"w": np.array([1, 2], np.int64)}, None, CodecRound(1, 1))
    with pytest.raises(UpdateError, match="numpy array"):
        codec.encode({"w": [1.0, 2.0]}, None, CodecRound(1, 1))  # type: ignore[dict-item]
    with pytest.raises(CodecConfigError, match="seed"):
        CodecRound(1, -5)


def test_empty_and_tiny_updates() -> None:
    for spec in ("topk:0.01+int4", "randk:0.01+int8:clip=1", "int4", "bf16"):
        codec = parse_codec(spec, error_feedback=True)
        for values in (np.zeros(0), np.array([0.5]), np.zeros(5)):
            update = {"w": values.astype(np.float32)}
            enc, state = codec.encode(update, None, CodecRound(1, 1, site_seed=0))
            out = codec.decode(enc, UpdateSpec.of(update), CodecRound(1, 1))
            np.testing.assert_allclose(out["w"] + state["w"], update["w"], atol=1e-6)


def test_encoded_is_plain_data() -> None:
    enc = Encoded({"values": np.zeros(4, np.int8)}, {"numel": 16})
    assert enc.nbytes == 4 and enc.dense_nbytes == 64 and enc.compression_ratio == 16


def test_encoded_maps_onto_flower_records_without_pickle() -> None:
    """What the pipeline does: arrays -> ArrayRecord of Array, meta -> ConfigRecord, and back."""
    flwr_app = pytest.importorskip("flwr.app")
    update = make_update()
    ctx = CodecRound(3, 2**62 + 5)
    for spec in ("topk:0.01+int4", "bf16", "randk:0.1+int8:clip=1", "int8"):
        codec = parse_codec(spec)
        enc, _ = codec.encode(update, None, ctx)
        arrays = flwr_app.ArrayRecord({k: flwr_app.Array(v) for k, v in enc.arrays.items()})
        config = flwr_app.ConfigRecord(dict(enc.meta))
        back = Encoded({k: a.numpy() for k, a in arrays.items()}, dict(config))
        layout = UpdateSpec.of(update)
        np.testing.assert_array_equal(flat(codec.decode(back, layout, ctx)), flat(codec.decode(enc, layout, ctx)))
