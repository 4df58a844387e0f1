"""python -m site_trainer.pii — scrub and review text files on this site.

    python -m site_trainer.pii data/ --dry-run                 # review: report only
    python -m site_trainer.pii 'corpus/**/*.txt' --config pii.yaml --out scrubbed/
    python -m site_trainer.pii data/ --entities EMAIL_ADDRESS,IBAN_CODE --action drop_document

Prints the summary and a redacted sample; writes report.json and report.html (redacted context
only) to --report-dir. Exit status: 0 done, 1 bad configuration, 2 some files could not be
scrubbed (they are named; they were left out, never passed on unscrubbed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pydantic import ValidationError


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m site_trainer.pii", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="files, directories or glob patterns ('**' recursive)")
    ap.add_argument("--config", type=Path, help="YAML or JSON with the pii settings (a mapping, or one under 'pii')")
    ap.add_argument("--entities", help="comma-separated entity types (default: every pattern entity)")
    ap.add_argument("--action", choices=["mask", "replace", "drop_document"])
    ap.add_argument("--ner-model", type=Path, help="local spaCy or Hugging Face NER directory (PERSON, LOCATION)")
    ap.add_argument("--languages", help="comma-separated ISO 639-1 codes of the text (phone numbering plans)")
    ap.add_argument("--workers", type=int, help="processes (default: every core of this machine)")
    ap.add_argument("--site", help="site name shown in the report")
    ap.add_argument("--cache-dir", type=Path, default=Path(".sovfl-pii/cache"),
                    help="scrubbed documents by content hash (re-runs only scrub what changed)")
    ap.add_argument("--report-dir", type=Path, default=Path(".sovfl-pii/report"))
    ap.add_argument("--out", type=Path, help="write scrubbed copies of the files here (same relative paths)")
    ap.add_argument("--dry-run", action="store_true", help="review only: write nothing but the report")
    ap.add_argument("--json", action="store_true", help="print the report as JSON instead of the summary")
    return ap


def load_config(args: argparse.Namespace):
    from . import PiiConfig

    data: dict = {}
    if args.config is not None:
        text = args.config.read_text()
        if args.config.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
        if isinstance(data, dict) and isinstance(data.get("pii"), dict):
            data = data["pii"]
    for key, val in (("entities", args.entities), ("languages", args.languages)):
        if val:
            data[key] = [x for x in val.split(",") if x.strip()]
    if args.action:
        data["action"] = args.action
    if args.ner_model:
        data["ner_model"] = str(args.ner_model)
    return PiiConfig.model_validate(data)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args)
    except (OSError, ValueError, ValidationError) as e:
        print(f"error: pii configuration: {e}", file=sys.stderr)
        return 1
    from . import expand_inputs, run_scrub
    from .report import render_terminal

    files = expand_inputs(args.inputs)
    if not files:
        print(f"error: no files match {args.inputs}", file=sys.stderr)
        return 1
    last = [0.0]

    def progress(docs: int, nbytes: int) -> None:
        now = time.monotonic()
        if now - last[0] > 2 or docs == len(files):
            last[0] = now
            print(f"\r  {docs}/{len(files)} files, {nbytes / 1e6:.1f} MB", end="", file=sys.stderr, flush=True)

    print(f"scrubbing {len(files)} files ({'dry run' if args.dry_run else 'cache ' + str(args.cache_dir)})",
          file=sys.stderr)
    try:
        report = run_scrub(files, cfg, cache_dir=args.cache_dir, report_dir=args.report_dir, dry_run=args.dry_run,
                           workers=args.workers, site=args.site, out_dir=args.out, progress=progress)
    except ValueError as e:  # NER model missing, plug-in not importable, files outside --out's base
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    print(file=sys.stderr)
    print(json.dumps(report.to_json(), indent=1, ensure_ascii=False) if args.json else render_terminal(report))
    print(f"report: {args.report_dir / 'report.html'}", file=sys.stderr)
    return 2 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
