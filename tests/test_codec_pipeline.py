"""Codecs inside the update pipeline: unit checks of the stage and a real federation with top-k."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conftest import live_marked, sovfl, write_config
from test_report_cmd import check_report
from federation.site.codec_mod import encode_update
from federation.protocol.update_codec import CodecStage, round_seed
from federation.protocol.codecs import UpdateSpec
from federation.protocol.pipeline import Pipeline, RoundContext, UpdateRejected


def _update(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(20, 10)).astype(np.float32), "b": rng.normal(size=10).astype(np.float32)}


def test_site_encode_then_coordinator_decode_with_residual():
    upd = _update()
    ctx = RoundContext("f", 1, 3, "a", round_seed(0, 3))
    payload, state, metrics = encode_update(upd, {}, {"codec": "topk:0.1+int8", "error_feedback": True}, ctx)
    assert metrics["upload_bytes"] < metrics["dense_bytes"] / 4
    stage = CodecStage.from_spec("topk:0.1+int8", True, layout=UpdateSpec.of(upd))
    back = Pipeline((stage,)).decode(payload, ctx).arrays
    for k in upd:  # what was sent plus what was kept is the update
        np.testing.assert_allclose(back[k] + state[k], upd[k], atol=1e-5)


def test_identity_codec_is_a_no_op():
    upd = _update()
    payload, state, metrics = encode_update(upd, {}, {"codec": "identity"}, RoundContext("f", 1, 1, "a"))
    assert state is None and payload.arrays is not None
    for k in upd:
        np.testing.assert_array_equal(payload.arrays[k], upd[k])


@pytest.mark.parametrize("corrupt,reason", [
    (lambda p: p.arrays.__setitem__("values", p.arrays["values"][:-3]), "codec_"),
    (lambda p: p.meta.__setitem__("codec.codec", "int4:block=64"), "codec_mismatch"),
])
def test_malformed_encoded_update_is_rejected_with_reason(corrupt, reason):
    upd = _update()
    ctx = RoundContext("f", 1, 1, "a", 7)
    payload, _, _ = encode_update(upd, {}, {"codec": "topk:0.1+int8", "error_feedback": True}, ctx)
    corrupt(payload)
    stage = CodecStage.from_spec("topk:0.1+int8", True, layout=UpdateSpec.of(upd))
    with pytest.raises(UpdateRejected) as err:
        Pipeline((stage,)).decode(payload, ctx)
    assert err.value.reason.startswith(reason)


@pytest.mark.e2e
def test_federation_with_topk_uplink_and_int8_downlink(tmp_path, marker):
    """Top-k + int8 with error feedback up, int8 global-model steps down: both shrink the bytes the
    real messages carry, every site ends up holding the same model, and the model trains."""
    cfg = {"federation": {"name": "topk", "rounds": 2, "quorum": 2, "codec": "topk:0.05+int8", "warm_clientapps": 2,
                          "downlink_codec": "int8"},
           "workload": {"task": "digits", "options": {"hidden": 32}},
           "sites": [{"id": n, "ranks": 1, "partition": i, "local_steps": 20, "batch_size": 16, "lr": 0.3}
                     for i, n in enumerate(["a", "b"])]}
    path = write_config(tmp_path / "topk.yaml", cfg)
    run = tmp_path / "run"
    proc = sovfl("simulate", str(path), "--workdir", str(run), env={"SOVFL_RUN_MARKER": marker}, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["status"] for x in lines] == ["aggregated", "aggregated"]
    for line in lines:
        assert line["compression_ratio"] > 10
        for site in line["sites"].values():
            assert site["upload_bytes"] * 10 < site["dense_bytes"]
    # the residual came back from the site store in round 2 (error feedback across rounds)
    assert [s["state_arrays_in"] for s in lines[0]["sites"].values()] == [0, 0]
    assert all(s["state_arrays_in"] > 0 for s in lines[1]["sites"].values())
    # downlink: each site's trainer built the coordinator's starting model (same workload, same seed) and
    # showed it at discovery, so round 1 sends no model (it evaluates and trains on the one it holds); round 2
    # gets an int8 step from it, and the final evaluation the next step (each model travels once)
    dense = lines[0]["sites"]["a"]["dense_bytes"]
    r1, r2, fin = lines[0]["downlink"], lines[1]["downlink"], lines[1]["final_eval_downlink"]
    assert r1["modes"] == {"hold": 2} and r2["modes"] == {"steps": 2} and fin["modes"] == {"steps": 2}
    assert set(r1["bytes"].values()) == {0} and r1["dense_bytes"] == 2 * dense
    assert lines[0]["bytes_down"] * 10 < dense and lines[1]["bytes_down"] * 3 < 2 * dense  # train stage
    assert all(b * 3 < dense for b in r2["bytes"].values()) and r2["ratio"] > 3  # vs 1 dense message
    assert all(b * 3 < dense for b in fin["bytes"].values()) and fin["ratio"] > 3
    refs = [json.loads((run / "sites" / s / "downlink" / "reference.json").read_text()) for s in ("a", "b")]
    assert refs[0]["digest"] == refs[1]["digest"]
    # the model trains: the sites' evaluation of the model they rebuilt improves round over round
    # (each round evaluates the model it received: the one the previous round made)
    assert [x["eval_model_round"] for x in lines] == [0, 1]
    # each round's evaluation is said as soon as the sites have it: on the data path, before their local
    # steps (the signed replies that carry it come after them), so well before the round ends
    said = (run / "progress.log").read_text()
    assert said.count("already holds the global model") == 2 and said.index("site a already holds") < said.index(
        "round 1/2 aggregated")
    for r, line in enumerate(lines, start=1):
        early = re.search(rf"round {r}: the model of round {r - 1} evaluated by 2 site\(s\), reported on the data "
                          rf"path before their local steps: eval_loss=([0-9.]+)", said)
        assert early and float(early.group(1)) == pytest.approx(line["eval_loss"], abs=1e-4), said
        assert early.start() < said.index(f"round {r}/2 aggregated")
    assert lines[1]["final_eval_loss"] < lines[1]["eval_loss"] - 0.05
    assert lines[1]["eval_loss"] < lines[0]["eval_loss"]
    assert lines[1]["final_eval_accuracy"] > 0.2  # twice chance after two short rounds
    # per-stage timing in every line, and the run's report with every figure drawn from data
    for line in lines:
        t = line["timing"]
        assert t["site_work_s"] > 0 and t["round_s"] == pytest.approx(line["round_s"], abs=1e-3)
        assert 0 < t["eval_known_s"] < line["round_s"]  # said once the train replies were in, before the unmask
        exchanges = [s for s in t["stages"] if s["stage"] != "finish"]
        assert exchanges and all(s["push_s"] >= 0 and s["replies"] == 2 for s in exchanges)
        assert "checkpoint_s" in t and "optimizer_s" in t
        # each site's message split, served by a warm ClientApp worker that imported our app before the
        # message came (protocol/message_cost.py, ops/warm_executor.py)
        for cost in (c for s in exchanges for c in (s.get("messages") or {}).values()):
            assert {"launch_s", "startup_s", "app_import_s", "handler_s", "return_s"} <= set(cost)
            assert cost["executor"] == "warm" and cost["app_import_s"] == 0
            assert cost["startup_s"] > 0 and cost["handler_s"] > 0
            assert sum(cost[k] for k in ("launch_s", "startup_s", "handler_s", "return_s")) == pytest.approx(
                cost["total_s"], abs=2e-3)
        assert set(t["message_cost"]) == {"a", "b"}
    assert f"report: {run / 'report.html'}" in proc.stdout
    check_report(run / "report.html", figures=4)
    assert live_marked(marker) == []
