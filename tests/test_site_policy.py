"""The site policy's rules (federation/protocol/policy_check.py) against round configs and terms as the
coordinator builds them (round_messages.RoundMessages.config, RoundTerms): each rule refuses by its
own reason code, and a round inside every rule is taken."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from federation.config.schema import ExperimentConfig
from federation.protocol.round_config import RoundConfig
from federation.protocol.site_terms import RoundTerms
from federation.protocol.policy_check import Identity, PolicyRefused, Usage, check_round, check_update
from site_trainer.policy_config import SitePolicy

FP = "sha256:" + "ab" * 32


def _cfg(**fed) -> RoundConfig:
    """Round 1's config from a validated federation config, the way the coordinator sends it."""
    cfg = ExperimentConfig.model_validate({"federation": {"name": "pol", **fed},
                                           "sites": [{"id": s, "partition": i} for i, s in enumerate("abc")]})
    f = cfg.federation
    return RoundConfig(round=1, federation=f.name, update_kind=f.update_kind, codec=f.codec, seal=f.seal)


def _terms(group=("a", "b", "c"), secagg=True, strategy="fedavg") -> RoundTerms:
    return RoundTerms.from_record(RoundTerms(9, 1, 3, strategy, secagg, list(group)).to_record())


def _code(policy: SitePolicy, cfg: RoundConfig, terms: RoundTerms | None, attested=False, usage=Usage(),
          identity=Identity(site_keys={"m": FP})) -> str | None:
    try:
        check_round(policy, "a", cfg, terms, identity, attested, usage)
    except PolicyRefused as err:
        assert err.detail and str(err).startswith(err.code + ": ")
        return err.code
    return None


def test_defaults_take_a_protected_delta_round_and_refuse_what_exposes_the_update():
    p = SitePolicy()
    assert _code(p, _cfg(), _terms()) is None  # SecAgg+ with two others
    assert _code(p, _cfg(seal=True), _terms(secagg=False)) is None
    assert _code(p, _cfg(), _terms(secagg=False)) == "policy_unprotected"
    assert _code(p, _cfg(update_kind="weights"), _terms()) == "policy_weights_update"
    assert _code(p, _cfg(), _terms(group=("a", "b"))) == "policy_secagg_group_too_small"
    assert _code(p, _cfg(), None) == "policy_no_terms"


def test_k_counts_the_other_sites_of_the_secagg_group():
    p = SitePolicy(min_secagg_others=2)
    with pytest.raises(PolicyRefused, match=r"1 other site\(s\) \['b'\]; this site needs at least 2"):
        check_round(p, "a", _cfg(), _terms(group=("a", "b")), Identity(), False, Usage())
    assert _code(p, _cfg(), _terms(group=("a", "b", "c"))) is None  # a third joins


def test_peers_by_name_or_key_fingerprint():
    assert _code(SitePolicy(peers=["b", "c"]), _cfg(), _terms(group=("a", "b", "c"))) is None
    assert _code(SitePolicy(peers=["b", "c"]), _cfg(), _terms(group=("a", "b", "m"))) == "policy_unknown_peer"
    assert _code(SitePolicy(peers=["b", FP]), _cfg(), _terms(group=("a", "b", "m"))) is None


def test_attestation_codecs_strategies_rounds_and_federation():
    assert _code(SitePolicy(require_attestation=True), _cfg(), _terms()) == "policy_no_attestation"
    assert _code(SitePolicy(require_attestation=True), _cfg(), _terms(), attested=True) is None
    assert _code(SitePolicy(codecs=["int8"]), _cfg(), _terms()) == "policy_codec"
    assert _code(SitePolicy(codecs=["identity"]), _cfg(), _terms()) is None
    assert _code(SitePolicy(codecs=["topk", "int8"]), _cfg(codec="topk:0.1+int8"), _terms()) is None
    assert _code(SitePolicy(codecs=["topk"]), _cfg(codec="topk:0.1+int8"), _terms()) == "policy_codec"
    assert _code(SitePolicy(strategies=["fedavg"]), _cfg(), _terms(strategy="fedadam")) == "policy_strategy"
    assert _code(SitePolicy(max_rounds=2), _cfg(), _terms(), usage=Usage(rounds=2)) == "policy_max_rounds"
    assert _code(SitePolicy(max_rounds=2), _cfg(), _terms(), usage=Usage(rounds=1)) is None
    assert _code(SitePolicy(federation_ca=FP), _cfg(), _terms(), identity=Identity(ca="sha256:" + "cd" * 32)) == \
        "policy_wrong_federation"


def test_updates_checked_before_they_leave():
    def code(policy, metrics, usage=Usage()):
        try:
            check_update(policy, metrics, usage)
        except PolicyRefused as err:
            return err.code
        return None
    dp = {"dp_epsilon": 0.4, "dp_epsilon_budget": 8.0, "upload_bytes": 100.0}
    assert code(SitePolicy(require_dp=True), {"upload_bytes": 1.0}) == "policy_dp_required"
    assert code(SitePolicy(max_epsilon=1.0), dp) == "policy_dp_budget"
    assert code(SitePolicy(max_epsilon=8.0, require_dp=True), dp) is None
    assert code(SitePolicy(max_bytes=150), dp, Usage(1, 100)) == "policy_max_bytes"
    assert code(SitePolicy(max_bytes=200), dp, Usage(1, 100)) is None


def test_a_policy_in_the_site_config_is_validated():
    site = {"id": "a", "partition": 0, "policy": {"min_secagg_others": 3, "codecs": ["identity"]}}
    cfg = ExperimentConfig.model_validate({"sites": [site]})
    assert cfg.sites[0].policy.min_secagg_others == 3 and cfg.sites[0].policy.deltas_only
    with pytest.raises(ValidationError, match="min_secagg_others"):
        ExperimentConfig.model_validate({"sites": [{**site, "policy": {"min_secagg_others": 0}}]})
    with pytest.raises(ValidationError, match="extra"):
        ExperimentConfig.model_validate({"sites": [{**site, "policy": {"allow_everything": True}}]})
