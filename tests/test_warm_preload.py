"""A site's warm ClientApp parents import its attestation plug-ins before they fork."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from federation.config.attestation_config import AttestationConfig, SiteAttestation, resolve
from federation.ops import launcher, warm_preload
from federation.ops.warm_parent import ONE_THREAD_ENV
from federation.ops.warm_preload import PRELOAD_ENV
from test_supernode_polls import Recorder

ROOT = Path(__file__).resolve().parents[1]


def site_settings(tmp_path: Path) -> Path:
    """A site's attestation file as `sovfl simulate` writes it: the dev issuer's attester and verifier."""
    att = resolve(AttestationConfig(enabled=True, dev_issuer=True), tmp_path / "issuer", create=True)
    path = tmp_path / "attestation.json"
    path.write_text(att.for_site("a").model_dump_json())
    return path


def test_the_sites_attester_and_verifier_modules_are_named(tmp_path):
    env = warm_preload.preload_env({"attestation-config": str(site_settings(tmp_path))})
    assert env[PRELOAD_ENV].split(",") == ["crypto.attestation", "crypto.attestation.testing",
                                           "crypto.attestation.eat_jwt"]


def test_nothing_is_named_without_attestation_or_with_unreadable_settings(tmp_path):
    assert warm_preload.preload_env({"site-id": "a"}) == {}
    assert warm_preload.preload_env({"attestation-config": str(tmp_path / "missing.json")}) == {}
    (tmp_path / "bad.json").write_text("{not json")
    assert warm_preload.preload_env({"attestation-config": str(tmp_path / "bad.json")}) == {}


def test_an_unknown_plugin_name_is_left_to_the_message(tmp_path):
    data = json.loads(site_settings(tmp_path).read_text())
    data["coordinator"]["verifiers"]["no-such-verifier"] = {}
    settings = SiteAttestation.model_validate(data)
    assert "no-such-verifier" not in ",".join(warm_preload.attestation_modules(settings))


def test_a_module_that_cannot_be_imported_is_reported_and_the_rest_still_load(capsys):
    failed = warm_preload.preload({PRELOAD_ENV: "no_such_module_for_sovfl, json"})
    assert len(failed) == 1 and "no_such_module_for_sovfl" in failed[0] and "ModuleNotFoundError" in failed[0]
    assert "could not preload no_such_module_for_sovfl" in capsys.readouterr().err
    assert "json" in sys.modules


def test_the_real_parent_has_them_loaded_and_still_forks_from_one_thread(tmp_path):
    """The production warm-up with the launcher's environment: the plug-ins are loaded before the
    first fork, loading them started no thread (the parent would refuse to fork), and what was
    loaded is frozen out of the collector (a worker's collections copy none of the shared heap)."""
    script = ("import sys\nfrom federation.ops import warm_worker as w\n"
              "w.warm_up()\nassert w.fork_safety() is None, w.fork_safety()\n"
              "import gc\nassert gc.get_freeze_count() > 10000, gc.get_freeze_count()\n"
              "print(sorted(m for m in sys.modules if m.startswith('crypto.attestation.')))\n")

    def loaded(env_add: dict[str, str]) -> str:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120,
                             env={**os.environ, **env_add, **ONE_THREAD_ENV})
        assert out.returncode == 0, out.stderr
        return out.stdout

    without = loaded({})  # our ClientApp alone does not load them: the preload does
    assert "crypto.attestation.eat_jwt" not in without and "crypto.attestation.testing" not in without
    with_them = loaded(warm_preload.preload_env({"attestation-config": str(site_settings(tmp_path))}))
    assert "crypto.attestation.eat_jwt" in with_them and "crypto.attestation.testing" in with_them


def test_the_launcher_hands_them_to_the_warm_superexec_only():
    sup = Recorder()
    launcher.start_superexec(sup, "a", 1234, 2, preload={PRELOAD_ENV: "crypto.attestation"})
    launcher.start_superexec(sup, "a", 1234, 0, preload={PRELOAD_ENV: "crypto.attestation"})
    (_, warm_argv, warm_env), (_, _, flower_env) = sup.started
    assert "federation.ops.warm_superexec" in warm_argv and warm_env[PRELOAD_ENV] == "crypto.attestation"
    assert PRELOAD_ENV not in flower_env  # Flower's flower-superexec starts no warm parent
