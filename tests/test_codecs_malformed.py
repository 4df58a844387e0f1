"""Malformed encoded payloads are rejected with a specific CodecError and a clear message."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from federation.protocol.codecs import (
    CodecError,
    CodecRound,
    DuplicateIndexError,
    Encoded,
    IndexOrderError,
    IndexRangeError,
    MalformedPayloadError,
    MetadataError,
    NonFiniteValueError,
    PayloadDTypeError,
    PayloadFieldError,
    PayloadLengthError,
    QuantizedRangeError,
    ScaleError,
    TruncatedPayloadError,
    UpdateSpec,
    parse_codec,
)

CTX = CodecRound(4, 321, site_seed=0)
UPDATE = {
    "a": np.random.default_rng(0).standard_normal((30, 33)).astype(np.float32),
    "b": np.random.default_rng(1).standard_normal(7).astype(np.float32),  # odd total: 997 values
}
LAYOUT = UpdateSpec.of(UPDATE)


def encoded(spec: str) -> Encoded:
    return parse_codec(spec).encode(UPDATE, None, CTX)[0]


def with_array(enc: Encoded, name: str, value: object) -> Encoded:
    arrays = dict(enc.arrays)
    if value is None:
        del arrays[name]
    else:
        arrays[name] = value  # type: ignore[assignment]
    return Encoded(arrays, dict(enc.meta))


def with_meta(enc: Encoded, **changes: object) -> Encoded:
    meta = dict(enc.meta)
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value  # type: ignore[assignment]
    return Encoded(dict(enc.arrays), meta)


def mutate(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[Encoded], Encoded]:
    return lambda enc: with_array(enc, name, fn(enc.arrays[name].copy()))


def setitem(i: int, v: object) -> Callable[[np.ndarray], np.ndarray]:
    def go(a: np.ndarray) -> np.ndarray:
        a[i] = v
        return a

    return go


def swap01(a: np.ndarray) -> np.ndarray:
    a[[0, 1]] = a[[1, 0]]
    return a


CASES = [
    # (id, codec spec, mutation, expected error, message fragment)
    ("truncated values", "int8", mutate("values", lambda a: a[:-3]), TruncatedPayloadError, "truncated"),
    ("values too long", "int8", mutate("values", lambda a: np.append(a, a[:2])), PayloadLengthError, "too long"),
    ("values wrong dtype", "int8", mutate("values", lambda a: a.astype(np.float64)), PayloadDTypeError, "dtype float64, expected int8"),
    ("values not an array", "int8", mutate("values", lambda a: a.tobytes()), PayloadDTypeError, "is a bytes"),
    ("values 2-D", "identity", mutate("values", lambda a: a.reshape(1, -1)), PayloadDTypeError, "1-D"),
    ("missing array", "int8", lambda e: with_array(e, "scales", None), PayloadFieldError, "missing"),
    ("unexpected array", "int8:clip=1", lambda e: with_array(e, "scales", np.ones(8, np.float32)), PayloadFieldError, "unexpected"),
    ("NaN value", "identity", mutate("values", setitem(5, np.nan)), NonFiniteValueError, "NaN/Inf"),
    ("Inf fp16", "fp16", mutate("values", setitem(0, np.inf)), NonFiniteValueError, "NaN/Inf"),
    ("bf16 NaN pattern", "bf16", mutate("values", setitem(3, 0x7FC0)), NonFiniteValueError, "bf16 NaN/Inf"),
    ("NaN scale", "int8", mutate("scales", setitem(1, np.nan)), NonFiniteValueError, "'scales' contains NaN/Inf"),
    ("zero scale", "int8", mutate("scales", setitem(2, 0.0)), ScaleError, "non-positive scale 0.0"),
    ("negative scale", "int4", mutate("scales", setitem(0, -1.0)), ScaleError, "non-positive scale -1.0"),
    ("truncated scales", "int8", mutate("scales", lambda a: a[:-1]), TruncatedPayloadError, "'scales' is truncated"),
    ("int8 -128", "int8:clip=1", mutate("values", setitem(9, -128)), QuantizedRangeError, "-128"),
    ("int16 -32768", "int16", mutate("values", setitem(9, -32768)), QuantizedRangeError, "-32768"),
    ("int4 nibble -8", "int4", mutate("values", setitem(0, 0x80)), QuantizedRangeError, "int4 value -8"),
    ("int4 padding", "int4", mutate("values", setitem(-1, 0x18)), PayloadLengthError, "padding nibble"),
    ("int4 truncated", "int4:clip=1", mutate("values", lambda a: a[:-1]), TruncatedPayloadError, "truncated"),
    ("index out of range", "topk:0.05:index=int32", mutate("indices", setitem(-1, 10**6)), IndexRangeError, "outside [0, 997)"),
    ("negative index", "topk:0.05:index=int32", mutate("indices", setitem(0, -1)), IndexRangeError, "outside"),
    ("unsorted indices", "topk:0.05:index=int32", mutate("indices", swap01), IndexOrderError, "not sorted"),
    ("duplicate indices", "topk:0.05:index=int32", mutate("indices", lambda a: np.sort(np.append(a[:-1], a[0]))), DuplicateIndexError, "more than once"),
    ("float indices", "topk:0.05:index=int32", mutate("indices", lambda a: a.astype(np.float32)), PayloadDTypeError, "indices"),
    ("truncated indices", "topk:0.05:index=int32", mutate("indices", lambda a: a[:-1]), TruncatedPayloadError, "truncated"),
    ("truncated index stream", "topk:0.05", mutate("index_unary", lambda a: a[: a.size // 2]), TruncatedPayloadError, "'index_unary' is truncated"),
    ("trailing index bytes", "topk:0.05", mutate("index_unary", lambda a: np.append(a, np.uint8(0))), PayloadLengthError, "trailing bytes"),
    ("extra index terminators", "topk:0.05", mutate("index_unary", lambda a: np.append(a, np.uint8(1))), PayloadLengthError, "more than metadata"),
    ("truncated index remainders", "topk:0.05", mutate("index_low", lambda a: a[:-1]), TruncatedPayloadError, "'index_low' is truncated"),
    ("delta index past end", "topk:0.05", mutate("index_unary", lambda a: np.concatenate([np.zeros(200, np.uint8), a])), IndexRangeError, "past the end"),
    ("rice_r out of range", "topk:0.05", lambda e: with_meta(e, rice_r=99), MetadataError, "'rice_r'=99"),
    ("missing codec", "int8", lambda e: with_meta(e, codec=None), MetadataError, "'codec' is missing"),
    ("other codec", "int8", lambda e: with_meta(e, codec="int4:block=128"), MetadataError, "coordinator expects"),
    ("wrong numel", "int8", lambda e: with_meta(e, numel=996), MetadataError, "different model"),
    ("wrong layout", "int8", lambda e: with_meta(e, layout="0" * 16), MetadataError, "different model"),
    ("numel as string", "int8", lambda e: with_meta(e, numel="997"), MetadataError, "must be an int"),
    ("summed as bool", "identity", lambda e: with_meta(e, summed=True), MetadataError, "must be an int"),
    ("sum claim on non-linear", "int8", lambda e: with_meta(e, summed=3), MetadataError, "not linear"),
    ("zero summed", "identity", lambda e: with_meta(e, summed=0), MetadataError, "'summed'=0"),
    ("wrong k", "topk:0.05", lambda e: with_meta(e, k=3), MetadataError, "metadata k=3"),
    ("randk replay", "randk:0.1+int8:clip=1", lambda e: with_meta(e, server_round=3), MetadataError, "stale or replayed"),
    ("randk missing seed", "randk:0.1", lambda e: with_meta(e, seed=None), MetadataError, "'seed' is missing"),
    ("summed value out of range", "int8:clip=1", lambda e: Encoded({"values": np.full(997, 300, np.int32)}, {**e.meta, "summed": 2}), QuantizedRangeError, "outside [-254, 254]"),
    ("meta not a dict", "int8", lambda e: Encoded(dict(e.arrays), None), MalformedPayloadError, "dict of metadata"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("spec", "corrupt", "error", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_payload_is_rejected_with_its_own_message(spec, corrupt, error, fragment) -> None:
    codec = parse_codec(spec)
    good = encoded(spec)
    codec.decode(good, LAYOUT, CTX)  # the unmodified payload is fine
    with pytest.raises(error) as info:
        codec.decode(corrupt(good), LAYOUT, CTX)
    assert fragment in str(info.value)
    if isinstance(info.value, MalformedPayloadError):
        assert "reject this site's update" in str(info.value)  # says what to do


def test_every_case_has_a_distinct_message() -> None:
    messages = set()
    for _, spec, corrupt, _, _ in CASES:
        with pytest.raises(CodecError) as info:
            parse_codec(spec).decode(corrupt(encoded(spec)), LAYOUT, CTX)
        messages.add(str(info.value).split(";")[0])
    assert len(messages) >= len(CASES) - 3  # a few cases share a cause (e.g. two "different model")


FUZZ_SPECS = ["int4", "int8:clip=1", "topk:0.05", "topk:0.05:index=int32+int8", "randk:0.1+int4:clip=1", "bf16"]


@settings(max_examples=150, deadline=None)
@given(spec=st.sampled_from(FUZZ_SPECS), data=st.data())
def test_random_byte_corruption_never_escapes_as_a_bare_exception(spec: str, data: st.DataObject) -> None:
    """Flip bytes, truncate or extend any payload array: decode either succeeds or raises a
    CodecError, never a raw numpy/Python exception."""
    codec = parse_codec(spec)
    enc = encoded(spec)
    name = data.draw(st.sampled_from(sorted(enc.arrays)))
    raw = bytearray(enc.arrays[name].tobytes())
    action = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if action == "flip" and raw:
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    elif action == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    else:
        raw += bytes(data.draw(st.lists(st.integers(0, 255), max_size=16)))
    dtype = enc.arrays[name].dtype
    raw = raw[: len(raw) - len(raw) % dtype.itemsize]
    bad = with_array(enc, name, np.frombuffer(bytes(raw), dtype=dtype))
    try:
        out = codec.decode(bad, LAYOUT, CTX)
    except CodecError:
        return
    assert all(np.isfinite(v).all() for v in out.values())
