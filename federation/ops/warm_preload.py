"""What a site's warm ClientApp parents import before they fork, beyond Flower and our ClientApp.

A site's verifiers and attester are plug-ins loaded by name when a message carries an ATTEST
record (crypto/attestation/plugins.py): their modules (JOSE, X.509 parsing, a user's own) would
otherwise be imported by every worker that serves such a message, once per message, since a
worker ends with its task. The launcher names them from the site's own attestation settings in
the SuperExec's environment (PRELOAD_ENV), and each warm parent imports them once
(warm_worker.warm_up), so that its workers start with them loaded.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from federation.config.attestation_config import SiteAttestation

PRELOAD_ENV = "SOVFL_WARM_PRELOAD"  # comma-separated module names


def attestation_modules(settings: SiteAttestation) -> list[str]:
    """The modules of the site's attester and of its verifiers for the coordinator, built-in or
    installed plug-ins (a name nothing provides is left to the message, which reports it)."""
    from crypto.attestation import available_attesters, available_verifiers

    attesters, verifiers = available_attesters(), available_verifiers()
    targets = [attesters.get(settings.attester.kind)] if settings.attester is not None else []
    targets += [verifiers.get(name) for name in settings.coordinator.verifiers]
    modules = ["crypto.attestation", *(t.partition(":")[0] for t in targets if t)]
    return list(dict.fromkeys(modules))


def preload_env(node_config: Mapping[str, str]) -> dict[str, str]:
    """PRELOAD_ENV for the SuperExec of a site with this node config; empty without attestation.
    Settings that cannot be read preload nothing: the first message that needs them says why."""
    path = node_config.get("attestation-config")
    if not path:
        return {}
    try:
        settings = SiteAttestation.model_validate_json(Path(path).read_text())
    except (OSError, ValidationError):
        return {}
    return {PRELOAD_ENV: ",".join(attestation_modules(settings))}


def preload(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Import the modules PRELOAD_ENV names; for each that fails, a line saying so (also on
    stderr). A module that fails here fails the same way in the worker that needs it, where the
    message's reply reports it."""
    failed = []
    for name in filter(None, (n.strip() for n in environ.get(PRELOAD_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a plug-in's import may raise anything
            failed.append(f"warm ClientApp parent: could not preload {name} ({type(err).__name__}: {err}); "
                          "each message that needs it imports it again")
    for line in failed:
        print(line, file=sys.stderr, flush=True)
    return failed
