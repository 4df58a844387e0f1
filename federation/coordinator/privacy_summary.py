"""The run's differential-privacy figures per site, for result.json (sites[].privacy).

Each site reports its own accountant's figures in every train reply (`dp_epsilon` spent so far at
`dp_delta`, `dp_noise_multiplier`, ...); the coordinator only relays them: it can neither set nor
raise a site's budget. A site's final epsilon is the one of the last round it trained.
"""

from __future__ import annotations


def privacy_by_site(history: list[dict]) -> dict[str, dict]:
    """{site: {epsilon, delta, noise_multiplier, steps, budget?, last_round}} from the metrics lines;
    empty when no site trains with privacy. A site later refused by its budget keeps its last figures
    and carries the round and reason it was left out (`stopped_round`, `stopped`)."""
    out: dict[str, dict] = {}
    for line in history:
        for name, site in (line.get("sites") or {}).items():
            if isinstance((site or {}).get("dp_epsilon"), (int, float)):
                fig = {"epsilon": site["dp_epsilon"], "delta": site.get("dp_delta"),
                       "noise_multiplier": site.get("dp_noise_multiplier"), "steps": site.get("dp_steps"),
                       "last_round": line.get("round")}
                if "dp_epsilon_budget" in site:
                    fig["budget"] = site["dp_epsilon_budget"]
                out[name] = fig
        for name, reason in (line.get("failed") or {}).items():
            if name in out and "privacy budget" in str(reason) and "stopped_round" not in out[name]:
                out[name].update(stopped_round=line.get("round"), stopped=str(reason))
    return out
