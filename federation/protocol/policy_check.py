"""A site's policy (site_trainer/policy_config.py) held against a round: pure functions, one reason
code per rule. `check_round` runs on a train message before any training; `check_update` on the
trainer's figures before the update leaves. Each raises `PolicyRefused` naming the rule broken;
the policy mod turns it into a failure reply that the coordinator counts as `policy:<code>`.
The coordinator runs `check_round` too, on the policies sites announce, to leave out of a round
a site that would refuse it (coordinator/policy_forecast.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from federation.protocol.round_config import RoundConfig
from federation.protocol.site_terms import RoundTerms
from site_trainer.policy_config import SitePolicy


class PolicyRefused(Exception):
    """The round breaks a rule of the site's policy; `code` names the rule."""

    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code, self.detail = code, detail


@dataclass(frozen=True)
class Identity:
    """What the site's own bundle says about the federation: its CA's and coordinator's
    fingerprints, and each registered site's signing-key fingerprint (empty without a bundle)."""

    ca: str | None = None
    coordinator_key: str | None = None
    site_keys: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Usage:
    """What this site sent so far in this run."""

    rounds: int = 0
    bytes: int = 0


def _codec_stages(spec: str) -> list[str]:
    return [stage.split(":", 1)[0] for stage in spec.split("+") if stage]


def check_round(policy: SitePolicy, site: str, cfg: RoundConfig, terms: RoundTerms | None, identity: Identity,
                attested: bool, usage: Usage) -> None:
    """Refuse round `cfg` (with its `terms`) when it breaks `policy` (PolicyRefused); `attested`:
    whether this site holds a current attestation of the coordinator."""
    if terms is None:
        raise PolicyRefused("policy_no_terms", "the train message does not say the round's group and settings; "
                                               "this site's policy cannot be checked (enable federation.audit)")
    if policy.federation_ca and identity.ca != policy.federation_ca:
        raise PolicyRefused("policy_wrong_federation", f"this site's bundle is of CA {identity.ca}, not the "
                                                       f"federation's {policy.federation_ca}")
    if policy.coordinator_key and identity.coordinator_key != policy.coordinator_key:
        raise PolicyRefused("policy_wrong_federation", f"the coordinator's key is {identity.coordinator_key}, "
                                                       f"not {policy.coordinator_key}")
    others = sorted(set(terms.group) - {site})
    if policy.peers is not None:
        allowed = set(policy.peers)
        unknown = [n for n in others if n not in allowed and identity.site_keys.get(n) not in allowed]
        if unknown:
            raise PolicyRefused("policy_unknown_peer", f"the round's group holds site(s) {unknown} outside this "
                                                       "site's peers")
    if terms.secagg and len(others) < policy.min_secagg_others:
        raise PolicyRefused("policy_secagg_group_too_small", f"the SecAgg+ round sums this site's update with "
                                                             f"{len(others)} other site(s) {others}; this site needs "
                                                             f"at least {policy.min_secagg_others}")
    wanted = {"secagg_or_seal": terms.secagg or cfg.seal, "secagg": terms.secagg, "seal": cfg.seal and not terms.secagg,
              "any": True}[policy.protection]
    if not wanted:
        how = "masked" if terms.secagg else "sealed" if cfg.seal else "neither masked nor sealed"
        raise PolicyRefused("policy_unprotected", f"the update would leave {how}; this site requires protection "
                                                  f"{policy.protection}")
    if policy.require_attestation and not attested:
        raise PolicyRefused("policy_no_attestation", "this site releases updates only to a coordinator it attested, "
                                                     "and holds no current attestation of it")
    if policy.deltas_only and cfg.update_kind != "delta":
        raise PolicyRefused("policy_weights_update", f"the round asks for {cfg.update_kind}; this site sends deltas "
                                                     "only")
    if policy.codecs is not None and cfg.codec not in policy.codecs and not all(
            s in policy.codecs for s in _codec_stages(cfg.codec)):
        raise PolicyRefused("policy_codec", f"codec {cfg.codec!r} is not among this site's codecs {policy.codecs}")
    if policy.strategies is not None and terms.strategy not in policy.strategies:
        raise PolicyRefused("policy_strategy", f"strategy {terms.strategy!r} is not among this site's strategies "
                                               f"{policy.strategies}")
    if policy.max_rounds is not None and usage.rounds >= policy.max_rounds:
        raise PolicyRefused("policy_max_rounds", f"this site already sent {usage.rounds} update(s) in this run, its "
                                                 f"most is {policy.max_rounds}")


def check_update(policy: SitePolicy, metrics: Mapping[str, float], usage: Usage) -> None:
    """Refuse to let an update leave when the trainer's figures break `policy` (PolicyRefused)."""
    budget = metrics.get("dp_epsilon_budget", metrics.get("dp_epsilon"))
    if policy.require_dp and budget is None:
        raise PolicyRefused("policy_dp_required", "the update was not trained under DP-SGD; this site sends only "
                                                  "DP updates (sites[].privacy)")
    if policy.max_epsilon is not None and budget is not None and float(budget) > policy.max_epsilon:
        raise PolicyRefused("policy_dp_budget", f"the run's privacy budget epsilon={float(budget):g} is above this "
                                                f"site's most {policy.max_epsilon:g}")
    size = int(metrics.get("upload_bytes", 0))
    if policy.max_bytes is not None and usage.bytes + size > policy.max_bytes:
        raise PolicyRefused("policy_max_bytes", f"this update ({size} bytes) would bring what this site sent in "
                                                f"this run to {usage.bytes + size} bytes, above its most "
                                                f"{policy.max_bytes}")
