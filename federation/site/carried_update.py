"""A site's update in a file, carried with the train reply through the mods: one channel, the reply.

In memory, the update is the reply's UPDATE records and every mod reads and rewrites them there. On
the streamed path (client_app.streams_update) it is a file, which Flower's records cannot hold, so
the reply object carries it (`carry`), and each mod that turns it into something else takes it off
(`take`) and carries on what it made: the train call carries the trainer's file (handoff.Reader),
the protection mod the sealed envelope (update_stream.SealedFile) or the SecAgg mod the masked
chunks (masked_stream.MaskedFile), which the reply's records reference; the bulk mod uploads the
`UploadFile` the reply carries. Nothing else of the message sees it.

Every file carried is also listed in the message's `SiteEnv.opened`, which the bulk mod closes when
the message ends: a reply that a mod fails or replaces leaves no file behind. The mark is kept
beside the Python object, never in the message.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable
from weakref import WeakKeyDictionary

from flwr.app import ArrayRecord, Message

from federation.protocol.bulk import Blob

_CARRIED: WeakKeyDictionary[Message, Any] = WeakKeyDictionary()


@runtime_checkable
class UploadFile(Protocol):
    """The update's file that the bulk mod uploads; the reply's `record_key` record references it."""

    record_key: ClassVar[str]
    blob: Blob

    def inline_records(self) -> ArrayRecord:
        """The record with the file's bytes in it, for Flower to carry when the data path cannot."""

    def close(self) -> None:
        """Delete the file."""


def carry(reply: Message, update: Any, opened: list) -> None:
    """`reply` carries the file `update` outward from here; `opened` (the message's
    `SiteEnv.opened`) closes it when the message ends."""
    _CARRIED[reply] = update
    if not any(f is update for f in opened):
        opened.append(update)


def take(reply: Message) -> Any | None:
    """The file `reply` carries, taken off it (the caller carries on what it makes of it), or None."""
    return _CARRIED.pop(reply, None)


def carried(reply: Message) -> Any | None:
    """The file `reply` carries, left on it, or None."""
    return _CARRIED.get(reply)
