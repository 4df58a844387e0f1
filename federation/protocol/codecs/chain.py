"""``Codec``: an optional sparsifier chained with a value coder, plus error feedback.

Every codec is such a chain: ``identity`` is (none, float32), ``topk:0.01`` is (top-k, float32),
``randk:0.1+int8:clip=0.05`` is (random-k, common-scale int8). The site calls ``encode``; the
coordinator calls ``decode``. Under secure aggregation the site masks the codec's values (the
federation's SecAgg mod) and the coordinator decodes the unmasked sum, so a codec never sums
payloads itself. The same object works in the other direction for the downlink (global model
steps, coordinator -> sites).
"""

from __future__ import annotations

from typing import Mapping, Protocol

import numpy as np

from .base import Arrays, CodecRound, Encoded, MetaValue, UpdateSpec, meta_int, meta_str
from .codec_errors import (
    CodecError,
    CodecStateError,
    MalformedPayloadError,
    MetadataError,
    PayloadFieldError,
)
from .coders import Sparsifier, ValueCoder


class CodecSettings(Protocol):
    """The configuration a codec is built from: spec.CodecConfig, which builds codecs from this module
    (so this module names it only by what a codec reads of it)."""

    @property
    def error_feedback(self) -> bool:
        """Whether the codec keeps an error-feedback residual."""


_MAX_SUMMED = 2**31 - 1


class Codec:
    """A configured codec. Build it with ``parse_codec(...)`` or ``CodecConfig.build()``."""

    def __init__(self, config: CodecSettings, sparsifier: Sparsifier | None, values: ValueCoder) -> None:
        self.config = config
        self.sparsifier = sparsifier
        self.values = values
        parts = ([sparsifier.token] if sparsifier else []) + (
            [values.token] if values.token != "identity" or not sparsifier else []
        )
        #: canonical spec string; carried in metadata and compared by the decoder
        self.spec = "+".join(parts)
        self.array_names = (sparsifier.array_names if sparsifier else ()) + values.array_names

    def __repr__(self) -> str:
        return f"Codec({self.spec!r}, error_feedback={self.error_feedback})"

    @property
    def error_feedback(self) -> bool:
        """Whether `encode` returns the residual to carry into the next round."""
        return self.config.error_feedback

    @property
    def linear_under_masks(self) -> bool:
        """Payloads of all sites can be summed element-wise (same coordinates, same scale)."""
        return self.values.linear and (self.sparsifier is None or self.sparsifier.shared_support)

    # -- site ------------------------------------------------------------------------------------

    def encode(
        self, update: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray] | None, round_ctx: CodecRound
    ) -> tuple[Encoded, Arrays]:
        """Encode ``update`` (plus the error-feedback residual in ``state``).

        Returns the payload and the new state: with error feedback, ``{name: residual}`` holding
        exactly what was not sent (``update + old_residual - decoded``); without, ``{}``.
        """
        spec = UpdateSpec.of(update)
        x = spec.flatten(update)
        if self.error_feedback and state:
            x += self._residual(state, spec)
        rng = _rounding_rng(round_ctx)
        meta: dict[str, MetaValue] = {
            "codec": self.spec,
            "numel": spec.numel,
            "layout": spec.digest,
            "summed": 1,
        }
        if self.sparsifier is not None:
            idx, arrays, sparse_meta = self.sparsifier.select(x, round_ctx)
            value_arrays, recon_values = self.values.encode(x[idx], rng)
            meta.update(sparse_meta)
        else:
            idx = None
            arrays = {}
            value_arrays, recon_values = self.values.encode(x, rng)
        arrays.update(value_arrays)
        encoded = Encoded(arrays, meta)
        if not self.error_feedback:
            return encoded, {}
        if idx is None:
            x -= recon_values
        else:
            x[idx] -= recon_values
        return encoded, spec.unflatten(x)

    def _residual(self, state: Mapping[str, np.ndarray], spec: UpdateSpec) -> np.ndarray:
        if set(state) != set(spec.names):
            raise CodecStateError(
                f"error-feedback state has tensors {sorted(state)} but the update has {list(spec.names)}; "
                "the model layout changed, so reset the codec state to {}"
            )
        for name, shape in zip(spec.names, spec.shapes):
            arr = state[name]
            if not isinstance(arr, np.ndarray) or arr.shape != shape or arr.dtype.kind != "f":
                raise CodecStateError(
                    f"error-feedback residual {name!r} is {getattr(arr, 'dtype', type(arr).__name__)} "
                    f"{getattr(arr, 'shape', '')}, expected float {shape}; reset the codec state to {{}}"
                )
        try:
            return spec.flatten(state)
        except CodecError as exc:
            raise CodecStateError(f"error-feedback state is unusable ({exc}); reset the codec state to {{}}") from exc

    # -- coordinator -----------------------------------------------------------------------------

    def decode(self, encoded: Encoded, spec: UpdateSpec, round_ctx: CodecRound | None = None) -> Arrays:
        """Validate ``encoded`` against this codec and ``spec`` and return the dense update.

        A payload whose metadata says ``summed`` > 1 (a sum of that many linear payloads) decodes to the sum.
        Pass ``round_ctx`` to also reject payloads made for another round or seed.
        Every malformed payload raises a ``MalformedPayloadError`` subclass.
        """
        try:
            return spec.unflatten(self._decode_flat(encoded, spec, round_ctx))
        except CodecError:
            raise
        except (ValueError, TypeError, IndexError, KeyError, OverflowError, AttributeError) as exc:
            raise MalformedPayloadError(f"payload could not be decoded ({type(exc).__name__}: {exc})") from exc

    def _decode_flat(self, encoded: Encoded, spec: UpdateSpec, round_ctx: CodecRound | None) -> np.ndarray:
        arrays, meta = encoded.arrays, encoded.meta
        if not isinstance(arrays, Mapping) or not isinstance(meta, Mapping):
            raise MalformedPayloadError("encoded payload must carry a dict of arrays and a dict of metadata")
        summed = self._check_meta(meta, spec)
        missing = [n for n in self.array_names if n not in arrays]
        if missing:
            raise PayloadFieldError(f"payload arrays {missing} are missing for codec {self.spec!r}")
        extra = sorted(set(arrays) - set(self.array_names))
        if extra:
            raise PayloadFieldError(f"unexpected payload arrays {extra} for codec {self.spec!r}")
        n = spec.numel
        if self.sparsifier is None:
            return self.values.decode(arrays, n, summed)
        idx = self.sparsifier.support(arrays, meta, n, round_ctx)
        flat = np.zeros(n, dtype=np.float32)
        flat[idx] = self.values.decode(arrays, idx.size, summed)
        return flat

    def _check_meta(self, meta: Mapping[str, MetaValue], spec: UpdateSpec) -> int:
        codec = meta_str(meta, "codec")
        if codec != self.spec:
            raise MetadataError(
                f"payload was encoded with codec {codec!r} but the coordinator expects {self.spec!r}; "
                "sites and coordinator must use the same codec config"
            )
        numel = meta_int(meta, "numel")
        if numel != spec.numel or meta_str(meta, "layout") != spec.digest:
            raise MetadataError(
                f"payload layout (numel={numel}, digest={meta.get('layout')!r}) does not match the model "
                f"(numel={spec.numel}, digest={spec.digest!r}); the site trained a different model"
            )
        summed = meta_int(meta, "summed", 1, _MAX_SUMMED)
        if summed > 1 and not self.linear_under_masks:
            raise MetadataError(f"payload claims to be a sum of {summed} updates but {self.spec!r} is not linear")
        return summed


def _rounding_rng(ctx: CodecRound) -> np.random.Generator:
    """Site-private randomness for stochastic rounding (reproducible only if ``site_seed`` is set)."""
    if ctx.site_seed is None:
        return np.random.default_rng()
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([ctx.site_seed, ctx.server_round, 0x5EED])))
