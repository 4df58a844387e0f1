"""`sites[].policy`: what a site agrees to take part in, read from the site's own configuration.

Pydantic only (no torch): the federation's schema and the torch-free ClientApp import this module.
The coordinator never sends any of it, and its messages cannot switch a rule off: the site checks
every train message against it before any training, and every update before it leaves
(federation/protocol/policy_check.py names the reason code of each rule). No `policy` at all: the site
takes every round, as before; a `policy: {}` holds the defaults below, which refuse what would
expose the site's update (weights instead of deltas, an update neither masked nor sealed, a
SecAgg+ sum with fewer than two other sites).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FINGERPRINT = r"^sha256:[0-9a-f]{64}$"


class SitePolicy(BaseModel):
    """The rules a site holds every round to; a round outside them is refused by name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    federation_ca: str | None = Field(None, pattern=FINGERPRINT, description=(
        "the federation's CA certificate fingerprint (sha256:<hex>, `openssl x509 -fingerprint -sha256`): the "
        "site's bundle must be of this CA (None: not checked)"))
    coordinator_key: str | None = Field(None, pattern=FINGERPRINT, description=(
        "the coordinator's signing-key fingerprint as provisioning printed it (None: not checked)"))
    peers: list[str] | None = Field(None, max_length=100_000, description=(
        "the only other sites this site's update may be aggregated with: site names or signing-key "
        "fingerprints (sha256:<hex>); a round whose group holds another site, however validly certified, is "
        "refused (None: any site the federation's CA certified)"))
    min_secagg_others: int = Field(2, ge=1, le=10_000, description=(
        "k: under SecAgg+, the least number of other sites whose updates this site's must be summed with"))
    protection: Literal["any", "secagg_or_seal", "secagg", "seal"] = Field("secagg_or_seal", description=(
        "how the update must leave: masked by SecAgg+, sealed to the coordinator's key, either, or any way"))
    require_attestation: bool = Field(False, description=(
        "release updates only to a coordinator this site attested (its attestation settings must verify the "
        "coordinator)"))
    deltas_only: bool = Field(True, description="send deltas, never the trained weights themselves")
    require_dp: bool = Field(False, description="send only updates trained under this site's DP-SGD (sites[].privacy)")
    max_epsilon: float | None = Field(None, gt=0, description=(
        "the most privacy budget (epsilon) this site's DP-SGD may plan or spend in a run; an update past it "
        "does not leave (None: no cap)"))
    codecs: list[str] | None = Field(None, description=(
        "accepted update codecs: whole specs ('topk:0.01+int8') or codec names ('identity', 'int8', 'topk'), "
        "every stage of a round's codec must be named (None: any)"))
    strategies: list[str] | None = Field(None, description=(
        "accepted server strategies (fedavg, fedadam, fedyogi, diloco; None: any)"))
    max_rounds: int | None = Field(None, ge=1, description="the most rounds this site sends an update in, per run")
    max_bytes: int | None = Field(None, ge=1, description="the most update bytes this site sends, per run")
    announce: bool = Field(True, description=(
        "tell the coordinator this policy at discovery, so that it leaves this site out of a round the policy "
        "refuses and says why before sending it anything; the site checks every round itself either way "
        "(False: the coordinator learns of a refusal only from the site's reply)"))
