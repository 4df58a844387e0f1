"""SecAgg+ secure aggregation (Bonawitz et al. CCS 2017, sparse graph of Bell et al. CCS 2020).

Pure library over bytes and numpy arrays (numpy + cryptography + pydantic for the config): a
protocol driver carries the messages, this package does the cryptography. See `client.py` and
`server.py` for the four stages; `encoding.py` for the fixed-point scheme and its error bound;
`graph.py` for the neighbour graph and its degree rule; `signing.py` for the sites' signatures on
their messages (through `crypto.envelope`).
"""

from .client import ClientStage, SecAggClient
from .config import RoundParams, SecAggConfig
from .context import RoundContext, new_context
from .encoding import FixedPointCodec
from .errors import (
    MalformedMessageError,
    ProtocolViolationError,
    ReconstructionError,
    ReplayedMessageError,
    SecAggAbort,
    SecAggConfigError,
    SecAggError,
    SecAggMessageError,
    TamperedMessageError,
)
from .graph import choose_degree, neighbour_graph
from .server import SecAggResult, SecAggServer
from .signing import ChunkManifest, Signature, SignatureRejected

__all__ = [
    "ChunkManifest",
    "ClientStage",
    "FixedPointCodec",
    "MalformedMessageError",
    "ProtocolViolationError",
    "ReconstructionError",
    "ReplayedMessageError",
    "RoundContext",
    "RoundParams",
    "SecAggAbort",
    "SecAggClient",
    "SecAggConfig",
    "SecAggConfigError",
    "SecAggError",
    "SecAggMessageError",
    "SecAggResult",
    "SecAggServer",
    "Signature",
    "SignatureRejected",
    "TamperedMessageError",
    "choose_degree",
    "neighbour_graph",
    "new_context",
]
