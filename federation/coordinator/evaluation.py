"""Evaluation of the global model on the sites' held-out data.

Each round's train message asks the sites (round config `evaluate`) to evaluate the model they
received before training on it: the figures ride back with the update, and `EvalRider` folds them
as the replies are pulled. So round r's metrics line reports the model round r started from, the
global model after round r - 1 (`eval_model_round`), at no extra message. The model the last round
produces is evaluated once more at the end of the run by `Evaluation`, a one-stage strategy with an
evaluate message (`final_eval_*` in the last line).

Sites evaluate the model they hold (with a downlink codec: the reference they rebuilt, which is
what they train on next); the figures are averaged weighted by each site's number of validation
examples.

The train reply comes after the round's local steps, a minute or more after the evaluation. A
site on the data path also sends its figures as soon as it has them (the bulk channel's Report),
and `EvalAnnouncer` says the round's evaluation once every site of the round has: the progress
log and `timing.eval_known_s` then follow the model, not the training. Without those reports it
says it once a stage has brought the train replies. The metrics line's figures stay those of the
signed replies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Message, RecordDict

from federation.coordinator.strategy import Exchange, ExchangeResult, Step
from federation.protocol import message_keys as keys


@dataclass
class EvalTotals:
    """Loss, examples and accuracy summed over the sites that evaluated."""

    totals: np.ndarray = field(default_factory=lambda: np.zeros(3))  # Σ loss·n, Σ n, Σ accuracy·n
    failed: dict[str, str] = field(default_factory=dict)
    sites: int = 0

    def add(self, metrics) -> None:
        """Fold one site's figures (its METRICS record)."""
        n = float(metrics["num_val_examples"])
        self.totals += [float(metrics["eval_loss"]) * n, n, float(metrics.get("eval_accuracy", np.nan)) * n]
        self.sites += 1

    def figures(self, prefix: str = "eval") -> dict:
        """`<prefix>_failed`, and `<prefix>_loss` / `<prefix>_accuracy` when any site answered."""
        tot = self.totals
        out: dict = {f"{prefix}_failed": self.failed}
        if tot[1] > 0:
            out[f"{prefix}_loss"] = tot[0] / tot[1]
            if np.isfinite(tot[2]):
                out[f"{prefix}_accuracy"] = tot[2] / tot[1]
        return out


class EvalRider:
    """Folds the evaluation figures that ride back with the train replies of one round."""

    sees_every_reply = True  # it adds nothing to the messages, but reads the train replies

    def __init__(self):
        self.totals = EvalTotals()

    def records(self, node: int) -> dict:
        """Nothing to add: the round config asks for the evaluation."""
        return {}

    def wanted(self) -> list[int]:
        """No message of its own."""
        return []

    def take(self, node: int, reply: Message | None) -> None:
        """A train reply's evaluation figures, if it carries any."""
        if reply is None or not reply.has_content():
            return
        m = reply.content.metric_records.get(keys.METRICS)
        status = reply.content.config_records.get(keys.STATUS)
        if m is not None and "eval_loss" in m and status is not None and status.get("ok", False):
            self.totals.add(m)


class EvalAnnouncer:
    """Says round `rnd`'s evaluation of the model before it once it is known, one time: from the
    early reports of every site in `sites` (on a bulk server thread), else from the train replies."""

    def __init__(self, rnd: int, sites: set[str], progress: Callable[[str], None], t0: float):
        self.rnd, self.pending, self.progress, self.t0 = rnd, set(sites), progress, t0
        self.early = EvalTotals()
        self.known_s: float | None = None  # seconds into the round when it was said
        self._lock = threading.Lock()

    def report(self, site: str, rnd: int, figures: dict[str, float]) -> None:
        """A site's early figures (BulkServer.on_report); the last one expected says the evaluation."""
        with self._lock:
            if self.known_s is not None or rnd != self.rnd or site not in self.pending:
                return
            self.pending.discard(site)
            self.early.add(figures)
            if not self.pending:
                self._say(self.early, "reported on the data path before their local steps")

    def replies(self, totals: EvalTotals) -> None:
        """After a stage: the train replies' figures, if the early reports did not say it already."""
        with self._lock:
            if self.known_s is None and totals.sites:
                self._say(totals, "in their train replies")

    def _say(self, totals: EvalTotals, how: str) -> None:
        self.known_s = round(time.monotonic() - self.t0, 4)
        self.progress(f"round {self.rnd}: the model of round {self.rnd - 1} evaluated by {totals.sites} site(s), "
                      f"{how}: eval_loss={totals.figures()['eval_loss']:.4f}, {self.known_s:.1f}s into the round")


@dataclass
class EvaluationState:
    """One evaluate stage in progress."""

    nodes: list[int]
    model_message: Callable[[float], Callable[[int], RecordDict]]
    totals: EvalTotals = field(default_factory=EvalTotals)


class Evaluation:
    """`Strategy` of the evaluate stage (the final model); its outcome is `eval_*` figures."""

    aborts: tuple[type[BaseException], ...] = ()

    def __init__(self, deadline_s: float):
        self.deadline_s = float(deadline_s)

    def begin(self, nodes: list[int], model_message: Callable[[float], Callable[[int], RecordDict]]) -> EvaluationState:
        """A fresh state for the sites that evaluate."""
        return EvaluationState(list(nodes), model_message)

    def steps(self) -> tuple[Step[EvaluationState], ...]:
        """One stage: evaluate."""
        return (Step(self.configure_evaluate, self.aggregate_evaluate),)

    def configure_evaluate(self, st: EvaluationState) -> Exchange:
        """The model message, as an evaluate message, to each site."""
        return Exchange("evaluate", "evaluate", st.nodes, st.model_message(self.deadline_s), self.deadline_s)

    def aggregate_evaluate(self, st: EvaluationState, result: ExchangeResult) -> None:
        """Sum each site's figures, weighted by its validation examples."""
        st.totals.failed = dict(result.failed)
        for reply in result.replies:
            st.totals.add(reply.message.content.metric_records[keys.METRICS])

    def finish(self, st: EvaluationState) -> dict:
        """`eval_failed`, and `eval_loss` / `eval_accuracy` when any site answered."""
        return st.totals.figures()
