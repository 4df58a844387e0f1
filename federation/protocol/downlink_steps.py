"""Downlink compression: the coordinator sends a site the encoded step from the model that site
holds to the new global model, instead of the dense model (`federation.downlink_codec`).

Why a reference and not simply the delta: with a lossy codec a site cannot rebuild the global
model, only `held + decode(step)`. The coordinator computes that same sum with the same function
(`apply_step`), so it knows bit for bit what an up-to-date site holds: the *reference*. The next
step encodes `model - reference`, so what a lossy step left out is sent later (error feedback with
no extra state) and the sites' models cannot drift from the global one. Sites train on the
reference; the coordinator keeps the exact global model and applies the sites' updates to it.

A train or evaluate message carries the "global" ArrayRecord and, when the downlink codec is not
identity, a "downlink" ConfigRecord with `mode` and `target` (the digest of the reference):
  full   the reference, dense float32: for a site that holds nothing usable (new, its reference
         lost, too far behind, or its last reply failed)
  steps  encoded steps j..n (`{j}/<array>` arrays, `{j}.<key>` metadata, `{j}.base` the digest of
         the model step j applies to): the site starts at the step whose base it holds
  hold   nothing: the site already holds the reference (the model did not change since)
The site checks its reconstruction against `target` and reports the digest it holds in the status
of every reply (`model_digest`); that report is how the coordinator picks the mode next time.
The coordinator keeps one reference for all sites plus the newest steps whose encoded size is
below one dense model (memory O(P)); a site further behind gets the full model.

With identity (the default) every message carries the dense global model, as before, and sites
keep nothing. Evaluate messages get the same treatment as train messages: sites evaluate the model
they hold (the reference), which is also the model they train on next.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
from flwr.app import ArrayRecord

from federation.protocol.codecs import CodecError, Encoded, UpdateSpec, parse_codec
from federation.protocol.codecs import RoundContext as CodecRound
from federation.protocol.pipeline import Payload
from federation.protocol.payload_records import to_records

Arrays = dict[str, np.ndarray]
RECORD = "downlink"  # the ConfigRecord next to the "global" ArrayRecord
DIGEST_KEY = "model_digest"  # what a site reports, in every reply's status
MAX_STEPS = 64  # a site never applies more steps than this in one message


class DownlinkError(ValueError):
    """A downlink message cannot be applied on this site; the text says what and what happens next."""


def model_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes (sorted names): equal iff bit-for-bit equal."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(memoryview(a).cast("B") if a.size else b"")
    return h.hexdigest()[:32]


def apply_step(held: Mapping[str, np.ndarray], step: Mapping[str, np.ndarray],
               out: Mapping[str, np.ndarray] | None = None) -> Arrays:
    """`held + step` as float32, tensor by tensor in `held`'s order. Coordinator and sites both call
    this one function, so both get the same bits (float32 addition is exactly rounded)."""
    dest = dict(out) if out is not None else {k: np.empty(v.shape, np.float32) for k, v in held.items()}
    for name, arr in held.items():
        np.add(arr, step[name], out=dest[name], dtype=np.float32)
    return dest


def step_seed(federation_seed: int, version: int) -> int:
    """Seed of the coordinator's `version`-th step (random-k coordinates, stochastic rounding)."""
    return int(np.random.default_rng([federation_seed, version, 0xD0A1]).integers(0, 2**63 - 1))


@dataclass(frozen=True)
class Step:
    base: str  # digest of the reference the step applies to
    encoded: Encoded


class DownlinkSender:
    """The coordinator's side: the reference, the recent steps, what each site reported holding,
    and the bytes each site was sent (from the records that go on the wire)."""

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
            self.reference = {k: np.array(v, dtype=np.float32) for k, v in model.items()}
            self.digest, self.steps = model_digest(self.reference), []
        else:
            self.version += 1
            layout = UpdateSpec.of(self.reference)
            seed = step_seed(self.seed, self.version)
            ctx = CodecRound(self.version, seed, site_seed=seed)
            enc, _ = self.codec.encode({k: model[k] - v for k, v in self.reference.items()}, None, ctx)
            self.steps.append(Step(self.digest, enc))
            self.reference = apply_step(self.reference, self.codec.decode(enc, layout))
            self.digest = model_digest(self.reference)
            while self.steps and (sum(s.encoded.nbytes for s in self.steps) >= 4 * layout.numel
                                  or len(self.steps) > MAX_STEPS):
                self.steps.pop(0)  # a site that far behind is better served by the full model
        self._encode_s += time.perf_counter() - t0

    def payload(self, node: int) -> tuple[tuple, Payload]:
        """(cache key, payload) for `node`. What the node holds is forgotten until it reports again:
        if its reply fails, it may hold anything, and it gets the full model next time."""
        if self.codec is None:
            return ("dense",), Payload(self._source or {}, {})
        held = self.held.pop(node, None)
        if held == self.digest:
            return ("hold",), Payload({}, {"mode": "hold", "target": self.digest})
        start = next((i for i, s in enumerate(self.steps) if s.base == held), None)
        if start is None:
            return ("full",), Payload(self.reference, {"mode": "full", "target": self.digest})
        arrays: Arrays = {}
        meta: dict = {"mode": "steps", "target": self.digest, "steps": len(self.steps) - start}
        for j, step in enumerate(self.steps[start:]):
            arrays.update({f"{j}/{k}": v for k, v in step.encoded.arrays.items()})
            meta.update({f"{j}.{k}": v for k, v in step.encoded.meta.items()})
            meta[f"{j}.base"] = step.base
        return ("steps", start), Payload(arrays, meta)

    # ---- messages ------------------------------------------------------------------------------
    def stage(self, model: Arrays, name_of: Callable[[int], str]) -> Callable[[int], dict]:
        """The model records of one stage's messages, node by node. Each distinct content is
        serialized once per stage and shared by every message that carries it."""
        self.update(model)
        cache: dict[tuple, dict] = {}
        dense = sum(4 * int(v.size) for v in model.values())

        def records(node: int) -> dict:
            key, payload = self.payload(node)
            if key not in cache:
                rd = to_records(payload, "global", RECORD)
                cache[key] = {"global": rd.array_records["global"]}
                if self.codec is not None:
                    cache[key][RECORD] = rd.config_records[RECORD]
            name = name_of(node)
            self._bytes[name] += record_nbytes(cache[key]["global"])
            self._dense[name] += dense
            self._modes[key[0]] += 1
            return cache[key]

        return records

    def heard(self, node: int, status: Mapping) -> None:
        """A good reply: remember the model digest the site says it holds (if it says one)."""
        digest = status.get(DIGEST_KEY)
        if isinstance(digest, str) and digest:
            self.held[node] = digest

    def round_metrics(self) -> dict:
        """This round's downlink line (and reset): bytes per site from the records sent, the dense
        float32 bytes the same messages would have carried, their ratio, and the modes used."""
        sent, dense = sum(self._bytes.values()), sum(self._dense.values())
        out = {"codec": self.spec, "bytes": dict(self._bytes), "dense_bytes": dense,
               "ratio": dense / sent if sent else None, "modes": dict(self._modes),
               "encode_s": round(self._encode_s, 6)}
        self._bytes, self._dense, self._modes, self._encode_s = Counter(), Counter(), Counter(), 0.0
        return out


def record_nbytes(rec: ArrayRecord) -> int:
    return sum(len(a.data) for a in rec.values())


# ---- the site's side (pure: the relay adds the reference file) -----------------------------------
def _meta_str(meta: Mapping, key: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not value:
        raise DownlinkError(f"downlink message without a valid {key!r} field; the coordinator and this site "
                            "run different versions")
    return value


def reconstruct(payload: Payload, held: tuple[str, Arrays] | None) -> tuple[Arrays, str]:
    """The model this site holds after a downlink message, and its digest.

    `held` is (digest, arrays) of the model the site held before (None: nothing). Raises
    DownlinkError, naming what was wrong, when the message does not apply to what the site holds
    or does not decode; the coordinator then sends the full model next time."""
    meta, arrays = payload.meta, payload.arrays
    mode, target = meta.get("mode"), _meta_str(meta, "target")
    holds = f"model {held[0]}" if held else "no model"
    if mode == "hold":
        if held is None or held[0] != target:
            raise DownlinkError(f"downlink: the coordinator believes this site holds model {target}, but it "
                                f"holds {holds}; it sends the full model next time")
        return held[1], target
    if mode == "full":
        model = dict(arrays)
    elif mode == "steps":
        model = _apply_steps(arrays, meta, held)
    else:
        raise DownlinkError(f"downlink: unknown mode {mode!r} (expected 'full', 'steps' or 'hold')")
    digest = model_digest(model)
    if digest != target:
        raise DownlinkError(f"downlink: the reconstructed model has digest {digest}, the coordinator's is "
                            f"{target} (payload corrupted, or a different numpy); it sends the full model next time")
    return model, digest


def _apply_steps(arrays: Mapping[str, np.ndarray], meta: Mapping, held: tuple[str, Arrays] | None) -> Arrays:
    n = meta.get("steps")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_STEPS:
        raise DownlinkError(f"downlink: 'steps' must be an int in [1, {MAX_STEPS}], got {n!r}")
    bases = [_meta_str(meta, f"{j}.base") for j in range(n)]
    if held is None or held[0] not in bases:
        raise DownlinkError(f"downlink: the steps apply to model(s) {bases}, but this site holds "
                            f"{'model ' + held[0] if held else 'no model'}; it sends the full model next time")
    model = held[1]
    layout = UpdateSpec.of(model)
    known = {f"{j}/" for j in range(n)}
    stray = [k for k in arrays if k[: k.find("/") + 1] not in known]
    if stray:
        raise DownlinkError(f"downlink: unexpected arrays {stray[:5]} in a {n}-step message")
    for j in range(bases.index(held[0]), n):
        prefix = f"{j}."
        step_meta = {k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix) and k != f"{j}.base"}
        step_arrays = {k[len(f"{j}/"):]: v for k, v in arrays.items() if k.startswith(f"{j}/")}
        try:
            codec = parse_codec(_meta_str(step_meta, "codec"))
            step = codec.decode(Encoded(step_arrays, step_meta), layout)
        except CodecError as err:
            raise DownlinkError(f"downlink: step {j} does not decode against this site's model: {err}") from None
        model = apply_step(model, step)
    return model

