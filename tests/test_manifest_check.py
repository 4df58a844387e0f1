"""The base-model check at site discovery, through the real Coordinator and the real ClientApp (in
process: the real Grid protocol, protobuf on the way, numpy trainers that report manifests).

A site whose frozen base or exchanged tensors differ from the coordinator's manifest is refused by
name before the first round, with the reason and the fix, counted once under `manifest_mismatch`,
named in every round's `failed`, and never asked to train; the rounds go on with the others. The
manifest rides on the discovery reply (no extra message).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from federation.coordinator.driver import FederationFailed
from federation.coordinator.manifest_check import BaseCheck
from federation.ops.inprocess import FunctionTrainer, InProcessSite, task_identity
from federation.protocol.round_config import RoundConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._fedsim import RUN_ID, coordinator, simulated_sites  # noqa: E402

MODEL = {"lora_a": np.full((2, 4), 0.5, np.float32), "lora_b": np.zeros((4, 2), np.float32)}
MANIFEST = {"version": 1, "exchanged": [["lora_a", "float32", [2, 4], "<f4"], ["lora_b", "float32", [4, 2], "<f4"]],
            "exchanged_numel": 16, "frozen": {"tensors": 3, "numel": 100, "sha256": "ab" * 32}}


class ManifestTrainer(FunctionTrainer):
    """A numpy site that reports a manifest at discovery and counts its train calls."""

    def __init__(self, manifest: dict | None, workdir: Path, step: float):
        super().__init__(self._step, 10, workdir)
        self.manifest, self.step, self.trained = manifest, step, 0

    def _step(self, glob: dict, config: RoundConfig):
        self.trained += 1
        return {k: np.full_like(v, self.step) for k, v in glob.items()}, {"loss": 1.0}

    def info(self) -> dict:
        return {**super().info(), **({"manifest": self.manifest} if self.manifest is not None else {})}


def _other_base() -> dict:
    m = copy.deepcopy(MANIFEST)
    m["frozen"]["sha256"] = "cd" * 32
    return m


def _wider() -> dict:
    m = copy.deepcopy(MANIFEST)
    m["exchanged"][0][2] = [4, 4]
    return m


def test_a_site_with_another_base_is_refused_by_name_and_the_round_goes_on(tmp_path):
    trainers = {"good0": ManifestTrainer(MANIFEST, tmp_path / "g0", 0.1),
                "good1": ManifestTrainer(MANIFEST, tmp_path / "g1", 0.3),
                "otherbase": ManifestTrainer(_other_base(), tmp_path / "ob", 9.0),
                "wider": ManifestTrainer(_wider(), tmp_path / "w", 9.0),
                "silent": ManifestTrainer(None, tmp_path / "s", 9.0)}
    sites = [InProcessSite(name, i + 1, t, run_id=RUN_ID) for i, (name, t) in enumerate(trainers.items())]
    lines = []
    with task_identity(RUN_ID):
        coord = coordinator(tmp_path, MODEL, sites, rounds=2, quorum=2, update_kind="delta", manifest=MANIFEST)
        for rnd in (1, 2):
            lines.append(coord.run_round(rnd))
    assert sorted(s.name for s in coord.sites.values()) == ["good0", "good1"]
    refused = {"otherbase", "wider", "silent"}
    for line in lines:
        assert line["status"] == "aggregated" and set(line["sites"]) == {"good0", "good1"}
        assert set(line["failed"]) == refused
        assert line["rejections"] == {"manifest_mismatch": 3}  # counted once per site, not per round
    failed = lines[0]["failed"]
    assert "frozen base weights differ" in failed["otherbase"] and "cdcdcdcd" in failed["otherbase"]
    assert "start the site from the coordinator's base model" in failed["otherbase"]
    assert "exchanged tensor lora_a: site has float32[4, 4], coordinator float32[2, 4]" in failed["wider"]
    assert "reports no base-model manifest" in failed["silent"]
    assert all(trainers[n].trained == 0 for n in refused)  # never asked to train: nothing of theirs averaged
    assert trainers["good0"].trained == trainers["good1"].trained == 2
    np.testing.assert_allclose(coord.model["lora_b"], 2 * 0.2, rtol=0, atol=1e-6)  # the two good sites' mean, twice


def test_too_few_matching_sites_fail_the_run_naming_the_refusals(tmp_path):
    trainers = [ManifestTrainer(MANIFEST, tmp_path / "a", 0.1), ManifestTrainer(_other_base(), tmp_path / "b", 0.1)]
    sites = simulated_sites(trainers, 0)
    with task_identity(RUN_ID), pytest.raises(FederationFailed, match=r"quorum is 2; site1 refused \(manifest_mismatch"):
        coordinator(tmp_path, MODEL, sites, quorum=2, manifest=MANIFEST)


@pytest.mark.parametrize("raw, why", [
    ("{not json", "is not JSON"),
    ("[1, 2]", "is a list, not a mapping"),
    (json.dumps({"version": 1, "exchanged": [["x"]]}), "malformed"),
    (json.dumps({**MANIFEST, "version": 99}), "manifest version 99"),
])
def test_bad_manifests_are_refusals_not_crashes(raw, why):
    from collections import Counter

    check, counts, said = BaseCheck(MANIFEST), Counter(), []
    assert not check.admit("x", {"manifest": raw}, counts, said.append)
    assert why in check.refused["x"] and counts["manifest_mismatch"] == 1 and "site x REFUSED" in said[0]
    assert BaseCheck(None).admit("x", {"manifest": raw}, counts, said.append)  # no manifest of its own: no check
