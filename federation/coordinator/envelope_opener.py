"""The coordinator's half of the envelope stage: verify (and unseal) each site's update.

A bad signature, an unknown or revoked site, a replayed round, a wrong federation or run, or a
tampered ciphertext becomes an `UpdateRejected` with its own reason, which the round counts.
"""

from __future__ import annotations

from crypto.envelope import EnvelopeError, ReplayGuard, open_envelope
from crypto.pki import CoordinatorBundle
from federation.protocol.envelope_layout import envelope_of, from_inner
from federation.protocol.pipeline import Payload, RoundContext, UpdateRejected


class CoordinatorProtection:
    """`Stage` that opens envelopes with the coordinator's bundle; one replay guard per run, so a
    (run, round, site) envelope opens once."""

    name = "protection"

    def __init__(self, bundle: CoordinatorBundle, require_sealed: bool, replay: ReplayGuard):
        self.bundle, self.require_sealed, self.replay = bundle, require_sealed, replay
        self.trust = bundle.trust()

    def encode(self, payload: Payload, ctx: RoundContext) -> Payload:
        """Not the coordinator's job: sites seal (site/protection_mod.py)."""
        raise NotImplementedError("the coordinator does not send updates")

    def decode(self, payload: Payload, ctx: RoundContext) -> Payload:
        """The payload the site sealed, once its envelope verified as `ctx.site`'s for this round."""
        env = envelope_of(payload)
        try:
            opened = open_envelope(env, trust=self.trust, federation_id=self.bundle.federation_id,
                                   run_id=ctx.run_id, round=ctx.round, replay=self.replay,
                                   recipient_key=self.bundle.seal_key, require_sealed=self.require_sealed)
        except EnvelopeError as err:
            raise UpdateRejected(err.reason, str(err)) from None
        if opened.header.site != ctx.site:
            raise UpdateRejected("wrong_site", f"envelope signed by {opened.header.site!r}, sent by {ctx.site!r}")
        return from_inner(opened.payload, opened.header.meta)
