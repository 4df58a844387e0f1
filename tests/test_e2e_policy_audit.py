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

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=240)]

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
    # its data snapshot: at discovery and in the first round its trainer answered, never on the wire
    snaps = {s: [e["fields"] for e in (json.loads(x) for x in (run / "sites" / s / "audit.jsonl").read_text()
                                       .splitlines()) if e["kind"] == "data_snapshot"] for s in ("a", "m")}
    for s, found in snaps.items():
        assert [f.get("round") for f in found] == [None, 1], found
        assert {f["digest"] for f in found} == {found[0]["digest"]} and len(found[0]["digest"]) == 64, found
        assert found[0]["method"] == "tensors" and found[0]["examples"] > 0 < found[0]["val_examples"], found
        assert found[0]["digest"] not in (run / "metrics.jsonl").read_text() + (run / "audit.jsonl").read_text()
    assert snaps["a"][0]["digest"] != snaps["m"][0]["digest"]  # two partitions of the images
    assert f"| a | discovery | `{snaps['a'][0]['digest']}` | tensors |" in text
    assert f"| m | round 1 | `{snaps['m'][0]['digest']}` | tensors |" in text
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


def test_a_site_sits_out_until_a_third_site_joins_then_takes_part(tmp_path, marker):
    """Deployed parties (`sovfl coordinator`, `sovfl site`, each with its provisioned bundle) under
    SecAgg+; every site's policy wants its update summed with at least two others (b says so, a
    and c keep the default policy). Round 1 has only a and b: b would be summed with one other, so
    it sits the round out by name, which leaves a with none: a sits out too, and the round is
    skipped. c's site starts while the coordinator holds
    after round 1; round 2 asks it who it is before its first stage, and a, b and c are aggregated."""
    import os
    import select
    import shutil
    import subprocess
    import sys
    import tempfile
    import time

    from conftest import ROOT, sovfl_popen, write_config
    from faults import output_of, release_stage, stage_hook_env, supernode_starts, wait_for_stage, wait_gone
    from federation.ops.launcher import free_port

    env = {**os.environ, "SOVFL_RUN_MARKER": marker, "FLWR_TELEMETRY_ENABLED": "0"}
    path = write_config(tmp_path / "late.yaml", {
        "federation": {"name": "policy-late", "rounds": 2, "quorum": 2, "update_kind": "delta", "evaluate": False,
                       "deadlines": {"connect_s": 60, "round_s": 60, "secagg_stage_s": 30, "trainer_start_s": 150},
                       "secagg": {"enabled": True, "threshold": 2, "neighbours": 2, "clip": 1.0, "bits": 32}},
        "workload": {"task": "digits", "options": {"hidden": 8}},
        "sites": [{"id": s, "ranks": 1, "partition": i, "local_steps": 2, "batch_size": 16, "lr": 0.1,
                   "policy": {"min_secagg_others": 2} if s == "b" else {}} for i, s in enumerate("abc")],
    })
    pki, port, coord_dir, hook = tmp_path / "pki", free_port(), tmp_path / "coord", tmp_path / "stages.jsonl"
    prov = subprocess.run([sys.executable, "-m", "federation.ops.cli", "provision", str(pki), "--site", "a",
                           "--site", "b", "--site", "c"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert prov.returncode == 0, prov.stderr

    sockets = Path(tempfile.mkdtemp(prefix="sovfl-late-"))  # a unix socket's path is short

    def site(name: str) -> subprocess.Popen:
        return sovfl_popen("site", str(path), "--site", name, "--superlink", f"127.0.0.1:{port}", "--workdir",
                           str(tmp_path / name), "--bundle", str(pki / "sites" / name), "--socket",
                           str(sockets / f"{name}.sock"), env=env)

    def wait_ready(name: str, proc: subprocess.Popen) -> None:  # its trainer serves: its SuperNode comes next
        end = time.monotonic() + 300
        while not (sockets / f"{name}.sock.ready").exists():
            assert time.monotonic() < end and proc.poll() is None, output_of(proc)
            time.sleep(0.2)

    # the coordinator first: a SuperNode that asks before the coordinator registered the sites' keys
    # is refused, and its restart waits out the key's hold (federation/ops/site_supervisor.py)
    coord = sovfl_popen("coordinator", str(path), "--host", "127.0.0.1", "--port", str(port), "--workdir",
                        str(coord_dir), "--bundle", str(pki / "coordinator"),
                        env={**env, **stage_hook_env(hook, "1:checkpoint")})
    procs = [coord]
    try:
        # the sites' keys are registered once it says this; read from the pipe itself, so that
        # select sees every byte (a buffered readline may hold the line select waits for)
        end, seen, fd = time.monotonic() + 300, "", coord.stdout.fileno()
        while "waiting for 3 site(s)" not in seen:
            assert time.monotonic() < end and coord.poll() is None, seen + output_of(coord)
            if select.select([fd], [], [], 1.0)[0]:
                seen += os.read(fd, 1 << 16).decode(errors="replace")
        procs += [site("a"), site("b")]
        try:
            wait_for_stage(hook, 1, "checkpoint", lambda: coord.poll() is None)
        except AssertionError as err:
            for p in procs[1:]:
                p.terminate()
            raise AssertionError(f"{err}\n{output_of(coord)}\n" + "\n".join(output_of(p) for p in procs[1:])) from None
        procs.append(site("c"))
        wait_ready("c", procs[-1])
        end = time.monotonic() + 120
        while supernode_starts(tmp_path / "c", "c") < 1:
            assert time.monotonic() < end and procs[-1].poll() is None, output_of(procs[-1])
            time.sleep(0.2)
        release_stage(hook)
        out, _ = coord.communicate(timeout=400)
        assert coord.returncode == 0 and "finished: ok" in out, out
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(sockets, ignore_errors=True)
    assert wait_gone(marker) == []
    lines = [json.loads(x) for x in (coord_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["status"] for x in lines] == ["skipped", "aggregated"], out
    code = "policy_secagg_group_too_small"
    assert lines[0]["policy_refused"] == {"a": code, "b": code}, lines[0]
    assert "1 other site(s)" in lines[0]["failed"]["b"] and "at least 2" in lines[0]["failed"]["b"], lines[0]
    assert sorted(lines[1]["sites"]) == ["a", "b", "c"] and not lines[1].get("policy_refused"), lines[1]
    assert "round 1: site b sits out: its announced policy refuses the round: " + code in out, out
    site_b = [json.loads(x) for x in (tmp_path / "b" / "audit.jsonl").read_text().splitlines()]
    accepted = [e["fields"] for e in site_b if e["kind"] == "round_accepted"]
    assert [f["round"] for f in accepted] == [2] and sorted(accepted[0]["group"]) == ["a", "b", "c"], accepted
    assert [e["fields"]["round"] for e in site_b if e["kind"] == "update_sent"] == [2]
    assert main(["audit", "compare", str(coord_dir), *(str(tmp_path / s) for s in "abc")]) == 0
    page = tmp_path / "audit.md"
    assert main(["audit", "export", str(coord_dir), *(str(tmp_path / s) for s in "abc"), "-o", str(page)]) == 0
    text = page.read_text()
    for s in "ab":
        assert f"| {s} | 1 | sat out: {code} |" in text and f"| {s} | 2 | accepted | `sha256:" in text, text
    assert "| c | 2 | accepted | `sha256:" in text and "| c | 1 |" not in text, text
