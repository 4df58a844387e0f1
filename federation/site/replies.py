"""How the site's replies look: the STATUS record every reply carries, and the update of a train
reply, which each mod of the update pipeline reads and replaces in turn."""

from __future__ import annotations

from flwr.app import ConfigRecord, Message, RecordDict

from federation.protocol import message_keys as keys
from federation.protocol.payload_records import from_records, to_records
from federation.protocol.pipeline import Payload


def status(site: str, ok: bool, error: str = "", **extra) -> ConfigRecord:
    """A reply's STATUS: which site, whether it went well, what went wrong, and more."""
    return ConfigRecord({"site": site, "ok": ok, "error": error, **extra})


def fail(msg: Message, site: str, error: str) -> Message:
    """A reply that names the site and says what went wrong (the coordinator logs and counts it)."""
    return Message(RecordDict({keys.STATUS: status(site, False, error)}), reply_to=msg)


def ok(reply: Message) -> bool:
    """Whether `reply` is a good reply (no Flower error, status ok)."""
    if reply.has_error():
        return False
    st = reply.content.config_records.get(keys.STATUS)
    return st is not None and bool(st.get("ok", False))


def update_of(reply: Message) -> Payload:
    """The update a train reply carries so far, as read-only views of its records (no copy)."""
    return from_records(reply.content, keys.UPDATE, keys.UPDATE_META, copy=False)


def set_update(reply: Message, payload: Payload) -> None:
    """Replace the reply's update (records and `upload_bytes`) with `payload`, what a mod made of it."""
    rd = to_records(payload, keys.UPDATE, keys.UPDATE_META)
    reply.content[keys.UPDATE] = rd.array_records[keys.UPDATE]
    reply.content[keys.UPDATE_META] = rd.config_records[keys.UPDATE_META]
    reply.content.metric_records[keys.METRICS]["upload_bytes"] = float(payload.nbytes)
