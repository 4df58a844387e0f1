"""A multi-node site as one Slurm job: `sovfl site --slurm` on every node of an allocation, and the
sbatch script (`sovfl slurm-script`) that starts it there with srun, one task per node.

Slurm says where each task runs: `SLURM_NODEID` is this node's index in the allocation (its
`--node-rank`), `SLURM_JOB_NODELIST` the allocation's nodes in order; node 0 runs the SuperNode (with its warm
ClientApp executor, federation/ops/warm_executor.py) and rank 0's endpoint and hosts the torch rendezvous, so the site's `rdzv_endpoint` is node 0's address
(Slurm's NodeAddr for it) at the port the configuration gives. Everything else is `sovfl site` as
on any machine: the same supervisor restarts a dead pool or SuperNode inside the allocation.
`scancel` sends SIGTERM to every node's `sovfl site`, which stops its processes and exits.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from federation.config.schema import ConfigError

ENV = ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES")


@dataclass(frozen=True)
class SlurmNode:
    """Where this task runs in its allocation."""

    job_id: str
    node_id: int
    hosts: tuple[str, ...]  # the allocation's node names, in Slurm's order (node 0 first)


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compressed host list (`gpu[01-03,07],login1`, `r[1-2]-n[1-2]`) as node names, in order."""
    names: list[str] = []
    for part in _split_top(spec):
        names.extend(_expand_one(part))
    return names


def _split_top(spec: str) -> list[str]:
    """Split on the commas that are not inside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in spec.strip():
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise ValueError(f"bad Slurm host list {spec!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"bad Slurm host list {spec!r}: unbalanced brackets")
    parts.append(cur)
    if any(not p for p in parts):
        raise ValueError(f"bad Slurm host list {spec!r}: an empty name")
    return parts


def _expand_one(part: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", part)
    if not m:
        return [part]
    prefix, ranges, rest = m.groups()
    out = []
    for r in ranges.split(","):
        lo, _, hi = r.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"bad Slurm host range {r!r} in {part!r}")
        width = len(lo)  # zero padding is kept: gpu[01-03] -> gpu01 gpu02 gpu03
        for i in range(int(lo), int(hi or lo) + 1):
            out.extend(f"{prefix}{i:0{width}d}{tail}" for tail in _expand_one(rest))
    return out


def node_from_env(env: dict[str, str] | None = None) -> SlurmNode:
    """This task's place in its allocation, from the variables srun sets."""
    env = os.environ if env is None else env
    missing = [v for v in ENV if not env.get(v)]
    if missing:
        raise ConfigError(f"--slurm: {', '.join(missing)} not set: run `sovfl site --slurm` inside an allocation, "
                          "one task per node (`srun --ntasks-per-node=1`, as the script of `sovfl slurm-script` does)")
    try:
        hosts = tuple(expand_hostlist(env["SLURM_JOB_NODELIST"]))
        node_id = int(env["SLURM_NODEID"])
    except ValueError as err:
        raise ConfigError(f"--slurm: {err}") from None
    if len(hosts) != int(env["SLURM_JOB_NUM_NODES"]) or not 0 <= node_id < len(hosts):
        raise ConfigError(f"--slurm: SLURM_NODEID {node_id} and SLURM_JOB_NODELIST {env['SLURM_JOB_NODELIST']} "
                          f"do not describe a {env['SLURM_JOB_NUM_NODES']}-node allocation")
    return SlurmNode(env["SLURM_JOB_ID"], node_id, hosts)


def node_address(name: str) -> str:
    """How other nodes reach node `name`: Slurm's NodeAddr for it (the name itself where scontrol
    is absent or says nothing else)."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        out = subprocess.run([scontrol, "show", "node", "-o", name], capture_output=True, text=True, timeout=30)
        m = re.search(r"\bNodeAddr=(\S+)", out.stdout)
        if out.returncode == 0 and m:
            return m.group(1)
    return name


def place_site(cfg, site_id: str, node: SlurmNode):
    """The configuration with site `site_id`'s rendezvous on node 0 of the allocation: the host of
    its `rdzv_endpoint` becomes node 0's address, the port stays. Checks the allocation's size."""
    index, site = next((i, s) for i, s in enumerate(cfg.sites) if s.id == site_id)
    if len(node.hosts) != site.nnodes:
        raise ConfigError(f"--slurm: site {site.id} has nnodes: {site.nnodes}, the allocation (job {node.job_id}) "
                          f"has {len(node.hosts)} node(s) ({', '.join(node.hosts)}); submit with --nodes={site.nnodes}")
    if site.nnodes > 1:
        port = site.rdzv_endpoint.rpartition(":")[2]
        if not port.isdigit():
            raise ConfigError(f"site {site.id}: rdzv_endpoint {site.rdzv_endpoint!r} has no port; under --slurm its "
                              "host is node 0's, its port the one you give (e.g. node0:29400)")
        site = site.model_copy(update={"rdzv_endpoint": f"{node_address(node.hosts[0])}:{port}"})
        cfg.sites[index] = site
    return site


def sbatch_script(config: str, site, superlink: str, bundle: str, workdir: str, sovfl: str | None = None,
                  partition: str | None = None, gpus_per_node: int = 0, time_limit: str | None = None,
                  extra: list[str] | None = None) -> str:
    """The batch script for one multi-node site: `nnodes` nodes, one srun task each."""
    sovfl = sovfl or str(Path(sys.executable).parent / "sovfl")
    lines = ["#!/bin/bash", f"#SBATCH --job-name=sovfl-{site.id}", f"#SBATCH --nodes={site.nnodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --output={workdir}/slurm-%j.out"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if time_limit:
        lines.append(f"#SBATCH --time={time_limit}")
    argv = [sovfl, "site", config, "--slurm", "--site", site.id, "--superlink", superlink, "--bundle", bundle,
            "--workdir", workdir, *(extra or [])]
    lines += [
        f"# site {site.id}: {site.nnodes} node(s) x {site.ranks} rank(s). Node 0 (SLURM_NODEID 0) runs the SuperNode",
        "# and rank 0's endpoint and hosts the rendezvous; every other node runs its ranks. `scancel` stops all of it.",
        f"# The workdir must be on storage every node shares when the site checkpoints; the bundle is read on node 0.",
        "export FLWR_TELEMETRY_ENABLED=0",
        f"mkdir -p {shlex.quote(workdir)}",
        "exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 " + " ".join(shlex.quote(a) for a in argv),
        ""]
    return "\n".join(lines)


def cmd_slurm_script(args) -> int:
    """`sovfl slurm-script`: print (or write) the sbatch script of one multi-node site."""
    from federation.config.schema import load_config

    cfg = load_config(args.config)
    site = next((s for s in cfg.sites if s.id == args.site), None)
    if site is None:
        raise ConfigError(f"{args.config}: no site '{args.site}'; known: {[s.id for s in cfg.sites]}")
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)  # Slurm opens the job's output file there before the script runs
    text = sbatch_script(str(Path(args.config).resolve()), site, args.superlink, str(Path(args.bundle).resolve()),
                         str(workdir), partition=args.partition,
                         gpus_per_node=args.gpus_per_node, time_limit=args.time)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}: submit it with `sbatch {args.out}`")
    else:
        print(text, end="")
    return 0


def add_parser(sub) -> None:
    """Register `sovfl slurm-script` on the CLI's subparsers."""
    p = sub.add_parser("slurm-script", help="write the sbatch script that runs a multi-node site under Slurm")
    p.add_argument("config", help="the federation's YAML configuration file (the site's entry gives nnodes and "
                   "rdzv_endpoint)")
    p.add_argument("--site", required=True, help="the site's id in the configuration")
    p.add_argument("--superlink", required=True, help="the coordinator's HOST:PORT")
    p.add_argument("--bundle", required=True, help="the site's provisioned bundle, readable on node 0")
    p.add_argument("--workdir", required=True, help="logs and site state (shared storage when the site checkpoints)")
    p.add_argument("--partition", help="#SBATCH --partition")
    p.add_argument("--gpus-per-node", type=int, default=0, help="#SBATCH --gpus-per-node (the site's ranks per node)")
    p.add_argument("--time", help="#SBATCH --time (the run's wall-clock limit)")
    p.add_argument("--out", help="write the script here instead of printing it")
    p.set_defaults(fn=cmd_slurm_script)
