"""Federation PKI: provisioning of per-party bundles, revocation, and trust stores.

    report = provision("pki", ["site-a", "site-b"], hosts=("127.0.0.1", "localhost"))
    trust = TrustStore.load("pki/coordinator")          # coordinator side: all sites
    trust.signing_key("site-a")                        # Ed25519 public key, or raises
    revoke("pki", "site-b")                            # CA-signed CRL into every bundle
"""

from .certs import party_uri, verify_client_cert, verify_server_cert
from .errors import PkiMaterialError
from .keys import KeyFileExists
from .manifest import BundleManifest, CoordinatorRecord, SiteRecord
from .provision import ProvisionReport, existing_sites, provision, revoke
from .trust import CoordinatorBundle, PartyRecord, SiteBundle, TrustStore, verify_bundle_certificate

__all__ = [
    "BundleManifest", "CoordinatorBundle", "CoordinatorRecord", "KeyFileExists", "PartyRecord", "PkiMaterialError",
    "ProvisionReport", "SiteBundle", "SiteRecord", "TrustStore", "existing_sites", "party_uri", "provision", "revoke",
    "verify_bundle_certificate", "verify_client_cert", "verify_server_cert",
]
