"""The sites' SuperNode keys admitted at a real SuperLink (TLS, SuperNode auth) from one process.

A real `flower-superlink` with the coordinator's provisioned certificate; the keys are the sites'
provisioned `supernode_auth.pub`. Checked: every site admitted in one call (one process, not one per
site); a second call with the same keys passes (the SuperLink knows them: a resumed run); a key that
is not a key fails with the site and the file named, while the other site in the same call is
still admitted.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from crypto.pki import provision
from federation.ops import launcher
from federation.ops.register_nodes import parse_sites

pytestmark = pytest.mark.e2e

SITES = ("paris", "berlin", "madrid")


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    """(supervisor, pki directory) with a running SuperLink and the `flwr` connection written."""
    tmp = tmp_path_factory.mktemp("register")
    pki = tmp / "pki"
    provision(pki, list(SITES), hosts=("127.0.0.1", "localhost"))
    sup = launcher.Supervisor(tmp / "work")
    try:
        port = launcher.free_port()
        link = launcher.start_superlink(sup, port, bundle=pki / "coordinator")
        launcher.wait_port(link, port)
        launcher.write_flwr_connection(sup, f"127.0.0.1:{port}", pki / "coordinator" / "ca.crt")
        yield sup, pki
    finally:
        sup.close()


def _key(pki: Path, site: str) -> Path:
    return pki / "sites" / site / "supernode_auth.pub"


def test_every_site_is_admitted_from_one_process_and_again_on_a_restart(superlink, monkeypatch):
    sup, pki = superlink
    started = []
    real_run = launcher.subprocess.run
    monkeypatch.setattr(launcher.subprocess, "run", lambda argv, **kw: started.append(argv) or real_run(argv, **kw))
    launcher.register_supernodes(sup, {s: _key(pki, s) for s in SITES[:2]})
    assert len(started) == 1 and started[0][2] == "federation.ops.register_nodes", started
    launcher.register_supernodes(sup, {s: _key(pki, s) for s in SITES[:2]})  # known keys: admitted


def test_a_bad_key_names_its_site_and_file_while_the_other_site_is_admitted(superlink, tmp_path):
    sup, pki = superlink
    bad = tmp_path / "not-a-key.pub"
    bad.write_text("ssh-rsa not-a-key\n")
    with pytest.raises(launcher.LaunchError) as err:
        launcher.register_supernodes(sup, {"madrid": _key(pki, "madrid"), "lisbon": bad})
    assert "site lisbon" in str(err.value) and str(bad) in str(err.value), err.value
    assert "madrid" not in str(err.value)
    again = subprocess.run([sys.executable, "-m", "federation.ops.register_nodes", "sovfl",
                            f"madrid={_key(pki, 'madrid')}"], capture_output=True, text=True, env=sup.env(), timeout=120)
    assert again.returncode == 0 and again.stdout.splitlines()[-1] == "known madrid", (again.stdout, again.stderr)


def test_arguments_are_site_equals_key():
    assert parse_sites(["a=/k/a.pub", "b=x=y"]) == {"a": Path("/k/a.pub"), "b": Path("x=y")}
    with pytest.raises(SystemExit, match="SITE=KEY_PATH"):
        parse_sites(["no-key"])
