"""Update-compression codecs (numpy + pydantic only: safe on the torch-free ClientApp path).

Site::

    codec = parse_codec("topk:0.01+int8", error_feedback=True)
    encoded, state = codec.encode(update, state, CodecRound(server_round, seed))
    # encoded.arrays -> Flower ArrayRecord, encoded.meta -> ConfigRecord; persist `state`

Coordinator::

    spec = UpdateSpec.of(global_model)            # names + shapes, sorted
    update = codec.decode(encoded, spec, round_ctx)

Which codecs compose with secure aggregation: `validate_for_protection` (compat.py).
"""

from .base import Arrays, CodecRound, Encoded, UpdateSpec
from .bitpack import pack_bits, unpack_bits
from .chain import Codec
from .codec_errors import (
    CodecConfigError,
    CodecError,
    CodecStateError,
    DuplicateIndexError,
    IndexOrderError,
    IndexRangeError,
    MalformedPayloadError,
    MetadataError,
    NonFiniteValueError,
    PayloadDTypeError,
    PayloadFieldError,
    PayloadLengthError,
    ProtectionConfigError,
    QuantizedRangeError,
    ScaleError,
    TruncatedPayloadError,
    UpdateError,
)
from .compat import SECAGG_CODECS, Protection, validate_for_protection
from .sparsify import shared_indices
from .spec import CodecConfig, parse_codec, parse_codec_config

__all__ = [
    "Arrays",
    "Codec",
    "CodecConfig",
    "CodecConfigError",
    "CodecError",
    "CodecRound",
    "CodecStateError",
    "DuplicateIndexError",
    "Encoded",
    "IndexOrderError",
    "IndexRangeError",
    "MalformedPayloadError",
    "MetadataError",
    "NonFiniteValueError",
    "PayloadDTypeError",
    "PayloadFieldError",
    "PayloadLengthError",
    "Protection",
    "ProtectionConfigError",
    "QuantizedRangeError",
    "SECAGG_CODECS",
    "ScaleError",
    "TruncatedPayloadError",
    "UpdateError",
    "UpdateSpec",
    "pack_bits",
    "parse_codec",
    "parse_codec_config",
    "shared_indices",
    "unpack_bits",
    "validate_for_protection",
]
