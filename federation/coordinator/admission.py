"""Attested admission, run by the coordinator before each round (RATS, RFC 9334, both ways).

A sampled site whose attestation result would lapse during the round is (re-)attested:

1. the coordinator sends a nonce it made; the site returns evidence bound to that nonce and to
   its Ed25519 update key, plus a nonce of its own when it verifies the coordinator;
2. the gate appraises the evidence against the key the federation's registry holds for that site
   (a token bound to any other key fails), then the coordinator answers the site's nonce with
   its own evidence, bound to its X25519 sealing key, which the site appraises.

A site that fails either direction is excluded from the round with the reason in the log and the
metrics line; the round goes on with the others. Admission lasts until the earlier of the two
results' expiries; the site itself refuses to release an update once its appraisal of the
coordinator has expired.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flwr.app import ConfigRecord, RecordDict

from crypto.attestation import AttestationError, AttestationGate, Evidence, create_attester, create_verifier
from crypto.attestation.models import unb64url, utcnow
from crypto.pki import CoordinatorBundle
from crypto.pki.keys import raw_public
from federation.config.attestation_config import CoordinatorAttestation

if TYPE_CHECKING:
    from federation.coordinator.driver import Coordinator



class UnknownSite(AttestationError):
    reason = "unknown_site"


class RevokedSite(AttestationError):
    reason = "revoked_site"


@dataclass
class AdmissionOutcome:
    admitted: list[int]
    excluded: dict[str, str] = field(default_factory=dict)  # site -> reason
    codes: dict[str, str] = field(default_factory=dict)  # site -> short reason code, for the rejection counts
    attested: list[str] = field(default_factory=list)  # sites (re-)attested this round

    def exclude(self, name: str, code: str, detail: str) -> None:
        self.excluded[name], self.codes[name] = f"{code}: {detail}", code

    def metrics(self) -> dict:
        return {"attested": sorted(self.attested), "excluded": dict(self.excluded)}


class Admission:
    def __init__(self, spec: CoordinatorAttestation, bundle: CoordinatorBundle, stage_s: float):
        policy = spec.sites.policy
        verifiers = {name: create_verifier(name, cfg, allow_insecure_dev=policy.allow_insecure_dev)
                     for name, cfg in spec.sites.verifiers.items()}
        self.gate = AttestationGate(verifiers, policy, nonce_ttl_s=2 * stage_s + 30)
        self.trust = bundle.trust()
        self.attester = create_attester(spec.attester.kind, bundle.name, spec.attester.config) if spec.attester else None
        self.seal_public = raw_public(bundle.seal_key.public_key())
        self.stage_s = stage_s
        self.until: dict[str, dt.datetime] = {}  # site -> admitted until

    def run(self, coord: "Coordinator", rnd: int, nodes: list[int], horizon_s: float) -> AdmissionOutcome:
        """Admit `nodes` to a round whose updates may arrive up to `horizon_s` from now: a site
        whose result would lapse before then is re-attested first (results shorter than a round
        mean re-attestation every round; what counts is that evidence was fresh when it began)."""
        now = utcnow()
        horizon = now + dt.timedelta(seconds=horizon_s)
        never = dt.datetime.min.replace(tzinfo=dt.timezone.utc)
        names = {n: coord.site_name(n) for n in nodes}
        due = [n for n in nodes if self.until.get(names[n], never) <= horizon]
        out = AdmissionOutcome([], attested=[names[n] for n in due])
        for name in out.attested:
            self.until.pop(name, None)  # lapsing: admitted again only on fresh evidence
        if due:
            self._attest(coord, rnd, due, names, out)
        out.admitted = [n for n in nodes if names[n] not in out.excluded and self.until.get(names[n], never) > now]
        for name, reason in out.excluded.items():
            coord.count_rejection("attestation:" + out.codes[name])
            coord.progress(f"round {rnd}: site {name} NOT ADMITTED: {reason}")
        return out

    def _attest(self, coord: "Coordinator", rnd: int, due: list[int], names: dict[int, str],
                out: AdmissionOutcome) -> None:
        challenges = {n: self.gate.challenge(names[n]).nonce for n in due}
        res = coord.exchange(due, "query", lambda n: RecordDict({"attest": ConfigRecord(
            {"step": "evidence", "nonce": challenges[n], "round": rnd})}), self.stage_s)
        for name, reason in res.failed.items():
            out.exclude(name, "no_evidence", reason)
        answers: dict[int, str] = {}
        pending: dict[str, dt.datetime] = {}  # site -> its result, until the site has appraised us
        for name, reply in res.ok.items():
            status = reply.content.config_records["status"]
            try:
                result = self.gate.admit(name, Evidence.model_validate_json(str(status["evidence"])),
                                         public_key=self._site_key(name))
            except AttestationError as err:
                out.exclude(name, err.reason, err.detail or str(err))
                continue
            except (KeyError, ValueError) as err:
                out.exclude(name, "malformed_evidence", f"attestation failed: {err}")
                continue
            challenge = status.get("challenge")
            if not challenge:  # this site does not appraise the coordinator
                self.until[name] = result.expires_at
                continue
            if self.attester is None:
                out.exclude(name, "coordinator_not_attested", "the site verifies the coordinator but "
                            "federation.attestation.coordinator.attester is unset")
                continue
            try:
                answers[reply.metadata.src_node_id] = self.attester.attest(
                    unb64url(str(challenge)), self.seal_public).model_dump_json()
            except Exception as err:  # a TEE plug-in failing must not end the round
                out.exclude(name, "coordinator_attester_failed", f"{type(err).__name__}: {err}")
                continue
            pending[name] = result.expires_at
        if not answers:
            return
        res = coord.exchange(list(answers), "query", lambda n: RecordDict({"attest": ConfigRecord(
            {"step": "coordinator", "evidence": answers[n], "round": rnd})}), self.stage_s)
        for name, reason in res.failed.items():
            out.exclude(name, "site_refused_coordinator", reason)
        for name, reply in res.ok.items():
            try:
                trusted = dt.datetime.fromtimestamp(float(reply.content.config_records["status"]["trusted_until"]),
                                                    dt.timezone.utc)
            except (KeyError, TypeError, ValueError, OverflowError) as err:
                out.exclude(name, "site_refused_coordinator", f"the site's answer has no usable trusted_until: {err}")
                continue
            self.until[name] = min(pending[name], trusted)

    def _site_key(self, name: str) -> bytes:
        rec = self.trust.lookup(name)
        if rec is None:
            raise UnknownSite(f"site {name!r} is not in the federation's registry: provision it")
        if rec.revoked:
            raise RevokedSite(f"site {name!r} is revoked")
        return raw_public(rec.sign_public)

    def admitted(self, name: str) -> bool:
        return self.until.get(name, dt.datetime.min.replace(tzinfo=dt.timezone.utc)) > utcnow()
