"""EvalAnnouncer (federation/coordinator/evaluation.py): a round's evaluation of the model before it is
said once, as soon as it is known: from every site's early report on the data path, else from the
train replies; the e2e run in tests/test_codec_pipeline.py sees it through real processes."""

from __future__ import annotations

import time

import pytest

from federation.coordinator.evaluation import EvalAnnouncer, EvalTotals


def _totals(*figures: tuple[float, int]) -> EvalTotals:
    t = EvalTotals()
    for loss, n in figures:
        t.add({"eval_loss": loss, "num_val_examples": n})
    return t


def test_the_sites_early_reports_say_it_once_weighted_by_their_examples():
    lines: list[str] = []
    a = EvalAnnouncer(3, {"paris", "berlin"}, lines.append, time.monotonic())
    a.report("paris", 3, {"eval_loss": 2.0, "num_val_examples": 30.0})
    a.report("paris", 3, {"eval_loss": 9.0, "num_val_examples": 30.0})  # a second word from a site counts once
    a.report("oslo", 3, {"eval_loss": 9.0, "num_val_examples": 30.0})  # not sampled in this round
    a.report("berlin", 2, {"eval_loss": 9.0, "num_val_examples": 30.0})  # late, for the round before
    assert lines == [] and a.known_s is None
    a.report("berlin", 3, {"eval_loss": 4.0, "num_val_examples": 10.0})
    assert lines == ["round 3: the model of round 2 evaluated by 2 site(s), reported on the data path before their "
                     f"local steps: eval_loss=2.5000, {a.known_s:.1f}s into the round"]  # (2 x 30 + 4 x 10) / 40
    a.replies(_totals((7.0, 30), (7.0, 10)))  # the replies come after: nothing more is said
    assert len(lines) == 1 and a.known_s == pytest.approx(0.0, abs=5.0)


def test_without_every_early_report_the_train_replies_say_it():
    lines: list[str] = []
    a = EvalAnnouncer(1, {"paris", "berlin"}, lines.append, time.monotonic())
    a.report("paris", 1, {"eval_loss": 2.0, "num_val_examples": 30.0})  # berlin has no data path
    a.replies(EvalTotals())  # a stage without train replies (none carried figures): not yet
    assert lines == []
    a.replies(_totals((3.0, 30), (5.0, 10)))
    assert len(lines) == 1 and "evaluated by 2 site(s), in their train replies: eval_loss=3.5000" in lines[0]
    a.report("berlin", 1, {"eval_loss": 1.0, "num_val_examples": 10.0})
    assert len(lines) == 1
