"""The round config: what a site must know about the round it is asked to take part in.

It travels as the CONFIG record of every train and evaluate message. The coordinator builds it once
per stage (`RoundConfig` from the federation config, `to_record`); the site parses it once per
message (`from_record`, in its SiteEnv) and every mod reads typed fields, so each default lives
here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from flwr.app import ConfigRecord
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class RoundConfigError(ValueError):
    """A message's round config does not parse; the text names the field (a version mismatch
    between coordinator and site, or a tampered message)."""


class RoundConfig(BaseModel):
    """One round as the sites see it. Unknown fields are refused: both sides run one version."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    round: int = Field(0, ge=0, description="the server round this message belongs to")
    federation: str = Field("", description="the federation's name (binds envelopes and codec rounds)")
    update_kind: Literal["weights", "delta"] = Field("delta", description="what the trainer sends back")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="the round's public seed (shared-seed codecs)")
    codec: str = Field("identity", description="the update codec spec (federation.codec)")
    error_feedback: bool = Field(True, description="keep what a lossy codec did not send for the next round")
    seal: bool = Field(False, description="seal the update to the coordinator's key")
    evaluate: bool = Field(False, description="evaluate the received global model before training; the "
                           "figures ride back with the update")
    overlap: bool = Field(False, description="after answering, keep training and fold the next global model in "
                          "(site_trainer/overlap.py)")
    overlap_max_steps_factor: float = Field(1.0, ge=1.0, le=1000.0, allow_inf_nan=False, description=(
        "with overlap: background steps go on until the next request, at most this many times the answered "
        "round's local_steps (federation.overlap_max_steps_factor; 1: up to local_steps)"))
    deadline_s: float = Field(300.0, gt=0, description="the site must answer within this (ClientApp start-up included)")
    local_steps: int | None = Field(None, ge=1, le=1_000_000, description="local steps of this round, chosen by the "
                                    "coordinator (federation.round_target_s); None: the site's own local_steps")
    aggregated: list[str] = Field(default_factory=list, max_length=10_000, description=(
        "'site:round' for the site the message goes to (no other site's: who was aggregated when is not "
        "the other sites' business): the newest earlier round whose update from that site is in the global "
        "model (0: none yet). A site's error feedback goes on from the residual of that round, so an update "
        "that was encoded but never aggregated (an aborted SecAgg round, a skipped or rerun round) leaves no "
        "trace. Empty: not given (the newest residual before this round)"))

    def aggregated_round(self, site: str) -> int | None:
        """The newest earlier round whose update from `site` is in the global model (0: none), or
        None when the coordinator did not say. Malformed entries are ignored."""
        if not self.aggregated:
            return None
        for entry in self.aggregated:
            name, _, rnd = entry.rpartition(":")
            if name == site and rnd.isdigit():
                return int(rnd)
        return 0

    def to_record(self) -> ConfigRecord:
        """The CONFIG record of a message (unset optional fields are left out: a record holds no None)."""
        return ConfigRecord(self.model_dump(exclude_none=True))

    @classmethod
    def from_record(cls, rec: Mapping | None) -> "RoundConfig":
        """Parse a CONFIG record (None or absent fields: the defaults above); RoundConfigError if bad."""
        try:
            return cls.model_validate(dict(rec or {}))
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(record)'}: {e['msg']}" for e in err.errors())
            raise RoundConfigError(f"the round config of this message is unusable ({problems}); coordinator and "
                                   "site must run the same sovereign-fl version") from None

    @classmethod
    def of(cls, cfg: "RoundConfig | Mapping | None") -> "RoundConfig":
        """`cfg` itself when already parsed, else `from_record(cfg)`."""
        return cfg if isinstance(cfg, RoundConfig) else cls.from_record(cfg)
