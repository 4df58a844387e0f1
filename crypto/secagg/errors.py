"""Exceptions of the SecAgg+ library.

Every failure a protocol driver must tell apart has its own class, all under `SecAggError`, so a
driver can reject and count a hostile message (`SecAggMessageError`) without ending the round, and
end the round cleanly (`SecAggAbort`) when too few clients remain to unmask.
"""

from __future__ import annotations


class SecAggError(Exception):
    """Base class of every error raised by crypto.secagg."""


class SecAggConfigError(SecAggError, ValueError):
    """The configuration cannot work for this round (e.g. threshold above the share count)."""


class SecAggAbort(SecAggError):
    """The round cannot complete: fewer than `threshold` clients (or shares) are left."""


class SecAggMessageError(SecAggError):
    """A message was rejected; the round may go on without its sender."""


class MalformedMessageError(SecAggMessageError):
    """Bytes that do not parse as the expected message, or values out of range."""


class ProtocolViolationError(SecAggMessageError):
    """A well-formed message that breaks the protocol (wrong stage, wrong peer, duplicate, ...)."""


class ReplayedMessageError(SecAggMessageError):
    """A message made for another run, round, stage, sender or receiver."""


class TamperedMessageError(SecAggMessageError):
    """An encrypted share whose authentication tag does not verify (modified in transit)."""


class ReconstructionError(SecAggAbort):
    """Shares were present but no `threshold` of them rebuild a secret that matches its commitment."""
