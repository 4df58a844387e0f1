"""Attested rounds in process: the site's half (federation/site/attestation_mod.py, the ClientApp's
train gate) and the coordinator's admission (federation/coordinator/admission.py) talking to real ClientApp
handlers through Flower's own message and context serialization, with real provisioned keys and
real tokens from a local test issuer. The end-to-end run is tests/test_e2e_attestation.py."""

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

    def send(self, kind: str, content: RecordDict) -> ConfigRecord:
        return self.handle(Message(content, dst_node_id=self.node_id, message_type=kind)).content.config_records["status"]

    def attest(self, nonce: str) -> ConfigRecord:
        return self.send("query", RecordDict({"attest": ConfigRecord({"step": "evidence", "nonce": nonce})}))

    def appraise(self, evidence: str) -> ConfigRecord:
        return self.send("query", RecordDict({"attest": ConfigRecord({"step": "coordinator", "evidence": evidence})}))

    def train(self) -> ConfigRecord:
        return self.send("train", RecordDict({"config": ConfigRecord({"round": 1, "deadline_s": 5.0})}))


def coordinator_gate(world) -> AttestationGate:
    spec = world["att"].coordinator.sites
    return AttestationGate({n: create_verifier(n, c) for n, c in spec.verifiers.items()}, spec.policy)


def coordinator_evidence(world, challenge: str, **mint) -> str:
    seal = raw_public(world["coord"].seal_key.public_key())
    return LocalTokenAttester("coordinator", world["issuer"], **mint).attest(unb64url(challenge), seal).model_dump_json()


def test_site_evidence_binds_its_registered_key_and_the_coordinators_nonce(world):
    gate, site = coordinator_gate(world), Site(world)
    challenge = gate.challenge("a")
    status = site.attest(challenge.nonce)
    assert status["ok"], status["error"]
    registered = raw_public(world["coord"].trust().signing_key("a"))
    result = gate.admit("a", Evidence.model_validate_json(status["evidence"]), public_key=registered)
    assert result.measurements["measurement"] == GOOD_MEASUREMENT
    assert status["challenge"]  # the site wants the coordinator attested too


def test_site_releases_updates_only_to_an_attested_coordinator(world):
    site = Site(world)
    refused = site.train()  # nothing appraised yet
    assert not refused["ok"] and refused["error"].startswith("coordinator_not_attested")
    challenge = site.attest(coordinator_gate(world).challenge("a").nonce)["challenge"]
    ok = site.appraise(coordinator_evidence(world, challenge))
    assert ok["ok"], ok["error"]
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
        assert site.appraise(old)["ok"]
        site.attest(coordinator_gate(world).challenge("a").nonce)
        evidence = old
    else:
        mint = {"debug": {"debug": True}, "measurement": {"measurement": "cc" * 48},
                "expired": {"iat": time.time() - 1000, "lifetime_s": 100}}[case]
        evidence = coordinator_evidence(world, challenge, **mint)
    status = site.appraise(evidence)
    assert not status["ok"] and reason in status["error"], status["error"]
    if case != "replayed":
        refused = site.train()
        assert not refused["ok"] and refused["error"].startswith("coordinator_not_attested")


def test_a_spent_or_missing_challenge_is_refused(world):
    site = Site(world)
    challenge = site.attest(coordinator_gate(world).challenge("a").nonce)["challenge"]
    evidence = coordinator_evidence(world, challenge)
    assert site.appraise(evidence)["ok"]
    again = site.appraise(coordinator_evidence(world, challenge))  # our nonce is used up
    assert not again["ok"] and "nonce_mismatch" in again["error"]


def test_a_site_without_attestation_settings_says_how_to_add_them(world, tmp_path):
    site = Site(world)
    ctx = context_from_proto(site.ctx)
    del ctx.node_config["attestation-config"]
    msg = Message(RecordDict({"attest": ConfigRecord({"step": "evidence", "nonce": "AA"})}), dst_node_id=1,
                  message_type="query")
    status = client_app.app(msg, ctx).content.config_records["status"]
    assert not status["ok"] and "attestation-config" in status["error"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"attester": {"kind": "local-token"}, "verify_coordinator": True}))
    status = Site(world, broken).attest("AA")
    assert not status["ok"] and "verifiers" in status["error"]


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


def test_admission_revoked_site_and_reattestation(world, tmp_path):
    coord, nodes, log = admission_run(world, tmp_path)
    coord.admission.trust.revoke("b")
    out = coord.admit(1, nodes, horizon_s=60)
    assert out.admitted == [nodes[0]] and out.attested == ["a", "b"]
    assert out.codes == {"b": "revoked_site"} and coord.rejections == {"attestation:revoked_site": 1}
    assert any("site b NOT ADMITTED: revoked_site" in line for line in log)
    assert coord.admission.admitted("a") and not coord.admission.admitted("b")
    again = coord.admit(2, nodes[:1], horizon_s=60)  # still valid: no new exchange
    assert again.admitted == nodes[:1] and again.attested == []
    lapsing = coord.admit(3, nodes[:1], horizon_s=10_000)  # would lapse mid-round: re-attested
    assert lapsing.admitted == nodes[:1] and lapsing.attested == ["a"]


def test_a_failing_coordinator_attester_excludes_sites_without_ending_the_round(world, tmp_path, monkeypatch):
    coord, nodes, log = admission_run(world, tmp_path)

    def broken(nonce, key):
        raise RuntimeError("TEE report device busy")

    monkeypatch.setattr(coord.admission.attester, "attest", broken)
    out = coord.admit(1, nodes, horizon_s=60)
    assert out.admitted == [] and set(out.codes.values()) == {"coordinator_attester_failed"}
    assert "TEE report device busy" in out.excluded["a"]
    assert coord.rejections == {"attestation:coordinator_attester_failed": 2}
