"""The STATUS record every reply carries (site -> coordinator), read in one place.

A site fills it (federation/site/replies.py); the coordinator reads the site's name, its
`num_examples` and `ok`. Another party's record may hold any type under any key, so each field is
checked here: a value of the wrong type or range is a `StatusError` (an UpdateRejected the round
counts as `bad_status`), never a ValueError, TypeError or OverflowError out of the round.
"""

from __future__ import annotations

from collections.abc import Mapping

from federation.protocol.message_keys import STEP_S_ESTIMATE
from federation.protocol.pipeline import UpdateRejected

MAX_EXAMPLES = 2**53  # beyond any dataset; keeps weights exact as float64


class StatusError(UpdateRejected):
    """A reply's STATUS record has a field of the wrong type or range."""

    def __init__(self, detail: str):
        super().__init__("bad_status", detail)


def num_examples(status: Mapping) -> int:
    """The site's example count: an int in [0, 2**53] (an integral float is taken as its int; bools,
    strings, NaN and fractions are refused)."""
    value = status.get("num_examples")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_EXAMPLES:
        raise StatusError(f"num_examples must be an int in [0, 2**53], got {type(value).__name__} {str(value)[:40]}")
    return value


def step_s_estimate(status: Mapping) -> float | None:
    """The site trainer's seconds per local step, timed at its start (a discovery reply's
    `step_s_estimate`), or None where it gave none or a value that is not a positive finite number
    (the round planner then waits for the steps of round 1)."""
    value = status.get(STEP_S_ESTIMATE)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
        return None
    return float(value)


def site_name(status: Mapping) -> str:
    """The site's name as it reports it (checked against the configuration by the caller)."""
    value = status.get("site")
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise StatusError(f"site must be a non-empty string, got {type(value).__name__}")
    return value
