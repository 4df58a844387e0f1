"""Starts and supervises the real processes of a federation: SuperLink, SuperNodes, trainer pools.

`simulate` puts all of them on loopback; `coordinator` and `site` run the same pieces on
separate machines. Every child runs in its own process group with a run marker in its
environment, and is torn down (SIGTERM, then SIGKILL) on success, failure and Ctrl-C.
Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Callable

from crypto.audit import LOG_NAME
from crypto.pki import provision
from federation.config import resolve
from federation.config.schema import ExperimentConfig, load_config
from federation.config.supernode_polls import SUPERNODE_POLLS_ENV, SupernodePolls
from federation.ops import superexec_wake, warm_preload
from federation.ops.superexec_wake import WAKE_ENV
from federation.ops.run_dir import prepare_workdir
from federation.ops.supervisor import (  # noqa: F401 (re-exported: launcher.Supervisor etc.)
    MARKER, OWNER, LaunchError, Proc, Supervisor, _bin, free_port, marked_pids, tail)
from site_trainer import endpoint
from site_trainer.config import SiteConfig, TrainerConfig
from site_trainer.launch import trainer_argv

APP_DIR = Path(__file__).parent / "flwr_app"


# ---- the pieces ----------------------------------------------------------------------------

INSECURE_WARNING = ("WARNING: TLS and SuperNode authentication are OFF (--insecure): updates, models and "
                    "node identities cross the network unprotected by TLS. Use this only for local debugging.")


def start_superlink(sup: Supervisor, port: int, host: str = "127.0.0.1", bundle: Path | None = None,
                    database: bool = True) -> Proc:
    """TLS with the coordinator's provisioned certificate and SuperNode authentication, unless
    `bundle` is None (plain text, which the caller must have asked for explicitly). State in
    WORKDIR/superlink.db (what a resume needs), or in memory without `database` (benchmarks' anchors)."""
    security = ["--insecure"] if bundle is None else [
        "--ssl-certfile", str(bundle / "server.crt"), "--ssl-keyfile", str(bundle / "server.key"),
        "--ssl-ca-certfile", str(bundle / "ca.crt"), "--enable-supernode-auth"]
    return sup.start("superlink", [
        _bin("flower-superlink"), *security, "--disable-runtime-dependency-installation",
        "--host", host, "--port", str(port), *(["--database", str(sup.workdir / "superlink.db")] if database else []),
    ])


def register_supernodes(sup: Supervisor, public_keys: dict[str, Path], timeout_s: float = 60) -> None:
    """Admit each site's provisioned SuperNode key at the SuperLink, every site from one process
    (federation/ops/register_nodes.py: Flower's `flwr supernode register` request, without a CLI
    start per site). A key the SuperLink has already (a restarted SuperLink keeps its database,
    and the keys in it: a resumed run) counts as admitted."""
    argv = [sys.executable, "-m", "federation.ops.register_nodes", "sovfl",
            *(f"{site}={key}" for site, key in public_keys.items())]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env=sup.env(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"could not register the sites' SuperNode keys ({', '.join(public_keys)}): "
                          f"no answer within {timeout_s:.0f}s") from None
    lines = out.stdout.splitlines()
    admitted = {line.split()[1] for line in lines if line.startswith(("ok ", "known "))}
    if out.returncode != 0 or admitted != set(public_keys):
        why = [f"could not register site {line[len('failed '):]}" for line in lines if line.startswith("failed ")]
        raise LaunchError("\n".join(why) or f"could not register the sites' SuperNode keys (exit code "
                          f"{out.returncode}): {(out.stderr or out.stdout).strip()[-2000:]}")


def wait_port(proc: Proc, port: int, deadline_s: float = 60.0) -> None:
    """Block until `proc` accepts TCP connections on 127.0.0.1:`port`."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not proc.alive():
            raise LaunchError(f"{proc.name} exited with code {proc.popen.returncode}; see {proc.log}:\n{tail(proc.log)}")
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise LaunchError(f"{proc.name} did not listen on port {port} within {deadline_s:.0f}s; see {proc.log}")


def start_trainer(sup: Supervisor, site: SiteConfig, cfg: ExperimentConfig, socket_path: str, node_rank: int = 0,
                  join_timeout_s: float | None = None, rdzv_id: str | None = None) -> Proc:
    """This node's part of the site's trainer pool: its torchrun, or the one rank of a one-rank
    site (launch.trainer_argv); node 0 serves `socket_path`."""
    tcfg = TrainerConfig(site=site, workload=cfg.workload, num_partitions=len(cfg.sites),
                         seed=cfg.federation.seed, rounds=cfg.federation.rounds, socket=socket_path,
                         workdir=str(sup.workdir / "sites" / site.id))
    Path(tcfg.workdir).mkdir(parents=True, exist_ok=True)
    node = f"-node{node_rank}" if node_rank else ""  # nodes may share the workdir: one file each
    cfg_path = Path(tcfg.workdir) / f"trainer{node}.json"
    cfg_path.write_text(tcfg.model_dump_json(indent=2))
    grace = 10.0 + (site.tracking.close_timeout_s if site.tracking.enabled else 0.0)  # its trackers' last records
    return sup.start(f"site-{site.id}{node}-trainer", trainer_argv(site, str(cfg_path), node_rank, rdzv_id, join_timeout_s),
                     {"OMP_NUM_THREADS": "1"}, grace)


def start_supernode(sup: Supervisor, site: SiteConfig, superlink: str, socket_path: str,
                    bundle: Path | None = None, insecure: bool = False,
                    extra_node_config: dict[str, str] | None = None, runtime_port: int | None = None,
                    polls: SupernodePolls | None = None, wake: str | None = None) -> Proc:
    """With `bundle` (the site's provisioned directory) the ClientApp signs (and seals) updates
    with its keys and, unless `insecure`, the SuperNode uses TLS verified against the federation
    CA and authenticates with its provisioned key.
    `extra_node_config` adds `key="value"` pairs (site-local settings the ClientApp reads).
    With `runtime_port` the SuperNode serves its Runtime API there and starts no SuperExec of its
    own (`--isolation process`): start_superexec's serves it; without, Flower's SuperExec starts a
    fresh `flwr-clientapp` process per message.
    With `polls` enabled (federation.supernode_polls) it runs as federation/ops/supernode_main.py,
    asking for its next message soon after each reply, and with `wake` it wakes the SuperExec
    listening under that name for each message (federation/ops/superexec_wake.py); without, as
    Flower ships it."""
    cfg = {"site-id": site.id, "trainer-socket": socket_path}
    if bundle is not None:
        cfg["bundle-dir"] = str(bundle)
    node_config = " ".join(f'{k}="{v}"' for k, v in {**cfg, **(extra_node_config or {})}.items())
    if not insecure and bundle is None:
        raise LaunchError(f"site {site.id}: TLS needs the site's provisioned bundle (or an explicit --insecure)")
    security = ["--insecure"] if insecure else [
        "--root-certificates", str(bundle / "ca.crt"), "--auth-supernode-private-key", str(bundle / "supernode_auth.key")]
    prompt = polls is not None and polls.enabled
    program = [sys.executable, "-m", "federation.ops.supernode_main"] if prompt else [_bin("flower-supernode")]
    return sup.start(f"site-{site.id}-supernode", [
        *program, *security, "--superlink", superlink, "--port", str(runtime_port or free_port()),
        *(["--isolation", "process"] if runtime_port else []), "--node-config", node_config, "--max-wait-time", "600",
    ], extra_env={**superexec_poll_env(), **({SUPERNODE_POLLS_ENV: polls.model_dump_json()} if prompt else {}),
                  **({WAKE_ENV: wake} if prompt and wake else {})})


def start_superexec(sup: Supervisor, site_id: str, runtime_port: int, parents: int, wake: str | None = None,
                    preload: dict[str, str] | None = None) -> Proc:
    """The SuperExec of a site's SuperNode started with `runtime_port`: ours with `parents` warm
    ClientApp parents (federation/ops/warm_superexec.py), listening for the SuperNode's `wake` and
    importing the modules `preload` names (warm_preload.preload_env), or with 0 Flower's
    `flower-superexec`."""
    address = ["--runtime-api-address", f"127.0.0.1:{runtime_port}", "--insecure"]  # loopback, as Flower's own
    argv = [sys.executable, "-m", "federation.ops.warm_superexec", *address, "--parents", str(parents)] if parents \
        else [_bin("flower-superexec"), *address]
    warm_env = {**({WAKE_ENV: wake} if wake else {}), **(preload or {})} if parents else {}
    return sup.start(f"site-{site_id}-superexec", argv, extra_env={**superexec_poll_env(), **warm_env})


def watch_site_node(guard, sup: Supervisor, site: SiteConfig, superlink: str, socket_path: str,
                    bundle: Path | None, insecure: bool, extra_node_config: dict[str, str], warm: int,
                    polls: SupernodePolls | None = None) -> Proc:
    """A site's SuperNode under its supervisor and, with `warm` > 0 (federation.warm_clientapps),
    the warm SuperExec beside it, on a Runtime API port kept across SuperNode restarts (the
    SuperExec outlives them); its SuperNode Proc."""
    port = free_port() if warm else None
    # only a SuperNode run by supernode_main (polls enabled) sends wakes; without them the SuperExec polls at 0.2 s
    wake = superexec_wake.new_name(site.id) if warm and polls is not None and polls.enabled else None
    node = guard.watch_supernode(site.id, partial(start_supernode, sup, site, superlink, socket_path, bundle, insecure,
                                                  extra_node_config, runtime_port=port, polls=polls, wake=wake),
                                 superlink, None if insecure else bundle)
    if port is not None:
        guard.watch_superexec(site.id, partial(start_superexec, sup, site.id, port, wake=wake,
                                               preload=warm_preload.preload_env(extra_node_config)), warm)
    return node


SUPEREXEC_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"  # flwr 1.41's one knob on a message's path (seconds)
SUPEREXEC_POLL_S = "0.2"  # Flower's default 1.0 s: each message waits up to that before its ClientApp starts


def superexec_poll_env() -> dict[str, str]:
    """The SuperExec a SuperNode starts inherits its environment: poll for tasks every
    SUPEREXEC_POLL_S (one local request to the SuperNode each) unless the user's environment sets
    the knob itself. What a message still waits for is in the metrics (protocol/message_cost.py)."""
    return {} if os.environ.get(SUPEREXEC_POLL_ENV) else {SUPEREXEC_POLL_ENV: SUPEREXEC_POLL_S}


def site_attestation_config(cfg: ExperimentConfig, site: str, workdir: Path,
                            issuer_dir: Path | None = None) -> dict[str, str]:
    """The node config that points a site's ClientApp at its attestation settings (written to
    `workdir`), or nothing when attestation is off."""
    if not cfg.federation.attestation.enabled:
        return {}
    try:
        att = resolve(cfg.federation.attestation, issuer_dir, create=issuer_dir is not None)
    except ValueError as err:
        raise LaunchError(str(err)) from None
    path = Path(workdir) / "attestation.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(att.for_site(site).model_dump_json(indent=2))
    return {"attestation-config": str(path)}


def site_policy_config(cfg: ExperimentConfig, site: str, workdir: Path) -> dict[str, str]:
    """The node config of a site's own policy (written to `workdir`, when it has one) and its audit
    log (`workdir`/audit.jsonl, kept when it has a bundle and `federation.audit` is on)."""
    spec = next(s for s in cfg.sites if s.id == site)
    out = {"audit-log": str(Path(workdir) / LOG_NAME)} if cfg.federation.audit else {}
    if spec.policy is not None:
        path = Path(workdir) / "site_policy.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(spec.policy.model_dump_json(indent=2))
        out["site-policy"] = str(path)
    return out


def wait_trainers(procs: dict[str, Proc], sockets: dict[str, str], deadline_s: float,
                  progress: Callable[[str], None]) -> None:
    """Block until every site trainer answers Info on its socket; fail fast if one exits."""
    end = time.monotonic() + deadline_s
    waiting = set(procs)
    while waiting:
        for site in sorted(waiting):
            proc = procs[site]
            if not proc.alive():
                raise LaunchError(f"site {site}: trainer exited with code {proc.popen.returncode} before it was "
                                  f"ready; see {proc.log}:\n{tail(proc.log)}")
            with contextlib.suppress(endpoint.TrainerUnavailable, endpoint.TrainerError):
                if Path(sockets[site] + ".ready").exists():
                    info = endpoint.call(sockets[site], "Info", {}, timeout_s=5)
                    progress(f"site {site}: trainer ready ({info['ranks']} rank(s), {info['num_examples']} examples)")
                    waiting.discard(site)
        if waiting and time.monotonic() > end:
            logs = ", ".join(str(procs[site].log) for site in sorted(waiting))
            raise LaunchError(f"trainer(s) {sorted(waiting)} not ready within {deadline_s:.0f}s; see {logs}")
        if waiting:
            time.sleep(0.5)


def write_flwr_connection(sup: Supervisor, address: str, ca: Path | None) -> None:
    """The `flwr` CLI's connection file (FLWR_HOME) for this run's SuperLink."""
    home = sup.workdir / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    security = "insecure = true" if ca is None else f'root-certificates = "{ca}"'
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "sovfl"\n\n[superlink.sovfl]\naddress = "{address}"\n{security}\n'
    )


def submit_run(sup: Supervisor, config_path: Path, address: str, bundle: Path | None = None,
               dev_issuer: Path | None = None, resume: bool = False, sites_starting_s: float = 0.0,
               data_address: str = "") -> Proc:
    """`flwr run` of our app; the coordinator's bundle (keys that open site envelopes) goes along,
    and under `sovfl simulate` the dev attestation issuer's directory. With `resume` the ServerApp
    continues from the workdir's last checkpoint (coordinator/resume.py). `data_address` is where the
    ServerApp serves the bulk data path (coordinator/bulk_server.py); empty: everything through Flower."""
    run_config = f'config-path="{config_path.resolve()}" workdir="{sup.workdir.resolve()}"'
    if resume:
        run_config += ' resume="true"'
    if sites_starting_s:
        run_config += f' sites-starting-s="{sites_starting_s:g}"'
    if bundle is not None:
        run_config += f' bundle-dir="{bundle}"'
    if dev_issuer is not None:
        run_config += f' dev-issuer-dir="{dev_issuer}"'
    if data_address:
        run_config += f' data-address="{data_address}"'
    return sup.start("flwr-run", [_bin("flwr"), "run", str(APP_DIR), "sovfl", "--run-config", run_config, "--stream"])


def watch_run(sup: Supervisor, must_live: list[Proc], deadline_s: float, progress: Callable[[str], None],
              tick: Callable[[], None] | None = None) -> dict:
    """Relay progress lines until result.json appears; fail fast if the coordinator side dies.
    `tick` runs on every turn (the site supervisor: it restarts and reports dead site processes)."""
    result_path, progress_path = sup.workdir / "result.json", sup.workdir / "progress.log"
    seen = 0
    end = time.monotonic() + deadline_s
    run_proc = next((p for p in must_live if p.name == "flwr-run"), None)
    run_exited_at: float | None = None
    warned_stream = False
    while True:
        if progress_path.exists():
            text = progress_path.read_text()
            lines = text[:text.rfind("\n") + 1].splitlines()  # complete lines only: the last may be half written
            for line in lines[seen:]:
                progress(line)
            seen = len(lines)
        if result_path.exists():
            return json.loads(result_path.read_text())
        if tick is not None:
            tick()
        for proc in must_live:
            if proc is run_proc:
                if not proc.alive() and run_exited_at is None:
                    run_exited_at = time.monotonic()
                continue
            if not proc.alive():
                raise LaunchError(f"{proc.name} exited with code {proc.popen.returncode}; see {proc.log}:\n{tail(proc.log)}")
        if run_exited_at is not None and time.monotonic() - run_exited_at > 15:
            # `flwr run --stream` is a log stream: a SuperLink error on it (HTTP 500 `database is
            # locked` under load) ends it while the ServerApp goes on. Only the run's own status says.
            status = run_status(sup, run_proc)
            if result_path.exists():  # written while we asked
                continue
            if status is None or status.startswith("finished"):
                raise LaunchError(f"the Flower run ended without a result (status {status or 'unknown'}); see "
                                  f"{run_proc.log}:\n{tail(run_proc.log)}")
            if not warned_stream:
                progress(f"the Flower log stream ended but the run is {status}: waiting for its result")
                warned_stream = True
            run_exited_at = time.monotonic()  # ask again in 15 s
        if time.monotonic() > end:
            raise LaunchError(f"the federation did not finish within {deadline_s:.0f}s")
        time.sleep(0.5)


def run_status(sup: Supervisor, run_proc: Proc, attempts: int = 5) -> str | None:
    """The SuperLink's status of the run `run_proc` started (e.g. "running", "finished:failed"), from
    `flwr ls --run-id ... --format json`; None if the run id is unknown or the SuperLink does not
    answer after `attempts` tries (each transient error retried after a second)."""
    found = re.search(r"Successfully started run (\d+)", run_proc.log.read_text(errors="replace")
                      if run_proc.log.exists() else "")
    if found is None:
        return None
    for _ in range(attempts):
        try:
            out = subprocess.run([_bin("flwr"), "ls", "sovfl", "--run-id", found.group(1), "--format", "json"],
                                 capture_output=True, text=True, env=sup.env(), cwd=sup.workdir, timeout=60)
            runs = json.loads(out.stdout).get("runs") or []
            if runs and runs[0].get("status"):
                return str(runs[0]["status"])
        except (subprocess.SubprocessError, OSError, ValueError, AttributeError):
            pass
        time.sleep(1.0)
    return None


def site_guard(sup: Supervisor, cfg: ExperimentConfig, progress: Callable[[str], None]):
    """The site supervisor that restarts this run's site processes (federation/ops/site_supervisor.py)."""
    from federation.ops.site_supervisor import SiteSupervisor  # only `site` runs use it

    return SiteSupervisor(sup, cfg.federation.site_restarts, progress)


def run_deadline(cfg: ExperimentConfig) -> float:
    """How long the whole run may take: discovery plus every round at its deadlines, with slack."""
    d = cfg.federation.deadlines
    per_round = d.round_s + (d.evaluate_s if cfg.federation.evaluate else 0)
    return d.connect_s * 2 + cfg.federation.rounds * per_round + 120


def result_line(result: dict) -> str:
    """The `RESULT rounds=... first_loss=... last_loss=...` line scripts parse."""
    fmt = lambda v: "nan" if v is None else f"{v:.6f}"  # noqa: E731
    return f"RESULT rounds={result.get('aggregated_rounds', 0)} first_loss={fmt(result.get('first_loss'))} " \
           f"last_loss={fmt(result.get('last_loss'))}"


def simulate(config_path: str | Path, workdir: str | Path | None = None,
             progress: Callable[[str], None] = print, insecure: bool = False,
             tap: Callable[[str], str] | None = None,
             node_config: dict[str, dict[str, str]] | None = None, resume: bool = False,
             site_tap: Callable[[str, str], str] | None = None) -> dict:
    """Run a whole federation on loopback with real processes; returns the run's result.

    `tap` maps the SuperLink's address to the one the sites dial instead (a wire audit's
    recording proxy); `site_tap(site, address)` does it per site, for the SuperLink's address and the
    data path's (a shaped link per site: benchmarks/wan_time_to_loss.py); `node_config` adds per-site SuperNode settings (tests' hooks); `resume`
    continues the run in `workdir` from its last checkpoint (every process is started afresh)."""
    config_path = Path(config_path)
    cfg = load_config(config_path)
    workdir = Path(workdir or Path("runs") / f"{cfg.federation.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    prepare_workdir(workdir, config_path, resume)
    sockdir = Path(tempfile.mkdtemp(prefix="sovfl-"))  # short: Unix socket paths are limited
    sup = Supervisor(workdir)
    progress(f"sovfl simulate: {len(cfg.sites)} site(s) x ranks {[s.ranks for s in cfg.sites]}, "
             f"{cfg.federation.rounds} round(s); logs in {workdir / 'logs'}")
    pki = workdir / "pki"
    if insecure:
        progress(INSECURE_WARNING)
    report = provision(pki, [s.id for s in cfg.sites], hosts=("127.0.0.1", "localhost"))
    if report.created:
        progress(f"provisioned a federation CA and bundles for {', '.join(report.created)} in {pki}")
    coord = pki / "coordinator"
    try:
        port = free_port()
        data = "" if insecure or not cfg.federation.data_path.enabled else f"127.0.0.1:{free_port()}"  # mutual TLS
        superlink = start_superlink(sup, port, bundle=None if insecure else coord)
        sockets = {s.id: str(sockdir / f"{s.id}.sock") for s in cfg.sites}
        guard = site_guard(sup, cfg, progress)  # restarts dead trainers and SuperNodes (site_supervisor.py)
        trainers = {s.id: guard.watch_trainer(s.id, partial(start_trainer, sup, s, cfg, sockets[s.id]), sockets[s.id])
                    for s in cfg.sites}
        # The coordinator side starts while the trainers load (the slowest start-up): the ServerApp
        # waits for the sites' SuperNodes, which start once their trainer answers.
        wait_port(superlink, port)
        write_flwr_connection(sup, f"127.0.0.1:{port}", None if insecure else coord / "ca.crt")
        if not insecure:
            register_supernodes(sup, {s.id: pki / "sites" / s.id / "supernode_auth.pub" for s in cfg.sites})
        issuer = pki / "dev-attestation-issuer" if cfg.federation.attestation.dev_issuer else None
        site_att = {s.id: {**site_attestation_config(cfg, s.id, workdir / "sites" / s.id, issuer),
                           **site_policy_config(cfg, s.id, workdir / "sites" / s.id)} for s in cfg.sites}
        run = submit_run(sup, config_path, f"127.0.0.1:{port}", coord, issuer, resume=resume,
                         sites_starting_s=cfg.federation.deadlines.trainer_start_s, data_address=data)
        wait_trainers(trainers, sockets, cfg.federation.deadlines.trainer_start_s, progress)
        dial = tap(f"127.0.0.1:{port}") if tap else f"127.0.0.1:{port}"
        for s in cfg.sites:
            s_dial = site_tap(s.id, dial) if site_tap else dial
            s_data = site_tap(s.id, data) if site_tap and data else data
            watch_site_node(guard, sup, s, s_dial, sockets[s.id], pki / "sites" / s.id, insecure,
                            {**site_att[s.id], **({"data-address": s_data} if s_data else {}),
                             **(node_config or {}).get(s.id, {})}, cfg.federation.warm_clientapps,
                            polls=cfg.federation.supernode_polls)
        result = watch_run(sup, [superlink, run], run_deadline(cfg), progress, tick=guard.tick)
    finally:
        sup.close()
        shutil.rmtree(sockdir, ignore_errors=True)
    result["workdir"] = str(workdir)
    return result
