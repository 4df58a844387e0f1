"""Attested admission, run by the coordinator before each round (RATS, RFC 9334, both ways).

A sampled site whose attestation result would lapse during the round is (re-)attested, in two
stages (a `Strategy`, driven like the rounds):

1. evidence: the coordinator sends a nonce it made; the site returns evidence bound to that nonce
   and to its Ed25519 update key, plus a nonce of its own when it verifies the coordinator;
2. coordinator: the gate has appraised the evidence against the key the federation's registry
   holds for that site (a token bound to any other key fails); the coordinator now answers the
   site's nonce with its own evidence, bound to its X25519 sealing key, which the site appraises.

A site that fails either direction is excluded from the round with the reason in the log and the
metrics line; the round goes on with the others. Admission lasts until the earlier of the two
results' expiries; the site itself refuses to release an update once its appraisal of the
coordinator has expired (site/attestation_mod.py).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from flwr.app import ConfigRecord, RecordDict

from crypto.attestation import AttestationError, AttestationGate, Evidence, create_attester, create_verifier
from crypto.attestation.models import unb64url, utcnow
from crypto.pki import CoordinatorBundle
from crypto.pki.keys import raw_public
from federation.config import CoordinatorAttestation
from federation.coordinator.strategy import Exchange, ExchangeResult, Step
from federation.protocol import message_keys as keys

NEVER = dt.datetime.min.replace(tzinfo=dt.timezone.utc)


class UnknownSite(AttestationError):
    """The site is not in the federation's registry."""

    reason = "unknown_site"


class RevokedSite(AttestationError):
    """The site's keys were revoked."""

    reason = "revoked_site"


@dataclass
class AdmissionOutcome:
    """Who may take part in the round, and why the others may not."""

    admitted: list[int]
    excluded: dict[str, str] = field(default_factory=dict)  # site -> reason
    codes: dict[str, str] = field(default_factory=dict)  # site -> short reason code, for the rejection counts
    attested: list[str] = field(default_factory=list)  # sites (re-)attested this round

    def exclude(self, name: str, code: str, detail: str) -> None:
        """Leave a site out of the round under a reason code."""
        self.excluded[name], self.codes[name] = f"{code}: {detail}", code

    def metrics(self) -> dict:
        """The round's metrics line entry `attestation`."""
        return {"attested": sorted(self.attested), "excluded": dict(self.excluded)}


@dataclass
class AdmissionState:
    """One admission in progress."""

    round: int
    nodes: list[int]
    names: dict[int, str]
    due: list[int]  # the sites attested now
    out: AdmissionOutcome
    started: dt.datetime  # results must still hold then
    challenges: dict[int, str] = field(default_factory=dict)  # node -> our nonce
    answers: dict[int, str] = field(default_factory=dict)  # node -> our evidence for its nonce
    pending: dict[str, dt.datetime] = field(default_factory=dict)  # site -> its result, until it appraised us


class Admission:
    """`Strategy` of attested admission; keeps, across rounds, until when each site is admitted."""

    aborts: tuple[type[BaseException], ...] = ()

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

    def begin(self, rnd: int, nodes: list[int], names: dict[int, str], horizon_s: float) -> AdmissionState:
        """Admission of `nodes` to a round whose updates may arrive up to `horizon_s` from now: a site
        whose result would lapse before then is re-attested first (results shorter than a round
        mean re-attestation every round; what counts is that evidence was fresh when it began)."""
        now = utcnow()
        horizon = now + dt.timedelta(seconds=horizon_s)
        due = [n for n in nodes if self.until.get(names[n], NEVER) <= horizon]
        out = AdmissionOutcome([], attested=[names[n] for n in due])
        for name in out.attested:
            self.until.pop(name, None)  # lapsing: admitted again only on fresh evidence
        return AdmissionState(rnd, list(nodes), names, due, out, now)

    def steps(self) -> tuple[Step[AdmissionState], ...]:
        """Site evidence first, then the coordinator's evidence for the sites that ask for it."""
        return (Step(self.configure_evidence, self.aggregate_evidence),
                Step(self.configure_coordinator, self.aggregate_coordinator))

    def configure_evidence(self, st: AdmissionState) -> Exchange | None:
        """A fresh nonce of ours to each site due."""
        if not st.due:
            return None
        st.challenges = {n: self.gate.challenge(st.names[n]).nonce for n in st.due}
        return Exchange("attestation evidence", "query", st.due, lambda n: RecordDict({keys.ATTEST: ConfigRecord(
            {"step": "evidence", "nonce": st.challenges[n], "round": st.round})}), self.stage_s)

    def aggregate_evidence(self, st: AdmissionState, result: ExchangeResult) -> None:
        """Appraise each site's evidence; answer the nonce of those that verify us."""
        out = st.out
        for name, reason in result.failed.items():
            out.exclude(name, "no_evidence", reason)
        for reply in result.replies:
            name, status = reply.name, reply.status
            try:
                res = self.gate.admit(name, Evidence.model_validate_json(str(status["evidence"])),
                                      public_key=self._site_key(name))
            except AttestationError as err:
                out.exclude(name, err.reason, err.detail or str(err))
                continue
            except (KeyError, ValueError) as err:
                out.exclude(name, "malformed_evidence", f"attestation failed: {err}")
                continue
            challenge = status.get("challenge")
            if not challenge:  # this site does not appraise the coordinator
                self.until[name] = res.expires_at
                continue
            if self.attester is None:
                out.exclude(name, "coordinator_not_attested", "the site verifies the coordinator but "
                            "federation.attestation.coordinator.attester is unset")
                continue
            try:
                st.answers[reply.message.metadata.src_node_id] = self.attester.attest(
                    unb64url(str(challenge)), self.seal_public).model_dump_json()
            except Exception as err:  # a TEE plug-in failing must not end the round
                out.exclude(name, "coordinator_attester_failed", f"{type(err).__name__}: {err}")
                continue
            st.pending[name] = res.expires_at

    def configure_coordinator(self, st: AdmissionState) -> Exchange | None:
        """Our evidence, bound to our sealing key, to each site that challenged us."""
        if not st.answers:
            return None
        return Exchange("attestation of the coordinator", "query", list(st.answers),
                        lambda n: RecordDict({keys.ATTEST: ConfigRecord(
                            {"step": "coordinator", "evidence": st.answers[n], "round": st.round})}), self.stage_s)

    def aggregate_coordinator(self, st: AdmissionState, result: ExchangeResult) -> None:
        """A site that trusts us is admitted until the earlier of both results' expiries."""
        for name, reason in result.failed.items():
            st.out.exclude(name, "site_refused_coordinator", reason)
        for reply in result.replies:
            name = reply.name
            try:
                trusted = dt.datetime.fromtimestamp(float(reply.status["trusted_until"]), dt.timezone.utc)
            except (KeyError, TypeError, ValueError, OverflowError) as err:
                st.out.exclude(name, "site_refused_coordinator", f"the site's answer has no usable trusted_until: {err}")
                continue
            self.until[name] = min(st.pending[name], trusted)

    def finish(self, st: AdmissionState) -> AdmissionOutcome:
        """The sites admitted now."""
        st.out.admitted = [n for n in st.nodes
                           if st.names[n] not in st.out.excluded and self.until.get(st.names[n], NEVER) > st.started]
        return st.out

    def _site_key(self, name: str) -> bytes:
        rec = self.trust.lookup(name)
        if rec is None:
            raise UnknownSite(f"site {name!r} is not in the federation's registry: provision it")
        if rec.revoked:
            raise RevokedSite(f"site {name!r} is revoked")
        return raw_public(rec.sign_public)

    def admitted(self, name: str) -> bool:
        """Whether `name` is admitted now (the evaluate stage sends the model only to those)."""
        return self.until.get(name, NEVER) > utcnow()
