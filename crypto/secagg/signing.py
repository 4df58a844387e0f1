"""Signed SecAgg+ messages: what each site sends the server carries its Ed25519 signature.

Every site -> server message of a round (its advert, its setup with the encrypted shares, its
masked input, its unmask shares) is signed with the site's provisioned key through the update
envelope (`crypto.envelope.make_envelope`): its signed header binds federation, run (the round
context's run id), round, stage (the envelope channel), site name, a nonce and the digest of the
message bytes, and its `meta` is the round context digest, which binds the graph seed as well. Only
the header and the signature travel; the receiver rebuilds the content from the message itself.

The server verifies against the site's registered key (`verify`, with its replay guard, so each
stage is accepted once per site and round). It relays each advert's signature to the neighbours,
who check that every relayed mask key was signed by the plan's member of that id
(`check_relayed_adverts`): a server cannot substitute public keys, the active-adversary defence of
Bonawitz et al. (CCS 2017, Sec. 6).

A masked input is large and chunked: its signed content is a manifest, (offset, length, SHA-256 of
the packed bytes) per chunk in offset order (`ChunkManifest`), which the server recomputes from
the chunks it received, so a changed, missing or extra chunk breaks the signature.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ed25519

from ..envelope import Envelope, EnvelopeError, EnvelopeHeader, KeyLookup, ReplayGuard, make_envelope, open_envelope
from . import wire
from .context import RoundContext
from .errors import SecAggMessageError

CHANNELS = {1: "secagg-advertise", 2: "secagg-setup", 3: "secagg-masked-input", 4: "secagg-unmask"}
MANIFEST_TAG = b"sovfl-secagg-chunks/v2"


class SignatureRejected(SecAggMessageError):
    """A message whose signature is missing or does not verify; `reason` is a stable metric code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Signature:
    """What travels next to a signed message: the envelope header and the Ed25519 signature."""

    header: bytes
    signature: bytes


def sign(key: ed25519.Ed25519PrivateKey, federation_id: str, site: str, ctx: RoundContext, stage: int,
         content: bytes) -> Signature:
    """`site`'s signature over `content`, its stage-`stage` message of the round `ctx`."""
    env = make_envelope(content, signing_key=key, federation_id=federation_id, run_id=ctx.run_id,
                        round=ctx.round, site=site, channel=CHANNELS[stage], meta=ctx.digest())
    return Signature(env.header, env.signature)


def verify(sig: Signature | None, content: bytes, *, trust: KeyLookup, federation_id: str, ctx: RoundContext,
           stage: int, site: str | None = None, replay: ReplayGuard | None = None) -> str:
    """The signer's name if `sig` is a registered site's signature over `content` for this stage
    of this round (by `site`, when given); else SignatureRejected with the reason."""
    if sig is None:
        raise SignatureRejected("secagg_unsigned", f"the stage-{stage} message carries no signature")
    try:
        claimed = EnvelopeHeader.decode(sig.header)
    except (EnvelopeError, TypeError, ValueError) as err:  # hostile bytes
        raise SignatureRejected("secagg_malformed_signature", f"stage-{stage} signature header: {err}") from None
    if claimed.meta != ctx.digest():  # checked before the replay guard takes the slot
        raise SignatureRejected("secagg_wrong_context", f"stage-{stage} message signed for another round context "
                                "(another graph seed, round or run)")
    if site is not None and claimed.site != site:
        raise SignatureRejected("secagg_wrong_site", f"stage-{stage} message signed as {claimed.site!r}, "
                                f"sent by {site!r}")
    party = trust.lookup(claimed.site)
    if party is not None and getattr(party, "role", "site") != "site":  # e.g. the coordinator's own key
        raise SignatureRejected("secagg_not_a_site", f"stage-{stage} message signed by {claimed.site!r}, "
                                "which is not a site: only sites send SecAgg messages")
    try:
        open_envelope(Envelope(sig.header, sig.signature, content), trust=trust, federation_id=federation_id,
                      run_id=ctx.run_id, round=ctx.round, channels=[CHANNELS[stage]], replay=replay)
    except EnvelopeError as err:
        raise SignatureRejected(f"secagg_{err.reason}", f"stage-{stage} message by {claimed.site!r}: {err}") from None
    return claimed.site


def check_relayed_adverts(relayed: list[wire.Relayed], signatures: bytes, *, trust: KeyLookup, federation_id: str,
                          ctx: RoundContext, me: int, names: dict[int, str]) -> None:
    """Client side of stage 3: every neighbour's mask key the server relays must come with its
    owner's signature in `signatures` (ADVERT_SIGNATURES bytes), by the registered site the plan
    names for that id (`names`); raises SignatureRejected (or a wire error) otherwise."""
    sigs = wire.decode_advert_signatures(ctx, signatures, me) if signatures else {}
    for x in relayed:
        raw = sigs.get(x.client)
        want = names.get(x.client)
        try:
            name = verify(Signature(*raw) if raw else None, wire.encode_advert(ctx, wire.Advert(x.client, x.s_pk)),
                          trust=trust, federation_id=federation_id, ctx=ctx, stage=1)
        except SignatureRejected as err:
            hint = (" (a site this bundle's registry does not know: re-run `sovfl provision` and give every site its "
                    "refreshed bundle)" if err.reason == "secagg_unknown_site" else "")
            raise SignatureRejected(err.reason, f"the keys relayed for neighbour {x.client}: {err.detail}{hint}") from None
        if name != want:
            raise SignatureRejected("secagg_wrong_site", f"the keys relayed for neighbour {x.client} are signed by "
                                    f"{name!r}; the round's plan names {want!r}")


class ChunkManifest:
    """The signed content of a masked input: (offset, words, SHA-256 of the packed bytes) per chunk,
    in offset order."""

    def __init__(self) -> None:
        self._parts = [MANIFEST_TAG]

    def add(self, offset: int, words: int, packed: bytes | np.ndarray) -> None:
        self._parts.append(struct.pack(">QQ", offset, words) + hashlib.sha256(packed).digest())

    def encode(self) -> bytes:
        return b"".join(self._parts)
