"""Which rendezvous a node >= 1 of a multi-node site joins when the pool starts again
(site_trainer.launch.read_rdzv_id), against a real TCPStore like the one node 0's torchrun agent
hosts at the site's rendezvous endpoint."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from federation.ops.launcher import free_port
from site_trainer.config import SiteConfig
from site_trainer.launch import RDZV_ID_KEY, publish_rdzv_id, read_rdzv_id


@pytest.fixture
def site_and_store():
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield SiteConfig(id="paris", partition=0, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}"), store


def test_a_restarted_node_waits_for_the_id_of_node_0s_new_pool(site_and_store):
    """Read while node 0's old agent still holds the old id, a restarted node gets the new one."""
    site, store = site_and_store
    publish_rdzv_id(site, "old", 5)
    threading.Timer(1.0, lambda: store.set(RDZV_ID_KEY, "new")).start()
    t0 = time.monotonic()
    assert read_rdzv_id(site, 10, not_id="old") == "new"
    assert time.monotonic() - t0 >= 0.9


def test_first_start_takes_the_published_id_and_a_stale_id_is_taken_at_the_deadline(site_and_store):
    """No last pool: the id there. Still the old id at the deadline: that one (node 0's pool may be
    waiting in it, e.g. after this node failed to join)."""
    site, _ = site_and_store
    publish_rdzv_id(site, "current", 5)
    assert read_rdzv_id(site, 5) == "current"
    assert read_rdzv_id(site, 1.5, not_id="current") == "current"


def test_no_store_is_an_error_that_names_the_endpoint():
    site = SiteConfig(id="paris", partition=0, nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}")
    with pytest.raises(RuntimeError, match="no rendezvous id in node 0's store at 127.0.0.1:"):
        read_rdzv_id(site, 1.0)
