"""Downlink compression, the format both sides share: the coordinator sends a site the encoded step
from the model that site holds to the new global model, instead of the dense model
(`federation.downlink_codec`). The coordinator's side is coordinator/downlink_sender.py, the site's
is site/downlink_mod.py; this module holds what both must compute alike.

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

With identity (the default) every message carries the dense global model and sites
keep nothing. Evaluate messages get the same treatment as train messages: sites evaluate the model
they hold (the reference), which is also the model they train on next.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from federation.protocol.codecs import Arrays, CodecError, Encoded, UpdateSpec, parse_codec
from federation.protocol.pipeline import Payload

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


def as_reference(model: Mapping[str, np.ndarray], copy: bool = True) -> Arrays:
    """`model` as the downlink keeps it, on the coordinator and on a site alike: every tensor
    float32 (a model's master copy; bf16 already exact float32), so both compute the same digest.
    `copy=False`: float32 arrays are taken as they are (a site's mapped export)."""
    return {k: np.array(v, dtype=np.float32, copy=copy or None) for k, v in model.items()}


def apply_step(held: Mapping[str, np.ndarray], step: Mapping[str, np.ndarray],
               out: Mapping[str, np.ndarray] | None = None) -> Arrays:
    """`held + step` as float32, tensor by tensor in `held`'s order. Coordinator and sites both call
    this one function, so both get the same bits (float32 addition is exactly rounded)."""
    dest = dict(out) if out is not None else {k: np.empty(v.shape, np.float32) for k, v in held.items()}
    for name, arr in held.items():
        np.add(arr, step[name], out=dest[name], dtype=np.float32)
    return dest


@dataclass(frozen=True)
class Step:
    """One encoded step of the coordinator's reference model."""

    base: str  # digest of the reference the step applies to
    encoded: Encoded


# ---- messages: what the coordinator writes (`*_payload`) and the site reads (`reconstruct`) -------
def dense_payload(model: Arrays) -> Payload:
    """The global model with the downlink off: no DOWNLINK record, sites keep nothing."""
    return Payload(model, {})


def hold_payload(target: str) -> Payload:
    """Nothing to send: the site already holds the reference `target`."""
    return Payload({}, {"mode": "hold", "target": target})


def full_payload(reference: Arrays, target: str) -> Payload:
    """The whole reference, dense float32, for a site that holds nothing usable."""
    return Payload(reference, {"mode": "full", "target": target})


def steps_payload(steps: list[Step], target: str) -> Payload:
    """Steps j = 0..n-1 as `{j}/<array>` arrays and `{j}.<key>` metadata, `{j}.base` each step's base."""
    arrays: Arrays = {}
    meta: dict = {"mode": "steps", "target": target, "steps": len(steps)}
    for j, step in enumerate(steps):
        arrays.update({f"{j}/{k}": v for k, v in step.encoded.arrays.items()})
        meta.update({f"{j}.{k}": v for k, v in step.encoded.meta.items()})
        meta[f"{j}.base"] = step.base
    return Payload(arrays, meta)


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

