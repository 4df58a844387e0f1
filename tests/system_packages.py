"""Debian packages that tests need, installed by the tests themselves when missing.

CI runs the suite on a fresh root machine, so a test that needs a system tool installs its Debian
package with apt rather than relying on what an earlier session left behind. Each set below names
the command (or absolute path) a test calls and the package that provides it; where apt cannot be
used (not root, no apt-get) the test skips and says which packages it lacks. apt runs under a file
lock, since pytest-xdist may start several such files at once, and only when something is missing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

LOCK = Path("/var/lock/sovfl-test-packages.lock")

# podman build and run on a bare Debian 12: the engine, its OCI runtime (runc: this kernel's cgroup
# setup fails crun), the init the containers run under, and the network stack podman's `bridge`
# networks use: netavark, aardvark-dns for names on a network, and iptables, which bookworm's
# netavark (1.4) calls to set up every container network, the build's RUN steps included.
CONTAINERS = {"podman": "podman", "buildah": "buildah", "runc": "runc", "debootstrap": "debootstrap",
              "/usr/libexec/podman/catatonit": "catatonit", "/usr/lib/podman/netavark": "netavark",
              "/usr/lib/podman/aardvark-dns": "aardvark-dns", "iptables": "iptables"}
SLURM = {"munged": "munge", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-wlm"}
# the shaped links (benchmarks/shaped_link): network namespaces, veth pairs and tbf qdiscs
SHAPED_LINKS = {"ip": "iproute2", "tc": "iproute2"}
OPENSSL = {"openssl": "openssl"}


def _absent(cmd: str) -> bool:
    return not Path(cmd).exists() if cmd.startswith("/") else shutil.which(cmd) is None


def missing(tools: dict[str, str]) -> dict[str, str]:
    """The commands of `tools` (-> their Debian packages) not on this machine."""
    return {cmd: pkg for cmd, pkg in tools.items() if _absent(cmd)}


def install(tools: dict[str, str]) -> str | None:
    """Install the packages of the missing commands of `tools`; None when all are there after,
    otherwise why not (not root, no apt-get, apt failed), naming the commands and packages."""
    lack = missing(tools)
    if not lack:
        return None
    packages = sorted(set(lack.values()))
    if os.geteuid() != 0:
        return f"needs root to install the Debian packages {packages} (missing: {sorted(lack)})"
    if shutil.which("apt-get") is None:
        return f"no apt-get to install the Debian packages {packages} (missing: {sorted(lack)})"
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another xdist worker may be installing
        lack = missing(tools)
        if not lack:
            return None
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        wait = ["-o", "DPkg::Lock::Timeout=600"]  # another apt on the machine holds dpkg's lock for a while
        for argv in (["apt-get", *wait, "update", "-q"],
                     ["apt-get", *wait, "install", "-y", "-q", *sorted(set(lack.values()))]):
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
            if proc.returncode != 0:
                return (f"`{' '.join(argv)}` failed ({proc.returncode}) installing {sorted(set(lack.values()))}:\n"
                        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    still = missing(tools)
    if still:
        return f"installed {sorted(set(lack.values()))} but still missing {sorted(still)}"
    return None


def need_packages(tools: dict[str, str]) -> None:
    """Make every command of `tools` available or end the test: skipped where apt cannot be used
    here (not root, no apt-get), failed where apt ran and the commands are still missing."""
    why = install(tools)
    if why is None:
        return
    if why.startswith(("needs root", "no apt-get")):
        pytest.skip(why)
    pytest.fail(why)
