"""Update-compression codecs (numpy + pydantic only: safe on the torch-free ClientApp path).

Site::

    codec = parse_codec("topk:0.01+int8", error_feedback=True)
    encoded, state = codec.encode(update, state, RoundContext(server_round, seed))
    # encoded.arrays -> Flower ArrayRecord, encoded.meta -> ConfigRecord; persist `state`

Coordinator::

    spec = UpdateSpec.of(global_model)            # names + shapes, sorted
    update = codec.decode(encoded, spec, round_ctx)            # any codec
    total = codec.decode(codec.aggregate(encodeds, spec), spec)  # linear codecs: sum first
"""

from .base import CodecState, Encoded, RoundContext, Update, UpdateSpec
from .bitpack import pack_bits, unpack_bits
from .chain import Codec
from .errors import (
    CodecConfigError,
    CodecError,
    CodecStateError,
    DuplicateIndexError,
    IndexOrderError,
    IndexRangeError,
    MalformedPayloadError,
    MetadataError,
    NonFiniteValueError,
    NotLinearError,
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
from .ring import from_ring, sum_bits, to_ring
from .sparsify import shared_indices
from .spec import CodecConfig, parse_codec, parse_codec_config

__all__ = [
    "Codec",
    "CodecConfig",
    "CodecConfigError",
    "CodecError",
    "CodecState",
    "CodecStateError",
    "DuplicateIndexError",
    "Encoded",
    "IndexOrderError",
    "IndexRangeError",
    "MalformedPayloadError",
    "MetadataError",
    "NonFiniteValueError",
    "NotLinearError",
    "PayloadDTypeError",
    "PayloadFieldError",
    "PayloadLengthError",
    "Protection",
    "ProtectionConfigError",
    "QuantizedRangeError",
    "RoundContext",
    "SECAGG_CODECS",
    "ScaleError",
    "TruncatedPayloadError",
    "Update",
    "UpdateError",
    "UpdateSpec",
    "from_ring",
    "pack_bits",
    "parse_codec",
    "parse_codec_config",
    "shared_indices",
    "sum_bits",
    "to_ring",
    "unpack_bits",
    "validate_for_protection",
]
