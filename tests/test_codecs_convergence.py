"""Codec-level convergence: in-process FedAvg on sklearn digits, 4 non-IID sites (Dirichlet 0.5).

Compressed runs must end within 1 accuracy point of uncompressed FedAvg with the same seeds.
The simulation lives in benchmarks/_fedsim.py (shared with benchmarks/compression.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._fedsim import run_fedavg  # noqa: E402

COMPRESSED = [
    # (codec, sum encoded payloads like SecAgg does)
    ("int8", False),
    ("topk:0.01", False),
    ("randk:0.1+int8:clip=0.5", True),  # the secure-aggregation-compatible chain
    ("topk:0.01+int4", False),  # the sealed-mode headline codec of benchmarks/compression.py
]


@pytest.fixture(scope="module")
def baseline():
    return run_fedavg(None)


def test_uncompressed_fedavg_reaches_good_accuracy(baseline) -> None:
    assert baseline.accuracy >= 0.95


@pytest.mark.parametrize(("codec", "sum_encoded"), COMPRESSED)
def test_compressed_fedavg_within_one_point_of_uncompressed(baseline, codec: str, sum_encoded: bool) -> None:
    result = run_fedavg(codec, error_feedback=True, sum_encoded=sum_encoded)
    drop_pts = 100 * (baseline.accuracy - result.accuracy)
    assert drop_pts <= 1.0, f"{result.codec}: {100 * result.accuracy:.2f}% vs {100 * baseline.accuracy:.2f}%"
    assert result.mean_site_bytes < result.dense_bytes / 3
