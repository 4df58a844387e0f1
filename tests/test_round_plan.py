"""round_target_s's choice (federation/coordinator/round_plan.py) from given link figures, step
times and update sizes, each case worked out by hand; and the size estimate against real encodings."""

from __future__ import annotations

import numpy as np
import pytest

from federation.config.schema import ExperimentConfig
from federation.coordinator.round_plan import choose, wire_bytes
from federation.coordinator.round_planner import RoundPlanner, message_overhead_s
from federation.protocol.codecs import UpdateSpec
from federation.protocol.link_probe import LinkFigures
from federation.protocol.pipeline import Payload, Pipeline, RoundContext
from federation.protocol.update_codec import CodecStage

LADDER = ["float32", "int8", "topk:0.1+int8"]
MB = 1e6
# one update's bytes under each codec (given, not estimated: the rule is what is tested here)
UP = {"float32": 40 * MB, "int8": 10 * MB, "topk:0.1+int8": 2 * MB}


def link(up_mbit, down_mbit=None, rtt_ms=0.0):
    return LinkFigures("bulk", rtt_ms, up_mbit, down_mbit or up_mbit)


def test_a_fast_link_keeps_dense_updates_and_fills_the_rest_with_steps():
    # 1000 Mbit/s both ways, RTT 10 ms: float32 = 40 MB down + 40 MB up = 0.64 s + 0.02 s = 0.66 s <= 0.5 * 10 s
    c = choose(1, 10.0, {"a": link(1000, rtt_ms=10)}, {"a": 0.1}, LADDER, UP, 40 * MB)
    assert c.codec == "float32" and c.fits and c.slowest == "a"
    assert c.transfer_s == pytest.approx(0.66)
    assert c.local_steps == 93  # floor((10 - 0.66) / 0.1)
    assert c.compute_s == pytest.approx(9.3)
    assert "codec float32" in c.reason and "93 local steps" in c.reason


def test_the_slowest_site_decides_the_codec():
    # site b at 100 Mbit/s: float32 takes 80 MB * 8 / 100e6 = 6.4 s > 5 s; int8: (40 + 10) MB -> 4.0 s <= 5 s
    links = {"a": link(1000), "b": link(100)}
    c = choose(2, 10.0, links, {"a": 0.01, "b": 0.01}, LADDER, UP, 40 * MB)
    assert c.codec == "int8" and c.slowest == "b" and c.fits
    assert c.transfer_s == pytest.approx(4.0)
    assert c.transfers["float32"] == pytest.approx(6.4)
    assert "float32 would take 6.40s" in c.reason
    assert c.local_steps == 600  # b: floor((10 - 4.0) / 0.01); a has more room (10 - 0.4) / 0.01


def test_the_tightest_site_decides_the_steps_with_its_own_step_time():
    # a: fast link but slow steps; b: slow link, fast steps. int8 fits (b 4.0 s, a 0.4 s).
    links = {"a": link(1000), "b": link(100)}
    c = choose(2, 10.0, links, {"a": 0.5, "b": 0.01}, LADDER, UP, 40 * MB)
    assert c.codec == "int8"
    assert c.local_steps == 19  # a: floor((10 - 0.4) / 0.5) = 19 < b's 600
    assert c.compute_s == pytest.approx(9.5)
    assert "site a has 9.60s left" in c.reason


def test_asymmetric_links_count_each_direction_at_its_rate():
    # up 10 Mbit/s, down 1000: int8 = 40 MB down (0.32 s) + 10 MB up (8 s) = 8.32 > 5; topk 2 MB up: 0.32 + 1.6
    c = choose(1, 10.0, {"a": link(10, 1000)}, {}, LADDER, UP, 40 * MB)
    assert c.codec == "topk:0.1+int8" and c.transfer_s == pytest.approx(1.92)


def test_nothing_fits_the_most_compressed_codec_and_the_fewest_steps_and_it_says_so():
    c = choose(3, 1.0, {"a": link(10)}, {"a": 0.1}, LADDER, UP, 40 * MB)
    # topk: 42 MB * 8 / 10e6 = 33.6 s, far over 0.5 s
    assert c.codec == "topk:0.1+int8" and not c.fits
    assert c.local_steps == 1 and "lower bound" in c.reason
    assert "over 50% of the 1s target" in c.reason and "by 33.10s" in c.reason


def test_the_round_s_fixed_cost_comes_off_the_steps_not_the_link_s_share():
    # as in the first case, with 3 s of Flower delivery and start-up measured last round
    c = choose(1, 10.0, {"a": link(1000, rtt_ms=10)}, {"a": 0.1}, LADDER, UP, 40 * MB, fixed_s=3.0)
    assert c.codec == "float32" and c.fixed_s == 3.0
    assert c.local_steps == 63  # floor((10 - 3 - 0.66) / 0.1)
    assert "the round's fixed 3.00s" in c.reason


def test_under_overlap_the_steps_get_the_whole_target():
    # as above, but the site trains while its update travels and the coordinator works
    # (site_trainer/overlap.py): a round takes about max(transfer + fixed, steps x step), so neither
    # the 0.66 s transfer nor the 3 s fixed cost comes off the steps
    c = choose(1, 10.0, {"a": link(1000, rtt_ms=10)}, {"a": 0.1}, LADDER, UP, 40 * MB, fixed_s=3.0, overlap=True)
    assert c.codec == "float32" and c.fixed_s == 3.0
    assert c.local_steps == 100  # floor(10 / 0.1)
    assert c.compute_s == pytest.approx(10.0)
    assert "overlap" in c.reason and "fills the 10.00s target" in c.reason
    # the codec's rule is the same: the slow site's transfer still has to fit its share
    c = choose(2, 10.0, {"a": link(1000), "b": link(100)}, {"a": 0.5, "b": 0.01}, LADDER, UP, 40 * MB,
               fixed_s=2.0, overlap=True)
    assert c.codec == "int8" and c.local_steps == 20  # a: floor(10 / 0.5)


def test_a_flower_path_s_round_trip_is_the_round_s_fixed_cost_not_the_link_s():
    # through Flower the RTT (seconds of message delivery) is in fixed_s; only the bytes' time is the link's
    flower = LinkFigures("flower", rtt_ms=6900.0, up_mbit=100.0, down_mbit=100.0)
    c = choose(2, 12.0, {"f": flower}, {"f": 0.1}, LADDER, UP, 40 * MB, fixed_s=7.0)
    assert c.codec == "int8" and c.transfer_s == pytest.approx(4.0)  # float32's 6.4 s is over 0.5 x 12 s
    assert c.local_steps == 10  # floor((12 - 7 - 4) / 0.1)
    assert flower.transfer_s(UP["int8"], 40 * MB, round_trips=1) == pytest.approx(4.0 + 6.9)


def test_steps_stay_within_their_bounds():
    c = choose(1, 100.0, {"a": link(10_000)}, {"a": 0.001}, LADDER, UP, 40 * MB, max_steps=500)
    assert c.local_steps == 500 and "upper bound" in c.reason
    c = choose(1, 10.0, {"a": link(1000)}, {"a": 2.0}, LADDER, UP, 40 * MB, min_steps=8)
    assert c.local_steps == 8  # (10 - 0.64) / 2 = 4.68 < 8


def test_before_step_times_are_known_the_sites_keep_their_own_steps():
    c = choose(1, 10.0, {"a": link(1000), "b": link(100)}, {"a": 0.1}, LADDER, UP, 40 * MB)
    assert c.codec == "int8" and c.local_steps is None and c.compute_s is None
    assert "no step time yet for b" in c.reason


def test_the_planner_plans_round_1_from_the_trainers_start_up_estimates():
    # no round measured yet: the seconds per step each trainer timed at its start (discovery) stand in;
    # a site that gave none still leaves the round to the sites' own steps
    cfg = ExperimentConfig.model_validate({"federation": {"round_target_s": 10.0, "overlap": True},
                                           "sites": [{"id": "a", "partition": 0}, {"id": "b", "partition": 1}]})
    planner = RoundPlanner(cfg, lambda line: None)
    links = {"a": link(1000), "b": link(100)}
    c = planner.choose(1, ["a", "b"], links, [], 10_000_000, 40 * MB, {"a": 0.1, "b": 0.05})
    # int8 (10M values + scales: 10.06 MB each way): b 4.02 s, a 0.40 s; round 1 has nothing to overlap
    # with, so each site's transfer comes off: a (10 - 0.40) / 0.1 = 95.97, b (10 - 4.02) / 0.05 = 119.5
    assert c.codec == "int8" and c.local_steps == 95 and c.fixed_s == 0 and c.transfer_s == pytest.approx(4.025)
    assert "site a has 9.60s left" in c.reason and "0.100s per step (its trainer's estimate at start-up)" in c.reason
    assert "overlap" not in c.reason
    # the round's fixed cost before any round measured it (discovery's message overhead, per message):
    # a (10 - 0.40 - 2) / 0.1 = 75.97, b (10 - 4.02 - 2) / 0.05 = 79.5
    f = planner.choose(1, ["a", "b"], links, [], 10_000_000, 40 * MB, {"a": 0.1, "b": 0.05}, first_fixed_s=2.0)
    assert f.local_steps == 75 and f.fixed_s == 2.0 and "the round's fixed 2.00s" in f.reason
    # every site already holds the model (said at discovery): only the update travels, and dense float32
    # fits (b: 40 MB up at 100 Mbit/s, 3.2 s); a (10 - 0.32) / 0.1 = 96.8 steps, b (10 - 3.2) / 0.05 = 136
    held = planner.choose(1, ["a", "b"], links, [], 10_000_000, 40 * MB, {"a": 0.1, "b": 0.05}, nothing_down=True)
    assert held.codec == "float32" and held.transfer_s == pytest.approx(3.2) and held.local_steps == 96
    assert "no model goes down: every site already holds it" in held.reason
    partial = planner.choose(1, ["a", "b"], links, [], 10_000_000, 40 * MB, {"a": 0.1})
    assert partial.local_steps is None and "no step time yet for b" in partial.reason
    # a measured round wins over the estimate (0.2 s per step measured for a, against 0.1 estimated)
    history = [{"round": 1, "sites": {"a": {"seconds": 4.0}, "b": {"seconds": 1.0}},
                "round_plan": {"codec": "int8", "local_steps": 20}}]
    m = planner.choose(2, ["a", "b"], links, history, 10_000_000, 40 * MB, {"a": 0.1, "b": 0.01})
    assert m.local_steps == 50 and "estimate" not in m.reason  # overlap from round 2: 10 / 0.2


def test_without_link_figures_the_configured_codec_stays():
    c = choose(1, 10.0, {}, {}, LADDER, UP, 40 * MB, fallback_codec="int8")
    assert c.codec == "int8" and c.local_steps is None and not c.fits and "no link figures" in c.reason
    with pytest.raises(ValueError):
        choose(1, 10.0, {}, {}, [], UP, 0)


def test_link_share_moves_the_line():
    # int8 for b takes 4.0 s: within 0.5 x 10 s, not within 0.3 x 10 s
    links = {"b": link(100)}
    assert choose(1, 10.0, links, {}, LADDER, UP, 40 * MB, link_share=0.5).codec == "int8"
    assert choose(1, 10.0, links, {}, LADDER, UP, 40 * MB, link_share=0.3).codec == "topk:0.1+int8"


@pytest.mark.parametrize("spec", ["float32", "int8", "topk:0.1+int8", "topk:0.01+int8", "randk:0.1+int8:clip=0.5",
                                  "int8:clip=0.5", "bf16", "topk:0.05:index=int32+int4"])
def test_the_size_estimate_is_close_to_a_real_encoding(spec):
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((500, 400)).astype(np.float32), "b": rng.standard_normal(3000).astype(np.float32)}
    numel = sum(a.size for a in arrays.values())
    stage = CodecStage.from_spec(spec, True, layout=UpdateSpec.of(arrays))
    real = Pipeline((stage,)).encode(Payload(arrays), RoundContext("f", 1, 1, "a", 7)).nbytes
    assert wire_bytes(spec, numel) == pytest.approx(real, rel=0.15), (spec, real)


def test_the_planner_reads_step_times_and_sizes_from_the_history():
    cfg = ExperimentConfig.model_validate({"federation": {"round_target_s": 10.0},
                                           "sites": [{"id": "a", "partition": 0, "local_steps": 20},
                                                     {"id": "b", "partition": 1}]})
    planner = RoundPlanner(cfg, lambda line: None)
    history = [
        {"round": 1, "sites": {"a": {"seconds": 4.0, "upload_bytes": 9e6}, "b": {"seconds": 1.0, "upload_bytes": 9.5e6}},
         "round_plan": {"codec": "int8", "local_steps": None}},  # the sites' own steps: a 20, b 10
        {"round": 2, "sites": {"b": {"seconds": 3.0, "bulk_down_bytes": 30e6}},
         "round_plan": {"codec": "topk:0.1+int8", "local_steps": 50}},
    ]
    assert planner.step_times(history) == {"a": pytest.approx(0.2), "b": pytest.approx(0.06)}
    # federation.overlap: 45 of b's 50 steps ran in the background (2.7 s) before the request came
    history[1]["sites"]["b"].update(seconds=0.3, background_s=2.7, background_steps=45)
    assert planner.step_times(history)["b"] == pytest.approx(0.06)
    # federation.overlap_max_steps_factor above 1: 80 background steps (4.8 s) for a round of 50, which then
    # trained none after the fold (its call took 0.1 s): 80 steps in 4.9 s, not 50
    history[1]["sites"]["b"].update(seconds=0.1, background_s=4.8, background_steps=80)
    assert planner.step_times(history)["b"] == pytest.approx(4.9 / 80)
    # stale progress thrown away (12 steps, 0.72 s) and the round's 50 trained after it (3.0 s)
    history[1]["sites"]["b"].update(seconds=3.0, background_s=0.72, background_steps=0, overlap_discarded_steps=12)
    assert planner.step_times(history)["b"] == pytest.approx(3.72 / 62)
    sizes, down = planner.sizes(history, 10_000_000)
    assert sizes["int8"] == 9.5e6 and down == 30e6  # what was really sent
    assert sizes["float32"] == wire_bytes("float32", 10_000_000)  # never sent: estimated
    history[-1].update(round_s=9.0, timing={"site_work_s": 3.5, "stages": [{"stage": "link probe before round 2",
                                                                             "seconds": 2.0}]})
    history[-1]["round_plan"]["transfer_s"] = 1.25
    assert planner.fixed_s(history) == pytest.approx(9.0 - 2.0 - 3.5 - 1.25)
    assert planner.fixed_s([]) == 0.0
    # once a round is measured, discovery's estimate of the fixed cost no longer counts
    c = planner.choose(3, ["a", "b"], {"a": link(1000), "b": link(1000)}, history, 10_000_000, 40_000_000,
                       first_fixed_s=50.0)
    assert c.fixed_s == pytest.approx(9.0 - 2.0 - 3.5 - 1.25)
    lines = []
    planner.progress = lines.append
    c = planner.choose(3, ["a", "b"], {"a": link(1000), "b": link(1000)}, history, 10_000_000, 40_000_000)
    assert planner.choices[3] is c and lines and "round 3: round target 10s" in lines[0]
    assert "overlap" not in c.reason
    # federation.overlap reaches the rule: the steps are not cut by the fixed cost
    overlapped = RoundPlanner(ExperimentConfig.model_validate({**cfg.model_dump(), "federation": {
        **cfg.federation.model_dump(), "overlap": True}}), lambda line: None)
    o = overlapped.choose(3, ["a", "b"], {"a": link(1000), "b": link(1000)}, history, 10_000_000, 40_000_000)
    assert "overlap" in o.reason and o.local_steps > c.local_steps


def _config(federation: dict, **site):
    return ExperimentConfig.model_validate({"federation": federation, "sites": [{"id": "a", "partition": 0, **site}]})


def test_the_config_knobs_and_their_refusals():
    off = _config({}).federation
    assert off.round_target_s is None and not off.probing  # off by default: nothing measured, nothing chosen
    on = _config({"round_target_s": 30}).federation
    assert on.probing and on.codec_ladder == ["float32", "int8", "topk:0.1+int8", "topk:0.01+int8"]
    assert _config({"link": {"probe": True}}).federation.probing
    assert not _config({"round_target_s": 30, "link": {"probe": False}}).federation.probing
    sec = _config({"round_target_s": 30, "secagg": {"enabled": True, "clip": 0.25}}).federation
    assert sec.codec_ladder == ["identity", "int8:clip=0.25", "randk:0.1+int8:clip=0.25", "randk:0.01+int8:clip=0.25"]
    refused = [
        ({"round_target_s": 30, "secagg": {"enabled": True}, "link": {"codecs": ["topk:0.1+int8"]}}, {}, "secure aggregation"),
        ({"link": {"codecs": ["nonsense"]}}, {}, "unknown codec stage"),
        ({"link": {"min_local_steps": 10, "max_local_steps": 5}}, {}, "exceeds max_local_steps"),
        ({"round_target_s": 0}, {}, "greater than 0"),
        ({"round_target_s": 30}, {"privacy": {"enabled": True, "epsilon": 8}}, "privacy budget"),
    ]
    for federation, site, why in refused:
        with pytest.raises(ValueError, match=why):
            _config(federation, **site)


def test_a_message_s_overhead_is_its_time_outside_the_handler_at_the_slowest_site():
    # discovery's per-site message costs (protocol/message_cost.py): total less handler, the slowest site's
    costs = {"a": {"total_s": 6.0, "handler_s": 1.5, "return_s": 2.0}, "b": {"total_s": 9.0, "handler_s": 2.0},
             "c": {"total_s": 30.0}}  # c's reply carried no handler stamps: nothing to tell apart
    assert message_overhead_s(costs) == pytest.approx(7.0)
    assert message_overhead_s({}) == 0.0 and message_overhead_s({"c": {"total_s": 3.0}}) == 0.0
