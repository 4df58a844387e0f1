"""The scrub report: what was found where, for the site's reviewers; counts only for the federation.

What is written, and why:
- counts per entity type, documents scanned/touched/dropped, bytes, throughput, errors (paths
  only): what an operator needs to see that the scrubber ran and how much it changed;
- a sample of redactions per entity type: file, line, the redacted context (the text around the
  finding with *every* finding in it replaced by <ENTITY>), the value's shape (`Xxxxx.Xxxx@xxxx.xx`,
  `9999 9999 9999 9999`) and length, and the score. With that a reviewer can tell a real card number
  from a version string or a table of constants (precision), and see what the model will read.

What is never written: an original value, or context in which another finding is left in clear.
The raw corpus is the only copy of the PII on the site; a report that quoted it would be a second,
longer-lived copy, read by more people (reviewers, auditors) than the data itself. Nothing of this
report leaves the site except `round_metrics(report)`: the counts per entity type, a dict of ints.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .scrubber import DocResult, Sample


@dataclass
class ScrubReport:
    site: str | None = None
    fingerprint: str = ""
    entities: tuple[str, ...] = ()
    action: str = "mask"
    dry_run: bool = False
    workers: int = 1
    documents: int = 0
    documents_touched: int = 0
    documents_dropped: int = 0
    documents_cached: int = 0
    bytes_scanned: int = 0  # scrubbed in this run
    bytes_cached: int = 0  # answered from the cache
    cpu_seconds: float = 0.0  # summed over the processes that scrubbed
    wall_seconds: float = 0.0
    counts: Counter = field(default_factory=Counter)
    errors: list[dict] = field(default_factory=list)  # {"path", "error"}: never text
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    sample_per_entity: int = 20

    # ---- accumulation -------------------------------------------------------------------------
    def add(self, path: str, res: DocResult, *, cached: bool) -> None:
        self.documents += 1
        self.documents_touched += res.touched
        self.documents_dropped += res.dropped
        self.counts.update(res.counts)
        if cached:
            self.documents_cached += 1
            self.bytes_cached += res.nbytes
        else:
            self.bytes_scanned += res.nbytes
            self.cpu_seconds += res.seconds
        for s in res.samples:
            keep = self.samples.setdefault(s.entity, [])
            keep.append(Sample(**{**s.__dict__, "path": path}))
            if len(keep) > 2 * self.sample_per_entity:
                self._trim(s.entity)

    def add_error(self, path: str, error: str) -> None:
        self.errors.append({"path": path, "error": error})

    def _trim(self, entity: str) -> None:
        keep = self.samples[entity]
        keep.sort(key=lambda s: (s.priority, s.path, s.line))
        del keep[self.sample_per_entity:]

    def finish(self, wall_seconds: float) -> "ScrubReport":
        self.wall_seconds = wall_seconds
        for e in list(self.samples):
            self._trim(e)
        return self

    # ---- figures -----------------------------------------------------------------------------
    @property
    def mb_per_s(self) -> float:
        """Bytes scrubbed in this run per wall second (all workers together)."""
        return self.bytes_scanned / 1e6 / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def mb_per_s_per_core(self) -> float:
        """Bytes scrubbed per CPU second of scrubbing: the per-core rate, without start-up."""
        return self.bytes_scanned / 1e6 / self.cpu_seconds if self.cpu_seconds else 0.0

    def metrics(self) -> dict[str, int]:
        return round_metrics(self)

    # ---- serialisation -----------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "site": self.site, "fingerprint": self.fingerprint, "entities": list(self.entities),
            "action": self.action, "dry_run": self.dry_run, "workers": self.workers,
            "documents": self.documents, "documents_touched": self.documents_touched,
            "documents_dropped": self.documents_dropped, "documents_cached": self.documents_cached,
            "bytes_scanned": self.bytes_scanned, "bytes_cached": self.bytes_cached,
            "cpu_seconds": round(self.cpu_seconds, 4), "wall_seconds": round(self.wall_seconds, 4),
            "mb_per_s": round(self.mb_per_s, 3), "mb_per_s_per_core": round(self.mb_per_s_per_core, 3),
            "counts": dict(sorted(self.counts.items())), "errors": self.errors,
            "samples": {e: [s.to_json() for s in v] for e, v in sorted(self.samples.items())},
        }

    def write(self, out_dir: Path) -> tuple[Path, Path]:
        """report.json and report.html in out_dir (0700 directory, 0600 files: this stays on the site)."""
        from .cache import write_private

        j, h = out_dir / "report.json", out_dir / "report.html"
        write_private(j, json.dumps(self.to_json(), indent=1, ensure_ascii=False).encode())
        write_private(h, render_html(self).encode())
        return j, h


def round_metrics(report: ScrubReport) -> dict[str, int]:
    """The only part of a scrub report that may leave the site: findings per entity type (every
    configured type present, zero if none). Put this dict, and nothing else, in the round's
    metrics line."""
    out = {e: 0 for e in report.entities}
    out.update({e: int(n) for e, n in report.counts.items()})
    return dict(sorted(out.items()))


def _mark(s: Sample) -> tuple[str, str]:
    return s.before.replace("\n", "⏎"), s.after.replace("\n", "⏎")


def render_terminal(report: ScrubReport, samples_per_entity: int = 3, width: int = 100) -> str:
    r = report
    head = "PII scrub" + (f" · site {r.site}" if r.site else "") + (" · DRY RUN (nothing written)" if r.dry_run else "")
    lines = [head, "=" * len(head),
             f"documents {r.documents} · touched {r.documents_touched} · dropped {r.documents_dropped} · "
             f"from cache {r.documents_cached} · errors {len(r.errors)}",
             f"scanned {r.bytes_scanned / 1e6:.2f} MB in {r.wall_seconds:.1f} s with {r.workers} worker(s): "
             f"{r.mb_per_s:.2f} MB/s, {r.mb_per_s_per_core:.2f} MB/s per core · action {r.action}",
             "", f"{'entity':18s} {'found':>8s}"]
    for e, n in round_metrics(r).items():
        lines.append(f"{e:18s} {n:8d}")
    for e, ss in sorted(r.samples.items()):
        lines.append(f"\n{e} (sample, redacted):")
        for s in ss[:samples_per_entity]:
            before, after = _mark(s)
            ctx = f"…{before[-35:]}⟦{e}⟧{after[:35]}…"
            lines.append(f"  {s.path}:{s.line}  {ctx[:width]}  shape {s.shape[:40]}")
    for err in r.errors[:20]:
        lines.append(f"! {err['path']}: {err['error']}")
    if len(r.errors) > 20:
        lines.append(f"! ... and {len(r.errors) - 20} more errors (report.json lists them all)")
    return "\n".join(lines)


_CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}th{background:#f3f3f3}
.ctx{font-family:ui-monospace,monospace;white-space:pre-wrap;max-width:60em}.hit{background:#ffd54f;padding:0 2px}
.note{color:#666}.err{color:#b00}"""


def render_html(report: ScrubReport) -> str:
    """A self-contained page (no script, no external resource); every string escaped."""
    r, e = report, html.escape
    rows = "".join(f"<tr><td>{e(k)}</td><td>{v}</td></tr>" for k, v in round_metrics(r).items())
    summary = [("site", r.site or "—"), ("documents", r.documents), ("touched", r.documents_touched),
               ("dropped", r.documents_dropped), ("from cache", r.documents_cached),
               ("MB scanned", f"{r.bytes_scanned / 1e6:.3f}"), ("wall s", f"{r.wall_seconds:.2f}"),
               ("MB/s", f"{r.mb_per_s:.2f}"), ("MB/s per core", f"{r.mb_per_s_per_core:.2f}"),
               ("workers", r.workers), ("action", r.action), ("dry run", r.dry_run),
               ("fingerprint", r.fingerprint)]
    summ = "".join(f"<tr><th>{e(str(k))}</th><td>{e(str(v))}</td></tr>" for k, v in summary)
    samples = []
    for ent, ss in sorted(r.samples.items()):
        samples.append(f"<h3>{e(ent)}</h3><table><tr><th>where</th><th>redacted context</th><th>shape</th>"
                       f"<th>length</th><th>score</th></tr>")
        for s in ss:
            ctx = f'…{e(s.before)}<span class="hit">&lt;{e(ent)}&gt;</span>{e(s.after)}…'
            samples.append(f"<tr><td>{e(s.path)}:{s.line}</td><td class=ctx>{ctx}</td><td class=ctx>{e(s.shape)}</td>"
                           f"<td>{s.length}</td><td>{s.score}</td></tr>")
        samples.append("</table>")
    errs = "".join(f"<li class=err>{e(x['path'])}: {e(x['error'])}</li>" for x in r.errors)
    return (f"<!doctype html><html><head><meta charset=utf-8><title>PII scrub report</title><style>{_CSS}</style>"
            f"</head><body><h1>PII scrub report{(' · ' + e(r.site)) if r.site else ''}</h1>"
            f"<p class=note>Stays on this site. Samples show redacted context and the shape of each value, never "
            f"the value. Only the counts per entity type go into the federation's metrics.</p>"
            f"<table>{summ}</table><h2>Findings per entity type</h2><table><tr><th>entity</th><th>found</th></tr>"
            f"{rows}</table><h2>Sample of redactions</h2>{''.join(samples) or '<p>none</p>'}"
            f"{'<h2>Errors</h2><ul>' + errs + '</ul>' if errs else ''}</body></html>")
