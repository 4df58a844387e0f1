"""End to end: attested admission in both directions, and a wire audit of sealed updates, over a
real federation (provisioned keys, a SuperLink, SuperNodes, ClientApp processes, torchrun trainers).

Four sites, two rounds, TLS switched off and every byte between the sites and the SuperLink
recorded by a proxy, so the test sees what TLS would hide. Attestation tokens come from a local
test issuer (`dev_issuer`), signed and appraised exactly as an attestation service's would be:
  a, b  pass, and are re-attested in round 2 because their results would lapse during it
  c     presents a measurement the coordinator's policy does not allowlist: not admitted
  d     appraises the coordinator with a policy its measurement fails: refuses to send its update
Rounds complete with a and b; the log and metrics name c and d and why. Updates are sealed to the
coordinator's attested key: none of a's or b's plaintext update bytes cross the wire, while the
global model (public to the federation, unsealed downlink) does, which shows the capture works.

The second test runs the hardware verifiers' formats end to end: the coordinator attests with
`amd-sev-snp` evidence (a raw report from a fake /dev/sev-guest, signed by a TEST ARK -> ASK -> VCEK
chain in AMD's formats, binding its sealing key) and the sites with `nvidia-nras` results from a
test NRAS issuer; site c's GPU token says debug is on, and c is left out by name; site d's policy
allowlists another launch measurement than the coordinator's report carries, so d refuses it.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_weighted_mean_rounds, live_marked, write_config
from federation.ops import launcher
from crypto.attestation.snp_testing import TestAmdChain
from crypto.attestation.testing import NrasTestIssuer
from federation.coordinator.checkpoint import load_checkpoint
from wiretap import WireTap, found, windows

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=140)]

BAD = "bb" * 48


def test_attested_admission_and_sealed_wire_audit(tmp_path, marker, monkeypatch):
    cfg = {
        "federation": {
            "name": "attested", "rounds": 2, "quorum": 2, "update_kind": "weights", "seal": True,
            "deadlines": {"connect_s": 60, "round_s": 30, "evaluate_s": 20, "trainer_start_s": 120},
            "attestation": {
                "enabled": True, "dev_issuer": True, "stage_s": 15,
                # results last 60 s; updates may arrive up to 30 + 2 x 15 = 60 s into a round, and
                # round 1 takes > 20 s: round 2 must re-attest a and b
                "coordinator": {"sites": {"policy": {"max_token_age_s": 60}}},
                "site_overrides": {
                    "c": {"attester": {"kind": "local-token", "config": {"measurement": BAD}}},
                    "d": {"coordinator": {"policy": {"allowed_measurements": {"measurement": [BAD]}}}},
                },
            },
        },
        "workload": {"task": "digits", "options": {"hidden": 8}},
        "sites": [{"id": s, "ranks": 1, "partition": i, "local_steps": 3, "batch_size": 16, "dump_updates": True}
                  for i, s in enumerate("abcd")],
    }
    path = write_config(tmp_path / "attested.yaml", cfg)
    run = tmp_path / "run"
    monkeypatch.setenv(launcher.MARKER, marker)
    tap, log = WireTap(), []
    try:
        result = launcher.simulate(path, run, log.append, insecure=True, tap=tap.start)
    finally:
        tap.close()
    assert result["status"] == "ok" and result["aggregated_rounds"] == 2, "\n".join(log)

    lines = assert_weighted_mean_rounds(run, {"a", "b"}, ranks=1, rounds=2, excluded=frozenset({"c", "d"}))
    for line in lines:
        att = line["attestation"]
        assert set(att["attested"]) == {"a", "b", "c", "d"}, att  # round 2: a, b re-attested on expiry
        assert att["excluded"]["c"].startswith("measurement_not_allowed:"), att
        assert att["excluded"]["d"].startswith("site_refused_coordinator:"), att
        assert "measurement_not_allowed" in att["excluded"]["d"]  # the site's own appraisal said why
        assert line["failed"]["c"] == att["excluded"]["c"]
    assert lines[-1]["rejections"]["attestation:measurement_not_allowed"] == 2
    assert lines[-1]["rejections"]["attestation:site_refused_coordinator"] == 2
    progress = (run / "progress.log").read_text()
    assert "round 1: site c NOT ADMITTED: measurement_not_allowed" in progress
    assert "round 2: site d NOT ADMITTED: site_refused_coordinator" in progress
    assert "sealed to our key" in progress and "WARNING: local-token is for development" in progress
    # c and d were never asked to train
    assert not (run / "sites" / "c" / "updates").exists() and not (run / "sites" / "d" / "updates").exists()

    # the wire audit
    leaked = {}
    for site in "ab":
        for rnd in (1, 2):
            with np.load(run / "sites" / site / "updates" / f"round_{rnd:04d}.npz") as z:
                needles = windows({k: z[k] for k in z.files})
            assert len(needles) > 50
            leaked[(site, rnd)] = found(needles, tap.up)
    assert leaked == {k: 0 for k in leaked}, f"plaintext update bytes on the wire: {leaked}"
    _, sent, _ = load_checkpoint(run / "checkpoints" / "round_0001")  # round 2's global model
    needles = windows(sent)
    assert found(needles, tap.down) >= 0.9 * len(needles), "the capture does not see the downlink"
    assert len(tap.up) > 10_000
    assert live_marked(marker) == []


def test_snp_coordinator_and_nras_sites(tmp_path, marker, monkeypatch):
    chain, nras = TestAmdChain("Milan"), NrasTestIssuer()
    chip_dir, nras_dir = chain.save(tmp_path / "test-amd-chip"), nras.save(tmp_path / "test-nras")
    nras_site = {"kind": "nras-test", "config": {"issuer_dir": str(nras_dir), "gpus": 2}}
    cfg = {
        "federation": {
            "name": "tee", "rounds": 1, "quorum": 2, "update_kind": "weights", "seal": True,
            "deadlines": {"connect_s": 60, "round_s": 30, "evaluate_s": 20, "trainer_start_s": 120},
            "attestation": {
                "enabled": True, "stage_s": 15,
                "coordinator": {
                    "attester": {"kind": "amd-sev-snp-fake", "config": {"chip_dir": str(chip_dir)}},
                    "sites": {"verifiers": {"nvidia-nras": {"jwks_path": str(nras_dir / "nras_jwks.json"),
                                                            "issuer": nras.issuer, "min_gpus": 2}},
                              "policy": {"allowed_measurements": {"x-nvidia-gpu-driver-version": ["570.00"],
                                                                  "hwmodel": ["GH100 A01 GSP BROM"]}}},
                },
                "site": {
                    "attester": nras_site,
                    "coordinator": {"verifiers": {"amd-sev-snp": chain.verifier_config(chip_dir / "cert_chain.pem")},
                                    "policy": {"allowed_measurements": {"measurement": ["a1" * 48],
                                                                        "host_data": ["00" * 32]}}},
                },
                "site_overrides": {
                    "c": {"attester": {**nras_site, "config": {**nras_site["config"], "debug": True}}},
                    "d": {"coordinator": {"verifiers": {"amd-sev-snp": chain.verifier_config(chip_dir / "cert_chain.pem")},
                                          "policy": {"allowed_measurements": {"measurement": [BAD]}}}},
                },
            },
        },
        "workload": {"task": "digits", "options": {"hidden": 8}},
        "sites": [{"id": s, "ranks": 1, "partition": i, "local_steps": 3, "batch_size": 16, "dump_updates": True}
                  for i, s in enumerate("abcd")],
    }
    path = write_config(tmp_path / "tee.yaml", cfg)
    run = tmp_path / "run"
    monkeypatch.setenv(launcher.MARKER, marker)
    log: list[str] = []
    result = launcher.simulate(path, run, log.append, insecure=True)
    assert result["status"] == "ok" and result["aggregated_rounds"] == 1, "\n".join(log)
    (line,) = assert_weighted_mean_rounds(run, {"a", "b"}, ranks=1, rounds=1, excluded=frozenset({"c", "d"}))
    att = line["attestation"]
    assert set(att["attested"]) == {"a", "b", "c", "d"}, att
    assert set(att["excluded"]) == {"c", "d"} and att["excluded"]["c"].startswith("debug_enabled:"), att
    assert att["excluded"]["d"].startswith("site_refused_coordinator:"), att
    assert "measurement_not_allowed" in att["excluded"]["d"]  # d appraised the SNP report and said why
    assert line["rejections"]["attestation:debug_enabled"] == 1
    progress = (run / "progress.log").read_text()
    assert "round 1: site c NOT ADMITTED: debug_enabled" in progress
    assert "sealed to our key" in progress  # a and b sealed (after appraising the coordinator's SNP report)
    assert not (run / "sites" / "c" / "updates").exists() and not (run / "sites" / "d" / "updates").exists()
    assert live_marked(marker) == []
