"""The link probe, both ends' shared part: what a probe measures, how it travels, how it is read.

A site measures its link to the coordinator through the path its updates really take: on the bulk
data path (`direct`) it times three RPCs of its own beside Ping/Begin/Put/Get (the coordinator's
handlers are coordinator/link_probe_server.py, the site's calls site/link_probe.py):

  ProbeEcho    unary            small request -> small reply              (round-trip time)
  ProbeSink    client-streaming chunks of zeros -> {"bytes": n}          (uplink throughput)
  ProbeSource  server-streaming {"bytes": n, "chunk": c} -> chunks       (downlink throughput)

on one stream by default (site/link_probe.py says why), or as many as a transfer uses. A site that is not
direct is measured by the coordinator through Flower (coordinator/link_book.py). Either way the
result is a `LinkFigures`; a site sends its own in the STATUS of its reply as JSON under
`link_probe`, which the coordinator reads with `parse_figures` (another party's bytes: every field
is checked, a bad one is a clear `LinkProbeError`, never an exception out of the round).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Literal

from flwr.app import ConfigRecord

STATUS_KEY = "link_probe"  # STATUS field of a reply: the site's LinkFigures as JSON
ECHO, SINK, SOURCE = "ProbeEcho", "ProbeSink", "ProbeSource"
PROBE_CHUNK = 256 << 10  # bytes per probe message: small enough to keep every stream busy
MAX_PROBE_BYTES = 1 << 30  # the most one ProbeSource call may ask the coordinator to send
MAX_RATE_MBIT = 1e6  # 1 Tbit/s: beyond any link; a larger figure is a bad report


class LinkProbeError(ValueError):
    """A probe report or request that cannot be used; the text says which field and why."""


@dataclass(frozen=True)
class ProbeSettings:
    """How long and how hard a probe measures (the coordinator says, in the PROBE record)."""

    seconds: float = 0.5  # each direction's measurement runs at least this long (or up to max_bytes)
    max_bytes: int = 32 << 20  # each direction sends at most this much per measurement
    pings: int = 10  # round trips whose least is the RTT
    streams: int = 1  # parallel streams (TCP connections) the throughput is measured on; 0: a transfer's

    def to_record(self) -> ConfigRecord:
        """The PROBE record of a message (a site that sees it probes and reports)."""
        return ConfigRecord({"seconds": float(self.seconds), "max_bytes": int(self.max_bytes), "pings": int(self.pings),
                             "streams": int(self.streams)})

    @classmethod
    def from_record(cls, rec) -> "ProbeSettings":
        """The coordinator's PROBE record, bounded (a probe never runs away): LinkProbeError if unusable."""
        try:
            seconds = float(rec.get("seconds", cls.seconds))
            max_bytes = int(rec.get("max_bytes", cls.max_bytes))
            pings = int(rec.get("pings", cls.pings))
            streams = int(rec.get("streams", cls.streams))
        except (TypeError, ValueError, OverflowError) as err:
            raise LinkProbeError(f"unreadable probe request ({err})") from None
        if not (0 < seconds <= 30 and 1 << 16 <= max_bytes <= MAX_PROBE_BYTES and 1 <= pings <= 100
                and 0 <= streams <= 32):
            raise LinkProbeError(f"probe request out of range: seconds {seconds} (0-30], max_bytes {max_bytes} "
                                 f"[64 KiB, 1 GiB], pings {pings} [1, 100], streams {streams} [0, 32]")
        return cls(seconds, max_bytes, pings, streams)


@dataclass(frozen=True)
class LinkFigures:
    """One site's link as measured: round trip, throughput each way, and how it was measured."""

    path: Literal["bulk", "flower"]  # what was measured: the data path, or Flower's messages
    rtt_ms: float
    up_mbit: float  # site -> coordinator
    down_mbit: float  # coordinator -> site
    up_bytes: int = 0  # bytes the rate was measured on
    down_bytes: int = 0
    streams: int = 1
    capped: bool = False  # a direction hit max_bytes before `seconds`: its rate is a lower bound
    round: int = 0  # measured before this round (0: at discovery)

    def to_json(self) -> str:
        """What a site puts in its STATUS."""
        return json.dumps(asdict(self), separators=(",", ":"))

    def metrics(self) -> dict:
        """The figures as the metrics line and the run report show them."""
        return {"path": self.path, "rtt_ms": round(self.rtt_ms, 3), "up_mbit": round(self.up_mbit, 3),
                "down_mbit": round(self.down_mbit, 3), "streams": self.streams, "capped": self.capped,
                "round": self.round}

    def transfer_s(self, up_bytes: float, down_bytes: float, round_trips: float | None = None) -> float:
        """Seconds to move `down_bytes` to the site and `up_bytes` back, plus `round_trips` RTTs
        (default: two on the data path, a download's request and an upload's answer; none through
        Flower, whose round trip is the delivery of the round's messages, a fixed cost of every
        round that no codec changes: 6.9 s measured on loopback, mostly the SuperNode's polling)."""
        if round_trips is None:
            round_trips = 2.0 if self.path == "bulk" else 0.0
        return (down_bytes * 8 / (self.down_mbit * 1e6) + up_bytes * 8 / (self.up_mbit * 1e6)
                + round_trips * self.rtt_ms / 1e3)


def _finite(obj: dict, key: str, lo: float, hi: float) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not lo <= value <= hi:
        raise LinkProbeError(f"{key} must be a number in [{lo:g}, {hi:g}], got {str(value)[:40]}")
    return float(value)


def parse_figures(text: object) -> LinkFigures:
    """A site's reported figures (the STATUS `link_probe` field), every field checked."""
    if not isinstance(text, str) or len(text) > 4096:
        raise LinkProbeError("link_probe must be a JSON string of at most 4 KiB")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        raise LinkProbeError("link_probe is not JSON") from None
    if not isinstance(obj, dict):
        raise LinkProbeError("link_probe is not a JSON object")
    path = obj.get("path")
    if path not in ("bulk", "flower"):
        raise LinkProbeError(f"path must be 'bulk' or 'flower', got {str(path)[:40]}")
    return LinkFigures(path=path, rtt_ms=_finite(obj, "rtt_ms", 0.0, 600_000.0),
                       up_mbit=_finite(obj, "up_mbit", 1e-6, MAX_RATE_MBIT),
                       down_mbit=_finite(obj, "down_mbit", 1e-6, MAX_RATE_MBIT),
                       up_bytes=int(_finite(obj, "up_bytes", 0, 2**53)), down_bytes=int(_finite(obj, "down_bytes", 0, 2**53)),
                       streams=int(_finite(obj, "streams", 1, 64)), capped=bool(obj.get("capped", False)),
                       round=int(_finite(obj, "round", 0, 2**31)))


def rate_mbit(nbytes: int, seconds: float, rtt_s: float) -> float:
    """Throughput of a transfer of `nbytes` that took `seconds` from the call to its answer: the
    answer costs one round trip beyond the bytes' own time, so that is taken off (unless it is most
    of the time: then the transfer was too short to say, and the whole time counts)."""
    busy = seconds - rtt_s if seconds - rtt_s > 0.5 * seconds else seconds
    return nbytes * 8 / max(busy, 1e-9) / 1e6


def next_size(nbytes: int, seconds: float, want_s: float, max_bytes: int) -> int:
    """The size of the next measurement after one of `nbytes` took `seconds`: large enough to take
    `want_s` at the rate just seen (with a margin), at least twice, at most 16 times as much."""
    factor = min(16.0, max(2.0, 1.5 * want_s / max(seconds, 1e-6)))
    return int(min(max_bytes, nbytes * factor))
