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
"""

from __future__ import annotations

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
