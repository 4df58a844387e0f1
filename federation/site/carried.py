"""What a message and its reply carry through the mods beside their records: one channel each way.

Flower's records hold bytes; the model and the update of the data path are files, which they cannot
hold. So the message object (on the way in) and the reply object (on the way out) carry the file,
and each mod that turns it into something else takes it off (`take`) and carries on what it made
(`carry`); nothing else of the message sees it. In memory the model and the update are the
records themselves, and nothing is carried.

- In: the bulk mod carries where it downloaded the message's Arrays (`Places`); the downlink mod
  takes them and carries the round's model as the trainer's hand-off file
  (trainer_call.GlobalModel), which the trainer call reads.
- Out (a train reply on the streamed path, client_app.streams_update): the train call carries the
  trainer's update file (handoff.Reader); the protection mod takes it and carries the sealed
  envelope (update_stream.SealedFile), or the SecAgg mod the masked chunks
  (masked_stream.MaskedFile), which the reply's records reference; the bulk mod uploads the
  `UploadFile` the reply carries.

Every update file carried is also listed in the message's `SiteEnv.opened`, which the bulk mod
closes when the message ends: a reply that a mod fails or replaces leaves no file behind (the
downloads and the model's file have owners of their own: `SiteEnv.downloads`, the downlink mod).
The mark is kept beside the Python object, never in the message.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable
from weakref import WeakKeyDictionary

from flwr.app import ArrayRecord, Message

from federation.protocol.bulk import Blob

Places = dict[str, dict[str, tuple[str, int]]]  # record -> array -> (the downloaded file, its offset there)

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


def carry(message: Message, what: Any, opened: list | None = None) -> None:
    """`message` (or reply) carries `what` on through the mods; `opened` (the message's
    `SiteEnv.opened`) closes it when the message ends."""
    _CARRIED[message] = what
    if opened is not None and not any(f is what for f in opened):
        opened.append(what)


def take(message: Message) -> Any | None:
    """What `message` carries, taken off it (the caller carries on what it makes of it), or None."""
    return _CARRIED.pop(message, None)


def carried(message: Message) -> Any | None:
    """What `message` carries, left on it, or None."""
    return _CARRIED.get(message)
