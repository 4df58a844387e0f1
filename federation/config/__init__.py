"""The experiment configuration: one YAML file, validated by pydantic models before anything starts.

Every side reads it: the coordinator (the whole file), each site (its own attestation settings),
the operator tools (everything). configs/README.md describes every field. Imports the codecs (to
validate codec specs), crypto's SecAgg and attestation settings and site_trainer's workload and
site models; never the coordinator, the site or ops.
"""

from federation.config.attestation_config import AttestationConfig, CoordinatorAttestation, SiteAttestation, resolve
from federation.config.schema import (
    ConfigError,
    Deadlines,
    ExperimentConfig,
    FederationConfig,
    load_config,
    parse_config,
)
from federation.config.strict import StrictModel

__all__ = [
    "AttestationConfig",
    "ConfigError",
    "CoordinatorAttestation",
    "Deadlines",
    "ExperimentConfig",
    "FederationConfig",
    "SiteAttestation",
    "StrictModel",
    "load_config",
    "parse_config",
    "resolve",
]
