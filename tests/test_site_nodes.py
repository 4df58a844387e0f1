"""`sovfl site --node-rank N`: what an operator sees when a node of a multi-node site cannot start.

The working two-node site (node 1 through `sovfl site --node-rank 1`) runs in the deployment test,
tests/test_e2e.py::test_coordinator_and_sites_as_separate_commands.
"""

from __future__ import annotations

import pytest

from conftest import sovfl, write_config
from federation.ops.launcher import free_port


@pytest.fixture
def config(tmp_path):
    sites = [{"id": "paris", "ranks": 1, "nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{free_port()}", "partition": 0},
             {"id": "solo", "ranks": 1, "partition": 1}]
    return write_config(tmp_path / "nodes.yaml", {"workload": {"task": "digits", "options": {"hidden": 8}}, "sites": sites})


@pytest.mark.parametrize("site,node_rank,needle", [
    ("paris", "2", "node_rank 2 is outside 0..1"),
    ("paris", "-1", "node_rank -1 is outside 0..1"),
    ("solo", "1", "single-node site (nnodes: 1)"),
])
def test_node_rank_out_of_range_is_refused(config, tmp_path, site, node_rank, needle):
    proc = sovfl("site", str(config), "--site", site, "--node-rank", node_rank, "--workdir", str(tmp_path / "w"),
                 timeout=60)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "w" / "logs").exists()  # nothing was started


def test_unreachable_rendezvous_fails_within_its_deadline(config, tmp_path):
    """Node 1 started while node 0 is not up: a clear error after --rdzv-timeout, no torchrun left."""
    proc = sovfl("site", str(config), "--site", "paris", "--node-rank", "1", "--rdzv-timeout", "1.5",
                 "--workdir", str(tmp_path / "w"), timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "rendezvous endpoint 127.0.0.1:" in proc.stderr and "within 1.5s" in proc.stderr
    assert "start node 0 first" in proc.stderr
    assert not (tmp_path / "w" / "logs").exists()


def test_node_zero_still_needs_the_coordinator_address(config, tmp_path):
    proc = sovfl("site", str(config), "--site", "paris", "--workdir", str(tmp_path / "w"), timeout=60)
    assert proc.returncode == 2 and "--superlink HOST:PORT" in proc.stderr and "node 0" in proc.stderr
