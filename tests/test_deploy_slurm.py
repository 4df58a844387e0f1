"""A two-node site as a Slurm job (`sovfl slurm-script`, `sovfl site --slurm`), on a Slurm cluster
started here: munged, slurmctld and two slurmd (n1, n2) on this machine, each with its own port,
spool and log, all under the test's directory with a configuration of its own (SLURM_CONF).

The coordinator runs as `sovfl coordinator` with a provisioned PKI (TLS, SuperNode authentication);
the site `hpc` (2 nodes x 1 rank) is submitted with sbatch. Its configuration names the rendezvous
host `node0`, which no resolver knows: under --slurm it becomes node 0's address (Slurm's NodeAddr).
Checked: 2 rounds aggregated with both nodes' ranks training the same model in the last round, node 1
running only its ranks, and after `scancel` no process of the job is left (every process the job
started carries the test's run marker in its environment). The cluster's daemons are stopped and
its jobs cancelled at the end, whatever happened.

Needs root (it installs slurm-wlm and munge with apt when missing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import live_marked, sovfl_popen
from deploy_tools import cleanup, need_packages, run, sovfl_cli
from system_packages import SLURM
from federation.ops.launcher import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=200)]

NODES = ("n1", "n2")


def _slurm_conf(d: Path, name: str, ports: list[int]) -> str:
    nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname=localhost Port={p} CPUs=2 State=UNKNOWN"
                      for n, p in zip(NODES, ports[1:]))
    return f"""ClusterName={name}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/linear
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=30
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def _until(what: str, check, deadline_s: float, interval_s: float = 1.0):
    end = time.monotonic() + deadline_s
    while True:
        got = check()
        if got or time.monotonic() > end:
            assert got, f"{what}: not within {deadline_s:g}s"
            return got
        time.sleep(interval_s)


@pytest.fixture
def slurm(tmp_path):
    """A running two-node cluster: the environment its commands need (SLURM_CONF)."""
    need_packages(SLURM)
    d = tmp_path / "slurm"
    (d / "state").mkdir(parents=True)
    (d / "munge.key").write_bytes(os.urandom(1024))
    (d / "munge.key").chmod(0o400)
    conf = d / "slurm.conf"
    conf.write_text(_slurm_conf(d, f"sovfl{uuid.uuid4().hex[:6]}", [free_port() for _ in range(3)]))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons: list[subprocess.Popen] = []

    def start(argv: list[str], log: str) -> None:
        with open(d / log, "wb") as out:
            daemons.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True))

    with cleanup() as on_exit:
        on_exit(lambda: [_stop(p) for p in reversed(daemons)])
        # --force: the socket's directory is the test's private one (munged wants it open to all)
        start(["munged", "-F", "--force", f"--socket={d}/munge.sock", f"--key-file={d}/munge.key",
               f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munge.seed"], "munged.out")
        _until("munged's socket", lambda: (d / "munge.sock").exists(), 30, 0.2)
        start(["slurmctld", "-D", "-f", str(conf)], "slurmctld.out")
        for node in NODES:
            start(["slurmd", "-D", "-N", node, "-f", str(conf)], f"slurmd-{node}.out")

        def cancel_all():  # before the daemons stop: a job's steps end with them
            run(["scancel", "--partition", "debug"], env=env, check=False, timeout=30)
            _until("the cluster's jobs to end", lambda: not run(["squeue", "-h"], env=env, check=False).stdout.strip(),
                   90, 2)
        on_exit(cancel_all)
        _until("both slurmd to register", lambda: run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env,
                                                      check=False).stdout.split().count("idle") == 2, 60, 0.5)
        yield env


def test_two_node_site_as_a_slurm_job(slurm, tmp_path, marker):
    env = {**slurm, "SOVFL_RUN_MARKER": marker}  # sbatch exports it to every process of the job
    sovfl_cli("provision", str(tmp_path / "pki"), "--site", "hpc", env=env)
    site = {"id": "hpc", "ranks": 1, "nnodes": 2, "rdzv_endpoint": f"node0:{free_port()}", "partition": 0,
            "local_steps": 5, "batch_size": 16, "lr": 0.1}
    cfg = tmp_path / "hpc.yaml"
    cfg.write_text(yaml.safe_dump({
        "federation": {"name": "slurm", "rounds": 2, "quorum": 1,
                       "deadlines": {"connect_s": 240, "round_s": 120, "evaluate_s": 120, "trainer_start_s": 240}},
        "workload": {"task": "digits", "options": {"hidden": 8}}, "sites": [site]}, sort_keys=False))
    port = free_port()
    work = tmp_path / "hpc"
    script = tmp_path / "hpc.sbatch"
    sovfl_cli("slurm-script", str(cfg), "--site", "hpc", "--superlink", f"127.0.0.1:{port}", "--bundle",
              str(tmp_path / "pki" / "sites" / "hpc"), "--workdir", str(work), "--out", str(script), env=env)
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "srun --ntasks-per-node=1" in text and " --slurm " in text, text

    coord = sovfl_popen("coordinator", str(cfg), "--host", "127.0.0.1", "--port", str(port), "--workdir",
                        str(tmp_path / "coord"), "--bundle", str(tmp_path / "pki" / "coordinator"), env=env)
    with cleanup() as on_exit:
        on_exit(lambda: coord.kill() if coord.poll() is None else None)
        job = run(["sbatch", "--parsable", str(script)], env=env).stdout.strip().split(";")[0]
        on_exit(lambda: run(["scancel", job], env=env, check=False))
        slurm_out = work / f"slurm-{job}.out"
        end = time.monotonic() + 600
        while coord.poll() is None and time.monotonic() < end:  # a job that ends early fails the test at once
            if not run(["squeue", "-h", "-j", job], env=env, check=False).stdout.strip():
                pytest.fail(f"job {job} ended before the run did:\n"
                            f"{slurm_out.read_text() if slurm_out.exists() else '(no output)'}")
            time.sleep(3)
        out, _ = coord.communicate(timeout=30)
        assert coord.returncode == 0, out + (slurm_out.read_text() if slurm_out.exists() else "")
        assert "RESULT rounds=2" in out and "signed updates required" in out, out
        lines = [json.loads(x) for x in (tmp_path / "coord" / "metrics.jsonl").read_text().splitlines()]
        digests = lines[-1]["sites"]["hpc"]["rank_digests"]
        assert len(digests) == 2 and len(set(digests)) == 1, lines[-1]  # both nodes' ranks, the same model
        log = slurm_out.read_text()
        for node in (0, 1):
            assert f"node {node} of 2 (n{node + 1}); rendezvous at 127.0.0.1:" in log, log
        assert "site hpc node 1: 1 rank(s) joining the rendezvous" in log, log
        assert "SuperNode connected to 127.0.0.1" in log, log
        assert (work / "logs" / "site-hpc-node1-trainer.log").exists()
        assert not list((work / "logs").glob("*supernode*node1*"))  # node 1: its ranks only

        # the site serves until stopped; scancel stops every process of the job
        assert run(["squeue", "-h", "-j", job, "-o", "%T"], env=env).stdout.strip() == "RUNNING"
        assert live_marked(marker), "the job's processes carry the run marker"
        run(["scancel", job], env=env)
        _until("the job to leave the queue", lambda: not run(["squeue", "-h", "-j", job], env=env,
                                                            check=False).stdout.strip(), 120, 2)
        _until("every process of the job to exit", lambda: live_marked(marker) == [], 60, 1)
        log = slurm_out.read_text()  # each node's sovfl stopped its own processes on SIGTERM (exit 130)
        assert log.count("sovfl: interrupted; all processes stopped") == 2, log
        assert "Exited with exit code 130" in log and "exit code 137" not in log, log
