"""The run's state that outlives a round: what a checkpoint writes and a resume gives back.

One dataclass, so that checkpointing (resume.checkpoint_job) and resuming (resume.resume_run) take
and return it without knowing the driver that holds it. What a resume may restore, and why the
rest is not, is said in resume.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from federation.coordinator.aggregate import ServerOptimizer
from federation.coordinator.downlink_sender import DownlinkSender
from federation.protocol.codecs import Arrays


@dataclass
class RunState:
    """The global model and what the next round's computation depends on.

    - `model`: the global model (float32 where bf16 travels as raw words, wire_dtypes.to_master);
    - `opt`: the server optimizer and its state (FedAdam/FedYogi moments, DiLoCo's momentum);
    - `downlink`: the downlink reference, its encoded steps and step counter;
    - `history`: the metrics lines of the rounds done;
    - `rejections`: the run-wide rejection counts;
    - `aggregated`: round -> the sites whose updates it aggregated (sites' error feedback goes on
      from these rounds);
    - `start_round`: the first round this process runs (after a resume: the round after the
      checkpoint's)."""

    model: Arrays
    opt: ServerOptimizer
    downlink: DownlinkSender
    history: list[dict] = field(default_factory=list)
    rejections: Counter[str] = field(default_factory=Counter)
    aggregated: dict[int, list[str]] = field(default_factory=dict)
    start_round: int = 1
