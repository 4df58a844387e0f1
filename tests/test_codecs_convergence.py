"""Convergence: in-process FedAvg on sklearn digits, 4 non-IID sites (Dirichlet 0.5), fixed seeds.

Compressed runs must end within 1 accuracy point of uncompressed FedAvg with the same seeds. The
simulation (benchmarks/_fedsim.py, shared with benchmarks/compression.py) runs the federation's
own coordinator and site code: model messages and downlink, the site codec stage with error
feedback, the coordinator's decode pipeline, weighted mean or SecAgg+ masking and unmasking, and
the server optimizer; its docstring lists what differs from a deployment.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._fedsim import run_fedavg  # noqa: E402

pytestmark = pytest.mark.slow(seconds=120)

COMPRESSED = [
    # (uplink codec, options)
    ("int8", {}),
    ("topk:0.01", {}),
    ("randk:0.1+int8:clip=0.5", {"secagg": True}),  # the secure-aggregation-compatible chain, masked
    ("topk:0.01+int4", {}),  # the sealed-mode headline codec of benchmarks/compression.py
    ("int8", {"downlink": "int8"}),  # compressed both ways
]


@pytest.fixture(scope="module")
def baseline():
    return run_fedavg(None)


def test_uncompressed_fedavg_reaches_good_accuracy(baseline) -> None:
    assert baseline.accuracy >= 0.95
    assert baseline.mean_site_bytes == baseline.dense_bytes and baseline.down_ratio < 1  # dense both ways


@pytest.mark.parametrize(("codec", "options"), COMPRESSED, ids=[f"{c}-{o}" for c, o in COMPRESSED])
def test_compressed_fedavg_within_one_point_of_uncompressed(baseline, codec: str, options: dict) -> None:
    result = run_fedavg(codec, error_feedback=True, **options)
    drop_pts = 100 * (baseline.accuracy - result.accuracy)
    assert drop_pts <= 1.0, f"{result.codec}: {100 * result.accuracy:.2f}% vs {100 * baseline.accuracy:.2f}%"
    assert result.mean_site_bytes < result.dense_bytes / 3
    if "downlink" in options:
        assert result.down_ratio > 2.5  # 650 parameters: int8 plus block scales and array headers
