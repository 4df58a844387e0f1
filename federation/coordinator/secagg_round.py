"""Secure aggregation (SecAgg+) as a round strategy: the coordinator's side.

The coordinator learns the weighted sum of the surviving sites' updates and nothing about any
single one (crypto/secagg/README.md: protocol and security argument). A round costs each site two
messages:

  round r - 1 (or discovery)   the plan of round r rides on a message the site gets anyway
                               (`SetupRider`); its reply carries the site's setup: fresh mask key,
                               seed commitment, Shamir shares sealed to its round-r neighbours
  round r, train message       stage 3: the ring, the live neighbours' mask keys with their
                               signatures and their envelopes to this site; the reply carries the
                               masked input (and the site's setup of round r + 1)
  round r, unmask query        stage 4: the shares that remove the masks

`SecAggRound` runs stages 3 and 4 as `Step`s over a `SecAggState`; the setups of coming rounds live
in `PendingSetups` on the strategy object. The message formats are in protocol/secagg_records.py;
the site's side is site/secagg_mod.py.

Plans. Round r's plan (crypto.secagg.RoundPlan) is fixed while round r - 1 runs: its round context
(a fresh random graph seed), and as members the sites sampled for round r (sampling is
reproducible from the federation seed, so it is known ahead), each with its SecAgg id
(`member_id(name)`) and long-term channel key (the CA-signed registry's; without a bundle, the key
the site told at discovery). A sampled site without a setup for round r (new, down or failing when
it was asked, or not sampled in round r - 1 and not reached by a prepare query) sits round r out;
it is asked for the setup of round r + 1 during round r. A site whose message failed (a crash, an
unreachable node) is asked again on the next message, or before round r + 1 starts if none goes out;
one that let the deadline pass is not waited for again.

Signatures (crypto.secagg.signing): every reply carries the site's Ed25519 signature over its
content (stage 3: the manifest of its packed chunks), bound to federation, run, round, stage and
site; a setup also carries the signature of its advert. With a coordinator bundle each is verified
against the site's registered key and the run's replay guard; a missing or bad signature rejects
the message (counted under its own reason, e.g. secagg_unsigned, secagg_bad_signature,
secagg_digest_mismatch). A rejected setup leaves the site out of its round, a rejected stage-3 or
-4 message counts as a dropout in that stage. The stage-3 request adds `relayed`: the live
neighbours' advert signatures, which each site checks before masking. Without a bundle (insecure
development runs) signatures are relayed but not checked here.

Dropouts: a site that errs, is rejected or misses a deadline in stage 3 is treated as having
vanished after its setup (its mask key is rebuilt from its neighbours' shares; it drew a fresh one
for every other round); in stage 4, after its masked input (its seed is rebuilt). When fewer than t
remain, `SecAggAbort` ends the round (the driver calls `abort`): `RoundOutcome.mean` is None (the
coordinator skips the round and leaves the global model unchanged), the reason is in
`extra["secagg"]["aborted"]`, in every sampled site's `failed` entry and in the progress log; the
next round has its own plan and setups and starts afresh.

Ring: the round's ring is chosen when stage 3 starts, for the sites that take part (config.codec):
with an integer codec on the secagg clip (e.g. randk + int8:clip=C), the narrowest that cannot
wrap for their number and largest weight; masked values travel packed at its width.

Memory: masked chunks are added to the SecAggServer's single uint32 accumulator (P + 1 words) as
each stage-3 reply is pulled (`receive_masked_input`), and the reply is dropped right away; the
driver pulls a streamed stage's replies one message id at a time, so at most
`federation.receive_workers` sites' masked vectors are held besides the accumulator: O(P), not
O(N·P). Once the train messages are built, the global model goes to disk (model_spill.py) and
FedAvg's step writes the new model into the ring's own words, so the round never holds the model
and the ring at once.

Concurrency: stage 3's replies are checked and added on up to `receive_workers` threads at once
(exchange.py, reply_folds.py), so the large replies of a WAN round do not wait for one
another. Each fold hashes, verifies and unpacks its own chunks unlocked, adds each chunk holding
the accumulator's stripes it covers (`StripeLocks`), and updates the round's bookkeeping (replay
guard, rejections, per-site metrics) under the state's lock. The sum is bit for bit the same in
any order: ring words add modulo 2^32, and nothing of the stage is a float sum.

Weights: a site's weight is its num_examples (as reported at site discovery), an integer the ring
carries next to the masked vector. When some sampled site has more than `max_weight` examples, every
weight of the round is scaled by max_weight / max(num_examples) and rounded (at least 1): the
ratios, hence the weighted mean, are kept up to that rounding. The coordinator learns only the total.

Decoding: the unmasked sum decodes (crypto.secagg fixed point) to the weighted mean of the sites'
codec values; it goes back through the codec's layout to a dense update (identity: reshaped to the
model; random-k: scattered onto the round's shared support), i.e. the same weighted mean update
`PlainRound` produces, so FedAvg / FedAdam / FedYogi apply unchanged. Values are clipped to
[-clip, clip] before encoding (the secagg config's clip, the same at every site); a codec's error
feedback does not see that clip or the fixed-point rounding (zero-mean, below one step 2c/L).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from flwr.app import Message, RecordDict

import crypto.secagg as secagg
from crypto.envelope import ReplayGuard
from crypto.pki import CoordinatorBundle
from crypto.secagg import (
    ChunkManifest,
    MalformedMessageError,
    ProtocolViolationError,
    ReplayedMessageError,
    RoundPlan,
    SecAggAbort,
    SecAggError,
    SecAggMessageError,
    SecAggServer,
    Signature,
    TamperedMessageError,
    member_id,
    new_context,
)
from crypto.secagg import wire as secagg_wire
from crypto.secagg.signing import verify
from federation.config.schema import FederationConfig
from federation.coordinator.envelope_opener import PageDropper
from federation.coordinator.model_spill import spill_model
from federation.coordinator.reply_folds import StripeLocks
from federation.coordinator.strategy import Exchange, ExchangeResult, Reply, RoundInput, RoundOutcome, Step, site_metrics
from federation.protocol.codecs import Arrays, UpdateSpec, parse_codec
from federation.protocol.message_keys import MASKED_INPUT, SECAGG, SECAGG_SETUP, SETUP, STAGE_NAMES, STATUS, UNMASK
from federation.protocol.pipeline import UpdateRejected, check_update
from federation.protocol.secagg_records import (
    check_reply,
    context_run_id,
    parse_chunks,
    reply_bytes,
    request_record,
    signature_of,
)
from federation.protocol.update_codec import secagg_levels
from federation.protocol.wire_dtypes import master_spec


def rejection_reason(err: Exception) -> str:
    """Short stable code for the round's rejection counts."""
    reason = getattr(err, "reason", None)  # SignatureRejected
    if isinstance(reason, str):
        return reason
    for cls, code in ((ReplayedMessageError, "secagg_replayed"), (TamperedMessageError, "secagg_tampered"),
                      (MalformedMessageError, "secagg_malformed"), (ProtocolViolationError, "secagg_protocol")):
        if isinstance(err, cls):
            return code
    return "secagg_rejected"


def round_weights(num_examples: dict[int, int], max_weight: int) -> dict[int, int]:
    """Integer ring weights from sample counts (see the module docstring)."""
    top = max(num_examples.values(), default=0)
    if top <= max_weight:
        return {n: max(1, int(v)) for n, v in num_examples.items()}
    return {n: min(max_weight, max(1, int(round(v * max_weight / top)))) for n, v in num_examples.items()}


class Signatures:
    """The coordinator's check of signed SecAgg messages (see the module docstring)."""

    def __init__(self, bundle: CoordinatorBundle | None, replay: ReplayGuard):
        self.trust = bundle.trust() if bundle is not None else None  # None: insecure, not checked
        self.federation_id = bundle.federation_id if bundle is not None else ""
        self.replay = replay

    def check(self, sig: Signature | None, content: bytes, ctx: secagg.RoundContext, stage: int, site: str) -> None:
        """Verify `sig` as `site`'s stage message of round `ctx`; SecAggMessageError if bad."""
        if self.trust is not None:
            verify(sig, content, trust=self.trust, federation_id=self.federation_id, ctx=ctx, stage=stage,
                   site=site, replay=self.replay)


@dataclass
class RoundSetups:
    """What the coordinator holds for one coming round: its plan and the setups the sites sent."""

    plan: RoundPlan | None  # None: fewer than two sites could be planned
    setups: dict[str, tuple[bytes, Signature | None]] = field(default_factory=dict)  # site -> (setup, advert sig)
    missing: dict[str, str] = field(default_factory=dict)  # site -> why it has no setup
    asked: set[int] = field(default_factory=set)  # nodes a message asked for their setup
    rejections: Counter = field(default_factory=Counter)  # reason -> count, counted in the round's line


class PendingSetups:
    """Setups of coming rounds, by round: state that lives across rounds.

    Bound to one SecAgg run id ("<federation>/<flower run id>"): a resumed coordinator is a new
    Flower run and must start with an empty one (its sites start with empty SecAgg state too), so
    material from before a crash is never combined with new material. Rounds are dropped once they
    ran (`take`)."""

    def __init__(self) -> None:
        self.rounds: dict[int, RoundSetups] = {}

    def take(self, rnd: int) -> RoundSetups | None:
        """The setups of round `rnd`, removed (with every older round's)."""
        for r in [r for r in self.rounds if r < rnd]:
            del self.rounds[r]
        return self.rounds.pop(rnd, None)


def in_ring_mean(result: secagg.SecAggResult, spec: UpdateSpec) -> Arrays:
    """The dense mean update decoded into the unmasked sum's own P words (uint32 in, float32 out,
    one chunk at a time: each chunk is read whole before its words are written), the tensors
    views of them: the coordinator holds the ring once, not the ring, a flat mean and its tensors.
    `result.ring_sum` is spent after this."""
    ring = result.ring_sum
    if ring.dtype.itemsize != 4 or not ring.flags.c_contiguous or ring.shape != (spec.numel + 1,):
        return spec.unflatten(result.decode())  # not 32-bit words: decode beside them
    flat = result.decode(out=ring[:-1].view(np.float32))
    out, offset = {}, 0
    for name, shape, size in zip(spec.names, spec.shapes, spec.sizes):
        out[name] = flat[offset:offset + size].reshape(shape)
        offset += size
    return out


@dataclass
class SecAggState:
    """One SecAgg+ round in progress: the crypto server, who is still in, and the metrics so far."""

    inp: RoundInput
    names: dict[int, str]  # node -> site
    out: RoundOutcome = field(default_factory=lambda: RoundOutcome(None, 0))
    info: dict = field(default_factory=dict)  # the metrics line's "secagg" entry
    stage: int = SETUP
    setups: RoundSetups | None = None
    server: SecAggServer | None = None
    ids: dict[int, int] = field(default_factory=dict)  # node -> SecAgg member id
    vector_len: int = 0  # m: values each site masks (the weight word comes on top)
    dense: Callable[[np.ndarray], Arrays] | None = None  # mean values -> dense update
    live: list[int] = field(default_factory=list)  # nodes masking (U2)
    survivors: list[int] = field(default_factory=list)  # nodes whose masked input is in the sum (U3)
    weights: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # stage 3's folds run on several threads
    stripes: StripeLocks | None = None  # the accumulator's stripes, made with the crypto server
    model_spilled: bool = False  # the global model is on disk (model_spill.py) until the step

    @property
    def ctx(self) -> secagg.RoundContext:
        """The round context of the round in progress (its plan's)."""
        assert self.setups is not None
        return self.setups.plan.ctx


class SecAggRound:
    """`Strategy` for `federation.secagg.enabled`: see the module docstring."""

    aborts = (SecAggAbort,)
    messages = 2  # a round's messages to each site: train (stage 3) and unmask (stage 4); setup rides along

    def __init__(self, fed: FederationConfig, bundle: CoordinatorBundle | None, replay: ReplayGuard,
                 spill_dir: Path | None = None):
        self.fed, self.cfg, self.bundle = fed, fed.secagg, bundle
        self.spill_dir = spill_dir  # where the model waits while the ring exists (model_spill.py; None: in memory)
        self.config_json = fed.secagg.model_dump_json()
        self.sigs = Signatures(bundle, replay)
        self.pending = PendingSetups()
        self.levels = secagg_levels(fed.codec, fed.secagg.clip)

    # ---- plans and setups (one round ahead) ----------------------------------------------------
    def registered_channel_keys(self) -> dict[str, bytes]:
        """site -> long-term channel key, from the CA-signed registry (empty without a bundle)."""
        if self.sigs.trust is None:
            return {}
        out = {}
        for name in self.sigs.trust.sites:
            rec = self.sigs.trust.lookup(name)
            if rec is not None and not rec.revoked and rec.channel_public is not None:
                out[name] = rec.channel_public.public_bytes_raw()
        return out

    def plan(self, rnd: int, flower_run_id: int, names: Iterable[str], channel_keys: dict[str, bytes]) -> RoundSetups:
        """Fix round `rnd`'s plan for the sites `names` (those without a channel key cannot take
        part and are noted as missing); a fresh random graph seed."""
        ctx = new_context(context_run_id(self.fed.name, flower_run_id), rnd)
        names = sorted(set(names))
        members = [secagg_wire.PlanMember(member_id(n), n, channel_keys[n]) for n in names if n in channel_keys]
        why = f"round {rnd} has fewer than 2 sites with a channel key"
        try:
            plan = RoundPlan.make(self.cfg, ctx, members) if len(members) >= 2 else None
        except SecAggError as err:
            plan, why = None, f"round {rnd} cannot be planned: {err}"
        setups = RoundSetups(plan)
        for n in names:
            if n not in channel_keys:
                setups.missing[n] = ("no SecAgg channel key for this site (provision it again: `sovfl provision` adds "
                                     "one; without a bundle, the site must answer discovery)")
            elif plan is None:
                setups.missing[n] = why
        self.pending.rounds[rnd] = setups
        return setups

    def setup_rider(self, rnd: int, names: Callable[[int], str | None], candidates: Callable[[], list[int]]) -> "SetupRider":
        """The rider that asks the members of round `rnd`'s plan for their setups."""
        return SetupRider(self, self.pending.rounds[rnd], names, candidates)

    # ---- the round ----------------------------------------------------------------------------
    def begin(self, inp: RoundInput) -> SecAggState:
        """A fresh state over the round's setups (the crypto server is made in stage 3)."""
        st = SecAggState(inp, inp.names(inp.nodes))
        st.info.update(threshold=None, sampled=len(inp.nodes), stage_s={})
        st.out.extra["secagg"] = st.info
        st.setups = self.pending.take(inp.round)
        return st

    def steps(self) -> tuple[Step[SecAggState], ...]:
        """Stages 3 and 4 (the setups rode on earlier messages)."""
        return (Step(self.configure_masked_input, self.aggregate_masked_input, self.receive_masked_input,
                     concurrent=True),
                Step(self.configure_unmask, self.aggregate_unmask))

    def layout(self, inp: RoundInput) -> tuple[int, Callable[[np.ndarray], Arrays] | None]:
        """(value-vector length m, function mean values -> dense update) for this round's codec;
        None for a dense codec: its mean is decoded in the ring's own words (`in_ring_mean`)."""
        spec = UpdateSpec.of(inp.model)
        codec = parse_codec(inp.codec or self.fed.codec, error_feedback=self.fed.error_feedback)
        if codec.sparsifier is None:
            return spec.numel, None
        k = codec.sparsifier.k(spec.numel)
        ctx = inp.ctx.codec_round()
        meta = {"k": k, "seed": ctx.seed, "server_round": ctx.server_round}

        def dense(values: np.ndarray) -> Arrays:
            flat = np.zeros(spec.numel, dtype=np.float32)
            flat[codec.sparsifier.support({}, meta, spec.numel, ctx)] = values
            return spec.unflatten(flat)

        return k, dense

    # ---- helpers -------------------------------------------------------------------------------
    def _reject(self, st: SecAggState, name: str, err: Exception) -> None:
        reason = rejection_reason(err)
        st.out.reject(name, reason, f"stage {st.stage} ({STAGE_NAMES[st.stage]}): {err}")
        st.inp.log(f"secagg: rejected {name}'s stage-{st.stage} message ({reason}): {err}; it is treated as dropped")

    def _failed(self, st: SecAggState, result: ExchangeResult, label: str) -> None:
        st.out.failed.update({k: f"stage {st.stage} ({label}): {v}" for k, v in result.failed.items()})
        st.info["stage_s"][str(st.stage)] = round(result.seconds, 3)

    def _open_setups(self, st: SecAggState) -> list[int]:
        """Make the round's crypto server and hand it the setups of the nodes taking part; the nodes
        whose setup it took. A site without one sits the round out (named in `failed`)."""
        setups = st.setups
        if setups is None or setups.plan is None:
            why = "no plan was made for this round" if setups is None else "fewer than 2 sites could be planned"
            raise SecAggAbort(f"stage 2: {why}")
        st.out.rejections.update(setups.rejections)
        st.server = SecAggServer(self.cfg, setups.plan, vector_len=st.vector_len)
        taken = []
        for node in st.inp.nodes:
            name = st.names[node]
            if name not in setups.setups:
                why = setups.missing.get(name) or ("its setup did not arrive in time" if node in setups.asked
                                                   else "the site was not asked for one")
                st.out.failed.setdefault(name, why if why.startswith("rejected ") else
                                         f"secagg: no setup for round {st.inp.round} ({why}); it sits this round out")
                continue
            try:
                st.server.receive_setup(member_id(name), setups.setups[name][0])
            except SecAggMessageError as err:
                self._reject(st, name, err)
                continue
            st.ids[node] = member_id(name)
            taken.append(node)
        return taken

    # ---- stage 3: masked input, in the train message ---------------------------------------------
    def configure_masked_input(self, st: SecAggState) -> Exchange:
        """Close the setup (U2, the ring); the train message: the model, plus each live site's
        neighbours' keys and envelopes, their signatures and its integer weight."""
        inp = st.inp
        st.stage = SETUP  # closing it: who takes part, in which ring
        st.vector_len, st.dense = self.layout(inp)
        taken = self._open_setups(st)
        sites = inp.sites
        weights = round_weights({n: sites[n].num_examples if n in sites else 1 for n in taken}, self.cfg.max_weight)
        levels = self.levels if inp.codec in (None, self.fed.codec) else secagg_levels(inp.codec, self.fed.secagg.clip)
        live_ids = st.server.close_setup([st.ids[n] for n in taken], max(weights.values(), default=1), levels)
        by_id = {st.ids[n]: n for n in taken}
        st.live = [by_id[i] for i in live_ids]
        st.weights = {n: weights[n] for n in st.live}
        for n in set(taken) - set(st.live):
            st.out.failed.setdefault(st.names[n], "secagg: too few live neighbours after the setup")
        st.stage = MASKED_INPUT
        params = st.server.params
        st.stripes = StripeLocks(st.vector_len + 1, params.chunk_words)
        st.info.update(roster=len(setups_plan(st).members), live=len(st.live), threshold=params.threshold,
                       degree=params.degree, levels=params.codec.levels, bits=params.codec.bits,
                       weight_bound=params.codec.max_weight, clip=params.codec.clip, vector_len=st.vector_len)
        deadline = float(self.fed.deadlines.round_s)
        model = inp.model_message(deadline)
        requests = {n: st.server.masked_input_request(st.ids[n]) for n in st.live}
        adverts = {st.ids[n]: st.setups.setups[st.names[n]][1] for n in st.live}  # member -> its advert signature

        def content(node: int) -> RecordDict:
            me = st.ids[node]
            sigs = {v: (adverts[v].header, adverts[v].signature)
                    for v in sorted(st.server.graph[me] & set(live_ids)) if adverts[v] is not None}
            rd = model(node)
            rd[SECAGG] = request_record(MASKED_INPUT, st.ctx, self.config_json, requests[node], weight=st.weights[node],
                                        vector_len=st.vector_len,
                                        relayed=secagg_wire.encode_advert_signatures(st.ctx, me, sigs))
            if node == st.live[-1] and self.spill_dir is not None and not st.model_spilled:
                # every train message is built: the model waits on disk until the step, through the
                # uploads and while the ring exists (model_spill.py)
                st.model_spilled = True
                spill_model(st.inp.model, self.spill_dir)
            return rd

        return Exchange("secagg stage 3 (train)", "train", st.live, content, deadline)

    def receive_masked_input(self, st: SecAggState, reply: Reply) -> None:
        """Check one site's masked chunks whole, then add them to the sum and drop the reply. Runs
        on several threads at once, one reply each (module docstring, "Concurrency")."""
        node = reply.node
        try:
            rec = check_reply(reply.message, MASKED_INPUT, st.ctx)
            # checked whole, then added chunk by chunk: one chunk's words at a time, and the pages of
            # a reply resolved from the data path dropped as they are read
            chunks = parse_chunks(reply.message, st.vector_len + 1, st.server.params.codec.bits, unpack=False)
            drop = PageDropper()
            manifest = ChunkManifest()
            for c in chunks:
                manifest.add(c.offset, c.count, c.packed)
                drop(c.packed)
            with st.lock:  # the run's replay guard
                self.sigs.check(signature_of(rec), manifest.encode(), st.ctx, MASKED_INPUT, st.names[node])
            for c in chunks:
                words = c.unpacked()  # unlocked: the costly part
                with st.stripes.hold(c.offset, c.count):
                    st.server.add_masked_chunk(st.ids[node], c.offset, words)
                drop(c.packed)
                del words
        except SecAggMessageError as err:  # add_masked_chunk cannot fail after parse_chunks; if it did, stage 3 aborts
            with st.lock:
                self._reject(st, reply.name, err)
            return
        metrics = site_metrics(reply)
        metrics["upload_bytes"] = float(sum(c.packed.nbytes for c in chunks))
        metrics["weight"] = st.weights[node]
        with st.lock:
            st.out.per_site[reply.name] = metrics

    def aggregate_masked_input(self, st: SecAggState, result: ExchangeResult) -> None:
        """The survivors: sites whose masked input is in the sum."""
        self._failed(st, result, "masked input, train")
        by_id = {i: n for n, i in st.ids.items()}
        st.survivors = [by_id[i] for i in st.server.close_masked_input()]

    # ---- stage 4: unmask -----------------------------------------------------------------------
    def configure_unmask(self, st: SecAggState) -> Exchange:
        """Ask the survivors for the shares that remove the masks."""
        st.stage = UNMASK
        requests = {n: st.server.unmask_request(st.ids[n]) for n in st.survivors}
        return Exchange(f"secagg stage {UNMASK}", "query", st.survivors, lambda node: RecordDict(
            {SECAGG: request_record(UNMASK, st.ctx, self.config_json, requests[node])}), float(self.fed.deadlines.secagg_stage_s))

    def aggregate_unmask(self, st: SecAggState, result: ExchangeResult) -> None:
        """Take each survivor's shares."""
        self._failed(st, result, STAGE_NAMES[UNMASK])
        for reply in result.replies:
            node = reply.message.metadata.src_node_id  # authenticated by the SuperLink
            try:
                if node not in st.survivors:
                    raise ProtocolViolationError(f"reply from node {node}, which was not asked")
                rec = check_reply(reply.message, UNMASK, st.ctx)
                data = reply_bytes(rec)
                self.sigs.check(signature_of(rec), data, st.ctx, UNMASK, st.names[node])
                st.server.receive_unmask(st.ids[node], data)
            except SecAggMessageError as err:
                self._reject(st, reply.name, err)

    # ---- the outcome ---------------------------------------------------------------------------
    def finish(self, st: SecAggState) -> RoundOutcome:
        """Unmask the sum and decode it to the weighted mean update (SecAggAbort if it cannot)."""
        info, out = st.info, st.out
        t0 = time.monotonic()
        result = st.server.finish()
        info["unmask_s"] = round(time.monotonic() - t0, 3)
        t0 = time.monotonic()
        names = {st.ids[n]: st.names[n] for n in st.ids}
        contributors = [names[i] for i in result.contributors]
        info.update(contributors=sorted(contributors), dropped=sorted(names[i] for i in result.dropped),
                    weight_total=result.weight_total, error_bound=result.error_bound(),
                    ring_sum_sha256=hashlib.sha256(memoryview(np.ascontiguousarray(result.ring_sum))).hexdigest())
        # per_site holds train metrics of the sites whose masked input is in the sum, and only those
        out.per_site = {k: out.per_site[k] for k in sorted(out.per_site) if k in contributors}  # not arrival order
        late = {name: out.failed.pop(name) for name in out.per_site if name in out.failed}
        if late:  # vanished in stage 4: its masked input is in the sum, its seed was rebuilt from shares
            info["unmask_missing"] = late
        try:
            if st.dense is None:  # a dense update: decoded into the ring's own words, tensors as views of them
                mean = in_ring_mean(result, UpdateSpec.of(st.inp.model))
            else:
                mean = st.dense(result.decode())
            spec = master_spec(st.inp.spec)  # bf16 tensors are kept and averaged in float32
            mean = {k: v.astype(np.dtype(spec[k][0]), copy=False) for k, v in mean.items()}
            check_update(mean, spec)
        except (UpdateRejected, SecAggError, ValueError, KeyError) as err:
            raise SecAggAbort(f"the unmasked sum does not decode to an update of the model: {err}") from None
        out.mean, out.count = mean, len(contributors)
        info["decode_s"] = round(time.monotonic() - t0, 3)
        return out

    def abort(self, st: SecAggState, err: BaseException) -> RoundOutcome:
        """Below the threshold (or undecodable): no update this round, every sampled site told why."""
        detail = str(err)
        for node, name in st.names.items():  # name the sites the library calls by id
            if node in st.ids:
                detail = detail.replace(f"client {st.ids[node]}", f"site {name}").replace(str(st.ids[node]), name)
        reason = f"secure aggregation aborted in stage {st.stage} ({STAGE_NAMES.get(st.stage, '?')}): {detail}"
        st.info.update(stage=st.stage, aborted=reason)
        for name in st.names.values():
            st.out.failed.setdefault(name, f"round aborted: {reason}")
        st.out.per_site, st.out.mean, st.out.count = {}, None, 0
        st.inp.log(f"round {st.inp.round}: {reason}; the global model is unchanged, the next round starts afresh")
        return st.out


def setups_plan(st: SecAggState) -> RoundPlan:
    """The plan of the round in progress."""
    assert st.setups is not None and st.setups.plan is not None
    return st.setups.plan


class SetupRider:
    """Asks the members of a coming round's plan for their setups, on whatever messages go out
    (see strategy.Rider), and verifies each setup as it arrives."""

    def __init__(self, strategy: SecAggRound, setups: RoundSetups, names: Callable[[int], str | None],
                 candidates: Callable[[], list[int]]):
        self.strategy, self.setups, self.names, self.candidates = strategy, setups, names, candidates
        self.members = {m.name for m in setups.plan.members} if setups.plan is not None else set()
        self.asked: set[int] = set()
        self.record = None if setups.plan is None else request_record(
            SETUP, setups.plan.ctx, strategy.config_json, setups.plan.encode())

    def _needs(self, node: int) -> bool:
        name = self.names(node)
        if self.record is None or node in self.asked:
            return False
        if name is None:  # discovery: the node has not said who it is yet; the plan is the same for all
            return True
        return name in self.members and name not in self.setups.setups and name not in self.setups.missing

    def records(self, node: int) -> dict:
        """The plan, to a member that has not sent its setup yet."""
        if not self._needs(node):
            return {}
        self.asked.add(node)
        self.setups.asked.add(node)
        return {SECAGG_SETUP: self.record}

    def wanted(self) -> list[int]:
        """Members that still owe their setup and were not asked in a message still in flight."""
        return [n for n in self.candidates() if self.names(n) is not None and self._needs(n)]

    def take(self, node: int, reply: Message | None) -> None:
        """Verify and keep a setup (or note why there is none)."""
        if node not in self.asked:
            return
        if reply is None:
            self.asked.discard(node)  # no answer yet: a later message may ask again
            return
        content = reply.content if reply.has_content() else None
        status = content.config_records.get(STATUS) if content is not None else None
        name = self.names(node) or (str(status["site"]) if status is not None and "site" in status else None)
        if name is None or name not in self.members:
            return
        rec = content.config_records.get(SECAGG_SETUP) if content is not None else None
        if rec is None:  # the message failed (or a reply without the record): asked again if another
            self.asked.discard(node)  # goes out, else before its round (prepare_round): a site back
            self.setups.asked.discard(node)  # from a crash sits out the round it missed, not the next
            return
        plan = self.setups.plan
        try:
            if "error" in rec:
                self.setups.missing[name] = f"the site could not set up: {rec['error']}"
                return
            rec = check_reply(reply, SETUP, plan.ctx, key=SECAGG_SETUP)
            data, advert = reply_bytes(rec), reply_bytes(rec, "advert")
            me = member_id(name)
            setup = secagg_wire.decode_setup(plan.ctx, data, me)
            if secagg_wire.decode_advert(plan.ctx, advert, me).s_pk != setup.s_pk:
                raise ProtocolViolationError("the signed advert is not the setup's mask key")
            sigs = self.strategy.sigs
            sigs.check(signature_of(rec), data, plan.ctx, SETUP, name)
            advert_sig = signature_of(rec, "advert_")
            sigs.check(advert_sig, advert, plan.ctx, 1, name)
        except SecAggMessageError as err:
            reason = rejection_reason(err)
            self.setups.rejections[reason] += 1
            self.setups.missing[name] = f"rejected {reason}: setup: {err}"
            return
        self.setups.setups[name] = (data, advert_sig)
        self.setups.missing.pop(name, None)

