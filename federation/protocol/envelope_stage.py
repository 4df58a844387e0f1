"""The protection stage: every update leaves its site signed, and sealed to the coordinator when
asked. On the coordinator a bad signature, an unknown or revoked site, a replayed round, a wrong
federation or run, or a tampered ciphertext becomes a counted rejection with its own reason.

The envelope covers the whole payload: the arrays are laid out in one buffer whose layout and
metadata travel inside the signed header (`meta`), so nothing about an update is unauthenticated.
"""

from __future__ import annotations

import json

import numpy as np

from crypto.envelope import Envelope, EnvelopeError, ReplayGuard, make_envelope, open_envelope
from crypto.pki import CoordinatorBundle, SiteBundle
from federation.protocol.pipeline import Payload, RoundContext, UpdateRejected

_ALLOWED_KINDS = set("fiub")  # numeric and bool dtypes only; never objects


def pack(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, list]:
    """All arrays back to back in one uint8 buffer, and the layout to find them again."""
    layout, offset = [], 0
    for name, a in arrays.items():
        layout.append([name, a.dtype.str, list(a.shape), offset])
        offset += a.nbytes
    buf = np.empty(offset, dtype=np.uint8)
    for (name, _, _, off), a in zip(layout, arrays.values()):
        buf[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return buf, layout


def unpack(buf: np.ndarray, layout: list) -> dict[str, np.ndarray]:
    out = {}
    try:
        for name, dtype, shape, off in layout:
            dt = np.dtype(dtype)
            if dt.kind not in _ALLOWED_KINDS:
                raise ValueError(f"dtype {dtype} not allowed")
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if off < 0 or off + n > len(buf):
                raise ValueError(f"{name} runs past the payload")
            out[str(name)] = buf[off:off + n].view(dt).reshape(shape)
    except (TypeError, ValueError) as err:
        raise UpdateRejected("malformed", f"signed payload layout is unusable: {err}") from None
    return out


class SiteProtection:
    """Site side: sign (and seal) the outgoing payload with the site's provisioned keys."""

    name = "protection"

    def __init__(self, bundle: SiteBundle, seal: bool):
        self.bundle, self.seal = bundle, seal

    def encode(self, payload: Payload, ctx: RoundContext) -> Payload:
        buf, layout = pack(payload.arrays)
        inner = json.dumps({"layout": layout, "meta": payload.meta}, separators=(",", ":")).encode()
        env = make_envelope(buf, signing_key=self.bundle.sign_key, federation_id=self.bundle.federation_id,
                            run_id=ctx.run_id, round=ctx.round, site=self.bundle.name, meta=inner,
                            seal_to=self.bundle.coordinator_seal_public if self.seal else None)
        body = np.frombuffer(env.body, dtype=np.uint8) if isinstance(env.body, bytes) else np.asarray(env.body)
        return Payload({"envelope": body}, {"envelope_header": env.header, "envelope_signature": env.signature})

    def decode(self, payload: Payload, ctx: RoundContext) -> Payload:
        raise NotImplementedError("sites do not open envelopes")


class CoordinatorProtection:
    """Coordinator side: verify (and unseal) each site's envelope; one replay guard per run."""

    name = "protection"

    def __init__(self, bundle: CoordinatorBundle, require_sealed: bool, replay: ReplayGuard):
        self.bundle, self.require_sealed, self.replay = bundle, require_sealed, replay
        self.trust = bundle.trust()

    def encode(self, payload: Payload, ctx: RoundContext) -> Payload:
        raise NotImplementedError("the coordinator does not send updates")

    def decode(self, payload: Payload, ctx: RoundContext) -> Payload:
        try:
            env = Envelope(bytes(payload.meta["envelope_header"]), bytes(payload.meta["envelope_signature"]),
                           payload.arrays["envelope"])
        except KeyError as err:
            raise UpdateRejected("unsigned", f"update carries no signed envelope (missing {err})") from None
        try:
            opened = open_envelope(env, trust=self.trust, federation_id=self.bundle.federation_id,
                                   run_id=ctx.run_id, round=ctx.round, replay=self.replay,
                                   recipient_key=self.bundle.seal_key, require_sealed=self.require_sealed)
        except EnvelopeError as err:
            raise UpdateRejected(err.reason, str(err)) from None
        if opened.header.site != ctx.site:
            raise UpdateRejected("wrong_site", f"envelope signed by {opened.header.site!r}, sent by {ctx.site!r}")
        try:
            inner = json.loads(opened.header.meta)
        except (ValueError, UnicodeDecodeError) as err:
            raise UpdateRejected("malformed", f"signed metadata is not JSON: {err}") from None
        return Payload(unpack(opened.payload, inner["layout"]), dict(inner.get("meta", {})))
