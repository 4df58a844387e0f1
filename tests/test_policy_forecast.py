"""The coordinator's forecast of the sites' announced policies (federation/coordinator/policy_forecast.py):
the site's own rules on what the coordinator knows for sure, a site that sits out leaves the group
of the others' checks, a site that would take the round is never left out, and the announcement
travels in the discovery reply as the site's mod writes it."""

from __future__ import annotations

from types import SimpleNamespace

from flwr.app import ConfigRecord

from federation.config.schema import ExperimentConfig
from federation.coordinator.policy_forecast import PolicyForecastHook, announced, forecast
from federation.coordinator.strategy import RoundOutcome
from federation.protocol import message_keys as keys
from federation.protocol.policy_check import Identity
from federation.protocol.round_config import RoundConfig
from federation.protocol.site_terms import RoundTerms
from federation.site.policy_mod import announcement
from site_trainer.policy_config import SitePolicy

CFG = RoundConfig(round=1, federation="f", update_kind="delta", codec="int8")


def _terms(group, secagg=True) -> RoundTerms:
    return RoundTerms(1, 1, 3, "fedavg", secagg, sorted(group))


def _forecast(policies, group, cfg=CFG, secagg=True, attested=False, sent=lambda s: 0):
    return {s: e.code for s, e in forecast(policies, cfg, _terms(group, secagg), Identity(), attested, sent).items()}


def test_k_sits_a_site_out_until_a_third_joins():
    policies = {"a": SitePolicy(min_secagg_others=2)}
    assert _forecast(policies, "ab") == {"a": "policy_secagg_group_too_small"}
    assert _forecast(policies, "abc") == {}  # a third joined: a takes part again


def test_one_site_sitting_out_can_break_another_s_k_and_the_forecast_repeats():
    policies = {"a": SitePolicy(min_secagg_others=2), "b": SitePolicy(codecs=["identity"])}
    # b refuses the int8 codec; without b, a is summed with c alone
    assert _forecast(policies, "abc") == {"b": "policy_codec", "a": "policy_secagg_group_too_small"}
    assert _forecast(policies, "abcd") == {"b": "policy_codec"}


def test_peers_protection_update_kind_strategy_and_attestation():
    assert _forecast({"a": SitePolicy(peers=["b"])}, "abc") == {"a": "policy_unknown_peer"}
    assert _forecast({"a": SitePolicy(peers=["b", "c"])}, "abc") == {}
    assert _forecast({"a": SitePolicy()}, "abc", secagg=False) == {"a": "policy_unprotected"}
    assert _forecast({"a": SitePolicy()}, "abc", cfg=CFG.model_copy(update={"update_kind": "weights"})) == {
        "a": "policy_weights_update"}
    assert _forecast({"a": SitePolicy(strategies=["diloco"])}, "abc") == {"a": "policy_strategy"}
    # the run has no attestation: the site holds none; with attestation on the site is not left out
    assert _forecast({"a": SitePolicy(require_attestation=True)}, "abc") == {"a": "policy_no_attestation"}
    assert _forecast({"a": SitePolicy(require_attestation=True)}, "abc", attested=True) == {}


def test_rounds_already_sent_and_what_only_the_site_judges():
    policy = {"a": SitePolicy(max_rounds=2, max_epsilon=1.0, max_bytes=10)}
    assert _forecast(policy, "abc", sent=lambda s: 1) == {}
    assert _forecast(policy, "abc", sent=lambda s: 2) == {"a": "policy_max_rounds"}


class _Env:
    def __init__(self, policy):
        self.policy = policy


def test_the_announcement_is_the_site_s_policy_unless_it_keeps_it_to_itself():
    policy = SitePolicy(min_secagg_others=3, codecs=["int8"])
    status = ConfigRecord(announcement(_Env(policy)))
    assert announced(status) == policy
    assert announcement(_Env(SitePolicy(announce=False))) == {} and announcement(_Env(None)) == {}
    assert announced(ConfigRecord({keys.POLICY: '{"min_secagg_others": "many"}'})) is None
    assert announced(ConfigRecord({})) is None


def test_the_hook_leaves_out_the_refusing_sites_and_names_them_in_the_round():
    cfg = ExperimentConfig.model_validate({
        "federation": {"name": "f", "secagg": {"enabled": True}, "update_kind": "delta"},
        "sites": [{"id": s, "partition": i} for i, s in enumerate("abc")]})
    names = {1: "a", 2: "b", 3: "c"}
    roster = SimpleNamespace(site_name=names.__getitem__)
    said: list[str] = []
    hook = PolicyForecastHook(cfg, roster, 7, Identity(), lambda rnd: "int8", lambda s: 0, said.append)
    hook.enrolled(2, "b", ConfigRecord(announcement(_Env(SitePolicy(codecs=["identity"])))))
    hook.enrolled(3, "c", ConfigRecord(announcement(_Env(SitePolicy(codecs=["int8"], announce=False)))))
    assert hook.before_round(1, [1, 2, 3], {}) == [1, 3]
    out = RoundOutcome(None, 0)
    hook.after_round(1, out, {}, None)
    assert list(out.failed) == ["b"] and out.failed["b"].startswith("policy_codec: ")
    assert said == ["round 1: site b sits out: its announced policy refuses the round: policy_codec: codec 'int8' "
                    "is not among this site's codecs ['identity']"]
    # b announces again at a later discovery, now taking int8: nobody sits out
    hook.enrolled(2, "b", ConfigRecord(announcement(_Env(SitePolicy(codecs=["int8"])))))
    assert hook.before_round(2, [1, 2, 3], {}) == [1, 2, 3]
    out = RoundOutcome(None, 0)
    hook.after_round(2, out, {}, None)
    assert out.failed == {}
