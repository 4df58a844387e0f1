"""`sovfl audit`: check the parties' audit logs (crypto/audit).

    sovfl audit verify DIR [--bundle B]        one log: chain, signatures, the party's provisioned key
    sovfl audit compare COORDINATOR_DIR SITE_DIR [SITE_DIR ...]
                                               each site's log against the coordinator's: updates sent
                                               and received by digest, every witnessed head
    sovfl audit export COORDINATOR_DIR [SITE_DIR ...] [-o FILE]
                                               one Markdown page per run for a data-protection officer

DIR is a party's workdir (its `audit.jsonl`) or the log file itself. Exit 0 when everything checks,
1 with the first bad entry (verify) or every difference (compare) named otherwise.
"""

from __future__ import annotations

import argparse
import sys

from crypto.audit import compare, verify
from crypto.audit.verify import expected_key


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify one log; with --bundle, its signer must be the party's provisioned key."""
    verdict = verify(args.dir)
    if verdict.ok and args.bundle:
        try:
            key = expected_key(args.bundle, str(verdict.opening.get("party")))
        except (LookupError, OSError, ValueError) as err:
            print(f"{verdict.path}: cannot find the party's key in {args.bundle}: {err}", file=sys.stderr)
            return 1
        verdict = verify(args.dir, key)
    if not verdict.ok:
        print(f"{verdict.path}: {verdict.problem}", file=sys.stderr)
        return 1
    o = verdict.opening
    print(f"{verdict.path}: ok, {len(verdict.entries)} entries of {o.get('role')} {o.get('party')} "
          f"(key {o.get('key_fingerprint')}), head {verdict.head.index} {verdict.head.hash}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Compare each site's log with the coordinator's."""
    coordinator = verify(args.coordinator)
    problems = []
    for site_dir in args.sites:
        site = verify(site_dir)
        found = compare(coordinator, site)
        problems += found
        if not found:
            print(f"{site.path}: consistent with {coordinator.path}")
    for p in dict.fromkeys(problems):
        print(p, file=sys.stderr)
    return 1 if problems else 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write the Markdown page of the run(s) (stdout without -o); 1 when a log does not verify."""
    from federation.ops.audit_export import export_markdown

    coordinator, sites = verify(args.coordinator), [verify(s) for s in args.sites]
    page = export_markdown(coordinator, sites)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(page)
    else:
        print(page)
    return 0 if all(v.ok for v in (coordinator, *sites)) else 1


def add_parser(sub) -> None:
    """The `audit` subcommand and its own subcommands."""
    a = sub.add_parser("audit", help="check the parties' signed, hash-chained audit logs")
    asub = a.add_subparsers(dest="audit_command", required=True)
    v = asub.add_parser("verify", help="check one log's chain and signatures")
    v.add_argument("dir", help="a party's workdir (its audit.jsonl) or the log file")
    v.add_argument("--bundle", help="a provisioned bundle that knows the party: its log must be signed by "
                                    "the key the bundle's CA-signed registry names")
    v.set_defaults(fn=cmd_verify)
    c = asub.add_parser("compare", help="check sites' logs against the coordinator's")
    c.add_argument("coordinator", help="the coordinator's workdir (its audit.jsonl) or the log file")
    c.add_argument("sites", nargs="+", help="site workdirs (their audit.jsonl) or log files")
    c.set_defaults(fn=cmd_compare)
    e = asub.add_parser("export", help="one Markdown page per run for a data-protection officer")
    e.add_argument("coordinator", help="the coordinator's workdir (its audit.jsonl) or the log file")
    e.add_argument("sites", nargs="*", help="site workdirs (their audit.jsonl) or log files")
    e.add_argument("-o", "--output", help="the Markdown file to write (default: stdout)")
    e.set_defaults(fn=cmd_export)
