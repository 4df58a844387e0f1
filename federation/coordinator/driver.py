"""The driver: runs the round strategies over Flower's Grid (Message API) and keeps the run.

The strategies (plain_round.py, secagg_round.py, admission.py, evaluation.py) say what each stage
sends and how replies fold; this module owns everything else: pushing messages and pulling replies
until each stage's deadline, naming the sites that crash, err or miss it, counting bytes and
rejections, applying the server optimizer, checkpointing the global model after every round and
writing one JSON line of metrics per round. A round goes on with the sites that answered if the
quorum holds; otherwise it is skipped and the global model is left unchanged.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
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
from federation.coordinator.aggregate import ServerOptimizer
from federation.coordinator.checkpoint import CheckpointStore
from federation.coordinator.downlink_sender import DownlinkSender
from federation.coordinator.evaluation import Evaluation
from federation.coordinator.plain_round import PlainRound
from federation.coordinator.resume import checkpoint_round, resume_run
from federation.coordinator.strategy import Exchange, ExchangeResult, Reply, RoundInput, RoundOutcome, Site, Strategy
from federation.protocol import message_keys as keys
from federation.protocol.codecs import Arrays
from federation.protocol.payload_records import record_bytes
from federation.protocol.pipeline import RoundContext
from federation.protocol.round_config import RoundConfig
from federation.protocol.update_codec import round_seed

__all__ = ["Coordinator", "FederationFailed", "Site"]

log = logging.getLogger("sovfl.coordinator")
POLL_S = 0.2
O = TypeVar("O")


class FederationFailed(RuntimeError):
    """The run cannot go on (too few sites); the message says why."""


@dataclass
class Traffic:
    """Array bytes a strategy's stages sent and received (good replies only)."""

    down: int = 0
    up: int = 0


class Coordinator:
    """The run on the coordinator: sites, global model, server optimizer, strategies and metrics."""

    def __init__(self, grid: Grid | None, cfg: ExperimentConfig, workdir: Path, run_id: int,
                 initial: Arrays, progress: Callable[[str], None] | None = None,
                 bundle: CoordinatorBundle | None = None):
        self.grid, self.cfg, self.workdir, self.run_id = grid, cfg, Path(workdir), run_id
        self.fed = cfg.federation
        self.model = initial
        self.spec = {k: (v.dtype.str, tuple(v.shape)) for k, v in initial.items()}
        self.opt = ServerOptimizer(self.fed.strategy, self.fed.update_kind, self.fed.effective_server_lr,
                                   self.fed.server_beta1, self.fed.server_beta2, self.fed.server_tau)
        self.bundle = bundle
        self.replay = ReplayGuard()  # one per run: a (run, round, site) envelope opens once
        self.protocol: Strategy = PlainRound(self.fed, bundle, self.replay)
        if self.fed.secagg.enabled:
            from federation.coordinator.secagg_round import SecAggRound

            self.protocol = SecAggRound(self.fed, bundle, self.replay)
        self.admission: Admission | None = None
        if self.fed.attestation.enabled:
            if bundle is None:
                raise FederationFailed("federation.attestation needs the coordinator's provisioned bundle (its "
                                       "sealing key is what its evidence binds, the registry holds the sites' keys)")
            self.admission = Admission(self.fed.attestation.coordinator, bundle, self.fed.attestation.stage_s)
        self.evaluation = Evaluation(self.fed.deadlines.evaluate_s)
        self.sites: dict[int, Site] = {}
        self.rejections: Counter[str] = Counter()
        self.downlink = DownlinkSender(self.fed.downlink_codec, self.fed.seed)
        self._progress = progress or (lambda line: log.info(line))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.workdir / "metrics.jsonl"
        self.checkpoints = CheckpointStore(self.workdir / "checkpoints", self.fed.checkpoint_keep, self.progress)
        self.history: list[dict] = []  # the metrics lines of the rounds done (restored by a resume)
        self.start_round = 1

    def progress(self, line: str) -> None:
        """A line for the operator (progress.log and stdout under the ServerApp)."""
        self._progress(line)

    def site_name(self, node: int) -> str:
        """The name a node gave at discovery (node-<id> for one that never did)."""
        site = self.sites.get(node)
        return site.name if site else f"node-{node}"

    # ---- messaging -------------------------------------------------------------------------------
    def exchange(self, ex: Exchange, receive: Callable[[Reply], None] | None = None) -> ExchangeResult:
        """Push one message per node and collect replies until all answered or the deadline.

        With `receive`, each good reply is handed over as soon as it is pulled and not kept
        (replies are pulled one at a time), so a stage of large replies holds at most one;
        without, the good replies come back in the result."""
        result, t0 = ExchangeResult(), time.monotonic()
        msgs = []
        for node in ex.nodes:
            rd = ex.content(node)
            result.bytes_down += record_bytes(rd)
            # a little TTL beyond our deadline so a site's own timeout report can still get through
            msgs.append(Message(rd, dst_node_id=node, message_type=ex.message_type, ttl=ex.deadline_s + 10))
        names = {m.metadata.dst_node_id: self.site_name(m.metadata.dst_node_id) for m in msgs}
        pending: dict[str, int] = {}
        for mid, m in zip(list(self.grid.push_messages(msgs)), msgs):
            if mid:
                pending[mid] = m.metadata.dst_node_id
            else:
                result.failed[names[m.metadata.dst_node_id]] = "push_failed: the SuperLink did not accept the message"
        del msgs
        end = time.monotonic() + ex.deadline_s
        while pending and time.monotonic() < end:
            batches = [[mid] for mid in pending] if receive else [list(pending)]
            for ids in batches:
                for reply in self.grid.pull_messages(ids):
                    node = pending.pop(reply.metadata.reply_to_message_id, None)
                    if node is None:
                        continue
                    good = self._check_reply(result, names[node], node, reply)
                    if good is not None:
                        (receive or result.replies.append)(good)
                reply = good = None  # streamed: drop this reply before the next pull
            if pending:
                time.sleep(POLL_S)
        for node in pending.values():
            result.failed[names[node]] = f"deadline: no reply within {ex.deadline_s:.0f}s (crashed, hung or disconnected)"
        result.seconds = time.monotonic() - t0
        return result

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
                result = self.exchange(ex, partial(step.receive, state) if step.receive else None)
                traffic.down += result.bytes_down
                traffic.up += result.bytes_up
                step.aggregate(state, result)
            return strategy.finish(state), traffic
        except strategy.aborts as err:
            return strategy.abort(state, err), traffic

    # ---- what the strategies are given -----------------------------------------------------------
    def round_context(self, rnd: int) -> RoundContext:
        """The round's identity, for the coordinator's side of the pipeline."""
        return RoundContext(self.fed.name, self.run_id, rnd, "", self.round_seed(rnd))

    def round_config(self, rnd: int, deadline_s: float) -> RoundConfig:
        """The CONFIG record of a stage's messages."""
        return RoundConfig(round=rnd, federation=self.fed.name, update_kind=self.fed.update_kind,
                           seed=self.round_seed(rnd), codec=self.fed.codec, error_feedback=self.fed.error_feedback,
                           seal=self.fed.seal,
                           # the site must answer before our deadline, ClientApp start-up (a few seconds) included
                           deadline_s=max(1.0, deadline_s * 0.8 - 2.0))

    def model_message(self, rnd: int, deadline_s: float) -> Callable[[int], RecordDict]:
        """The global model (with a downlink codec: the encoded steps from the model each site holds,
        coordinator/downlink_sender.py) and the round config, serialized once per stage and content
        and shared by the messages."""
        records = self.downlink.stage(self.model, self.site_name)
        config = self.round_config(rnd, deadline_s).to_record()
        return lambda node: RecordDict({**records(node), keys.CONFIG: config})

    def round_seed(self, rnd: int) -> int:
        """The public seed of round `rnd` (shared-seed codecs)."""
        return round_seed(self.fed.seed, rnd)

    def round_horizon_s(self) -> float:
        """The latest an update of this round can arrive, every stage at its deadline."""
        d = self.fed.deadlines
        stages = d.round_s + 2 * self.fed.attestation.stage_s
        return stages + (3 * d.secagg_stage_s if self.fed.secagg.enabled else 0.0)

    # ---- stages of the run -----------------------------------------------------------------------
    def wait_for_sites(self) -> None:
        """Wait for the configured sites to connect and say who they are (`deadlines.connect_s`)."""
        want = len(self.cfg.sites)
        end = time.monotonic() + self.fed.deadlines.connect_s
        nodes: list[int] = []
        while time.monotonic() < end:
            nodes = list(self.grid.get_node_ids())
            if len(nodes) >= want:
                break
            time.sleep(0.5)
        self.progress(f"{len(nodes)}/{want} site(s) connected")
        res = self.exchange(Exchange("discovery", "query", nodes, lambda n: RecordDict({keys.CONFIG: ConfigRecord({})}),
                                     self.fed.deadlines.connect_s))
        known = {s.id for s in self.cfg.sites}
        for reply in res.replies:
            node, site = reply.message.metadata.src_node_id, str(reply.status["site"])
            if site not in known:
                self.progress(f"ignoring node {node}: site '{site}' is not in the configuration")
                continue
            self.sites[node] = Site(node, site, int(reply.status["num_examples"]))
        for name, reason in res.failed.items():
            self.progress(f"site discovery: {name} failed: {reason}")
        if len(self.sites) < self.fed.quorum:
            raise FederationFailed(
                f"only {len(self.sites)} site(s) ready ({sorted(s.name for s in self.sites.values())}) "
                f"within {self.fed.deadlines.connect_s:.0f}s; quorum is {self.fed.quorum}"
            )
        self.progress("sites: " + ", ".join(f"{s.name} ({s.num_examples} examples)" for s in self.sites.values()))

    def sample(self, rnd: int) -> list[int]:
        """The sites of round `rnd` (`sites_per_round`, reproducible from the federation seed)."""
        nodes = sorted(self.sites)
        k = min(self.fed.sites_per_round or len(nodes), len(nodes))
        rng = np.random.default_rng([self.fed.seed, rnd])
        # node ids are uint64 and may exceed int64: sample positions, never the ids themselves
        return sorted(nodes[i] for i in rng.choice(len(nodes), size=k, replace=False).tolist())

    def admit(self, rnd: int, nodes: list[int], horizon_s: float) -> AdmissionOutcome:
        """Attested admission of `nodes` (see admission.py); refusals are counted and logged."""
        assert self.admission is not None
        state = self.admission.begin(rnd, nodes, {n: self.site_name(n) for n in nodes}, horizon_s)
        out, _ = self.drive(self.admission, state)
        for name, reason in out.excluded.items():
            self.rejections["attestation:" + out.codes[name]] += 1
            self.progress(f"round {rnd}: site {name} NOT ADMITTED: {reason}")
        return out

    def round_input(self, rnd: int, nodes: list[int]) -> RoundInput:
        """What the round strategy is given for round `rnd`."""
        return RoundInput(self.round_context(rnd), nodes, self.sites, self.model, self.spec,
                          partial(self.model_message, rnd), self.progress)

    def train_round(self, rnd: int) -> dict:
        """Sample, admit, run the round strategy, apply the mean update and checkpoint; the round's
        metrics line (without evaluation and downlink)."""
        t0 = time.monotonic()
        nodes = self.sample(rnd)
        sampled, admission = len(nodes), None
        if self.admission is not None:
            admission = self.admit(rnd, nodes, self.round_horizon_s())
            nodes = admission.admitted
        out, traffic = self.drive(self.protocol, self.protocol.begin(self.round_input(rnd, nodes)))
        out.bytes_down, out.bytes_up = traffic.down, traffic.up
        self.rejections.update(out.rejections)
        for name, reason in out.failed.items():
            self.progress(f"round {rnd}: site {name} excluded: {reason}")
        if admission is not None:
            out.failed.update(admission.excluded)
            out.extra["attestation"] = admission.metrics()
        return self._apply(rnd, out, sampled, t0)

    def _apply(self, rnd: int, out: RoundOutcome, sampled: int, t0: float) -> dict:
        line = {"round": rnd, "sites": out.per_site, "failed": out.failed, "sampled": sampled,
                "bytes_down": out.bytes_down, "bytes_up": out.bytes_up, "rejections": dict(self.rejections),
                **out.extra}
        dense = sum(v.nbytes for v in self.model.values())
        if out.per_site:
            line["compression_ratio"] = dense * len(out.per_site) / max(
                1, sum(s.get("upload_bytes", dense) for s in out.per_site.values()))
        if out.mean is not None and out.count >= self.fed.quorum:
            self.model = self.opt.step(self.model, out.mean)
            line["status"] = "aggregated"
        else:
            line["status"] = "skipped"
            self.progress(f"round {rnd}: skipped, {out.count} usable update(s) < quorum {self.fed.quorum}; "
                          "the global model is unchanged")
        line["train_s"] = time.monotonic() - t0
        return line

    def evaluate_round(self, rnd: int) -> dict:
        """Evaluate the global model on every site admitted now; the `eval_*` metrics."""
        nodes = sorted(self.sites)
        if self.admission is not None:  # the model goes only to sites admitted now
            nodes = [n for n in nodes if self.admission.admitted(self.site_name(n))]
        out, _ = self.drive(self.evaluation, self.evaluation.begin(nodes, partial(self.model_message, rnd)))
        return out

    def run_round(self, rnd: int) -> dict:
        """One whole round: train, evaluate, downlink figures; the metrics line, also appended to
        metrics.jsonl."""
        t0 = time.monotonic()
        line = self.train_round(rnd)
        if self.fed.evaluate:
            line.update(self.evaluate_round(rnd))
        line["downlink"] = self.downlink.round_metrics()
        line["round_s"] = time.monotonic() - t0
        self.history.append(line)
        checkpoint_round(self, rnd)  # before the metrics line: a resume rewrites metrics.jsonl from it
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        return line

    def run(self, resume: bool = False) -> dict:
        """The whole run: discovery, then every round (with `resume`, from the last checkpointed
        one, see resume.py); the run's result (result.json)."""
        if resume:
            resume_run(self)
        self.wait_for_sites()
        history = self.history
        for rnd in range(self.start_round, self.fed.rounds + 1):
            line = self.run_round(rnd)
            losses = ", ".join(f"{k}={v['loss']:.4f}" for k, v in line["sites"].items())
            ev = f" eval_loss={line['eval_loss']:.4f}" if "eval_loss" in line else ""
            acc = f" eval_acc={line['eval_accuracy']:.3f}" if "eval_accuracy" in line else ""
            self.progress(f"round {rnd}/{self.fed.rounds} {line['status']}: {len(line['sites'])} site(s) "
                          f"[{losses}]{ev}{acc} in {line['round_s']:.1f}s")
        evals = [h["eval_loss"] for h in history if h["status"] == "aggregated" and "eval_loss" in h]
        return {
            "status": "ok" if any(h["status"] == "aggregated" for h in history) else "failed",
            "rounds": len(history),
            "aggregated_rounds": sum(h["status"] == "aggregated" for h in history),
            "first_loss": evals[0] if evals else None,
            "last_loss": evals[-1] if evals else None,
            "rejections": dict(self.rejections),
        }
