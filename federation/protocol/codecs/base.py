"""Types shared by every codec: round context, update layout, the encoded payload.

An update is ``Arrays`` (``dict[str, np.ndarray]``, the one alias for named arrays across
federation/) of float32 tensors. Codecs work on one flat float32
vector in sorted-name order (``UpdateSpec``), so sites and the coordinator agree on
coordinates without exchanging anything but the layout digest.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Union

import numpy as np

from .codec_errors import (
    CodecConfigError,
    MetadataError,
    PayloadDTypeError,
    PayloadLengthError,
    TruncatedPayloadError,
    UpdateError,
)

#: named numpy arrays: an update, a model, a codec payload or its error-feedback state
Arrays = dict[str, np.ndarray]
MetaValue = Union[int, float, str]

_MAX_SEED = 2**63 - 1  # fits Flower ConfigRecord's signed 64-bit ints

#: bfloat16, which numpy lacks, travels as its raw 2-byte words (site_trainer/layout.py); an exchanged
#: tensor is never an integer, so a uint16 update tensor is always bf16
RAW_BF16 = np.dtype("<u2")


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def float_values(arr: np.ndarray) -> np.ndarray:
    """The values of an update tensor as float32 (raw bf16 words decoded exactly; a float32 array as is)."""
    return bf16_to_float32(arr) if arr.dtype == RAW_BF16 else np.asarray(arr, dtype=np.float32)


@dataclass(frozen=True)
class CodecRound:
    """What a codec needs to know about the round (a federation's `RoundContext` makes one with
    `codec_round()`; the codec library stays usable on its own).

    ``seed`` is sent by the coordinator each round; shared-seed codecs derive their coordinates
    from it, so every site picks the same ones. ``site_seed`` only makes the site-private
    stochastic rounding reproducible (tests); leave it ``None`` in production so rounding noise
    comes from OS entropy.
    """

    server_round: int
    seed: int
    site_seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("server_round", "seed", "site_seed"):
            value = getattr(self, name)
            if value is None and name == "site_seed":
                continue
            if not _is_int(value) or not 0 <= value <= _MAX_SEED:
                raise CodecConfigError(
                    f"CodecRound.{name} must be an int in [0, 2**63-1], got {value!r}"
                )


@dataclass(frozen=True)
class UpdateSpec:
    """Names and shapes of an update, in the fixed (sorted) order codecs flatten it in."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, update: Mapping[str, np.ndarray]) -> "UpdateSpec":
        """The layout of `update` (names sorted); rejects anything but a dict of numpy arrays."""
        if not isinstance(update, Mapping):
            raise UpdateError(f"an update must be a dict of name -> numpy array, got {type(update).__name__}")
        names = tuple(sorted(update))
        shapes = []
        for name in names:
            arr = update[name]
            if not isinstance(arr, np.ndarray):
                raise UpdateError(f"update tensor {name!r} is a {type(arr).__name__}; convert it to a numpy array")
            shapes.append(tuple(int(d) for d in arr.shape))
        return cls(names, tuple(shapes))

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Elements per tensor, in spec order."""
        return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @cached_property
    def numel(self) -> int:
        """Elements in the whole update."""
        return int(sum(self.sizes))

    @cached_property
    def digest(self) -> str:
        """Short fingerprint of the layout, carried in metadata so a mismatch is caught early."""
        blob = json.dumps([[n, list(s)] for n, s in zip(self.names, self.shapes)]).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def flatten(self, update: Mapping[str, np.ndarray]) -> np.ndarray:
        """Fresh float32 vector of ``update`` in spec order; rejects non-finite or non-float data."""
        if set(update) != set(self.names):
            raise UpdateError(
                f"update tensors {sorted(update)} do not match the expected layout {list(self.names)}"
            )
        out = np.empty(self.numel, dtype=np.float32)
        offset = 0
        for name, shape, size in zip(self.names, self.shapes, self.sizes):
            arr = update[name]
            if not isinstance(arr, np.ndarray) or tuple(arr.shape) != shape:
                raise UpdateError(f"update tensor {name!r} has shape {getattr(arr, 'shape', None)}, expected {shape}")
            if arr.dtype == RAW_BF16:  # a bfloat16 tensor as it travels (raw words): its exact float32 values
                arr = float_values(arr)
            elif arr.dtype.kind != "f":
                raise UpdateError(f"update tensor {name!r} has dtype {arr.dtype}; updates must be floating point "
                                  "(or bfloat16 as raw <u2 words)")
            out[offset : offset + size] = arr.reshape(-1)
            offset += size
        if not np.isfinite(out).all():
            ends = np.cumsum(self.sizes)
            bad = [n for n, end, size in zip(self.names, ends, self.sizes) if not np.isfinite(out[end - size:end]).all()]
            raise UpdateError(
                f"update tensors {bad} contain NaN or Inf (local training diverged?); do not send this update"
            )
        return out

    def unflatten(self, flat: np.ndarray) -> Arrays:
        """Split a flat vector back into named tensors (copies, so callers may mutate them)."""
        if flat.shape != (self.numel,):
            raise UpdateError(f"flat vector has shape {flat.shape}, expected ({self.numel},)")
        out: Arrays = {}
        offset = 0
        for name, shape, size in zip(self.names, self.shapes, self.sizes):
            out[name] = flat[offset : offset + size].reshape(shape).copy()
            offset += size
        return out


@dataclass(frozen=True)
class Encoded:
    """An encoded update: named 1-D numpy arrays (the wire payload, one Flower ``Array`` each,
    in an ``ArrayRecord``) and small scalar metadata (a Flower ``ConfigRecord``). No pickle."""

    arrays: Arrays
    meta: dict[str, MetaValue]

    @property
    def nbytes(self) -> int:
        """Wire payload bytes (array data only; metadata is a handful of scalars)."""
        return int(sum(int(a.nbytes) for a in self.arrays.values()))

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the same update sent as dense float32."""
        return 4 * int(self.meta.get("numel", 0))

    @property
    def compression_ratio(self) -> float:
        """Dense float32 bytes divided by wire payload bytes (higher is smaller on the wire)."""
        return self.dense_nbytes / self.nbytes if self.nbytes else float("inf")


# --- helpers for validating payloads ---------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def meta_int(meta: Mapping[str, MetaValue], key: str, lo: int = 0, hi: int | None = None) -> int:
    """Read an integer metadata field, rejecting absent, mistyped or out-of-range values."""
    if key not in meta:
        raise MetadataError(f"metadata field {key!r} is missing")
    value = meta[key]
    if not _is_int(value):
        raise MetadataError(f"metadata field {key!r} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise MetadataError(f"metadata field {key!r}={value} is outside [{lo}, {hi if hi is not None else 'inf'}]")
    return value


def meta_str(meta: Mapping[str, MetaValue], key: str) -> str:
    """Read a string metadata field, rejecting absent or mistyped values."""
    if key not in meta:
        raise MetadataError(f"metadata field {key!r} is missing")
    value = meta[key]
    if not isinstance(value, str):
        raise MetadataError(f"metadata field {key!r} must be a string, got {type(value).__name__}")
    return value


def payload_array(
    arrays: Mapping[str, np.ndarray], key: str, dtypes: tuple[np.dtype, ...] | np.dtype, length: int | None
) -> np.ndarray:
    """Fetch a payload array and check it is a 1-D numpy array of an allowed dtype and length."""
    allowed = tuple(np.dtype(d) for d in (dtypes if isinstance(dtypes, tuple) else (dtypes,)))
    arr = arrays[key]
    names = "/".join(str(d) for d in allowed)
    if not isinstance(arr, np.ndarray):
        raise PayloadDTypeError(f"payload array {key!r} is a {type(arr).__name__}, expected a numpy {names} array")
    if arr.dtype not in allowed:
        raise PayloadDTypeError(f"payload array {key!r} has dtype {arr.dtype}, expected {names}")
    if arr.ndim != 1:
        raise PayloadDTypeError(f"payload array {key!r} has shape {arr.shape}, expected a 1-D array")
    if length is not None and arr.shape[0] != length:
        if arr.shape[0] < length:
            raise TruncatedPayloadError(
                f"payload array {key!r} is truncated: {arr.shape[0]} elements, metadata implies {length}"
            )
        raise PayloadLengthError(
            f"payload array {key!r} is too long: {arr.shape[0]} elements, metadata implies {length}"
        )
    return arr
