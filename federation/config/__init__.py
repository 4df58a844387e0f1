"""The experiment configuration: one YAML file, validated by pydantic models before anything starts.

Every side reads it: the coordinator (the whole file, `federation.config.schema`), each site (its own
attestation settings, exported here), the operator tools (everything). configs/README.md describes
every field. The package itself exports only the attestation models: the ClientApp imports them,
and its import path must stay free of torch, which validating a workload (in `schema`) may import.
Never imports the coordinator, the site or ops.
"""

from federation.config.attestation_config import AttestationConfig, CoordinatorAttestation, SiteAttestation, resolve
from federation.config.strict import StrictModel

__all__ = [
    "AttestationConfig",
    "CoordinatorAttestation",
    "SiteAttestation",
    "StrictModel",
    "resolve",
]
