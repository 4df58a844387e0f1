"""`sovfl audit export`: one Markdown page per run for a data-protection officer, from the verified
audit logs of the coordinator and the sites (crypto/audit): the parties and their keys, the run's
settings, each round's group, what was aggregated and refused and why (a site that sat a round out
for its announced policy, from the coordinator's log), each site's privacy budget, the digests of
every update sent and received, and of each site's data snapshot. Only logs that verify are read;
the page says which checks passed (`verify` of every log, `compare` of every site's with the
coordinator's).
"""

from __future__ import annotations

from collections import defaultdict

from crypto.audit import Verdict, compare


def _kinds(v: Verdict, kind: str) -> list[dict]:
    return [e for e in v.entries if e["kind"] == kind]


def _cell(value) -> str:
    text = ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def export_markdown(coordinator: Verdict, sites: list[Verdict]) -> str:
    """The page: one section per run the coordinator's log started."""
    out = ["# Audit of a sovereign-fl federation\n\n## Checks\n\n| log | party | entries | verified | head |\n"
           "|---|---|---|---|---|\n"]
    for v in [coordinator, *sites]:
        o = v.opening
        out.append(f"| `{v.path}` | {o.get('role')} {o.get('party')} (key `{o.get('key_fingerprint')}`) | "
                   f"{len(v.entries)} | {'yes' if v.ok else _cell(v.problem)} | {v.head.index} `{v.head.hash[:16]}` |\n")
    problems = [p for s in sites for p in compare(coordinator, s)]
    out.append("\nCompared with the coordinator's log: " + ("every update digest and witnessed head agrees.\n"
                                                           if not problems else "\n\n" + "".join(
                                                               f"- {_cell(p)}\n" for p in problems)))
    by_site = {s.opening.get("party"): s for s in sites}
    for start in _kinds(coordinator, "run_started"):
        f, run = start["fields"], start["fields"].get("run")
        out.append(f"\n## Run {run}\n\nStarted {start['t']:.0f} (Unix time) by coordinator "
                   f"{coordinator.opening.get('party')}, sovereign-fl {f.get('code_version')}, federation "
                   f"{f.get('federation')} (CA `{f.get('ca_fingerprint')}`), configuration `{f.get('config_digest')}`.\n\n"
                   f"Settings: {f.get('rounds')} rounds, strategy {f.get('strategy')}, update kind "
                   f"{f.get('update_kind')}, codec {f.get('codec')}, SecAgg+ {f.get('secagg')}, sealed {f.get('seal')}, "
                   f"attestation {f.get('attestation')}.\n\n### Parties\n\n| site | registered key | log |\n|---|---|---|\n")
        for name, key in sorted(f.get("site_keys", {}).items()):
            log = by_site.get(name)
            out.append(f"| {name} | `{key}` | {f'`{log.path}`' if log else 'not given'} |\n")
        out.append("\n### Rounds\n\n| round | group | aggregated | refused or failed | aggregate digest |\n"
                   "|---|---|---|---|---|\n")
        for e in _kinds(coordinator, "round_closed"):
            r = e["fields"]
            if r.get("run") != run:
                continue
            group = next((g["fields"]["group"] for g in _kinds(coordinator, "round_started")
                          if g["fields"].get("run") == run and g["fields"].get("round") == r.get("round")), [])
            failed = "; ".join(f"{s}: {_cell(why)}" for s, why in sorted(r.get("failed", {}).items()))
            out.append(f"| {r.get('round')} | {_cell(group)} | {_cell(r.get('aggregated', []))} | {failed} | "
                       f"`{r.get('aggregate_digest')}` |\n")
        out.append("\n### What each site agreed to, refused and sent\n\n| site | round | decision | update digest "
                   "| epsilon |\n|---|---|---|---|---|\n")
        rows: dict[tuple[str, int], dict] = defaultdict(dict)
        for name, log in sorted(by_site.items()):
            for e in log.entries:
                g = e["fields"]
                if g.get("run") != run or "round" not in g:
                    continue
                row = rows[(name, g["round"])]
                if e["kind"] == "round_refused":
                    row["decision"] = f"refused: {g.get('code')}"
                elif e["kind"] == "round_accepted":
                    row.setdefault("decision", "accepted")
                elif e["kind"] == "update_sent":
                    row["digest"] = g.get("digest")
                    row["epsilon"] = (g.get("privacy") or {}).get("dp_epsilon", "")
        for e in _kinds(coordinator, "round_closed"):  # left out by the forecast of its announced policy
            r = e["fields"]
            for name, code in (r.get("policy_refused") or {}).items() if r.get("run") == run else ():
                rows[(name, r.get("round"))].setdefault("decision", f"sat out: {code}")
        for (name, rnd), row in sorted(rows.items()):
            out.append(f"| {name} | {rnd} | {row.get('decision', '')} | `{row.get('digest', '')}` | "
                       f"{row.get('epsilon', '')} |\n")
        out.append(_data_section(by_site, run))
    return "".join(out)


def _data_section(by_site: dict[str, Verdict], run) -> str:
    """Each site's data snapshot as its trainer read it: at discovery, and at the first round a
    (re)started trainer answered; the digest never left the site."""
    out = ["\n### What each site trained on\n\n| site | when | data digest | taken from | examples (train / val) |\n"
           "|---|---|---|---|---|\n"]
    for name, log in sorted(by_site.items()):
        for e in _kinds(log, "data_snapshot"):
            g = e["fields"]
            if g.get("run") != run:
                continue
            when = f"round {g['round']}" if "round" in g else "discovery"
            digest = f"`{g['digest']}`" if g.get("digest") else f"none: {_cell(g.get('why', ''))}"
            out.append(f"| {name} | {when} | {digest} | {_cell(g.get('method', ''))} | "
                       f"{g.get('examples', '')} / {g.get('val_examples', '')} |\n")
    return "".join(out)
