"""PII scrubbing of a site's raw text before tokenization (Presidio, pre-filtered, all cores).

Light to import: `PiiConfig` and `round_metrics` do not load Presidio (which pulls spaCy,
transformers and torch); the scrubber loads on first use.

    from site_trainer.pii import CorpusScrubber, PiiConfig, run_scrub, round_metrics

    # the text data path: a document transform and the fingerprint of its behaviour
    scrub = CorpusScrubber(PiiConfig(), cache_dir=workdir / "pii")
    text = scrub(path, text)            # scrubbed text, or None: drop the document
    key = (..., scrub.fingerprint)      # part of any cache key built on scrubbed text
    metrics = round_metrics(scrub.finish())

    # `sovfl scrub CONFIG --site NAME [--dry-run]`
    report = run_scrub(files, cfg, cache_dir=..., report_dir=..., dry_run=..., site=...)

See README.md in this directory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .config import KNOWN_ENTITIES, NER_ENTITIES, PATTERN_ENTITIES, VALIDATED_ENTITIES, PiiConfig

if TYPE_CHECKING:
    from .corpus import CorpusScrubber
    from .detector import Detector, Span
    from .report import ScrubReport
    from .scrubber import Scrubber

__all__ = ["PiiConfig", "CorpusScrubber", "Scrubber", "ScrubReport", "Detector", "Span", "run_scrub",
           "round_metrics", "expand_inputs", "PATTERN_ENTITIES", "VALIDATED_ENTITIES", "NER_ENTITIES",
           "KNOWN_ENTITIES"]

_LAZY = {"CorpusScrubber": "corpus", "Scrubber": "scrubber", "ScrubReport": "report", "Detector": "detector",
         "Span": "detector", "round_metrics": "report"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(name)


def expand_inputs(inputs: Iterable[str | Path], root: Path | None = None) -> list[Path]:
    """Files named by `inputs`: a file, a directory (every file under it) or a glob pattern
    (`**` recursive), relative to `root`. Sorted, without duplicates; hidden files (.name) under
    a directory are skipped."""
    root = Path(root) if root is not None else Path.cwd()
    out: dict[Path, None] = {}
    for item in inputs:
        p = Path(item).expanduser()
        p = p if p.is_absolute() else root / p
        if p.is_file():
            out[p] = None
        elif p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts):
                    out[f] = None
        else:
            anchor = Path(p.anchor)
            for f in sorted(anchor.glob(str(p.relative_to(anchor)))):
                if f.is_file():
                    out[f] = None
    return sorted(out)


def run_scrub(files: Sequence[Path], config: PiiConfig, *, cache_dir: Path | None, report_dir: Path | None,
              dry_run: bool = False, workers: int | None = None, site: str | None = None,
              out_dir: Path | None = None, base: Path | None = None,
              progress: Callable[[int, int], None] | None = None) -> "ScrubReport":
    """Scrub and review a site's files: what `sovfl scrub CONFIG --site NAME [--dry-run]` runs.

    Not a dry run: scrubbed documents go to the cache under `cache_dir` (training then reads them
    from there instead of scrubbing again) and, with `out_dir`, to scrubbed copies of the files.
    Dry run: nothing but the report is written. The report (report.json, report.html) goes to
    `report_dir`; it stays on the site. Returns the report; `round_metrics(report)` is what may
    be sent anywhere.
    """
    from .corpus import CorpusScrubber

    with CorpusScrubber(config, cache_dir=cache_dir, workers=workers, site=site, dry_run=dry_run) as scrub:
        report = scrub.scrub_files(files, base=base, out_dir=out_dir, progress=progress)
    if report_dir is not None:
        report.write(Path(report_dir))
    return report
