"""round_target_s in a federation: the real Coordinator and the real ClientApp mods over the in-process
grid (federation/ops/inprocess.py), the real gRPC data path (mutual TLS) between them. Site s0 reaches
the data path on loopback, s1 through a shaped link (20 Mbit/s, 20 ms: network namespaces, tbf, the
delay line; loopback too where the harness cannot run), s2 has no data path (its link is timed
through Flower). Every site's link is measured at discovery and again before round 3; each round's
codec and local steps are chosen from those figures, logged with the reason, recorded in the
metrics line, and are what the sites were told and did."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from crypto.pki import CoordinatorBundle, provision
from federation.ops.supervisor import free_port
from federation.config.schema import ExperimentConfig
from federation.coordinator.bulk_server import BulkServer
from federation.coordinator.driver import Coordinator
from federation.coordinator.round_plan import choose
from federation.ops.report_cmd import build_report
from federation.ops.inprocess import FunctionTrainer, InProcessGrid, InProcessSite, task_identity
from federation.protocol.link_probe import LinkFigures

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.shaped_link import ShapedLink, available  # noqa: E402
from system_packages import SHAPED_LINKS, install  # noqa: E402

pytestmark = pytest.mark.slow(seconds=45)  # three in-process federations, one through a shaped link

SHAPES = {"w": (700, 600), "v": (300, 1000), "b": (50,)}  # 2.9 MB of float32
STEP_S = {"s0": 0.01, "s1": 0.005, "s2": 0.02}  # each site's declared seconds per local step


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    provision(root, ["s0", "s1", "s2"], hosts=("127.0.0.1", "localhost"))
    return root


def _sites(tmp_path, pki, addresses: dict[str, str], told: dict[str, list], estimates: bool = False):
    def trainer(i, name):
        def train(model, cfg):
            told[name].append((cfg.round, cfg.codec, cfg.local_steps))
            steps = cfg.local_steps or 10  # the site's own local_steps when the round chooses none
            rng = np.random.default_rng([i, cfg.round])
            delta = {k: (0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.items()}
            return delta, {"loss": 1.0 / cfg.round, "train_s": steps * STEP_S[name]}
        # `estimates`: each declares its step time at discovery, as the site trainer times one at its start
        # each also built the coordinator's starting model, and shows it at discovery: round 1 sends none
        return FunctionTrainer(train, 10 * (i + 1), tmp_path / name, step_s_estimate=STEP_S[name] if estimates else None,
                               holds=_initial())

    sites = []
    for i, name in enumerate(("s0", "s1", "s2")):
        nc = {"bundle-dir": str(pki / "sites" / name), "codec-site-seed": str(i + 1)}
        if name in addresses:
            nc["data-address"] = addresses[name]
        sites.append(InProcessSite(name, i + 1, trainer(i, name), nc, 1))
    return sites


@pytest.mark.parametrize("protection", [{"seal": True}, {"secagg": {"enabled": True, "threshold": 2, "clip": 0.5}}],
                         ids=["sealed", "secagg"])
def test_each_round_s_codec_and_steps_are_chosen_from_the_measured_links_applied_and_logged(tmp_path, pki, protection):
    cfg = ExperimentConfig.model_validate({
        "federation": {"name": "target", "rounds": 3, "quorum": 2, "evaluate": False, "seed": 5, **protection,
                       "round_target_s": 3.0, "downlink_codec": "int8",
                       "link": {"probe_seconds": 0.5, "probe_max_bytes": 8 << 20, "probe_flower_bytes": 1 << 20,
                                "probe_every": 2, "max_local_steps": 400}},
        "sites": [{"id": f"s{i}", "partition": i} for i in range(3)],
    })
    bundle = CoordinatorBundle.load(pki / "coordinator")
    port = free_port()
    server = BulkServer(bundle, tmp_path / "coord", f"127.0.0.1:{port}").start()
    told: dict[str, list] = {"s0": [], "s1": [], "s2": []}
    lines: list[str] = []
    shaped = install(SHAPED_LINKS) is None and available() is None  # else s1's link is plain loopback
    try:
        with (ShapedLink(rate_mbit=20, rtt_ms=20) if shaped else contextlib.nullcontext()) as link:
            s1 = f"127.0.0.1:{link.forward(('127.0.0.1', server.port))}" if shaped else f"127.0.0.1:{port}"
            grid = InProcessGrid(_sites(tmp_path, pki, {"s0": f"127.0.0.1:{port}", "s1": s1}, told, estimates=True), 1)
            coord = Coordinator(grid, cfg, tmp_path / "coord", 1, _initial(), lines.append, bundle, bulk=server)
            with task_identity(1):
                result = coord.run()
    finally:
        server.stop()
    metrics = [json.loads(x) for x in coord.metrics_path.read_text().splitlines()]
    assert result["aggregated_rounds"] == 3, lines

    # the links: measured where updates travel, at discovery (round 0) and again before round 3
    for line in metrics:
        assert line["data_path"]["s0"] == line["data_path"]["s1"] == "direct"
        assert line["data_path"]["s2"].startswith("flower: no data-address")
    first, last = metrics[0]["links"], metrics[2]["links"]
    assert [first[s]["path"] for s in ("s0", "s1", "s2")] == ["bulk", "bulk", "flower"]
    assert {first[s]["round"] for s in first} == {0} and {last[s]["round"] for s in last} == {3}
    if shaped:  # s1's link is the shaped one: the slowest, and measured as such
        for figs in (first, last):
            # (tests/test_link_probe.py holds the probe to 20% of nominal; here the machine also runs the
            # round, and load only ever adds to an echo: the RTT is at least the delay line's 20 ms and
            # under two of them, one round trip through the link)
            assert abs(figs["s1"]["up_mbit"] - 20) <= 4 and 19 <= figs["s1"]["rtt_ms"] < 40, figs["s1"]
    assert sum("link measured on the data path" in x for x in lines) == 4  # s0 and s1, twice
    assert sum("link measured through Flower" in x for x in lines) == 2

    # the choices: logged with their reason, in the line, and what every site was told and did
    ladder = cfg.federation.codec_ladder
    for rnd, line in enumerate(metrics, start=1):
        plan = line["round_plan"]
        assert plan["round"] == rnd and plan["codec"] in ladder and plan["reason"]
        assert any(x.startswith(f"round {rnd}: round target 3s: codec {plan['codec']}") for x in lines), lines
        for site in ("s0", "s1", "s2"):
            assert (rnd, plan["codec"], plan["local_steps"]) in told[site], (site, told[site])
    # round 1: no step measured yet; the sites' estimates from discovery plan it (nothing to overlap yet),
    # its fixed cost is the discovery's slowest message overhead once per message the round sends, and no
    # model goes down (every site said at discovery it holds the starting model)
    plan = metrics[0]["round_plan"]
    messages = 2 if "secagg" in protection else 1
    assert coord.message_overhead_s > 0
    assert plan["fixed_s"] == pytest.approx(messages * coord.message_overhead_s, abs=1e-4)
    figs = {s: LinkFigures(**{k: v for k, v in f.items()}) for s, f in metrics[0]["links"].items()}
    up = coord.planner.sizes([], 720050)[0]
    again = choose(1, 3.0, figs, STEP_S, ladder, up, 0.0, max_steps=400, fallback_codec=cfg.federation.codec,
                   estimated=frozenset(STEP_S), fixed_s=messages * coord.message_overhead_s)
    assert (again.codec, again.local_steps) == (plan["codec"], plan["local_steps"]) and plan["local_steps"] >= 1
    assert "its trainer's estimate at start-up" in plan["reason"] and "no model goes down" in plan["reason"]
    assert metrics[0]["downlink"]["modes"] == {"hold": 3} and "no model goes down" not in metrics[1]["round_plan"]["reason"]
    for rnd in (2, 3):  # from then on the rule's own result on the figures the line records
        line, before = metrics[rnd - 1], metrics[rnd - 2]
        plan = line["round_plan"]
        figs = {s: LinkFigures(**{k: v for k, v in f.items()}) for s, f in line["links"].items()}
        steps_before = before["round_plan"]["local_steps"] or 10
        step_s = {s: m["seconds"] / steps_before for s, m in before["sites"].items()}
        assert step_s == pytest.approx(STEP_S)
        up = {c: coord.planner.sizes(metrics[:rnd - 1], 720050)[0][c] for c in ladder}
        down = coord.planner.sizes(metrics[:rnd - 1], 720050)[1] or 720050 * 4
        fixed = coord.planner.fixed_s(metrics[:rnd - 1])
        assert plan["fixed_s"] == pytest.approx(fixed, abs=1e-4)
        again = choose(rnd, 3.0, figs, step_s, ladder, up, down, max_steps=400, fallback_codec=cfg.federation.codec,
                       fixed_s=fixed)
        assert (again.codec, again.local_steps) == (plan["codec"], plan["local_steps"])
        assert 1 <= plan["local_steps"] < 400 and plan["slowest"] in ("s1", "s2")
        if plan["codec"] != ladder[0]:  # a lossy round: the updates really were smaller
            assert all(m["upload_bytes"] < 0.5 * 720050 * 4 for m in line["sites"].values()), line["sites"]

    # the run report shows the links and the choices
    page = build_report(tmp_path / "coord").read_text()
    assert "Links as measured (link probe)" in page and "Codec and local steps chosen for the round target" in page
    assert page.count("<td>flower</td>") == 2 and metrics[1]["round_plan"]["codec"] in page


class _Died(BaseException):
    """Stands for the coordinator process dying (nothing in the driver catches it)."""


class _DiesAtTrain(InProcessGrid):
    def __init__(self, sites, run_id, at):
        super().__init__(sites, run_id)
        self.at, self.trains = at, 0

    def push_messages(self, messages):
        messages = list(messages)
        ids = super().push_messages(messages)
        if messages and messages[0].metadata.message_type == "train":
            self.trains += 1
            if self.trains == self.at:
                raise _Died
        return ids


def test_a_resumed_run_measures_again_and_chooses_from_the_restored_history(tmp_path, pki):
    cfg = ExperimentConfig.model_validate({
        "federation": {"name": "target-resume", "rounds": 3, "quorum": 2, "evaluate": False, "seed": 5,
                       "round_target_s": 3.0, "downlink_codec": "int8", "data_path": {"enabled": False},
                       "link": {"probe_flower_bytes": 1 << 16, "max_local_steps": 400}},
        "sites": [{"id": f"s{i}", "partition": i} for i in range(3)],
    })
    told: dict[str, list] = {"s0": [], "s1": [], "s2": []}
    sites = _sites(tmp_path, pki, {}, told)  # no data path: every link timed through Flower
    lines: list[str] = []
    bundle = CoordinatorBundle.load(pki / "coordinator")
    first = Coordinator(_DiesAtTrain(sites, 1, at=2), cfg, tmp_path / "coord", 1, _initial(), lines.append, bundle)
    with task_identity(1), pytest.raises(_Died):
        first.run()
    before = [json.loads(x) for x in first.metrics_path.read_text().splitlines()]
    assert [m["round"] for m in before] == [1] and before[0]["status"] == "aggregated"
    assert before[0]["round_plan"]["local_steps"] is None
    lines.clear()
    coord = Coordinator(InProcessGrid(sites, 2), cfg, tmp_path / "coord", 2, _initial(), lines.append, bundle)
    with task_identity(2):
        result = coord.run(resume=True)
    metrics = [json.loads(x) for x in coord.metrics_path.read_text().splitlines()]
    assert result["aggregated_rounds"] == 3 and [m["round"] for m in metrics] == [1, 2, 3], (result, "\n".join(lines))
    assert metrics[0]["round_plan"] == before[0]["round_plan"]  # a round done keeps the choice its line records
    assert sum("link measured through Flower" in x for x in lines) == 3, lines  # measured again at the resumed discovery
    # the rerun round 2 is chosen from the restored history: round 1's step times are known
    assert metrics[1]["round_plan"]["local_steps"] is not None and "no step time" not in metrics[1]["round_plan"]["reason"]
    for site in told:
        assert (2, metrics[1]["round_plan"]["codec"], metrics[1]["round_plan"]["local_steps"]) in told[site]
