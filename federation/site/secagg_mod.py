"""Secure aggregation (SecAgg+), the site's side, as a mod.

A site handles at most two messages per SecAgg round (crypto/secagg/README.md has the protocol
and its security argument):
- the round's train message carries SECAGG stage 3: the ring and the live neighbours' mask keys
  and share envelopes. The mod checks them before the trainer runs (neighbours' signatures), lets
  the inner mods and the trainer run, then masks what the codec mod left in the reply: the codec's
  values in a fixed order (identity: the update's tensors in sorted-name order; other codecs: their
  value vector), masked in the ring chunk by chunk, each chunk packed at the ring's width. The
  reply carries those chunks instead of the update (the protection mod does not envelope it: the
  sum is what opens). On the data path an identity update is never whole here: it is masked from
  the trainer's hand-off file into a file the bulk mod uploads (masked_stream.py), bit for bit
  the chunks of the whole path;
- a query carries SECAGG stage 4 (unmask): the shares that remove the masks.
Any message (those two, a discovery or prepare query) may also carry SECAGG_SETUP: the plan of a
coming round. The site draws that round's fresh mask key and self-mask seed, seals their Shamir
shares to the plan's neighbours under its long-term channel key, and answers with its setup and
its signed advert in the same reply. A setup that cannot be made is an `error` in that record,
never a failed message: the site then sits that round out.

State (Flower's `context.state`, kept by the SuperNode per Flower run, one record "secagg"): the
secrets of each round set up and not yet closed (`r<round>`: crypto SecAggClient state), the last
round set up and the last round masked, the SecAgg run id and config they belong to, and, only
for a site without a bundle, a per-run channel key. It never leaves the site. Rules that keep
every mask single-use: a round is set up at most once (a second plan for it is refused, even if
the first reply got lost); its masked input is made at most once; its secrets are deleted after
the unmask answer, and every older round's when a later round masks. A new Flower run (a resumed
coordinator) starts with an empty state: nothing from before is ever combined with it.

The SecAgg client id is `crypto.secagg.member_id(site name)`; with a bundle, every reply record is
signed with the site's key (the one plain updates are signed with) and, before masking, the site
checks that each relayed neighbour key was signed by the site the plan names for it, and that the
plan's channel keys are those of its registry. Without a bundle (insecure development runs)
messages leave unsigned and relayed keys are taken on trust, with a warning.

Test-only hooks (site-local node config, off unless set; never set them in production):
  secagg-dump-dir="DIR"   write each round's encoded (unmasked!) ring vector to DIR/round_XXXX.npy
                          (used by tests to check that the unmasked sum is exact)
  secagg-fault="round=R,after=STAGE[,how=raise|exit]"   in round R: `before=setup` refuses the
                          setup of round R (the site sits R out); `after=setup` vanishes after it
                          (its masked input and unmask raise); `after=masked` vanishes after its
                          masked input (its unmask raises). how=exit kills the ClientApp process
                          without any reply. Several faults are separated by ';'.

Imports neither torch nor anything that does (the ClientApp path stays light).
"""

from __future__ import annotations

import logging
import os
import sys
import zlib
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType

from crypto.pki import SiteBundle
from crypto.pki.keys import raw_public
from crypto.secagg import (
    ChunkManifest,
    MalformedMessageError,
    ProtocolViolationError,
    ReplayedMessageError,
    RoundPlan,
    SecAggClient,
    SecAggConfig,
    SecAggError,
    member_id,
    ring,
)
from crypto.secagg.keys import KeyPair
from crypto.secagg.signing import check_relayed_adverts, sign
from crypto.secagg.wire import decode_masked_input_request
from federation.protocol import message_keys as keys
from federation.protocol.codecs import CodecError, UpdateSpec, parse_codec
from federation.protocol.message_keys import MASKED_INPUT, SETUP, UNMASK
from federation.protocol.payload_records import to_array
from federation.protocol.pipeline import Payload
from federation.protocol.secagg_records import Request, chunk_key, reply_record
from federation.protocol.update_codec import codec_meta
from federation.site.carried import carry, take
from federation.site.codec_mod import rounding_seed
from federation.site.masked_stream import MaskedFile, UpdateValues, mask_to_file, writer_for
from federation.site.replies import fail, ok, update_of
from federation.site.site_env import SiteEnv, load_bundle, site_env
from federation.site.update_stream import reader_records

__all__ = ["Request", "SecAggSiteError", "chunk_array", "on_setup", "on_train", "on_train_streamed", "on_unmask",
           "secagg_mod", "values_vector"]

STATE = keys.SECAGG  # this mod's record in context.state
log = logging.getLogger("sovfl.secagg_site")
_warned: set[str] = set()  # sites already warned about in this process (one ClientApp process per message)


class SecAggSiteError(RuntimeError):
    """Stage 3 could not run; raised so that the ClientApp answers with an error (Flower's error
    reply: the coordinator counts the site as dropped in stage 3)."""


def secagg_mod(msg: Message, context: Context, call_next) -> Message:
    """SecAgg+ on the site: stage 3 of a train message, stage 4 of a query, any round's setup."""
    records = msg.content.config_records
    stage_req, setup_req = keys.SECAGG in records, keys.SECAGG_SETUP in records
    discover = keys.DISCOVER in records and bool(records[keys.DISCOVER].get("secagg", False))
    if not (stage_req or setup_req or discover):
        return call_next(msg, context)
    env = site_env(context)
    train = msg.metadata.message_type == MessageType.TRAIN
    masking = prepare_masking(msg, context, env) if stage_req and train else None
    reply = call_next(msg, context)
    if not ok(reply):
        return _with_setup(reply, msg, context, env.site) if setup_req else reply
    if masking is not None:
        _mask_reply(msg, context, env, reply, masking)
    elif stage_req:
        answer = on_unmask(msg, context, env.site)
        if not isinstance(answer, ConfigRecord):  # a failure reply that says why
            return _with_setup(answer, msg, context, env.site) if setup_req else answer
        reply.content[keys.SECAGG] = answer
    if setup_req:
        reply.content[keys.SECAGG_SETUP] = on_setup(msg, context, env.site)
    if discover:
        status = reply.content.config_records[keys.STATUS]
        try:
            status["secagg_channel_pk"] = raw_public(_channel_key(context, env.site).public_key())
        except SecAggError as err:
            status["secagg_error"] = str(err)
    return reply


def _mask_reply(msg: Message, context: Context, env: SiteEnv, reply: Message, masking: Masking) -> None:
    """Replace the reply's update by its masked chunks: streamed from the trainer's file into a file
    the bulk mod uploads when the update is still there (client_app.streams_update), else whole."""
    source = take(reply)
    streamed = None
    if source is not None:
        try:
            streamed = on_train_streamed(context, env.site, source, masking)
            if streamed is None:  # no room for the file: read the update whole, as without the data path
                reply.content[keys.UPDATE] = reader_records(source)
        finally:
            source.close()
    if streamed is not None:
        masked_file, rec = streamed
        carry(reply, masked_file, env.opened)  # the bulk mod uploads it
        chunks, upload = masked_file.records(), float(masked_file.blob.size)  # the chunks' .npy bytes, as below
    else:
        st = reply.content.config_records[keys.STATUS]
        masked = on_train(msg, context, env.site, update_of(reply), int(st["num_examples"]), masking)
        chunks, rec = masked[keys.SECAGG_CHUNKS], masked[keys.SECAGG]
        upload = float(sum(len(a.data) for a in chunks.values()))
    del reply.content[keys.UPDATE], reply.content[keys.UPDATE_META]
    reply.content[keys.SECAGG_CHUNKS], reply.content[keys.SECAGG] = chunks, rec
    reply.content.metric_records[keys.METRICS]["upload_bytes"] = upload


def _with_setup(failed: Message, msg: Message, context: Context, site: str) -> Message:
    """A failed stage still answers the next round's setup the message asked for: the site is alive
    and its keys do not depend on its training, so a trainer that failed this round (and is back
    for the next) does not sit the next round out for want of a setup."""
    if failed.has_content():
        failed.content[keys.SECAGG_SETUP] = on_setup(msg, context, site)
    return failed


# ---- state in context.state -------------------------------------------------------------------

def _state(context: Context) -> ConfigRecord:
    rec = context.state.config_records.get(STATE)
    return rec if rec is not None else ConfigRecord({"last_setup": -1, "last_masked": -1})


def _save(context: Context, st: ConfigRecord) -> None:
    context.state[STATE] = st


def _bind(st: ConfigRecord, req: Request) -> None:
    """The state belongs to one SecAgg run id and config: refuse a request of another (a replay)."""
    if "run" in st and st["run"] != req.ctx.run_id:
        raise ReplayedMessageError(f"request for SecAgg run {req.ctx.run_id!r}, this site's state is for {st['run']!r}")
    if "config" in st and st["config"] != req.config_json:
        raise ProtocolViolationError("the secagg config changed within the run")
    st["run"], st["config"] = req.ctx.run_id, req.config_json


def _forget(st: ConfigRecord, below: int) -> None:
    """Delete the secrets (and plan names) of every round before `below`."""
    for k in [k for k in st if k[:1] in ("r", "n") and k[1:].isdigit() and int(k[1:]) < below]:
        del st[k]


def _load(context: Context, req: Request) -> tuple[ConfigRecord, SecAggClient]:
    st = _state(context)
    _bind(st, req)
    raw = st.get(f"r{req.ctx.round}")
    if raw is None:
        raise ProtocolViolationError(f"stage {req.stage} of round {req.ctx.round} arrived, but this site holds no "
                                     "SecAgg state for it (never set up, or the round is over)")
    client = SecAggClient.from_state(SecAggConfig.model_validate_json(req.config_json), bytes(raw))
    if client.ctx != req.ctx:
        raise ReplayedMessageError(f"stage-{req.stage} request for round {req.ctx.round} with another round context "
                                   "(another graph seed) than this site's setup")
    return st, client


def _signed_reply(req: Request, bundle: SiteBundle | None, content: bytes, stage: int | None = None,
                  **extra) -> ConfigRecord:
    """The reply's record, signed over `content` when the site has its bundle."""
    return reply_record(req, _sign(req, bundle, content, stage or req.stage), **extra)


def _sign(req: Request, bundle: SiteBundle | None, content: bytes, stage: int):
    return None if bundle is None else sign(bundle.sign_key, bundle.federation_id, bundle.name, req.ctx, stage,
                                            content)


def site_bundle(context: Context, site: str) -> SiteBundle | None:
    """The site's provisioned keys and peer registry (the message's SiteEnv's, if any), or None."""
    env = SiteEnv.current(context)
    bundle = env.bundle if env is not None else load_bundle(context)
    if bundle is None and site not in _warned:
        _warned.add(site)
        log.warning("site %s: no bundle-dir: SecAgg messages leave UNSIGNED and neighbours' keys are NOT checked "
                    "(insecure development mode; provision bundles with `sovfl provision`)", site)
    return bundle


def _channel_key(context: Context, site: str):
    """This site's X25519 channel key: the bundle's (provisioned, in every site's registry), or
    without a bundle a key of this Flower run (told to the coordinator at discovery, on trust)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    bundle = site_bundle(context, site)
    if bundle is not None:
        if bundle.channel_key is None:
            raise ProtocolViolationError(f"site {site}'s bundle has no SecAgg channel key: re-run `sovfl provision` "
                                         "(it adds one) and give the site its refreshed bundle")
        return bundle.channel_key
    st = _state(context)
    if "channel" not in st:
        st["channel"] = KeyPair.generate().private
        _save(context, st)
    return X25519PrivateKey.from_private_bytes(bytes(st["channel"]))


def _check_plan(plan: RoundPlan, bundle: SiteBundle | None) -> None:
    """With a bundle: every member is a registered, unrevoked site holding the channel key the plan
    gives it (a coordinator cannot slip in a key of its own)."""
    if bundle is None:
        return
    trust = bundle.trust()
    for m in plan.members:
        rec = trust.lookup(m.name)
        if rec is None or rec.role != "site" or rec.revoked:
            raise ProtocolViolationError(f"the plan names {m.name!r}, which is not a registered, unrevoked site")
        if rec.channel_public is None or raw_public(rec.channel_public) != m.channel_pk:
            raise ProtocolViolationError(f"the plan's channel key for {m.name!r} is not the one in our registry")
        if m.client != member_id(m.name):
            raise ProtocolViolationError(f"the plan gives {m.name!r} client id {m.client}, not its own")


# ---- the steps ----------------------------------------------------------------------------------

def on_setup(msg: Message, context: Context, site: str) -> ConfigRecord:
    """The SECAGG_SETUP reply: this site's setup of the planned round, or an `error` saying why not."""
    try:
        req = Request.parse(msg, keys.SECAGG_SETUP)
    except SecAggError as err:
        return ConfigRecord({"stage": SETUP, "error": f"{type(err).__name__}: {err}"})
    try:
        _fault(context, req.ctx.round, SETUP)
        bundle = site_bundle(context, site)
        cfg = SecAggConfig.model_validate_json(req.config_json)
        if not cfg.enabled:
            raise ProtocolViolationError("secagg plan with secure aggregation disabled in its config")
        plan = RoundPlan.decode(cfg, req.ctx, req.request)
        _check_plan(plan, bundle)
        channel = _channel_key(context, site)
        st = _state(context)
        _bind(st, req)
        if int(st["last_setup"]) >= req.ctx.round:
            raise ReplayedMessageError(f"round {req.ctx.round} was already set up here (last set up: "
                                       f"{st['last_setup']}); a round's keys are drawn once")
        me = member_id(bundle.name if bundle is not None else site)
        client, setup = SecAggClient.setup(cfg, plan, me, channel.private_bytes_raw())
        _forget(st, req.ctx.round - 1)
        st[f"r{req.ctx.round}"], st["last_setup"] = client.to_state(), req.ctx.round
        st[f"n{req.ctx.round}"] = "\n".join(m.name for m in plan.members)
        _save(context, st)
        advert = client.advert()
        asig = _sign(req, bundle, advert, 1)
        extra = {} if asig is None else {"advert_sig_header": asig.header, "advert_sig": asig.signature}
        return _signed_reply(req, bundle, setup, data=setup, advert=advert, **extra)
    except (SecAggError, ValueError, OSError, RuntimeError) as err:  # pydantic's ValidationError is a ValueError
        return reply_record(req, None, error=f"{type(err).__name__}: {err}")


def on_unmask(msg: Message, context: Context, site: str) -> ConfigRecord | Message:
    """Stage 4: the SECAGG reply record, or a failure reply that says why."""
    try:
        req = Request.parse(msg)
        if req.stage != UNMASK:
            raise ProtocolViolationError(f"a query carries secagg stage {req.stage}; stage 3 travels in a train message")
    except SecAggError as err:
        return fail(msg, site, f"secagg: {type(err).__name__}: {err}")
    _fault(context, req.ctx.round, req.stage)
    try:
        bundle = site_bundle(context, site)
        st, client = _load(context, req)
        data = client.unmask(req.request)  # a refused request leaves the state as it was (MASKED)
        _forget(st, req.ctx.round + 1)  # one unmask answer per round, then forget the secrets
        _save(context, st)
        return _signed_reply(req, bundle, data, data=data)
    except (SecAggError, ValueError, OSError) as err:
        return fail(msg, site, f"secagg stage {req.stage}: {type(err).__name__}: {err}")


class Masking:
    """A stage-3 request, checked before the trainer runs: the round's client and its request."""

    def __init__(self, req: Request, st: ConfigRecord, client: SecAggClient, bundle: SiteBundle | None):
        self.req, self.st, self.client, self.bundle = req, st, client, bundle


def prepare_masking(msg: Message, context: Context, env: SiteEnv) -> Masking:
    """Check a stage-3 request before any training: this round was set up here and not masked yet,
    the relayed neighbour keys carry the signatures of the sites the plan names (SecAggSiteError)."""
    try:
        req = Request.parse(msg)
        if req.stage != MASKED_INPUT:
            raise ProtocolViolationError(f"a train message carries secagg stage {req.stage}, expected 3")
        _fault(context, req.ctx.round, req.stage)
        bundle = site_bundle(context, env.site)
        st, client = _load(context, req)
        if int(st["last_masked"]) >= req.ctx.round:
            raise ReplayedMessageError(f"round {req.ctx.round} was already masked here")
        if bundle is not None:
            relayed = req.record.get("relayed", b"")
            if not isinstance(relayed, bytes):
                raise MalformedMessageError("the relayed advert signatures are not bytes")
            _, entries = decode_masked_input_request(req.ctx, req.request, client.id)
            check_relayed_adverts(entries, relayed, trust=bundle.trust(), federation_id=bundle.federation_id,
                                  ctx=req.ctx, me=client.id, names=_plan_names(st, req))
        return Masking(req, st, client, bundle)
    except (SecAggError, ValueError) as err:
        raise SecAggSiteError(f"site {env.site}: secagg stage 3: {type(err).__name__}: {err}") from None


def _plan_names(st: ConfigRecord, req: Request) -> dict[int, str]:
    """client id -> site name, as the plan this site set the round up with named them."""
    names = st.get(f"n{req.ctx.round}")
    return {member_id(n): n for n in str(names or "").split("\n") if n}


def chunk_array(packed: np.ndarray):
    """A masked chunk, packed at the ring's width, as a Flower Array (.npy bytes, one copy)."""
    return to_array(packed)


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


def on_train(msg: Message, context: Context, site: str, payload: Payload, num_examples: int,
             masking: Masking) -> dict:
    """Stage 3: mask the encoded update, whole in memory; the reply's SECAGG_CHUNKS and SECAGG records."""
    chunks: dict = {}
    manifest = ChunkManifest()

    def keep(offset: int, words: np.ndarray, bits: int) -> None:
        packed = ring.pack_words(words, bits)  # a fresh array: words is reused
        chunks[chunk_key(offset)] = chunk_array(packed)
        manifest.add(offset, words.shape[0], packed)

    def mask(rng, weight: int) -> tuple[bytes, int]:
        client = masking.client
        for offset, words in client.masked_input(masking.req.request, x, weight, rng=rng):
            keep(offset, words, client.params.codec.bits)
        return manifest.encode(), len(chunks)

    try:
        x = values_vector(payload)
    except (CodecError, ValueError) as err:
        raise SecAggSiteError(f"site {site}: secagg stage 3: {type(err).__name__}: {err}") from None
    rec = _stage3(context, site, masking, x.shape[0], lambda: x, mask)
    return {keys.SECAGG_CHUNKS: ArrayRecord(chunks), keys.SECAGG: rec}


def on_train_streamed(context: Context, site: str, source, masking: Masking) -> tuple[MaskedFile, ConfigRecord] | None:
    """Stage 3 on an identity update still in the trainer's hand-off file (`source`, a handoff
    Reader): masked a chunk at a time into a file (masked_stream.py), never whole here. The
    MaskedFile (its blob for the bulk mod) and the reply's SECAGG record; None if the file cannot
    be reserved (nothing is masked yet: the caller masks in memory, as without the data path)."""
    try:
        values = UpdateValues(source)
        values.check_finite()
        spec, _ = decode_masked_input_request(masking.req.ctx, masking.req.request, masking.client.id)
    except (SecAggError, CodecError, ValueError, OSError) as err:
        raise SecAggSiteError(f"site {site}: secagg stage 3: {type(err).__name__}: {err}") from None
    try:
        writer = writer_for(masking.client, values, spec.bits, site)
    except OSError as err:
        print(f"[sovfl site] site {site}: cannot write the masked update to a file ({err}); masking it in memory",
              file=sys.stderr, flush=True)
        return None
    made: list[MaskedFile] = []

    def mask(rng, weight: int) -> tuple[bytes, int]:
        masked, manifest = mask_to_file(masking.client, masking.req.request, values, weight, writer, rng=rng)
        made.append(masked)
        return manifest, len(masked.chunks)

    try:
        rec = _stage3(context, site, masking, values.length, values.whole, mask)
    except BaseException:
        writer.discard()
        for m in made:
            m.close()
        raise
    return made[0], rec


def _stage3(context: Context, site: str, masking: Masking, length: int, whole, mask) -> ConfigRecord:
    """What both ways of masking share: the request's weight and length checked against the update,
    then `mask(rng, weight)` (-> the manifest of the chunks made, their number), with the round's state saved as
    masked whatever happens from there (masks are single use), and the signed SECAGG record.
    `whole()` gives the values whole, for the test-only dump hook."""
    req, st, client, bundle = masking.req, masking.st, masking.client, masking.bundle
    try:
        try:
            weight, vector_len = int(req.record["weight"]), int(req.record["vector_len"])
        except (KeyError, TypeError, ValueError) as err:
            raise MalformedMessageError(f"stage-3 request without weight / vector_len ({err})") from None
        if not 1 <= weight <= client.config.max_weight:
            raise ProtocolViolationError(f"weight {weight} outside [1, {client.config.max_weight}]")
        if length != vector_len:
            raise ProtocolViolationError(f"the encoded update has {length} values, the round expects {vector_len}")
        # everything below commits this round's masks: the state is saved as MASKED even if it fails
        try:
            rng = _dump_rng(context, whole, weight, req, client.id)
            if rng is None and (seed := rounding_seed(context)) is not None:  # reproducible runs (codec_mod.py)
                rng = np.random.default_rng([seed, req.ctx.round, zlib.crc32(site.encode())])
            manifest, count = mask(rng, weight)
        finally:
            st[f"r{req.ctx.round}"], st["last_masked"] = client.to_state(), req.ctx.round
            _forget(st, req.ctx.round)
            _save(context, st)
        return _signed_reply(req, bundle, manifest, chunks=count, vector_len=vector_len, weight=weight,
                             bits=client.params.codec.bits)
    except (SecAggError, CodecError, ValueError, OSError) as err:
        raise SecAggSiteError(f"site {site}: secagg stage 3: {type(err).__name__}: {err}") from None


# ---- test-only hooks ------------------------------------------------------------------------------

_FAULTS = {("before", "setup"): {SETUP, MASKED_INPUT, UNMASK}, ("after", "setup"): {MASKED_INPUT, UNMASK},
           ("after", "masked"): {UNMASK}}


def _fault(context: Context, rnd: int, stage: int) -> None:
    """Test only (node config `secagg-fault`): vanish from round `rnd` at some step (module docstring)."""
    spec = str(context.node_config.get("secagg-fault", "") or "")
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kv = dict(item.split("=", 1) for item in part.split(","))
        when = next((w for w in ("before", "after") if w in kv), "after")
        if int(kv["round"]) == rnd and stage in _FAULTS[(when, kv[when])]:
            if kv.get("how", "raise") == "exit":
                os._exit(17)  # the ClientApp process dies: no reply at all
            raise RuntimeError(f"test fault injected: vanished {when} stage '{kv[when]}' of round {rnd}")


def _dump_rng(context: Context, whole, weight: int, req: Request, me: int):
    """Test only (node config `secagg-dump-dir`): the seeded rounding generator, after writing the
    encoded ring vector it will produce (the same noise key drives both). `whole()`: the values."""
    where = str(context.node_config.get("secagg-dump-dir", "") or "")
    if not where:
        return None
    x = whole()
    spec, _ = decode_masked_input_request(req.ctx, req.request, me)
    from crypto.secagg import FixedPointCodec

    codec = FixedPointCodec(SecAggConfig.model_validate_json(req.config_json).clip, spec.bits, spec.levels,
                            spec.weight_bound)
    seed = int.from_bytes(os.urandom(8), "big")
    ring_vector = codec.encode(x, weight, np.random.default_rng(seed))
    Path(where).mkdir(parents=True, exist_ok=True)
    np.save(Path(where) / f"round_{req.ctx.round:04d}.npy", ring_vector)
    return np.random.default_rng(seed)
