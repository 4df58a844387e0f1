"""SecAgg+ secure aggregation (Bonawitz et al. CCS 2017, sparse graph of Bell et al. CCS 2020).

Pure library over bytes and numpy arrays (numpy + cryptography + pydantic for the config): a
protocol driver carries the messages, this package does the cryptography. See `plan.py` for a
round's members, fixed one round ahead; `client.py` and `server.py` for the steps (setup, masked
input, unmask); `encoding.py` for the fixed-point scheme and its error bound; `ring.py` for the
ring and its packing on the wire; `graph.py` for the neighbour graph and its degree rule;
`signing.py` for the sites' signatures on their messages (through `crypto.envelope`). README.md
states the security argument.
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
from .plan import RoundPlan, member_id
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
    "RoundPlan",
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
    "member_id",
    "neighbour_graph",
    "new_context",
]
