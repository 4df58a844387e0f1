"""The coordinator's round loop, driven through Flower's Grid (Message API).

Each stage pushes messages, then pulls replies until its deadline; a site that crashes, errs or
misses the deadline is reported by name and the round goes on if the quorum holds. Updates are
decoded, checked and folded into a running weighted mean as they arrive. After every round the
global model is checkpointed and one JSON line of metrics is written.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from crypto.envelope import ReplayGuard
from crypto.pki import CoordinatorBundle
from federation.coordinator.admission import Admission
from federation.coordinator.aggregate import ServerOptimizer
from federation.coordinator.checkpoint import save_checkpoint
from federation.protocol.update_codec import CodecStage, round_seed
from federation.protocol.codecs import UpdateSpec
from federation.config.schema import ExperimentConfig
from federation.protocol.downlink_steps import DownlinkSender
from federation.protocol.pipeline import Pipeline
from federation.protocol.envelope_stage import CoordinatorProtection
from federation.coordinator.plain_round import PlainRound, RoundProtocol

log = logging.getLogger("sovfl.coordinator")
POLL_S = 0.2


class FederationFailed(RuntimeError):
    """The run cannot go on (too few sites); the message says why."""


@dataclass
class Site:
    node_id: int
    name: str
    num_examples: int


@dataclass
class StageResult:
    ok: dict[str, Message] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # site -> reason
    bytes_down: int = 0


def record_bytes(rd: RecordDict) -> int:
    """Bytes of array data in a message, as serialized for the wire."""
    return sum(len(a.data) for rec in rd.array_records.values() for a in rec.values())


class Coordinator:
    def __init__(self, grid: Grid, cfg: ExperimentConfig, workdir: Path, run_id: int,
                 initial: dict[str, np.ndarray], progress: Callable[[str], None] | None = None,
                 bundle: CoordinatorBundle | None = None):
        self.grid, self.cfg, self.workdir, self.run_id = grid, cfg, Path(workdir), run_id
        self.fed = cfg.federation
        self.model = initial
        self.spec = {k: (v.dtype.str, tuple(v.shape)) for k, v in initial.items()}
        self.opt = ServerOptimizer(self.fed.strategy, self.fed.update_kind, self.fed.effective_server_lr,
                                   self.fed.server_beta1, self.fed.server_beta2, self.fed.server_tau)
        self.bundle = bundle
        self.replay = ReplayGuard()  # one per run: a (run, round, site) envelope opens once
        self.protocol: RoundProtocol = PlainRound()
        if self.fed.secagg.enabled:
            from federation.coordinator.secagg_round import SecAggRound

            self.protocol = SecAggRound(self.fed.secagg)
        self.admission: Admission | None = None
        if self.fed.attestation.enabled:
            if bundle is None:
                raise FederationFailed("federation.attestation needs the coordinator's provisioned bundle (its "
                                       "sealing key is what its evidence binds, the registry holds the sites' keys)")
            self.admission = Admission(self.fed.attestation.coordinator, bundle, self.fed.attestation.stage_s)
        self.sites: dict[int, Site] = {}
        self.rejections: dict[str, int] = {}
        self.downlink = DownlinkSender(self.fed.downlink_codec, self.fed.seed)
        self._progress = progress or (lambda line: log.info(line))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.workdir / "metrics.jsonl"

    def progress(self, line: str) -> None:
        self._progress(line)

    # ---- messaging -------------------------------------------------------------------------
    def exchange(self, nodes: Iterable[int], kind: str, content: Callable[[int], RecordDict],
                 deadline_s: float, on_reply: Callable[[str, int, Message], None] | None = None) -> StageResult:
        """Push one message per node and collect replies until all answered or the deadline.

        With `on_reply`, each good reply is handed over as soon as it is pulled and not kept
        (replies are pulled one at a time), so a stage of large replies holds at most one."""
        result = StageResult()
        msgs = []
        for node in nodes:
            rd = content(node)
            result.bytes_down += record_bytes(rd)
            # a little TTL beyond our deadline so a site's own timeout report can still get through
            msgs.append(Message(rd, dst_node_id=node, message_type=kind, ttl=deadline_s + 10))
        names = {m.metadata.dst_node_id: self.site_name(m.metadata.dst_node_id) for m in msgs}
        pending: dict[str, int] = {}
        for mid, m in zip(list(self.grid.push_messages(msgs)), msgs):
            if mid:
                pending[mid] = m.metadata.dst_node_id
            else:
                result.failed[names[m.metadata.dst_node_id]] = "push_failed: the SuperLink did not accept the message"
        del msgs
        end = time.monotonic() + deadline_s
        while pending and time.monotonic() < end:
            batches = [[mid] for mid in pending] if on_reply else [list(pending)]
            for ids in batches:
                for reply in self.grid.pull_messages(ids):
                    node = pending.pop(reply.metadata.reply_to_message_id, None)
                    if node is None:
                        continue
                    name = names[node]
                    if reply.has_error():
                        reason = str(reply.error.reason)
                        result.failed[name] = (f"deadline: the message expired before the site answered ({reason})"
                                               if "TTL" in reason else f"client_error: {reason}")
                        continue
                    status = reply.content.config_records.get("status")
                    if status is None or not status.get("ok", False):
                        result.failed[name] = f"site_error: {status.get('error') if status else 'no status in reply'}"
                        continue
                    self.downlink.heard(node, status)
                    if on_reply is None:
                        result.ok[name] = reply
                    else:
                        on_reply(name, node, reply)
                reply = None  # with on_reply: drop this reply before the next pull
            if pending:
                time.sleep(POLL_S)
        for node in pending.values():
            result.failed[names[node]] = f"deadline: no reply within {deadline_s:.0f}s (crashed, hung or disconnected)"
        return result

    def site_name(self, node: int) -> str:
        site = self.sites.get(node)
        return site.name if site else f"node-{node}"

    # ---- stages ------------------------------------------------------------------------------
    def wait_for_sites(self) -> None:
        want = len(self.cfg.sites)
        end = time.monotonic() + self.fed.deadlines.connect_s
        nodes: list[int] = []
        while time.monotonic() < end:
            nodes = list(self.grid.get_node_ids())
            if len(nodes) >= want:
                break
            time.sleep(0.5)
        self.progress(f"{len(nodes)}/{want} site(s) connected")
        res = self.exchange(nodes, "query", lambda n: RecordDict({"config": ConfigRecord({})}),
                             self.fed.deadlines.connect_s)
        known = {s.id for s in self.cfg.sites}
        for name, reply in res.ok.items():
            st = reply.content.config_records["status"]
            site = str(st["site"])
            if site not in known:
                self.progress(f"ignoring node {reply.metadata.src_node_id}: site '{site}' is not in the configuration")
                continue
            self.sites[reply.metadata.src_node_id] = Site(reply.metadata.src_node_id, site, int(st["num_examples"]))
        for name, reason in res.failed.items():
            self.progress(f"site discovery: {name} failed: {reason}")
        if len(self.sites) < self.fed.quorum:
            raise FederationFailed(
                f"only {len(self.sites)} site(s) ready ({sorted(s.name for s in self.sites.values())}) "
                f"within {self.fed.deadlines.connect_s:.0f}s; quorum is {self.fed.quorum}"
            )
        self.progress("sites: " + ", ".join(f"{s.name} ({s.num_examples} examples)" for s in self.sites.values()))

    def sample(self, rnd: int) -> list[int]:
        nodes = sorted(self.sites)
        k = min(self.fed.sites_per_round or len(nodes), len(nodes))
        rng = np.random.default_rng([self.fed.seed, rnd])
        # node ids are uint64 and may exceed int64: sample positions, never the ids themselves
        return sorted(nodes[i] for i in rng.choice(len(nodes), size=k, replace=False).tolist())

    def _round_config(self, rnd: int, deadline_s: float) -> ConfigRecord:
        return ConfigRecord({
            "round": rnd, "federation": self.fed.name, "update_kind": self.fed.update_kind,
            "seed": self.round_seed(rnd), "codec": self.fed.codec, "error_feedback": self.fed.error_feedback,
            "seal": self.fed.seal,
            # the relay must answer before our deadline, ClientApp start-up (a few seconds) included
            "deadline_s": max(1.0, deadline_s * 0.8 - 2.0),
        })

    def model_message(self, rnd: int, deadline_s: float) -> Callable[[int], RecordDict]:
        """The global model (with a downlink codec: the encoded steps from the model each site holds,
        federation/downlink.py), serialized once per stage and content and shared by the messages."""
        records = self.downlink.stage(self.model, self.site_name)
        config = self._round_config(rnd, deadline_s)
        return lambda node: RecordDict({**records(node), "config": config})

    def update_pipeline(self) -> Pipeline:
        """The coordinator's side of the update pipeline, fresh per round (stages keep timings)."""
        stages: list = []
        if self.fed.codec != "identity":
            stages.append(CodecStage.from_spec(self.fed.codec, self.fed.error_feedback, layout=UpdateSpec.of(self.model)))
        if self.bundle is not None:
            stages.append(CoordinatorProtection(self.bundle, require_sealed=self.fed.seal, replay=self.replay))
        return Pipeline(tuple(stages))

    def round_seed(self, rnd: int) -> int:
        return round_seed(self.fed.seed, rnd)

    record_bytes = staticmethod(record_bytes)

    def count_rejection(self, reason: str) -> None:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def round_horizon_s(self) -> float:
        """The latest an update of this round can arrive, every stage at its deadline."""
        d = self.fed.deadlines
        stages = d.round_s + 2 * self.fed.attestation.stage_s
        return stages + (3 * d.secagg_stage_s if self.fed.secagg.enabled else 0.0)

    def train_round(self, rnd: int) -> dict:
        t0 = time.monotonic()
        nodes = self.sample(rnd)
        sampled, admission = len(nodes), None
        if self.admission is not None:
            admission = self.admission.run(self, rnd, nodes, self.round_horizon_s())
            nodes = admission.admitted
        out = self.protocol.train(self, rnd, nodes)
        for name, reason in out.failed.items():
            self.progress(f"round {rnd}: site {name} excluded: {reason}")
        if admission is not None:
            out.failed.update(admission.excluded)
            out.extra["attestation"] = admission.metrics()
        line = {"round": rnd, "sites": out.per_site, "failed": out.failed, "sampled": sampled,
                "bytes_down": out.bytes_down, "bytes_up": out.bytes_up, "rejections": dict(self.rejections),
                **out.extra}
        dense = sum(v.nbytes for v in self.model.values())
        if out.per_site:
            line["compression_ratio"] = dense * len(out.per_site) / max(
                1, sum(s.get("upload_bytes", dense) for s in out.per_site.values()))
        if out.mean is not None and out.count >= self.fed.quorum:
            self.model = self.opt.step(self.model, out.mean)
            save_checkpoint(self.workdir / "checkpoints", rnd, self.model, self.opt.state())
            line["status"] = "aggregated"
        else:
            line["status"] = "skipped"
            self.progress(f"round {rnd}: skipped, {out.count} usable update(s) < quorum {self.fed.quorum}; "
                          "the global model is unchanged")
        line["train_s"] = time.monotonic() - t0
        return line

    def evaluate_round(self, rnd: int) -> dict:
        nodes = sorted(self.sites)
        if self.admission is not None:  # the model goes only to sites admitted now
            nodes = [n for n in nodes if self.admission.admitted(self.site_name(n))]
        res = self.exchange(nodes, "evaluate", self.model_message(rnd, self.fed.deadlines.evaluate_s),
                             self.fed.deadlines.evaluate_s)
        tot = np.zeros(3)
        for reply in res.ok.values():
            m = reply.content.metric_records["metrics"]
            n = float(m["num_val_examples"])
            tot += [float(m["eval_loss"]) * n, n, float(m.get("eval_accuracy", np.nan)) * n]
        out: dict = {"eval_failed": res.failed}
        if tot[1] > 0:
            out["eval_loss"] = tot[0] / tot[1]
            if np.isfinite(tot[2]):
                out["eval_accuracy"] = tot[2] / tot[1]
        return out

    def run(self) -> dict:
        self.wait_for_sites()
        history = []
        for rnd in range(1, self.fed.rounds + 1):
            t0 = time.monotonic()
            line = self.train_round(rnd)
            if self.fed.evaluate:
                line.update(self.evaluate_round(rnd))
            line["downlink"] = self.downlink.round_metrics()
            line["round_s"] = time.monotonic() - t0
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(line) + "\n")
            history.append(line)
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
            "rejections": self.rejections,
        }
