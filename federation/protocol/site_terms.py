"""What both parties' audit logs and a site's policy read off the messages of a round.

- `RoundTerms`: the TERMS record a train message carries: the round's group (who its update is
  aggregated with), the strategy, whether it is a SecAgg+ round, the run's rounds. A site's policy
  judges them with the round config before any training (federation/protocol/policy_check.py).
- `update_digest`: one digest of a train reply's update both sides compute from the same bytes:
  the signed envelope header and signature (plain rounds), or the signed manifest of the masked
  chunks (SecAgg+). Each binds the whole payload by its digest, so the small record stands for it.
- `head_of`: the audit-log head (index, hash) a site's reply carries in its STATUS.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from flwr.app import ConfigRecord, RecordDict

from federation.protocol import message_keys as keys
from federation.protocol.envelope_layout import HEADER, SIGNATURE


@dataclass(frozen=True)
class RoundTerms:
    """A round as a site's policy sees it, beside the round config."""

    run: int = 0
    round: int = 0
    rounds: int = 0  # the run's planned rounds
    strategy: str = ""
    secagg: bool = False
    group: list[str] = field(default_factory=list)  # every site of the round, this one included

    def to_record(self) -> ConfigRecord:
        """The TERMS record."""
        return ConfigRecord({"run": self.run, "round": self.round, "rounds": self.rounds, "strategy": self.strategy,
                             "secagg": self.secagg, "group": list(self.group)})

    @classmethod
    def from_record(cls, rec: Mapping | None) -> "RoundTerms | None":
        """The terms of a TERMS record (None: the message carries none)."""
        if rec is None:
            return None
        return cls(int(rec.get("run", 0)), int(rec.get("round", 0)), int(rec.get("rounds", 0)),
                   str(rec.get("strategy", "")), bool(rec.get("secagg", False)),
                   [str(n) for n in rec.get("group", [])])


def update_digest(content: RecordDict) -> str | None:
    """``sha256:<hex>`` of what the site signed about its update (None: an unsigned reply)."""
    meta = content.config_records.get(keys.UPDATE_META)
    if meta is not None and isinstance(meta.get(HEADER), bytes) and isinstance(meta.get(SIGNATURE), bytes):
        signed = meta[HEADER] + meta[SIGNATURE]
    else:
        sec = content.config_records.get(keys.SECAGG)
        if sec is None or not isinstance(sec.get("sig_header"), bytes) or not isinstance(sec.get("sig"), bytes):
            return None
        signed = sec["sig_header"] + sec["sig"]
    return "sha256:" + hashlib.sha256(signed).hexdigest()


def head_of(status: Mapping | None) -> tuple[int, str] | None:
    """The site's audit-log head a reply's STATUS carries (None: it carries none)."""
    if status is None or keys.AUDIT_HASH not in status:
        return None
    return int(status.get(keys.AUDIT_INDEX, -1)), str(status[keys.AUDIT_HASH])
