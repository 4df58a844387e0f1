"""Round hooks: the parts a run switches on by configuration, plugged into the driver's round loop.

The driver calls every hook at the same points of a run (`RoundHook`'s methods, in the order the
hooks are listed); a part that is off is not in the list. The hooks here: the data path's server
(`DataPathHook`), attested admission (`AdmissionHook`), the next SecAgg+ round's setup
(`SecAggSetupHook`), the link probe (`LinkProbeHook`), the per-round choice of codec and local
steps (`PlannerHook`) and the evaluation of the received model (`EvalHook`). What a hook adds to a
round's messages it adds as a rider (strategy.Rider).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from flwr.app import ConfigRecord, RecordDict

from federation.coordinator.admission import Admission, AdmissionOutcome
from federation.coordinator.bulk_path import BulkPath
from federation.coordinator.evaluation import EvalAnnouncer, EvalRider
from federation.coordinator.exchange import MessageExchange, stage_timing
from federation.coordinator.link_book import LinkBook
from federation.coordinator.roster import Roster
from federation.coordinator.round_planner import RoundPlanner
from federation.coordinator.run_state import RunState
from federation.coordinator.strategy import Exchange, ExchangeResult, Rider, RoundOutcome
from federation.protocol import message_keys as keys


class RoundHook:
    """The points of a run where a part plugs in; each does nothing unless the part overrides it."""

    def discovery_records(self) -> dict:
        """Records the discovery query carries (beside the roster's)."""
        return {}

    def enrolled(self, node: int, site: str, status: ConfigRecord) -> None:
        """`node` took `site` at a discovery, saying `status`."""

    def start_round(self, rnd: int) -> None:
        """Round `rnd` begins, before anything is sent for it (late discovery included)."""

    def discovery_riders(self, nodes: list[int], first: set[str]) -> list[Rider]:
        """What rides on the first discovery of `nodes` for round 1 (`first`: its sample)."""
        return []

    def discovered(self) -> list[dict]:
        """After the first discovery; the stage timings of what it did."""
        return []

    def prepare_riders(self, rnd: int, nodes: list[int]) -> list[Rider]:
        """Round `rnd`'s needs of `nodes` that nothing carried ahead (asked before the round starts)."""
        return []

    def before_round(self, rnd: int, nodes: list[int], timing: dict) -> list[int]:
        """Round `rnd` starts with `nodes`: the nodes it goes on with (stage timings into `timing`)."""
        return nodes

    def riders(self, rnd: int, nodes: list[int], upcoming: set[str], t0: float) -> list[Rider]:
        """What rides on round `rnd`'s messages to `nodes` (`upcoming`: the next round's sample)."""
        return []

    def after_stage(self) -> None:
        """A stage of the round strategy is aggregated."""

    def stages_over(self) -> None:
        """The round strategy is done (or failed): nothing of this round is expected any more."""

    def after_round(self, rnd: int, out: RoundOutcome, timing: dict, rejections: Counter[str]) -> None:
        """The round's outcome, before it is applied: failures, figures and rejections to add."""

    def metrics(self, rnd: int, line: dict) -> None:
        """Figures for round `rnd`'s metrics line."""

    def may_evaluate(self, name: str) -> bool:
        """Whether site `name` may be sent the final model for evaluation."""
        return True


class DataPathHook(RoundHook):
    """The data path beside Flower (bulk_path.py): its upload window per round, its refusals, which
    path each site took."""

    def __init__(self, bulk: BulkPath, run_id: int):
        self.bulk, self.run_id = bulk, run_id

    def enrolled(self, node: int, site: str, status: ConfigRecord) -> None:
        """Which path `site` said it uses from now on."""
        self.bulk.heard(site, status)

    def start_round(self, rnd: int) -> None:
        """Uploads are taken for this (run, round) only."""
        self.bulk.server.window(self.run_id, rnd)

    def after_round(self, rnd: int, out: RoundOutcome, timing: dict, rejections: Counter[str]) -> None:
        """Count the streams refused before any reply named them."""
        rejections.update(self.bulk.server.take_refusals())  # streams refused before any reply named them

    def metrics(self, rnd: int, line: dict) -> None:
        """Which path each site's model and update took."""
        line["data_path"] = dict(self.bulk.paths)


class AdmissionHook(RoundHook):
    """Attested admission (admission.py): evidence asked ahead on the messages, a verdict per round.
    `horizon_s()`: the latest an update of a round can arrive (evidence due within it is asked again)."""

    def __init__(self, admission: Admission, roster: Roster, horizon_s: Callable[[], float], rounds: int,
                 progress: Callable[[str], None]):
        self.admission, self.roster, self.horizon_s, self.rounds = admission, roster, horizon_s, rounds
        self.progress = progress
        self.outcome: AdmissionOutcome | None = None

    def verdict(self, rnd: int, nodes: list[int]) -> AdmissionOutcome:
        """Round `rnd` starts: the nodes whose evidence our appraisal holds."""
        return self.admission.verdict(rnd, nodes, {n: self.roster.site_name(n) for n in nodes})

    def discovery_riders(self, nodes: list[int], first: set[str]) -> list[Rider]:
        """Nonces to every node that may be in round 1's sample."""
        return [self.admission.rider(0, 1, lambda node, name: name is None or name in first,
                                     self.roster.known_name, lambda: nodes)]

    def prepare_riders(self, rnd: int, nodes: list[int]) -> list[Rider]:
        """Nonces to the nodes never asked whose appraisal is due."""
        asked, name = self.admission.round(rnd).asked, self.roster.site_name
        fresh = {n for n in nodes if n not in asked and self.admission.due(name(n), self.horizon_s())}
        if not fresh:
            return []
        return [self.admission.rider(rnd - 1, rnd, lambda node, _: node in fresh, self.roster.known_name,
                                     lambda: sorted(fresh))]

    def before_round(self, rnd: int, nodes: list[int], timing: dict) -> list[int]:
        """The round goes on with the admitted nodes only."""
        self.outcome = self.verdict(rnd, nodes)
        return self.outcome.admitted

    def riders(self, rnd: int, nodes: list[int], upcoming: set[str], t0: float) -> list[Rider]:
        """Our answers to the sites' nonces, and nonces to the next round's sites that are due."""
        adm, within = self.admission, 2 * self.horizon_s()
        nxt = rnd + 1 if rnd < self.rounds else None
        return [adm.rider(rnd, nxt, lambda node, name: name is not None and name in upcoming and adm.due(name, within),
                          self.roster.known_name, self.roster.candidates)]

    def after_round(self, rnd: int, out: RoundOutcome, timing: dict, rejections: Counter[str]) -> None:
        """The refused sites named, counted and failed; the round's attestation figures."""
        outcome, self.outcome = self.outcome, None
        if outcome is None:
            return
        self.admission.refusals(rnd, outcome)
        for name, reason in outcome.excluded.items():
            rejections["attestation:" + outcome.codes[name]] += 1
            self.progress(f"round {rnd}: site {name} NOT ADMITTED: {reason}")
        out.failed.update(outcome.excluded)
        out.extra["attestation"] = outcome.metrics()

    def may_evaluate(self, name: str) -> bool:
        """Only a site admitted now is sent the final model."""
        return self.admission.admitted(name)


class SecAggSetupHook(RoundHook):
    """The next SecAgg+ round's setup (secagg_round.py `PendingSetups`), asked on this round's messages."""

    def __init__(self, secagg, roster: Roster, run_id: int, rounds: int):
        self.secagg, self.roster, self.run_id, self.rounds = secagg, roster, run_id, rounds

    def channel_keys(self) -> dict[str, bytes]:
        """site -> the SecAgg channel key plans name: the registry's, else what discovery told."""
        return self.secagg.registered_channel_keys() or dict(self.roster.channel_keys)

    def discovery_riders(self, nodes: list[int], first: set[str]) -> list[Rider]:
        """Round 1's setup, when the registry already holds every channel key."""
        if not self.secagg.registered_channel_keys():
            return []
        self.secagg.plan(1, self.run_id, first, self.secagg.registered_channel_keys())
        return [self.secagg.setup_rider(1, self.roster.known_name, lambda: nodes)]

    def prepare_riders(self, rnd: int, nodes: list[int]) -> list[Rider]:
        """The setup of the round's nodes that were never asked for it."""
        setups = self.secagg.pending.rounds.get(rnd)
        if setups is None:
            setups = self.secagg.plan(rnd, self.run_id, [self.roster.site_name(n) for n in nodes], self.channel_keys())
        todo = [n for n in nodes if n not in setups.asked]
        rider = self.secagg.setup_rider(rnd, self.roster.known_name, lambda: todo)
        return [rider] if rider.wanted() else []

    def riders(self, rnd: int, nodes: list[int], upcoming: set[str], t0: float) -> list[Rider]:
        """The next round's setup, planned for its sample."""
        if rnd >= self.rounds:
            return []
        self.secagg.plan(rnd + 1, self.run_id, upcoming, self.channel_keys())
        return [self.secagg.setup_rider(rnd + 1, self.roster.known_name, self.roster.candidates)]


class LinkProbeHook(RoundHook):
    """The sites' links measured (link_book.py): at discovery, then every `link.probe_every` rounds;
    those on the data path measure it themselves, the others are measured through Flower."""

    def __init__(self, links: LinkBook, roster: Roster, exchange: MessageExchange, bulk: BulkPath | None,
                 deadlines, progress: Callable[[str], None]):
        self.links, self.roster, self.exchange, self.bulk = links, roster, exchange, bulk
        self.deadlines, self.progress = deadlines, progress
        roster.on_status.append(lambda site, status: self.links.heard(site, status))

    def discovery_records(self) -> dict:
        """The probe request: sites on the data path measure it at discovery."""
        return {keys.PROBE: self.links.request(0)}  # sites on the data path measure

    def discovered(self) -> list[dict]:
        """Measure the links of the sites not on the data path through Flower."""
        return self.probe_flower(sorted(self.roster.sites), 0)

    def _direct(self, node: int) -> bool:
        paths = self.bulk.paths if self.bulk is not None else {}
        return paths.get(self.roster.site_name(node)) == "direct"

    def probe_flower(self, nodes: list[int], rnd: int) -> list[dict]:
        """Measure, through Flower, the links of `nodes` that are not on the data path; the stage timings."""
        todo = {n: self.roster.site_name(n) for n in nodes if not self._direct(n)}
        results = self.links.probe_flower(self.exchange.exchange, todo, rnd,
                                          min(self.deadlines.connect_s, self.deadlines.round_s))
        return [stage_timing(f"link probe through Flower before round {rnd}", r) for r in results]

    def before_round(self, rnd: int, nodes: list[int], timing: dict) -> list[int]:
        """Every `link.probe_every` rounds: the round's sites measured again."""
        if self.links.due(rnd):
            timing["stages"] += self.probe(rnd, nodes)
        return nodes

    def probe(self, rnd: int, nodes: list[int]) -> list[dict]:
        """Before round `rnd`: the sites of `nodes` measure their links again; the stage timings."""
        direct = [n for n in nodes if self._direct(n)]
        stages = []
        if direct:
            rec = self.links.request(rnd)
            res = self.exchange.exchange(Exchange(f"link probe before round {rnd}", "query", direct, lambda n: RecordDict(
                {keys.CONFIG: ConfigRecord({}), keys.PROBE: rec}), self.deadlines.round_s))
            for reply in res.replies:
                self.links.heard(reply.name, reply.status)
            for name, reason in res.failed.items():
                self.progress(f"round {rnd}: link probe of site {name} failed: {reason}")
            stages.append(stage_timing(f"link probe before round {rnd}", res))
        return stages + self.probe_flower([n for n in nodes if n not in direct], rnd)

    def metrics(self, rnd: int, line: dict) -> None:
        """Each site's link as last measured."""
        line["links"] = self.links.metrics()  # each site's link as last measured


class PlannerHook(RoundHook):
    """`round_target_s`: each round's codec and local steps chosen from the links and the history
    (round_planner.py); `first_fixed_s()`: a round's fixed cost before any round measured it."""

    def __init__(self, planner: RoundPlanner, roster: Roster, links: LinkBook | None, state: Callable[[], RunState],
                 first_fixed_s: Callable[[], float]):
        self.planner, self.roster, self.links, self.state = planner, roster, links, state
        self.first_fixed_s = first_fixed_s

    def before_round(self, rnd: int, nodes: list[int], timing: dict) -> list[int]:
        """Choose the round's codec and local steps."""
        st = self.state()
        self.planner.choose(rnd, [self.roster.site_name(n) for n in nodes], self.links.figures if self.links else {},
                            st.history, sum(int(v.size) for v in st.model.values()),
                            sum(v.nbytes for v in st.model.values()),
                            {s.name: s.step_s_estimate for s in self.roster.sites.values() if s.step_s_estimate},
                            first_fixed_s=self.first_fixed_s(),
                            nothing_down=bool(nodes) and all(st.downlink.holds(n, st.model) for n in nodes))
        return nodes

    def metrics(self, rnd: int, line: dict) -> None:
        """The round's choice and why."""
        if rnd in self.planner.choices:  # round_target_s's choice and why
            line["round_plan"] = self.planner.choices[rnd].metrics()


class EvalHook(RoundHook):
    """The sites evaluate the model they receive before training on it; the round's figures are
    said as soon as they are known (evaluation.py): from the sites' early reports on the data path
    (`report`, on a bulk server thread), else from the train replies."""

    def __init__(self, roster: Roster, progress: Callable[[str], None]):
        self.roster, self.progress = roster, progress
        self.current: tuple[EvalAnnouncer, EvalRider] | None = None
        self.rider: EvalRider | None = None
        self.announcer: EvalAnnouncer | None = None

    def report(self, site: str, rnd: int, figures: dict[str, float]) -> None:
        """A site's evaluation of round `rnd`'s model ahead of its reply."""
        current = self.current
        if current is not None:
            current[0].report(site, rnd, figures)

    def riders(self, rnd: int, nodes: list[int], upcoming: set[str], t0: float) -> list[Rider]:
        """A rider reading the train replies' figures, and the round's announcer."""
        self.rider = EvalRider()
        self.announcer = EvalAnnouncer(rnd, {self.roster.site_name(n) for n in nodes}, self.progress, t0)
        self.current = (self.announcer, self.rider)
        return [self.rider]

    def after_stage(self) -> None:
        """Say the figures from the train replies, unless the early reports did."""
        if self.current is not None:  # the train replies' figures, unless the sites said them earlier
            self.current[0].replies(self.current[1].totals)

    def stages_over(self) -> None:
        """Early reports that arrive from now on are for no round."""
        self.current = None

    def after_round(self, rnd: int, out: RoundOutcome, timing: dict, rejections: Counter[str]) -> None:
        """The round's evaluation figures (of the model of the round before)."""
        if self.rider is None or self.announcer is None:
            return
        out.extra.update(self.rider.totals.figures(), eval_model_round=rnd - 1)
        if self.announcer.known_s is not None:
            timing["eval_known_s"] = self.announcer.known_s
        self.rider = self.announcer = None



def hooks_for(roster: Roster, messaging: MessageExchange, progress: Callable[[str], None], run_id: int, rounds: int,
              deadlines, state: Callable[[], RunState], horizon_s: Callable[[], float],
              first_fixed_s: Callable[[], float], bulk: BulkPath | None = None, admission: Admission | None = None,
              secagg=None, links: LinkBook | None = None, planner: RoundPlanner | None = None,
              evaluate: bool = False) -> list[RoundHook]:
    """The hooks of the parts that are on (not None), in the order the driver calls them."""
    hooks: list[RoundHook] = []
    if bulk is not None:
        hooks.append(DataPathHook(bulk, run_id))
    if admission is not None:
        hooks.append(AdmissionHook(admission, roster, horizon_s, rounds, progress))
    if secagg is not None:
        hooks.append(SecAggSetupHook(secagg, roster, run_id, rounds))
    if links is not None:
        hooks.append(LinkProbeHook(links, roster, messaging, bulk, deadlines, progress))
    if planner is not None:
        hooks.append(PlannerHook(planner, roster, links, state, first_fixed_s))
    if evaluate:
        evals = EvalHook(roster, progress)
        if bulk is not None:
            bulk.server.on_report = evals.report
        hooks.append(evals)
    return hooks

def prepare_round(hooks: list[RoundHook], messaging: MessageExchange, rnd: int, nodes: list[int],
                  wait_s: float) -> ExchangeResult | None:
    """Before round `rnd`: a query to each of `nodes` that was never asked for what the round
    needs (the hooks' prepare riders: evidence, SecAgg setup), answered before the round starts
    (within `wait_s`). Only when nothing could ride ahead: round 1 without a bundle (channel keys
    come from discovery), or a round run on its own (tests). A site that was asked and did not
    answer sits the round out instead. None when nothing is asked."""
    riders = [r for h in hooks for r in h.prepare_riders(rnd, nodes)]
    if not riders:
        return None
    t0 = time.monotonic()
    saved, messaging.riders = messaging.riders, riders
    try:
        res = messaging.exchange(Exchange(f"prepare round {rnd}", "query", [], lambda n: RecordDict(), wait_s))
        messaging.await_all_side_queries(wait_s)  # here the round does wait for them
    finally:
        messaging.riders = saved
    res.seconds = time.monotonic() - t0
    res.wait_s = res.seconds - res.push_s
    return res
