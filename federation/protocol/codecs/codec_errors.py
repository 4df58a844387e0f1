"""Codec errors.

Every failure a codec can see is a ``CodecError`` subclass with a message that says what was
wrong and what to do, so the coordinator can reject and count a hostile or broken update
without ever surfacing a bare numpy exception.
"""

from __future__ import annotations

DROP_HINT = "reject this site's update for the round and count it as malformed"


class CodecError(ValueError):
    """Base class of every codec failure."""


class CodecConfigError(CodecError):
    """The codec spec or config is invalid (fix the config; nothing was encoded)."""


class ProtectionConfigError(CodecConfigError):
    """The codec cannot be combined with the requested protection mode."""

    def __init__(self, message: str, alternatives: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.alternatives = alternatives


class UpdateError(CodecError):
    """The update handed to ``encode`` is unusable (wrong dtype, non-finite, layout changed)."""


class CodecStateError(CodecError):
    """The error-feedback state does not match the update it is applied to."""


class MalformedPayloadError(CodecError):
    """Base class of decode-side rejections of an encoded payload."""

    def __init__(self, what: str, hint: str = DROP_HINT) -> None:
        super().__init__(f"{what}; {hint}")
        self.what = what
        self.hint = hint


class PayloadFieldError(MalformedPayloadError):
    """An expected payload array is missing, or an unexpected one is present."""


class MetadataError(MalformedPayloadError):
    """Payload metadata is missing, mistyped, or disagrees with the coordinator's expectations."""


class PayloadDTypeError(MalformedPayloadError):
    """A payload array has the wrong dtype or is not a 1-D numpy array."""


class TruncatedPayloadError(MalformedPayloadError):
    """A payload array is shorter than its metadata says."""


class PayloadLengthError(MalformedPayloadError):
    """A payload array is longer than its metadata says (trailing data)."""


class IndexRangeError(MalformedPayloadError):
    """A sparse index lies outside ``[0, numel)``."""


class IndexOrderError(MalformedPayloadError):
    """Sparse indices are not sorted ascending."""


class DuplicateIndexError(MalformedPayloadError):
    """Sparse indices contain duplicates."""


class NonFiniteValueError(MalformedPayloadError):
    """A payload carries NaN or Inf."""


class ScaleError(MalformedPayloadError):
    """A quantization scale is zero or negative."""


class QuantizedRangeError(MalformedPayloadError):
    """A quantized integer lies outside the symmetric range the codec can produce."""
