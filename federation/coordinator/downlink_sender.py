"""The coordinator's side of the downlink: the reference model, its recent encoded steps, what each
site reported holding, and the bytes each site was sent (see protocol/downlink_steps.py for why a
reference and for the message format)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord

from federation.protocol import message_keys as keys
from federation.protocol.codecs import Arrays, CodecRound, UpdateSpec, parse_codec
from federation.protocol.downlink_steps import (
    MAX_STEPS,
    Step,
    apply_step,
    as_reference,
    dense_payload,
    full_payload,
    hold_payload,
    model_digest,
    steps_payload,
)
from federation.protocol.payload_records import array_bytes, to_records
from federation.protocol.pipeline import Payload


# node -> the writer of a payload's arrays onto the data path (None: the node gets them through Flower)
Offer = Callable[[int], Callable[[Arrays], tuple[ArrayRecord, int] | None] | None]


def step_seed(federation_seed: int, version: int) -> int:
    """Seed of the coordinator's `version`-th step (random-k coordinates, stochastic rounding)."""
    return int(np.random.default_rng([federation_seed, version, 0xD0A1]).integers(0, 2**63 - 1))


class DownlinkSender:
    """What goes into the GLOBAL (and DOWNLINK) records of each site's message, and what it cost."""

    def __init__(self, spec: str = "identity", seed: int = 0):
        codec = parse_codec(spec)
        self.codec = None if codec.spec == "identity" else codec
        self.spec = codec.spec
        self.seed = seed
        self.reference: Arrays | None = None
        self.digest: str | None = None
        self.steps: list[Step] = []
        self.version = 0
        self.held: dict[int, str] = {}  # node -> digest it reported in its last good reply
        self._source: Arrays | None = None  # the model object the reference follows
        self._bytes: Counter[str] = Counter()
        self._dense: Counter[str] = Counter()
        self._modes: Counter[str] = Counter()
        self._encode_s = 0.0
        self._cache: dict[tuple, dict] = {}  # the current stage's serialized records

    # ---- the reference -------------------------------------------------------------------------
    def update(self, model: Arrays) -> None:
        """Make the reference follow `model`: one encoded step per new model object."""
        if model is self._source:
            return
        self._source = model
        if self.codec is None:
            return
        t0 = time.perf_counter()
        if self.reference is None or UpdateSpec.of(model) != UpdateSpec.of(self.reference):
            self.reference = as_reference(model)
            self.digest, self.steps = model_digest(self.reference), []
        else:
            self.version += 1
            layout = UpdateSpec.of(self.reference)
            seed = step_seed(self.seed, self.version)
            enc, _ = self.codec.encode({k: model[k] - v for k, v in self.reference.items()}, None,
                                       CodecRound(self.version, seed, site_seed=seed))
            self.steps.append(Step(self.digest, enc))
            self.reference = apply_step(self.reference, self.codec.decode(enc, layout))
            self.digest = model_digest(self.reference)
            while self.steps and (sum(s.encoded.nbytes for s in self.steps) >= 4 * layout.numel
                                  or len(self.steps) > MAX_STEPS):
                self.steps.pop(0)  # a site that far behind is better served by the full model
        self._encode_s += time.perf_counter() - t0

    def holds(self, node: int, model: Arrays) -> bool:
        """Whether `node`'s next message of `model` carries no model: it said it holds the reference,
        and the reference already follows `model` (the round planner's bytes down)."""
        return self.codec is not None and model is self._source and self.held.get(node) == self.digest

    def payload(self, node: int) -> tuple[tuple, Payload]:
        """(cache key, payload) for `node`. What the node holds is forgotten until it reports again:
        if its reply fails, it may hold anything, and it gets the full model next time."""
        if self.codec is None:
            return ("dense",), dense_payload(self._source or {})
        held = self.held.pop(node, None)
        if held == self.digest:
            return ("hold",), hold_payload(self.digest)
        start = next((i for i, s in enumerate(self.steps) if s.base == held), None)
        if start is None:
            return ("full",), full_payload(self.reference, self.digest)
        return ("steps", start), steps_payload(self.steps[start:], self.digest)

    # ---- messages ------------------------------------------------------------------------------
    def stage(self, model: Arrays, name_of: Callable[[int], str], offer: Offer | None = None) -> Callable[[int], dict]:
        """The model records of one stage's messages, node by node. Each distinct content is
        serialized once per stage and shared by every message that carries it. `offer(node)`: for
        a node on the data path, what writes a payload's arrays to it tensor by tensor and gives
        the record of references (bulk_path.offer_arrays), so its content is never serialized
        whole; None (or no `offer`): the node gets the serialized arrays (through Flower)."""
        self.update(model)
        cache: dict[tuple, tuple[dict, int]] = {}
        self._cache = cache
        dense = sum(4 * int(v.size) for v in getattr(model, "master", model).values())  # (a WireView's master)

        def records(node: int) -> dict:
            key, payload = self.payload(node)
            write = offer(node) if offer is not None else None
            ckey = (*key, write is not None)
            if ckey not in cache:
                made = write(payload.arrays) if write is not None else None
                if made is None:
                    rd = to_records(payload, keys.GLOBAL, keys.DOWNLINK)
                    made = rd.array_records[keys.GLOBAL], array_bytes(rd.array_records[keys.GLOBAL])
                recs = {keys.GLOBAL: made[0]}
                if self.codec is not None:
                    recs[keys.DOWNLINK] = ConfigRecord(dict(payload.meta))
                cache[ckey] = recs, made[1]
            recs, wire = cache[ckey]
            name = name_of(node)
            self._bytes[name] += wire
            self._dense[name] += dense
            self._modes[key[0]] += 1
            return recs

        return records

    def forget_stage(self) -> None:
        """The stage's messages are pushed: drop their serialized records (a later message of the
        stage serializes again), so a model's serialized copy does not live through the stage."""
        self._cache.clear()

    def heard(self, node: int, status: Mapping) -> None:
        """A good reply: remember the model digest the site says it holds (if it says one)."""
        digest = status.get(keys.MODEL_DIGEST)
        if isinstance(digest, str) and digest:
            self.held[node] = digest

    def target(self, model: Arrays) -> dict:
        """With a codec, the digest of the model the next message sends (DOWNLINK_TARGET), the
        reference first following `model` (one step per new model): a site that already holds it
        says so at discovery and is not sent it (site/downlink_mod.py)."""
        if self.codec is None:
            return {}
        self.update(model)
        return {keys.DOWNLINK_TARGET: self.digest} if self.digest else {}

    def enrolled(self, node: int, site: str, status: Mapping, progress: Callable[[str], None]) -> None:
        """`node` took `site` at discovery: what it holds (`heard`), said when it is the global model."""
        self.heard(node, status)
        if self.codec is not None and status.get(keys.MODEL_DIGEST) == self.digest:
            progress(f"site {site} already holds the global model ({self.digest}): its next message "
                     "does not carry it")

    def round_metrics(self) -> dict:
        """This round's downlink line (and reset): bytes per site from the records sent, the dense
        float32 bytes the same messages would have carried, their ratio, and the modes used."""
        sent, dense = sum(self._bytes.values()), sum(self._dense.values())
        out = {"codec": self.spec, "bytes": dict(self._bytes), "dense_bytes": dense,
               "ratio": dense / sent if sent else None, "modes": dict(self._modes),
               "encode_s": round(self._encode_s, 6)}
        self._bytes, self._dense, self._modes, self._encode_s = Counter(), Counter(), Counter(), 0.0
        return out
