"""A nested record (a metrics.jsonl line, a configuration) as the flat keys trackers take.

Keys are '/'-joined paths made of the characters every backend accepts (MLflow's are the
narrowest: letters, digits, `_ - . /` and space); other characters become `_`. Numbers and booleans
are kept as floats; strings, lists and None are left out of metrics (a list's items have no stable
name).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_BAD = re.compile(r"[^A-Za-z0-9_\-. ]")
SECRET = re.compile(r"secret|password|passphrase|token|api_key|apikey|credential|private", re.IGNORECASE)


def key_part(part: Any) -> str:
    """One path component, with the characters no backend refuses."""
    return _BAD.sub("_", str(part)) or "_"


def flat_metrics(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number in `record` under its '/'-joined path."""
    out: dict[str, float] = {}
    for k, v in record.items():
        key = f"{prefix}{key_part(k)}"
        if isinstance(v, Mapping):
            out.update(flat_metrics(v, key + "/"))
        elif isinstance(v, bool):
            out[key] = float(v)
        elif isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
            out[key] = float(v)
    return out


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A configuration as dotted keys and string values, every key that names a secret left out."""
    out: dict[str, str] = {}
    for k, v in config.items():
        if SECRET.search(str(k)):
            continue
        key = f"{prefix}{key_part(k)}"
        if isinstance(v, Mapping):
            out.update(flat_params(v, key + "."))
        elif v is not None:
            out[key] = str(v)[:500]
    return out
