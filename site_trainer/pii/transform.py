"""The site's PII scrubber in the text data path, its round metrics, and the scrub of a site's corpus.

How a site's text reaches its trainer ranks (site_trainer/README.md, "PII scrubbing"):

    sites[].pii (PiiConfig)  ->  site_transforms(...)  ->  TaskContext.document_transforms
        -> the text task's text_data.prepare: rank 0 scrubs each document (cached by content hash
           under <workdir>/pii), then tokenizes; other ranks read only the token cache
        -> restore_report(): every rank gets the counts stored in the token cache's index
        -> round_metrics(transforms): {"pii_EMAIL_ADDRESS": 12.0, ...} in every train reply

Only a task that declares `reads_text` gets a scrubber, so a digits site never imports Presidio.
The counts per entity type are the only thing of the scrub that leaves the site: no text, no
sample, no path.

Light to import (the coordinator reads `counts_from_metrics`): the scrubber loads on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import PiiConfig

if TYPE_CHECKING:
    from .corpus import CorpusScrubber
    from .report import ScrubReport

METRIC_PREFIX = "pii_"  # a train reply's metric `pii_<ENTITY>`: findings of that type in the site's text


def cache_dir(workdir: Path) -> Path:
    """Where a site's scrubbed documents are cached (by content hash): shared by training and `sovfl scrub`."""
    return Path(workdir) / "pii"


def report_dir(workdir: Path) -> Path:
    """Where `sovfl scrub` writes the site's report (report.json, report.html); it stays there."""
    return cache_dir(workdir) / "report"


class ScrubTransform:
    """`sites[].pii` as a `text_data.DocumentTransform`: a `CorpusScrubber` over the document stream.

    `map` scrubs on every core (the scrubber's process pool, above its inline threshold) and closes
    the pool when the stream ends; `report()` writes the site-local report and returns what the
    token cache stores (counts per entity type: ints); `restore_report` gives every rank those counts back, whether the cache was built
    now or reused.
    """

    def __init__(self, config: PiiConfig, workdir: Path, site: str | None = None):
        from .corpus import CorpusScrubber

        self.config, self.workdir = config, Path(workdir)
        self.scrubber: CorpusScrubber = CorpusScrubber(config, cache_dir=cache_dir(workdir), site=site)
        self.fingerprint = f"pii:{self.scrubber.fingerprint}"
        self.counts: dict[str, int] | None = None  # set by report() on the builder, restore_report() on every rank

    def __call__(self, path: str, text: str) -> str | None:
        return self.scrubber(path, text)

    def map(self, items: Iterable[tuple[str, str]]) -> Iterator[str | None]:
        try:
            for _, text in self.scrubber.map(items):
                yield text
        finally:
            self.scrubber.close()

    def report(self) -> dict[str, int]:
        """After the build (rank 0): the site-local report (report.json, report.html, as `sovfl scrub`
        writes it) under `report_dir(workdir)`, and the counts the token cache stores."""
        from .report import round_metrics

        full = self.scrubber.finish()
        full.write(report_dir(self.workdir))
        self.counts = round_metrics(full)
        return self.counts

    def restore_report(self, report: dict | None) -> None:
        if report is not None:
            self.counts = {str(k): int(v) for k, v in report.items()}


def site_transforms(config: PiiConfig, task_cls: type, workdir: Path | None, site: str | None) -> tuple:
    """The transforms the framework gives a site's task (`TaskContext.document_transforms`): the
    site's scrubber for a task that reads text with `pii.enabled`, else none (Presidio not loaded)."""
    if not getattr(task_cls, "reads_text", False) or not config.enabled:
        return ()
    if workdir is None:
        raise ValueError(f"site {site}: the PII scrubber needs the site's workdir for its cache; none was given")
    return (ScrubTransform(config, Path(workdir), site),)


def round_metrics(transforms: Sequence[Any], task: str = "the task") -> dict[str, float]:
    """The counts of the site's scrubbers as metrics of a train reply (`pii_<ENTITY>`).

    Refuses (RuntimeError) when a scrubber was given but never reached the token cache: the task
    read its text some other way, so the model would see it unscrubbed."""
    out: dict[str, float] = {}
    for t in transforms:
        if not isinstance(t, ScrubTransform):
            continue
        if t.counts is None:
            raise RuntimeError(f"{task} declares reads_text but its data never went through the site's PII "
                               "scrubber (TaskContext.document_transforms); pass them to "
                               "site_trainer.text_data.Corpus(files, transforms=[*ctx.document_transforms, ...]) "
                               "and build with text_data.prepare, or set sites[].pii.enabled: false")
        for entity, n in t.counts.items():
            out[METRIC_PREFIX + entity] = out.get(METRIC_PREFIX + entity, 0.0) + float(n)
    return out


def counts_from_metrics(metrics: dict) -> dict[str, int]:
    """The coordinator's side: `{ENTITY: count}` from a train reply's metrics (empty if none)."""
    return {k[len(METRIC_PREFIX):]: int(v) for k, v in sorted(metrics.items())
            if k.startswith(METRIC_PREFIX) and isinstance(v, (int, float))}


def scrub_documents(files: Sequence[tuple[Path, str | None]], config: PiiConfig, workdir: Path, *,
                    text_field: str | None = "text", dry_run: bool = False, site: str | None = None,
                    progress: Callable[[int, int], None] | None = None) -> tuple["ScrubReport", dict[str, list[str]]]:
    """Scrub a site's corpus document by document, exactly as training reads it (`.jsonl` lines,
    `.txt` files and their pieces), so that a later training run finds every document in the cache
    and scrubs nothing again. Not a dry run: results go to the cache. Dry run: nothing is written.

    Returns the report (the caller writes it) and the `.jsonl` lines skipped as training skips them
    (reason -> the first few `file:line`). `text_field` None: chat rows (`format: chat`), every
    message's content scrubbed as training scrubs it."""
    from site_trainer import text_data

    from .corpus import CorpusScrubber

    stats = text_data.CorpusStats()
    if text_field is None:
        from site_trainer import chat_data

        docs = ((row.where.rsplit(":", 1)[0], m["content"]) for row in chat_data.read_rows(files, 0.0, stats)
                for m in row.messages)
    else:
        docs = ((p.path, p.text) for p in text_data.read_pieces(files, text_field, 0.0, stats) if p.text is not None)
    with CorpusScrubber(config, cache_dir=cache_dir(workdir), site=site, dry_run=dry_run) as scrub:
        for _ in scrub.map(docs, progress=progress):
            pass
        report = scrub.finish()
    return report, {reason: list(stats.bad_line_examples.get(reason, [])) for reason in stats.bad_lines}
