"""Signed SecAgg+ messages, coordinator and site sides, without processes (see test_secagg_workflow).

Sites hold provisioned bundles (with their SecAgg channel keys) and sign every message; the
coordinator verifies with its bundle. A forged or missing signature on a setup or its advert, a
tampered masked chunk and a key the coordinator substitutes in what it relays are each refused
with their own reason, and the round ends with the exact aggregate of the honest survivors.
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
from crypto.secagg import member_id
from crypto.secagg.signing import CHANNELS, ChunkManifest, Signature, SignatureRejected, sign, verify
from federation.site import secagg_mod as secagg_site
from federation.protocol.message_keys import SECAGG as RECORD
from federation.protocol.message_keys import SECAGG_CHUNKS as CHUNKS
from federation.protocol.message_keys import SECAGG_SETUP as SETUP_RECORD
from test_secagg_workflow import SETUP, _task_identity, check_exact, make  # noqa: F401 (autouse fixture)

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
        rec = reply.content.config_records[SETUP_RECORD if stage == SETUP else RECORD]
        seen.append((stage, rnd, bytes(rec["sig"])))
        if stage == SETUP:
            seen.append((1, rnd, bytes(rec["advert_sig"])))
        return reply

    sites["c"].tamper = spy
    line = coord.train_round(1)
    assert line["rejections"] == {} and not line["failed"]
    check_exact(coord, line, 1, dumps, SITES)
    # round 1's setup rode on discovery (the registry holds every channel key; before the spy), round
    # 2's on the train message; a setup's advert is signed on its own (it is relayed to neighbours)
    assert sorted((st, r) for st, r, _ in seen) == [(1, 2), (2, 2), (3, 1), (4, 1)]
    assert all(len(sig) == 64 for _, _, sig in seen)
    assert coord.messages_per_site()["c"] == 3  # discovery, train, unmask
    assert coord.train_round(2)["status"] == "aggregated"  # fresh signatures every round: no replay hit


def _unsigned(prefix: str):
    def forge(site_name: str, pki: Path):
        def tamper(rec, ctx):
            del rec[prefix + "sig_header"], rec[prefix + "sig"]
        return tamper
    return forge


def _signed_by_e(claim_sender: bool, prefix: str = ""):
    """Site e's key signs the sender's setup (or its advert): naming the sender (a forged
    signature) or naming e (a valid signature, but by another site)."""
    def forge(site_name: str, pki: Path):
        other = SiteBundle.load(pki / "sites" / "e")

        def tamper(rec, ctx):
            stage, field = (1, "advert") if prefix else (2, "data")
            sig = sign(other.sign_key, other.federation_id, site_name if claim_sender else other.name, ctx, stage,
                       bytes(rec[field]))
            rec[prefix + "sig_header"], rec[prefix + "sig"] = sig.header, sig.signature
        return tamper
    return forge


def capture_context(grid) -> dict:
    """Keeps the round context of the latest SecAgg request (what a site would sign with)."""
    seen = {}

    def spy(m: Message) -> Message:
        if SETUP_RECORD in m.content.config_records:
            seen["ctx"] = secagg_site.Request.parse(m, SETUP_RECORD).ctx
        return m

    grid.tamper_out = spy
    return seen


@pytest.mark.parametrize("forge,reason", [
    (_unsigned(""), "secagg_unsigned"),
    (_signed_by_e(claim_sender=True), "secagg_bad_signature"),
    (_signed_by_e(claim_sender=False), "secagg_wrong_site"),
    (_unsigned("advert_"), "secagg_unsigned"),
    (_signed_by_e(claim_sender=True, prefix="advert_"), "secagg_bad_signature"),
    (_signed_by_e(claim_sender=False, prefix="advert_"), "secagg_wrong_site"),
], ids=["unsigned", "forged", "another-site", "advert-unsigned", "advert-forged", "advert-another-site"])
def test_forged_or_unsigned_setup_is_rejected(tmp_path, pki, forge, reason):
    coord, grid, dumps, sites = signed_run(tmp_path, pki)
    contexts = capture_context(grid)
    edit = forge("b", pki)
    # round 1's plan rode on discovery, before this tamper: round 2 is the one b's forged setup is for
    assert coord.train_round(1)["status"] == "aggregated"

    def tamper(stage, rnd, reply):
        if stage == SETUP and rnd == 3:
            edit(reply.content.config_records[SETUP_RECORD], contexts["ctx"])
        return reply

    sites["b"].tamper = tamper
    assert coord.train_round(2)["status"] == "aggregated"
    line = coord.train_round(3)
    assert line["rejections"] == {reason: 1}
    assert line["failed"]["b"].startswith(f"rejected {reason}: setup")
    assert line["secagg"]["roster"] == 5 and line["secagg"]["live"] == 4
    check_exact(coord, line, 3, dumps, list("acde"))


def test_tampered_masked_chunk_is_rejected(tmp_path, pki):
    coord, grid, dumps, sites = signed_run(tmp_path, pki)

    def tamper(stage, rnd, reply):
        if stage == 3 and not reply.has_error():
            rec = reply.content.array_records[CHUNKS]
            key = sorted(rec)[1]
            packed = rec[key].numpy().copy()
            packed[0] ^= np.uint8(1)  # one bit: still a well-formed chunk of words inside the ring
            rec[key] = Array(packed)
        return reply

    sites["b"].tamper = tamper
    line = coord.train_round(1)
    assert line["rejections"] == {"secagg_digest_mismatch": 1}
    assert line["failed"]["b"].startswith("rejected secagg_digest_mismatch: stage 3 (masked input)")
    assert line["secagg"]["dropped"] == ["b"]  # its masks were removed from the survivors' sum
    check_exact(coord, line, 1, dumps, list("acde"))


def _with_fake_key(req: bytes, ctx, me: int, victim: int) -> tuple[bytes, wire.Advert]:
    """The masked-input request with the victim's mask key replaced by a fresh one (the coordinator's)."""
    spec, relayed = wire.decode_masked_input_request(ctx, req, me)
    fake = wire.Advert(victim, KeyPair.generate().public)
    relayed = [wire.Relayed(x.client, fake.s_pk, x.envelope) if x.client == victim else x for x in relayed]
    return wire.encode_masked_input_request(ctx, me, spec, relayed), fake


def _swap_keys(req: bytes, relayed: bytes, ctx, me: int, victim: int, coord_bundle) -> tuple[bytes, bytes]:
    return _with_fake_key(req, ctx, me, victim)[0], relayed  # the victim's own signature stays


def _drop_signature(req, relayed, ctx, me, victim, coord_bundle):
    sigs = wire.decode_advert_signatures(ctx, relayed, me)
    del sigs[victim]
    return req, wire.encode_advert_signatures(ctx, me, sigs)


def _coordinator_signs_own_keys(req, relayed, ctx, me, victim, coord_bundle):
    """A key the coordinator controls, vouched for with its own (registered) signing key."""
    req, fake = _with_fake_key(req, ctx, me, victim)
    sig = sign(coord_bundle.sign_key, coord_bundle.federation_id, coord_bundle.name, ctx, 1, wire.encode_advert(ctx, fake))
    sigs = wire.decode_advert_signatures(ctx, relayed, me)
    sigs[victim] = (sig.header, sig.signature)
    return req, wire.encode_advert_signatures(ctx, me, sigs)


def _another_sites_key(req, relayed, ctx, me, victim, coord_bundle, _pki={}):
    """The key and signature of another neighbour relayed as the victim's."""
    spec, entries = wire.decode_masked_input_request(ctx, req, me)
    sigs = wire.decode_advert_signatures(ctx, relayed, me)
    other = next(x for x in entries if x.client != victim)
    entries = [wire.Relayed(victim, other.s_pk, x.envelope) if x.client == victim else x for x in entries]
    sigs[victim] = sigs[other.client]
    return wire.encode_masked_input_request(ctx, me, spec, entries), wire.encode_advert_signatures(ctx, me, sigs)


@pytest.mark.parametrize("substitute,reason", [
    (_swap_keys, "secagg_digest_mismatch"),
    (_drop_signature, "secagg_unsigned"),
    (_coordinator_signs_own_keys, "secagg_not_a_site"),
    (_another_sites_key, "secagg_"),
], ids=["swapped", "signature-dropped", "coordinator-signed", "another-sites-key"])
def test_site_refuses_a_substituted_relayed_key(tmp_path, pki, substitute, reason):
    """A malicious coordinator replaces neighbour c's mask key in what it relays to site a."""
    coord, grid, dumps, sites = signed_run(tmp_path, pki)
    a, c = sites["a"].node_id, member_id("c")
    coord_bundle = CoordinatorBundle.load(pki / "coordinator")

    def tamper_out(m: Message) -> Message:
        rec = m.content.config_records.get(RECORD)
        if rec is not None and int(rec["stage"]) == 3 and m.metadata.dst_node_id == a:
            req = secagg_site.Request.parse(m)
            rec["request"], rec["relayed"] = substitute(req.request, bytes(rec["relayed"]), req.ctx, member_id("a"), c,
                                                        coord_bundle)
        return m

    grid.tamper_out = tamper_out
    line = coord.train_round(1)
    err = line["failed"]["a"]
    assert err.startswith("stage 3 (masked input, train): client_error:") and "SignatureRejected" in err, err
    assert reason in err and f"neighbour {c}" in err
    check_exact(coord, line, 1, dumps, list("bcde"))  # a refused before masking: dropped after its setup
    assert line["secagg"]["dropped"] == ["a"]


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
    from crypto.secagg import ring

    words = np.arange(40, dtype=np.uint32)
    one, two = ChunkManifest(), ChunkManifest()
    one.add(0, 16, ring.pack_words(words[:16], 12))
    one.add(16, 24, ring.pack_words(words[16:], 12))
    two.add(0, 40, ring.pack_words(words, 12))
    assert one.encode() != two.encode()  # the chunking is part of what is signed
    packed = ring.pack_words(words, 12)
    assert secagg_site.chunk_array(packed).data == Array(packed).data  # the .npy bytes Flower makes
