"""The deployment pieces that need no container runtime or cluster: Slurm's host lists and
allocation variables (federation/ops/slurm.py), the sbatch script, `sovfl health` against real
sockets, and the Kubernetes manifests (deploy/kubernetes), parsed and checked against the images."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, sovfl, write_config
from federation.config.schema import ConfigError, load_config
from federation.ops import slurm
from federation.ops.health_cmd import tcp_accepts, unix_accepts


@pytest.mark.parametrize("spec,hosts", [
    ("n1", ["n1"]),
    ("n[1-2]", ["n1", "n2"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("r[1-2]-n[09-10]", ["r1-n09", "r1-n10", "r2-n09", "r2-n10"]),
    ("a,b[3],c", ["a", "b3", "c"]),
])
def test_hostlist_expands_like_scontrol(spec, hosts):
    assert slurm.expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["n[1-2", "n1-2]", "n[2-1]", "n[a-b]", "a,,b", "n[[1]]"])
def test_bad_hostlist_is_refused(spec):
    with pytest.raises(ValueError, match="bad Slurm host"):
        slurm.expand_hostlist(spec)


def _env(**kw):
    return {"SLURM_JOB_ID": "42", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2", **kw}


def test_node_from_env():
    node = slurm.node_from_env(_env())
    assert node == slurm.SlurmNode("42", 1, ("gpu07", "gpu08"))


@pytest.mark.parametrize("env,needle", [
    ({"SLURM_NODEID": ""}, "SLURM_NODEID not set"),
    ({"SLURM_JOB_NUM_NODES": "3"}, "do not describe a 3-node allocation"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID 2"),
    ({"SLURM_JOB_NODELIST": "gpu[07-"}, "bad Slurm host list"),
])
def test_node_from_env_refuses_what_is_not_an_allocation(env, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        slurm.node_from_env(_env(**env))


@pytest.fixture
def two_node_config(tmp_path):
    sites = [{"id": "hpc", "ranks": 4, "nnodes": 2, "rdzv_endpoint": "node0:29400", "partition": 0},
             {"id": "solo", "ranks": 1, "partition": 1}]
    return write_config(tmp_path / "c.yaml", {"workload": {"task": "digits"}, "sites": sites})


def test_place_site_puts_the_rendezvous_on_node_zero(two_node_config, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: node 0's name is its address
    cfg = load_config(two_node_config)
    site = slurm.place_site(cfg, "hpc", slurm.SlurmNode("7", 1, ("gpu07", "gpu08")))
    assert site.rdzv_endpoint == "gpu07:29400" and cfg.sites[0] is site  # what the trainer pool is started with
    with pytest.raises(ConfigError, match="has nnodes: 2, the allocation .* has 3 node"):
        slurm.place_site(cfg, "hpc", slurm.SlurmNode("7", 0, ("a", "b", "c")))


def test_sbatch_script(two_node_config):
    site = load_config(two_node_config).sites[0]
    text = slurm.sbatch_script("/c.yaml", site, "coord:9092", "/pki", "/shared/run", sovfl="/opt/sovfl/bin/sovfl",
                               partition="gpu", gpus_per_node=4, time_limit="12:00:00")
    assert text.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --time=12:00:00", "#SBATCH --output=/shared/run/slurm-%j.out"):
        assert line in text.splitlines()
    assert text.splitlines()[-1] == ("exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 /opt/sovfl/bin/sovfl site "
                                     "/c.yaml --slurm --site hpc --superlink coord:9092 --bundle /pki --workdir /shared/run")
    check = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


def test_site_slurm_outside_an_allocation_is_refused(two_node_config, tmp_path):
    env = {k: "" for k in slurm.ENV}
    proc = sovfl("site", str(two_node_config), "--site", "hpc", "--slurm", "--workdir", str(tmp_path / "w"),
                 env=env, timeout=60)
    assert proc.returncode == 2 and "inside an allocation" in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()


def test_health_checks_real_sockets(tmp_path):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        assert tcp_accepts(f"127.0.0.1:{port}", 2.0)
    assert not tcp_accepts(f"127.0.0.1:{port}", 2.0)  # closed now
    path = tmp_path / "sovfl-x-1.sock"
    assert not unix_accepts(str(tmp_path / "sovfl-*.sock"), 1.0)
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(str(path))
        srv.listen()
        assert unix_accepts(str(tmp_path / "sovfl-*.sock"), 1.0)
    assert not unix_accepts(str(tmp_path / "sovfl-*.sock"), 1.0)  # a stale socket file is not health
    proc = sovfl("health", "--tcp", f"127.0.0.1:{port}", timeout=60)
    assert proc.returncode == 1 and f"tcp 127.0.0.1:{port} does not accept" in proc.stderr
    module = subprocess.run([sys.executable, "-m", "federation.ops.health_cmd", "--unix", str(tmp_path / "none-*")],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)  # the images' form
    assert module.returncode == 1 and "does not accept connections" in module.stderr, module.stderr


# -- Kubernetes manifests --------------------------------------------------------------------------

K8S = ROOT / "deploy" / "kubernetes"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _containerfile_ports() -> set[int]:
    text = (ROOT / "deploy" / "Containerfile").read_text()
    return {int(p) for line in text.splitlines() if line.startswith("EXPOSE") for p in line.split()[1:]}


def test_kubernetes_coordinator_manifest():
    docs = {d["kind"]: d for d in _docs("coordinator.yaml")}
    assert set(docs) >= {"Job", "Service", "PersistentVolumeClaim"}
    pod = docs["Job"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"].startswith("sovfl-coordinator") or "/sovfl-coordinator:" in c["image"]
    assert c["args"][:2] == ["coordinator", "/config/federation.yaml"] and "--bundle" in c["args"]
    ports = {p["containerPort"] for p in c["ports"]}
    assert ports == _containerfile_ports() == {9092, 9093}
    assert {p["targetPort"] for p in docs["Service"]["spec"]["ports"]} == ports
    assert docs["Service"]["spec"]["selector"].items() <= docs["Job"]["spec"]["template"]["metadata"]["labels"].items()
    _check_mounts(pod, c, {"/pki", "/config", "/work"})
    assert c["readinessProbe"]["exec"]["command"][:4] == ["python", "-m", "federation.ops.health_cmd", "--tcp"]


def test_kubernetes_site_manifest():
    docs = {d["kind"]: d for d in _docs("site.yaml")}
    assert set(docs) >= {"Deployment", "PersistentVolumeClaim"}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert "/sovfl-site:" in c["image"] or c["image"].startswith("sovfl-site")
    args = c["args"]
    assert args[:2] == ["site", "/config/federation.yaml"] and "--superlink" in args and "--bundle" in args
    superlink = args[args.index("--superlink") + 1]
    coord = {d["kind"]: d for d in _docs("coordinator.yaml")}["Service"]
    host, port = superlink.rsplit(":", 1)
    assert host.startswith(coord["metadata"]["name"]) and int(port) == 9092  # the coordinator's Service
    _check_mounts(pod, c, {"/pki", "/config", "/work", "/data", "/models", "/dev/shm"})
    assert c["livenessProbe"]["exec"]["command"][:4] == ["python", "-m", "federation.ops.health_cmd", "--unix"]
    assert docs["Deployment"]["spec"]["strategy"]["type"] == "Recreate"  # never two SuperNodes of one site


def _check_mounts(pod: dict, c: dict, paths: set[str]) -> None:
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert set(mounts) == paths
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert {m["name"] for m in mounts.values()} == set(volumes)
    assert mounts["/pki"]["readOnly"] and "secret" in volumes[mounts["/pki"]["name"]]
    assert mounts["/config"]["readOnly"] and "configMap" in volumes[mounts["/config"]["name"]]
    sec = pod["securityContext"]
    assert sec["runAsUser"] == sec["fsGroup"] == 10001 and sec["runAsNonRoot"]
    assert f"ARG UID={sec['runAsUser']}" in (ROOT / "deploy" / "Containerfile").read_text()
