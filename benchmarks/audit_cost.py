"""What the audit logs and the site policies cost a round, on a real loopback deployment.

Two runs of `sovfl simulate` (launcher.simulate: a real SuperLink, one SuperNode and one torchrun
trainer per site, provisioned keys, SecAgg+ on digits), in one run of this script, alternated
`--pairs` times so that a load change hits both sides:

- off: `federation.audit: false` and no site policy: no log written, no terms on the messages;
- on: the coordinator's and every site's signed, hash-chained audit log (an fsync per message's
  entries), the round's terms and the coordinator's head on every message, each site's head on
  every reply, and a policy on every site (the defaults: deltas only, SecAgg+ or sealing, k = 2)
  checked on every train message and every update.

Round time: each run's median `round_s` (the coordinator's clock) over rounds 2 onwards (round 1
also carries discovery and start-up); the ratio is on / off, over the medians of the pairs. Log
bytes per round: every party's audit.jsonl after the on run, over its rounds.

    .venv/bin/python benchmarks/audit_cost.py [--rounds 5] [--sites 3] [--pairs 1]

Round times on a loaded machine move by more than the logs cost, so the script also measures what
the two mods add to one train message, in this process and in CPU time (which the load does not
move): the site's real SiteScope, audit mod and policy mod with its provisioned bundle, a policy and
its log, around a trainer call that returns a signed update's records at once, against SiteScope
alone (`mods_cpu_ms`).

Last line: `RESULT round_time_ratio=<on/off> log_bytes_per_round=<bytes> off_round_s=<median>
on_round_s=<median> entries_per_round=<all parties> mods_cpu_ms=<per train message>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from federation.ops import launcher  # noqa: E402


def config(path: Path, sites: int, rounds: int, on: bool) -> Path:
    """The run's config: the same federation, audit and policies on or off."""
    cfg = {
        "federation": {"name": "audit-cost", "rounds": rounds, "quorum": 2, "update_kind": "delta",
                       "evaluate": False, "audit": on,
                       "deadlines": {"connect_s": 120, "round_s": 120, "secagg_stage_s": 60, "trainer_start_s": 300},
                       "secagg": {"enabled": True, "threshold": 2, "clip": 0.5}},
        "workload": {"task": "digits", "options": {"hidden": 64}},
        "sites": [{"id": f"site{i}", "ranks": 1, "partition": i, "local_steps": 5, "batch_size": 16, "lr": 0.1,
                   **({"policy": {}} if on else {})} for i in range(sites)],
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(workdir: Path, cfg: Path, label: str) -> list[dict]:
    """One federation; its metrics lines."""
    launcher.simulate(cfg, workdir, progress=lambda line: print(f"  [{label}] {line}", flush=True))
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def median_round_s(lines: list[dict]) -> float:
    """The median round time after round 1."""
    return statistics.median(x["round_s"] for x in lines if x["round"] > 1)


def mods_cpu_ms(workdir: Path, messages: int = 200) -> float:
    """CPU milliseconds the audit and policy mods add to one train message (see the docstring)."""
    import time

    from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

    from crypto.pki import provision
    from federation.ops.inprocess import task_identity, wire
    from federation.protocol import message_keys as keys
    from federation.protocol.envelope_layout import HEADER, SIGNATURE
    from federation.protocol.round_config import RoundConfig
    from federation.protocol.site_terms import RoundTerms
    from federation.site.audit_mod import audit_mod
    from federation.site.policy_mod import policy_mod
    from federation.site.replies import status
    from federation.site.site_env import SiteScope

    provision(workdir / "pki", ["a", "b", "c"])
    (workdir / "policy.json").write_text("{}")
    node = {"site-id": "a", "bundle-dir": str(workdir / "pki" / "sites" / "a"),
            "audit-log": str(workdir / "site-a" / "audit.jsonl"), "site-policy": str(workdir / "policy.json")}
    with task_identity(1):
        msg = Message(RecordDict({keys.CONFIG: RoundConfig(round=1, federation="f").to_record(),
                                  keys.TERMS: RoundTerms(1, 1, 5, "fedavg", True, ["a", "b", "c"]).to_record(),
                                  keys.AUDIT: ConfigRecord({"index": 3, "hash": "0" * 64})}),
                      dst_node_id=1, message_type="train", ttl=60)
    msg.metadata.__dict__["_message_id"] = "m1"
    msg = wire(msg)

    def trainer(m: Message, c) -> Message:
        return Message(RecordDict({keys.STATUS: status("a", True),
                                   keys.UPDATE_META: ConfigRecord({HEADER: b"h" * 200, SIGNATURE: b"s" * 64}),
                                   keys.METRICS: MetricRecord({"upload_bytes": 1000.0})}), reply_to=m)

    def timed(app) -> float:
        t0 = time.process_time()
        for _ in range(messages):
            ctx = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})
            reply = app(msg, ctx)
            assert reply.content.config_records[keys.STATUS]["ok"], reply.content.config_records[keys.STATUS]
        return (time.process_time() - t0) / messages * 1000

    scope = SiteScope(lambda env: None)
    bare = timed(lambda m, c: scope(m, c, trainer))
    mods = timed(lambda m, c: scope(m, c, lambda m1, c1: audit_mod(m1, c1, lambda m2, c2: policy_mod(m2, c2, trainer))))
    return mods - bare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--mods-only", action="store_true", help="only the in-process CPU cost of the two mods")
    args = ap.parse_args()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    base = args.workdir or Path(tempfile.mkdtemp(prefix="audit-cost-"))
    base.mkdir(parents=True, exist_ok=True)
    mods_ms = mods_cpu_ms(base / "mods")
    print(f"# audit + policy mods: {mods_ms:.2f} ms of CPU per train message", flush=True)
    if args.mods_only:
        print(f"RESULT mods_cpu_ms={mods_ms:.2f}")
        return
    off_s, on_s, log_bytes, entries = [], [], 0, 0
    for pair in range(args.pairs):
        for on in (False, True):
            label = f"{'on' if on else 'off'}{pair}"
            lines = run(base / label, config(base / f"{label}.yaml", args.sites, args.rounds, on), label)
            (on_s if on else off_s).append(median_round_s(lines))
            rounds = ", ".join(f"{x['round_s']:.2f}" for x in lines)
            print(f"# {label}: median round_s {(on_s if on else off_s)[-1]:.3f} ({rounds})", flush=True)
            if on:
                logs = [base / label / "audit.jsonl", *(base / label / "sites").glob("*/audit.jsonl")]
                log_bytes = sum(p.stat().st_size for p in logs)
                entries = sum(len(p.read_text().splitlines()) for p in logs)
    off, on_ = statistics.median(off_s), statistics.median(on_s)
    print(f"# {args.sites} sites, SecAgg+, {args.rounds} rounds per run, {args.pairs} pair(s); workdir {base}")
    print(f"# audit logs of the last on run: {log_bytes} bytes, {entries} entries in all")
    print(f"RESULT round_time_ratio={on_ / off:.4f} log_bytes_per_round={log_bytes / args.rounds:.0f} "
          f"off_round_s={off:.3f} on_round_s={on_:.3f} entries_per_round={entries / args.rounds:.1f} "
          f"mods_cpu_ms={mods_ms:.2f}")


if __name__ == "__main__":
    main()
