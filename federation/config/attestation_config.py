"""Attestation settings for both relying parties (RATS, RFC 9334).

The coordinator appraises each site's evidence before admitting it to a round; each site
appraises the coordinator's evidence before it releases an update. Each side's appraisal policy
is its own: a site reads its settings from its own file (node config `attestation-config`),
never from the coordinator's messages, so a coordinator cannot switch a site's checks off.

`dev_issuer` (for `sovfl simulate` only) fills every unset attester, verifier and allowlist from a
local test token issuer created in the run's PKI directory: it exercises the whole flow (signed
tokens, nonces, key binding, policy) but proves nothing about hardware.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from crypto.attestation.policy import Policy
from federation.config.strict import StrictModel

DEV_MEASUREMENT_CLAIM = "measurement"


class AttesterSpec(StrictModel):
    """Which attester produces this party's evidence: `amd-sev-snp`, `nvidia-nras`, an installed
    `sovereign_fl.attesters` plug-in (TDX, ...), or for tests and demos `insecure-dev`,
    `local-token`, `nras-test`, `amd-sev-snp-fake` (crypto/attestation/README.md)."""

    kind: str = Field(description="the attester's name (entry point of group sovereign_fl.attesters)")
    config: dict[str, Any] = Field(default_factory=dict, description="the attester's own settings")


class Appraisal(StrictModel):
    """How a relying party appraises its peer: verifier plug-ins by evidence format, then policy."""

    verifiers: dict[str, dict[str, Any]] = Field(default_factory=dict, description="verifier name (entry point of "
                                                 "group sovereign_fl.verifiers) -> its settings")
    policy: Policy = Field(default_factory=Policy, description="what the appraised party's attestation result must "
                           "show")


class SiteAttestation(StrictModel):
    """One site: how it attests itself, and whether and how it appraises the coordinator."""

    attester: AttesterSpec | None = Field(None, description="how this site produces its evidence")
    verify_coordinator: bool = Field(True, description="release updates only to an attested coordinator")
    coordinator: Appraisal = Field(default_factory=Appraisal, description="how this site appraises the coordinator")

    @model_validator(mode="after")
    def _complete(self) -> "SiteAttestation":
        if self.attester is None:
            raise ValueError("a site needs an attester to take part in attested rounds; set attester.kind")
        if self.verify_coordinator and not self.coordinator.verifiers:
            raise ValueError("verify_coordinator is on but coordinator.verifiers is empty; name at least one verifier "
                             "(e.g. eat-jwt with the attestation service's JWKS)")
        return self


class CoordinatorAttestation(StrictModel):
    """The coordinator: how it attests itself (binding its sealing key) and appraises sites."""

    attester: AttesterSpec | None = Field(None, description="how the coordinator produces its evidence (bound to "
                                          "its sealing key)")
    sites: Appraisal = Field(default_factory=Appraisal, description="how the coordinator appraises site evidence")


class AttestationConfig(StrictModel):
    """`federation.attestation`: admission of sites before each round, appraisal of the coordinator by sites."""

    enabled: bool = Field(False, description="attest sites before each round and the coordinator to the sites")
    dev_issuer: bool = Field(False, description="sovfl simulate only: a local test token issuer fills every unset "
                             "attester, verifier and measurement allowlist (proves nothing about hardware)")
    stage_s: float = Field(60.0, gt=0, description="deadline of each attestation exchange")
    coordinator: CoordinatorAttestation = Field(default_factory=CoordinatorAttestation, description="the "
                                                "coordinator's attester and its appraisal of sites")
    site: dict[str, Any] = Field(default_factory=dict, description="every site's SiteAttestation settings")
    site_overrides: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per-site settings laid over "
                                                       "`site` (attester, verify_coordinator, coordinator)")

    @model_validator(mode="after")
    def _usable(self) -> "AttestationConfig":
        if not self.enabled or self.dev_issuer:
            return self
        if not self.coordinator.sites.verifiers:
            raise ValueError("attestation is enabled but coordinator.sites.verifiers is empty: name the verifiers "
                             "that appraise site evidence, or set dev_issuer: true under sovfl simulate")
        if self.site.get("verify_coordinator", True) and self.coordinator.attester is None:
            raise ValueError("sites verify the coordinator but coordinator.attester is unset: configure it, or set "
                             "site.verify_coordinator: false")
        return self

    def with_dev_issuer(self, issuer_dir: Path, issuer: str, audience: str, measurement: str) -> "AttestationConfig":
        """Every unset attester, verifier and allowlist taken from the local test issuer in `issuer_dir`."""
        attester = {"kind": "local-token", "config": {"issuer_dir": str(issuer_dir)}}
        verifiers = {"eat-jwt": {"jwks_path": str(issuer_dir / "jwks.json"), "issuer": issuer, "audience": audience}}

        def appraisal(a: dict) -> dict:
            policy = dict(a.get("policy") or {})
            if not policy.get("allowed_measurements"):
                policy["allowed_measurements"] = {DEV_MEASUREMENT_CLAIM: [measurement]}
            return {"verifiers": a.get("verifiers") or verifiers, "policy": policy}

        def fill(spec: dict | None) -> dict:
            if not spec:
                return attester
            if spec.get("kind") == "local-token" and "issuer_dir" not in spec.get("config", {}):
                return {**spec, "config": {**spec.get("config", {}), "issuer_dir": str(issuer_dir)}}
            return spec

        def site(over: dict, base: bool) -> dict:
            out = dict(over)
            if base or "attester" in out:
                out["attester"] = fill(out.get("attester"))
            if base or "coordinator" in out:
                out["coordinator"] = appraisal(out.get("coordinator") or {})
            return out

        data = self.model_dump()
        coord = data["coordinator"]
        data["coordinator"] = {"attester": fill(coord["attester"]), "sites": appraisal(coord["sites"])}
        data["site"] = site(data["site"], True)
        data["site_overrides"] = {k: site(v, False) for k, v in data["site_overrides"].items()}
        data["dev_issuer"] = False
        return AttestationConfig.model_validate(data)

    def for_site(self, site: str) -> SiteAttestation:
        """The settings one site runs with: `site`, then its own overrides on top."""
        return SiteAttestation.model_validate({**self.site, **self.site_overrides.get(site, {})})


def resolve(att: AttestationConfig, issuer_dir: Path | None, create: bool = False) -> AttestationConfig:
    """`att` with a dev issuer's settings filled in (creating the issuer in `issuer_dir` if asked)."""
    if not (att.enabled and att.dev_issuer):
        return att
    if issuer_dir is None:
        raise ValueError("federation.attestation.dev_issuer works only under `sovfl simulate` (which creates the "
                         "test issuer); a deployment configures real attesters and verifiers")
    from crypto.attestation.testing import GOOD_MEASUREMENT, LocalTokenIssuer

    if create and not (issuer_dir / "issuer.json").exists():
        LocalTokenIssuer().save(issuer_dir)
    issuer = LocalTokenIssuer.load(issuer_dir)
    return att.with_dev_issuer(issuer_dir, issuer.issuer, issuer.audience, GOOD_MEASUREMENT)
