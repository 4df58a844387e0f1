"""End to end: federation.overlap with SecAgg+ and a site dropping out, over a real SuperLink,
SuperNodes, ClientApp processes and trainer services (digits, three one-rank sites, DiLoCo's outer
Nesterov step, evaluation of each round's model at the start of the next train message).

After answering a round, each site's ranks keep training (site_trainer/overlap.py) and fold the
next global model in when it arrives. Site c vanishes after its SecAgg setup of round 2 (its
masked input never comes): round 2 is the exact sum of a and b with c's masks removed, and the
steps c took after round 1, meant for round 2, are discarded when it is asked round 3. Checked:
the unmasked ring sum is exactly the sum of the contributors' encoded inputs, the decoded mean is
within the codec's bound of the plaintext mean of the updates the sites sent (which include
their background progress), the outer step is exactly DiLoCo's on that mean, every site that
trained round r and is asked round r+1 folded background steps in (its first background step runs
before its reply can even reach the coordinator), c's were discarded, and each round's line says
how idle each site's ranks were. With `overlap_max_steps_factor` 2.5 the background steps go on
past the round's local steps, until the request, and never beyond 2.5 x of them (digits' steps
are cheap: they reach the cap).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import live_marked, write_config
from crypto.secagg import FixedPointCodec
from federation.config.schema import load_config
from federation.coordinator.checkpoint import load_checkpoint
from federation.ops import launcher

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=125)]

SITES = ["a", "b", "c"]
CLIP, STEPS = 1.0, 20
FACTOR = 2.5  # federation.overlap_max_steps_factor: background steps go on until the request, up to 50


def _flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(arrays[k], dtype=np.float64).reshape(-1) for k in sorted(arrays)])


def test_overlap_with_secagg_and_a_site_dropping_out(tmp_path, marker, monkeypatch):
    monkeypatch.setenv(launcher.MARKER, marker)
    cfg = {
        "federation": {"name": "overlap-e2e", "rounds": 3, "quorum": 2, "update_kind": "delta", "evaluate": True,
                       "strategy": "diloco", "overlap": True, "overlap_max_steps_factor": FACTOR,
                       "deadlines": {"connect_s": 60, "round_s": 60, "evaluate_s": 60, "secagg_stage_s": 30,
                                     "trainer_start_s": 120},
                       "secagg": {"enabled": True, "threshold": 2, "neighbours": 2, "clip": CLIP, "bits": 32}},
        "workload": {"task": "digits", "options": {"hidden": 16}},
        "sites": [{"id": s, "ranks": 1, "partition": i, "local_steps": STEPS, "batch_size": 16, "lr": 0.05,
                   "dump_updates": True} for i, s in enumerate(SITES)],
    }
    path = write_config(tmp_path / "overlap.yaml", cfg)
    run, dumps = tmp_path / "run", tmp_path / "ring"
    node_config = {s: {"secagg-dump-dir": str(dumps / s)} for s in SITES}
    node_config["c"]["secagg-fault"] = "round=2,after=setup"
    lines_out: list[str] = []
    result = launcher.simulate(path, run, lines_out.append, insecure=True, node_config=node_config)
    log = "\n".join(lines_out)
    assert result["status"] == "ok", log
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["status"] for x in lines] == ["aggregated"] * 3, log
    r1, r2, r3 = lines
    assert r1["secagg"]["contributors"] == SITES and r3["secagg"]["contributors"] == SITES
    assert r2["secagg"]["contributors"] == ["a", "b"] and r2["secagg"]["dropped"] == ["c"]
    assert "after stage 'setup'" in r2["failed"]["c"]

    # SecAgg+ stays exact and the outer step is DiLoCo's on the decoded mean of what the sites sent
    from site_trainer.workloads import initial_weights

    previous = _flat(initial_weights(load_config(path).workload, 0))
    fed = load_config(path).federation
    lr, mom = fed.effective_server_lr, fed.effective_server_momentum  # the defaults (Nesterov)
    momentum = np.zeros_like(previous)
    for rnd, line in enumerate(lines, start=1):
        info, contributors = line["secagg"], line["secagg"]["contributors"]
        ring = sum(np.load(dumps / s / f"round_{rnd:04d}.npy").astype(np.uint64) for s in contributors)
        ring = (ring % 2 ** info["bits"]).astype(np.uint32)
        assert hashlib.sha256(ring.tobytes()).hexdigest() == info["ring_sum_sha256"], f"round {rnd}"
        weights = {s: line["sites"][s]["weight"] for s in contributors}
        codec = FixedPointCodec(CLIP, info["bits"], info["levels"], info["weight_bound"])
        decoded = codec.decode(ring).astype(np.float64)
        updates = {s: np.load(run / "sites" / s / "updates" / f"round_{rnd:04d}.npz") for s in contributors}
        plain = sum(np.clip(_flat(updates[s]), -CLIP, CLIP) * w for s, w in weights.items()) / sum(weights.values())
        assert np.abs(decoded - plain).max() <= codec.error_bound(len(contributors), info["weight_total"])
        momentum = mom * momentum + decoded
        _, model, _ = load_checkpoint(run / "checkpoints" / f"round_{rnd:04d}")
        np.testing.assert_allclose(_flat(model) - previous, lr * (decoded + mom * momentum), rtol=0, atol=2e-6)
        previous = _flat(model)

    # overlap: progress taken in the background is folded into the next round, or discarded
    for rnd, line in ((2, r2), (3, r3)):
        for s in line["sites"]:
            site = line["sites"][s]
            assert 0 <= site["idle_fraction"] <= 1 and site["idle_s"] >= 0, (rnd, s, site)
            if s in lines[rnd - 2]["sites"]:  # trained the round before: its background steps are folded in
                assert 1 <= site["background_steps"] <= int(FACTOR * STEPS), (rnd, s, site)
                assert "overlap_discarded_steps" not in site
    c3 = r3["sites"]["c"]
    assert c3["background_steps"] == 0 and 1 <= c3["overlap_discarded_steps"] <= int(FACTOR * STEPS), c3
    assert all("background_steps" in site and "idle_fraction" not in site for site in r1["sites"].values())
    # and the federation learns: each round's model evaluates better than the one before
    losses = [line["eval_loss"] for line in lines] + [lines[-1]["final_eval_loss"]]
    assert losses == sorted(losses, reverse=True), losses
    idle = {rnd: {s: round(v["idle_fraction"], 2) for s, v in line["sites"].items()}
            for rnd, line in enumerate(lines, start=1) if rnd > 1}
    print(f"overlap e2e: background steps r2 {[r2['sites'][s]['background_steps'] for s in r2['sites']]}, "
          f"r3 {[r3['sites'][s]['background_steps'] for s in r3['sites']]}, idle fraction {idle}")
    assert live_marked(marker) == []
