"""Attested admission (RATS, RFC 9334, both ways), riding on the messages rounds send anyway.

Each round's messages carry, as a `Rider` (strategy.py), what the next round's admission needs:

1. to each site that will be sampled next round and whose result would lapse by then, a nonce the
   coordinator made (ATTEST `nonce`). The site answers in the same reply with evidence bound to that
   nonce and to its Ed25519 update key, plus a nonce of its own when it verifies the coordinator;
2. the gate appraises the evidence against the key the federation's registry holds for that site
   (a token bound to any other key fails): the site is admitted, on our side, until its result
   expires;
3. the coordinator answers the site's nonce in the next message it sends that site (the next
   round's train message) with its own evidence, bound to its X25519 sealing key; the site
   appraises it before anything else and refuses to train for a coordinator it does not trust
   (site/attestation_mod.py), which the rider reads from the reply (`site_refused_coordinator`).

Round 1's evidence rides on site discovery. A sampled site whose evidence for a round did not
arrive in time (down, busy, new) sits that round out and is asked again during it; the round goes
on with the others. A site that fails either direction is excluded from the round with the reason
in the log and the metrics line.

State across rounds, all on `Admission` and safe to checkpoint or drop: `our_until` (until when
our appraisal of each site holds), `their_until` (until when each site says it trusts us),
`challenges` (sites' nonces awaiting our evidence, by node) and the per-round `RoundAdmission`
records. A resumed coordinator may restore `our_until` (results stay valid until they expire) but
must drop `challenges` (a new run reaches sites with new nonces).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field

from flwr.app import ConfigRecord, Message

from crypto.attestation import AttestationError, AttestationGate, Evidence, create_attester, create_verifier
from crypto.attestation.models import unb64url, utcnow
from crypto.pki import CoordinatorBundle
from crypto.pki.keys import raw_public
from federation.config import CoordinatorAttestation
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
    """Who may take part in a round, and why the others may not."""

    admitted: list[int]
    excluded: dict[str, str] = field(default_factory=dict)  # site -> reason
    codes: dict[str, str] = field(default_factory=dict)  # site -> short reason code, for the rejection counts
    attested: list[str] = field(default_factory=list)  # sites whose evidence was appraised for this round

    def exclude(self, name: str, code: str, detail: str) -> None:
        """Leave a site out of the round under a reason code."""
        self.excluded[name], self.codes[name] = f"{code}: {detail}", code

    def metrics(self) -> dict:
        """The round's metrics line entry `attestation`."""
        return {"attested": sorted(self.attested), "excluded": dict(self.excluded)}


@dataclass
class RoundAdmission:
    """What was learnt about one round's admission while the previous round ran."""

    attested: set[str] = field(default_factory=set)  # evidence appraised for this round
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)  # site -> (code, detail)
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)  # site -> (code, detail): out of this round
    asked: set[int] = field(default_factory=set)  # nodes sent a nonce for this round's admission


class Admission:
    """Attested admission; keeps, across rounds, each side's verdict on the other."""

    def __init__(self, spec: CoordinatorAttestation, bundle: CoordinatorBundle, horizon_s: float):
        policy = spec.sites.policy
        verifiers = {name: create_verifier(name, cfg, allow_insecure_dev=policy.allow_insecure_dev)
                     for name, cfg in spec.sites.verifiers.items()}
        self.horizon_s = float(horizon_s)  # the longest a round's updates may take to arrive
        self.gate = AttestationGate(verifiers, policy, nonce_ttl_s=2 * self.horizon_s + 60)
        self.trust = bundle.trust()
        self.attester = create_attester(spec.attester.kind, bundle.name, spec.attester.config) if spec.attester else None
        self.seal_public = raw_public(bundle.seal_key.public_key())
        self.our_until: dict[str, dt.datetime] = {}  # site -> our appraisal of it holds until
        self.their_until: dict[str, float] = {}  # site -> it trusts us until (its report, epoch s)
        self.challenges: dict[int, str] = {}  # node -> the site's nonce, awaiting our evidence
        self.rounds: dict[int, RoundAdmission] = {}

    def round(self, rnd: int) -> RoundAdmission:
        """The record of round `rnd`'s admission."""
        return self.rounds.setdefault(rnd, RoundAdmission())

    # ---- which sites need what -------------------------------------------------------------
    def due(self, name: str, within_s: float) -> bool:
        """Whether `name` needs fresh evidence to take part `within_s` seconds from now."""
        horizon = utcnow() + dt.timedelta(seconds=within_s)
        if self.our_until.get(name, NEVER) <= horizon:
            return True
        theirs = self.their_until.get(name)
        return theirs is not None and theirs <= horizon.timestamp()

    def admitted(self, name: str) -> bool:
        """Whether our appraisal of `name` holds now (the final evaluation sends the model only to those)."""
        return self.our_until.get(name, NEVER) > utcnow()

    def verdict(self, rnd: int, nodes: list[int], names: dict[int, str]) -> AdmissionOutcome:
        """Round `rnd` starts: the sampled sites our appraisal admits now, and why the others are out."""
        rec = self.round(rnd)
        out = AdmissionOutcome([], attested=sorted(rec.attested & set(names.values())))
        for node in nodes:
            name = names[node]
            if self.admitted(name):
                out.admitted.append(node)
            elif name in rec.failed:
                out.exclude(name, *rec.failed[name])
            else:
                out.exclude(name, "no_evidence", "no attestation evidence for this round arrived in time "
                            "(the site was down, busy or new); it is asked again during this round")
        return out

    def refusals(self, rnd: int, out: AdmissionOutcome) -> None:
        """Add the sites that refused our evidence in round `rnd`'s messages to its outcome."""
        for name, (code, why) in self.round(rnd).refused.items():
            if name not in out.excluded:
                out.exclude(name, code, why)

    def rider(self, rnd: int, next_round: int | None, want: Callable[[int, str | None], bool],
              names: Callable[[int], str | None], candidates: Callable[[], list[int]]) -> "AdmissionRider":
        """The rider of round `rnd`'s messages: our evidence for each site's nonce, and nonces for
        the sites `want(node, name)` names for `next_round` (None: none) among `candidates()`."""
        return AdmissionRider(self, rnd, next_round, want, names, candidates)

    # ---- appraisal ---------------------------------------------------------------------------
    def _site_key(self, name: str) -> bytes:
        rec = self.trust.lookup(name)
        if rec is None:
            raise UnknownSite(f"site {name!r} is not in the federation's registry: provision it")
        if rec.revoked:
            raise RevokedSite(f"site {name!r} is revoked")
        return raw_public(rec.sign_public)

    def appraise(self, rnd: int, node: int, name: str, evidence_json: str) -> None:
        """Appraise a site's evidence for round `rnd` (a nonce we issued to its node)."""
        rec = self.round(rnd)
        rec.attested.add(name)
        self.our_until.pop(name, None)  # admitted again only on this evidence
        try:
            res = self.gate.admit(name, Evidence.model_validate_json(evidence_json), public_key=self._site_key(name),
                                  nonce_party=f"node:{node}")
        except AttestationError as err:
            rec.failed[name] = (err.reason, err.detail or str(err))
            return
        except (KeyError, ValueError) as err:
            rec.failed[name] = ("malformed_evidence", f"attestation failed: {err}")
            return
        rec.failed.pop(name, None)
        self.our_until[name] = res.expires_at

    def answer(self, node: int) -> tuple[str | None, str | None]:
        """Our evidence for the node's outstanding nonce (spent here), or (None, why it failed)."""
        challenge = self.challenges.pop(node, None)
        if challenge is None:
            return None, None
        if self.attester is None:
            return None, ("the site verifies the coordinator but federation.attestation.coordinator.attester is "
                          "unset")
        try:
            return self.attester.attest(unb64url(challenge), self.seal_public).model_dump_json(), None
        except Exception as err:  # a TEE plug-in failing must not end the round
            return None, f"{type(err).__name__}: {err}"


class AdmissionRider:
    """Admission riding on one round's messages (see the module docstring)."""

    def __init__(self, adm: Admission, rnd: int, next_round: int | None, want: Callable[[int, str | None], bool],
                 names: Callable[[int], str | None], candidates: Callable[[], list[int]]):
        self.adm, self.rnd, self.next, self.want, self.names = adm, rnd, next_round, want, names
        self.candidates = candidates
        self.asked: dict[int, str] = {}  # node -> the nonce it was sent in this round
        self.answered: set[int] = set()
        self.failed: dict[str, tuple[str, str]] = {}

    def _wants_nonce(self, node: int) -> bool:
        return self.next is not None and node not in self.asked and node not in self.answered and \
            self.want(node, self.names(node))

    def records(self, node: int) -> dict:
        """Our evidence for the site's nonce, a nonce of ours when it is due for the next round."""
        rec: dict = {}
        evidence, failure = self.adm.answer(node)
        name = self.names(node)
        if evidence is not None:
            rec["evidence"] = evidence
        elif failure is not None and name is not None:
            code = "coordinator_not_attested" if self.adm.attester is None else "coordinator_attester_failed"
            self.adm.round(self.rnd).refused.setdefault(name, (code, failure))
        if self._wants_nonce(node):
            nonce = self.adm.gate.challenge(f"node:{node}").nonce
            self.asked[node] = nonce
            self.adm.round(self.next).asked.add(node)
            rec.update(nonce=nonce, round=self.next, answer_within_s=2 * self.adm.horizon_s + 60)
        return {keys.ATTEST: ConfigRecord(rec)} if rec else {}

    def wanted(self) -> list[int]:
        """Nodes due for the next round that have not been asked in this round."""
        return [n for n in self.candidates() if self._wants_nonce(n)]

    def take(self, node: int, reply: Message | None) -> None:
        """Appraise the site's evidence, keep its nonce, note whether it trusts us."""
        if reply is None or not reply.has_content():
            if node in self.asked and node not in self.answered:
                del self.asked[node]  # may be asked again by a later message of this round
            return
        content = reply.content
        status = content.config_records.get(keys.STATUS)
        name = self.names(node) or (str(status["site"]) if status is not None and "site" in status else None)
        if name is None:
            return
        rec = content.config_records.get(keys.ATTEST)
        if status is not None and not status.get("ok", False) and "coordinator_not_attested" in str(status.get("error")):
            self.adm.their_until.pop(name, None)
            self.adm.round(self.rnd).refused.setdefault(name, ("site_refused_coordinator", str(status.get("error"))))
        if rec is None:
            return
        if "trusted_until" in rec:
            self.adm.their_until[name] = float(rec["trusted_until"])
        if "appraisal_error" in rec:
            self.adm.their_until.pop(name, None)
        if "challenge" in rec:
            self.adm.challenges[node] = str(rec["challenge"])
        if node in self.asked and node not in self.answered and self.next is not None:
            # the reply to the message that carried our nonce; a later message of the round (the
            # unmask query) carries none, and its reply must not undo this one's appraisal
            self.answered.add(node)
            if "evidence" in rec:
                self.adm.appraise(self.next, node, name, str(rec["evidence"]))
            else:
                self.adm.round(self.next).attested.add(name)
                self.adm.our_until.pop(name, None)
                self.adm.round(self.next).failed[name] = ("no_evidence", str(rec.get("error") or "the site sent none"))

