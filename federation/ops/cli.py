"""`sovfl`: the command line for simulation engineers, site operators and the coordinator."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from functools import partial
from pathlib import Path

from crypto.pki import CoordinatorBundle, provision
from federation.config.schema import ConfigError, load_config
from federation.ops import (audit_cmd, export_cmd, health_cmd, launcher, report_cmd, run_dir, scrub_cmd,
                            site_supervisor, slurm)
from site_trainer.launch import (RendezvousUnreachable, check_node_rank, fresh_rdzv_id, publish_rdzv_id,
                                 read_rdzv_id, wait_for_rendezvous)


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt  # unwinds through the launcher's teardown


def cmd_validate(args: argparse.Namespace) -> int:
    """`sovfl validate`: check a configuration file."""
    cfg = load_config(args.config)
    print(f"{args.config}: OK ({len(cfg.sites)} site(s), {cfg.federation.rounds} round(s), "
          f"workload {cfg.workload.name}, strategy {cfg.federation.strategy})")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    """`sovfl simulate`: the whole federation on loopback, real processes."""
    result = launcher.simulate(args.config, args.workdir, insecure=args.insecure, resume=bool(args.resume))
    if result.get("status") != "ok":
        print(f"sovfl simulate: FAILED: {result.get('error', 'no round reached its quorum')} "
              f"(logs: {result['workdir']}/logs)", file=sys.stderr)
        return 1
    print(f"checkpoints and metrics in {result['workdir']}")
    print(report_cmd.report_after_run(result["workdir"]))
    print(launcher.result_line(result))
    return 0


def _bundle_dir(path: str | None, what: str) -> Path:
    if not path:
        raise ConfigError(f"{what} needs its provisioned bundle (--bundle DIR, made by `sovfl provision`), "
                          "or --insecure for a plain-text debug run")
    bundle = Path(path).resolve()
    if not (bundle / "ca.crt").exists():
        raise ConfigError(f"{bundle}: not a provisioned bundle (no ca.crt); run `sovfl provision` first")
    return bundle


def cmd_provision(args: argparse.Namespace) -> int:
    """`sovfl provision`: a federation CA and one key bundle per party."""
    report = provision(args.out_dir, args.site, coordinator_name=args.coordinator, hosts=tuple(args.host),
                       rotate=args.rotate)
    for label in ("created", "kept", "rotated", "refreshed"):
        names = getattr(report, label)
        if names:
            print(f"{label}: {', '.join(names)}")
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"federation {report.federation_id}: give each party only its own bundle "
          f"({args.out_dir}/coordinator, {args.out_dir}/sites/<name>); keep {args.out_dir}/ca (the CA key) private")
    return 0


def cmd_coordinator(args: argparse.Namespace) -> int:
    """The coordinator machine: a SuperLink reachable by the sites, then the run."""
    cfg = load_config(args.config)
    bundle = _bundle_dir(args.bundle, "the coordinator")
    workdir = Path(args.workdir or f"runs/{cfg.federation.name}-coordinator").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir.prepare_workdir(workdir, Path(args.config), args.resume)
    sup = launcher.Supervisor(workdir)
    if args.insecure:
        print(launcher.INSECURE_WARNING, file=sys.stderr)
    try:
        link = launcher.start_superlink(sup, args.port, args.host, None if args.insecure else bundle)
        launcher.wait_port(link, args.port)
        launcher.write_flwr_connection(sup, f"127.0.0.1:{args.port}", None if args.insecure else bundle / "ca.crt")
        if not args.insecure:
            keys = {site: Path(p) for site, p in _site_auth_keys(bundle, [s.id for s in cfg.sites], workdir).items()}
            # each `flwr` CLI start takes seconds, a minute on a loaded host: within the sites' connect deadline
            launcher.register_supernodes(sup, keys, timeout_s=max(60.0, cfg.federation.deadlines.connect_s))
        print(f"SuperLink on {args.host}:{args.port}; waiting for {len(cfg.sites)} site(s)")
        data_port = args.port + 1 if args.data_port is None else args.data_port
        data = ("" if args.insecure or not data_port or not cfg.federation.data_path.enabled
                else f"{args.host}:{data_port}")
        if data:
            print(f"data path (models and updates, mutual TLS) on {data}: open it to the sites beside the SuperLink's port")
        run = launcher.submit_run(sup, Path(args.config), f"127.0.0.1:{args.port}", bundle, resume=args.resume,
                                  data_address=data)
        result = launcher.watch_run(sup, [link, run], launcher.run_deadline(cfg), print)
    finally:
        sup.close()
    print(launcher.result_line(result))
    return 0 if result.get("status") == "ok" else 1


def _site_auth_keys(bundle: Path, sites: list[str], workdir: Path) -> dict[str, Path]:
    """The SuperNode public keys the coordinator admits, written from its provisioned registry into
    the workdir (the bundle may be a read-only mount: a container's or Kubernetes' secret)."""
    keys = CoordinatorBundle.load(bundle).supernode_public_keys()
    missing = sorted(set(sites) - set(keys))
    if missing:
        raise ConfigError(f"{bundle}: no provisioned SuperNode key for site(s) {missing}; "
                          "re-run `sovfl provision` with those --site names")
    out = {}
    for site in sites:
        path = workdir / f"supernode-{site}.pub"
        path.write_text(keys[site] + "\n")
        out[site] = path
    return out


def cmd_site(args: argparse.Namespace) -> int:
    """A site machine: its trainer pool and its SuperNode (node 0), or only its ranks (nodes >= 1)."""
    cfg = load_config(args.config)
    site = next((s for s in cfg.sites if s.id == args.site), None)
    if site is None:
        raise ConfigError(f"{args.config}: no site '{args.site}'; known: {[s.id for s in cfg.sites]}")
    if args.slurm:  # this node's rank and node 0's rendezvous address from the allocation (ops/slurm.py)
        node = slurm.node_from_env()
        site, args.node_rank = slurm.place_site(cfg, site.id, node), node.node_id
        print(f"site {site.id}: Slurm job {node.job_id}, node {node.node_id} of {len(node.hosts)} "
              f"({node.hosts[node.node_id]}); rendezvous at {site.rdzv_endpoint}")
    try:
        check_node_rank(site, args.node_rank)
    except ValueError as err:
        raise ConfigError(f"{args.config}: {err}") from None
    if args.node_rank > 0:
        return _site_node(args, cfg, site)
    if not args.superlink:
        raise ConfigError(f"site {site.id}: --superlink HOST:PORT (the coordinator) is required on node 0, which "
                          "runs the SuperNode")
    bundle = _bundle_dir(args.bundle, f"site {args.site}")
    if args.insecure:
        print(launcher.INSECURE_WARNING, file=sys.stderr)
    workdir = Path(args.workdir or f"runs/{cfg.federation.name}-site-{site.id}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    sock = args.socket or f"/tmp/sovfl-{site.id}-{int(time.time())}.sock"
    sup = launcher.Supervisor(workdir)
    try:
        start_s = cfg.federation.deadlines.trainer_start_s
        guard = launcher.site_guard(sup, cfg, print)  # restarts what dies (site_supervisor.py)
        trainer = guard.watch_trainer(site.id, partial(_start_node0_pool, sup, site, cfg, sock, start_s), sock)
        launcher.wait_trainers({site.id: trainer}, {site.id: sock}, start_s, print)
        data = {} if args.insecure else {"data-address": args.data or data_address_of(args.superlink)}
        launcher.watch_site_node(guard, sup, site, args.superlink, sock, bundle, args.insecure,
                                 {**launcher.site_attestation_config(cfg, site.id, workdir),
                                  **launcher.site_policy_config(cfg, site.id, workdir), **data},
                                 cfg.federation.warm_clientapps, polls=cfg.federation.supernode_polls)
        if cfg.federation.site_restarts.link_watch:
            guard.watch_link(f"site {site.id}: SuperNode", args.superlink)
        print(f"site {site.id}: SuperNode connected to {args.superlink}; Ctrl-C to stop")
        return site_supervisor.keep_running(guard)
    finally:
        sup.close()


def data_address_of(superlink: str) -> str:
    """The coordinator's data path by default: the SuperLink's host, the port after its own."""
    host, _, port = superlink.rpartition(":")
    return f"{host}:{int(port) + 1}"


def _site_node(args: argparse.Namespace, cfg, site) -> int:
    """Node N >= 1 of a multi-node site: only this node's torchrun, joining node 0's rendezvous.

    No SuperNode and no endpoint here (global rank 0, on node 0, serves them), hence no bundle.
    The torchrun is supervised like node 0's: a rank that dies (here or on another node, which
    fails this node's collectives) takes it down, and it is started again, in the rendezvous node
    0's restarted pool published (site_trainer.launch.read_rdzv_id).
    """
    deadline = args.rdzv_timeout or cfg.federation.deadlines.trainer_start_s
    workdir = Path(args.workdir or f"runs/{cfg.federation.name}-site-{site.id}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"site {site.id} node {args.node_rank}: waiting up to {deadline:g}s for node 0's rendezvous "
          f"endpoint {site.rdzv_endpoint}")
    try:
        wait_for_rendezvous(site, deadline)
    except RendezvousUnreachable as err:
        raise launcher.LaunchError(str(err)) from None
    sup = launcher.Supervisor(workdir)
    try:
        guard = launcher.site_guard(sup, cfg, print)  # restarts what dies (site_supervisor.py)
        trainer = guard.watch_trainer(f"{site.id} node {args.node_rank}",
                                      partial(_start_node_pool, sup, site, cfg, args.node_rank, deadline, {}), "")
        print(f"site {site.id} node {args.node_rank}: {site.ranks} rank(s) joining the rendezvous at "
              f"{site.rdzv_endpoint}; Ctrl-C to stop (log: {trainer.log})")
        return site_supervisor.keep_running(guard)
    finally:
        sup.close()


def _start_node0_pool(sup, site, cfg, sock: str, start_s: float):
    """Node 0's pool; a multi-node site's with a fresh rendezvous id, published to the other nodes."""
    rdzv_id = fresh_rdzv_id(site) if site.nnodes > 1 else None
    proc = launcher.start_trainer(sup, site, cfg, sock, join_timeout_s=start_s, rdzv_id=rdzv_id)
    if rdzv_id is not None:
        try:
            publish_rdzv_id(site, rdzv_id, start_s)
        except Exception as err:  # noqa: BLE001 - torch's store errors: the pool did not come up
            proc.popen.kill()
            raise launcher.LaunchError(f"site {site.id}: the rendezvous store at {site.rdzv_endpoint} did not come "
                                       f"up within {start_s:g}s ({err}); see {proc.log}") from None
    return proc


def _start_node_pool(sup, site, cfg, node_rank: int, deadline: float, last: dict):
    """Node >= 1's pool, in the rendezvous node 0's running pool published: after the first start,
    one other than `last["id"]`, the id of this node's last pool (read_rdzv_id)."""
    try:
        wait_for_rendezvous(site, deadline)
        rdzv_id = last["id"] = read_rdzv_id(site, deadline, not_id=last.get("id"))
    except RendezvousUnreachable as err:
        raise launcher.LaunchError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - torch's store errors
        raise launcher.LaunchError(f"site {site.id} node {node_rank}: no rendezvous id from node 0's store at "
                                   f"{site.rdzv_endpoint} within {deadline:g}s ({err})") from None
    return launcher.start_trainer(sup, site, cfg, "", node_rank=node_rank, join_timeout_s=deadline, rdzv_id=rdzv_id)


def _command(sub, name: str, help: str, fn, workdir_help: str) -> argparse.ArgumentParser:
    """A subcommand taking a configuration file, --workdir and --insecure."""
    p = sub.add_parser(name, help=help)
    p.add_argument("config", help="the federation's YAML configuration file")
    p.add_argument("--workdir", help=workdir_help)
    p.add_argument("--insecure", action="store_true", help="no TLS and no SuperNode authentication (debug only)")
    p.set_defaults(fn=fn)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The `sovfl` argument parser (validate, simulate, provision, coordinator, site, scrub, export, report,
    health, slurm-script, audit)."""
    p = argparse.ArgumentParser(prog="sovfl", description="Federated learning for sovereign clouds.")
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("validate", help="check a configuration file and exit")
    v.add_argument("config", help="the YAML configuration file to check")
    v.set_defaults(fn=cmd_validate)

    s = _command(sub, "simulate", "run a whole federation on loopback with real processes", cmd_simulate,
                 "where logs, checkpoints and metrics go (default: runs/NAME-TIME)")

    pv = sub.add_parser("provision", help="create the federation CA and one key bundle per party")
    pv.add_argument("out_dir", help="where the CA and the bundles go (OUT_DIR/coordinator, OUT_DIR/sites/NAME)")
    pv.add_argument("--site", action="append", required=True, help="a site name (repeat for each site)")
    pv.add_argument("--coordinator", default="coordinator", help="the coordinator's name")
    pv.add_argument("--host", action="append", default=None,
                    help="a DNS name or IP the sites use to reach the coordinator (repeatable; 127.0.0.1 and "
                         "localhost are always added: the coordinator's own tools use them)")
    pv.add_argument("--rotate", action="append", default=[], help="re-issue this party's keys (repeatable)")
    pv.set_defaults(fn=cmd_provision)

    c = _command(sub, "coordinator", "run the SuperLink and the federation on this machine", cmd_coordinator,
                 "logs, checkpoints and metrics (default: runs/NAME-coordinator)")
    c.add_argument("--host", default="0.0.0.0", help="address the sites reach (default: all interfaces)")
    c.add_argument("--port", type=int, default=9092, help="the SuperLink's port the sites connect to")
    c.add_argument("--data-port", type=int, default=None,
                   help="the data path's port (models and updates beside Flower, mutual TLS; default: --port + 1; "
                        "0: off, everything through Flower)")
    c.add_argument("--bundle", help="the coordinator's provisioned bundle (OUT_DIR/coordinator)")
    run_dir.register(s, c)

    t = _command(sub, "site", "run one site's trainer pool and SuperNode on this machine", cmd_site,
                 "logs, the site store and the trainer's local checkpoints; multi-node sites that checkpoint "
                 "need the same path on storage every node shares")
    t.add_argument("--site", required=True, help="this site's id in the configuration")
    t.add_argument("--superlink", help="the coordinator's HOST:PORT (node 0 only)")
    t.add_argument("--data", help="the coordinator's data path HOST:PORT (default: the SuperLink's host, its port + 1)")
    t.add_argument("--socket", help="the trainer's Unix socket (default: under /tmp)")
    t.add_argument("--bundle", help="this site's provisioned bundle (OUT_DIR/sites/NAME); node 0 only")
    t.add_argument("--node-rank", type=int, default=0,
                   help="multi-node sites: this node's index; 0 runs rank 0's endpoint and the SuperNode, "
                        "1..nnodes-1 run only their ranks and join node 0's rendezvous")
    t.add_argument("--slurm", action="store_true",
                   help="inside a Slurm allocation (srun, one task per node): --node-rank from SLURM_NODEID, the "
                        "rendezvous host from node 0 of SLURM_JOB_NODELIST (see `sovfl slurm-script`)")
    t.add_argument("--rdzv-timeout", type=float,
                   help="nodes >= 1: seconds to wait for node 0's rendezvous endpoint and for the nodes to "
                        "join (default: deadlines.trainer_start_s)")
    scrub_cmd.add_parser(sub)
    export_cmd.add_parser(sub)
    report_cmd.register(sub)
    health_cmd.add_parser(sub)
    slurm.add_parser(sub)
    audit_cmd.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """The `sovfl` entry point; the exit code says how it went (2: bad configuration)."""
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) == "provision":
        # the coordinator's own processes (`flwr` registering keys, submitting the run) reach its
        # SuperLink on loopback: its certificate names loopback beside the hosts the sites use
        args.host = list(dict.fromkeys([*(args.host or []), "127.0.0.1", "localhost"]))
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"sovfl: {err}", file=sys.stderr)
        return 2
    except launcher.LaunchError as err:
        print(f"sovfl: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sovfl: interrupted; all processes stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
