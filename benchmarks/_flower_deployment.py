"""Flower's own deployment for the benchmarks' anchors, started like ours: a SuperLink and one
SuperNode per site from the launcher's pieces (TLS, SuperNode authentication, a fresh PKI), one
`flwr run` of an anchor app that writes its result to `out` (whole, by a rename), awaited under a
deadline.

benchmarks/round_latency.py (and large_update.py through it) and benchmarks/wan_time_to_loss.py
differ only in the app, its run config, the SuperLink's storage and how each SuperNode reaches
the SuperLink (wan_time_to_loss: through its site's shaped link).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from crypto.pki import provision
from federation.ops import launcher
from site_trainer.config import SiteConfig


def run_anchor(workdir: Path, app: Path, sites: list[SiteConfig], run_config: str, deadline_s: float, *,
               database: bool = True, dial: Callable[[int, int], str] | None = None,
               node_config: Callable[[int, SiteConfig], dict[str, str]] | None = None,
               env: dict[str, str] | None = None) -> dict:
    """The JSON the anchor app wrote to `out` (added to `run_config`). `dial(i, port)` is the address
    site i's SuperNode dials (default: the SuperLink on loopback); `node_config(i, site)` its
    node config; without `database` the SuperLink keeps its state in memory."""
    wd = workdir / "flower"
    wd.mkdir(parents=True, exist_ok=True)
    pki = wd / "pki"
    provision(pki, [s.id for s in sites], hosts=("127.0.0.1", "localhost"))
    coord = pki / "coordinator"
    out = wd / "flower_rounds.json"
    out.unlink(missing_ok=True)
    sup = launcher.Supervisor(wd)
    try:
        port = launcher.free_port()
        link = launcher.start_superlink(sup, port, bundle=coord, database=database)
        launcher.wait_port(link, port)
        launcher.write_flwr_connection(sup, f"127.0.0.1:{port}", coord / "ca.crt")
        launcher.register_supernodes(sup, {s.id: pki / "sites" / s.id / "supernode_auth.pub" for s in sites})
        for i, s in enumerate(sites):  # no trainer: the anchors' ClientApps train in their own process
            launcher.start_supernode(sup, s, dial(i, port) if dial else f"127.0.0.1:{port}", "unused",
                                     pki / "sites" / s.id, extra_node_config=node_config(i, s) if node_config else None)
        run = sup.start("flwr-run", [launcher._bin("flwr"), "run", str(app), "sovfl", "--run-config",
                                     f'{run_config} out="{out}"', "--stream"], env)
        end = time.monotonic() + deadline_s
        while not out.exists():
            if time.monotonic() > end:
                raise launcher.LaunchError(f"Flower's FedAvg did not finish; see {run.log}:\n{launcher.tail(run.log)}")
            if not link.alive():
                raise launcher.LaunchError(f"the SuperLink died; see {link.log}")
            if not run.alive():
                time.sleep(2)  # the result file is written just before the run ends
                if not out.exists():
                    raise launcher.LaunchError(f"flwr run ended without a result; see {run.log}:\n{launcher.tail(run.log)}")
            time.sleep(0.5)
        return json.loads(out.read_text())
    finally:
        sup.close()
