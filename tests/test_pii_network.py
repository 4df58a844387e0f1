"""The scrubber makes no network connection attempt: not the CLI, not its worker processes.

Every process of the run (the CLI, the forkserver, the workers) loads a sitecustomize that
records and refuses DNS look-ups and TCP/UDP connections (Unix sockets, which multiprocessing
uses, pass). A control run of Presidio's stock e-mail recognizer shows the trap is real:
tldextract fetches the public-suffix list at run time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DENY = '''
import os, socket
_log, _loaded = os.environ["NETDENY_LOG"], os.environ["NETDENY_LOADED"]

def _deny(what, detail):
    with open(_log, "a") as f:
        f.write(f"{os.getpid()} {what} {detail!r}\\n")
    raise OSError(101, "network denied by the test: " + what)

_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex

def connect(self, addr):
    if self.family == socket.AF_UNIX:
        return _connect(self, addr)
    _deny("connect", addr)

def connect_ex(self, addr):
    if self.family == socket.AF_UNIX:
        return _connect_ex(self, addr)
    _deny("connect_ex", addr)

socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
socket.getaddrinfo = lambda *a, **k: _deny("getaddrinfo", a[:2])
socket.gethostbyname = lambda *a: _deny("gethostbyname", a)
socket.gethostbyname_ex = lambda *a: _deny("gethostbyname_ex", a)
socket.create_connection = lambda *a, **k: _deny("create_connection", a[:1])
with open(_loaded, "a") as f:
    f.write(f"{os.getpid()}\\n")
'''


def _run(tmp: Path, args: list[str], extra_env: dict | None = None) -> tuple[subprocess.CompletedProcess, list, set]:
    hook = tmp / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(DENY)
    log, loaded = tmp / "attempts.log", tmp / "loaded.log"
    for f in (log, loaded):
        f.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)]), "NETDENY_LOG": str(log),
           "NETDENY_LOADED": str(loaded), "TLDEXTRACT_CACHE": str(tmp / "tld-cache"), "HOME": str(tmp),
           "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp, timeout=300)
    attempts = log.read_text().splitlines() if log.exists() else []
    pids = set(loaded.read_text().split()) if loaded.exists() else set()
    return r, attempts, pids


def test_stock_presidio_email_recognizer_reaches_for_the_network(tmp_path):
    """Control: the deny hook sees what the issue describes (and so would catch us doing it)."""
    code = ("from presidio_analyzer.predefined_recognizers import EmailRecognizer\n"
            "print(EmailRecognizer().analyze('write to jean@orange.fr', ['EMAIL_ADDRESS']))")
    r, attempts, _ = _run(tmp_path, ["-c", code])
    assert r.returncode == 0, r.stderr[-2000:]
    assert attempts, "the stock recognizer made no attempt: the deny hook would prove nothing"
    print("\n" + "\n".join(attempts[:3]))


def test_scrub_cli_with_workers_makes_no_connection_attempt(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    lines = ["Écrire à jean.dupont@orange.fr, à m.rossi@libero.it ou à info@bank.co.uk.",
             "IBAN DE89 3704 0044 0532 0130 00, carte 4111 1111 1111 1111, IP 81.2.69.160.",
             "Rufen Sie +49 30 901820 an; Steuer-ID 86095742719."]
    for i in range(6):
        (data / f"doc{i}.txt").write_text("\n".join(lines) + f"\nfiller {i}\n" * 50)
    r, attempts, pids = _run(tmp_path, ["-m", "site_trainer.pii", str(data), "--workers", "2", "--out",
                                        str(tmp_path / "out"), "--json"], {"SOVFL_PII_INLINE_BYTES": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert attempts == [], attempts
    # the hook ran in the CLI, the forkserver and the workers: they were all covered
    assert len(pids) >= 3, pids
    import json

    report = json.loads(r.stdout)
    assert report["counts"]["EMAIL_ADDRESS"] == 18 and report["counts"]["IBAN_CODE"] == 6, report["counts"]
    assert report["workers"] == 2 and report["documents"] == 6 and not report["errors"]
    out = (tmp_path / "out" / "doc0.txt").read_text()
    assert "orange.fr" not in out and "<EMAIL_ADDRESS>" in out and "<IBAN_CODE>" in out
