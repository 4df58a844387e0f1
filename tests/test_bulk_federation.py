"""The bulk data path inside a federation: the real Coordinator and the real ClientApp mods over the
in-process grid (federation/ops/inprocess.py), with the real gRPC data path between them (mutual TLS,
provisioned certificates). The model and the updates leave the Flower messages and the run is bit for
bit the run without the data path; a SuperLink answering HTTP 500 `database is locked` is retried
and the rounds complete."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from crypto.pki import CoordinatorBundle, provision
from federation.ops.supervisor import free_port
from federation.config.schema import ExperimentConfig
from federation.coordinator.bulk_server import BulkServer
from federation.coordinator.driver import Coordinator
from federation.coordinator.retry_grid import RetryingGrid, transient
from federation.ops.inprocess import FunctionTrainer, InProcessGrid, InProcessSite, task_identity
from federation.protocol.bulk import REF_STYPE

SHAPES = {"w": (700, 600), "v": (300, 1000), "b": (50,)}  # two Arrays over the inline limit, one under


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def _cfg(**federation) -> ExperimentConfig:
    return ExperimentConfig.model_validate({
        "federation": {"name": "bulk", "rounds": 2, "quorum": 2, "evaluate": False, "seed": 5, **federation},
        "sites": [{"id": f"s{i}", "partition": i} for i in range(2)],
    })


def _sites(tmp_path, pki, data: str | None, without: set[str] = frozenset()):
    def trainer(i):
        def train(model, cfg):
            rng = np.random.default_rng([i, cfg.round])
            delta = {k: (0.01 * rng.standard_normal(v.shape) - 0.1 * v).astype(np.float32) for k, v in model.items()}
            return delta, {"loss": float(i + cfg.round)}
        return FunctionTrainer(train, 10 * (i + 1), tmp_path / f"s{i}", handoff_update=True)  # streamed, as the service's

    sites = []
    for i in range(2):
        name = f"s{i}"
        nc = {"bundle-dir": str(pki / "sites" / name), "codec-site-seed": str(i + 1)}
        if data and name not in without:
            nc["data-address"] = data
        sites.append(InProcessSite(name, i + 1, trainer(i), nc, 1))
    return sites


class Tapped(InProcessGrid):
    """Records whether any message or reply carried a large Array through Flower, or a reference."""

    def __init__(self, sites, run_id=1, fail_every: int = 0):
        super().__init__(sites, run_id)
        self.inline = self.refs = 0
        self.fail_every, self.calls, self.failures = fail_every, 0, 0

    def _flaky(self, what: str):
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            self.failures += 1
            req = httpx.Request("POST", f"http://127.0.0.1/{what}")
            raise httpx.HTTPStatusError("Server error '500 Internal Server Error': sqlite3.OperationalError: "
                                        "database is locked", request=req, response=httpx.Response(500, request=req))

    def _count(self, msgs):
        for m in msgs:
            if m.has_content():
                for rec in m.content.array_records.values():
                    for a in rec.values():
                        self.refs += a.stype == REF_STYPE
                        self.inline += a.stype != REF_STYPE and len(a.data) >= 1 << 20

    def push_messages(self, messages):
        self._flaky("push-messages")
        messages = list(messages)
        self._count(messages)
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        self._flaky("pull-messages")
        out = super().pull_messages(message_ids)
        self._count(out)
        return out

    def get_node_ids(self):
        self._flaky("get-nodes")
        return super().get_node_ids()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    provision(root, ["s0", "s1"], hosts=("127.0.0.1", "localhost"))
    return root


def _run(tmp_path, pki, cfg, bulk: bool, fail_every: int = 0, without: set[str] = frozenset()):
    bundle = CoordinatorBundle.load(pki / "coordinator")
    server = None
    if bulk:
        port = free_port()
        server = BulkServer(bundle, tmp_path / "coord", f"127.0.0.1:{port}").start()
    grid = Tapped(_sites(tmp_path, pki, f"127.0.0.1:{port}" if bulk else None, without), 1, fail_every)
    lines: list[str] = []
    coord = Coordinator(grid, cfg, tmp_path / "coord", 1, _initial(), lines.append, bundle, bulk=server)
    try:
        with task_identity(1):
            result = coord.run()
    finally:
        if server is not None:
            stats = (server.bytes_in, server.bytes_out)
            server.stop()
    metrics = [json.loads(x) for x in coord.metrics_path.read_text().splitlines()]
    return coord, result, metrics, grid, lines, stats if bulk else None


@pytest.mark.parametrize("protection", [{"seal": True}, {"secagg": {"enabled": True, "threshold": 2, "clip": 0.5}}],
                         ids=["sealed", "secagg"])
def test_model_and_updates_travel_on_the_data_path_and_change_nothing(tmp_path, pki, protection, monkeypatch):
    cfg = _cfg(**protection)
    ref, ref_result, _, ref_grid, _, _ = _run(tmp_path / "flower", pki, cfg, bulk=False)
    assert ref_grid.inline > 0 and ref_grid.refs == 0
    from federation.site import secagg_mod

    def never(*args, **kwargs):  # on the data path the update is masked from the trainer's file, never whole
        raise AssertionError("the SecAgg update was masked whole in the ClientApp")

    monkeypatch.setattr(secagg_mod, "on_train", never)
    coord, result, metrics, grid, lines, (bytes_in, bytes_out) = _run(tmp_path / "bulk", pki, cfg, bulk=True)
    assert result["aggregated_rounds"] == ref_result["aggregated_rounds"] == 2
    for k in ref.model:  # the same run, bit for bit
        assert np.array_equal(coord.model[k], ref.model[k]), k
    assert grid.inline == 0 and grid.refs > 0, "a large Array still went through Flower"
    big = sum(np.prod(s) * 4 for s in SHAPES.values() if np.prod(s) * 4 >= 1 << 20)
    assert bytes_out >= 2 * 2 * big and bytes_in >= 2 * 2 * big  # 2 sites x 2 rounds, each way
    for line in metrics:
        assert line["data_path"] == {"s0": "direct", "s1": "direct"}
        for site in line["sites"].values():
            assert site["bulk_up_bytes"] >= big and site["bulk_down_bytes"] >= big
        assert not any(k.startswith("bulk_") for k in line["rejections"])
    assert any("model and updates travel direct" in x for x in lines)


def test_a_site_without_the_data_path_goes_through_flower_and_says_so(tmp_path, pki):
    cfg = _cfg(seal=True)
    coord, result, metrics, grid, lines, _ = _run(tmp_path, pki, cfg, bulk=True, without={"s1"})
    assert result["aggregated_rounds"] == 2
    assert metrics[-1]["data_path"]["s0"] == "direct"
    assert metrics[-1]["data_path"]["s1"].startswith("flower: no data-address")
    assert any("site s1: model and updates travel through Flower" in x for x in lines), lines
    assert grid.inline > 0 and grid.refs > 0


def test_superlink_errors_are_retried_and_the_rounds_complete(tmp_path, pki):
    cfg = _cfg(seal=True)
    ref, _, _, _, _, _ = _run(tmp_path / "ref", pki, cfg, bulk=True)
    coord, result, metrics, grid, lines, _ = _run(tmp_path / "flaky", pki, cfg, bulk=True, fail_every=3)
    assert grid.failures >= 3
    assert result["aggregated_rounds"] == 2 and result["status"] == "ok"
    for k in ref.model:
        assert np.array_equal(coord.model[k], ref.model[k]), k
    assert sum(sum(m.get("superlink_retries", {}).values()) for m in metrics[-1:]) == grid.failures
    assert any("database is locked" in x and "retrying" in x for x in lines), lines


def test_a_superlink_down_past_the_budget_ends_the_run_with_a_clear_error():
    class Down:
        def get_node_ids(self):
            raise httpx.ConnectError("Connection refused")

    waits: list[float] = []
    grid = RetryingGrid(Down(), budget_s=0.0, sleep=waits.append)
    with pytest.raises(TimeoutError, match="superlink_retry_s.*--resume"):
        grid.get_node_ids()
    assert not transient(ValueError("a bug")) and transient(httpx.ReadError("reset"))


@pytest.mark.parametrize("protection,what", [({"seal": True}, "sealed"),
                                              ({"secagg": {"enabled": True, "threshold": 2, "clip": 0.5}}, "masked")],
                         ids=["sealed", "secagg"])
def test_a_site_that_cannot_write_its_update_file_protects_it_in_memory(tmp_path, pki, monkeypatch, capfd,
                                                                        protection, what):
    """The streamed path's file cannot be written (a full or missing disk): the update is read from
    the trainer's file and sealed (or masked) whole, as without the data path, before any mask is
    drawn, and the rounds complete."""
    from federation.site import update_stream

    monkeypatch.setattr(update_stream, "sealed_dir", lambda: str(tmp_path / "no" / "such" / "dir"))
    cfg = _cfg(**protection)
    _, result, metrics, grid, _, _ = _run(tmp_path / "bulk", pki, cfg, bulk=True)
    assert result["aggregated_rounds"] == 2
    assert grid.inline == 0 and all(s["bulk_up_bytes"] > 0 for line in metrics for s in line["sites"].values())
    assert not any(line["rejections"] for line in metrics)
    assert capfd.readouterr().err.count(f"cannot write the {what} update to a file") == 4  # 2 sites x 2 rounds


def test_the_trainer_reads_the_model_from_the_file_it_was_downloaded_into(tmp_path, pki):
    """On the data path the trainer call gets the model in the very file the bulk mod downloaded it
    into (the message carries where it lies to the downlink mod: site/carried.py), never a copy."""
    seen: list[bool] = []

    class Recording(FunctionTrainer):
        def train(self, model, config):
            seen.append(model.temporary)  # True: a temporary copy of the message's model
            return super().train(model, config)

    def train(model, cfg):
        return {k: (0.01 * v).astype(np.float32) for k, v in model.items()}, {"loss": 1.0}

    bundle = CoordinatorBundle.load(pki / "coordinator")
    port = free_port()
    server = BulkServer(bundle, tmp_path / "coord", f"127.0.0.1:{port}").start()
    sites = [InProcessSite(f"s{i}", i + 1, Recording(train, 10, tmp_path / f"s{i}", handoff_update=True),
                           {"bundle-dir": str(pki / "sites" / f"s{i}"), "data-address": f"127.0.0.1:{port}"}, 1)
             for i in range(2)]
    coord = Coordinator(Tapped(sites), _cfg(seal=True), tmp_path / "coord", 1, _initial(), lambda line: None, bundle,
                        bulk=server)
    try:
        with task_identity(1):
            result = coord.run()
    finally:
        server.stop()
    assert result["aggregated_rounds"] == 2
    assert seen == [False] * 4  # 2 sites x 2 rounds, each from its downloaded file
