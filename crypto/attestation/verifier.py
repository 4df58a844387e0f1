"""Verifier plug-ins and their registry.

A verifier turns one evidence format into an :class:`AttestationResult`. Built-ins: ``eat-jwt``
and ``insecure-dev``. Others (SEV-SNP, TDX, GPU, ...) come from installed packages through the
entry-point group ``sovereign_fl.verifiers`` (see README.md in this package).
"""

from __future__ import annotations

import datetime as dt
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel

from .errors import InsecureVerifierRefused, UnknownVerifier
from .models import AttestationResult, Evidence
from .plugins import available, load_class

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "sovereign_fl.verifiers"
# Also registered as entry points (pyproject.toml); listed here too so that no other package's
# entry point can shadow them.
BUILTIN_VERIFIERS = {
    "eat-jwt": "crypto.attestation.eat_jwt:EatJwtVerifier",
    "amd-sev-snp": "crypto.attestation.sev_snp:SevSnpVerifier",
    "nvidia-nras": "crypto.attestation.nvidia_nras:NrasVerifier",
    "azure-maa": "crypto.attestation.azure_maa:AzureMaaVerifier",
    "insecure-dev": "crypto.attestation.insecure_dev:InsecureDevVerifier",
}


class Verifier(ABC):
    """Appraise evidence of one format.

    ``verify`` must check the evidence's authenticity and freshness, that it is bound to
    ``nonce`` and to ``evidence.public_key``, and extract measurements and debug state. Policy
    (allowlists, age limits) is applied afterwards by :class:`~crypto.attestation.policy.Policy`.
    """

    name: ClassVar[str]
    insecure: ClassVar[bool] = False
    config_model: ClassVar[type[BaseModel]]

    def __init__(self, config: BaseModel | Mapping[str, Any] | None = None):
        if config is None:
            config = {}
        self.config = config if isinstance(config, self.config_model) else self.config_model.model_validate(config)

    @abstractmethod
    def verify(self, evidence: Evidence, *, nonce: bytes, now: dt.datetime | None = None) -> AttestationResult: ...


def available_verifiers() -> dict[str, str]:
    """name -> "module:Class" for built-ins and installed plug-ins (built-ins win on a clash)."""
    return available(ENTRY_POINT_GROUP, BUILTIN_VERIFIERS)


def load_verifier_class(name: str) -> type[Verifier]:
    return load_class(name, group=ENTRY_POINT_GROUP, builtins=BUILTIN_VERIFIERS, base=Verifier, error=UnknownVerifier)


def create_verifier(
    name: str, config: BaseModel | Mapping[str, Any] | None = None, *, allow_insecure_dev: bool = False
) -> Verifier:
    """Instantiate a verifier by name; insecure ones only with ``allow_insecure_dev=True``."""
    cls = load_verifier_class(name)
    if cls.insecure and not allow_insecure_dev:
        raise InsecureVerifierRefused(f"verifier {name!r} is insecure; set allow_insecure_dev=True to use it")
    return cls(config)
