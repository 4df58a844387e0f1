"""The driver's use of round_plan.choose: the figures it needs, gathered from the run.

Per round: the link figures of the round's sites (link_book.py), each site's seconds per local
step from its latest line in the metrics history (its trainer's `train_s`, plus the background
seconds under federation.overlap, over the steps it reports having run, else those it was given,
else its own `local_steps`; under overlap, over those and its background steps: max(given, folded
in) plus discarded) or, before a site's first round, the estimate its trainer timed at its start
and gave at discovery (site_trainer/local_trainer.py `_time_step`), the bytes of an update under
each codec (what that codec really sent in an earlier round, else round_plan.wire_bytes) and the
model's bytes down (none when every site already holds the model, as after discovery when the
sites built the coordinator's starting model; else what the last round's sites received on the
data path, else the dense model),
and what the last round cost besides (its wall time less the slowest site's trainer calls, the
predicted transfer and any link probe: Flower's delivery, ClientApp start-up, aggregation). Before
any round that last figure is estimated from discovery: the slowest site's seconds of a discovery
message outside its handler (`message_overhead_s`), once per message a round sends each site (the
round strategy's `messages`: SecAgg+ sends two). Without it round 1 was planned as if its
messages cost nothing and overran its target by half (92 s for 60 s, benchmarks/wan_time_to_loss.py).

A resumed run re-measures its links at discovery and gets the step times and sizes from the
restored history, so the rounds it runs are chosen from fresh links; the rounds before keep the
choices their lines record.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from federation.config.schema import ExperimentConfig
from federation.coordinator.round_plan import RoundChoice, choose, wire_bytes
from federation.protocol.link_probe import LinkFigures


def message_overhead_s(costs: Mapping[str, Mapping[str, float]]) -> float:
    """The slowest site's seconds of one message outside its handler (Flower's delivery, the
    ClientApp's start-up, the reply's return), from a stage's per-site message costs
    (protocol/message_cost.py); 0 when no reply said when its handler ran."""
    return max((float(c["total_s"]) - float(c["handler_s"]) for c in costs.values()
                if "total_s" in c and "handler_s" in c), default=0.0)


def _count(value: object) -> int:
    """A step count from a metrics line (0 when absent or not a number)."""
    return int(value) if isinstance(value, (int, float)) and value > 0 else 0


class RoundPlanner:
    """Chooses each round's codec and local steps for `federation.round_target_s`."""

    def __init__(self, cfg: ExperimentConfig, progress: Callable[[str], None]):
        self.cfg, self.fed, self.progress = cfg, cfg.federation, progress
        self.ladder = self.fed.codec_ladder
        self.own_steps = {s.id: s.local_steps for s in cfg.sites}
        self.choices: dict[int, RoundChoice] = {}

    def step_times(self, history: list[dict]) -> dict[str, float]:
        """site -> seconds per local step, from its latest round in `history`."""
        out: dict[str, float] = {}
        for line in history:
            steps = (line.get("round_plan") or {}).get("local_steps")
            for site, m in (line.get("sites") or {}).items():
                took = m.get("seconds") or m.get("train_call_s")
                n = m.get("local_steps") or steps or self.own_steps.get(site)  # what it says it ran, else what it was told
                if isinstance(took, (int, float)) and took > 0 and n:
                    # federation.overlap: some of the round's steps ran in the background, before the request;
                    # background_s times all of them: the b folded in (more than n with
                    # overlap_max_steps_factor above 1: then the round trained none after the fold) and any
                    # discarded, so the round's steps were max(n, b) + discarded
                    background = m.get("background_s")
                    if isinstance(background, (int, float)) and background > 0:
                        took += background
                        n = max(n, _count(m.get("background_steps"))) + _count(m.get("overlap_discarded_steps"))
                    out[site] = float(took) / n
        return out

    def sizes(self, history: list[dict], numel: int) -> tuple[dict[str, float], float | None]:
        """(codec -> bytes of one update, bytes down of the latest round or None)."""
        seen: dict[str, float] = {}
        down = None
        for line in history:
            codec = (line.get("round_plan") or {}).get("codec")
            ups = [m["upload_bytes"] for m in (line.get("sites") or {}).values() if m.get("upload_bytes")]
            if codec and ups:
                seen[codec] = max(ups)
            downs = [m["bulk_down_bytes"] for m in (line.get("sites") or {}).values() if m.get("bulk_down_bytes")]
            if downs:
                down = max(downs)
        return {c: seen.get(c, float(wire_bytes(c, numel))) for c in self.ladder}, down

    def fixed_s(self, history: list[dict]) -> float:
        """What the latest round cost besides the link and the training: its wall time less the
        slowest site's trainer calls, the predicted transfer and any link probe (0 before any round)."""
        if not history:
            return 0.0
        line = history[-1]
        t = line.get("timing") or {}
        probes = sum(float(st.get("seconds") or 0) for st in t.get("stages") or []
                     if str(st.get("stage", "")).startswith(("link probe", "discovery")))
        transfer = float((line.get("round_plan") or {}).get("transfer_s") or 0.0)
        total = float(line.get("round_s") or 0.0) - probes - float(t.get("site_work_s") or 0.0) - transfer
        return max(0.0, total)

    def choose(self, rnd: int, sites: list[str], links: Mapping[str, LinkFigures], history: list[dict],
               numel: int, dense_bytes: int, estimates: Mapping[str, float] | None = None,
               first_fixed_s: float = 0.0, nothing_down: bool = False) -> RoundChoice:
        """Round `rnd`'s choice for `sites`; logged with its reason. `estimates`: site -> seconds per
        step its trainer timed at its start, for the sites no round has measured yet; `first_fixed_s`:
        what a round costs besides, before any round has measured it (from discovery);
        `nothing_down`: every site already holds the model the round sends (the downlink's hold)."""
        up, down = self.sizes(history, numel)
        if nothing_down:
            down = 0.0
        measured = self.step_times(history)
        estimated = {s: v for s, v in (estimates or {}).items() if s not in measured}
        choice = choose(rnd, float(self.fed.round_target_s or 0), {s: links[s] for s in sites if s in links},
                        {**estimated, **measured}, self.ladder, up, down if down is not None else float(dense_bytes),
                        link_share=self.fed.link.link_share, min_steps=self.fed.link.min_local_steps,
                        max_steps=self.fed.link.max_local_steps, fallback_codec=self.fed.codec,
                        fixed_s=self.fixed_s(history) if history else max(0.0, first_fixed_s),
                        estimated=frozenset(estimated),
                        # round 1 has no earlier reply to train behind: its steps, transfer and fixed cost add up
                        overlap=self.fed.overlap and bool(history))
        if nothing_down:
            choice = replace(choice, reason=f"{choice.reason}; no model goes down: every site already holds it")
        self.choices[rnd] = choice
        self.progress(f"round {rnd}: round target {self.fed.round_target_s:g}s: {choice.reason}")
        return choice
