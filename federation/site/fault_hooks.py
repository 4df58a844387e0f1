"""Test-only hooks of the ClientApp, switched on by node config and off by default.

`absent-rounds="3,7"`: the site answers the train messages of those rounds with a failure, as if
it had been down. tests/fault_soak.py runs its reference with the rounds each site missed in the
killed run, so that both runs aggregate the same sites in every round and can be compared bit for bit.
"""

from __future__ import annotations


def absent(node_config, rnd: int) -> str | None:
    """Why this site sits out round `rnd` (node config `absent-rounds`), or None."""
    spec = str(node_config.get("absent-rounds", "") or "")
    rounds = {int(x) for x in spec.split(",") if x.strip()}
    return f"test fault injected: absent from round {rnd} (node config absent-rounds)" if rnd in rounds else None
