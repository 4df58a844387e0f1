"""The coordinator folds SecAgg+ masked replies concurrently (federation/coordinator/reply_folds.py).

The real `Coordinator` and `SecAggRound` over test_secagg_workflow's fake Grid (each site's real
ClientApp and mods in process). What is checked is what happened, from recorded events, never how
long it took: with `federation.receive_workers` >= the sites, every site's fold is running at once
(a barrier the folds meet would break otherwise) and the stage's recorded spans overlap; with 1,
they follow one another; with 2 of 3 sites, the third reply is pulled only once a fold is done.
The ring sum is exact either way (each site's encoded vector is dumped, test_secagg_workflow's
`check_exact`): integer words added modulo 2^32 do not depend on the order or the thread.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from federation.coordinator.reply_folds import StripeLocks
from federation.protocol.message_keys import SECAGG_CHUNKS as CHUNKS
from test_secagg_workflow import SHAPES, _task_identity, check_exact, make  # noqa: F401 (autouse fixture)

SITES = list("abc")
STAGE = "secagg stage 3 (train)"


def _coordinator(tmp_path, workers: int):
    dumps = tmp_path / "dumps"
    # small chunks: each masked vector is several chunks, so the folds contend for the same stripes
    coord, grid = make(tmp_path, n=3, secagg={"chunk_bytes": 64, "threshold": 2},
                       node_config={s: {"secagg-dump-dir": str(dumps / s)} for s in SITES})
    coord.fed = coord.fed.model_copy(update={"receive_workers": workers})
    return coord, grid, dumps


class Recorder:
    """Wraps the strategy's real `receive_masked_input`: records start/end events (and the fake
    grid's pulls of masked replies); the first `meet` folds wait for each other at a barrier."""

    def __init__(self, coord, grid, meet: int = 0, fail: str | None = None):
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.active = self.max_active = 0
        self.barrier = threading.Barrier(meet, timeout=20) if meet else None
        self.met = 0
        self.fail = fail
        real, self.real_pull = coord.protocol.receive_masked_input, grid.pull_messages

        def receive(st, reply):
            with self.lock:
                self.events.append(("start", reply.name))
                self.active += 1
                self.max_active = max(self.max_active, self.active)
                meets = self.barrier is not None and self.met < self.barrier.parties
                self.met += meets
            try:
                if meets:
                    self.barrier.wait()  # BrokenBarrierError unless that many folds run at once
                if reply.name == self.fail:
                    raise RuntimeError(f"fold of {reply.name} failed")
                real(st, reply)
            finally:
                with self.lock:
                    self.active -= 1
                    self.events.append(("end", reply.name))

        def pull(ids):
            out = self.real_pull(ids)
            with self.lock:
                self.events += [("pull", m.metadata.src_node_id) for m in out
                                if m.has_content() and CHUNKS in m.content.array_records]
            return out

        coord.protocol.receive_masked_input = receive  # steps() binds it for the next round
        grid.pull_messages = pull


def _stage(line: dict) -> dict:
    return next(s for s in line["timing"]["stages"] if s["stage"] == STAGE)


def test_every_masked_reply_is_folded_at_once_and_the_sum_stays_exact(tmp_path):
    coord, grid, dumps = _coordinator(tmp_path, workers=3)
    rec = Recorder(coord, grid, meet=3)
    before = {k: v.copy() for k, v in coord.model.items()}
    line = coord.train_round(1)
    assert line["status"] == "aggregated" and line["secagg"]["contributors"] == SITES and not line["failed"]
    # all three folds started before any ended (they met at the barrier), and the stage's spans say so
    assert [e for e, _ in rec.events if e != "pull"][:3] == ["start"] * 3 and rec.max_active == 3
    spans = _stage(line)["receive_spans"]
    assert sorted(spans) == SITES
    assert max(a for a, _ in spans.values()) < min(b for _, b in spans.values())  # one instant inside all three
    assert _stage(line)["receive_busy_s"] >= _stage(line)["receive_s"] > 0
    # the unmasked ring sum is exactly the sum of the sites' encoded vectors, and FedAvg applied it
    mean = check_exact(coord, line, 1, dumps, SITES)
    step = np.concatenate([(coord.model[k] - before[k]).reshape(-1) for k in sorted(SHAPES)])
    np.testing.assert_allclose(step, mean, atol=1e-7)
    assert list(line["sites"]) == SITES  # in site order, not in the order the folds ended


def test_one_worker_folds_one_reply_after_the_other(tmp_path):
    coord, grid, dumps = _coordinator(tmp_path, workers=1)
    rec = Recorder(coord, grid)
    line = coord.train_round(1)
    assert line["status"] == "aggregated" and line["secagg"]["contributors"] == SITES
    folds = [e for e in rec.events if e[0] != "pull"]
    assert [e for e, _ in folds] == ["start", "end"] * 3 and rec.max_active == 1
    spans = sorted(_stage(line)["receive_spans"].values())
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert _stage(line)["receive_busy_s"] == pytest.approx(_stage(line)["receive_s"], abs=1e-3)
    check_exact(coord, line, 1, dumps, SITES)


def test_with_fewer_workers_than_replies_a_reply_waits_on_the_grid_until_a_fold_ends(tmp_path):
    coord, grid, dumps = _coordinator(tmp_path, workers=2)
    rec = Recorder(coord, grid, meet=2)
    line = coord.train_round(1)
    assert line["status"] == "aggregated" and line["secagg"]["contributors"] == SITES
    assert rec.max_active == 2  # two at once (they met), never three
    pulls = [i for i, (e, _) in enumerate(rec.events) if e == "pull"]
    first_end = next(i for i, (e, _) in enumerate(rec.events) if e == "end")
    assert len(pulls) == 3 and pulls[1] < first_end < pulls[2]  # the third pulled once a slot was free
    check_exact(coord, line, 1, dumps, SITES)


def test_a_failing_fold_ends_the_stage_only_after_the_other_folds_end(tmp_path):
    coord, grid, _ = _coordinator(tmp_path, workers=3)
    rec = Recorder(coord, grid, meet=3, fail="b")
    with pytest.raises(RuntimeError, match="fold of b failed"):
        coord.train_round(1)
    assert sorted(n for e, n in rec.events if e == "end") == SITES and rec.active == 0


def test_stripe_locks_hold_the_stripes_a_slice_covers():
    locks = StripeLocks(100, 16)  # stripes [0,16) [16,32) ... [96,100)
    assert len(locks._locks) == 7
    with locks.hold(10, 20):  # words 10..29: stripes 0 and 1
        assert [lk.locked() for lk in locks._locks] == [True, True] + [False] * 5
        got = []
        t = threading.Thread(target=lambda: got.append(locks._locks[1].acquire(timeout=0.05)))
        t.start()
        t.join()
        assert got == [False]  # a fold touching word 16..31 waits
    assert not any(lk.locked() for lk in locks._locks)
    with locks.hold(99, 50):  # clamped to the array
        assert [lk.locked() for lk in locks._locks] == [False] * 6 + [True]
