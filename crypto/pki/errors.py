"""The one error of PKI material that does not parse or verify, with a stable ``reason`` code.

Bundles, site registries and CRLs travel from the provisioning operator to every party; a party
that loads a damaged or forged one must refuse it with a reason, not crash. A ValueError, as
these loaders raised before it existed.
"""

from __future__ import annotations


class PkiMaterialError(ValueError):
    """Refused PKI material. ``reason``: malformed_manifest, malformed_registry, bad_registry_signature,
    malformed_crl, bad_crl_signature, malformed_certificate, ca_mismatch, wrong_federation, malformed_key,
    missing_file."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail
