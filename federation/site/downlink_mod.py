"""The site's side of the downlink, as a mod: the global model of a train or evaluate message,
rebuilt (with a downlink codec) from the model this site holds, handed to the trainer call as a
hand-off file, and the digest of what the site now holds reported in the reply's status.

Without a DOWNLINK record the message carries the dense model, copied to a temporary shared-memory
file for the trainer. With one, the model is rebuilt from the reference in the site store
(site_store.py) and becomes the new reference, and the trainer reads that very file (no extra
copy). The format and the reasoning are in protocol/downlink_steps.py. At discovery, a site whose
trainer already holds the coordinator's model (the same starting weights) makes it the reference
and says so (`offer_held`), and round 1 sends it none.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flwr.app import Context, Message, MessageType, RecordDict

from federation.protocol import message_keys as keys
from federation.protocol.downlink_steps import DownlinkError, as_reference, model_digest, reconstruct
from federation.protocol.payload_records import MalformedRecord, from_records
from federation.protocol.wire_dtypes import to_master
from federation.site.carried import carry, take
from federation.site.replies import fail, ok
from federation.site.site_env import site_env
from federation.site.site_store import ReferenceStore
from federation.site.trainer_call import GlobalModel, Trainer, TrainerFailed
from federation.site.update_stream import handle_in_blob
from site_trainer import handoff


def downlink_mod(msg: Message, context: Context, call_next) -> Message:
    """Prepare the round's global model for the trainer call; report the model digest after it."""
    if msg.metadata.message_type not in (MessageType.TRAIN, MessageType.EVALUATE):
        return call_next(msg, context)
    env = site_env(context)
    places = take(msg)  # where the bulk mod downloaded the message's Arrays, if it did (carried.py)
    try:
        glob = receive_global(msg.content, env.site, lambda: env.store.reference.dir,
                              places.get(keys.GLOBAL) if places else None)
    except (DownlinkError, MalformedRecord, TrainerFailed) as err:  # MalformedRecord: an array that does not parse
        return fail(msg, env.site, f"site {env.site}: {err}")
    carry(msg, glob)  # for the trainer call
    try:
        reply = call_next(msg, context)
    finally:
        take(msg)
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


def offer_held(trainer: Trainer, store_dir: Callable[[], Path], target: str, timeout_s: float) -> tuple[dict, str]:
    """Discovery: whether this site already holds the coordinator's model `target` (a digest), so
    that the next message need not carry it: the reference in its store if that is it, else the
    model its trainer holds now (`export`; at a trainer's start, the model it built from the
    workload and the seed, or loaded from the same pretrained files), made the reference when it is
    bit for bit the coordinator's. ({MODEL_DIGEST: target} or {}, what happened, for the site's log).
    Nothing here fails discovery: a site that cannot tell is sent the model."""
    try:
        store = ReferenceStore(store_dir())
    except TrainerFailed as err:  # the store's place is the trainer's workdir
        return {}, f"{err}: the model is sent"
    current = store.load()
    if current is not None and current[0] == target:
        return {keys.MODEL_DIGEST: target}, f"holds the coordinator's model {target} (its reference)"
    export = getattr(trainer, "export", None)
    if export is None:
        return {}, "its trainer cannot show the model it holds (no export): the model is sent"
    try:
        handle = export(timeout_s)
    except TrainerFailed as err:
        return {}, f"could not read the model its trainer holds ({err}): the model is sent"
    if handle is None:
        return {}, "its trainer shows no model: the model is sent"
    try:
        arrays = handoff.map_arrays(handle)
    except (OSError, ValueError) as err:
        return {}, f"could not read its trainer's export ({err}): the model is sent"
    finally:
        handoff.release(handle.path)
    # as the coordinator keeps its reference: bf16 words as exact float32, every tensor float32
    model = as_reference(to_master(arrays, {k: (v.dtype.str, v.shape) for k, v in arrays.items()}), copy=False)
    digest = model_digest(model)
    if digest != target:
        return {}, f"its trainer's model {digest} is not the coordinator's {target}: the model is sent"
    try:
        store.save(model, digest)
    except OSError as err:
        return {}, f"could not keep its trainer's model as the reference ({err}): the model is sent"
    return {keys.MODEL_DIGEST: digest}, f"holds the coordinator's model {digest} (its trainer's): it is not sent"


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
