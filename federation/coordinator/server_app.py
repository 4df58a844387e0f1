"""The ServerApp: reads the experiment file named in the run config and drives the rounds."""

from __future__ import annotations

import json
import logging
import threading
import traceback
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from crypto.durable import write_atomic
from crypto.pki import CoordinatorBundle
from federation.config import AttestationConfig, resolve
from federation.config.schema import ConfigError, load_config
from federation.protocol.malloc_policy import return_freed_tensors
from federation.coordinator.bulk_server import BulkServer
from federation.coordinator.checkpoint import CheckpointError
from federation.coordinator.driver import Coordinator, FederationFailed
from federation.coordinator.pack_grid import PackGrid
from federation.coordinator.privacy_summary import privacy_by_site
from federation.coordinator.run_record import record_workload

app = ServerApp()
log = logging.getLogger("sovfl.server")


def progress_writer(workdir: Path):
    """A progress callback that prints and appends to progress.log (which the launcher relays)."""
    path = workdir / "progress.log"
    lock = threading.Lock()  # lines come from the driver and from the data path's threads (early evaluations)

    def write(line: str) -> None:
        with lock:
            print(f"[sovfl] {line}", flush=True)
            with path.open("a") as f:
                f.write(line + "\n")
    return write


def attestation_line(att: AttestationConfig) -> str:
    """The operator's line on how sites are admitted and how the coordinator attests."""
    kind = att.coordinator.attester.kind if att.coordinator.attester else None
    line = (f"attestation: sites admitted before each round on evidence appraised by "
            f"{sorted(att.coordinator.sites.verifiers)}; the coordinator attests with {kind or 'nothing'}")
    if kind in ("local-token", "insecure-dev"):
        line += f" (WARNING: {kind} is for development: no hardware root of trust)"
    return line


def data_path(address: str, bundle: CoordinatorBundle | None, workdir: Path, progress) -> BulkServer | None:
    """The bulk data path's server on `address` (run config `data-address`), or None: without an
    address or a bundle (its certificates) every byte goes through Flower."""
    if not address:
        progress("data path: off (no data-address): models and updates travel through Flower")
        return None
    if bundle is None:
        progress(f"data path: off (no coordinator bundle for its mutual TLS): models and updates travel through Flower")
        return None
    try:
        server = BulkServer(bundle, workdir, address).start()
    except (OSError, RuntimeError) as err:  # the port is taken: the run goes on, slower, through Flower
        progress(f"WARNING: data path: cannot listen on {address} ({err}); models and updates travel through Flower")
        return None
    progress(f"data path: listening on {address} (mutual TLS, the federation's certificates)")
    return server


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp: load the experiment file and keys, run the Coordinator, always write result.json."""
    return_freed_tensors()  # whole models come and go every round (protocol/malloc_policy.py)
    workdir = Path(str(context.run_config.get("workdir") or ".")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    progress = progress_writer(workdir)
    result: dict
    bulk: BulkServer | None = None
    try:
        cfg = load_config(str(context.run_config["config-path"]))
        issuer_dir = str(context.run_config.get("dev-issuer-dir") or "")
        try:
            att = resolve(cfg.federation.attestation, Path(issuer_dir) if issuer_dir else None)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        cfg = cfg.model_copy(update={"federation": cfg.federation.model_copy(update={"attestation": att})})
        from site_trainer.workloads import coordinator_start  # torch lives only in this process

        initial, manifest = coordinator_start(cfg.workload, cfg.federation.seed)
        record_workload(workdir, cfg)
        progress(f"federation '{cfg.federation.name}': {cfg.federation.rounds} round(s), {len(cfg.sites)} site(s), "
                 f"strategy {cfg.federation.strategy}, model {sum(v.size for v in initial.values()):,} parameters")
        bundle_dir = str(context.run_config.get("bundle-dir") or "")
        bundle = CoordinatorBundle.load(bundle_dir) if bundle_dir else None
        if bundle is None:
            if cfg.federation.seal:
                raise ConfigError("federation.seal is on but the coordinator has no provisioned bundle (bundle-dir)")
            what = "secure-aggregation messages" if cfg.federation.secagg.enabled else "site updates"
            progress(f"WARNING: no coordinator bundle: {what} are accepted UNSIGNED; provision one with "
                     "`sovfl provision` and pass it with --bundle")
        else:
            how = ("updates masked by SecAgg+, every secure-aggregation message signed by its site and "
                   "verified against the site registry" if cfg.federation.secagg.enabled else
                   f"signed updates required{', sealed to our key' if cfg.federation.seal else ''}")
            progress(f"coordinator identity '{bundle.name}' in federation {bundle.federation_id}: {how}")
        if att.enabled:
            progress(attestation_line(att))
        resume = str(context.run_config.get("resume", "")).lower() == "true"
        starting = float(context.run_config.get("sites-starting-s", 0) or 0)  # `sovfl simulate` starts sites alongside
        bulk = data_path(str(context.run_config.get("data-address") or ""), bundle, workdir, progress)
        coordinator = Coordinator(PackGrid(grid), cfg, workdir, context.run_id, initial, progress, bundle, manifest,
                                  sites_starting_s=starting, bulk=bulk)
        del initial  # the coordinator holds the model; the round-0 copy must not outlive round 1
        result = coordinator.run(resume=resume)
        privacy = privacy_by_site(coordinator.history)
        if privacy:  # sites[].privacy: each site's final epsilon, as its own accountant reported it
            result["privacy"] = privacy
    except (ConfigError, FederationFailed, CheckpointError) as err:
        progress(f"FAILED: {err}")
        result = {"status": "failed", "error": str(err)}
    except Exception as err:  # the run must end with a result, never silently
        progress(f"FAILED: unexpected {type(err).__name__}: {err}")
        traceback.print_exc()
        result = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
    finally:
        if bulk is not None:
            bulk.stop()
    write_atomic(workdir / "result.json", json.dumps(result, indent=2))  # the launcher reads it once it exists
    progress(f"finished: {result['status']}")
