"""The experiment configuration: one YAML file, validated by pydantic models before anything starts.

Every side reads it: the coordinator (the whole file, `federation.config.schema`), each site (its own
attestation settings, exported here), the operator tools (everything). configs/README.md describes
every field. The package itself exports only the attestation models, each imported when first
asked for: the ClientApp imports them, and its import path must stay free of torch, which
validating a workload (in `schema`) may import. Never imports the coordinator, the site or ops.
"""

import importlib

_EXPORTS = {  # name -> the module that defines it, imported on first use: a process that reads one
    # small model (the SuperNode, federation/ops/supernode_main.py) does not load attestation's
    "AttestationConfig": "federation.config.attestation_config",
    "CoordinatorAttestation": "federation.config.attestation_config",
    "SiteAttestation": "federation.config.attestation_config",
    "resolve": "federation.config.attestation_config",
    "StrictModel": "federation.config.strict",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """The package's exports, imported when first asked for."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
