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

from federation.aggregate import ServerOptimizer, WeightedMean
from federation.checkpoint import save_checkpoint
from federation.config import ExperimentConfig
from federation.pipeline import Payload, Pipeline, RoundContext, UpdateRejected, check_update
from federation.wire import from_records, to_records

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
                 initial: dict[str, np.ndarray], progress: Callable[[str], None] | None = None):
        self.grid, self.cfg, self.workdir, self.run_id = grid, cfg, Path(workdir), run_id
        self.fed = cfg.federation
        self.model = initial
        self.spec = {k: (v.dtype.str, tuple(v.shape)) for k, v in initial.items()}
        self.opt = ServerOptimizer(self.fed.strategy, self.fed.update_kind, self.fed.effective_server_lr,
                                   self.fed.server_beta1, self.fed.server_beta2, self.fed.server_tau)
        self.pipeline = Pipeline()
        self.sites: dict[int, Site] = {}
        self.rejections: dict[str, int] = {}
        self._progress = progress or (lambda line: log.info(line))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.workdir / "metrics.jsonl"

    def progress(self, line: str) -> None:
        self._progress(line)

    # ---- messaging -------------------------------------------------------------------------
    def _exchange(self, nodes: Iterable[int], kind: str, content: Callable[[int], RecordDict],
                  deadline_s: float) -> StageResult:
        """Push one message per node and collect replies until all answered or the deadline."""
        result = StageResult()
        msgs = []
        for node in nodes:
            rd = content(node)
            result.bytes_down += record_bytes(rd)
            # a little TTL beyond our deadline so a site's own timeout report can still get through
            msgs.append(Message(rd, dst_node_id=node, message_type=kind, ttl=deadline_s + 10))
        names = {m.metadata.dst_node_id: self._name(m.metadata.dst_node_id) for m in msgs}
        pending: dict[str, int] = {}
        for mid, m in zip(list(self.grid.push_messages(msgs)), msgs):
            if mid:
                pending[mid] = m.metadata.dst_node_id
            else:
                result.failed[names[m.metadata.dst_node_id]] = "push_failed: the SuperLink did not accept the message"
        end = time.monotonic() + deadline_s
        while pending and time.monotonic() < end:
            for reply in self.grid.pull_messages(list(pending)):
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
                result.ok[name] = reply
            if pending:
                time.sleep(POLL_S)
        for node in pending.values():
            result.failed[names[node]] = f"deadline: no reply within {deadline_s:.0f}s (crashed, hung or disconnected)"
        return result

    def _name(self, node: int) -> str:
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
        res = self._exchange(nodes, "query", lambda n: RecordDict({"config": ConfigRecord({})}),
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
            # the relay must answer before our deadline, ClientApp start-up (a few seconds) included
            "deadline_s": max(1.0, deadline_s * 0.8 - 2.0),
        })

    def _model_message(self, rnd: int, deadline_s: float) -> Callable[[int], RecordDict]:
        """The global model is serialized once per stage and shared by every site's message."""
        model = to_records(Payload(self.model), "global").array_records["global"]
        config = self._round_config(rnd, deadline_s)
        return lambda node: RecordDict({"global": model, "config": config})

    def train_round(self, rnd: int) -> dict:
        t0 = time.monotonic()
        nodes = self.sample(rnd)
        res = self._exchange(nodes, "train", self._model_message(rnd, self.fed.deadlines.round_s),
                             self.fed.deadlines.round_s)
        mean = WeightedMean()
        per_site: dict[str, dict] = {}
        failed = dict(res.failed)
        bytes_up = 0
        for name, reply in res.ok.items():
            st = reply.content.config_records["status"]
            try:
                payload = from_records(reply.content, "update", "update_meta")
                bytes_up += record_bytes(reply.content)
                ctx = RoundContext(self.fed.name, self.run_id, rnd, name)
                payload = self.pipeline.decode(payload, ctx)
                check_update(payload.arrays, self.spec)
                n = int(st["num_examples"])
                if n <= 0:
                    raise UpdateRejected("bad_num_examples", f"num_examples is {n}")
                mean.add(payload.arrays, n)
            except UpdateRejected as err:
                self.rejections[err.reason] = self.rejections.get(err.reason, 0) + 1
                failed[name] = f"rejected {err}"
                continue
            m = dict(reply.content.metric_records.get("metrics", {}))
            per_site[name] = {"loss": m.get("loss"), "samples": int(st["num_examples"]),
                              "seconds": m.get("train_s"), "relay_s": m.get("relay_s"),
                              "rank_digests": list(st.get("rank_digests", []))}
        for name, reason in failed.items():
            self.progress(f"round {rnd}: site {name} excluded: {reason}")
        line = {"round": rnd, "sites": per_site, "failed": failed, "sampled": len(nodes),
                "bytes_down": res.bytes_down, "bytes_up": bytes_up, "rejections": dict(self.rejections)}
        if mean.count >= self.fed.quorum:
            self.model = self.opt.step(self.model, mean.result())
            save_checkpoint(self.workdir / "checkpoints", rnd, self.model, self.opt.state())
            line["status"] = "aggregated"
        else:
            line["status"] = "skipped"
            self.progress(f"round {rnd}: skipped, {mean.count} usable update(s) < quorum {self.fed.quorum}; "
                          "the global model is unchanged")
        line["train_s"] = time.monotonic() - t0
        return line

    def evaluate_round(self, rnd: int) -> dict:
        res = self._exchange(sorted(self.sites), "evaluate", self._model_message(rnd, self.fed.deadlines.evaluate_s),
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
