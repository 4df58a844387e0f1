"""End to end: three sites, each with its own local strategy (ddp, zero2, zero3), in one federation."""

from __future__ import annotations


import pytest

from conftest import assert_weighted_mean_rounds, live_marked, sovfl, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=90)]

STRATEGIES = {"paris": "ddp", "frankfurt": "zero2", "milan": "zero3"}


def test_three_sites_three_strategies(tmp_path, marker):
    """A tiny GPT trained by a DDP site, a ZeRO-2 site and a ZeRO-3 site (2 ranks each): every round
    aggregates all three, the global model is exactly their weighted mean, and within each site the
    ranks agree on the full weights (under ZeRO: the model each rank assembles from all shards)."""
    sites = [{"id": name, "ranks": 2, "partition": i, "local_steps": 3, "batch_size": 8, "lr": 3e-3,
              "optimizer": "adamw", "parallelism": strategy, "dump_updates": True}
             for i, (name, strategy) in enumerate(STRATEGIES.items())]
    cfg = {
        "federation": {"name": "strategies", "rounds": 2, "quorum": 3, "update_kind": "weights", "evaluate": False,
                       "deadlines": {"connect_s": 60, "round_s": 90, "trainer_start_s": 150}},
        "workload": {"task": "slm", "options": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16,
                     "corpus_bytes_per_site": 20_000}},
        "sites": sites,
    }
    path = write_config(tmp_path / "strategies.yaml", cfg)
    run = tmp_path / "run"
    proc = sovfl("simulate", str(path), "--workdir", str(run), env={"SOVFL_RUN_MARKER": marker}, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT rounds=2" in proc.stdout
    for name, strategy in STRATEGIES.items():
        log = (run / "logs" / f"site-{name}-trainer.log").read_text()
        assert f"parallelism {strategy}" in log, log[-2000:]
    assert_weighted_mean_rounds(run, set(STRATEGIES), ranks=2, rounds=2)
    assert live_marked(marker) == []
