"""The time-to-loss rules of benchmarks/wan_time_to_loss.py, as pure functions (tests/test_wan_time_to_loss.py).

- A side's time is its first evaluation at or below the target, whatever its curve does after.
- Flower runs at several local-step settings; the target is the lowest eval loss any of them reaches
  in its run, and the anchor is the setting that reaches it first (so no setting reaches the target
  sooner than the anchor). Every setting's best loss and time to the target is reported.
- Each site gets enough text that the most any run reads (rounds x local steps x batch x sequence
  length, per site) passes over its training text at most `max_passes` times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Curve = list[tuple[float, float]]  # (seconds, eval loss), in the order evaluated

TOLERANCE = 1e-9  # a loss equal to the target, up to float noise, has reached it


def time_to(curve: Curve, target: float) -> float:
    """Seconds of the first evaluation at or below `target`; inf if none is."""
    return next((t for t, loss in curve if loss <= target + TOLERANCE), math.inf)


def best_loss(curve: Curve) -> float:
    """The lowest eval loss of a run (inf for an empty curve)."""
    return min((loss for _, loss in curve), default=math.inf)


@dataclass(frozen=True)
class Anchor:
    local_steps: int  # the winning setting
    target: float  # the lowest loss any setting reached
    seconds: float  # the winning setting's first evaluation at or below the target
    per_setting: dict[int, dict]  # every setting: its best loss and its time to the target (inf: never)


def choose_anchor(curves: dict[int, Curve]) -> Anchor:
    """Flower's anchor among its local-step settings (curves by local steps): the target is the lowest
    loss any setting reaches; the anchor the setting first at or below it (ties: fewer local steps)."""
    runs = {k: c for k, c in curves.items() if c}
    if not runs:
        raise ValueError("no Flower setting produced an evaluation")
    target = min(best_loss(c) for c in runs.values())
    per = {k: {"best_loss": best_loss(c), "time_to_target_s": time_to(c, target)} for k, c in sorted(curves.items())}
    steps = min(runs, key=lambda k: (per[k]["time_to_target_s"], k))
    return Anchor(steps, target, per[steps]["time_to_target_s"], per)


def tokens_read_per_site(rounds: int, local_steps: int, batch: int, seq_len: int, steps_factor: float = 1.0) -> int:
    """Training tokens one site reads in a run: rounds x local steps (x the overlap's step factor) x batch x length."""
    return math.ceil(rounds * local_steps * steps_factor) * batch * seq_len


def text_bytes_per_site(tokens: int, bytes_per_token: float, max_passes: float, train_fraction: float = 0.9) -> int:
    """Bytes of text a site needs (train and validation together) for `tokens` training tokens to pass
    over its training text at most `max_passes` times."""
    if tokens < 0 or bytes_per_token <= 0 or max_passes <= 0 or not 0 < train_fraction <= 1:
        raise ValueError(f"tokens {tokens}, bytes/token {bytes_per_token}, passes {max_passes}, "
                         f"train fraction {train_fraction}: all must be positive (fraction at most 1)")
    return math.ceil(tokens * bytes_per_token / max_passes / train_fraction)


def passes(tokens: int, train_tokens: int) -> float:
    """How many times a run reading `tokens` passes over `train_tokens` of training text."""
    return tokens / train_tokens if train_tokens else math.inf


def split_breakdown(round_s: float, training_s: float, transfer_s: float) -> dict:
    """A round's seconds as training, transfer and fixed cost (the rest: process starts, model loads,
    masking, aggregation, Flower's delivery); where training and transfer overlap (ours with overlap:
    the sites train while their update travels) their sum may exceed the round, and fixed is 0."""
    return {"round_s": round(round_s, 2), "training_s": round(training_s, 2), "transfer_s": round(transfer_s, 2),
            "fixed_s": round(max(0.0, round_s - training_s - transfer_s), 2)}
