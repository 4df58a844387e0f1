"""The rules benchmarks/wan_time_to_loss.py times by: first crossing, the anchor, the data sizing."""

import math

import pytest

from benchmarks._time_to_loss import (choose_anchor, passes, split_breakdown, text_bytes_per_site, time_to,
                                      tokens_read_per_site)


def test_time_is_the_first_evaluation_at_or_below_the_target_on_a_curve_that_rises_again():
    # the Flower run: it reaches 8.442 at 391 s, rises, and ends at 8.44 after 1035 s
    curve = [(128.0, 10.72), (261.0, 9.04), (391.0, 8.43), (518.0, 8.36), (646.0, 8.39), (771.0, 8.43),
             (904.0, 8.46), (1035.0, 8.44)]
    assert time_to(curve, 8.442) == 391.0
    assert time_to(curve, 8.36) == 518.0  # equal counts as reached
    assert time_to(curve, 8.0) == math.inf
    assert time_to([], 1.0) == math.inf


def test_the_anchor_is_the_setting_first_at_the_lowest_loss_any_setting_reached():
    curves = {
        5: [(100.0, 9.5), (200.0, 9.0), (300.0, 8.7), (400.0, 8.5)],
        30: [(130.0, 9.0), (260.0, 8.4), (390.0, 8.3), (520.0, 8.35)],  # best 8.3 at 390 s, then rises
        60: [(200.0, 8.9), (400.0, 8.45), (600.0, 8.3)],  # reaches 8.3 too, but later
    }
    a = choose_anchor(curves)
    assert (a.local_steps, a.target, a.seconds) == (30, 8.3, 390.0)
    assert a.per_setting[5] == {"best_loss": 8.5, "time_to_target_s": math.inf}
    assert a.per_setting[60]["time_to_target_s"] == 600.0
    # a tie in time goes to the setting with fewer local steps
    tie = choose_anchor({60: [(10.0, 1.0)], 30: [(10.0, 1.0)]})
    assert tie.local_steps == 30


def test_a_setting_without_evaluations_is_reported_and_never_the_anchor():
    a = choose_anchor({5: [], 30: [(50.0, 2.0)]})
    assert a.local_steps == 30
    assert a.per_setting[5] == {"best_loss": math.inf, "time_to_target_s": math.inf}
    with pytest.raises(ValueError, match="no Flower setting"):
        choose_anchor({5: [], 30: []})


def test_text_is_sized_so_the_longest_run_passes_over_it_at_most_max_passes_times():
    tokens = tokens_read_per_site(rounds=10, local_steps=60, batch=4, seq_len=64)
    assert tokens == 153_600
    size = text_bytes_per_site(tokens, bytes_per_token=3.5, max_passes=1.0)
    train_tokens = size * 0.9 / 3.5
    assert passes(tokens, train_tokens) <= 1.0 + 1e-9
    assert passes(tokens, train_tokens) > 0.99  # not more than asked
    # two passes allowed: half the text; the overlap's step factor reads more
    assert text_bytes_per_site(tokens, 3.5, 2.0) == pytest.approx(size / 2, abs=1)
    assert tokens_read_per_site(10, 60, 4, 64, steps_factor=1.5) == int(1.5 * tokens)
    # the setting: 54 kB of training text for 8 rounds of 30 steps is several passes
    assert passes(tokens_read_per_site(8, 30, 4, 64), 54_000 / 3.5) > 3
    with pytest.raises(ValueError):
        text_bytes_per_site(tokens, 0.0, 1.0)


def test_round_split_into_training_transfer_and_fixed_cost():
    assert split_breakdown(100.0, 60.0, 25.0) == {"round_s": 100.0, "training_s": 60.0, "transfer_s": 25.0,
                                                  "fixed_s": 15.0}
    # overlapped training and transfer: fixed cost is never negative
    assert split_breakdown(50.0, 45.0, 30.0)["fixed_s"] == 0.0
