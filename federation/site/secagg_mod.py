"""Secure aggregation (SecAgg+), the site's side, as a mod.

Query messages carrying a SECAGG record are stages 1 (advertise keys), 2 (share keys) and 4
(unmask): `on_query` answers them and the trainer is never called. A train message carrying one is
stage 3: the mod lets the inner mods and the trainer run, then `on_train` masks what the codec mod
left in the reply: it flattens the codec's values in a fixed order (identity: the update's tensors
in sorted-name order; other codecs: their value vector), masks them in the ring chunk by chunk,
and the reply carries one uint32 Array per chunk instead of the update. The protection mod does
not envelope a masked update (the sum is what opens). Message formats: protocol/secagg_records.py.

Flower starts a fresh ClientApp process for every message, so the round's SecAgg client (private
keys, self-mask seed, the neighbours' shares) is kept between stages in `context.state`, which the
SuperNode holds per run on the site: ConfigRecord "secagg" = {client: bytes, run, round, seed,
config, last_round}. It never leaves the site. The state of a round is wiped after its unmask
stage; a request for a round this site has already started, for another run, or for a stage out of
order is refused (the SecAgg client itself allows each stage once, in order).

The SecAgg client id is `context.node_id`, the id the SuperLink authenticated this SuperNode as.

Signatures (crypto.secagg.signing): with a provisioned bundle (node config `bundle-dir`, the key
plain updates are signed with) every reply record carries `sig_header` and `sig`, the site's
Ed25519 signature over the stage's content (stage 3: the manifest of its masked chunks), and in
stage 2 the site first checks that each neighbour's relayed keys were signed by that neighbour
(record field `relayed`) against the site registry of its bundle. Without a bundle (insecure
development runs) messages leave unsigned and relayed keys are taken on trust, with a warning.

Test-only hooks (site-local node config, off unless set; never set them in production):
  secagg-dump-dir="DIR"   write each round's encoded (unmasked!) ring vector to DIR/round_XXXX.npy
                          (used by tests to check that the unmasked sum is exact)
  secagg-fault="round=R,after=STAGE[,how=raise|exit]"   vanish in round R after STAGE (advertise,
                          share, masked): later messages of that round raise (an error reply) or,
                          with how=exit, kill the ClientApp process without any reply. Several
                          faults are separated by ';'.

Imports neither torch nor anything that does (the ClientApp path stays light).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from crypto.pki import SiteBundle
from crypto.secagg import (
    ChunkManifest,
    MalformedMessageError,
    ProtocolViolationError,
    ReplayedMessageError,
    SecAggClient,
    SecAggConfig,
    SecAggError,
)
from crypto.secagg.signing import check_relayed_adverts, sign
from federation.protocol import message_keys as keys
from federation.protocol.codecs import CodecError, UpdateSpec, parse_codec
from federation.protocol.message_keys import ADVERTISE, MASKED_INPUT, SHARE_KEYS, UNMASK
from federation.protocol.payload_records import to_array
from federation.protocol.pipeline import Payload
from federation.protocol.secagg_records import Request, chunk_key, reply_record
from federation.protocol.update_codec import codec_meta
from federation.site.replies import fail, ok, status, update_of
from federation.site.site_env import SiteEnv, load_bundle, site_env

__all__ = ["Request", "SecAggSiteError", "chunk_array", "on_query", "on_train", "secagg_mod", "values_vector"]

STATE = keys.SECAGG  # this mod's record in context.state
_FAULT_STAGES = {"advertise": ADVERTISE, "share": SHARE_KEYS, "masked": MASKED_INPUT}
log = logging.getLogger("sovfl.secagg_site")
_warned: set[str] = set()  # sites already warned about in this process (one ClientApp process per message)


class SecAggSiteError(RuntimeError):
    """Stage 3 could not run; raised so that the ClientApp answers with an error (Flower's error
    reply: the coordinator counts the site as dropped in stage 3)."""


def secagg_mod(msg: Message, context: Context, call_next) -> Message:
    """Answer SecAgg stages 1, 2 and 4; mask the update of a stage-3 train message."""
    if keys.SECAGG not in msg.content.config_records:
        return call_next(msg, context)
    kind = msg.metadata.message_type
    if kind == MessageType.QUERY:
        return on_query(msg, context, site_env(context).site)
    if kind != MessageType.TRAIN:
        return call_next(msg, context)
    reply = call_next(msg, context)
    if not ok(reply):
        return reply
    env = site_env(context)
    masked = on_train(msg, context, env.site, update_of(reply), int(reply.content.config_records[keys.STATUS]["num_examples"]))
    del reply.content[keys.UPDATE], reply.content[keys.UPDATE_META]
    reply.content[keys.SECAGG_CHUNKS] = masked[keys.SECAGG_CHUNKS]
    reply.content[keys.SECAGG] = masked[keys.SECAGG]
    reply.content.metric_records[keys.METRICS]["upload_bytes"] = float(
        sum(int(np.prod(a.shape)) * 4 for a in masked[keys.SECAGG_CHUNKS].values()))
    return reply


# ---- state in context.state -------------------------------------------------------------------

def _state(context: Context) -> ConfigRecord:
    rec = context.state.config_records.get(STATE)
    return rec if rec is not None else ConfigRecord({"last_round": -1})


def _save(context: Context, client: SecAggClient, config_json: str, last_round: int) -> None:
    context.state[STATE] = ConfigRecord({
        "client": client.to_state(), "run": client.ctx.run_id, "round": client.ctx.round,
        "seed": client.ctx.graph_seed, "config": config_json, "last_round": last_round,
    })


def _wipe(context: Context, last_round: int) -> None:
    context.state[STATE] = ConfigRecord({"last_round": last_round})


def _load(context: Context, req: Request) -> SecAggClient:
    st = _state(context)
    if "client" not in st:
        raise ProtocolViolationError(f"stage {req.stage} of round {req.ctx.round} arrived, but this site holds no "
                                     "SecAgg state for it (no stage 1, or the round is over)")
    if (st["run"], st["round"], st["seed"]) != (req.ctx.run_id, req.ctx.round, req.ctx.graph_seed):
        raise ReplayedMessageError(f"stage-{req.stage} request for round {req.ctx.round}, but this site's SecAgg "
                                   f"state is for round {st['round']} (another round, run or graph seed)")
    if st["config"] != req.config_json:
        raise ProtocolViolationError("the secagg config changed within the round")
    return SecAggClient.from_state(SecAggConfig.model_validate_json(str(st["config"])), bytes(st["client"]))


def _signed_reply(req: Request, bundle: SiteBundle | None, content: bytes, **extra) -> ConfigRecord:
    """The reply's SECAGG record, signed over `content` when the site has its bundle."""
    sig = None if bundle is None else sign(bundle.sign_key, bundle.federation_id, bundle.name, req.ctx, req.stage,
                                           content)
    return reply_record(req, sig, **extra)


def site_bundle(context: Context, site: str) -> SiteBundle | None:
    """The site's provisioned keys and peer registry (the message's SiteEnv's, if any), or None."""
    env = SiteEnv.current(context)
    bundle = env.bundle if env is not None else load_bundle(context)
    if bundle is None and site not in _warned:
        _warned.add(site)
        log.warning("site %s: no bundle-dir: SecAgg messages leave UNSIGNED and neighbours' keys are NOT checked "
                    "(insecure development mode; provision bundles with `sovfl provision`)", site)
    return bundle


def _check_neighbours(req: Request, bundle: SiteBundle | None, client: SecAggClient) -> None:
    """Stage 2: each relayed neighbour key must carry its owner's signature (see module docstring)."""
    if bundle is None:
        return
    relayed = req.record.get("relayed", b"")
    if not isinstance(relayed, bytes):
        raise MalformedMessageError("the relayed advert signatures are not bytes")
    check_relayed_adverts(req.request, relayed, trust=bundle.trust(), federation_id=bundle.federation_id,
                          ctx=req.ctx, me=client.id, own_site=bundle.name)


# ---- test-only hooks ------------------------------------------------------------------------------

def _fault(context: Context, rnd: int, stage: int) -> None:
    """Test only (node config `secagg-fault`): vanish for the rest of round `rnd` after a stage."""
    spec = str(context.node_config.get("secagg-fault", "") or "")
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kv = dict(item.split("=", 1) for item in part.split(","))
        if int(kv["round"]) == rnd and stage > _FAULT_STAGES[kv["after"]]:
            if kv.get("how", "raise") == "exit":
                os._exit(17)  # the ClientApp process dies: no reply at all
            raise RuntimeError(f"test fault injected: vanished after stage '{kv['after']}' of round {rnd}")


def _dump_rng(context: Context, rnd: int, x: np.ndarray, weight: int, client: SecAggClient):
    """Test only (node config `secagg-dump-dir`): the seeded rounding generator, after writing the
    encoded ring vector it will produce (the same noise key drives both)."""
    where = str(context.node_config.get("secagg-dump-dir", "") or "")
    if not where or client.params is None:
        return None
    seed = int.from_bytes(os.urandom(8), "big")
    ring = client.params.codec.encode(x, weight, np.random.default_rng(seed))
    Path(where).mkdir(parents=True, exist_ok=True)
    np.save(Path(where) / f"round_{rnd:04d}.npy", ring)
    return np.random.default_rng(seed)


# ---- the stages ---------------------------------------------------------------------------------

def on_query(msg: Message, context: Context, site: str) -> Message:
    """Stages 1, 2 and 4 (query messages carrying a SECAGG record); failures are replies that say why."""
    try:
        req = Request.parse(msg)
    except SecAggError as err:
        return fail(msg, site, f"secagg: {type(err).__name__}: {err}")
    _fault(context, req.ctx.round, req.stage)
    try:
        bundle = site_bundle(context, site)
        st = _state(context)
        if req.stage == ADVERTISE:
            if int(st["last_round"]) >= req.ctx.round:
                raise ReplayedMessageError(f"round {req.ctx.round} was already started here (last started: "
                                           f"{st['last_round']}); keys are never advertised twice for a round")
            cfg = SecAggConfig.model_validate_json(req.config_json)
            if not cfg.enabled:
                raise ProtocolViolationError("secagg request with secure aggregation disabled in its config")
            client = SecAggClient(cfg, req.ctx, int(context.node_id))
            data = client.advertise_keys()
            _save(context, client, req.config_json, req.ctx.round)
        elif req.stage == SHARE_KEYS:
            client = _load(context, req)
            _check_neighbours(req, bundle, client)
            data = client.share_keys(req.request)
            _save(context, client, req.config_json, int(st["last_round"]))
        elif req.stage == UNMASK:
            client = _load(context, req)
            data = client.unmask(req.request)  # a refused request leaves the state as it was (MASKED)
            _wipe(context, int(st["last_round"]))  # one unmask answer per round, then forget the secrets
        else:
            raise ProtocolViolationError("stage 3 (masked input) travels in a train message, not a query")
        rec = _signed_reply(req, bundle, data, data=data)
    except (SecAggError, ValueError, OSError) as err:  # pydantic's ValidationError is a ValueError
        return fail(msg, site, f"secagg stage {req.stage}: {type(err).__name__}: {err}")
    return Message(RecordDict({keys.STATUS: status(site, True), keys.SECAGG: rec}), reply_to=msg)


def chunk_array(words: np.ndarray) -> Array:
    """A masked chunk as a Flower Array (.npy bytes, what `Array(ndarray)` makes) in one copy: the
    masking loop reuses its buffer, so each chunk is copied out as it is made."""
    return to_array(words)


def values_vector(payload: Payload) -> np.ndarray:
    """The codec payload's values as one float vector, in the order the coordinator decodes them:
    identity payloads are the update's tensors (sorted names, as `UpdateSpec`); a codec's payload
    is its value vector (all coordinates, or the k shared random-k ones), decoded to floats."""
    meta = codec_meta(payload)
    if "codec" not in meta:
        return UpdateSpec.of(payload.arrays).flatten(payload.arrays)
    codec = parse_codec(str(meta["codec"]))
    if not codec.linear_under_masks:
        raise CodecError(f"codec {codec.spec!r} cannot be used with secure aggregation")
    m = int(meta["k"]) if codec.sparsifier is not None else int(meta["numel"])
    values = {k: v for k, v in payload.arrays.items() if k in codec.values.array_names}
    return np.asarray(codec.values.decode(values, m, 1), dtype=np.float32)


def on_train(msg: Message, context: Context, site: str, payload: Payload, num_examples: int) -> RecordDict:
    """Stage 3: mask the encoded update; the reply's SECAGG_CHUNKS and SECAGG records."""
    try:
        req = Request.parse(msg)
        if req.stage != MASKED_INPUT:
            raise ProtocolViolationError(f"a train message carries secagg stage {req.stage}, expected 3")
    except SecAggError as err:
        raise SecAggSiteError(f"site {site}: secagg stage 3: {type(err).__name__}: {err}") from None
    _fault(context, req.ctx.round, req.stage)
    try:
        bundle = site_bundle(context, site)
        client = _load(context, req)
        st = _state(context)
        try:
            weight, vector_len = int(req.record["weight"]), int(req.record["vector_len"])
        except (KeyError, TypeError, ValueError) as err:
            raise MalformedMessageError(f"stage-3 request without weight / vector_len ({err})") from None
        if not 1 <= weight <= client.config.max_weight:
            raise ProtocolViolationError(f"weight {weight} outside [1, {client.config.max_weight}]")
        x = values_vector(payload)
        if x.shape[0] != vector_len:
            raise ProtocolViolationError(f"the encoded update has {x.shape[0]} values, the round expects {vector_len}")
        # everything below commits this round's masks: the state is saved as MASKED even if it fails
        rng = _dump_rng(context, req.ctx.round, x, weight, client)
        chunks, manifest = {}, ChunkManifest()
        try:
            for offset, words in client.masked_input(req.request, x, weight, rng=rng):
                chunks[chunk_key(offset)] = chunk_array(words)  # copies: words is reused
                manifest.add(offset, words)
        finally:
            _save(context, client, req.config_json, int(st["last_round"]))
        rec = _signed_reply(req, bundle, manifest.encode(), chunks=len(chunks), vector_len=vector_len, weight=weight)
    except (SecAggError, CodecError, ValueError, OSError) as err:
        raise SecAggSiteError(f"site {site}: secagg stage 3: {type(err).__name__}: {err}") from None
    return RecordDict({keys.SECAGG_CHUNKS: ArrayRecord(chunks), keys.SECAGG: rec})
