"""The codec as a pipeline stage: compress on the site (with error feedback), decode on the
coordinator. Malformed payloads become counted rejections, never crashes."""

from __future__ import annotations

import time

import numpy as np

from federation.protocol.codecs import Arrays, Codec, CodecError, Encoded, UpdateSpec, parse_codec
from federation.protocol.codecs.base import float_values
from federation.protocol.pipeline import Payload, RoundContext, UpdateRejected

META_PREFIX = "codec."  # the codec's metadata inside a Payload's meta (the SecAgg mod reads it too)


def round_seed(federation_seed: int, rnd: int) -> int:
    """The seed every site uses in round `rnd` (shared-seed random-k picks the same coordinates)."""
    return int(np.random.default_rng([federation_seed, rnd, 0x5EED]).integers(0, 2**63 - 1))


def codec_meta(payload: Payload) -> dict:
    """The codec's own metadata of an encoded payload (prefix removed)."""
    return {k[len(META_PREFIX):]: v for k, v in payload.meta.items() if k.startswith(META_PREFIX)}


class CodecStage:
    """`Stage` around a `Codec`: the site keeps the error-feedback residual it returns (`new_state`),
    the coordinator decodes against the model's layout."""

    name = "codec"

    def __init__(self, codec: Codec, layout: UpdateSpec | None = None,
                 state: Arrays | None = None, site_seed: int | None = None):
        self.codec = codec
        self.layout = layout
        self.site_seed = site_seed  # reproducible stochastic rounding (simulations); None: OS entropy
        self.state = dict(state or {})
        self.new_state: Arrays | None = None
        self.encode_s = 0.0
        self.decode_s = 0.0

    @classmethod
    def from_spec(cls, spec: str, error_feedback: bool, **kw) -> "CodecStage":
        """The stage for a codec spec string (as in the round config)."""
        return cls(parse_codec(spec, error_feedback=error_feedback), **kw)

    def encode(self, payload: Payload, ctx: RoundContext) -> Payload:
        """Site: the encoded update; the residual to keep is left in `new_state` (None without EF)."""
        t0 = time.perf_counter()
        update = {k: float_values(v) for k, v in payload.arrays.items()}  # bf16 words: their values
        enc, new_state = self.codec.encode(update, self.state, ctx.codec_round(self.site_seed))
        self.new_state = new_state if self.codec.error_feedback else None
        self.encode_s = time.perf_counter() - t0
        meta = {**payload.meta, **{META_PREFIX + k: v for k, v in enc.meta.items()}}
        return Payload(dict(enc.arrays), meta)

    def decode(self, payload: Payload, ctx: RoundContext) -> Payload:
        """Coordinator: the dense update, or UpdateRejected naming what was wrong."""
        if self.layout is None:
            raise ValueError("CodecStage.decode needs the model's layout (UpdateSpec)")
        t0 = time.perf_counter()
        meta = codec_meta(payload)
        rest = {k: v for k, v in payload.meta.items() if not k.startswith(META_PREFIX)}
        if meta.get("codec") != self.codec.spec:
            raise UpdateRejected("codec_mismatch", f"update encoded with {meta.get('codec')!r}, "
                                 f"this federation uses {self.codec.spec!r}")
        try:
            update = self.codec.decode(Encoded(dict(payload.arrays), meta), self.layout, ctx.codec_round())
        except CodecError as err:
            raise UpdateRejected(f"codec_{type(err).__name__}", str(err)) from None
        self.decode_s += time.perf_counter() - t0
        return Payload(update, rest)


def secagg_levels(spec: str, clip: float) -> int | None:
    """The levels of the integer grid a codec puts its values on, when that grid is the one SecAgg's
    fixed point would use: a clip-and-scale integer coder (int8: 2 * 127 steps) over the same clip
    as secure aggregation. Then the ring can be chosen from those levels (crypto.secagg.config) and
    encoding adds no rounding. None for float values or another clip."""
    values = parse_codec(spec).values
    qmax, vclip = getattr(values, "qmax", None), getattr(values, "clip", None)
    if qmax is None or vclip is None or not np.isclose(float(vclip), float(clip), rtol=1e-12, atol=0.0):
        return None
    return 2 * int(qmax)
