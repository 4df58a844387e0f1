"""The ClientApp: a bare call to the site's trainer, wrapped in Flower mods.

Each message is served by a process of its own (a worker forked from a warm parent that imported
this module before the message came, federation/ops/warm_executor.py, or with Flower's executor a
fresh `flwr-clientapp`), so nothing here is long-lived and torch is never imported: the trainer is
the site trainer service, reached over a Unix socket with tensors in
shared memory (trainer_call.py). Each concern of the site is one mod, outermost first:

  pack_mod          the message's small records unpacked from one Flower object, the reply's packed
                    (protocol/record_pack.py: fewer requests on Flower's path)
  SiteScope         one SiteEnv per message (keys, settings, round config, trainer, store), relay_s
  audit_mod         the site's signed audit log: what it agreed to or refused, the digests of what it
                    sent and received, the coordinator's heads it witnessed; its own head on every reply
  bulk_mod          large Arrays beside Flower: the model fetched from, the update uploaded to the
                    coordinator's data path (bulk_mod.py); discovery replies say which path works
  attestation_mod   answers the attestation record of any message; refuses train messages until the
                    coordinator is trusted
  policy_mod        the site's own policy: a train message outside it is refused by its rule's reason
                    code before any training, an update that breaks it never leaves
  secagg_mod        sets up coming SecAgg rounds, masks the update of a train message (stage 3),
                    answers unmask queries (stage 4)
  protection_mod    signs (and seals) the update of a plain train message
  downlink_mod      rebuilds the global model from the model the site holds; reports its digest
  codec_mod         compresses the update with error feedback (residual in the site store)
  train / evaluate / query   the bare calls: the trainer (a train message first evaluates the model
                    it received when the round config says `evaluate`), and site discovery (Info)

On the way in a message passes the mods top-down; the reply passes them bottom-up, so the update
the trainer returns is encoded, then enveloped or masked. Every failure becomes a reply that names
the site and says what went wrong (or, in SecAgg stage 3, a Flower error reply).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

_IMPORTS_START = time.perf_counter()  # our imports, paid once per ClientApp process (APP_IMPORT_S)

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from federation.protocol import message_keys as keys
from federation.protocol.malloc_policy import return_freed_tensors
from federation.protocol.message_cost import TTL_MARGIN_S
from federation.protocol.payload_records import to_records
from federation.protocol.pipeline import Payload
from federation.site.attestation_mod import attestation_mod
from federation.site.audit_mod import audit_mod
from federation.site.bulk_mod import bulk_mod
from federation.site.carried import carried, carry, take
from federation.site.codec_mod import codec_mod
from federation.site.downlink_mod import dense_global, downlink_mod, offer_held
from federation.protocol.testing_hooks import absent
from federation.site.pack_mod import pack_mod
from federation.site.policy_mod import announcement, policy_mod
from federation.site.protection_mod import protection_mod
from federation.site.replies import fail, status
from federation.site.secagg_mod import secagg_mod
from federation.site.site_env import SiteEnv, SiteScope, TrainerFactory, site_env
from federation.site.trainer_call import EvalResult, GlobalModel, ServiceTrainer, TrainerFailed, TrainResult
from federation.site.update_stream import reader_records

APP_IMPORT_S = time.perf_counter() - _IMPORTS_START  # reported per message (protocol/message_cost.py)
log = logging.getLogger("sovfl.site")
return_freed_tensors()  # chunks and tensors come and go: freed ones leave the process (protocol/malloc_policy.py)


def service_trainer(env: SiteEnv) -> ServiceTrainer:
    """The deployment's trainer: the site trainer service named by node config `trainer-socket`."""
    return ServiceTrainer.from_node_config(env.node_config)


def query(msg: Message, context: Context) -> Message:
    """Site discovery (a DISCOVER record): who this site is, how much data it trains on and its
    base-model manifest. Any other query only carries records the mods answer."""
    env = site_env(context)
    if keys.DISCOVER not in msg.content.config_records:
        return Message(RecordDict({keys.STATUS: status(env.site, True)}), reply_to=msg)
    try:
        info = env.trainer.info()
    except TrainerFailed as err:
        return fail(msg, env.site, str(err))
    # the base-model manifest rides on this reply (checked by the coordinator before the first round)
    manifest = {keys.MANIFEST: json.dumps(info["manifest"], separators=(",", ":"))} if info.get("manifest") else {}
    # the trainer's seconds per local step, timed at its start: round 1's figure for round_target_s
    step = {keys.STEP_S_ESTIMATE: float(info["step_s_estimate"])} if info.get("step_s_estimate") else {}
    held = _offer_held(env, msg)
    if isinstance(info.get("data_snapshot"), dict) and info["data_snapshot"]:  # the site's audit log only
        env.audit_events.append(("data_snapshot", dict(info["data_snapshot"])))
    return Message(RecordDict({keys.STATUS: status(env.site, True, num_examples=info["num_examples"],
                                                   ranks=info["ranks"], **manifest, **step, **held,
                                                   **announcement(env))}), reply_to=msg)


def _offer_held(env: SiteEnv, msg: Message) -> dict:
    """With a downlink codec the coordinator names its model (DOWNLINK_TARGET): say whether this
    site already holds it, within half of what is left of the message's time (downlink_mod.py)."""
    target = msg.content.config_records[keys.DISCOVER].get(keys.DOWNLINK_TARGET)
    if not isinstance(target, str) or not target:
        return {}
    left_s = msg.metadata.created_at + msg.metadata.ttl - TTL_MARGIN_S - time.time()
    held, what = offer_held(env.trainer, lambda: env.store.reference.dir, target, max(1.0, left_s / 2))
    log.info("site %s: %s", env.site, what)
    return held


def _trainer_call(msg: Message, context: Context, *methods: str,
                  after: Callable[[str, TrainResult | EvalResult], None] | None = None,
                  ) -> tuple[SiteEnv, list[TrainResult | EvalResult] | Message]:
    """Call the trainer's `methods`, in order, on the round's model: the one the downlink mod
    prepared, or the message's dense model (then a temporary copy, released here); `after(name,
    result)` after each. A failure is the reply to send."""
    env = site_env(context)
    model = carried(msg)  # the downlink mod's (carried.py)
    owned = not isinstance(model, GlobalModel)
    if owned:  # no downlink mod before the call: the message's dense model, where the bulk mod put it if it did
        places = take(msg)
        model = dense_global(msg.content, env.site, places.get(keys.GLOBAL) if places else None)
    try:
        out = []
        for m in methods:
            t0 = time.perf_counter()
            out.append(getattr(env.trainer, m)(model, env.config))
            out[-1].metrics[f"{m}_call_s"] = time.perf_counter() - t0
            if after is not None:
                after(m, out[-1])
        return env, out
    except TrainerFailed as err:
        return env, fail(msg, env.site, str(err))
    finally:
        if owned:
            model.release()


def streams_update(env: SiteEnv, msg: Message) -> bool:
    """Whether the update can go from the trainer's file to the coordinator without being whole in
    this process: signed (and maybe sealed) by the protection mod, or masked by the SecAgg mod, a
    chunk at a time into a file (update_stream.py, masked_stream.py), not encoded by a codec (top-k
    and the residual need the whole vector), and uploaded on the data path."""
    return env.bulk_direct and env.bundle is not None and env.config.codec == "identity"


def train(msg: Message, context: Context) -> Message:
    """The bare train call: the trainer's update, dense, in the reply (the mods encode it). With
    `evaluate` in the round config the received model is evaluated first, on the site's held-out
    data, and those figures ride back with the update (no separate evaluate message)."""
    env = site_env(context)
    if (why := absent(env.node_config, env.config.round)) is not None:  # test only (protocol/testing_hooks.py)
        return fail(msg, env.site, why)
    evaluate_first = env.config.evaluate

    def tell_early(name: str, result: TrainResult | EvalResult) -> None:
        # on the data path the coordinator hears the evaluation now, not after the local steps
        if name == "evaluate" and env.report_evaluation is not None:
            env.report_evaluation(dict(result.metrics))

    env, res = _trainer_call(msg, context, *(("evaluate", "train") if evaluate_first else ("train",)),
                             after=tell_early)
    if isinstance(res, Message):
        return res
    trained = res[-1]
    if isinstance(trained.data_snapshot, dict) and trained.data_snapshot:  # a trainer's first round: audit log only
        env.audit_events.append(("data_snapshot", {"round": env.config.round, **trained.data_snapshot}))
    dense = float(trained.dense_bytes())
    streamed = trained.source is not None and streams_update(env, msg)
    if streamed:
        env.opened.append(trained.source)  # closed when the message ends, whatever becomes of the reply
        out = RecordDict({keys.UPDATE: ArrayRecord(), keys.UPDATE_META: ConfigRecord({})})
    elif trained.source is not None:
        try:
            out = RecordDict({keys.UPDATE: reader_records(trained.source), keys.UPDATE_META: ConfigRecord({})})
        finally:
            trained.close()
    else:
        out = to_records(Payload(trained.update), keys.UPDATE, keys.UPDATE_META)
    out[keys.STATUS] = status(env.site, True, num_examples=trained.num_examples, rank_digests=trained.rank_digests)
    metrics = {**trained.metrics, "dense_bytes": dense, "upload_bytes": dense}
    if evaluate_first:  # the evaluation's figures (not its load_s: the train call reports its own)
        metrics.update({k: v for k, v in res[0].metrics.items() if k != "load_s"})
    out[keys.METRICS] = MetricRecord(metrics)
    reply = Message(out, reply_to=msg)
    if streamed:  # the protection mod seals it, or the SecAgg mod masks it, from the file
        carry(reply, trained.source, env.opened)
    return reply


def evaluate(msg: Message, context: Context) -> Message:
    """The bare evaluate call: the trainer's figures on the site's held-out data (the run's final
    model; each round's model is evaluated at the start of the next train message)."""
    env, res = _trainer_call(msg, context, "evaluate")
    if isinstance(res, Message):
        return res
    return Message(RecordDict({keys.STATUS: status(env.site, True, num_examples=res[0].num_examples,
                                                   rank_digests=res[0].rank_digests),
                               keys.METRICS: MetricRecord(dict(res[0].metrics))}), reply_to=msg)


def build_client_app(trainer_for: TrainerFactory = service_trainer) -> ClientApp:
    """The ClientApp with its mods, over the trainer `trainer_for` returns for a message's SiteEnv
    (the deployment's: the trainer service; simulations plug in their own)."""
    app = ClientApp(mods=[pack_mod, SiteScope(trainer_for, APP_IMPORT_S), audit_mod, bulk_mod])
    app.query(mods=[attestation_mod, secagg_mod])(query)
    app.train(mods=[attestation_mod, policy_mod, secagg_mod, protection_mod, downlink_mod, codec_mod])(train)
    app.evaluate(mods=[downlink_mod])(evaluate)
    return app


app = build_client_app()
