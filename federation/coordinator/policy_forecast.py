"""The sites' announced policies, planned around: a site that told its policy at discovery
(`sites[].policy.announce`) sits out a round its own check would refuse, and the round says why
before anything is sent to it.

The rules are the site's own (protocol/policy_check.py), run here on what the coordinator knows
for sure; the site still checks every message itself, so this is a forecast, never its decision.
A rule is forecast only where the coordinator cannot be wrong against the site: its view of the
federation (the CA and the coordinator's key its bundle holds, the registered sites' keys), the
round's group, protection, update kind, codec and strategy, the rounds it already aggregated from
the site (the site counts at least these), and attestation when the run has none (then the site
holds no attestation of the coordinator). The DP budget and the bytes sent are the site's to judge.

Under SecAgg+ a site's k counts the sites actually summed with it: a site that sits out adds
nothing to the sum, so sitting one out can break another's k or peer list, and the forecast
repeats until no further site sits out. A site that sits out is named in the round's `failed`
with its rule's code (`policy_<rule>: ... (forecast ...)`), which the audit log counts as a
refusal like the site's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flwr.app import ConfigRecord
from pydantic import ValidationError

from crypto.pki import CoordinatorBundle
from crypto.pki.keys import cert_fingerprint, load_cert, public_key_fingerprint
from federation.config.schema import ExperimentConfig
from federation.coordinator.round_hooks import RoundHook
from federation.coordinator.roster import Roster
from federation.coordinator.strategy import RoundOutcome
from federation.protocol import message_keys as keys
from federation.protocol.policy_check import Identity, PolicyRefused, Usage, check_round
from federation.protocol.round_config import RoundConfig
from federation.protocol.site_terms import RoundTerms
from site_trainer.policy_config import SitePolicy

log = logging.getLogger("sovfl.coordinator")


def coordinator_identity(bundle: CoordinatorBundle | None) -> Identity:
    """The federation as the coordinator's own bundle knows it (what an honest site's holds too)."""
    if bundle is None:
        return Identity()
    sites = {n: public_key_fingerprint(r.sign_public) for n, r in bundle.trust().parties.items() if r.role == "site"}
    return Identity(cert_fingerprint(load_cert(bundle.ca_cert)), public_key_fingerprint(bundle.sign_key.public_key()),
                    sites)


def announced(status: ConfigRecord) -> SitePolicy | None:
    """The policy a discovery reply announces (None: none, or one that does not parse)."""
    text = status.get(keys.POLICY)
    if not isinstance(text, str) or not text:
        return None
    try:
        return SitePolicy.model_validate_json(text)
    except ValidationError as err:
        log.warning("a site announced a policy that does not parse (%s); its rounds are not forecast",
                    str(err).splitlines()[0])
        return None


def forecast(policies: dict[str, SitePolicy], cfg: RoundConfig, terms: RoundTerms, identity: Identity,
             attested: bool, sent: Callable[[str], int]) -> dict[str, PolicyRefused]:
    """site -> the refusal its policy makes of the round (`terms.group` less the sites that sit
    out, repeated until none more does); `sent(site)`: rounds it already sent an update in."""
    out: dict[str, PolicyRefused] = {}
    while True:
        left = sorted(set(terms.group) - set(out))
        newly = {}
        for site in left:
            if site not in policies:
                continue
            try:
                check_round(policies[site], site, cfg, RoundTerms(terms.run, terms.round, terms.rounds, terms.strategy,
                                                                  terms.secagg, left),
                            identity, attested, Usage(rounds=sent(site)))
            except PolicyRefused as err:
                newly[site] = err
        if not newly:
            return out
        out.update(newly)


class PolicyForecastHook(RoundHook):
    """Leaves out of each round the sites whose announced policy refuses it (after the round's
    codec is chosen), and names them in the round's failures."""

    def __init__(self, cfg: ExperimentConfig, roster: Roster, run_id: int, identity: Identity,
                 codec: Callable[[int], str], sent: Callable[[str], int], progress: Callable[[str], None]):
        self.fed, self.roster, self.run_id, self.identity = cfg.federation, roster, run_id, identity
        self.codec, self.sent, self.progress = codec, sent, progress
        self.policies: dict[str, SitePolicy] = {}
        self.sat_out: dict[str, str] = {}

    def enrolled(self, node: int, site: str, status: ConfigRecord) -> None:
        """Keep the policy the site announced (a later discovery's replaces it)."""
        policy = announced(status)
        if policy is None:
            self.policies.pop(site, None)
        else:
            self.policies[site] = policy

    def before_round(self, rnd: int, nodes: list[int], timing: dict) -> list[int]:
        """The round goes on without the sites whose policy refuses it."""
        self.sat_out = {}
        names = {n: self.roster.site_name(n) for n in nodes}
        if not any(name in self.policies for name in names.values()):
            return nodes
        fed = self.fed
        cfg = RoundConfig(round=rnd, federation=fed.name, update_kind=fed.update_kind, codec=self.codec(rnd),
                          seal=fed.seal)
        terms = RoundTerms(self.run_id, rnd, fed.rounds, fed.strategy, fed.secagg.enabled, sorted(names.values()))
        refused = forecast(self.policies, cfg, terms, self.identity, fed.attestation.enabled, self.sent)
        for site, err in refused.items():
            self.sat_out[site] = (f"{err.code}: {err.detail} (forecast from the policy it announced; it sits the "
                                  "round out)")
            self.progress(f"round {rnd}: site {site} sits out: its announced policy refuses the round: {err}")
        return [n for n in nodes if names[n] not in refused]

    def after_round(self, rnd: int, out: RoundOutcome, timing: dict, rejections) -> None:
        """The sites that sat out, each with its rule's code."""
        out.failed.update(self.sat_out)
        self.sat_out = {}
