"""Evaluation of the global model on every admitted site's held-out data, as a one-stage strategy.

Sites evaluate the model they hold (with a downlink codec: the reference they rebuilt, which is
what they train on next); the coordinator averages loss and accuracy weighted by each site's
number of validation examples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import RecordDict

from federation.coordinator.strategy import Exchange, ExchangeResult, Step
from federation.protocol import message_keys as keys


@dataclass
class EvaluationState:
    """One evaluate stage in progress: loss, examples and accuracy summed over the sites."""

    nodes: list[int]
    model_message: Callable[[float], Callable[[int], RecordDict]]
    totals: np.ndarray = field(default_factory=lambda: np.zeros(3))  # Σ loss·n, Σ n, Σ accuracy·n
    failed: dict[str, str] = field(default_factory=dict)


class Evaluation:
    """`Strategy` of the evaluate stage; its outcome is the round's `eval_*` metrics."""

    aborts: tuple[type[BaseException], ...] = ()

    def __init__(self, deadline_s: float):
        self.deadline_s = float(deadline_s)

    def begin(self, nodes: list[int], model_message: Callable[[float], Callable[[int], RecordDict]]) -> EvaluationState:
        """A fresh state for the sites that evaluate this round."""
        return EvaluationState(list(nodes), model_message)

    def steps(self) -> tuple[Step[EvaluationState], ...]:
        """One stage: evaluate."""
        return (Step(self.configure_evaluate, self.aggregate_evaluate),)

    def configure_evaluate(self, st: EvaluationState) -> Exchange:
        """The model message, as an evaluate message, to each site."""
        return Exchange("evaluate", "evaluate", st.nodes, st.model_message(self.deadline_s), self.deadline_s)

    def aggregate_evaluate(self, st: EvaluationState, result: ExchangeResult) -> None:
        """Sum each site's figures, weighted by its validation examples."""
        st.failed = dict(result.failed)
        for reply in result.replies:
            m = reply.message.content.metric_records[keys.METRICS]
            n = float(m["num_val_examples"])
            st.totals += [float(m["eval_loss"]) * n, n, float(m.get("eval_accuracy", np.nan)) * n]

    def finish(self, st: EvaluationState) -> dict:
        """`eval_failed`, and `eval_loss` / `eval_accuracy` when any site answered."""
        tot = st.totals
        out: dict = {"eval_failed": st.failed}
        if tot[1] > 0:
            out["eval_loss"] = tot[0] / tot[1]
            if np.isfinite(tot[2]):
                out["eval_accuracy"] = tot[2] / tot[1]
        return out
