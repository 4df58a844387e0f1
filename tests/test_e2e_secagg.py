"""End to end: SecAgg+ over a real SuperLink, SuperNodes, ClientApp processes and torchrun trainers.

One run of four sites (one rank each, digits; complete graph, threshold t = 3 of the 4 shares of
each secret, so one site may vanish per round) covers every case of the issue, round by round:
  1  b, c vanish after their masked inputs  -> fewer than t shares: clean abort, global model unchanged
  2  a never sets round 2 up                -> the next round works: the exact sum of b, c, d
  3  b vanishes after its setup             -> the exact sum of a, c, d (b's masks removed)
  4  c vanishes after its masked input      -> the exact sum of all four (c's seed rebuilt from
                                               its neighbours' shares)
Each site handles two messages per round (train, unmask), plus discovery and, for a site that sat a
round out or whose train message failed, one query carrying its next setup.
Sites dump their encoded ring vectors (test-only node config `secagg-dump-dir`) and their plaintext
updates (`dump_updates`), so the test checks that the unmasked ring sum is exactly the sum of the
contributors' encoded inputs, that the decoded average is within the quantization bound of the
plaintext weighted average, and that the coordinator's outer optimizer (strategy diloco: Nesterov
momentum, its buffer carried over the aborted round) stepped on exactly that decoded average. Every
site holds its provisioned bundle: all SecAgg messages are signed and verified (sites check their
neighbours' relayed keys), and none is rejected.

TLS is off and a proxy records every byte between the sites and the SuperLink (a wire audit):
masking alone keeps each update unreadable, so neither a site's plaintext update nor its encoded
ring input appears on the wire, while the (public, unmasked) global model does.

A second run (3 sites, SecAgg+, sites[].privacy) has a site whose DP budget stops it after round 2.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import live_marked, write_config
from crypto.secagg import FixedPointCodec
from federation.ops import launcher
from federation.coordinator.checkpoint import load_checkpoint, read_checkpoint
from federation.config.schema import load_config
from wiretap import WireTap, found, windows

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=140)]

SITES = ["a", "b", "c", "d"]
FAULTS = {
    "a": "round=2,before=setup",
    "b": "round=1,after=masked;round=3,after=setup",
    "c": "round=1,after=masked;round=4,after=masked",
    "d": "",
}
CLIP = 1.0


def _flat(path: Path) -> np.ndarray:
    with np.load(path) as z:
        return np.concatenate([z[k].astype(np.float64).reshape(-1) for k in sorted(z.files)])


def _model_flat(model: dict) -> np.ndarray:
    return np.concatenate([model[k].astype(np.float64).reshape(-1) for k in sorted(model)])


def test_secagg_exact_sums_dropouts_at_each_stage_abort_and_recovery(tmp_path, marker, monkeypatch):
    monkeypatch.setenv(launcher.MARKER, marker)
    cfg = {
        "federation": {"name": "secagg-e2e", "rounds": 4, "quorum": 2, "update_kind": "delta", "evaluate": False,
                       "strategy": "diloco",
                       "deadlines": {"connect_s": 60, "round_s": 60, "secagg_stage_s": 30, "trainer_start_s": 120},
                       "secagg": {"enabled": True, "threshold": 3, "neighbours": 3, "clip": CLIP, "bits": 32}},
        "workload": {"task": "digits", "options": {"hidden": 16}},
        "sites": [{"id": s, "ranks": 1, "partition": i, "local_steps": 3, "batch_size": 16, "lr": 0.1,
                   "dump_updates": True} for i, s in enumerate(SITES)],
    }
    path = write_config(tmp_path / "secagg.yaml", cfg)
    run, dumps = tmp_path / "run", tmp_path / "ring"
    node_config = {s: {"secagg-dump-dir": str(dumps / s), **({"secagg-fault": FAULTS[s]} if FAULTS[s] else {})}
                   for s in SITES}
    lines_out: list[str] = []
    t0 = time.monotonic()
    tap = WireTap()
    try:
        result = launcher.simulate(path, run, lines_out.append, insecure=True, tap=tap.start, node_config=node_config)
    finally:
        tap.close()
    elapsed = time.monotonic() - t0
    log = "\n".join(lines_out)
    assert result["status"] == "ok", log
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["status"] for x in lines] == ["skipped", "aggregated", "aggregated", "aggregated"], log
    assert all(x["rejections"] == {} for x in lines) and all(x["secagg"]["threshold"] == 3 for x in lines)
    assert "every secure-aggregation message signed by its site" in log

    from site_trainer.workloads import initial_weights

    previous = initial_weights(load_config(path).workload, 0)
    fed = load_config(path).federation
    lr, mom = fed.effective_server_lr, fed.effective_server_momentum  # the defaults (Nesterov)
    momentum = np.zeros_like(_model_flat(previous))  # the outer buffer, by hand
    for rnd, line in enumerate(lines, start=1):
        info = line["secagg"]
        if line["status"] != "aggregated":
            continue
        contributors = info["contributors"]
        assert set(line["sites"]) == set(contributors)
        # the unmasked ring sum is exactly the sum of the contributors' encoded inputs
        ring = sum(np.load(dumps / s / f"round_{rnd:04d}.npy").astype(np.uint64) for s in contributors)
        ring = (ring % 2 ** info["bits"]).astype(np.uint32)
        assert hashlib.sha256(ring.tobytes()).hexdigest() == info["ring_sum_sha256"], f"round {rnd}"
        weights = {s: line["sites"][s]["weight"] for s in contributors}
        assert int(ring[-1]) == sum(weights.values()) == info["weight_total"]
        assert all(w == line["sites"][s]["samples"] for s, w in weights.items())  # below max_weight: unscaled
        # the decoded average is within the stated bound of the plaintext (clipped) weighted average
        codec = FixedPointCodec(CLIP, info["bits"], info["levels"], info["weight_bound"])
        assert info["bits"] == 32 and info["weight_bound"] == max(weights.values())
        decoded = codec.decode(ring).astype(np.float64)
        plain = sum(np.clip(_flat(run / "sites" / s / "updates" / f"round_{rnd:04d}.npz"), -CLIP, CLIP) * w
                    for s, w in weights.items()) / sum(weights.values())
        bound = codec.error_bound(len(contributors), info["weight_total"])
        assert bound == pytest.approx(info["error_bound"]) and bound < 1e-6
        assert np.abs(decoded - plain).max() <= bound, f"round {rnd}"
        assert np.abs(plain).max() > 1e-3  # training moved the model: this is not a sum of zeros
        # the outer step on exactly that decoded mean (the pseudo-gradient is its negative)
        momentum = mom * momentum + decoded
        _, model, opt = load_checkpoint(run / "checkpoints" / f"round_{rnd:04d}")
        np.testing.assert_allclose(_model_flat(model) - _model_flat(previous), lr * (decoded + mom * momentum),
                                   rtol=0, atol=2e-6)
        np.testing.assert_allclose(_model_flat({k[2:]: v for k, v in opt.items()}), momentum, rtol=0, atol=2e-6)
        previous = model

    r1, r2, r3, r4 = lines
    # below threshold: clean abort, the model is unchanged, the next round works
    assert "aborted in stage 4 (unmask)" in r1["secagg"]["aborted"] and r1["sites"] == {}
    assert read_checkpoint(run / "checkpoints" / "round_0004").state["metrics"][0]["status"] == "skipped"
    assert "secure aggregation aborted" in log and "the global model is unchanged" in log
    # a never set round 2 up: the sum of the other three, no mask of a's in it
    assert r2["secagg"]["contributors"] == ["b", "c", "d"] and r2["secagg"]["dropped"] == []
    assert "no setup for round 2" in r2["failed"]["a"] and "before stage 'setup'" in r2["failed"]["a"]
    # b vanished after its setup: the survivors' sum, b's pairwise masks removed
    assert r3["secagg"]["contributors"] == ["a", "c", "d"] and r3["secagg"]["dropped"] == ["b"]
    assert "after stage 'setup'" in r3["failed"]["b"]
    # c vanished after sending its masked input: it is still in the sum of all four
    assert r4["secagg"]["contributors"] == SITES and "after stage 'masked'" in r4["secagg"]["unmask_missing"]["c"]
    # the masked upload is 4 bytes per parameter in a 32-bit ring (+ the weight word)
    p = _model_flat(previous).shape[0]
    assert all(s["upload_bytes"] == 4 * (p + 1) for s in r4["sites"].values())
    # two messages per site and round; a sat round 2 out and b failed its train message of round 3:
    # each got its next setup in a query of its own (round 1's rode on discovery)
    assert r4["messages"] == {"a": 1 + 2 * 3 + 1, "b": 1 + 2 * 3 + 1 + 1, "c": 1 + 2 * 4, "d": 1 + 2 * 4}
    # the wire audit: what TLS would hide shows no update, masked or not
    for rnd, line in enumerate(lines, start=1):
        for site in line["secagg"].get("contributors", []):
            plain_update = np.load(run / "sites" / site / "updates" / f"round_{rnd:04d}.npz")
            needles = windows({k: plain_update[k] for k in plain_update.files})
            needles += windows({"ring": np.load(dumps / site / f"round_{rnd:04d}.npy")})
            assert len(needles) > 50 and found(needles, tap.up) == 0, f"{site}'s round {rnd} update is on the wire"
    _, sent, _ = load_checkpoint(run / "checkpoints" / "round_0003")  # round 4's global model
    needles = windows(sent)
    assert found(needles, tap.down) >= 0.9 * len(needles), "the capture does not see the downlink"
    print(f"secagg e2e: {elapsed:.1f}s, per round: {[round(x['round_s'], 1) for x in lines]}, "
          f"stage seconds r4: {r4['secagg']['stage_s']}")
    assert live_marked(marker) == []


def test_a_site_out_of_privacy_budget_is_left_out_by_name_and_the_others_finish(tmp_path, marker, monkeypatch):
    """sites[].privacy under SecAgg+: three digits sites train with DP-SGD; a and b calibrate their
    noise to epsilon 8 over the planned 3 rounds x 3 steps, c has a fixed noise multiplier and a
    budget that two rounds fit. c refuses round 3 on its own (its ledger, its own config), the
    coordinator names it and aggregates a and b; every round's line has each site's epsilon and
    noise multiplier, result.json each site's final epsilon, the report its plot."""
    from federation.ops.report_cmd import build_report
    from site_trainer.privacy import accountant

    monkeypatch.setenv(launcher.MARKER, marker)
    q_c = 16 / 480  # digits partition 2 of 3: 599 images, 480 for training
    cap_c = accountant.epsilon([(q_c, 1.0, 2 * 3)], 1e-5) + 1e-3
    privacy = {"a": {"enabled": True, "epsilon": 8.0}, "b": {"enabled": True, "epsilon": 8.0, "accountant": "prv"},
               "c": {"enabled": True, "noise_multiplier": 1.0, "epsilon": cap_c}}
    cfg = {
        "federation": {"name": "dp-e2e", "rounds": 3, "quorum": 2, "update_kind": "delta", "evaluate": False,
                       "deadlines": {"connect_s": 60, "round_s": 60, "secagg_stage_s": 30, "trainer_start_s": 120},
                       "secagg": {"enabled": True, "threshold": 2, "neighbours": 2, "clip": CLIP, "bits": 32}},
        "workload": {"task": "digits", "options": {"hidden": 16}},
        "sites": [{"id": s, "ranks": 1, "partition": i, "local_steps": 3, "batch_size": 16, "lr": 0.1,
                   "privacy": {**privacy[s], "max_grad_norm": 1.0}} for i, s in enumerate(["a", "b", "c"])],
    }
    path = write_config(tmp_path / "dp.yaml", cfg)
    run = tmp_path / "run"
    lines_out: list[str] = []
    result = launcher.simulate(path, run, lines_out.append, insecure=True)
    log = "\n".join(lines_out)
    assert result["status"] == "ok", log
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["status"] for x in lines] == ["aggregated"] * 3, log
    r1, r2, r3 = lines
    assert set(r1["sites"]) == set(r2["sites"]) == {"a", "b", "c"}
    assert set(r3["sites"]) == {"a", "b"} and r3["secagg"]["contributors"] == ["a", "b"]
    assert "privacy budget: round 3" in r3["failed"]["c"] and f"budget {cap_c:g}" in r3["failed"]["c"]
    assert "round 3: site c excluded" in log and "privacy budget" in log
    for name in ("a", "b", "c"):  # each trained round: epsilon spent so far, growing, and the noise multiplier
        eps = [x["sites"][name]["dp_epsilon"] for x in lines if name in x["sites"]]
        assert eps == sorted(eps) and eps[0] > 0
        assert all(x["sites"][name]["dp_noise_multiplier"] > 0 for x in lines if name in x["sites"])
    assert r2["sites"]["c"]["dp_noise_multiplier"] == 1.0 and r2["sites"]["c"]["dp_epsilon"] <= cap_c
    final = result["privacy"]
    assert 7.9 < final["a"]["epsilon"] <= 8.0 and 7.9 < final["b"]["epsilon"] <= 8.0  # calibrated: all of it spent
    assert final["c"]["epsilon"] == r2["sites"]["c"]["dp_epsilon"] and final["c"]["stopped_round"] == 3
    assert json.loads((run / "sites" / "c" / "privacy" / "ledger.json").read_text())["rounds"] == [[1, 3], [2, 3]]
    assert "Privacy: epsilon spent per site" in build_report(run).read_text()
    assert live_marked(marker) == []
