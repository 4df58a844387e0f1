"""Signed SecAgg+ messages, coordinator and site sides, without processes (see test_secagg_workflow).

Sites hold provisioned bundles and sign every message; the coordinator verifies with its bundle.
A forged or missing signature, a tampered masked chunk and a key the coordinator substitutes in
the relayed adverts are each refused with their own reason, and the round ends with the exact
aggregate of the honest survivors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, Message

from crypto.pki import CoordinatorBundle, SiteBundle, provision
from crypto.secagg import wire
from crypto.secagg.context import RoundContext as SecAggContext
from crypto.secagg.keys import KeyPair
from crypto.secagg.signing import CHANNELS, ChunkManifest, Signature, SignatureRejected, sign, verify
from federation.site import secagg_mod as secagg_site
from federation.protocol.message_keys import SECAGG as RECORD
from federation.protocol.message_keys import SECAGG_CHUNKS as CHUNKS
from test_secagg_workflow import _task_identity, check_exact, make  # noqa: F401 (autouse fixture)

SITES = list("abcde")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pki")
    provision(out, SITES)
    return out


def signed_run(tmp_path: Path, pki: Path):
    dumps = tmp_path / "dumps"
    coord, grid = make(tmp_path, pki=pki, secagg={"chunk_bytes": 64},
                       node_config={s: {"secagg-dump-dir": str(dumps / s)} for s in SITES})
    return coord, grid, dumps, {s.name: s for s in grid.sites.values()}


def test_signed_round_verifies_every_message_and_is_exact(tmp_path, pki):
    coord, grid, dumps, sites = signed_run(tmp_path, pki)
    seen = []

    def spy(stage, rnd, reply):
        seen.append((stage, bytes(reply.content.config_records[RECORD]["sig"])))
        return reply

    sites["c"].tamper = spy
    line = coord.train_round(1)
    assert line["rejections"] == {} and not line["failed"]
    check_exact(coord, line, 1, dumps, SITES)
    assert [st for st, _ in seen] == [1, 2, 3, 4] and all(len(sig) == 64 for _, sig in seen)
    assert coord.train_round(2)["status"] == "aggregated"  # fresh signatures every round: no replay hit


def _unsigned(site_name: str, pki: Path):
    def tamper(rec, ctx):
        del rec["sig_header"], rec["sig"]
    return tamper


def _signed_by_e(claim_sender: bool):
    """Site e's key signs the sender's advert: naming the sender (a forged signature) or naming e
    (a valid signature, but by another site)."""
    def forge(site_name: str, pki: Path):
        other = SiteBundle.load(pki / "sites" / "e")

        def tamper(rec, ctx):
            sig = sign(other.sign_key, other.federation_id, site_name if claim_sender else other.name, ctx, 1,
                       bytes(rec["data"]))
            rec["sig_header"], rec["sig"] = sig.header, sig.signature
        return tamper
    return forge


def capture_context(grid) -> dict:
    """Keeps the round context of the latest SecAgg request (what a site would sign with)."""
    seen = {}

    def spy(m: Message) -> Message:
        if RECORD in m.content.config_records:
            seen["ctx"] = secagg_site.Request.parse(m).ctx
        return m

    grid.tamper_out = spy
    return seen


@pytest.mark.parametrize("forge,reason", [
    (_unsigned, "secagg_unsigned"),
    (_signed_by_e(claim_sender=True), "secagg_bad_signature"),
    (_signed_by_e(claim_sender=False), "secagg_wrong_site"),
], ids=["unsigned", "forged", "another-site"])
def test_forged_or_unsigned_advert_is_rejected(tmp_path, pki, forge, reason):
    coord, grid, dumps, sites = signed_run(tmp_path, pki)
    contexts = capture_context(grid)
    edit = forge("b", pki)

    def tamper(stage, rnd, reply):
        if stage == 1:
            edit(reply.content.config_records[RECORD], contexts["ctx"])
        return reply

    sites["b"].tamper = tamper
    line = coord.train_round(1)
    assert line["rejections"] == {reason: 1}
    assert line["failed"]["b"].startswith(f"rejected {reason}: stage 1 (advertise keys)")
    assert line["secagg"]["roster"] == 4
    check_exact(coord, line, 1, dumps, list("acde"))


def test_tampered_masked_chunk_is_rejected(tmp_path, pki):
    coord, grid, dumps, sites = signed_run(tmp_path, pki)

    def tamper(stage, rnd, reply):
        if stage == 3 and not reply.has_error():
            rec = reply.content.array_records[CHUNKS]
            key = sorted(rec)[1]
            words = rec[key].numpy().copy()
            words[0] ^= np.uint32(1)  # one bit: still a well-formed uint32 chunk inside the ring
            rec[key] = Array(words)
        return reply

    sites["b"].tamper = tamper
    line = coord.train_round(1)
    assert line["rejections"] == {"secagg_digest_mismatch": 1}
    assert line["failed"]["b"].startswith("rejected secagg_digest_mismatch: stage 3 (masked input)")
    assert line["secagg"]["dropped"] == ["b"]  # its masks were removed from the survivors' sum
    check_exact(coord, line, 1, dumps, list("acde"))


def _with_fake_keys(req: bytes, ctx, me: int, victim: int) -> tuple[bytes, wire.Advert]:
    """The share-keys request with the victim's keys replaced by fresh ones (the coordinator's)."""
    roster, adverts = wire.decode_share_keys_request(ctx, req, me)
    fake = wire.Advert(victim, KeyPair.generate().public, KeyPair.generate().public)
    adverts = [fake if a.client == victim else a for a in adverts]
    return wire.encode_share_keys_request(ctx, me, roster, adverts), fake


def _swap_keys(req: bytes, relayed: bytes, ctx, me: int, victim: int, coord_bundle) -> tuple[bytes, bytes]:
    return _with_fake_keys(req, ctx, me, victim)[0], relayed  # the victim's own signature stays


def _drop_signature(req, relayed, ctx, me, victim, coord_bundle):
    sigs = wire.decode_advert_signatures(ctx, relayed, me)
    del sigs[victim]
    return req, wire.encode_advert_signatures(ctx, me, sigs)


def _coordinator_signs_own_keys(req, relayed, ctx, me, victim, coord_bundle):
    """Keys the coordinator controls, vouched for with its own (registered) signing key."""
    req, fake = _with_fake_keys(req, ctx, me, victim)
    sig = sign(coord_bundle.sign_key, coord_bundle.federation_id, coord_bundle.name, ctx, 1, wire.encode_advert(ctx, fake))
    sigs = wire.decode_advert_signatures(ctx, relayed, me)
    sigs[victim] = (sig.header, sig.signature)
    return req, wire.encode_advert_signatures(ctx, me, sigs)


@pytest.mark.parametrize("substitute,reason", [
    (_swap_keys, "secagg_digest_mismatch"),
    (_drop_signature, "secagg_unsigned"),
    (_coordinator_signs_own_keys, "secagg_not_a_site"),
], ids=["swapped", "signature-dropped", "coordinator-signed"])
def test_site_refuses_a_substituted_relayed_key(tmp_path, pki, substitute, reason):
    """A malicious coordinator replaces neighbour c's keys in what it relays to site a."""
    coord, grid, dumps, sites = signed_run(tmp_path, pki)
    a, c = sites["a"].node_id, sites["c"].node_id
    coord_bundle = CoordinatorBundle.load(pki / "coordinator")

    def tamper_out(m: Message) -> Message:
        rec = m.content.config_records.get(RECORD)
        if rec is not None and int(rec["stage"]) == 2 and m.metadata.dst_node_id == a:
            req = secagg_site.Request.parse(m)
            rec["request"], rec["relayed"] = substitute(req.request, bytes(rec["relayed"]), req.ctx, a, c, coord_bundle)
        return m

    grid.tamper_out = tamper_out
    line = coord.train_round(1)
    err = line["failed"]["a"]
    assert err.startswith("stage 2 (share keys): site_error:") and "SignatureRejected" in err and reason in err
    assert f"neighbour {c}" in err
    check_exact(coord, line, 1, dumps, list("bcde"))


def test_signature_binds_stage_round_context_and_content(pki):
    site = SiteBundle.load(pki / "sites" / "a")
    trust = CoordinatorBundle.load(pki / "coordinator").trust()
    ctx = SecAggContext("unit/1", 3, b"\x05" * 32)
    sig = sign(site.sign_key, site.federation_id, "a", ctx, 2, b"shares")
    kw = dict(trust=trust, federation_id=site.federation_id)
    assert verify(sig, b"shares", ctx=ctx, stage=2, site="a", **kw) == "a"
    for content, c, stage, who, code in [
        (b"sharez", ctx, 2, "a", "secagg_digest_mismatch"),
        (b"shares!", ctx, 2, "a", "secagg_malformed"),  # another length than the signed one
        (b"shares", ctx, 4, "a", "secagg_malformed"),  # channel of another stage
        (b"shares", SecAggContext("unit/1", 4, b"\x05" * 32), 2, "a", "secagg_wrong_context"),
        (b"shares", SecAggContext("unit/1", 3, b"\x06" * 32), 2, "a", "secagg_wrong_context"),
        (b"shares", ctx, 2, "b", "secagg_wrong_site"),
    ]:
        with pytest.raises(SignatureRejected) as info:
            verify(sig, content, ctx=c, stage=stage, site=who, **kw)
        assert info.value.reason == code
    with pytest.raises(SignatureRejected, match="malformed"):
        verify(Signature(b"junk", sig.signature), b"shares", ctx=ctx, stage=2, **kw)
    assert set(CHANNELS) == {1, 2, 3, 4}


def test_chunk_manifest_and_chunk_array():
    words = np.arange(40, dtype=np.uint32)
    one, two = ChunkManifest(), ChunkManifest()
    one.add(0, words[:16])
    one.add(16, words[16:])
    two.add(0, words)
    assert one.encode() != two.encode()  # the chunking is part of what is signed
    assert secagg_site.chunk_array(words).data == Array(words).data  # the .npy bytes Flower makes
