"""End to end: site policies and the parties' audit logs over a real SuperLink, SuperNodes,
ClientApp processes and torchrun trainers, every party with its provisioned keys.

One SecAgg+ run of seven digits sites, two rounds. Two sites take every round: `a` (the default
policy) and `m` (no policy; a site the coordinator's CA certified like any other, which stands
for an identity a dishonest coordinator minted). Five sites each refuse every round by one rule and
stay in the run. Those that announce their policy at discovery (the default) sit each round out,
left out by the coordinator's forecast before anything is sent to them; d does not announce it and
refuses each train message itself before any training, e lets no update leave:
  b  k = 7: the SecAgg+ group holds only six other sites       policy_secagg_group_too_small
  c  peers = a, b, d, e, f: the group holds m                     policy_unknown_peer
  d  codecs = int8: the round's codec is identity                 policy_codec
  e  DP-SGD planned at epsilon 8, its policy's most is 1          policy_dp_budget
  f  require_attestation: the coordinator is not attested         policy_no_attestation
The round's metrics name each refusal and count it by code; a and m are aggregated. Afterwards
every log verifies (`sovfl audit verify`, against the provisioned keys), and each site's log
agrees with the coordinator's (`sovfl audit compare`: the digests of a's and m's updates, every
witnessed head both ways). The coordinator's operator exports the global model with its bundle,
and the export is recorded in its log, which still verifies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import simulate_ok
from federation.ops import launcher
from federation.ops.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=120)]

REFUSE = {"b": "policy_secagg_group_too_small", "c": "policy_unknown_peer", "d": "policy_codec",
          "e": "policy_dp_budget",
          "f": "policy_no_attestation"}
POLICY = {"a": {}, "b": {"min_secagg_others": 7}, "c": {"peers": ["a", "b", "d", "e", "f"]},
          "d": {"codecs": ["int8"], "announce": False}, "e": {"max_epsilon": 1.0}, "f": {"require_attestation": True}}


def test_sites_refuse_rounds_by_rule_and_the_audit_logs_verify_and_agree(tmp_path, marker, monkeypatch, capsys):
    monkeypatch.setenv(launcher.MARKER, marker)
    sites = ["a", "m", "b", "c", "d", "e", "f"]
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
    assert "6 other site(s)" in lines[0]["failed"]["b"] and "at least 7" in lines[0]["failed"]["b"]
    assert lines[-1]["rejections"] == {f"policy:{code}": 2 for code in REFUSE.values()}

    pki = run / "pki"
    coord = run
    assert main(["export", str(run), "--out", str(tmp_path / "unrecorded")]) == 0
    assert "not recorded in the run's audit log" in capsys.readouterr().err
    assert main(["export", str(run), "--out", str(tmp_path / "wrong"), "--bundle", str(pki / "sites" / "a")]) == 1
    assert "is not a coordinator bundle" in capsys.readouterr().err and not (tmp_path / "wrong").exists()
    assert main(["export", str(run), "--out", str(tmp_path / "model"), "--bundle", str(pki / "coordinator")]) == 0
    exported = [json.loads(x) for x in (run / "audit.jsonl").read_text().splitlines() if '"exported"' in x]
    assert len(exported) == 1 and exported[0]["fields"]["round"] == 2, exported
    files = exported[0]["fields"]["files"]
    assert [Path(f).name for f in files] == ["model.safetensors"]
    assert all(d.startswith("sha256:") for d in files.values())
    assert exported[0]["fields"]["checkpoint_digest"].startswith("sha256:")
    assert main(["audit", "verify", str(coord), "--bundle", str(pki / "sites" / "a")]) == 0
    for s in sites:
        assert main(["audit", "verify", str(run / "sites" / s), "--bundle", str(pki / "coordinator")]) == 0, s
    assert main(["audit", "compare", str(coord), *(str(run / "sites" / s) for s in sites)]) == 0, \
        capsys.readouterr().err
    page = tmp_path / "audit.md"
    assert main(["audit", "export", str(coord), *(str(run / "sites" / s) for s in sites), "-o", str(page)]) == 0
    text = page.read_text()
    assert "| d | 1 | refused: policy_codec |" in text
    assert "| b | 1 | sat out: policy_secagg_group_too_small |" in text and "| a | 2 | accepted | `sha256:" in text
    site_a = [json.loads(x) for x in (run / "sites" / "a" / "audit.jsonl").read_text().splitlines()]
    sent = [e for e in site_a if e["kind"] == "update_sent"]
    assert [e["fields"]["round"] for e in sent] == [1, 2] and all(e["fields"]["digest"] for e in sent)
    assert any(e["kind"] == "witness" for e in site_a)
    site_e = [json.loads(x) for x in (run / "sites" / "e" / "audit.jsonl").read_text().splitlines()]
    refused = [e["fields"] for e in site_e if e["kind"] == "round_refused"]
    assert [f["code"] for f in refused] == ["policy_dp_budget"] * 2 and not any(
        e["kind"] == "update_sent" for e in site_e)
    # d refused each train message itself; b, c and f were never sent one: the coordinator said why
    site_d = [json.loads(x) for x in (run / "sites" / "d" / "audit.jsonl").read_text().splitlines()]
    assert [e["fields"]["code"] for e in site_d if e["kind"] == "round_refused"] == ["policy_codec"] * 2
    for s in ("b", "c", "f"):
        site_log = (run / "sites" / s / "audit.jsonl").read_text()
        assert '"round_refused"' not in site_log and '"round_accepted"' not in site_log, s
        assert f"round 1: site {s} sits out: its announced policy refuses the round: {REFUSE[s]}:" in log, log
        assert "(forecast from the policy it announced" in lines[0]["failed"][s]


def test_a_site_refuses_a_weights_round_by_reply_and_the_others_send_their_weights_sealed(tmp_path, marker,
                                                                                           monkeypatch):
    """`w` keeps its default policy (deltas only) to itself: it refuses the weights round by reply,
    before any training; `x` and `y` allow weights and send them sealed."""
    monkeypatch.setenv(launcher.MARKER, marker)
    policies = {"w": {"announce": False}, "x": {"deltas_only": False}, "y": {"deltas_only": False}}
    cfg = {
        "federation": {"name": "policy-weights", "rounds": 1, "quorum": 2, "update_kind": "weights", "seal": True,
                       "evaluate": False,
                       "deadlines": {"connect_s": 60, "round_s": 60, "trainer_start_s": 150}},
        "workload": {"task": "digits", "options": {"hidden": 8}},
        "sites": [{"id": s, "ranks": 1, "partition": i, "local_steps": 2, "batch_size": 16, "lr": 0.1,
                   "policy": policies[s]} for i, s in enumerate(policies)],
    }
    run = tmp_path / "run"
    log, lines = simulate_ok(cfg, run, insecure=True)
    assert [x["status"] for x in lines] == ["aggregated"], log
    assert sorted(lines[0]["sites"]) == ["x", "y"], log
    assert lines[0]["failed"]["w"].split("site_error: ", 1)[-1].startswith("policy_weights_update:"), lines[0]
    assert lines[0]["policy_refused"] == {"w": "policy_weights_update"}
    site_w = [json.loads(x) for x in (run / "sites" / "w" / "audit.jsonl").read_text().splitlines()]
    assert [e["fields"]["code"] for e in site_w if e["kind"] == "round_refused"] == ["policy_weights_update"]
    assert not any(e["kind"] in ("update_sent", "round_accepted") for e in site_w)
    assert main(["audit", "compare", str(run), *(str(run / "sites" / s) for s in policies)]) == 0
