"""The two images (deploy/Containerfile) built here and run as a federation on a podman network.

From a Debian base made locally (deploy/make-base-image.sh: debootstrap, `podman import`; kept in
podman's store as a cache between runs) and a wheelhouse of the project's wheel and its pins
(deploy/wheelhouse.sh, from this checkout), deploy/build-images.sh builds the coordinator and site
images on a dependencies' layer it keeps as localhost/sovfl-deps:DIGEST (the cache that outlives
them: a run with the same pins installs only the project). A coordinator container and two site containers then run 2 rounds of the digits federation
with SecAgg+ on an internal podman network (no route out: nothing is fetched at run time), with TLS
and SuperNode authentication from `sovfl provision`; the bundles and the configuration are mounted
read-only, each container's /work is a host directory. Checked: the RESULT line, the metrics of both
sites in both rounds, the health checks, the non-root user, the CPU torch build, and that the sites
stop cleanly on `podman stop` (SIGTERM: exit 130, not a SIGKILL after the grace period). Every
container, the network and the two product images are removed at the end, whatever happened; the
base and the dependencies' layer stay, as caches.

Needs root (it installs podman, buildah, runc, debootstrap, iptables and the rest of
system_packages.CONTAINERS with apt when missing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from deploy_tools import ROOT, cleanup, need_packages, run, sovfl_cli
from system_packages import CONTAINERS

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=300)]

BASE = "localhost/sovfl-base:bookworm"
UID = 10001  # the images' user (deploy/Containerfile)
# this kernel's cgroup setup needs runc (crun fails) and ulimits at or below the host's
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
"""
BUILD_EXTRA = "--runtime runc --ulimit nofile=20000:20000 --ulimit nproc=32768:32768"
SITES = ("paris", "berlin")


@pytest.fixture(scope="module")
def podman_env(tmp_path_factory):
    need_packages(CONTAINERS)
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf), "BUILDAH_EXTRA": BUILD_EXTRA}


@pytest.fixture(scope="module")
def images(podman_env, tmp_path_factory):
    """(coordinator image, site image, dependencies' image, build seconds), built once for this file;
    the first two are removed after it."""
    if run(["podman", "image", "exists", BASE], env=podman_env, check=False).returncode != 0:
        run([str(ROOT / "deploy" / "make-base-image.sh"), BASE], env=podman_env, timeout=900)
    tag = f"test-{uuid.uuid4().hex[:8]}"
    ctx = tmp_path_factory.mktemp("context")
    started = time.monotonic()
    out = run([str(ROOT / "deploy" / "build-images.sh"), str(ctx), BASE, tag, sys.executable],
              env=podman_env, timeout=1200).stdout.split()
    built = time.monotonic() - started
    coordinator, site = f"localhost/sovfl-coordinator:{tag}", f"localhost/sovfl-site:{tag}"
    assert out[-2:] == [coordinator, site], out
    deps = f"localhost/sovfl-deps:{(ctx / 'deps.sha256').read_text().strip()}"
    yield coordinator, site, deps, built
    try:  # removing two GB-sized images is slow on a loaded machine; a leftover image fails no test
        run(["podman", "rmi", "-f", coordinator, site], env=podman_env, check=False, timeout=600)
    except subprocess.TimeoutExpired:
        print(f"podman rmi of {coordinator} and {site} did not end within 600 s: remove them by hand")


def _podman(env, *args, timeout=120, check=True):
    return run(["podman", *args], env=env, timeout=timeout, check=check)


def test_images_are_cpu_non_root_and_offline_ready(images, podman_env):
    coordinator, site, deps, built = images
    size = int(_podman(podman_env, "image", "inspect", "--format", "{{.Size}}", site).stdout)
    layers = {image: _podman(podman_env, "image", "inspect", "--format", "{{json .RootFS.Layers}}", image).stdout
              for image in (deps, coordinator, site)}
    deps_layers = json.loads(layers[deps])
    for image in (coordinator, site):  # both are built on the kept dependencies' layer, plus the project's
        assert json.loads(layers[image])[:len(deps_layers)] == deps_layers, (image, layers)
        assert len(json.loads(layers[image])) > len(deps_layers), (image, layers)
    print(f"images built in {built:.0f}s (wheelhouse + both targets); site image {size / 1e9:.2f} GB")
    probe = ("import json, os, torch, importlib.metadata as md; "
             "print(json.dumps({'uid': os.getuid(), 'cuda': torch.version.cuda, 'torch': torch.__version__, "
             "'nvidia': sorted(d.metadata['Name'] for d in md.distributions() if d.metadata['Name'].startswith('nvidia'))}))")
    for image in (coordinator, site):
        got = json.loads(_podman(podman_env, "run", "--rm", "--network", "none", "--entrypoint", "python",
                                 image, "-c", probe).stdout)
        assert got == {"uid": UID, "cuda": None, "torch": "2.13.0+cpu", "nvidia": []}, got
        data = json.loads(_podman(podman_env, "image", "inspect", image).stdout)[0]
        config = data["Config"]
        assert config["Entrypoint"] == ["sovfl"] and config["User"].startswith(str(UID))
        health = data.get("Healthcheck") or config.get("Healthcheck")  # kept by --format docker
        assert health and "-m federation.ops.health_cmd" in " ".join(health["Test"]), (sorted(data), sorted(config))
    assert size < 4e9  # a CUDA torch build alone would be several GB


def _config(path: Path) -> None:
    sites = [{"id": name, "ranks": 1, "partition": i, "local_steps": 5, "batch_size": 16, "lr": 0.1}
             for i, name in enumerate(SITES)]
    path.write_text(yaml.safe_dump({
        "federation": {"name": "containers", "rounds": 2, "quorum": 2, "update_kind": "delta",
                       "deadlines": {"connect_s": 240, "round_s": 180, "evaluate_s": 180, "trainer_start_s": 240},
                       "secagg": {"enabled": True, "threshold": 2, "clip": 1.0, "bits": 32}},
        "workload": {"task": "digits", "options": {"hidden": 8}},
        "sites": sites}, sort_keys=False))


def _logs(env, name: str) -> str:
    """A container's output, stdout and stderr (podman logs keeps them apart)."""
    proc = _podman(env, "logs", name, check=False)
    return proc.stdout + proc.stderr


def _owned(path: Path) -> str:
    """A host directory the images' user may read and write (bundles keep their 0600 keys)."""
    for p in (path, *path.rglob("*")):
        os.chown(p, UID, UID)
    return str(path)


def _wait_healthy(env, name: str, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if _podman(env, "healthcheck", "run", name, check=False).returncode == 0:
            return True
        if _podman(env, "inspect", "--format", "{{.State.Running}}", name, check=False).stdout.strip() != "true":
            return False
        time.sleep(3)
    return False


def test_coordinator_and_two_sites_in_containers(images, podman_env, tmp_path):
    coordinator_image, site_image, _, _ = images
    env = podman_env
    run_id = uuid.uuid4().hex[:8]
    pki = tmp_path / "pki"
    sovfl_cli("provision", str(pki), *[a for s in SITES for a in ("--site", s)], "--host", "coordinator")
    (tmp_path / "config").mkdir()
    _config(tmp_path / "config" / "federation.yaml")
    work = {name: tmp_path / f"work-{name}" for name in ("coordinator", *SITES)}
    for path in work.values():
        path.mkdir()
    network = f"sovfl-{run_id}"
    names = {"coordinator": f"sovfl-coordinator-{run_id}", **{s: f"sovfl-{s}-{run_id}" for s in SITES}}
    common = ["--network", network, "--init", "--shm-size", "256m", "--stop-timeout", "60",
              "-v", f"{_owned(tmp_path / 'config')}:/config:ro"]
    with cleanup() as on_exit:
        _podman(env, "network", "create", "--internal", network)
        on_exit(lambda: _podman(env, "network", "rm", "-f", network, check=False))
        on_exit(lambda: _podman(env, "rm", "-f", "-t", "5", *names.values(), check=False, timeout=120))
        _podman(env, "run", "-d", "--name", names["coordinator"], "--network-alias", "coordinator", *common,
                "-v", f"{_owned(pki / 'coordinator')}:/pki:ro", "-v", f"{_owned(work['coordinator'])}:/work",
                coordinator_image)  # its default command: sovfl coordinator /config/federation.yaml --bundle /pki
        for site in SITES:
            _podman(env, "run", "-d", "--name", names[site], *common,
                    "-v", f"{_owned(pki / 'sites' / site)}:/pki:ro", "-v", f"{_owned(work[site])}:/work",
                    site_image, "site", "/config/federation.yaml", "--site", site, "--superlink", "coordinator:9092",
                    "--bundle", "/pki", "--workdir", "/work/run")
        for name in names.values():
            assert _wait_healthy(env, name, 300), _logs(env, name)[-3000:]
        code = _podman(env, "wait", names["coordinator"], timeout=900).stdout.strip()
        logs = _logs(env, names["coordinator"])
        assert code == "0", logs[-4000:]
        assert "RESULT rounds=2" in logs, logs[-4000:]
        assert "updates masked by SecAgg+, every secure-aggregation message signed by its site" in logs, logs[-4000:]
        metrics = [json.loads(x) for x in (work["coordinator"] / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [m["round"] for m in metrics] == [1, 2]
        for m in metrics:  # both sites' masked updates, unmasked as one sum
            assert m["status"] == "aggregated" and sorted(m["sites"]) == sorted(SITES), m
            assert sorted(m["secagg"]["contributors"]) == sorted(SITES), m["secagg"]
        # the sites keep serving until stopped; SIGTERM stops them cleanly
        for site in SITES:
            assert _podman(env, "inspect", "--format", "{{.State.Running}}", names[site]).stdout.strip() == "true"
        _podman(env, "stop", "-t", "60", *[names[s] for s in SITES], timeout=180)
        for site in SITES:
            state = json.loads(_podman(env, "inspect", "--format", "{{json .State}}", names[site]).stdout)
            out = _logs(env, names[site])
            assert state["ExitCode"] == 130, (state, out[-3000:])  # the CLI's clean teardown, not SIGKILL (137)
            assert "SuperNode connected to coordinator:9092" in out and "all processes stopped" in out, out[-3000:]
        _podman(env, "rm", *names.values())
        assert _podman(env, "ps", "-a", "--filter", f"name={run_id}", "--format", "{{.Names}}").stdout.strip() == ""
