"""End to end: site policies and the parties' audit logs over a real SuperLink, SuperNodes,
ClientApp processes and torchrun trainers, every party with its provisioned keys.

One SecAgg+ run of six digits sites, two rounds. Two sites take every round: `a` (the default
policy) and `m` (no policy; a site the coordinator's CA certified like any other, which stands
for an identity a dishonest coordinator minted). Four sites each refuse every round by one rule,
before any training or before the update leaves, and stay in the run:
  b  k = 6: the SecAgg+ group holds only five other sites      policy_secagg_group_too_small
  c  peers = a, b, d, e: the group holds m                        policy_unknown_peer
  d  codecs = int8: the round's codec is identity                 policy_codec
  e  DP-SGD planned at epsilon 8, its policy's most is 1          policy_dp_budget
The round's metrics name each refusal and count it by code; a and m are aggregated. Afterwards
every log verifies (`sovfl audit verify`, against the provisioned keys), and each site's log
agrees with the coordinator's (`sovfl audit compare`: the digests of a's and m's updates, every
witnessed head both ways).
"""

from __future__ import annotations

import json

import pytest

from conftest import simulate_ok
from federation.ops import launcher
from federation.ops.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=120)]

REFUSE = {"b": "policy_secagg_group_too_small", "c": "policy_unknown_peer", "d": "policy_codec",
          "e": "policy_dp_budget"}
POLICY = {"a": {}, "b": {"min_secagg_others": 6}, "c": {"peers": ["a", "b", "d", "e"]}, "d": {"codecs": ["int8"]},
          "e": {"max_epsilon": 1.0}}


def test_sites_refuse_rounds_by_rule_and_the_audit_logs_verify_and_agree(tmp_path, marker, monkeypatch, capsys):
    monkeypatch.setenv(launcher.MARKER, marker)
    sites = ["a", "m", "b", "c", "d", "e"]
    cfg = {
        "federation": {"name": "policy-e2e", "rounds": 2, "quorum": 2, "update_kind": "delta", "evaluate": False,
                       "deadlines": {"connect_s": 60, "round_s": 60, "secagg_stage_s": 30, "trainer_start_s": 150},
                       "secagg": {"enabled": True, "threshold": 2, "neighbours": 5, "clip": 1.0, "bits": 32}},
        "workload": {"task": "digits", "options": {"hidden": 8}},
        "sites": [{"id": s, "ranks": 1, "partition": i, "local_steps": 2, "batch_size": 16, "lr": 0.1,
                   **({"policy": POLICY[s]} if s in POLICY else {}),
                   **({"privacy": {"enabled": True, "epsilon": 8.0}} if s == "e" else {})}
                  for i, s in enumerate(sites)],
    }
    run = tmp_path / "run"
    log, lines = simulate_ok(cfg, run, insecure=True)
    assert [x["status"] for x in lines] == ["aggregated"] * 2, log
    for line in lines:
        assert sorted(line["sites"]) == ["a", "m"], log
        assert line["policy_refused"] == REFUSE, log
        for site, code in REFUSE.items():
            assert line["failed"][site].split("site_error: ", 1)[-1].startswith(code + ":"), line["failed"][site]
    assert "['m'] outside this site's peers" in lines[0]["failed"]["c"]
    assert "5 other site(s)" in lines[0]["failed"]["b"] and "at least 6" in lines[0]["failed"]["b"]
    assert lines[-1]["rejections"] == {f"policy:{code}": 2 for code in REFUSE.values()}

    pki = run / "pki"
    coord = run
    assert main(["audit", "verify", str(coord), "--bundle", str(pki / "sites" / "a")]) == 0
    for s in sites:
        assert main(["audit", "verify", str(run / "sites" / s), "--bundle", str(pki / "coordinator")]) == 0, s
    assert main(["audit", "compare", str(coord), *(str(run / "sites" / s) for s in sites)]) == 0, \
        capsys.readouterr().err
    page = tmp_path / "audit.md"
    assert main(["audit", "export", str(coord), *(str(run / "sites" / s) for s in sites), "-o", str(page)]) == 0
    text = page.read_text()
    assert "| b | 1 | refused: policy_secagg_group_too_small |" in text and "| a | 2 | accepted | `sha256:" in text
    site_a = [json.loads(x) for x in (run / "sites" / "a" / "audit.jsonl").read_text().splitlines()]
    sent = [e for e in site_a if e["kind"] == "update_sent"]
    assert [e["fields"]["round"] for e in sent] == [1, 2] and all(e["fields"]["digest"] for e in sent)
    assert any(e["kind"] == "witness" for e in site_a)
    site_e = [json.loads(x) for x in (run / "sites" / "e" / "audit.jsonl").read_text().splitlines()]
    refused = [e["fields"] for e in site_e if e["kind"] == "round_refused"]
    assert [f["code"] for f in refused] == ["policy_dp_budget"] * 2 and not any(
        e["kind"] == "update_sent" for e in site_e)
