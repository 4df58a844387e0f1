"""Secure aggregation (SecAgg+) as a round strategy: the coordinator's side.

The coordinator learns the weighted sum of the surviving sites' updates and nothing about any
single one. One round is four stages, one `Step` each (configure_X builds the stage's messages,
aggregate_X folds the replies into `SecAggState`): advertise keys, share keys, masked input (the
train message) and unmask. The message formats are in protocol/secagg_records.py; the site's side
is site/secagg_mod.py.

Signatures (crypto.secagg.signing): every reply carries the site's Ed25519 signature over its
content (stage 3: the manifest of its chunks) bound to federation, run, round, stage and site.
With a coordinator bundle each is verified against the site's registered key and the run's
replay guard; a missing or bad signature rejects the message (counted under its own reason, e.g.
secagg_unsigned, secagg_bad_signature, secagg_digest_mismatch), and the site counts as dropped in
that stage. The stage-2 request adds `relayed`: the neighbours' advert signatures, so that each
site checks that no key was substituted. Without a bundle (insecure development runs) signatures
are relayed but not checked here.

Identities: a site's SecAgg client id is its Flower node id (unsigned 64-bit). The coordinator takes
it from the node a message was addressed to, which the SuperLink authenticates as the replying
node; the site takes it from `context.node_id`. Nothing the site writes names its own id.

Dropouts: a site that errs, is rejected or misses a deadline in stage s is treated as having
vanished after stage s - 1; the crypto library recovers up to n - t of them. When fewer than t
remain, `SecAggAbort` ends the round (the driver calls `abort`): `RoundOutcome.mean` is None (the
coordinator skips the round and leaves the global model unchanged), the reason is in
`extra["secagg"]["aborted"]`, in every sampled site's `failed` entry and in the progress log; the
next round starts afresh.

Memory: masked chunks are added to the SecAggServer's single uint32 accumulator (P + 1 words) as
each stage-3 reply is pulled (`receive_masked_input`), and the reply is dropped right away; the
driver pulls a streamed stage's replies one message id at a time, so at most one site's masked
vector is held besides the accumulator: O(P), not O(N·P).

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
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import RecordDict

import crypto.secagg as secagg
from crypto.envelope import ReplayGuard
from crypto.pki import CoordinatorBundle
from crypto.secagg import (
    ChunkManifest,
    MalformedMessageError,
    ProtocolViolationError,
    ReplayedMessageError,
    SecAggAbort,
    SecAggError,
    SecAggMessageError,
    SecAggServer,
    Signature,
    TamperedMessageError,
    new_context,
)
from crypto.secagg import wire as secagg_wire
from crypto.secagg.signing import verify
from federation.config.schema import FederationConfig
from federation.coordinator.strategy import Exchange, ExchangeResult, Reply, RoundInput, RoundOutcome, Step, site_metrics
from federation.protocol.codecs import Arrays, UpdateSpec, parse_codec
from federation.protocol.message_keys import ADVERTISE, MASKED_INPUT, SECAGG, SHARE_KEYS, STAGE_NAMES, UNMASK
from federation.protocol.pipeline import UpdateRejected, check_update
from federation.protocol.secagg_records import (
    check_reply,
    context_run_id,
    parse_chunks,
    reply_bytes,
    request_record,
    signature_of,
)
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


class RoundSignatures:
    """The coordinator's side of signed SecAgg messages for one round (see the module docstring)."""

    def __init__(self, bundle: CoordinatorBundle | None, replay: ReplayGuard, ctx: secagg.RoundContext,
                 names: dict[int, str]):
        self.trust = bundle.trust() if bundle is not None else None  # None: insecure, not checked
        self.federation_id = bundle.federation_id if bundle is not None else ""
        self.replay, self.ctx, self.names = replay, ctx, names
        self.adverts: dict[int, Signature] = {}

    def check(self, stage: int, node: int, rec, content: bytes) -> Signature | None:
        """The reply's signature, verified as node's stage message; SecAggMessageError if bad."""
        sig = signature_of(rec)
        if self.trust is not None:
            verify(sig, content, trust=self.trust, federation_id=self.federation_id, ctx=self.ctx, stage=stage,
                   site=self.names[node], replay=self.replay)
        return sig

    def relayed(self, node: int, neighbours: Iterable[int]) -> bytes:
        """The neighbours' advert signatures for node's stage-2 request."""
        sigs = {v: (self.adverts[v].header, self.adverts[v].signature) for v in sorted(neighbours) if v in self.adverts}
        return secagg_wire.encode_advert_signatures(self.ctx, node, sigs)


@dataclass
class SecAggState:
    """One SecAgg+ round in progress: the crypto server, who is still in, and the metrics so far."""

    inp: RoundInput
    names: dict[int, str]
    out: RoundOutcome = field(default_factory=lambda: RoundOutcome(None, 0))
    info: dict = field(default_factory=dict)  # the metrics line's "secagg" entry
    stage: int = ADVERTISE
    ctx: secagg.RoundContext | None = None
    server: SecAggServer | None = None
    sigs: RoundSignatures | None = None
    vector_len: int = 0  # m: values each site masks (the weight word comes on top)
    dense: Callable[[np.ndarray], Arrays] | None = None  # mean values -> dense update
    roster: list[int] = field(default_factory=list)  # advertised keys (after stage 1)
    live: list[int] = field(default_factory=list)  # shared keys (after stage 2)
    survivors: list[int] = field(default_factory=list)  # masked input in the sum (after stage 3)
    weights: dict[int, int] = field(default_factory=dict)


class SecAggRound:
    """`Strategy` for `federation.secagg.enabled`: see the module docstring."""

    aborts = (SecAggAbort,)

    def __init__(self, fed: FederationConfig, bundle: CoordinatorBundle | None, replay: ReplayGuard):
        self.fed, self.cfg, self.bundle, self.replay = fed, fed.secagg, bundle, replay
        self.config_json = fed.secagg.model_dump_json()

    def begin(self, inp: RoundInput) -> SecAggState:
        """A fresh state; the crypto server is made in the first stage."""
        st = SecAggState(inp, inp.names(inp.nodes))
        st.info.update(threshold=None, sampled=len(inp.nodes), stage_s={})
        st.out.extra["secagg"] = st.info
        return st

    def steps(self) -> tuple[Step[SecAggState], ...]:
        """The four stages of SecAgg+, in order."""
        return (Step(self.configure_advertise, self.aggregate_advertise),
                Step(self.configure_share_keys, self.aggregate_share_keys),
                Step(self.configure_masked_input, self.aggregate_masked_input, self.receive_masked_input),
                Step(self.configure_unmask, self.aggregate_unmask))

    def layout(self, inp: RoundInput) -> tuple[int, Callable[[np.ndarray], Arrays]]:
        """(value-vector length m, function mean values -> dense update) for this round's codec."""
        spec = UpdateSpec.of(inp.model)
        codec = parse_codec(self.fed.codec, error_feedback=self.fed.error_feedback)
        if codec.sparsifier is None:
            return spec.numel, spec.unflatten
        k = codec.sparsifier.k(spec.numel)
        ctx = inp.ctx.codec_round()
        meta = {"k": k, "seed": ctx.seed, "server_round": ctx.server_round}

        def dense(values: np.ndarray) -> Arrays:
            flat = np.zeros(spec.numel, dtype=np.float32)
            flat[codec.sparsifier.support({}, meta, spec.numel, ctx)] = values
            return spec.unflatten(flat)

        return k, dense

    # ---- helpers -------------------------------------------------------------------------------
    def _query(self, st: SecAggState, targets: list[int], requests: dict[int, bytes],
               extra: dict[int, dict] | None = None) -> Exchange:
        """A query stage: each target gets its request (and extra fields) in a SECAGG record."""
        def content(node: int) -> RecordDict:
            return RecordDict({SECAGG: request_record(st.stage, st.ctx, self.config_json, requests.get(node, b""),
                                                      **(extra or {}).get(node, {}))})
        return Exchange(f"secagg stage {st.stage}", "query", targets, content, float(self.fed.deadlines.secagg_stage_s))

    def _reject(self, st: SecAggState, name: str, err: Exception) -> None:
        reason = rejection_reason(err)
        st.out.reject(name, reason, f"stage {st.stage} ({STAGE_NAMES[st.stage]}): {err}")
        st.inp.log(f"secagg: rejected {name}'s stage-{st.stage} message ({reason}): {err}; it is treated as dropped")

    def _failed(self, st: SecAggState, result: ExchangeResult, label: str) -> None:
        st.out.failed.update({k: f"stage {st.stage} ({label}): {v}" for k, v in result.failed.items()})
        st.info["stage_s"][str(st.stage)] = round(result.seconds, 3)

    def _take(self, st: SecAggState, result: ExchangeResult, targets: list[int],
              take: Callable[[int, bytes, Signature | None], None]) -> None:
        """Hand each verified reply of a query stage to `take`; what it refuses is a rejection."""
        for node, (data, sig) in self._verified(st, result, targets).items():
            try:
                take(node, data, sig)
            except SecAggMessageError as err:
                self._reject(st, st.names[node], err)

    def _verified(self, st: SecAggState, result: ExchangeResult, targets: list[int]) -> dict[int, tuple[bytes, Signature | None]]:
        """The replies of a query stage that answer it and carry a good signature: node -> (data, sig)."""
        self._failed(st, result, STAGE_NAMES[st.stage])
        replies = {}
        for reply in result.replies:
            node = reply.message.metadata.src_node_id  # authenticated by the SuperLink
            try:
                if node not in targets:
                    raise ProtocolViolationError(f"reply from node {node}, which was not asked")
                rec = check_reply(reply.message, st.stage, st.ctx)
                data = reply_bytes(rec)
                replies[node] = (data, st.sigs.check(st.stage, node, rec, data))
            except SecAggMessageError as err:
                self._reject(st, reply.name, err)
        return replies

    # ---- stage 1: advertise keys ---------------------------------------------------------------
    def configure_advertise(self, st: SecAggState) -> Exchange:
        """Set up the round (context, crypto server, signatures) and ask every sampled site for keys."""
        inp = st.inp
        st.stage = ADVERTISE
        st.ctx = new_context(context_run_id(inp.ctx.federation, inp.ctx.run_id), inp.round)
        st.vector_len, st.dense = self.layout(inp)
        st.server = SecAggServer(self.cfg, st.ctx, vector_len=st.vector_len, sampled=inp.nodes)
        st.sigs = RoundSignatures(self.bundle, self.replay, st.ctx, st.names)
        return self._query(st, list(inp.nodes), {})

    def aggregate_advertise(self, st: SecAggState, result: ExchangeResult) -> None:
        """Take each good advert; the roster is who advertised (SecAggAbort below the threshold)."""
        def advert(node: int, data: bytes, sig: Signature | None) -> None:
            st.server.receive_advert(node, data)
            if sig is not None:  # relayed to its neighbours in stage 2
                st.sigs.adverts[node] = sig

        self._take(st, result, list(st.inp.nodes), advert)
        st.roster = st.server.close_advertise()
        params = st.server.params
        st.info.update(roster=len(st.roster), threshold=params.threshold, degree=params.degree,
                       levels=params.codec.levels, bits=params.codec.bits, clip=params.codec.clip,
                       vector_len=st.vector_len)

    # ---- stage 2: share keys -------------------------------------------------------------------
    def configure_share_keys(self, st: SecAggState) -> Exchange:
        """Relay each site its neighbours' adverts, with their signatures."""
        st.stage = SHARE_KEYS
        requests = {n: st.server.share_keys_request(n) for n in st.roster}
        relayed = {n: {"relayed": st.sigs.relayed(n, st.server.graph[n])} for n in st.roster}
        return self._query(st, st.roster, requests, relayed)

    def aggregate_share_keys(self, st: SecAggState, result: ExchangeResult) -> None:
        """Take each site's encrypted shares; live sites are those with enough live neighbours."""
        self._take(st, result, st.roster, lambda node, data, _: st.server.receive_share_keys(node, data))
        st.live = st.server.close_share_keys()
        for n in set(st.roster) - set(st.live):
            st.out.failed.setdefault(st.names[n], "secagg: too few live neighbours after stage 2 (share keys)")

    # ---- stage 3: masked input, in the train message ---------------------------------------------
    def configure_masked_input(self, st: SecAggState) -> Exchange:
        """The train message: the model, plus each site's shares and its integer weight."""
        st.stage = MASKED_INPUT
        sites = st.inp.sites
        st.weights = round_weights({n: sites[n].num_examples if n in sites else 1 for n in st.live}, self.cfg.max_weight)
        deadline = float(self.fed.deadlines.round_s)
        model = st.inp.model_message(deadline)
        requests = {n: st.server.masked_input_request(n) for n in st.live}

        def content(node: int) -> RecordDict:
            rd = model(node)
            rd[SECAGG] = request_record(MASKED_INPUT, st.ctx, self.config_json, requests[node],
                                        weight=st.weights[node], vector_len=st.vector_len)
            return rd

        return Exchange("secagg stage 3 (train)", "train", st.live, content, deadline)

    def receive_masked_input(self, st: SecAggState, reply: Reply) -> None:
        """Check one site's masked chunks whole, then add them to the sum and drop the reply."""
        node = reply.node
        try:
            rec = check_reply(reply.message, MASKED_INPUT, st.ctx)
            chunks = parse_chunks(reply.message, st.vector_len + 1, st.server.params.codec.bits)
            manifest = ChunkManifest()
            for off, words in chunks:
                manifest.add(off, words)
            st.sigs.check(MASKED_INPUT, node, rec, manifest.encode())
            for off, words in chunks:
                st.server.add_masked_chunk(node, off, words)
        except SecAggMessageError as err:  # add_masked_chunk cannot fail after parse_chunks; if it did, stage 3 aborts
            self._reject(st, reply.name, err)
            return
        metrics = site_metrics(reply)
        metrics["upload_bytes"] = float(sum(w.nbytes for _, w in chunks))
        metrics["weight"] = st.weights[node]
        st.out.per_site[reply.name] = metrics

    def aggregate_masked_input(self, st: SecAggState, result: ExchangeResult) -> None:
        """The survivors: sites whose masked input is in the sum."""
        self._failed(st, result, "masked input, train")
        st.survivors = st.server.close_masked_input()

    # ---- stage 4: unmask -----------------------------------------------------------------------
    def configure_unmask(self, st: SecAggState) -> Exchange:
        """Ask the survivors for the shares that remove the masks."""
        st.stage = UNMASK
        return self._query(st, st.survivors, {n: st.server.unmask_request(n) for n in st.survivors})

    def aggregate_unmask(self, st: SecAggState, result: ExchangeResult) -> None:
        """Take each survivor's shares."""
        self._take(st, result, st.survivors, lambda node, data, _: st.server.receive_unmask(node, data))

    # ---- the outcome ---------------------------------------------------------------------------
    def finish(self, st: SecAggState) -> RoundOutcome:
        """Unmask the sum and decode it to the weighted mean update (SecAggAbort if it cannot)."""
        info, out = st.info, st.out
        t0 = time.monotonic()
        result = st.server.finish()
        info["unmask_s"] = round(time.monotonic() - t0, 3)
        t0 = time.monotonic()
        contributors = [st.names[n] for n in result.contributors]
        info.update(contributors=sorted(contributors), dropped=sorted(st.names[n] for n in result.dropped),
                    weight_total=result.weight_total, error_bound=result.error_bound(),
                    ring_sum_sha256=hashlib.sha256(np.ascontiguousarray(result.ring_sum).tobytes()).hexdigest())
        # per_site holds train metrics of the sites whose masked input is in the sum, and only those
        out.per_site = {k: v for k, v in out.per_site.items() if k in contributors}
        late = {name: out.failed.pop(name) for name in out.per_site if name in out.failed}
        if late:  # vanished in stage 4: its masked input is in the sum, its seed was rebuilt from shares
            info["unmask_missing"] = late
        try:
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
            detail = detail.replace(f"client {node}", f"site {name}").replace(str(node), name)
        reason = f"secure aggregation aborted in stage {st.stage} ({STAGE_NAMES.get(st.stage, '?')}): {detail}"
        st.info.update(stage=st.stage, aborted=reason)
        for name in st.names.values():
            st.out.failed.setdefault(name, f"round aborted: {reason}")
        st.out.per_site, st.out.mean, st.out.count = {}, None, 0
        st.inp.log(f"round {st.inp.round}: {reason}; the global model is unchanged, the next round starts afresh")
        return st.out
