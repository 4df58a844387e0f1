"""The detector plug-in interface: `Detector` (one entity type) and the `Span` it reports.

Its own module so that detectors of every kind (the Presidio-backed ones in recognizers.py, the
NER models in ner.py, a site's plug-ins) build on it without importing each other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Span:
    """One finding: [start, end) in the text it was found in."""

    start: int
    end: int
    entity: str
    score: float


class Detector(ABC):
    """One entity type's detector (the plug-in interface).

    - `entity`: the type it reports (e.g. ``"EMAIL_ADDRESS"``); counts and placeholders use it.
    - `trigger`: a regex (stdlib `re` syntax) or a tuple of them, or None for whole documents. Every span `find` returns must
      overlap a trigger match and lie within `margin` characters of it: the scrubber then runs
      `find` on small windows only. A trigger that is too narrow loses recall silently; the test
      suite checks windowed == whole-document results for the built-ins.
    - `rank`: breaks ties between overlapping spans of equal score (more selective checks win).
    - `version`: anything that changes results (model hash, pattern version): enters cache keys.
    - `defer`: skip trigger matches that lie inside a span already found by a detector of higher
      rank. Only for a detector whose spans lose every overlap anyway (lowest score and rank).
    """

    entity: str
    trigger: str | tuple[str, ...] | None = None
    margin: int = 64
    rank: int = 0
    version: str = "1"
    defer: bool = False

    @abstractmethod
    def find(self, text: str) -> list[Span]:
        """Spans of `entity` in `text`, offsets relative to `text`."""

    def load(self) -> None:
        """Heavy set-up (models, compiled patterns), called once before the first document; errors
        here are configuration errors and stop the run."""

    def fingerprint(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}:{self.entity}:{self.version}:{self.trigger}"
