"""Attested rounds in process: the site's half (federation/site/attestation_mod.py, the ClientApp's
train gate) and the coordinator's admission (federation/coordinator/admission.py, riding on the
messages the driver sends) talking to real ClientApp handlers through Flower's own message and
context serialization, with real provisioned keys and real tokens from a local test issuer. The
end-to-end run is tests/test_e2e_attestation.py."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import x25519
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto
from flwr.supercore.task_identity import TaskIdentity

from crypto.attestation import AttestationGate, Evidence, create_verifier
from crypto.attestation.models import unb64url
from crypto.attestation.testing import GOOD_MEASUREMENT, LocalTokenAttester, LocalTokenIssuer
from crypto.pki import CoordinatorBundle, SiteBundle, provision
from crypto.pki.keys import raw_public
from federation.site import client_app
from federation.config import AttestationConfig, resolve
from federation.config.schema import parse_config
from federation.coordinator.driver import Coordinator
from federation.coordinator.driver import Site as CoordSite
from federation.coordinator.strategy import Exchange
from test_secagg_workflow import FakeGrid


@pytest.fixture(autouse=True)
def _task_identity():
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("att")
    provision(root / "pki", ["a", "b"])
    att = resolve(AttestationConfig(enabled=True, dev_issuer=True), root / "issuer", create=True)
    settings = root / "a.json"
    settings.write_text(att.for_site("a").model_dump_json())
    return {"root": root, "att": att, "settings": settings, "issuer": LocalTokenIssuer.load(root / "issuer"),
            "site": SiteBundle.load(root / "pki" / "sites" / "a"),
            "coord": CoordinatorBundle.load(root / "pki" / "coordinator")}


class Site:
    """A SuperNode's view: node config, and a context state that survives between messages as
    Flower keeps it (through protobuf), one ClientApp process per message."""

    def __init__(self, world, settings=None, name: str = "a", node_id: int = 1):
        self.name, self.node_id = name, node_id
        cfg = {"site-id": name, "trainer-socket": str(world["root"] / "no-trainer.sock"),
               "bundle-dir": str(world["root"] / "pki" / "sites" / name),
               "attestation-config": str(settings or world["settings"])}
        self.ctx = context_to_proto(Context(run_id=7, node_id=node_id, node_config=cfg, state=RecordDict(),
                                            run_config={}))

    def handle(self, msg: Message) -> Message:  # for test_secagg_workflow.FakeGrid
        ctx = context_from_proto(self.ctx)
        reply = client_app.app(msg, ctx)
        self.ctx = context_to_proto(ctx)
        return reply

    def send(self, kind: str, content: RecordDict) -> Message:
        return self.handle(Message(content, dst_node_id=self.node_id, message_type=kind))

    def attest(self, nonce: str) -> ConfigRecord:
        """The site's answer to our nonce (ATTEST record of the reply)."""
        return self.send("query", RecordDict({"attest": ConfigRecord({"nonce": nonce})})).content.config_records["attest"]

    def appraise(self, evidence: str) -> ConfigRecord:
        """The site's answer to our evidence for its nonce."""
        return self.send("query", RecordDict({"attest": ConfigRecord({"evidence": evidence})})).content.config_records["attest"]

    def train(self) -> ConfigRecord:
        return self.send("train", RecordDict({"config": ConfigRecord({"round": 1, "deadline_s": 5.0})})).content.config_records["status"]


def coordinator_gate(world) -> AttestationGate:
    spec = world["att"].coordinator.sites
    return AttestationGate({n: create_verifier(n, c) for n, c in spec.verifiers.items()}, spec.policy)


def coordinator_evidence(world, challenge: str, **mint) -> str:
    seal = raw_public(world["coord"].seal_key.public_key())
    return LocalTokenAttester("coordinator", world["issuer"], **mint).attest(unb64url(challenge), seal).model_dump_json()


def test_site_evidence_binds_its_registered_key_and_the_coordinators_nonce(world):
    gate, site = coordinator_gate(world), Site(world)
    challenge = gate.challenge("a")
    answer = site.attest(challenge.nonce)
    assert "error" not in answer, answer["error"]
    registered = raw_public(world["coord"].trust().signing_key("a"))
    result = gate.admit("a", Evidence.model_validate_json(answer["evidence"]), public_key=registered)
    assert result.measurements["measurement"] == GOOD_MEASUREMENT
    assert answer["challenge"]  # the site wants the coordinator attested too


def test_site_releases_updates_only_to_an_attested_coordinator(world):
    site = Site(world)
    refused = site.train()  # nothing appraised yet
    assert not refused["ok"] and refused["error"].startswith("coordinator_not_attested")
    challenge = site.attest(coordinator_gate(world).challenge("a").nonce)["challenge"]
    ok = site.appraise(coordinator_evidence(world, challenge))
    assert "appraisal_error" not in ok and "error" not in ok, dict(ok)
    assert ok["trusted_until"] > time.time() + 60
    passed = site.train()  # the gate opens: the relay goes on to the trainer (absent here)
    assert not passed["ok"] and "coordinator_not_attested" not in passed["error"]
    assert "trainer" in passed["error"].lower()


@pytest.mark.parametrize("case, reason", [
    ("debug", "debug_enabled"),
    ("measurement", "measurement_not_allowed"),
    ("other_key", "key_binding_mismatch"),
    ("replayed", "nonce_mismatch"),
    ("expired", "token_expired"),
])
def test_site_refuses_a_coordinator_whose_evidence_fails(world, case, reason):
    site = Site(world)
    challenge = site.attest(coordinator_gate(world).challenge("a").nonce)["challenge"]
    if case == "other_key":  # a token for some other key than the sealing key in the site's bundle
        other = raw_public(x25519.X25519PrivateKey.generate().public_key())
        evidence = LocalTokenAttester("coordinator", world["issuer"]).attest(unb64url(challenge), other).model_dump_json()
    elif case == "replayed":  # good evidence for an earlier challenge of this site
        old = coordinator_evidence(world, challenge)
        assert "trusted_until" in site.appraise(old)
        site.attest(coordinator_gate(world).challenge("a").nonce)
        evidence = old
    else:
        mint = {"debug": {"debug": True}, "measurement": {"measurement": "cc" * 48},
                "expired": {"iat": time.time() - 1000, "lifetime_s": 100}}[case]
        evidence = coordinator_evidence(world, challenge, **mint)
    answer = site.appraise(evidence)
    assert "trusted_until" not in answer and reason in answer["appraisal_error"], dict(answer)
    # evidence that fails closes the door, even after an earlier success (the replayed case)
    refused = site.train()
    assert not refused["ok"] and refused["error"].startswith("coordinator_not_attested")
    assert reason in refused["error"]  # the refusal says why


def test_a_spent_or_missing_challenge_is_refused(world):
    site = Site(world)
    challenge = site.attest(coordinator_gate(world).challenge("a").nonce)["challenge"]
    evidence = coordinator_evidence(world, challenge)
    assert "trusted_until" in site.appraise(evidence)
    again = site.appraise(coordinator_evidence(world, challenge))  # our nonce is used up
    assert "nonce_mismatch" in again["appraisal_error"]


def test_a_site_without_attestation_settings_says_how_to_add_them(world, tmp_path):
    site = Site(world)
    ctx = context_from_proto(site.ctx)
    del ctx.node_config["attestation-config"]
    msg = Message(RecordDict({"attest": ConfigRecord({"nonce": "AA"})}), dst_node_id=1, message_type="query")
    reply = client_app.app(msg, ctx).content
    assert reply.config_records["status"]["ok"]  # an attestation problem never fails the message itself
    assert "attestation-config" in reply.config_records["attest"]["error"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"attester": {"kind": "local-token"}, "verify_coordinator": True}))
    assert "verifiers" in Site(world, broken).attest("AA")["error"]


def admission_run(world, tmp_path, **fed):
    """A real Coordinator with attestation on, its sites reached through an in-process grid."""
    cfg = parse_config({"federation": {"name": "unit", "attestation": {"enabled": True, "dev_issuer": True,
                                                                       "stage_s": 5}, **fed},
                        "sites": [{"id": "a", "partition": 0}, {"id": "b", "partition": 1}]})
    att = resolve(cfg.federation.attestation, world["root"] / "issuer")
    cfg = cfg.model_copy(update={"federation": cfg.federation.model_copy(update={"attestation": att})})
    sites = [Site(world, name=n, node_id=i + 10) for i, n in enumerate("ab")]
    log: list[str] = []
    coord = Coordinator(FakeGrid(sites), cfg, tmp_path / "coord", 7, {"w": np.zeros(3, np.float32)}, log.append,
                        world["coord"])
    coord.sites = {s.node_id: CoordSite(s.node_id, s.name, 10) for s in sites}
    return coord, [s.node_id for s in sites], log


def probe(coord, rnd: int, nodes):
    """A query to each node carrying what the admission rider of round `rnd` adds (our evidence
    for the sites' nonces), as a round's messages would."""
    coord.riders = [coord.admission.rider(rnd, None, lambda n, name: False, coord.known_name, lambda: nodes)]
    try:
        coord.exchange(Exchange("probe", "query", nodes, lambda n: RecordDict(), 5.0))
    finally:
        coord.riders = []


def test_admission_revoked_site_and_reattestation(world, tmp_path, monkeypatch):
    coord, nodes, log = admission_run(world, tmp_path)
    monkeypatch.setattr(coord, "round_horizon_s", lambda: 60.0)  # results last longer than a round
    coord.admission.trust.revoke("b")
    coord.prepare(1, nodes)  # nonces out, evidence back (in a deployment: on discovery's messages)
    out = coord.admit(1, nodes)
    assert out.admitted == [nodes[0]] and out.attested == ["a", "b"]
    assert out.codes == {"b": "revoked_site"}
    assert coord.admission.admitted("a") and not coord.admission.admitted("b")
    probe(coord, 1, nodes)  # our evidence for a's nonce rides on the next message: a trusts us
    assert coord.admission.their_until["a"] > time.time() + 60
    assert coord.prepare(2, nodes[:1]) is None  # still valid on both sides: nothing is sent
    again = coord.admit(2, nodes[:1])
    assert again.admitted == nodes[:1] and again.attested == []
    monkeypatch.setattr(coord, "round_horizon_s", lambda: 10_000.0)  # would lapse mid-round: re-attested
    assert coord.prepare(3, nodes[:1]) is not None
    lapsing = coord.admit(3, nodes[:1])
    assert lapsing.admitted == nodes[:1] and lapsing.attested == ["a"]


def test_a_failing_coordinator_attester_excludes_sites_without_ending_the_round(world, tmp_path, monkeypatch):
    coord, nodes, log = admission_run(world, tmp_path)

    def broken(nonce, key):
        raise RuntimeError("TEE report device busy")

    coord.prepare(1, nodes)
    monkeypatch.setattr(coord.admission.attester, "attest", broken)
    probe(coord, 1, nodes)  # the sites' nonces cannot be answered
    out = coord.admit(1, nodes)
    assert out.admitted == nodes  # our side admits them; theirs will refuse to train
    coord.admission.refusals(1, out)
    assert set(out.codes.values()) == {"coordinator_attester_failed"}
    assert "TEE report device busy" in out.excluded["a"]


def test_evidence_asked_on_a_rounds_first_message_survives_its_second(world, tmp_path, monkeypatch):
    """Under SecAgg a round sends each site two messages (train, unmask). The admission rider asks
    for the next round's evidence on the first; the reply to the second, which carries no nonce and
    so no evidence, must not undo that appraisal (it did: every other round lost all its sites)."""
    coord, nodes, log = admission_run(world, tmp_path)
    monkeypatch.setattr(coord, "round_horizon_s", lambda: 60.0)
    coord.prepare(1, nodes)
    assert coord.admit(1, nodes).admitted == nodes
    coord.riders = [coord.admission.rider(1, 2, lambda n, name: True, coord.known_name, lambda: nodes)]
    try:
        for stage in ("train", "unmask"):
            coord.exchange(Exchange(f"round 1 {stage}", "query", nodes, lambda n: RecordDict(), 5.0))
    finally:
        coord.riders = []
    out = coord.admit(2, nodes)
    assert out.admitted == nodes and out.attested == ["a", "b"] and not out.excluded, out.excluded
