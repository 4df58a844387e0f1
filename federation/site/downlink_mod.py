"""The site's side of the downlink, as a mod: the global model of a train or evaluate message,
rebuilt (with a downlink codec) from the model this site holds, handed to the trainer call as a
hand-off file, and the digest of what the site now holds reported in the reply's status.

Without a DOWNLINK record the message carries the dense model, copied to a temporary shared-memory
file for the trainer. With one, the model is rebuilt from the reference in the site store
(site_store.py) and becomes the new reference, and the trainer reads that very file (no extra
copy). The format and the reasoning are in protocol/downlink_steps.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flwr.app import Context, Message, MessageType, RecordDict

from federation.protocol import message_keys as keys
from federation.protocol.downlink_steps import DownlinkError, reconstruct
from federation.protocol.payload_records import MalformedRecord, from_records
from federation.site.replies import fail, ok
from federation.site.site_env import site_env
from federation.site.site_store import ReferenceStore
from federation.site.trainer_call import GlobalModel, TrainerFailed
from federation.site.update_stream import handle_in_blob
from site_trainer import handoff


def downlink_mod(msg: Message, context: Context, call_next) -> Message:
    """Prepare the round's global model for the trainer call; report the model digest after it."""
    if msg.metadata.message_type not in (MessageType.TRAIN, MessageType.EVALUATE):
        return call_next(msg, context)
    env = site_env(context)
    try:
        glob = receive_global(msg.content, env.site, lambda: env.store.reference.dir, env.bulk_places.get(keys.GLOBAL))
    except (DownlinkError, MalformedRecord, TrainerFailed) as err:  # MalformedRecord: an array that does not parse
        return fail(msg, env.site, f"site {env.site}: {err}")
    env.global_model = glob
    try:
        reply = call_next(msg, context)
    finally:
        env.global_model = None
        glob.release()
    if ok(reply):
        for key, value in glob.status.items():
            reply.content.config_records[keys.STATUS][key] = value
    return reply


def receive_global(content: RecordDict, site: str, store_dir: Callable[[], Path],
                   places: dict[str, tuple[str, int]] | None = None) -> GlobalModel:
    """The global model of a train/evaluate message, ready for the trainer. Without a DOWNLINK
    record it is the dense model (copied to shared memory); with one, it is rebuilt from the
    reference in `store_dir()` and becomes the new reference. `places`: where the bulk mod downloaded
    the GLOBAL record's Arrays (update_stream.py). Raises DownlinkError."""
    if keys.DOWNLINK not in content.config_records:
        return dense_global(content, site, places)
    payload = from_records(content, keys.GLOBAL, keys.DOWNLINK)
    store = ReferenceStore(store_dir())
    current = store.load()
    model, digest = reconstruct(payload, current[:2] if current else None)
    if current is not None and digest == current[0]:
        handle = current[2]  # "hold": the trainer reads the reference file as it is
    else:
        handle = store.save(model, digest)
    return GlobalModel(handle, False, {keys.MODEL_DIGEST: digest})


def dense_global(content: RecordDict, site: str, places: dict[str, tuple[str, int]] | None = None) -> GlobalModel:
    """The dense GLOBAL record of a message as a hand-off file: the file the bulk mod downloaded it
    into when it came on the data path (`places`; no copy, the bulk mod deletes it), else a
    temporary copy."""
    rec = content.array_records.get(keys.GLOBAL)
    if places and rec is not None and len(rec):
        handle = handle_in_blob(rec, places)
        if handle is not None:
            return GlobalModel(handle, False)
    arrays = from_records(content, keys.GLOBAL, keys.DOWNLINK, copy=False).arrays
    return GlobalModel(handoff.write_arrays(arrays, tag=f"{site}-global"), True)
