"""Shared fixtures: e2e runs of `sovfl simulate` as a real subprocess tree on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def simulate_ok(cfg: dict, run: Path, **kw) -> tuple[str, list[dict]]:
    """A federation of config `cfg` simulated in `run` (launcher.simulate), asserted ok: its progress
    log and metrics lines."""
    from federation.ops import launcher

    out: list[str] = []
    result = launcher.simulate(write_config(run.with_suffix(".yaml"), cfg), run, out.append, **kw)
    log = "\n".join(out)
    assert result["status"] == "ok", log
    return log, [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def digits_site(i: int, name: str, ranks: int, **kw) -> dict:
    """A site entry of a digits federation (partition i), for e2e configurations."""
    return {"id": name, "ranks": ranks, "partition": i, "local_steps": 5, "batch_size": 16, "lr": 0.1, **kw}


def _env(env: dict | None) -> dict:
    return {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", **(env or {})}


def sovfl(*args: str, env: dict | None = None, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """Run the `sovfl` CLI to completion, output captured."""
    return subprocess.run([sys.executable, "-m", "federation.ops.cli", *args], capture_output=True, text=True,
                          env=_env(env), timeout=timeout, cwd=ROOT, **kw)


def as_foreground() -> None:
    """preexec_fn: SIGINT as a terminal's foreground command has it. A shell without job control
    starts `cmd &` with SIGINT ignored and children inherit that, so a suite run that way would
    otherwise see the tests' Ctrl-C ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def sovfl_popen(*args: str, env: dict | None = None) -> subprocess.Popen:
    """Start the `sovfl` CLI in the background, stdout and stderr merged; Ctrl-C (SIGINT) reaches it."""
    return subprocess.Popen([sys.executable, "-m", "federation.ops.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(env), cwd=ROOT, preexec_fn=as_foreground)


def _seconds(item: pytest.Item) -> float:
    mark = item.get_closest_marker("slow")
    return float(mark.kwargs.get("seconds", 0)) if mark else 0.0


def pytest_collection_modifyitems(session, config, items):  # noqa: ARG001 - pytest's hook signature
    """The longest files first (`pytest.mark.slow(seconds=...)`: about what a file takes under
    `make test`), then the other end-to-end files, then the rest in collection order.

    `make test` runs whole files per worker in this order (`--dist loadfile --no-loadscope-reorder`),
    so the long poles, e2e federations that mostly wait on their processes, start at once and the
    CPU-bound unit files fill the cores around them. xdist's default order (files with the most
    tests first) started the e2e files, one to three tests each, last, when nothing was left to
    overlap them with."""
    items.sort(key=lambda item: (-_seconds(item), item.get_closest_marker("e2e") is None))


_MACHINE = pytest.StashKey()


def pytest_configure(config):
    """The controller (not an xdist worker) samples the machine for the summary below."""
    if not hasattr(config, "workerinput") and sys.platform == "linux":
        from machine_state import MachineState

        config.stash[_MACHINE] = MachineState().start()


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001 - pytest's hook signature
    state = config.stash.get(_MACHINE, None)
    if state is not None:
        terminalreporter.write_line(state.summary())


@pytest.fixture
def single_rank_group():
    """A real gloo process group of one rank, in this process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def marker():
    """The run marker of a test's processes; whatever carries it is SIGKILLed at teardown, so a
    failed test does not leave its federation running (and eating the CPU) under the next tests.
    Tests that pass assert `live_marked(marker) == []` themselves."""
    mark = uuid.uuid4().hex
    yield mark
    for pid in live_marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def live_marked(marker: str) -> list[int]:
    from federation.ops.launcher import marked_pids

    return marked_pids(marker)


def assert_weighted_mean_rounds(run: Path, sites: set[str], ranks: int, rounds: int,
                                excluded: frozenset[str] = frozenset()) -> list[dict]:
    """Each round's checkpoint is the sample-weighted mean of the weights the sites dumped
    (update_kind: weights), to 1e-6, and every rank of a site reported the same weights; exactly
    the `excluded` sites failed."""
    import json

    import numpy as np

    from federation.coordinator.checkpoint import load_checkpoint

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["status"] for x in lines] == ["aggregated"] * rounds
    for rnd, line in enumerate(lines, start=1):
        assert set(line["sites"]) == sites and set(line["failed"]) == set(excluded), line["failed"]
        acc: dict[str, np.ndarray] = {}
        weight = 0
        for site, info in line["sites"].items():
            digests = info["rank_digests"]
            assert len(digests) == ranks and len(set(digests)) == 1, f"{site} ranks diverged: {digests}"
            with np.load(run / "sites" / site / "updates" / f"round_{rnd:04d}.npz") as z:
                for k in z.files:
                    acc[k] = acc.get(k, 0) + z[k].astype(np.float64) * info["samples"]
            weight += info["samples"]
        _, model, _ = load_checkpoint(run / "checkpoints" / f"round_{rnd:04d}")
        assert set(model) == set(acc)
        for k in model:
            np.testing.assert_allclose(model[k], acc[k] / weight, rtol=0, atol=1e-6)
    return lines


def secagg_to_stage3(cfg, ids: list[int], length: int, run: str = "run", rnd: int = 1, weight_bound: int = 1):
    """SecAgg clients and server after every client's setup: ready for masked input."""
    from crypto.secagg import SecAggClient, SecAggServer, new_context
    from crypto.secagg.simulation import make_plan

    ctx = new_context(run, rnd)
    plan, channel = make_plan(cfg, ctx, ids)
    srv = SecAggServer(cfg, plan, vector_len=length)
    clients = {}
    for i in ids:
        clients[i], setup = SecAggClient.setup(cfg, plan, i, channel[i])
        srv.receive_setup(i, setup)
    srv.close_setup(weight_bound=weight_bound)
    return ctx, clients, srv


@pytest.fixture
def shaped_links():
    """Shaped links can be built here (benchmarks/shaped_link): iproute2 installed when missing;
    skipped, with the reason, where that or the namespaces cannot be had (not root)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.shaped_link import available
    from system_packages import SHAPED_LINKS, need_packages

    need_packages(SHAPED_LINKS)
    reason = available()
    if reason is not None:
        pytest.skip(reason)
