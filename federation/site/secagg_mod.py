"""Secure aggregation (SecAgg+), the site's side: handlers the ClientApp calls for the four stages.

`on_query` answers stages 1 (advertise keys), 2 (share keys) and 4 (unmask); `on_train` does
stage 3 after the codec encoded the trained update: it flattens the codec's values in a fixed
order (identity: the update's tensors in sorted-name order; other codecs: their value vector),
masks them in the ring chunk by chunk, and returns one uint32 Array per chunk. The message
formats are described in `federation.secagg_round`.

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
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

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
from crypto.secagg import RoundContext as SecAggContext
from crypto.secagg.signing import check_relayed_adverts, sign
from federation.protocol.codecs import CodecError, UpdateSpec, parse_codec
from federation.protocol.pipeline import Payload

ADVERTISE, SHARE_KEYS, MASKED_INPUT, UNMASK = 1, 2, 3, 4
RECORD = "secagg"  # request / reply ConfigRecord, and the state record in context.state
CHUNKS = "secagg_chunks"  # stage-3 reply ArrayRecord: one uint32 Array per masked chunk
OFFSET_DIGITS = 12
CODEC_META = "codec."  # prefix of the codec stage's metadata in a Payload (federation.codec_stage)
_FAULT_STAGES = {"advertise": ADVERTISE, "share": SHARE_KEYS, "masked": MASKED_INPUT}
log = logging.getLogger("sovfl.secagg_site")


class SecAggSiteError(RuntimeError):
    """Stage 3 could not run; raised so that the ClientApp answers with an error (the relay sets the
    reply's status itself, so a failed status could not get through)."""


@dataclass(frozen=True)
class Request:
    stage: int
    ctx: SecAggContext
    config_json: str
    request: bytes
    record: ConfigRecord

    @classmethod
    def parse(cls, msg: Message) -> "Request":
        rec = msg.content.config_records.get(RECORD)
        if rec is None:
            raise MalformedMessageError(f"no '{RECORD}' record in the message")
        try:
            stage, rnd, run = int(rec["stage"]), int(rec["round"]), str(rec["run"])
            seed, config, request = rec["graph_seed"], str(rec["config"]), rec.get("request", b"")
            if not isinstance(seed, bytes) or not isinstance(request, bytes):
                raise TypeError("graph_seed and request must be bytes")
            ctx = SecAggContext(run, rnd, seed)
        except (KeyError, TypeError, ValueError) as err:
            raise MalformedMessageError(f"secagg request is malformed ({type(err).__name__}: {err})") from None
        if stage not in (ADVERTISE, SHARE_KEYS, MASKED_INPUT, UNMASK):
            raise MalformedMessageError(f"unknown secagg stage {stage}")
        if not run.endswith(f"/{int(msg.metadata.run_id)}"):
            raise ReplayedMessageError(f"secagg request for run {run!r}, this is Flower run {msg.metadata.run_id}")
        return cls(stage, ctx, config, request, rec)


# ---- state in context.state -------------------------------------------------------------------

def _state(context: Context) -> ConfigRecord:
    rec = context.state.config_records.get(RECORD)
    return rec if rec is not None else ConfigRecord({"last_round": -1})


def _save(context: Context, client: SecAggClient, config_json: str, last_round: int) -> None:
    context.state[RECORD] = ConfigRecord({
        "client": client.to_state(), "run": client.ctx.run_id, "round": client.ctx.round,
        "seed": client.ctx.graph_seed, "config": config_json, "last_round": last_round,
    })


def _wipe(context: Context, last_round: int) -> None:
    context.state[RECORD] = ConfigRecord({"last_round": last_round})


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


def _reply_record(req: Request, bundle: SiteBundle | None, content: bytes, **extra) -> ConfigRecord:
    """The reply's "secagg" record, signed over `content` when the site has its bundle."""
    rec = ConfigRecord({"stage": req.stage, "round": req.ctx.round, "ctx": req.ctx.digest(), **extra})
    if bundle is not None:
        sig = sign(bundle.sign_key, bundle.federation_id, bundle.name, req.ctx, req.stage, content)
        rec["sig_header"], rec["sig"] = sig.header, sig.signature
    return rec


def site_bundle(context: Context, site: str) -> SiteBundle | None:
    """The site's provisioned keys and peer registry (node config `bundle-dir`), or None."""
    path = str(context.node_config.get("bundle-dir", "") or "")
    if path:
        return SiteBundle.load(path)
    log.warning("site %s: no bundle-dir: SecAgg messages leave UNSIGNED and neighbours' keys are NOT checked "
                "(insecure development mode; provision bundles with `sovfl provision`)", site)
    return None


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
    if not where:
        return None
    if client.params is None:
        return None
    seed = int.from_bytes(os.urandom(8), "big")
    ring = client.params.codec.encode(x, weight, np.random.default_rng(seed))
    Path(where).mkdir(parents=True, exist_ok=True)
    np.save(Path(where) / f"round_{rnd:04d}.npy", ring)
    return np.random.default_rng(seed)


# ---- the stages ---------------------------------------------------------------------------------

def _ok(msg: Message, site: str, rec: ConfigRecord) -> Message:
    return Message(RecordDict({"status": ConfigRecord({"site": site, "ok": True, "error": ""}), RECORD: rec}),
                   reply_to=msg)


def _fail(msg: Message, site: str, error: str) -> Message:
    return Message(RecordDict({"status": ConfigRecord({"site": site, "ok": False, "error": error})}), reply_to=msg)


def on_query(msg: Message, context: Context, site: str) -> Message:
    """Stages 1, 2 and 4 (query messages carrying a "secagg" ConfigRecord)."""
    try:
        req = Request.parse(msg)
    except SecAggError as err:
        return _fail(msg, site, f"secagg: {type(err).__name__}: {err}")
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
        rec = _reply_record(req, bundle, data, data=data)
    except (SecAggError, ValueError, OSError) as err:  # pydantic's ValidationError is a ValueError
        return _fail(msg, site, f"secagg stage {req.stage}: {type(err).__name__}: {err}")
    return _ok(msg, site, rec)


def chunk_array(words: np.ndarray) -> Array:
    """A masked chunk as a Flower Array (.npy bytes, what `Array(ndarray)` makes) in one copy."""
    header = np.lib.format.header_data_from_array_1_0(words)
    buf = BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return Array(dtype=str(words.dtype), shape=tuple(words.shape), stype="numpy.ndarray",
                 data=b"".join((buf.getvalue(), memoryview(np.ascontiguousarray(words)).cast("B"))))


def values_vector(payload: Payload) -> np.ndarray:
    """The codec payload's values as one float vector, in the order the coordinator decodes them:
    identity payloads are the update's tensors (sorted names, as `UpdateSpec`); a codec's payload
    is its value vector (all coordinates, or the k shared random-k ones), decoded to floats."""
    spec = payload.meta.get(CODEC_META + "codec")
    if spec is None:
        return UpdateSpec.of(payload.arrays).flatten(payload.arrays)
    codec = parse_codec(str(spec))
    if not codec.linear_under_masks:
        raise CodecError(f"codec {codec.spec!r} cannot be used with secure aggregation")
    meta = {k[len(CODEC_META):]: v for k, v in payload.meta.items() if k.startswith(CODEC_META)}
    m = int(meta["k"]) if codec.sparsifier is not None else int(meta["numel"])
    values = {k: v for k, v in payload.arrays.items() if k in codec.values.array_names}
    return np.asarray(codec.values.decode(values, m, 1), dtype=np.float32)


def on_train(msg: Message, context: Context, site: str, payload: Payload, num_examples: int) -> RecordDict:
    """Stage 3: mask the encoded update; the reply's content (the relay adds status and metrics)."""
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
                chunks[f"{offset:0{OFFSET_DIGITS}d}"] = chunk_array(words)  # copies: words is reused
                manifest.add(offset, words)
        finally:
            _save(context, client, req.config_json, int(st["last_round"]))
        rec = _reply_record(req, bundle, manifest.encode(), chunks=len(chunks), vector_len=vector_len, weight=weight)
    except (SecAggError, CodecError, ValueError, OSError) as err:
        raise SecAggSiteError(f"site {site}: secagg stage 3: {type(err).__name__}: {err}") from None
    return RecordDict({CHUNKS: ArrayRecord(chunks), RECORD: rec})
