"""Secure aggregation (SecAgg+) as a round protocol on Flower's Message API: the coordinator's side.

The coordinator learns the weighted sum of the surviving sites' updates and nothing about any
single one. One round is four stages, each one `exchange` with its own deadline:

  stage  message  coordinator -> site                      site -> coordinator
  1      query    "secagg" ConfigRecord: round context,     public keys (advert bytes)
                  config (JSON)
  2      query    the neighbours' adverts                   Shamir shares of b_u and s_u, sealed
                                                            to each neighbour (envelopes)
  3      train    the global model + "config" (as in a      "secagg_chunks" ArrayRecord: one uint32
                  plain round) + "secagg": the envelopes    Array per masked chunk (4 bytes per
                  addressed to this site, its weight        parameter), "secagg" ConfigRecord
  4      query    survivors / dropped neighbours            seed shares of survivors, key shares
                                                            of dropped neighbours

Every request ConfigRecord "secagg" holds: stage, round, run (the SecAgg round context's run id,
"<federation>/<flower run id>"), graph_seed (32 bytes), config (the SecAggConfig as JSON) and, from
stage 2 on, request (the crypto library's request bytes). Replies echo stage, round and ctx (the
SHA-256 of the round context); a reply for another stage, round or run is rejected.

Signatures (crypto.secagg.signing): every reply carries sig_header and sig, the site's Ed25519
signature over its content (stage 3: the manifest of its chunks) bound to federation, run, round,
stage and site. With a coordinator bundle each is verified against the site's registered key and
the run's replay guard; a missing or bad signature rejects the message (counted under its own
reason, e.g. secagg_unsigned, secagg_bad_signature, secagg_digest_mismatch), and the site counts
as dropped in that stage. The stage-2 request adds relayed: the neighbours' advert signatures, so
that each site checks that no key was substituted. Without a bundle (insecure development runs)
signatures are relayed but not checked here.

Identities: a site's SecAgg client id is its Flower node id (unsigned 64-bit). The coordinator takes
it from the node a message was addressed to, which the SuperLink authenticates as the replying
node; the site takes it from `context.node_id`. Nothing the site writes names its own id.

Dropouts: a site that errs, is rejected or misses a deadline in stage s is treated as having
vanished after stage s - 1; the crypto library recovers up to n - t of them. When fewer than t
remain, `SecAggAbort` ends the round: `RoundOutcome.mean` is None (the coordinator skips the round
and leaves the global model unchanged), the reason is in `extra["secagg"]["aborted"]`, in every
sampled site's `failed` entry and in the progress log; the next round starts afresh.

Memory: masked chunks are added to the SecAggServer's single uint32 accumulator (P + 1 words) as
each stage-3 reply is pulled, and the reply is dropped right away; replies are pulled one message
id at a time, so at most one site's masked vector is held besides the accumulator: O(P), not O(N·P).

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
import logging
import time
from typing import TYPE_CHECKING, Iterable

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from crypto.secagg import (
    MalformedMessageError,
    ProtocolViolationError,
    ReplayedMessageError,
    SecAggAbort,
    SecAggConfig,
    SecAggError,
    SecAggMessageError,
    SecAggResult,
    SecAggServer,
    TamperedMessageError,
    new_context,
)
from crypto.secagg import RoundContext as SecAggContext
from crypto.secagg import wire
from crypto.secagg.signing import ChunkManifest, Signature, verify
from federation.protocol.codecs import UpdateSpec, parse_codec
from federation.protocol.codecs import RoundContext as CodecRound
from federation.protocol.pipeline import UpdateRejected, check_update
from federation.coordinator.plain_round import RoundOutcome, site_metrics
from federation.site.secagg_mod import ADVERTISE, CHUNKS, MASKED_INPUT, RECORD, SHARE_KEYS, UNMASK

if TYPE_CHECKING:
    from federation.coordinator.driver import Coordinator

log = logging.getLogger("sovfl.secagg")

STAGE_NAMES = {ADVERTISE: "advertise keys", SHARE_KEYS: "share keys", MASKED_INPUT: "masked input",
               UNMASK: "unmask"}
OFFSET_DIGITS = 12  # chunk Array keys: the chunk's word offset, zero-padded (at most twice that here)


def context_run_id(federation: str, flower_run_id: int) -> str:
    """The SecAgg round context's run id: binds keys and messages to this federation and Flower run."""
    return f"{federation}/{int(flower_run_id)}"


def request_record(stage: int, ctx: SecAggContext, config_json: str, request: bytes = b"", **extra) -> ConfigRecord:
    return ConfigRecord({"stage": stage, "round": ctx.round, "run": ctx.run_id, "graph_seed": ctx.graph_seed,
                         "config": config_json, "request": request, **extra})


def rejection_reason(err: Exception) -> str:
    """Short stable code for `Coordinator.count_rejection`."""
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


def check_reply(reply: Message, stage: int, ctx: SecAggContext) -> ConfigRecord:
    """The reply's "secagg" record, if it answers this stage of this round; else a SecAggMessageError."""
    rec = reply.content.config_records.get(RECORD)
    if rec is None:
        raise MalformedMessageError(f"stage-{stage} reply without a '{RECORD}' record")
    try:
        if not isinstance(rec["ctx"], bytes):
            raise TypeError("ctx must be bytes")
        got = (int(rec["stage"]), int(rec["round"]), rec["ctx"])
    except (KeyError, TypeError, ValueError) as err:
        raise MalformedMessageError(f"stage-{stage} reply record is malformed ({type(err).__name__}: {err})") from None
    if got != (stage, ctx.round, ctx.digest()):
        raise ReplayedMessageError(f"reply made for stage {got[0]} of round {got[1]} (or another run), "
                                   f"expected stage {stage} of round {ctx.round}")
    return rec


def reply_bytes(rec: ConfigRecord) -> bytes:
    data = rec.get("data")
    if not isinstance(data, bytes):
        raise MalformedMessageError("reply record has no 'data' bytes")
    return data


def signature_of(rec: ConfigRecord) -> Signature | None:
    """The reply's signature fields, None when it has none."""
    header, sig = rec.get("sig_header"), rec.get("sig")
    if header is None and sig is None:
        return None
    if not isinstance(header, bytes) or not isinstance(sig, bytes):
        raise MalformedMessageError("reply signature fields sig_header / sig are not bytes")
    return Signature(header, sig)


class RoundSignatures:
    """The coordinator's side of signed SecAgg messages for one round (see the module docstring)."""

    def __init__(self, coord: "Coordinator", ctx: SecAggContext, names: dict[int, str]):
        bundle = coord.bundle
        self.trust = bundle.trust() if bundle is not None else None  # None: insecure, not checked
        self.federation_id = bundle.federation_id if bundle is not None else ""
        self.replay, self.ctx, self.names = coord.replay, ctx, names
        self.adverts: dict[int, Signature] = {}

    def check(self, stage: int, node: int, rec: ConfigRecord, content: bytes) -> Signature | None:
        """The reply's signature, verified as node's stage message; SecAggMessageError if bad."""
        sig = signature_of(rec)
        if self.trust is not None:
            verify(sig, content, trust=self.trust, federation_id=self.federation_id, ctx=self.ctx, stage=stage,
                   site=self.names[node], replay=self.replay)
        return sig

    def relayed(self, node: int, neighbours: Iterable[int]) -> bytes:
        """The neighbours' advert signatures for node's stage-2 request."""
        sigs = {v: (self.adverts[v].header, self.adverts[v].signature) for v in sorted(neighbours) if v in self.adverts}
        return wire.encode_advert_signatures(self.ctx, node, sigs)


def parse_chunks(reply: Message, length: int, bits: int) -> list[tuple[int, np.ndarray]]:
    """All masked chunks of a stage-3 reply, validated before any is added to the sum.

    They must be 1-D uint32 arrays, keyed by their word offset, that tile [0, length) exactly with
    words inside Z_2^bits: a site's vector is added whole or not at all (a partial one could not
    be taken out of the sum again)."""
    rec = reply.content.array_records.get(CHUNKS)
    if rec is None:
        raise MalformedMessageError(f"stage-3 reply without a '{CHUNKS}' array record")
    chunks = []
    for key, arr in rec.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 2 * OFFSET_DIGITS):
            raise MalformedMessageError(f"masked chunk key {key!r} is not a word offset")
        if arr.dtype != "uint32" or len(arr.shape) != 1:
            raise MalformedMessageError(f"masked chunk {key} is {arr.dtype} {tuple(arr.shape)}, expected 1-D uint32")
        try:
            words = arr.numpy()
        except Exception as err:  # hostile bytes: whatever numpy raises while parsing them
            raise MalformedMessageError(f"masked chunk {key} does not parse ({type(err).__name__})") from None
        if words.dtype != np.uint32 or words.ndim != 1 or words.shape[0] == 0:
            raise MalformedMessageError(f"masked chunk {key} holds {words.dtype} {words.shape}")
        chunks.append((int(key), words))
    chunks.sort(key=lambda c: c[0])
    pos = 0
    for off, words in chunks:
        if off != pos:
            raise MalformedMessageError(f"masked chunks leave a gap or overlap at word {min(off, pos)}")
        pos += words.shape[0]
        if bits < 32 and int(words.max()) >> bits:
            raise MalformedMessageError(f"masked chunk at {off} holds words outside Z_2^{bits}")
    if pos != length:
        raise MalformedMessageError(f"masked chunks cover {pos} words, the round's vector has {length}")
    return chunks


class SecAggRound:
    """`RoundProtocol` for `federation.secagg.enabled`: see the module docstring."""

    def __init__(self, cfg: SecAggConfig):
        self.cfg = cfg
        self.config_json = cfg.model_dump_json()

    # ---- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _names(coord: "Coordinator", nodes: Iterable[int]) -> dict[int, str]:
        out = {}
        for n in nodes:
            site = coord.sites.get(n)
            out[n] = site.name if site else f"node-{n}"
        return out

    @staticmethod
    def stage_s(coord: "Coordinator") -> float:
        """Deadline of stages 1, 2 and 4 (stage 3 is the train stage: `deadlines.round_s`)."""
        return float(coord.fed.deadlines.secagg_stage_s)

    def _layout(self, coord: "Coordinator", rnd: int):
        """(value-vector length m, function mean values -> dense update) for this round's codec."""
        spec = UpdateSpec.of(coord.model)
        codec = parse_codec(coord.fed.codec, error_feedback=coord.fed.error_feedback)
        if codec.sparsifier is None:
            return spec.numel, spec.unflatten
        k = codec.sparsifier.k(spec.numel)
        ctx = CodecRound(rnd, coord.round_seed(rnd))
        meta = {"k": k, "seed": ctx.seed, "server_round": ctx.server_round}

        def dense(values: np.ndarray):
            flat = np.zeros(spec.numel, dtype=np.float32)
            flat[codec.sparsifier.support({}, meta, spec.numel, ctx)] = values
            return spec.unflatten(flat)

        return k, dense

    def _reject(self, coord: "Coordinator", out: RoundOutcome, name: str, stage: int, err: Exception) -> None:
        reason = rejection_reason(err)
        coord.count_rejection(reason)
        out.failed[name] = f"rejected {reason}: stage {stage} ({STAGE_NAMES[stage]}): {err}"
        coord.progress(f"secagg: rejected {name}'s stage-{stage} message ({reason}): {err}; "
                       "it is treated as dropped")

    # ---- the round -----------------------------------------------------------------------------
    def train(self, coord: "Coordinator", rnd: int, nodes: list[int]) -> RoundOutcome:
        out = RoundOutcome(None, 0)
        info: dict = {"threshold": None, "sampled": len(nodes), "stage_s": {}}
        out.extra["secagg"] = info
        stage = ADVERTISE
        try:
            self._run(coord, rnd, nodes, out, info)
        except SecAggAbort as err:
            stage = info.get("stage", stage)
            detail = str(err)
            for node, name in self._names(coord, nodes).items():  # name the sites the library calls by id
                detail = detail.replace(f"client {node}", f"site {name}").replace(str(node), name)
            reason = f"secure aggregation aborted in stage {stage} ({STAGE_NAMES.get(stage, '?')}): {detail}"
            info["aborted"] = reason
            for name in self._names(coord, nodes).values():
                out.failed.setdefault(name, f"round aborted: {reason}")
            out.per_site, out.mean, out.count = {}, None, 0
            coord.progress(f"round {rnd}: {reason}; the global model is unchanged, the next round starts afresh")
        return out

    def _run(self, coord: "Coordinator", rnd: int, nodes: list[int], out: RoundOutcome, info: dict) -> None:
        cfg = self.cfg
        names = self._names(coord, nodes)
        ctx = new_context(context_run_id(coord.fed.name, coord.run_id), rnd)
        m, dense = self._layout(coord, rnd)
        server = SecAggServer(cfg, ctx, vector_len=m, sampled=nodes)
        stage_s = self.stage_s(coord)
        sigs = RoundSignatures(coord, ctx, names)

        def stage_exchange(stage: int, targets: list[int], requests: dict[int, bytes],
                           extra: dict[int, dict] | None = None) -> dict[int, tuple[bytes, Signature | None]]:
            t0 = time.monotonic()
            info["stage"] = stage
            res = coord.exchange(targets, "query", lambda n: RecordDict({
                RECORD: request_record(stage, ctx, self.config_json, requests.get(n, b""), **(extra or {}).get(n, {}))}),
                stage_s)
            out.bytes_down += res.bytes_down
            out.failed.update({k: f"stage {stage} ({STAGE_NAMES[stage]}): {v}" for k, v in res.failed.items()})
            replies = {}
            for name, reply in res.ok.items():
                out.bytes_up += coord.record_bytes(reply.content)
                node = reply.metadata.src_node_id  # authenticated by the SuperLink
                try:
                    if node not in targets:
                        raise ProtocolViolationError(f"reply from node {node}, which was not asked")
                    rec = check_reply(reply, stage, ctx)
                    data = reply_bytes(rec)
                    replies[node] = (data, sigs.check(stage, node, rec, data))
                except SecAggMessageError as err:
                    self._reject(coord, out, name, stage, err)
            info["stage_s"][str(stage)] = round(time.monotonic() - t0, 3)
            return replies

        # stage 1: advertise keys
        for node, (data, sig) in stage_exchange(ADVERTISE, list(nodes), {}).items():
            try:
                server.receive_advert(node, data)
            except SecAggMessageError as err:
                self._reject(coord, out, names[node], ADVERTISE, err)
                continue
            if sig is not None:
                sigs.adverts[node] = sig
        roster = server.close_advertise()
        assert server.params is not None
        params = server.params
        info.update(roster=len(roster), threshold=params.threshold, degree=params.degree,
                    levels=params.codec.levels, bits=params.codec.bits, clip=params.codec.clip,
                    vector_len=m)

        # stage 2: share keys
        requests = {n: server.share_keys_request(n) for n in roster}
        relayed = {n: {"relayed": sigs.relayed(n, server.graph[n])} for n in roster}
        for node, (data, _) in stage_exchange(SHARE_KEYS, roster, requests, relayed).items():
            try:
                server.receive_share_keys(node, data)
            except SecAggMessageError as err:
                self._reject(coord, out, names[node], SHARE_KEYS, err)
        live = server.close_share_keys()
        for n in set(roster) - set(live):
            out.failed.setdefault(names[n], "secagg: too few live neighbours after stage 2 (share keys)")

        # stage 3: the train message; masked chunks are summed as each reply arrives
        t0 = time.monotonic()
        info["stage"] = MASKED_INPUT
        weights = round_weights({n: coord.sites[n].num_examples if n in coord.sites else 1 for n in live},
                                cfg.max_weight)
        model_content = coord.model_message(rnd, coord.fed.deadlines.round_s)
        requests = {n: server.masked_input_request(n) for n in live}

        def stage3_content(node: int) -> RecordDict:
            rd = model_content(node)
            rd[RECORD] = request_record(MASKED_INPUT, ctx, self.config_json, requests[node],
                                        weight=weights[node], vector_len=m)
            return rd

        def on_masked(name: str, node: int, reply: Message) -> None:
            out.bytes_up += coord.record_bytes(reply.content)
            try:
                rec = check_reply(reply, MASKED_INPUT, ctx)
                chunks = parse_chunks(reply, m + 1, params.codec.bits)
                manifest = ChunkManifest()
                for off, words in chunks:
                    manifest.add(off, words)
                sigs.check(MASKED_INPUT, node, rec, manifest.encode())
            except SecAggMessageError as err:
                self._reject(coord, out, name, MASKED_INPUT, err)
                return
            try:
                for off, words in chunks:
                    server.add_masked_chunk(node, off, words)
            except SecAggMessageError as err:  # cannot happen after parse_chunks; if it did, stage 3 aborts
                self._reject(coord, out, name, MASKED_INPUT, err)
                return
            metrics = site_metrics(reply)
            metrics["upload_bytes"] = float(sum(w.nbytes for _, w in chunks))
            metrics["weight"] = weights[node]
            out.per_site[name] = metrics

        res = coord.exchange(live, "train", stage3_content, coord.fed.deadlines.round_s, on_masked)
        out.bytes_down += res.bytes_down
        out.failed.update({k: f"stage 3 (masked input, train): {v}" for k, v in res.failed.items()})
        survivors = server.close_masked_input()
        info["stage_s"][str(MASKED_INPUT)] = round(time.monotonic() - t0, 3)

        # stage 4: unmask
        requests = {n: server.unmask_request(n) for n in survivors}
        for node, (data, _) in stage_exchange(UNMASK, survivors, requests).items():
            try:
                server.receive_unmask(node, data)
            except SecAggMessageError as err:
                self._reject(coord, out, names[node], UNMASK, err)
        info["stage"] = UNMASK
        t0 = time.monotonic()
        result = server.finish()
        info["unmask_s"] = round(time.monotonic() - t0, 3)
        self._finish(coord, result, dense, names, out, info)

    def _finish(self, coord: "Coordinator", result: SecAggResult, dense, names: dict[int, str],
                out: RoundOutcome, info: dict) -> None:
        t0 = time.monotonic()
        contributors = [names[n] for n in result.contributors]
        info.update(contributors=sorted(contributors), dropped=sorted(names[n] for n in result.dropped),
                    weight_total=result.weight_total, error_bound=result.error_bound(),
                    ring_sum_sha256=hashlib.sha256(np.ascontiguousarray(result.ring_sum).tobytes()).hexdigest())
        # per_site holds train metrics of the sites whose masked input is in the sum, and only those
        out.per_site = {k: v for k, v in out.per_site.items() if k in contributors}
        late = {name: out.failed.pop(name) for name in out.per_site if name in out.failed}
        if late:  # vanished in stage 4: its masked input is in the sum, its seed was rebuilt from shares
            info["unmask_missing"] = late
        try:
            mean = dense(result.decode())
            mean = {k: v.astype(np.dtype(coord.spec[k][0]), copy=False) for k, v in mean.items()}
            check_update(mean, coord.spec)
        except (UpdateRejected, SecAggError, ValueError, KeyError) as err:
            raise SecAggAbort(f"the unmasked sum does not decode to an update of the model: {err}") from None
        out.mean, out.count = mean, len(contributors)
        info["decode_s"] = round(time.monotonic() - t0, 3)
        info.pop("stage", None)
