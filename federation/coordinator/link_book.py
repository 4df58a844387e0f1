"""What the coordinator knows of each site's link, and how it asks (protocol/link_probe.py).

A site on the data path measures its own link when a message carries a PROBE record (discovery,
or a probe query before a round when `link.probe_every` says so) and reports the figures in its
STATUS; the book checks and keeps them. A site without the data path sends its updates through
Flower, so that is the path measured, by the coordinator: three queries in turn (empty, with
`probe_flower_bytes` down, asking for as many back), each site's round-trip time the empty one's,
each direction's rate its bytes over the extra time its message took. Flower's own delivery
(polling, a ClientApp process per message) is in those times, as it is in an update's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from federation.coordinator.strategy import Exchange, ExchangeResult
from federation.protocol import link_probe as lp
from federation.protocol import message_keys as keys
from federation.protocol.payload_records import to_array

if TYPE_CHECKING:
    from federation.config.schema import LinkPlan


class LinkBook:
    """Each site's latest link figures, and the probe requests that refresh them."""

    def __init__(self, plan: "LinkPlan", progress: Callable[[str], None]):
        self.plan, self.progress = plan, progress
        self.settings = lp.ProbeSettings(plan.probe_seconds, plan.probe_max_bytes, streams=plan.probe_streams)
        self.figures: dict[str, lp.LinkFigures] = {}
        self.errors: dict[str, str] = {}  # site -> why its last probe gave no figures

    def request(self, rnd: int) -> ConfigRecord:
        """The PROBE record asking a site on the data path to measure its link (before round `rnd`)."""
        rec = self.settings.to_record()
        rec["round"] = rnd
        return rec

    def due(self, rnd: int) -> bool:
        """Whether the links are measured again before round `rnd` (`link.probe_every`)."""
        every = self.plan.probe_every
        return bool(every) and rnd > 1 and (rnd - 1) % every == 0

    def heard(self, site: str, status) -> bool:
        """A reply's STATUS: keep the figures it reports (True), or say why there are none."""
        if lp.STATUS_KEY in status:
            try:
                fig = lp.parse_figures(status[lp.STATUS_KEY])
            except lp.LinkProbeError as err:
                self._failed(site, f"its report is unusable ({err})")
                return False
            self.keep(site, fig)
            return True
        if status.get("link_probe_error"):
            self._failed(site, str(status["link_probe_error"])[:300])
        return False

    def keep(self, site: str, fig: lp.LinkFigures) -> None:
        """Take `fig` as `site`'s link from now on, and say so."""
        self.figures[site] = fig
        self.errors.pop(site, None)
        where = "on the data path" if fig.path == "bulk" else "through Flower"
        bound = " (a lower bound: the probe hit its byte cap)" if fig.capped else ""
        self.progress(f"site {site}: link measured {where}: RTT {fig.rtt_ms:.1f} ms, up {fig.up_mbit:.1f} Mbit/s, "
                      f"down {fig.down_mbit:.1f} Mbit/s{bound}")

    def _failed(self, site: str, why: str) -> None:
        self.errors[site] = why
        self.progress(f"site {site}: link NOT measured: {why}")

    def metrics(self) -> dict:
        """The figures (and failures) for the metrics line and the run report."""
        out: dict = {s: f.metrics() for s, f in sorted(self.figures.items())}
        out.update({s: {"error": e} for s, e in sorted(self.errors.items()) if s not in self.figures})
        return out

    # ---- sites without the data path: timed through Flower -----------------------------------
    def probe_flower(self, exchange: Callable[[Exchange], ExchangeResult], nodes: dict[int, str], rnd: int,
                     deadline_s: float) -> list[dict]:
        """Measure the Flower path of `nodes` (node -> site) with three queries; their stage timings."""
        if not nodes:
            return []
        n = self.plan.probe_flower_bytes
        asked = self.request(rnd)
        asked["flower"] = True
        back = ConfigRecord({**dict(asked.items()), "flower_up_bytes": n})
        payload = ArrayRecord({"zeros": to_array(np.zeros(n, dtype=np.uint8))})
        stages, times = [], []
        for what, content in (("rtt", lambda node: RecordDict({keys.CONFIG: ConfigRecord({}), keys.PROBE: asked})),
                              ("down", lambda node: RecordDict({keys.CONFIG: ConfigRecord({}), keys.PROBE: asked,
                                                                keys.PROBE_PAYLOAD: payload})),
                              ("up", lambda node: RecordDict({keys.CONFIG: ConfigRecord({}), keys.PROBE: back}))):
            res = exchange(Exchange(f"link probe through Flower ({what})", "query", list(nodes), content, deadline_s))
            times.append(res.by_node)
            stages.append(res)
        for node, site in nodes.items():
            if not all(node in t for t in times):
                self._failed(site, "a probe query through Flower got no reply in time")
                continue
            rtt, down, up = (t[node] for t in times)
            self.keep(site, flower_figures(n, rtt, down, up, rnd))
        return stages


def flower_figures(nbytes: int, rtt_s: float, down_s: float, up_s: float, rnd: int) -> lp.LinkFigures:
    """A Flower path's figures from the seconds three messages took: empty both ways (`rtt_s`),
    `nbytes` down (`down_s`), `nbytes` back (`up_s`). A message with bytes that came back no later
    than the empty one says only that the rate is above what its whole time gives (`capped`)."""
    def rate(took: float) -> tuple[float, bool]:
        extra = took - rtt_s
        return (nbytes * 8 / extra / 1e6, False) if extra > 0.05 * took else (nbytes * 8 / max(took, 1e-6) / 1e6, True)

    (down, c1), (up, c2) = rate(down_s), rate(up_s)
    return lp.LinkFigures("flower", rtt_s * 1e3, min(up, lp.MAX_RATE_MBIT), min(down, lp.MAX_RATE_MBIT),
                          nbytes, nbytes, 1, c1 or c2, rnd)
