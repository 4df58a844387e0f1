"""The scrubber: a cheap pre-filter, Presidio recognizers on small windows, Presidio's anonymizer.

Cost model. Presidio's `AnalyzerEngine` tokenizes the whole document with spaCy, then runs every
recognizer's regexes (and `phonenumbers`' matcher once per region) over all of it. Here one stdlib
`re` scan per distinct trigger finds the few places where an entity could be (digit runs, `@`,
dotted quads, hex-colon groups, upper-case codes); only windows around them reach the recognizers.
Windows start and end at whitespace, so `\\b` and look-arounds behave as on the whole text, and a
span touching a window's edge is re-run on a wider window: results equal whole-document results
(`analyze(text, prefilter=False)`), which the tests check.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import version

from .config import PiiConfig
from .detector import Detector, Span
from .recognizers import FAST_WITH_REGEX, build_detectors, detectors_fingerprint

SCRUBBER_VERSION = "1"  # bump whenever detection or output changes: it is in every fingerprint
_SNAP = 64  # how far a window edge moves outwards to reach whitespace
CONTEXT_CHARS = 40  # redacted context on each side of a sample


def _as_tuple(trigger: str | tuple[str, ...]) -> tuple[str, ...]:
    return (trigger,) if isinstance(trigger, str) else tuple(trigger)


def _compile(pattern: str):
    if pattern in FAST_WITH_REGEX:
        import regex

        return regex.compile(pattern)
    return re.compile(pattern)


def _snap_left(text: str, pos: int) -> int:
    lo = max(0, pos - _SNAP)
    while pos > lo and not text[pos - 1].isspace():
        pos -= 1
    return pos


def _snap_right(text: str, pos: int) -> int:
    n = len(text)
    hi = min(n, pos + _SNAP)
    while pos < hi and not text[pos].isspace():
        pos += 1
    return pos


def windows(text: str, hits: Sequence[tuple[int, int]], margin: int) -> list[tuple[int, int]]:
    """Merged [start, end) windows covering each hit plus `margin`, edges moved out to whitespace."""
    out: list[list[int]] = []
    n = len(text)
    for s, e in hits:
        ws = _snap_left(text, max(0, s - margin))
        we = _snap_right(text, min(n, e + margin))
        if out and ws <= out[-1][1]:
            out[-1][1] = max(out[-1][1], we)
        else:
            out.append([ws, we])
    return [(a, b) for a, b in out]


def resolve(spans: list[Span], ranks: dict[str, int]) -> list[Span]:
    """Non-overlapping spans, sorted by start: higher score, then the more selective entity, then
    the longer span wins an overlap."""
    best = sorted(spans, key=lambda s: (-s.score, -ranks.get(s.entity, 0), -(s.end - s.start), s.start))
    starts: list[int] = []
    taken: list[Span] = []  # sorted by start, disjoint
    for s in best:
        i = bisect.bisect_left(starts, s.start)
        if (i > 0 and taken[i - 1].end > s.start) or (i < len(taken) and taken[i].start < s.end):
            continue
        starts.insert(i, s.start)
        taken.insert(i, s)
    return taken


def covered(hits: list[tuple[int, int]], spans: list[Span]) -> list[bool]:
    """For each hit, whether one span contains it (spans may overlap)."""
    ordered = sorted(spans)
    starts = [s.start for s in ordered]
    reach, m = [], -1
    for s in ordered:  # furthest end among spans starting at or before each one
        m = max(m, s.end)
        reach.append(m)
    out = []
    for a, b in hits:
        i = bisect.bisect_right(starts, a) - 1
        out.append(i >= 0 and reach[i] >= b)
    return out


def shape(value: str) -> str:
    """The value's form without its content: letters -> x/X, digits -> 9, punctuation kept."""
    return "".join("9" if c.isdigit() else ("X" if c.isupper() else "x") if c.isalpha() else c for c in value)


def redacted_context(text: str, spans: Sequence[Span], i: int, width: int = CONTEXT_CHARS,
                     starts: Sequence[int] | None = None) -> tuple[str, str]:
    """The text around spans[i] with every finding in it replaced by <ENTITY>: no original value.
    `spans` are sorted by start and disjoint (resolve's output); `starts` their starts, if known."""
    s = spans[i]
    lo, hi = max(0, s.start - width), min(len(text), s.end + width)
    starts = [t.start for t in spans] if starts is None else starts
    near = spans[max(0, bisect.bisect_left(starts, lo) - 1):bisect.bisect_right(starts, hi)]

    def render(a: int, b: int) -> str:
        parts, pos = [], a
        for t in near:
            if t.end <= a or t.start >= b:
                continue
            parts.append(text[pos:max(pos, t.start)])
            parts.append(f"<{t.entity}>")
            pos = max(pos, t.end)
        if pos < b:
            parts.append(text[pos:b])
        return "".join(parts)

    before = render(lo, s.start)
    after = render(s.end, hi)
    # a finding cut by the context edge must not leave a fragment of its value
    if any(t.start < lo < t.end for t in near):
        before = before.split(">", 1)[-1] if ">" in before else ""
    if any(t.start < hi < t.end for t in near):
        after = after.rsplit("<", 1)[0]
    return before, after


@dataclass
class Sample:
    """One redaction for a reviewer: the type, where, the redacted context and the value's shape."""

    entity: str
    line: int
    before: str
    after: str
    shape: str
    length: int
    score: float
    priority: int  # deterministic sampling order (lowest kept)
    path: str = ""

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("entity", "path", "line", "before", "after", "shape", "length", "score",
                                              "priority")}


@dataclass
class DocResult:
    """The outcome for one document: its output text (None: dropped) and what the report needs."""

    text: str | None
    counts: Counter = field(default_factory=Counter)
    nbytes: int = 0
    seconds: float = 0.0
    samples: list[Sample] = field(default_factory=list)

    @property
    def touched(self) -> bool:
        return bool(self.counts)

    @property
    def dropped(self) -> bool:
        return self.text is None


class Scrubber:
    """Finds and removes PII in text. Build once per process (detectors load once).

    `scrub(text)` -> DocResult. `__call__(path, text)` is the document transform of the text data
    path: scrubbed text, or None to drop the document; `fingerprint` identifies everything that
    changes its output and belongs in any cache key built on the result.
    """

    def __init__(self, config: PiiConfig, *, surrogate_key: bytes | None = None,
                 detectors: list[Detector] | None = None):
        self.config = config
        self.detectors = build_detectors(config) if detectors is None else detectors
        self._ranks = {d.entity: d.rank for d in self.detectors}
        # most selective first, so that a deferring detector can skip what is already found
        self._order = sorted(self.detectors, key=lambda d: -d.rank)
        self._compiled = {}
        for d in self.detectors:
            if d.trigger is not None:
                trig = _as_tuple(d.trigger)
                self._compiled.setdefault(trig, [_compile(t) for t in trig])
        self._anonymizer = None
        self._loaded = False
        self._surrogates = None
        if config.action == "replace":
            from .surrogates import Surrogates

            self._surrogates = Surrogates(surrogate_key, {d.entity: d for d in self.detectors})
        self.fingerprint = self._fingerprint()

    def _fingerprint(self) -> str:
        doc = {
            "scrubber": SCRUBBER_VERSION,
            "presidio": [version("presidio-analyzer"), version("presidio-anonymizer")],
            "phonenumbers": version("phonenumbers"),
            "tldextract": version("tldextract"),
            "action": self.config.action,
            "detectors": detectors_fingerprint(self.detectors),
            "surrogates": self._surrogates.key_id if self._surrogates else None,
            "samples": self.config.sample_per_entity,
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]

    @property
    def surrogate_key(self) -> bytes | None:
        """The key `replace` draws surrogates with (None for other actions): workers need the same."""
        return self._surrogates.key if self._surrogates is not None else None

    def load(self) -> "Scrubber":
        """Load every recognizer and model now (Presidio's import takes seconds); a model that
        cannot load raises here, before any document, rather than failing each one."""
        if not self._loaded:
            for d in self.detectors:
                d.load()
            self._loaded = True
        return self

    # ---- analysis ---------------------------------------------------------------------------
    def analyze(self, text: str, *, prefilter: bool = True) -> list[Span]:
        """Every finding in `text`, overlaps resolved. `prefilter=False` runs each detector on the
        whole text (the reference the windowed path must equal)."""
        spans: list[Span] = []
        hits_of: dict[tuple[str, ...], list[tuple[int, int]]] = {}
        for d in self._order:
            if d.trigger is None or not prefilter:
                spans.extend(d.find(text))
                continue
            trig = _as_tuple(d.trigger)
            hits = hits_of.get(trig)
            if hits is None:
                hits = sorted(m.span() for r in self._compiled[trig] for m in r.finditer(text))
                hits_of[trig] = hits
            if d.defer and spans:
                hits = [h for h, c in zip(hits, covered(hits, spans)) if not c]
            for ws, we in windows(text, hits, d.margin):
                spans.extend(self._find_in_window(d, text, ws, we, d.margin))
        return resolve(spans, self._ranks)

    @staticmethod
    def _find_in_window(d: Detector, text: str, ws: int, we: int, margin: int) -> list[Span]:
        n = len(text)
        while True:
            found = d.find(text[ws:we])
            edge = any((s.start == 0 and ws > 0) or (s.end == we - ws and we < n) for s in found)
            if not edge:
                return [Span(s.start + ws, s.end + ws, s.entity, s.score) for s in found]
            ws = _snap_left(text, max(0, ws - 4 * margin))
            we = _snap_right(text, min(n, we + 4 * margin))

    # ---- scrubbing ----------------------------------------------------------------------------
    def scrub(self, text: str, *, sample_key: str = "") -> DocResult:
        """Analyze and apply the action. `sample_key` (e.g. the content hash) seeds which findings
        are sampled, so that reports are the same whatever the order documents were processed in."""
        t0 = time.perf_counter()
        spans = self.analyze(text)
        res = DocResult(text=text, nbytes=len(text.encode("utf-8", "surrogatepass")))
        if spans:
            res.counts = Counter(s.entity for s in spans)
            res.samples = self._samples(text, spans, sample_key)
            res.text = None if self.config.action == "drop_document" else self._anonymize(text, spans)
        res.seconds = time.perf_counter() - t0
        return res

    def __call__(self, path: str, text: str) -> str | None:
        """The text data path's document transform: scrubbed text, or None to drop the document."""
        return self.scrub(text).text

    def _anonymize(self, text: str, spans: list[Span]) -> str:
        from presidio_anonymizer import AnonymizerEngine
        from presidio_anonymizer.entities import OperatorConfig, RecognizerResult

        if self._anonymizer is None:
            self._anonymizer = AnonymizerEngine()
        entities = {s.entity for s in spans}
        if self._surrogates is not None:
            ops = {e: OperatorConfig("custom", {"lambda": self._surrogates.for_entity(e)}) for e in entities}
        else:
            ops = {e: OperatorConfig("replace", {"new_value": f"<{e}>"}) for e in entities}
        results = [RecognizerResult(s.entity, s.start, s.end, s.score) for s in spans]
        return self._anonymizer.anonymize(text=text, analyzer_results=results, operators=ops).text

    def _samples(self, text: str, spans: list[Span], key: str) -> list[Sample]:
        k = self.config.sample_per_entity
        if k == 0:
            return []
        ranked = sorted(
            (int.from_bytes(hashlib.blake2b(f"{key}:{i}".encode(), digest_size=8).digest(), "big"), i)
            for i in range(len(spans)))
        per: Counter = Counter()
        starts = [s.start for s in spans]
        out = []
        for prio, i in ranked:
            s = spans[i]
            if per[s.entity] >= k:
                continue
            per[s.entity] += 1
            before, after = redacted_context(text, spans, i, starts=starts)
            out.append(Sample(entity=s.entity, line=text.count("\n", 0, s.start) + 1, before=before, after=after,
                              shape=shape(text[s.start:s.end]), length=s.end - s.start, score=round(s.score, 3),
                              priority=prio))
        return out
