"""The driver: the run's round loop over Flower's Grid (Message API).

Each round: sample the sites (roster.sample), ask nodes that connected late (roster.py), let the
round hooks prepare and filter it (round_hooks.py: the data path's window, attested admission, the
link probe, the round planner, the evaluation announcer), run the round strategy (plain_round.py or
secagg_round.py) through the exchange (exchange.py: push, pull until each stage's deadline, reply
checks; beneath it the data path, bulk_grid.py, over the SuperLink's retries, retry_grid.py), apply
the server optimizer to the mean update if the quorum holds (otherwise the round is skipped and the
global model is left unchanged), checkpoint the run's state (run_state.py, resume.py) and write one
JSON line of metrics. The run ends with one evaluate message per site (the final model).

Messages per site and round: one train message, plus one unmask query under secure aggregation.
What the next round needs (attestation evidence, SecAgg setup) rides on them; a site the round
does not address but the next one samples gets a query of its own, which the round does not wait
for. Round 1's needs ride on site discovery.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from flwr.app import ConfigRecord, RecordDict
from flwr.serverapp import Grid

from crypto.envelope import ReplayGuard
from crypto.pki import CoordinatorBundle
from federation.config.schema import ExperimentConfig
from federation.coordinator.admission import Admission, AdmissionOutcome
from federation.coordinator.aggregate import ServerOptimizer
from federation.coordinator.bulk_grid import BulkGrid
from federation.coordinator.bulk_path import BulkPath
from federation.coordinator.bulk_server import BulkServer
from federation.coordinator.downlink_sender import DownlinkSender
from federation.coordinator.evaluation import Evaluation
from federation.coordinator.exchange import MessageExchange, Traffic, stage_timing
from federation.coordinator.facade import part_field, state_field
from federation.coordinator.link_book import LinkBook
from federation.coordinator.manifest_check import BaseCheck
from federation.coordinator.model_spill import restore_model
from federation.coordinator.plain_round import PlainRound
from federation.coordinator.resume import resume_run
from federation.coordinator.retry_grid import RetryingGrid
from federation.coordinator.roster import Roster, sample
from federation.coordinator.round_hooks import AdmissionHook, hooks_for, prepare_round
from federation.coordinator.round_messages import RoundMessages
from federation.coordinator.round_planner import RoundPlanner, message_overhead_s
from federation.coordinator.run_log import RunLog, metrics_line, round_summary, run_result
from federation.coordinator.run_state import RunState
from federation.coordinator.run_observers import run_observers
from federation.coordinator.strategy import Exchange, ExchangeResult, RoundInput, RoundOutcome, Site, Strategy
from federation.protocol import message_cost
from federation.protocol import message_keys as keys
from federation.protocol import testing_hooks
from federation.protocol.codecs import Arrays
from federation.protocol.wire_dtypes import WireCopy, to_master

__all__ = ["Coordinator", "FederationFailed", "Site"]

log = logging.getLogger("sovfl.coordinator")


class FederationFailed(RuntimeError):
    """The run cannot go on (too few sites); the message says why."""


class Coordinator:
    """The run on the coordinator: the roster, the exchange, the run's state, the round hooks and
    the round strategy, driven round by round."""

    model = state_field("model")
    opt = state_field("opt")
    downlink = state_field("downlink")
    history = state_field("history")
    rejections = state_field("rejections")
    grid = part_field("messaging", "grid")
    riders = part_field("messaging", "riders")
    sites = part_field("roster", "sites")
    background_checkpoints = part_field("log", "background")

    def __init__(self, grid: Grid | None, cfg: ExperimentConfig, workdir: Path, run_id: int,
                 initial: Arrays, progress: Callable[[str], None] | None = None,
                 bundle: CoordinatorBundle | None = None, manifest: dict | None = None,
                 sites_starting_s: float = 0.0, bulk: BulkServer | None = None):
        self.cfg, self.fed, self.workdir, self.run_id = cfg, cfg.federation, Path(workdir), run_id
        fed = self.fed
        self._progress = progress or (lambda line: log.info(line))
        self.sites_starting_s = sites_starting_s  # sites started alongside us (simulate): their start-up is allowed too
        self.spec = {k: (v.dtype.str, tuple(v.shape)) for k, v in initial.items()}  # updates as they travel
        self.state = RunState(to_master(initial, self.spec),  # float32 where bf16 travels as raw words
                              ServerOptimizer(fed.strategy, fed.update_kind, fed.effective_server_lr, fed.server_beta1,
                                              fed.server_beta2, fed.server_tau, momentum=fed.effective_server_momentum,
                                              nesterov=fed.effective_server_nesterov),
                              DownlinkSender(fed.downlink_codec, fed.seed))
        self.base_check = BaseCheck(manifest)  # the task's manifest: sites with another base are refused
        self.wire_copy = WireCopy(self.spec)  # the dense model down: bf16 tensors as their words
        self.bundle, self.replay = bundle, ReplayGuard()  # one guard per run: a (run, round, site) envelope opens once
        self.protocol: Strategy = PlainRound(fed, bundle, self.replay, spill_dir=self.workdir / "spill")
        self.secagg = None
        if fed.secagg.enabled:
            from federation.coordinator.secagg_round import SecAggRound

            self.protocol = self.secagg = SecAggRound(fed, bundle, self.replay, spill_dir=self.workdir / "spill")
        self.evaluation = Evaluation(fed.deadlines.evaluate_s)
        self.bulk = BulkPath(bulk, self.progress, fed.data_path.inline_max_bytes, fed.data_path.streams) if bulk else None
        self.superlink = RetryingGrid(grid, fed.deadlines.superlink_retry_s, self.progress) if grid is not None else None
        names = (lambda n: self.roster.site_name(n)), (lambda n: self.roster.known_name(n))
        beneath = BulkGrid(self.superlink, self.bulk, *names) if self.bulk and self.superlink else self.superlink
        self.messaging = MessageExchange(beneath, self.downlink, *names, self._reject)
        self.roster = Roster(cfg, self.messaging, self.progress, self._admit_base, self.discovery_request)
        self.roster.on_enrol.append(self._enrolled)
        self.site_name, self.known_name, self.node_of = self.roster.site_name, self.roster.known_name, self.roster.node_of
        self.links = LinkBook(fed.link, self.progress) if fed.probing else None  # link_book.py
        self.planner = RoundPlanner(cfg, self.progress) if fed.round_target_s is not None else None
        self.messages_out = RoundMessages(cfg, run_id, self.roster, lambda: self.state, self.wire_copy, self.bulk,
                                          self.planner)
        self.admission: Admission | None = None
        if fed.attestation.enabled:
            if bundle is None:
                raise FederationFailed("federation.attestation needs the coordinator's provisioned bundle (its "
                                       "sealing key is what its evidence binds, the registry holds the sites' keys)")
            self.admission = Admission(fed.attestation.coordinator, bundle, self.round_horizon_s())
        self.hooks = hooks_for(self.roster, self.messaging, self.progress, run_id, fed.rounds, fed.deadlines,
                               lambda: self.state, lambda: self.round_horizon_s(), lambda: getattr(
                                   self.protocol, "messages", 1) * self.message_overhead_s, self.bulk,
                               self.admission, self.secagg, self.links, self.planner, fed.evaluate)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log = RunLog(self.workdir, cfg, run_id, lambda: self.state, self.progress)  # checkpoints, metrics.jsonl
        self.metrics_path, self.checkpoints, self.checkpoint_writer = (self.log.metrics_path, self.log.checkpoints,
                                                                       self.log.writer)
        observers, self.tracking = run_observers(cfg, self.workdir, bundle, self.roster, run_id, lambda: self.state,
                                                 self.messages_out.codec, self.log, self.progress)  # audit, trackers
        self.hooks += observers
        self.message_overhead_s = 0.0  # a message's seconds outside its handler, measured at discovery

    # ---- the parts' callbacks --------------------------------------------------------------------
    def progress(self, line: str) -> None:
        """A line for the operator (progress.log and stdout under the ServerApp)."""
        self._progress(line)

    def _reject(self, reason: str) -> None:
        self.state.rejections[reason] += 1

    def _admit_base(self, site: str, status: ConfigRecord) -> bool:
        return self.base_check.admit(site, status, self.state.rejections, self.progress)

    def _enrolled(self, node: int, site: str, status: ConfigRecord) -> None:
        for hook in self.hooks:  # the data path first, then the downlink, learn what the site said
            hook.enrolled(node, site, status)
        self.downlink.enrolled(node, site, status, self.progress)

    def discovery_request(self) -> dict:
        """The discovery query's records: whether the run is SecAgg+, the downlink's target, the hooks'."""
        discover = ConfigRecord({"secagg": self.secagg is not None, **self.downlink_target()})
        return {keys.DISCOVER: discover, **{k: v for h in self.hooks for k, v in h.discovery_records().items()}}

    def downlink_target(self) -> dict:
        """The downlink's target for the discovery query (DownlinkSender.target)."""
        return self.downlink.target(self.model)

    def messages_per_site(self) -> dict[str, int]:
        """Messages sent to each site so far (discovery included): every one is a round trip."""
        return {self.site_name(n): c for n, c in sorted(self.messaging.messages.items())}

    def _part_metrics(self, rnd: int, line: dict) -> None:
        for hook in self.hooks:
            hook.metrics(rnd, line)
        if self.superlink is not None and self.superlink.retries:
            line["superlink_retries"] = dict(self.superlink.retries)

    def round_horizon_s(self) -> float:
        """The latest an update of this round can arrive, every stage at its deadline."""
        d = self.fed.deadlines
        return d.round_s + (d.secagg_stage_s if self.fed.secagg.enabled else 0.0)

    def model_message(self, rnd: int, deadline_s: float, evaluate: bool = False) -> Callable[[int], RecordDict]:
        """The global model message of a stage (round_messages.py)."""
        return self.messages_out.model_message(rnd, deadline_s, evaluate)

    def exchange(self, ex: Exchange, receive: Callable | None = None, workers: int = 1) -> ExchangeResult:
        """One stage's messages out and replies back (exchange.py)."""
        return self.messaging.exchange(ex, receive, workers)

    def run_strategy(self, strategy: Strategy, state: object) -> tuple[object, Traffic]:
        """Run a strategy's stages through the exchange; the previous round's checkpoint is settled
        before each stage's aggregate (the model and the optimizer's state change after it)."""
        return self.messaging.run(strategy, state, self.fed.receive_workers, lambda: self.wait_for_checkpoint(),
                                  lambda: [h.after_stage() for h in self.hooks])

    def admit(self, rnd: int, nodes: list[int]) -> AdmissionOutcome:
        """Round `rnd` starts: the nodes whose evidence our appraisal holds (admission.py)."""
        return next(h for h in self.hooks if isinstance(h, AdmissionHook)).verdict(rnd, nodes)

    # ---- before a round -------------------------------------------------------------------------
    def wait_for_sites(self) -> None:
        """Wait for the configured sites to connect and say who they are (`deadlines.connect_s`, plus
        `sites_starting_s` when the launcher starts the sites alongside the coordinator). What round 1
        needs rides on this discovery query (the hooks' discovery riders)."""
        first = set(sample(self.cfg, 1))
        found = self.roster.discover_all(self.fed.deadlines.connect_s + self.sites_starting_s, lambda nodes: [
            r for h in self.hooks for r in h.discovery_riders(nodes, first)])
        self.message_overhead_s = message_overhead_s(found.msg_cost)  # round 1's fixed cost, per message
        for hook in self.hooks:
            hook.discovered()
        if len(self.sites) < self.fed.quorum:
            raise FederationFailed(
                f"only {len(self.sites)} site(s) ready ({sorted(s.name for s in self.sites.values())}) "
                f"within {self.fed.deadlines.connect_s:.0f}s; quorum is {self.fed.quorum}{self.base_check.summary()}"
            )
        self.progress("sites: " + ", ".join(f"{s.name} ({s.num_examples} examples)" for s in self.sites.values()))

    def prepare(self, rnd: int, nodes: list[int]) -> ExchangeResult | None:
        """Before round `rnd`: what it needs of `nodes` that nothing carried ahead (round_hooks.prepare_round)."""
        return prepare_round(self.hooks, self.messaging, rnd, nodes, float(self.fed.deadlines.secagg_stage_s))

    # ---- a round --------------------------------------------------------------------------------
    def train_round(self, rnd: int) -> dict:
        """Sample, prepare and admit, run the round strategy (with what rides on it), apply the mean
        update and checkpoint; the round's metrics line (without downlink figures)."""
        t0 = time.monotonic()
        testing_hooks.stage_entered("round start", rnd=rnd)  # inert unless a test sets SOVFL_TEST_STAGE_HOOK
        names = sample(self.cfg, rnd)
        timing: dict = {"stages": []}
        for hook in self.hooks:
            hook.start_round(rnd)
        late = self.roster.discover_late(rnd)
        if late is not None:
            timing["stages"].append(stage_timing(f"discovery before round {rnd}", late))
        nodes = [n for n in (self.node_of(name) for name in names) if n is not None]
        self.messaging.await_side_queries(nodes)
        absent = {name: "not connected: no node answered discovery as this site" for name in names
                  if self.node_of(name) is None}
        prep = self.prepare(rnd, nodes)
        if prep is not None:
            timing["stages"].append(stage_timing(f"prepare round {rnd}", prep))
        for hook in self.hooks:
            nodes = hook.before_round(rnd, nodes, timing)
        upcoming = set(sample(self.cfg, rnd + 1)) if rnd < self.fed.rounds else set()
        self.riders = [r for h in self.hooks for r in h.riders(rnd, nodes, upcoming, t0)]
        inp = RoundInput(self.messages_out.context(rnd), nodes, self.sites, self.model, self.spec,
                         partial(self.model_message, rnd, evaluate=self.fed.evaluate), self.progress,
                         codec=self.messages_out.codec(rnd))
        try:
            out, traffic = self.run_strategy(self.protocol, self.protocol.begin(inp))
        finally:
            self.riders = []
            for hook in self.hooks:
                hook.stages_over()
        timing["stages"] += traffic.stages
        out.bytes_down, out.bytes_up = traffic.down, traffic.up
        out.failed.update(absent)
        self.rejections.update(out.rejections)
        for name, reason in out.failed.items():
            self.progress(f"round {rnd}: site {name} excluded: {reason}")
        out.failed.update(self.base_check.refused)
        for hook in self.hooks:
            hook.after_round(rnd, out, timing, self.rejections)
        return self.apply_round(rnd, out, len(names), t0, timing)

    def apply_round(self, rnd: int, out: RoundOutcome, sampled: int, t0: float, timing: dict) -> dict:
        """Apply round `rnd`'s mean update to the global model if the quorum holds (after the last
        round's checkpoint is written: it holds the model before the step); the round's metrics line."""
        line = metrics_line(rnd, out, sampled, self.rejections, sum(v.nbytes for v in self.model.values()),
                            partial(self._part_metrics, rnd))
        self.wait_for_checkpoint()  # the model and the optimizer's state change below
        if self.log.background:
            timing["checkpoint_wait_s"] = round(self.log.wait_s, 4)
        self.log.wait_s = 0.0
        if out.mean is not None and out.count >= self.fed.quorum:
            t1 = time.monotonic()
            self.model = self.opt.step(self.model, out.mean, consume=True, in_place=True)
            out.mean = None
            timing.update(optimizer_s=round(time.monotonic() - t1, 4))
            line["status"] = "aggregated"
            self.state.aggregated[rnd] = sorted(out.per_site)
        else:
            restore_model(self.model)  # a SecAgg+ round put it on disk for the step that is not taken
            line["status"] = "skipped"
            self.progress(f"round {rnd}: skipped, {out.count} usable update(s) < quorum {self.fed.quorum}; "
                          "the global model is unchanged")
        line["train_s"] = time.monotonic() - t0
        site_work = [s.get("train_call_s", 0.0) + s.get("evaluate_call_s", 0.0) for s in out.per_site.values()]
        timing["site_work_s"] = round(max(site_work, default=0.0), 4)  # the slowest site's trainer calls
        timing["relay_s"] = round(max((s.get("relay_s") or 0.0 for s in out.per_site.values()), default=0.0), 4)
        line["timing"] = timing
        return line

    def final_evaluation(self) -> dict:
        """Evaluate the run's final model on every site the hooks allow now: the `final_eval_*` figures."""
        nodes = [n for n in sorted(self.sites) if all(h.may_evaluate(self.site_name(n)) for h in self.hooks)]
        out, traffic = self.run_strategy(self.evaluation, self.evaluation.begin(
            nodes, partial(self.model_message, self.fed.rounds)))
        return {f"final_{k}": v for k, v in out.items()} | {"final_eval_stage": traffic.stages[0] if traffic.stages else {}}

    def run_round(self, rnd: int, write: bool = True) -> dict:
        """One whole round: train (the received model evaluated first), downlink figures; the metrics
        line, also checkpointed and appended to metrics.jsonl unless `write` is False."""
        t0 = time.monotonic()
        line = self.train_round(rnd)
        line["downlink"] = self.downlink.round_metrics()
        line["round_s"] = time.monotonic() - t0
        line["timing"]["round_s"] = round(line["round_s"], 4)
        line["timing"]["message_cost"] = message_cost.per_site(line["timing"].get("stages", []))
        line["messages"] = self.messages_per_site()
        if write:
            self.log.commit(rnd, line)  # its checkpoint, then its metrics line
        return line

    def wait_for_checkpoint(self) -> None:
        """Wait for the checkpoint being written in the background, if any (run_log.py)."""
        self.log.wait_for_write()

    # ---- the run ---------------------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict:
        """The whole run: discovery, every round (with `resume`, from the last checkpointed one, see
        resume.py), the final evaluation; the run's result (result.json). The trackers' runs end
        with it, whatever its end."""
        try:
            if resume:
                self.state = resume_run(self.state, self.checkpoints, self.cfg, self.spec, self.metrics_path,
                                        self.progress)
            self.wait_for_sites()
            self.log.background = True
            try:
                self._rounds()
            except BaseException:
                try:  # the checkpoint in flight is finished (the process would wait for its thread anyway)
                    self.checkpoint_writer.wait()
                except Exception as err:  # the run's own error is the one to raise
                    log.warning("the last checkpoint could not be written: %s", err)
                raise
            self.wait_for_checkpoint()  # every round's checkpoint and metrics line are on disk
            return run_result(self.history, self.fed.rounds, self.rejections, self.messages_per_site())
        finally:
            if self.tracking is not None:
                self.tracking.finish(self.model, self.checkpoints, self.history)

    def _rounds(self) -> None:
        """Every round from `start_round` on (the last one with the final evaluation)."""
        for rnd in range(self.state.start_round, self.fed.rounds + 1):
            last = rnd == self.fed.rounds
            line = self.run_round(rnd, write=not (last and self.fed.evaluate))
            if last and self.fed.evaluate:
                line.update(self.final_evaluation())
                line["final_eval_downlink"] = self.downlink.round_metrics()
                line["messages"] = self.messages_per_site()
                self.log.commit(rnd, line)  # its checkpoint, then its metrics line
            self.progress(round_summary(rnd, self.fed.rounds, line))
