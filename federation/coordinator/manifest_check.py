"""The base-model check at site discovery: a site whose base model differs is left out by name.

Every site's trainer reports a manifest (site_trainer/manifest.py: the exchanged tensors' names,
logical dtypes and shapes, and a SHA-256 fingerprint of its frozen base weights). It rides on the
discovery reply the coordinator already asks for (the STATUS record's `manifest`, JSON), so the
check costs no extra round trip. The coordinator compares it with its own, made from the task
(site_trainer.workloads.coordinator_start). A site that differs is refused before the first round,
so none of its updates is ever averaged: it is named with the reason (which tensor or which
fingerprint differs, and what to do) in the progress log and in every round's `failed`, counted
once under `manifest_mismatch` in the run's rejections, and the rounds go on with the others.

Without a manifest of its own (in-process simulations over numpy trainers) the coordinator checks
nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from federation.protocol.message_keys import MANIFEST
from site_trainer.manifest import manifest_mismatch

REJECTION = "manifest_mismatch"


def site_manifest(status: Mapping) -> dict | str:
    """The manifest a discovery reply carries, or why there is none to compare."""
    raw = status.get(MANIFEST)
    if not raw:
        return ("the site reports no base-model manifest; run the same sovereign-fl version on the site as on "
                "the coordinator")
    try:
        got = json.loads(raw)
    except (TypeError, ValueError) as err:
        return f"the site's manifest is not JSON ({err})"
    return got if isinstance(got, dict) else f"the site's manifest is a {type(got).__name__}, not a mapping"


@dataclass
class BaseCheck:
    """The coordinator's manifest and the sites it refused (name -> reason)."""

    expected: dict | None
    refused: dict[str, str] = field(default_factory=dict)

    def admit(self, site: str, status: Mapping, rejections: Counter, progress: Callable[[str], None]) -> bool:
        """Whether `site` (its discovery STATUS) may join; a refusal is recorded, counted and logged."""
        if self.expected is None:
            return True
        got = site_manifest(status)
        try:
            why = got if isinstance(got, str) else manifest_mismatch(self.expected, got)
        except (TypeError, ValueError, AttributeError) as err:
            why = f"the site's manifest is malformed ({type(err).__name__}: {err})"
        if why is None:
            return True
        reason = f"{REJECTION}: base model differs from the coordinator's: {why}"
        self.refused[site] = reason
        rejections[REJECTION] += 1
        progress(f"site {site} REFUSED, left out of every round: {reason}")
        return False

    def summary(self) -> str:
        """The refusals, for a failure message ('' when none)."""
        return "".join(f"; {name} refused ({reason})" for name, reason in sorted(self.refused.items()))
