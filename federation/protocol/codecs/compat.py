"""Which codecs compose with which protection mode.

SecAgg only reveals the *sum* of masked vectors, so a codec is allowed there only if payloads of
different sites line up coordinate by coordinate and share one scale (``linear_under_masks``):
common clip-and-scale int quantization, shared-seed random-k, their chain, or plain float32
(which the SecAgg layer fixed-points itself). Sealed mode decrypts each update inside the
attested aggregator, so it allows every codec.
"""

from __future__ import annotations

from typing import Literal

from .chain import Codec
from .codec_errors import CodecConfigError, ProtectionConfigError
from .spec import CodecConfig, parse_codec_config

Protection = Literal["none", "secagg", "sealed"]

SECAGG_CODECS = (
    "identity",
    "int8:clip=<C>",
    "int16:clip=<C>",
    "randk:<F>",
    "randk:<F>+int8:clip=<C>",
    "randk:<F>+int4:clip=<C>",
)


def _why_not_linear(cfg: CodecConfig) -> str:
    reasons = []
    if cfg.sparsifier == "topk":
        reasons.append("top-k picks different coordinates at each site, so masked sums would mix unrelated values")
    if cfg.quantizer in ("fp16", "bf16"):
        reasons.append(f"{cfg.quantizer} bit patterns do not add up to the bit pattern of the sum")
    if cfg.quantizer.startswith("int") and cfg.clip is None:
        reasons.append(f"{cfg.quantizer} with per-block scales gives each site its own scales")
    return "; ".join(reasons)


def _nearest_linear(cfg: CodecConfig) -> str:
    """The closest SecAgg-compatible spec (placeholders for values the user must choose)."""
    parts = []
    if cfg.sparsifier != "none":
        parts.append(f"randk:{cfg.fraction!r}")
    if cfg.quantizer.startswith("int"):
        parts.append(f"{cfg.quantizer}:clip=<C>")
    elif cfg.quantizer in ("fp16", "bf16"):
        parts.append("int16:clip=<C>")
    return "+".join(parts) or "identity"


def validate_for_protection(codec: "CodecConfig | Codec | str", protection: Protection) -> CodecConfig:
    """Return the codec config if it may be used under ``protection``; else raise
    ``ProtectionConfigError`` naming why and the allowed alternatives."""
    if isinstance(codec, Codec):
        cfg = codec.config
    elif isinstance(codec, CodecConfig):
        cfg = codec
    else:
        cfg = parse_codec_config(codec)
    if protection not in ("none", "secagg", "sealed"):
        raise CodecConfigError(f"protection must be 'none', 'secagg' or 'sealed', got {protection!r}")
    if protection != "secagg" or cfg.linear_under_masks:
        return cfg
    nearest = _nearest_linear(cfg)
    alternatives = tuple(dict.fromkeys((nearest, *SECAGG_CODECS)))
    raise ProtectionConfigError(
        f"codec {cfg.spec!r} cannot be used with secure aggregation: {_why_not_linear(cfg)}. "
        f"Closest allowed codec: {nearest!r} (C = common clip range from the config, F = fraction). "
        f"Allowed with secagg: {', '.join(repr(a) for a in alternatives)}; "
        "or use protection 'sealed' (attested aggregator), which allows every codec.",
        alternatives,
    )
