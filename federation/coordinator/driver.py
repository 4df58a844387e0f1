"""The driver: runs the round strategies over Flower's Grid (Message API) and keeps the run.

The strategies (plain_round.py, secagg_round.py, evaluation.py) say what each stage sends and how
replies fold; riders (strategy.Rider: attested admission, the next SecAgg round's setup, the
evaluation of the received model) add their records to those messages. This module owns
everything else: pushing messages and pulling replies until each stage's deadline, naming the
sites that crash, err or miss it, counting bytes and rejections, timing every stage, applying the
server optimizer, checkpointing the global model after every round and writing one JSON line of
metrics per round. A round goes on with the sites that answered if the quorum holds; otherwise it
is skipped and the global model is left unchanged.

Messages per site and round: one train message, plus one unmask query under secure aggregation.
What the next round needs (attestation evidence, SecAgg setup) rides on them; a site the round
does not address but the next one samples gets a query of its own, which the round does not wait
for. Round 1's needs ride on site discovery. The run ends with one evaluate message per site (the
final model).

State that outlives a round, for a checkpoint (issue 13): the model, the server optimizer, the
downlink reference (`DownlinkSender`), the run-wide counters, Admission's verdicts and SecAggRound's
`PendingSetups`; their docstrings say what a resumed run (a new Flower run id) may restore.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from crypto.envelope import ReplayGuard
from crypto.pki import CoordinatorBundle
from federation.config.schema import ExperimentConfig
from federation.coordinator.admission import Admission, AdmissionOutcome
from federation.coordinator.bulk_path import BulkPath, ref_bytes
from federation.coordinator.bulk_server import BulkServer
from federation.coordinator.aggregate import ServerOptimizer
from federation.coordinator.checkpoint import CheckpointStore
from federation.coordinator.checkpoint_writer import CheckpointWriter
from federation.coordinator.downlink_sender import DownlinkSender
from federation.coordinator.evaluation import EvalAnnouncer, EvalRider, Evaluation
from federation.coordinator.link_book import LinkBook
from federation.coordinator.manifest_check import BaseCheck
from federation.coordinator.model_spill import restore_model
from federation.coordinator.plain_round import PlainRound
from federation.coordinator.polling import PollSchedule
from federation.coordinator.reply_folds import Folds
from federation.coordinator.resume import checkpoint_job, checkpoint_round, resume_run
from federation.coordinator.retry_grid import RetryingGrid
from federation.coordinator.round_planner import RoundPlanner, message_overhead_s
from federation.coordinator import stage_hook
from federation.coordinator.strategy import (
    Exchange,
    ExchangeResult,
    Reply,
    Rider,
    RoundInput,
    RoundOutcome,
    Site,
    Strategy,
)
from federation.protocol import message_cost
from federation.protocol import message_keys as keys
from federation.protocol.codecs import Arrays
from federation.protocol.bulk import BulkRefused
from federation.protocol.payload_records import record_bytes
from federation.protocol.pipeline import RoundContext
from federation.protocol.round_config import RoundConfig
from federation.protocol.status_record import StatusError, num_examples, site_name, step_s_estimate
from federation.protocol.update_codec import round_seed
from federation.protocol.wire_dtypes import WireCopy, to_master

__all__ = ["Coordinator", "FederationFailed", "Site"]

log = logging.getLogger("sovfl.coordinator")
O = TypeVar("O")
LATE_TRIES = 3  # discovery queries to a node that connected late and does not answer


class FederationFailed(RuntimeError):
    """The run cannot go on (too few sites); the message says why."""


@dataclass
class Traffic:
    """Array bytes a strategy's stages sent and received (good replies only), and their timings."""

    down: int = 0
    up: int = 0
    stages: list[dict] = field(default_factory=list)


def stage_timing(name: str, result: ExchangeResult, aggregate_s: float = 0.0) -> dict:
    """One stage's line in the metrics' `timing.stages`."""
    line = {"stage": name, "seconds": round(result.seconds, 4), "push_s": round(result.push_s, 4),
            "wait_s": round(result.wait_s, 4), "receive_s": round(result.receive_s, 4),
            "aggregate_s": round(aggregate_s, 4), "replies": len(result.by_node),
            "slowest_reply_s": round(max(result.by_node.values(), default=0.0), 4),
            "messages": result.msg_cost}
    if result.receive_spans:  # a streamed stage: each site's fold (start, end after the push began), their sum
        line["receive_busy_s"] = round(result.receive_busy_s, 4)
        line["receive_spans"] = {k: [round(a, 4), round(b, 4)] for k, (a, b) in sorted(result.receive_spans.items())}
    return line


class Coordinator:
    """The run on the coordinator: sites, global model, server optimizer, strategies and metrics."""

    def __init__(self, grid: Grid | None, cfg: ExperimentConfig, workdir: Path, run_id: int,
                 initial: Arrays, progress: Callable[[str], None] | None = None,
                 bundle: CoordinatorBundle | None = None, manifest: dict | None = None,
                 sites_starting_s: float = 0.0, bulk: BulkServer | None = None):
        self.cfg, self.workdir, self.run_id = cfg, Path(workdir), run_id
        # every call to the SuperLink is retried on its transient errors (retry_grid.py)
        self.grid = RetryingGrid(grid, cfg.federation.deadlines.superlink_retry_s, self.progress) if grid is not None else None
        self.sites_starting_s = sites_starting_s  # sites started alongside us (simulate): their start-up is allowed too
        self.fed = cfg.federation
        self.spec = {k: (v.dtype.str, tuple(v.shape)) for k, v in initial.items()}  # updates as they travel
        self.model = to_master(initial, self.spec)  # float32 where bf16 travels as raw words
        self.base_check = BaseCheck(manifest)  # the task's manifest: sites with another base are refused
        self.wire_copy = WireCopy(self.spec)  # the dense model down: bf16 tensors as their words
        self.opt = ServerOptimizer(self.fed.strategy, self.fed.update_kind, self.fed.effective_server_lr,
                                   self.fed.server_beta1, self.fed.server_beta2, self.fed.server_tau,
                                   momentum=self.fed.effective_server_momentum,
                                   nesterov=self.fed.effective_server_nesterov)
        self.bundle = bundle
        self.replay = ReplayGuard()  # one per run: a (run, round, site) envelope opens once
        self.protocol: Strategy = PlainRound(self.fed, bundle, self.replay, spill_dir=self.workdir / "spill")
        self.secagg = None
        if self.fed.secagg.enabled:
            from federation.coordinator.secagg_round import SecAggRound

            self.protocol = self.secagg = SecAggRound(self.fed, bundle, self.replay, spill_dir=self.workdir / "spill")
        self.admission: Admission | None = None
        if self.fed.attestation.enabled:
            if bundle is None:
                raise FederationFailed("federation.attestation needs the coordinator's provisioned bundle (its "
                                       "sealing key is what its evidence binds, the registry holds the sites' keys)")
            self.admission = Admission(self.fed.attestation.coordinator, bundle, self.round_horizon_s())
        self.evaluation = Evaluation(self.fed.deadlines.evaluate_s)
        self.aggregated: dict[int, list[str]] = {}  # round -> the sites whose updates it aggregated
        self.sites: dict[int, Site] = {}
        self.discovered: set[int] = set()  # nodes that answered a discovery (not asked again)
        self.late_tries: Counter[int] = Counter()  # discovery queries to nodes that connected late
        self.claims: dict[int, tuple[str, ConfigRecord]] = {}  # node -> a site another online node holds
        self.channel_keys: dict[str, bytes] = {}  # site -> SecAgg channel key told at discovery (no bundle)
        self.rejections: Counter[str] = Counter()
        self.downlink = DownlinkSender(self.fed.downlink_codec, self.fed.seed)
        self._progress = progress or (lambda line: log.info(line))
        self.bulk = (BulkPath(bulk, self.progress, self.fed.data_path.inline_max_bytes, self.fed.data_path.streams)
                     if bulk is not None else None)  # the data path beside Flower
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.workdir / "metrics.jsonl"
        self.riders: list[Rider] = []  # riding on every message sent now
        # the round's evaluation of the model it received, said as soon as it is known (evaluation.py)
        self._evals: tuple[EvalAnnouncer, EvalRider] | None = None
        if bulk is not None:
            bulk.on_report = self.early_evaluation
        # rider-only messages in flight: id -> (node, riders, the monotonic time its deadline passes)
        self._side: dict[str, tuple[int, list[Rider], float]] = {}
        self.messages: Counter[int] = Counter()  # messages sent per node over the run (round trips)
        self.checkpoints = CheckpointStore(self.workdir / "checkpoints", self.fed.checkpoint_keep, self.progress)
        # `run` writes each round's checkpoint on a thread while the next round goes on (checkpoint_writer.py);
        # a round run on its own (`run_round`: tools, tests) writes it before returning, as before
        self.checkpoint_writer = CheckpointWriter()
        self.background_checkpoints = False
        self._checkpoint_wait_s = 0.0  # this round's waits for the previous round's checkpoint
        self.history: list[dict] = []  # the metrics lines of the rounds done (restored by a resume)
        # the link probe and the per-round choice of codec and local steps (link_book.py, round_planner.py)
        self.links = LinkBook(self.fed.link, self.progress) if self.fed.probing else None
        self.planner = RoundPlanner(cfg, self.progress) if self.fed.round_target_s is not None else None
        self.message_overhead_s = 0.0  # a message's seconds outside its handler, measured at discovery
        self.start_round = 1

    def early_evaluation(self, site: str, rnd: int, figures: dict[str, float]) -> None:
        """A site's evaluation of round `rnd`'s model ahead of its reply (on a bulk server thread)."""
        evals = self._evals
        if evals is not None:
            evals[0].report(site, rnd, figures)

    def progress(self, line: str) -> None:
        """A line for the operator (progress.log and stdout under the ServerApp)."""
        self._progress(line)

    def site_name(self, node: int) -> str:
        """The name a node gave at discovery (node-<id> for one that never did)."""
        site = self.sites.get(node)
        return site.name if site else f"node-{node}"

    def known_name(self, node: int) -> str | None:
        """The name a node gave at discovery, None before."""
        site = self.sites.get(node)
        return site.name if site else None

    def messages_per_site(self) -> dict[str, int]:
        """Messages sent to each site so far (discovery included): every one is a round trip."""
        return {self.site_name(n): c for n, c in sorted(self.messages.items())}

    def node_of(self, name: str) -> int | None:
        """The node that answered discovery as `name`."""
        return next((n for n, s in self.sites.items() if s.name == name), None)

    # ---- messaging -------------------------------------------------------------------------------
    def _message(self, node: int, rd: RecordDict, message_type: str, deadline_s: float,
                 riders: list[Rider]) -> tuple[Message, list[Rider]]:
        """The message to `node` with the riders' records, and the riders that are to see its reply
        (those that added records, and those that see every reply)."""
        seen = []
        for rider in riders:
            recs = rider.records(node)
            for key, rec in recs.items():
                rd[key] = rec
            if recs or getattr(rider, "sees_every_reply", False):
                seen.append(rider)
        if self.bulk is not None:
            rd = self.bulk.outgoing(self.known_name(node), rd)
        self.messages[node] += 1
        return Message(rd, dst_node_id=node, message_type=message_type,
                       ttl=deadline_s + message_cost.TTL_MARGIN_S), seen

    def exchange(self, ex: Exchange, receive: Callable[[Reply], None] | None = None,
                 workers: int = 1) -> ExchangeResult:
        """Push one message per node (with the riders' records) and collect replies until all
        answered or the deadline; riders' own messages go out too but are not waited for.

        With `receive`, each good reply is handed over as soon as it is pulled and not kept
        (replies are pulled one at a time), so a stage of large replies holds at most `workers`
        of them: with more than one, `receive` runs on that many threads while the driver goes on
        pulling (reply_folds.py); without `receive`, the good replies come back in the result."""
        result, t0 = ExchangeResult(), time.monotonic()
        riders = list(self.riders)
        built = [self._message(node, ex.content(node), ex.message_type, ex.deadline_s, riders) for node in ex.nodes]
        n_main = len(built)
        side = [n for n in dict.fromkeys(n for r in riders for n in r.wanted()) if n not in set(ex.nodes)]
        built += [self._message(n, RecordDict({keys.CONFIG: ConfigRecord({})}), "query", ex.deadline_s, riders)
                  for n in side]
        for m, _ in built:
            result.bytes_down += record_bytes(m.content) + ref_bytes(m.content)
        names = {m.metadata.dst_node_id: self.site_name(m.metadata.dst_node_id) for m, _ in built}
        pending: dict[str, tuple[int, list[Rider]]] = {}
        pushed = time.time()  # wall clock (the sites stamp replies on theirs): a site may start before the push ends
        ids = list(self.grid.push_messages([m for m, _ in built])) if built else []
        for i, (mid, (m, seen)) in enumerate(zip(ids, built)):
            node = m.metadata.dst_node_id
            if not mid:
                for rider in seen:
                    rider.take(node, None)
                if i < n_main:
                    result.failed[names[node]] = "push_failed: the SuperLink did not accept the message"
            elif i < n_main:
                pending[mid] = (node, seen)
            else:
                self._side[mid] = (node, seen, t0 + ex.deadline_s)
        del built
        self.downlink.forget_stage()  # pushed: the serialized model lives on in the SuperLink or the data path's file
        result.push_s = time.monotonic() - t0
        end = time.monotonic() + ex.deadline_s
        poll = PollSchedule()  # (polling.py: how often a wait asks the SuperLink)
        folds = Folds(receive, workers, t0, result) if receive else None
        try:
            while pending and time.monotonic() < end:
                self._pull_side()
                batches = [[mid] for mid in pending] if receive else [list(pending)]
                for batch in batches:
                    if folds is not None and not folds.room():
                        break  # every worker holds a reply: the others wait on the SuperLink until one is done
                    for reply in self.grid.pull_messages(batch):
                        entry = pending.pop(reply.metadata.reply_to_message_id, None)
                        if entry is None:
                            continue
                        node, seen = entry
                        result.by_node[node] = time.monotonic() - t0
                        if reply.has_content():
                            result.msg_cost[names[node]] = message_cost.split(reply.content, pushed, time.time())
                        if not self._bulk_in(result, names[node], reply):
                            for rider in seen:
                                rider.take(node, None)
                            continue
                        for rider in seen:
                            rider.take(node, reply)
                        good = self._check_reply(result, names[node], node, reply)
                        if good is not None:
                            if folds is not None:
                                folds.submit(good)
                            else:
                                result.replies.append(good)
                        reply = good = None  # streamed: drop this reply before the next pull
                if pending:
                    wait_s = max(0.0, min(poll.next_wait(), end - time.monotonic()))
                    if folds is not None:
                        folds.wait(wait_s)  # woken early when a fold ends: its slot can take the next reply
                    else:
                        time.sleep(wait_s)
        except BaseException:
            if folds is not None:
                folds.close(raise_errors=False)  # no fold left running on the strategy's state
            raise
        if folds is not None:
            folds.close()  # every fold done before the stage's aggregate (a fold's error is raised here)
        self._pull_side()
        if self.bulk is not None:
            self.bulk.stage_over()
        for node, seen in pending.values():
            result.failed[names[node]] = f"deadline: no reply within {ex.deadline_s:.0f}s (crashed, hung or disconnected)"
            for rider in seen:
                rider.take(node, None)
        result.seconds = time.monotonic() - t0
        result.wait_s = max(0.0, result.seconds - result.push_s - result.receive_s)
        return result

    def _bulk_in(self, result: ExchangeResult, name: str, reply: Message) -> bool:
        """Resolve the data-path references of a reply (bulk_path.py); False, with the site's failure
        recorded and counted, if they are refused."""
        if self.bulk is None:
            return True
        try:
            self.bulk.incoming(name, reply)
            return True
        except BulkRefused as err:
            result.failed[name] = f"{err.reason}: {err.detail}"
            self.rejections[err.reason] += 1
            return False

    def _pull_side(self) -> bool:
        """Hand the riders' replies that arrived to them; whether any did."""
        if not self._side:
            return False
        got = False
        for reply in self.grid.pull_messages(list(self._side)):
            entry = self._side.pop(reply.metadata.reply_to_message_id, None)
            if entry is not None:
                got = True
                node, riders, _ = entry
                for rider in riders:
                    rider.take(node, reply)
        return got

    def drain(self) -> None:
        """End the riders of the last round: take what arrived of their own messages, give up on the
        rest (a round never waits for a site it does not address)."""
        self._pull_side()
        for node, riders, _ in self._side.values():
            for rider in riders:
                rider.take(node, None)
        self._side.clear()

    def settle(self, nodes: list[int]) -> None:
        """Before a round: wait for what the last round asked `nodes` on the side (a site that missed
        a stage was sent a query for this round's setup) until each answers or its own deadline
        passes, then `drain`. Giving up sooner would make a slow but live site sit this round out
        only because the last round's final stage was quicker than its ClientApp; a dead site costs
        at most what is left of its query's deadline."""
        mine = set(nodes)
        poll = PollSchedule()
        while True:
            ends = [end for node, _, end in self._side.values() if node in mine]
            left = max(ends) - time.monotonic() if ends else 0.0
            if left <= 0:
                break
            if not self._pull_side():
                time.sleep(max(0.0, min(poll.next_wait(), left)))
        self.drain()

    def _check_reply(self, result: ExchangeResult, name: str, node: int, reply: Message) -> Reply | None:
        """A good reply, or None with the site's failure recorded in `result`."""
        if reply.has_error():
            reason = str(reply.error.reason)
            result.failed[name] = (f"deadline: the message expired before the site answered ({reason})"
                                   if "TTL" in reason else f"client_error: {reason}")
            return None
        status = reply.content.config_records.get(keys.STATUS)
        if status is None or not status.get("ok", False):
            result.failed[name] = f"site_error: {status.get('error') if status else 'no status in reply'}"
            return None
        self.downlink.heard(node, status)
        result.bytes_up += record_bytes(reply.content)
        return Reply(name, node, reply)

    def drive(self, strategy: Strategy[object, O], state: object) -> tuple[O, Traffic]:
        """Run a strategy's steps over the Grid, then its `finish` (or `abort`)."""
        traffic = Traffic()
        try:
            for step in strategy.steps():
                ex = step.configure(state)
                if ex is None:
                    continue
                stage_hook.entered(ex.stage, state)  # test hook: inert unless SOVFL_TEST_STAGE_HOOK is set
                result = self.exchange(ex, partial(step.receive, state) if step.receive else None,
                                       self.fed.receive_workers if step.concurrent else 1)
                traffic.down += result.bytes_down
                traffic.up += result.bytes_up
                self.settle_checkpoint()  # the previous round's, before anything is aggregated
                t0 = time.monotonic()
                step.aggregate(state, result)
                if self.bulk is not None:  # the stage's uploads are folded in: their files go
                    self.bulk.server.release_all()
                traffic.stages.append(stage_timing(ex.stage, result, time.monotonic() - t0))
                if self._evals is not None:  # the train replies' figures, unless the sites said them earlier
                    self._evals[0].replies(self._evals[1].totals)
            stage_hook.entered("aggregate", state)
            t0 = time.monotonic()
            out = strategy.finish(state)
            took = round(time.monotonic() - t0, 4)  # the strategy's own work (decode, unmask): aggregation
            traffic.stages.append({"stage": "finish", "seconds": took, "push_s": 0.0, "wait_s": 0.0, "receive_s": 0.0,
                                   "aggregate_s": took, "replies": 0, "slowest_reply_s": 0.0})
            return out, traffic
        except strategy.aborts as err:
            return strategy.abort(state, err), traffic

    # ---- what the strategies are given -----------------------------------------------------------
    def round_context(self, rnd: int) -> RoundContext:
        """The round's identity, for the coordinator's side of the pipeline."""
        return RoundContext(self.fed.name, self.run_id, rnd, "", self.round_seed(rnd))

    def round_config(self, rnd: int, deadline_s: float, evaluate: bool = False) -> RoundConfig:
        """The CONFIG record of a stage's messages."""
        choice = self.planner.choices.get(rnd) if self.planner is not None else None
        return RoundConfig(round=rnd, federation=self.fed.name, update_kind=self.fed.update_kind,
                           seed=self.round_seed(rnd), codec=self.round_codec(rnd), error_feedback=self.fed.error_feedback,
                           seal=self.fed.seal, evaluate=evaluate, overlap=self.fed.overlap,
                           overlap_max_steps_factor=self.fed.overlap_max_steps_factor,
                           local_steps=choice.local_steps if choice else None,
                           # the site must answer before our deadline, ClientApp start-up (a few seconds) included
                           deadline_s=max(1.0, deadline_s * 0.8 - 2.0))

    def round_codec(self, rnd: int) -> str:
        """The update codec of round `rnd`: round_target_s's choice, else `federation.codec`."""
        choice = self.planner.choices.get(rnd) if self.planner is not None else None
        return choice.codec if choice is not None else self.fed.codec

    def aggregated_rounds(self, rnd: int) -> dict[str, int]:
        """site -> the newest round before `rnd` whose update from it is in the global model (0:
        none); a resume restores `aggregated` from the checkpoint's history."""
        last = {s.id: 0 for s in self.cfg.sites}
        for r, sites in self.aggregated.items():
            for site in sites:
                if site in last and r < rnd:
                    last[site] = max(last[site], r)
        return last

    def model_message(self, rnd: int, deadline_s: float, evaluate: bool = False) -> Callable[[int], RecordDict]:
        """The global model (with a downlink codec: the encoded steps from the model each site holds,
        coordinator/downlink_sender.py) and the round config, serialized once per stage and content
        and shared by the messages. `evaluate`: sites evaluate it before training on it."""
        down = self.model if self.downlink.codec is not None else self.wire_copy.of(self.model)
        bulk = self.bulk

        def offer(node: int):  # a site on the data path: the model written to its offer file tensor by tensor
            return bulk.offer_arrays if bulk is not None and bulk.direct(self.known_name(node)) else None
        records = self.downlink.stage(down, self.site_name, offer)
        config, last = self.round_config(rnd, deadline_s, evaluate), self.aggregated_rounds(rnd)

        def message(node: int) -> RecordDict:  # each site's config names only its own last aggregated round
            name = self.known_name(node)
            own = config.model_copy(update={"aggregated": [f"{name}:{last.get(name, 0)}"]}) if name else config
            return RecordDict({**records(node), keys.CONFIG: own.to_record()})
        return message

    def round_seed(self, rnd: int) -> int:
        """The public seed of round `rnd` (shared-seed codecs)."""
        return round_seed(self.fed.seed, rnd)

    def round_horizon_s(self) -> float:
        """The latest an update of this round can arrive, every stage at its deadline."""
        d = self.fed.deadlines
        return d.round_s + (d.secagg_stage_s if self.fed.secagg.enabled else 0.0)

    # ---- what rides on a round's messages --------------------------------------------------------
    def candidates(self) -> list[int]:
        """The nodes a rider may address: every site discovered."""
        return sorted(self.sites)

    def riders_for(self, rnd: int, evaluate: EvalRider | None = None) -> list[Rider]:
        """What rides on round `rnd`'s messages: the evaluation of the received model, our answers to
        the sites' attestation nonces and what round `rnd + 1` needs (its sites' evidence, their
        SecAgg setups)."""
        nxt = rnd + 1 if rnd < self.fed.rounds else None
        riders: list[Rider] = [evaluate] if evaluate is not None else []
        upcoming = set(self.sample(nxt)) if nxt is not None else set()
        if self.admission is not None:
            adm, within = self.admission, 2 * self.round_horizon_s()
            riders.append(adm.rider(rnd, nxt, lambda node, name: name is not None and name in upcoming
                                    and adm.due(name, within), self.known_name, self.candidates))
        if self.secagg is not None and nxt is not None:
            self.secagg.plan(nxt, self.run_id, upcoming, self.secagg_channel_keys())
            riders.append(self.secagg.setup_rider(nxt, self.known_name, self.candidates))
        return riders

    def secagg_channel_keys(self) -> dict[str, bytes]:
        """site -> the SecAgg channel key plans name: the registry's, else what discovery told."""
        return self.secagg.registered_channel_keys() or dict(self.channel_keys)

    def prepare(self, rnd: int, nodes: list[int]) -> ExchangeResult | None:
        """Before round `rnd`: a query to each of `nodes` that was never asked for what the round
        needs (evidence, SecAgg setup), answered before the round starts. Only when nothing could
        ride ahead: round 1 without a bundle (channel keys come from discovery), or a round run on
        its own (tests). A site that was asked and did not answer sits the round out instead."""
        riders: list[Rider] = []
        if self.secagg is not None:
            setups = self.secagg.pending.rounds.get(rnd)
            if setups is None:
                setups = self.secagg.plan(rnd, self.run_id, [self.site_name(n) for n in nodes],
                                          self.secagg_channel_keys())
            todo = [n for n in nodes if n not in setups.asked]
            rider = self.secagg.setup_rider(rnd, self.known_name, lambda: todo)
            if rider.wanted():
                riders.append(rider)
        if self.admission is not None:
            asked = self.admission.round(rnd).asked
            fresh = {n for n in nodes if n not in asked and self.admission.due(self.site_name(n), self.round_horizon_s())}
            if fresh:
                riders.append(self.admission.rider(rnd - 1, rnd, lambda node, name: node in fresh, self.known_name,
                                                   lambda: sorted(fresh)))
        if not riders:
            return None
        t0 = time.monotonic()
        saved, self.riders = self.riders, riders
        try:
            res = self.exchange(Exchange(f"prepare round {rnd}", "query", [], lambda n: RecordDict(),
                                         float(self.fed.deadlines.secagg_stage_s)))
            deadline, poll = time.monotonic() + float(self.fed.deadlines.secagg_stage_s), PollSchedule()
            while self._side and time.monotonic() < deadline:  # here the round does wait for them
                if not self._pull_side():
                    time.sleep(max(0.0, min(poll.next_wait(), deadline - time.monotonic())))
            self.drain()
        finally:
            self.riders = saved
        res.seconds = time.monotonic() - t0
        res.wait_s = res.seconds - res.push_s
        return res

    # ---- stages of the run -----------------------------------------------------------------------
    def wait_for_sites(self) -> None:
        """Wait for the configured sites to connect and say who they are (`deadlines.connect_s`, plus
        `sites_starting_s` when the launcher starts the sites alongside the coordinator). What round 1 needs rides on this discovery query: attestation nonces, and the SecAgg plan
        when the registry already holds every site's channel key."""
        want = len(self.cfg.sites)
        end = time.monotonic() + self.fed.deadlines.connect_s + self.sites_starting_s
        nodes: list[int] = []
        while time.monotonic() < end:
            nodes = list(self.grid.get_node_ids())
            if len(nodes) >= want:
                break
            time.sleep(0.5)
        self.progress(f"{len(nodes)}/{want} site(s) connected")
        riders: list[Rider] = []
        first = set(self.sample(1))
        if self.admission is not None:
            adm = self.admission
            riders.append(adm.rider(0, 1, lambda node, name: name is None or name in first, self.known_name,
                                    lambda: nodes))
        if self.secagg is not None and self.secagg.registered_channel_keys():
            self.secagg.plan(1, self.run_id, first, self.secagg.registered_channel_keys())
            riders.append(self.secagg.setup_rider(1, self.known_name, lambda: nodes))
        found = self.discovery(nodes, riders, self.fed.deadlines.connect_s, "discovery")
        self.enrol(found)
        self.message_overhead_s = message_overhead_s(found.msg_cost)  # round 1's fixed cost, per message
        self.probe_flower(sorted(self.sites), 0)
        if len(self.sites) < self.fed.quorum:
            raise FederationFailed(
                f"only {len(self.sites)} site(s) ready ({sorted(s.name for s in self.sites.values())}) "
                f"within {self.fed.deadlines.connect_s:.0f}s; quorum is {self.fed.quorum}{self.base_check.summary()}"
            )
        self.progress("sites: " + ", ".join(f"{s.name} ({s.num_examples} examples)" for s in self.sites.values()))

    def discovery(self, nodes: list[int], riders: list[Rider], deadline_s: float, stage: str) -> ExchangeResult:
        """Ask `nodes` who they are (site name, examples, base manifest, channel key), `riders` aboard."""
        discover = ConfigRecord({"secagg": self.secagg is not None, **self.downlink_target()})
        probe = {keys.PROBE: self.links.request(0)} if self.links is not None else {}  # sites on the data path measure
        self.riders = riders
        try:
            return self.exchange(Exchange(stage, "query", nodes, lambda n: RecordDict(
                {keys.CONFIG: ConfigRecord({}), keys.DISCOVER: discover, **probe}), deadline_s))
        finally:
            self.riders = []

    def downlink_target(self) -> dict:
        """With a downlink codec, the digest of the model the next message sends (DOWNLINK_TARGET):
        a site that already holds it says so at discovery and is not sent it (site/downlink_mod.py)."""
        if self.downlink.codec is None:
            return {}
        self.downlink.update(self.model)  # the reference follows the model (one step per new model)
        return {keys.DOWNLINK_TARGET: self.downlink.digest} if self.downlink.digest else {}

    def enrol(self, res: ExchangeResult, online: set[int] | None = None) -> None:
        """Take the sites that answered a discovery (`claim`), `online` the nodes the SuperLink lists now."""
        for reply in res.replies:
            node = reply.message.metadata.src_node_id
            self.claim(node, reply.status, online)
            if self.links is not None and self.known_name(node) is not None:
                self.links.heard(self.site_name(node), reply.status)
        for name, reason in res.failed.items():
            self.progress(f"site discovery: {name} failed: {reason}")

    def claim(self, node: int, status: ConfigRecord, online: set[int] | None) -> None:
        """`node` says it is the site in `status`. A site name held by another node that is still
        `online` (None: always, the first discovery) stays with that node and the claim is kept: it is
        taken once that node is gone, which is how a SuperNode restarted under a new node id (no
        provisioned key) gets its site back without being asked again."""
        self.discovered.add(node)
        try:
            site, examples = site_name(status), num_examples(status)
        except StatusError as err:
            self.progress(f"ignoring node {node}: its discovery reply is malformed ({err.detail})")
            return
        if site not in {s.id for s in self.cfg.sites}:
            self.progress(f"ignoring node {node}: site '{site}' is not in the configuration")
            return
        old = self.node_of(site)
        if old is not None and (online is None or old in online):
            if node not in self.claims:
                self.progress(f"ignoring node {node}: site '{site}' already answered from node {old} "
                              "(taken over if that node goes offline)")
            self.claims[node] = (site, status)
            return
        self.claims.pop(node, None)
        if not self.base_check.admit(site, status, self.rejections, self.progress):
            return
        if old is not None:
            del self.sites[old]
            self.progress(f"site {site} is back as node {node} (its node {old} is offline)")
        self.sites[node] = Site(node, site, examples, step_s_estimate(status))
        if self.bulk is not None:
            self.bulk.heard(site, status)
        self.downlink.heard(node, status)
        if self.downlink.codec is not None and status.get(keys.MODEL_DIGEST) == self.downlink.digest:
            self.progress(f"site {site} already holds the global model ({self.downlink.digest}): its next message "
                          "does not carry it")
        pk = status.get("secagg_channel_pk")
        if isinstance(pk, bytes) and len(pk) == 32:
            self.channel_keys[site] = pk

    def probe_flower(self, nodes: list[int], rnd: int) -> list[dict]:
        """Measure, through Flower, the links of `nodes` that are not on the data path (link_book.py);
        the probe's stage timings."""
        if self.links is None:
            return []
        paths = self.bulk.paths if self.bulk is not None else {}
        todo = {n: self.site_name(n) for n in nodes if paths.get(self.site_name(n)) != "direct"}
        results = self.links.probe_flower(self.exchange, todo, rnd, min(self.fed.deadlines.connect_s,
                                                                         self.fed.deadlines.round_s))
        return [stage_timing(f"link probe through Flower before round {rnd}", r) for r in results]

    def probe_links(self, rnd: int, nodes: list[int]) -> list[dict]:
        """Before round `rnd` (`link.probe_every`): the sites of `nodes` measure their links again
        (those on the data path themselves, the others through Flower); the stage timings."""
        assert self.links is not None
        paths = self.bulk.paths if self.bulk is not None else {}
        direct = [n for n in nodes if paths.get(self.site_name(n)) == "direct"]
        stages = []
        if direct:
            rec = self.links.request(rnd)
            res = self.exchange(Exchange(f"link probe before round {rnd}", "query", direct, lambda n: RecordDict(
                {keys.CONFIG: ConfigRecord({}), keys.PROBE: rec}), self.fed.deadlines.round_s))
            for reply in res.replies:
                self.links.heard(reply.name, reply.status)
            for name, reason in res.failed.items():
                self.progress(f"round {rnd}: link probe of site {name} failed: {reason}")
            stages.append(stage_timing(f"link probe before round {rnd}", res))
        return stages + self.probe_flower([n for n in nodes if n not in direct], rnd)

    def discover_late(self, rnd: int) -> ExchangeResult | None:
        """Before round `rnd`: nodes that connected since discovery (a site started late, or a
        SuperNode restarted under a new node id) are asked who they are and join from this round
        (`prepare` asks their SecAgg setup and evidence); a kept claim on a site whose node has
        gone offline is taken. A node is asked until it answers, at most LATE_TRIES times."""
        if self.grid is None:
            return None
        online = set(self.grid.get_node_ids())
        for node, (site, status) in list(self.claims.items()):
            if node not in online:
                del self.claims[node]
            elif self.node_of(site) not in online:
                self.claim(node, status, online)
        new = sorted(n for n in online - set(self.sites) - self.discovered if self.late_tries[n] < LATE_TRIES)
        if not new:
            return None
        self.late_tries.update(new)
        self.progress(f"round {rnd}: {len(new)} node(s) connected since discovery; asking who they are")
        res = self.discovery(new, [], min(self.fed.deadlines.connect_s, self.fed.deadlines.round_s),
                             f"discovery before round {rnd}")
        self.enrol(res, online)
        return res

    def sample(self, rnd: int) -> list[str]:
        """The sites of round `rnd`: `sites_per_round` of the configured sites (all if unset), drawn
        from the federation seed and the round alone, so any round's sample is known ahead."""
        names = sorted(s.id for s in self.cfg.sites)
        k = min(self.fed.sites_per_round or len(names), len(names))
        rng = np.random.default_rng([self.fed.seed, rnd])
        return sorted(names[i] for i in rng.choice(len(names), size=k, replace=False).tolist())

    def admit(self, rnd: int, nodes: list[int]) -> AdmissionOutcome:
        """Round `rnd` starts: the nodes whose evidence our appraisal holds (admission.py)."""
        assert self.admission is not None
        return self.admission.verdict(rnd, nodes, {n: self.site_name(n) for n in nodes})

    def round_input(self, rnd: int, nodes: list[int]) -> RoundInput:
        """What the round strategy is given for round `rnd`."""
        return RoundInput(self.round_context(rnd), nodes, self.sites, self.model, self.spec,
                          partial(self.model_message, rnd, evaluate=self.fed.evaluate), self.progress,
                          codec=self.round_codec(rnd))

    def train_round(self, rnd: int) -> dict:
        """Sample, admit, run the round strategy (with what rides on it), apply the mean update and
        checkpoint; the round's metrics line (without downlink figures)."""
        t0 = time.monotonic()
        names = self.sample(rnd)
        timing: dict = {"stages": []}
        if self.bulk is not None:
            self.bulk.server.window(self.run_id, rnd)
        late = self.discover_late(rnd)
        if late is not None:
            timing["stages"].append(stage_timing(f"discovery before round {rnd}", late))
        nodes = [n for n in (self.node_of(name) for name in names) if n is not None]
        self.settle(nodes)
        absent = {name: "not connected: no node answered discovery as this site" for name in names
                  if self.node_of(name) is None}
        prep = self.prepare(rnd, nodes)
        if prep is not None:
            timing["stages"].append(stage_timing(f"prepare round {rnd}", prep))
        admission = None
        if self.admission is not None:
            admission = self.admit(rnd, nodes)
            nodes = admission.admitted
        if self.links is not None and self.links.due(rnd):
            timing["stages"] += self.probe_links(rnd, nodes)
        if self.planner is not None:
            self.planner.choose(rnd, [self.site_name(n) for n in nodes], self.links.figures if self.links else {},
                                self.history, sum(int(v.size) for v in self.model.values()),
                                sum(v.nbytes for v in self.model.values()),
                                {s.name: s.step_s_estimate for s in self.sites.values() if s.step_s_estimate},
                                first_fixed_s=getattr(self.protocol, "messages", 1) * self.message_overhead_s,
                                nothing_down=bool(nodes) and all(self.downlink.holds(n, self.model) for n in nodes))
        evals = EvalRider() if self.fed.evaluate else None
        self.riders = self.riders_for(rnd, evals)
        announcer = EvalAnnouncer(rnd, {self.site_name(n) for n in nodes}, self.progress, t0) if evals is not None else None
        self._evals = (announcer, evals) if announcer is not None and evals is not None else None
        try:
            out, traffic = self.drive(self.protocol, self.protocol.begin(self.round_input(rnd, nodes)))
        finally:
            self.riders, self._evals = [], None
        timing["stages"] += traffic.stages
        out.bytes_down, out.bytes_up = traffic.down, traffic.up
        out.failed.update(absent)
        self.rejections.update(out.rejections)
        if self.bulk is not None:
            self.rejections.update(self.bulk.server.take_refusals())  # streams refused before any reply named them
        for name, reason in out.failed.items():
            self.progress(f"round {rnd}: site {name} excluded: {reason}")
        out.failed.update(self.base_check.refused)
        if admission is not None:
            self.admission.refusals(rnd, admission)
            for name, reason in admission.excluded.items():
                self.rejections["attestation:" + admission.codes[name]] += 1
                self.progress(f"round {rnd}: site {name} NOT ADMITTED: {reason}")
            out.failed.update(admission.excluded)
            out.extra["attestation"] = admission.metrics()
        if evals is not None:
            out.extra.update(evals.totals.figures(), eval_model_round=rnd - 1)
            if announcer is not None and announcer.known_s is not None:
                timing["eval_known_s"] = announcer.known_s
        return self._apply(rnd, out, len(names), t0, timing)

    def _apply(self, rnd: int, out: RoundOutcome, sampled: int, t0: float, timing: dict) -> dict:
        line = {"round": rnd, "sites": out.per_site, "failed": out.failed, "sampled": sampled,
                "bytes_down": out.bytes_down, "bytes_up": out.bytes_up, "rejections": dict(self.rejections),
                **out.extra}
        if self.bulk is not None:  # which path each site's model and update took (bulk_path.py)
            line["data_path"] = dict(self.bulk.paths)
        if self.links is not None:  # each site's link as last measured (link_book.py)
            line["links"] = self.links.metrics()
        if self.planner is not None and rnd in self.planner.choices:  # round_target_s's choice and why
            line["round_plan"] = self.planner.choices[rnd].metrics()
        if isinstance(self.grid, RetryingGrid) and self.grid.retries:
            line["superlink_retries"] = dict(self.grid.retries)
        dense = sum(v.nbytes for v in self.model.values())
        if out.per_site:
            line["compression_ratio"] = dense * len(out.per_site) / max(
                1, sum(s.get("upload_bytes", dense) for s in out.per_site.values()))
        self.settle_checkpoint()  # the model and the optimizer's state change below
        if self.background_checkpoints:
            timing["checkpoint_wait_s"] = round(self._checkpoint_wait_s, 4)
        self._checkpoint_wait_s = 0.0
        if out.mean is not None and out.count >= self.fed.quorum:
            t1 = time.monotonic()
            self.model = self.opt.step(self.model, out.mean, consume=True, in_place=True)
            out.mean = None
            timing.update(optimizer_s=round(time.monotonic() - t1, 4))
            line["status"] = "aggregated"
            self.aggregated[rnd] = sorted(out.per_site)
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
        """Evaluate the run's final model on every site admitted now: the `final_eval_*` figures."""
        nodes = sorted(self.sites)
        if self.admission is not None:  # the model goes only to sites admitted now
            nodes = [n for n in nodes if self.admission.admitted(self.site_name(n))]
        out, traffic = self.drive(self.evaluation, self.evaluation.begin(
            nodes, partial(self.model_message, self.fed.rounds)))
        return {f"final_{k}": v for k, v in out.items()} | {"final_eval_stage": traffic.stages[0] if traffic.stages else {}}

    def run_round(self, rnd: int, write: bool = True) -> dict:
        """One whole round: train (the received model evaluated first), downlink figures; the metrics
        line, also appended to metrics.jsonl unless `write` is False."""
        t0 = time.monotonic()
        line = self.train_round(rnd)
        line["downlink"] = self.downlink.round_metrics()
        line["round_s"] = time.monotonic() - t0
        line["timing"]["round_s"] = round(line["round_s"], 4)
        line["timing"]["message_cost"] = message_cost.per_site(line["timing"].get("stages", []))
        line["messages"] = self.messages_per_site()
        if write:
            self.commit_line(rnd, line)
        return line

    def settle_checkpoint(self) -> None:
        """Wait for the checkpoint being written in the background, if any (its error is raised)."""
        self._checkpoint_wait_s += self.checkpoint_writer.wait()

    def commit_line(self, rnd: int, line: dict) -> None:
        """Checkpoint the round, then append its metrics line: a resume rewrites metrics.jsonl from
        the checkpoint's history, so a line is never written for a round that has no checkpoint.
        With `background_checkpoints` (`run`) both are written on a thread of their own from a
        snapshot taken here, and the next round goes on (checkpoint_writer.py): `round_s` then
        leaves the write out and `timing.checkpoint_s` is the write's own seconds."""
        self.history.append(line)
        stage_hook.entered("checkpoint", rnd=rnd)  # test hook: inert unless SOVFL_TEST_STAGE_HOOK is set
        self.settle_checkpoint()
        if self.background_checkpoints:
            write_checkpoint, record, path = checkpoint_job(self, rnd), json.loads(json.dumps(line)), self.metrics_path

            def write() -> None:
                t0 = time.monotonic()
                write_checkpoint()
                record["timing"]["checkpoint_s"] = round(time.monotonic() - t0, 4)
                with path.open("a") as f:
                    f.write(json.dumps(record) + "\n")

            self.checkpoint_writer.start(write, lambda _: line["timing"].update(
                checkpoint_s=record["timing"].get("checkpoint_s")))
            return
        t0 = time.monotonic()
        checkpoint_round(self, rnd)
        # known only after the write: the checkpoint's copy of this line lacks it (a resumed run's
        # metrics.jsonl shows that round without checkpoint_s and with round_s short by as much)
        spent = time.monotonic() - t0
        line["round_s"] += spent
        line["timing"].update(checkpoint_s=round(spent, 4), round_s=round(line["round_s"], 4))
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def run(self, resume: bool = False) -> dict:
        """The whole run: discovery, every round (with `resume`, from the last checkpointed one, see
        resume.py), the final evaluation; the run's result (result.json)."""
        if resume:
            resume_run(self)
        self.wait_for_sites()
        history = self.history
        self.background_checkpoints = True
        try:
            self._rounds()
        except BaseException:
            try:  # the checkpoint in flight is finished (the process would wait for its thread anyway)
                self.checkpoint_writer.wait()
            except Exception as err:  # the run's own error is the one to raise
                log.warning("the last checkpoint could not be written: %s", err)
            raise
        self.settle_checkpoint()  # every round's checkpoint and metrics line are on disk
        evals = [(h["eval_model_round"], h["eval_loss"]) for h in history if "eval_loss" in h]
        if history and "final_eval_loss" in history[-1]:
            evals.append((self.fed.rounds, history[-1]["final_eval_loss"]))
        trained = [loss for model_round, loss in evals if model_round >= 1]
        return {
            "status": "ok" if any(h["status"] == "aggregated" for h in history) else "failed",
            "rounds": len(history),
            "aggregated_rounds": sum(h["status"] == "aggregated" for h in history),
            # the global model evaluated after round 1, and after the last round
            "first_loss": trained[0] if trained else None,
            "last_loss": trained[-1] if trained else None,
            "rejections": dict(self.rejections),
            "messages_per_site": self.messages_per_site(),
        }

    def _rounds(self) -> None:
        """Every round from `start_round` on (the last one with the final evaluation)."""
        for rnd in range(self.start_round, self.fed.rounds + 1):
            last = rnd == self.fed.rounds
            line = self.run_round(rnd, write=not (last and self.fed.evaluate))
            if last and self.fed.evaluate:
                line.update(self.final_evaluation())
                line["final_eval_downlink"] = self.downlink.round_metrics()
                line["messages"] = self.messages_per_site()
                self.commit_line(rnd, line)
            losses = ", ".join(f"{k}={v['loss']:.4f}" for k, v in line["sites"].items())
            ev = (f" eval_loss={line['eval_loss']:.4f} (model of round {line['eval_model_round']})"
                  if "eval_loss" in line else "")
            acc = f" eval_acc={line['eval_accuracy']:.3f}" if "eval_accuracy" in line else ""
            fin = f" final_eval_loss={line['final_eval_loss']:.4f}" if "final_eval_loss" in line else ""
            self.progress(f"round {rnd}/{self.fed.rounds} {line['status']}: {len(line['sites'])} site(s) "
                          f"[{losses}]{ev}{acc}{fin} in {line['round_s']:.1f}s")
