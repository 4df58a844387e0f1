"""Codec configuration: the pydantic ``CodecConfig`` and the spec-string grammar.

Spec strings are ``[sparsifier][+quantizer]`` with ``:``-separated arguments::

    identity | fp16 | bf16
    int8 | int4 | int16                      per-block scales (block=128 by default)
    int8:block=256 | int8:clip=0.05          block size, or common clip-and-scale (SecAgg)
    topk:0.01 | topk:1% | topk:0.01:index=int32   top-k, indices Rice delta-coded by default
    randk:0.1                                shared-seed random-k
    topk:0.005+int4 | randk:0.1+int8:clip=0.05    sparsify, then quantize the kept values

Error feedback is a site-local choice (it changes nothing on the wire), so it is a separate
flag rather than part of the string. ``CodecConfig`` also accepts a spec string wherever a
config is expected (``CodecConfig.model_validate("topk:0.01+int8")``), for YAML configs.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .chain import Codec
from .codec_errors import CodecConfigError
from .coders import Sparsifier, ValueCoder
from .floats import Bf16Values, Float32Values, Fp16Values
from .quantize import StochasticInt
from .sparsify import RandK, TopK

SparsifierName = Literal["none", "topk", "randk"]
QuantizerName = Literal["float32", "fp16", "bf16", "int4", "int8", "int16"]

_FLOAT_NAMES = {"identity": "float32", "none": "float32", "float32": "float32", "fp32": "float32",
                "fp16": "fp16", "bf16": "bf16"}
_INT_NAMES = {"int4": "int4", "int8": "int8", "int16": "int16"}
_GRAMMAR = (
    "expected '[topk:F|randk:F][+identity|fp16|bf16|int4|int8|int16[:block=B|:clip=C]]', "
    "e.g. 'topk:0.01+int8', 'randk:0.1+int8:clip=0.05', 'bf16'"
)


class CodecConfig(BaseModel):
    """Which codec a run uses; identical on every site and the coordinator (but error feedback)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sparsifier: SparsifierName = "none"
    fraction: float | None = Field(default=None, gt=0.0, le=1.0, description="share of coordinates kept")
    index_coding: Literal["int32", "delta"] = "delta"
    quantizer: QuantizerName = "float32"
    block_size: int = Field(default=128, ge=1, le=1 << 20, description="values per scale (block scaling)")
    clip: float | None = Field(default=None, gt=0.0, description="common clip range: linear under masks")
    error_feedback: bool = False

    @model_validator(mode="before")
    @classmethod
    def _from_spec_string(cls, data: Any) -> Any:
        return _parse_fields(data) if isinstance(data, str) else data

    @model_validator(mode="after")
    def _consistent(self) -> "CodecConfig":
        if self.sparsifier == "none" and self.fraction is not None:
            raise ValueError("fraction is only meaningful with sparsifier 'topk' or 'randk'")
        if self.sparsifier != "none" and self.fraction is None:
            raise ValueError(f"sparsifier {self.sparsifier!r} needs a fraction in (0, 1]")
        if self.clip is not None:
            if not self.quantizer.startswith("int"):
                raise ValueError(f"clip applies to int quantizers only, not {self.quantizer!r}")
            if not math.isfinite(self.clip):
                raise ValueError("clip must be finite")
        return self

    @property
    def spec(self) -> str:
        """Canonical spec string (what travels in payload metadata)."""
        return self.build().spec

    @property
    def linear_under_masks(self) -> bool:
        """Whether payloads of different sites add up coordinate by coordinate (SecAgg-compatible)."""
        return self.build().linear_under_masks

    def build(self) -> Codec:
        """The codec this config describes."""
        sparsifier: Sparsifier | None = None
        if self.sparsifier == "topk":
            sparsifier = TopK(float(self.fraction or 0), self.index_coding)
        elif self.sparsifier == "randk":
            sparsifier = RandK(float(self.fraction or 0))
        values: ValueCoder
        if self.quantizer == "float32":
            values = Float32Values()
        elif self.quantizer == "fp16":
            values = Fp16Values()
        elif self.quantizer == "bf16":
            values = Bf16Values()
        else:
            values = StochasticInt(int(self.quantizer[3:]), self.block_size, self.clip)
        return Codec(self, sparsifier, values)


def _fraction(text: str, token: str) -> float:
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise CodecConfigError(f"{token!r}: fraction {text!r} is not a number; {_GRAMMAR}") from None
    if not 0 < value <= 1:
        raise CodecConfigError(f"{token!r}: fraction must be in (0, 1], got {value}")
    return value


def _options(args: list[str], token: str, allowed: set[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in allowed:
            raise CodecConfigError(f"{token!r}: unknown option {arg!r} (allowed: {sorted(allowed) or 'none'})")
        out[key] = value
    return out


def _parse_fields(spec: str) -> dict[str, Any]:
    """Spec string -> CodecConfig field dict."""
    fields: dict[str, Any] = {}
    tokens = [t.strip() for t in spec.strip().lower().split("+")]
    if not tokens or any(not t for t in tokens):
        raise CodecConfigError(f"empty codec spec or stage in {spec!r}; {_GRAMMAR}")
    for position, token in enumerate(tokens):
        name, *args = token.split(":")
        if name in ("topk", "randk"):
            if position != 0:
                raise CodecConfigError(f"{spec!r}: sparsify first, then quantize ({name} must be the first stage)")
            if not args:
                raise CodecConfigError(f"{token!r} needs a fraction, e.g. '{name}:0.01'")
            fields["sparsifier"] = name
            fields["fraction"] = _fraction(args[0], token)
            opts = _options(args[1:], token, {"index"} if name == "topk" else set())
            if "index" in opts:
                if opts["index"] not in ("int32", "delta"):
                    raise CodecConfigError(f"{token!r}: index must be 'int32' or 'delta'")
                fields["index_coding"] = opts["index"]
        elif name in _FLOAT_NAMES or name in _INT_NAMES:
            if "quantizer" in fields:
                raise CodecConfigError(f"{spec!r}: at most one quantizer stage")
            if name in _FLOAT_NAMES:
                _options(args, token, set())
                fields["quantizer"] = _FLOAT_NAMES[name]
                continue
            fields["quantizer"] = _INT_NAMES[name]
            opts = _options(args, token, {"block", "clip"})
            if "block" in opts and "clip" in opts:
                raise CodecConfigError(
                    f"{token!r}: choose per-block scales (block=) or a common clip (clip=), not both"
                )
            try:
                if "block" in opts:
                    fields["block_size"] = int(opts["block"])
                if "clip" in opts:
                    fields["clip"] = float(opts["clip"])
            except ValueError:
                raise CodecConfigError(f"{token!r}: block must be an int and clip a number") from None
        else:
            raise CodecConfigError(f"unknown codec stage {name!r} in {spec!r}; {_GRAMMAR}")
    return fields


def parse_codec_config(spec: "str | CodecConfig", **overrides: Any) -> CodecConfig:
    """Spec string or config (plus field overrides such as ``error_feedback=True``) -> config."""
    try:
        if isinstance(spec, CodecConfig):
            base = spec.model_dump()
        elif isinstance(spec, str):
            base = _parse_fields(spec)
        else:
            raise CodecConfigError(f"codec must be a spec string or CodecConfig, got {type(spec).__name__}")
        base.update({k: v for k, v in overrides.items() if v is not None})
        return CodecConfig(**base)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'codec'}: {e['msg']}" for e in exc.errors())
        raise CodecConfigError(f"invalid codec config {spec!r}: {problems}") from None


def parse_codec(spec: "str | CodecConfig", *, error_feedback: bool | None = None, **overrides: Any) -> Codec:
    """Build a codec, e.g. ``parse_codec("topk:0.01+int8", error_feedback=True)``."""
    return parse_codec_config(spec, error_feedback=error_feedback, **overrides).build()
