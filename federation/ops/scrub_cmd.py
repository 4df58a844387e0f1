"""`sovfl scrub CONFIG --site NAME [--dry-run]`: scrub and review a site's text before training.

Runs on the site, with the site's own configuration: the files are those its text task reads
(the workload's data globs with {site} and {partition} replaced, as the task does), scrubbed
document by document exactly as training reads them, with the site's `sites[].pii`. Not a dry
run: the scrubbed documents go to the scrubber's cache in the trainer's workdir, so the first
training run tokenizes them without scrubbing again. Dry run: nothing but the report is written.
The report (terminal, `report.json`, `report.html`) stays on the site: counts, throughput and
redacted samples, never an original value.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from federation.config.schema import ConfigError, load_config
from site_trainer.config import SiteConfig, merge_options


def add_parser(sub) -> None:
    """Register `sovfl scrub` on the CLI's subparsers."""
    p = sub.add_parser("scrub", help="scrub a site's text of PII and review the report, before training")
    p.add_argument("config", help="the federation's YAML configuration file")
    p.add_argument("--site", required=True, help="the site whose text to scrub (its id in the configuration)")
    p.add_argument("--dry-run", action="store_true", help="write nothing but the report (no scrubbed cache)")
    p.add_argument("--workdir", help="the site's workdir, as given to `sovfl site` (default: runs/NAME-site-ID); "
                                     "the cache and report go to WORKDIR/sites/ID/pii")
    p.add_argument("--workers", type=int, help="scrubbing processes (default: sites[].pii.workers, else every core)")
    p.set_defaults(fn=cmd_scrub)


def site_text_files(cfg, site: SiteConfig, workdir: Path) -> tuple[list[tuple[Path, str | None]], str | None]:
    """The files the site's text task reads and their `.jsonl` text field (None: chat rows); ConfigError if the
    workload reads no text or its patterns match nothing."""
    from site_trainer import workload_loader
    from site_trainer.workload import TaskContext

    wl = cfg.workload
    if wl.task is None:
        raise ConfigError(f"site {site.id}: the workload is a script ({wl.name}); `sovfl scrub` needs a task that "
                          "reads site text (such as hf-causal-lm), whose data files it knows")
    cls = workload_loader.task_class(wl.task)
    if not getattr(cls, "reads_text", False):
        raise ConfigError(f"site {site.id}: task {wl.task!r} does not read text (it does not declare reads_text), so "
                          "there is nothing to scrub; PII scrubbing applies to text tasks such as hf-causal-lm")
    options = workload_loader.validate_options(cls, merge_options(wl.options, site.workload_options),
                                               "workload.options", repr(wl.task))
    ctx = TaskContext(role="site", seed=cfg.federation.seed, site=site.id, partition=site.partition,
                      num_partitions=len(cfg.sites), workdir=workdir)
    try:
        files = cls.text_files(options, ctx)
    except (ValueError, NotImplementedError) as err:  # a pattern that matches nothing; a task that cannot say
        raise ConfigError(f"site {site.id}: {err}") from None
    if not files:
        raise ConfigError(f"site {site.id}: task {wl.task!r} found no text file for this site; check its data patterns")
    if getattr(options, "format", "text") == "chat":  # hf-causal-lm chat rows: every message's content
        return files, None
    return files, str(getattr(options, "text_field", "text"))


class _Progress:
    """A line on stderr at most every 2 s: documents, MB, MB/s."""

    def __init__(self, total_bytes: int):
        self.total, self.t0, self.last = total_bytes, time.monotonic(), 0.0

    def __call__(self, docs: int, nbytes: int) -> None:
        now = time.monotonic()
        if now - self.last >= 2.0:
            self.last = now
            print(f"  scrubbed {docs} document(s), {nbytes / 1e6:.1f} of {self.total / 1e6:.1f} MB, "
                  f"{nbytes / 1e6 / max(now - self.t0, 1e-9):.2f} MB/s", file=sys.stderr, flush=True)


def cmd_scrub(args: argparse.Namespace) -> int:
    """`sovfl scrub`: 0 when every document was scrubbed, 1 when some were dropped as errors."""
    from site_trainer.pii import transform
    from site_trainer.pii.report import render_terminal

    cfg = load_config(args.config)
    site = next((s for s in cfg.sites if s.id == args.site), None)
    if site is None:
        raise ConfigError(f"{args.config}: no site '{args.site}'; known: {[s.id for s in cfg.sites]}")
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: give at least 1")
    if not site.pii.enabled:
        raise ConfigError(f"site {site.id}: sites[].pii.enabled is false, so training reads this site's text "
                          "unscrubbed; set it to true (or remove it: on is the default) to scrub")
    pii = site.pii if args.workers is None else site.pii.model_copy(update={"workers": args.workers})
    workdir = Path(args.workdir or f"runs/{cfg.federation.name}-site-{site.id}").resolve() / "sites" / site.id
    files, text_field = site_text_files(cfg, site, workdir)
    total = sum(p.stat().st_size for p, _ in files)
    mode = "dry run: nothing but the report is written" if args.dry_run else \
        f"scrubbed documents cached in {transform.cache_dir(workdir)}"
    print(f"site {site.id}: scrubbing {len(files)} file(s), {total / 1e6:.1f} MB ({mode})", file=sys.stderr)
    try:
        report, skipped = transform.scrub_documents(files, pii, workdir, text_field=text_field, dry_run=args.dry_run,
                                                    site=site.id, progress=_Progress(total))
    except ValueError as err:  # the scrubber's configuration (a NER model that does not load, a plug-in)
        raise ConfigError(f"site {site.id}: sites[].pii: {err}") from None
    out = transform.report_dir(workdir)
    json_path, html_path = report.write(out)
    print(render_terminal(report))
    for reason, where in skipped.items():
        print(f"skipped .jsonl lines ({reason}), as training does: {', '.join(where)}")
    print(f"report: {html_path} and {json_path} (site-local; only the counts per entity type leave the site)")
    return 1 if report.errors else 0
