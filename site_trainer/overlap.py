"""Communication hidden behind computation: a site keeps training while its update travels.

With `federation.overlap` (the round config's `overlap`), after a site answers round r with the
update Δ_r = θ_r − w_r, its ranks do not wait: they keep stepping from θ_r (as the first steps of
round r+1: its learning-rate position and batch stream) until the coordinator's request for round
r+1 arrives with the new global model w_{r+1}, or until they took the budget: the answered round's
`local_steps` L times `overlap_max_steps_factor` (default 1: at most L, the round's own count; above
1 the ranks stay busy through a link and a coordinator slower than L steps, and the cap bounds how far
the progress drifts from the models the other sites fold it with when the coordinator stalls). The
request freezes the background progress and folds it into the new global model, on every rank,
for each exchanged tensor (its DDP replica or its ZeRO shard alike):

    p        = θ_now − θ_r            (the steps taken while the link and the coordinator were busy)
    θ_start  = w_{r+1} + p            (float arithmetic in the tensor's dtype, in this order)

and round r+1 then trains only max(0, `local_steps` − b) more steps (b background steps were taken;
with a factor above 1, b may exceed `local_steps`: the round then trains none and answers at once,
its update holding all b steps). The learning-rate schedule of background steps
starts where round r+1 starts (position r·L_site, L_site the site's own `local_steps`, as
`LocalTrainer.train` places rounds) and advances one position per step for the first L steps; the
steps after the L-th keep the L-th's learning rate, position r·L_site + L − 1, the last step of a
round r+1 of L steps (`LocalTrainer.background_step`): the schedule never runs into rounds the
federation has not reached (a cosine decay is not spent early, whatever the timing), a factor of 1
leaves it as it was, and the next round places it afresh.
This is the one-round-delayed outer step of Eager updates (Kale et al. 2025) and Streaming
DiLoCo (Douillard et al. 2025): the outer step that produced w_{r+1} is applied to the local model
one round late, so the ranks never wait for it. The update of round r+1 is still the delta from
the model the round names, Δ_{r+1} = θ_{r+1} − w_{r+1} (it includes p): SecAgg+ masks, codecs
and the coordinator's weighted mean see an ordinary update.

Progress is folded only into the round it was taken for (request round == r + 1). Otherwise it is
discarded and the round starts from its global model with the full `local_steps`: a site that
sat rounds out, a round trained again after the coordinator resumed (the local state was rewound
to its checkpoint), a trainer restarted from a local checkpoint (written when Δ_r was answered,
before any background step: the progress was never saved). Discarded steps are counted
(`overlap_discarded_steps`); their effect on the inner optimizer's state (momentum, Adam moments)
stays, as state always carries over from round to round.

The memory cost is one copy of this rank's exchanged tensors (θ_r, then p in place). Evaluation
requests between the reply and the next train request (a train message that evaluates first)
see the plain global model; the progress waits for the train request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger("sovfl.trainer")

Entry = tuple[str, torch.Tensor]
BackgroundStep = Callable[[int, bool], None]  # (round the step belongs to, first of this gap) -> one step


def background_budget(local_steps: int, factor: float | int | str | None) -> int:
    """How many background steps may follow the answer of a round of `local_steps` steps: at most
    `local_steps` x `factor` (`overlap_max_steps_factor`, rounded down, never below `local_steps`).
    A factor that is not a finite number >= 1 counts as 1 (the round config's own check refuses
    one before it gets here)."""
    try:
        f = float(factor if factor is not None else 1.0)
    except (TypeError, ValueError):
        f = 1.0
    if not 1.0 <= f <= 1000.0:  # NaN, inf, below 1: today's budget
        f = 1.0
    steps = max(0, int(local_steps))
    return max(steps, int(steps * f + 1e-9))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: its ZeRO shard of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class Overlap:
    """One rank's background training between a reply and the next request, and the fold-in.

    Collective where the step function is (`run`); `sent`, `freeze` and `fold` are local to each
    rank and every rank calls them at the same point of the same command.
    """

    def __init__(self) -> None:
        self.step_fn: BackgroundStep | None = None  # the loop's one optimizer step (LocalTrainer)
        self._saved: list[torch.Tensor] | None = None  # θ_r, then (after freeze) the progress p
        self.round = 0  # r: the round whose reply θ_r was
        self.budget = 0  # background steps allowed (the sent round's local_steps x overlap_max_steps_factor)
        self.steps = 0  # background steps taken since the reply
        self.seconds = 0.0
        self.frozen = False

    @property
    def pending(self) -> bool:
        """Background steps are due: a reply was sent with overlap on and no request came yet."""
        return self._saved is not None and not self.frozen and self.steps < self.budget

    def sent(self, entries: Sequence[Entry], round_no: int, budget: int) -> None:
        """After the update of `round_no` was packed: remember θ_r and allow `budget` steps."""
        self.clear()
        if self.step_fn is None or budget <= 0:
            return
        with torch.no_grad():
            self._saved = [_local(t).detach().clone() for _, t in entries]
        self.round, self.budget = round_no, budget

    def run(self, n: int) -> None:
        """Collective: `n` background optimizer steps (every rank runs the same n)."""
        assert self.step_fn is not None and self._saved is not None
        t0 = time.perf_counter()
        for _ in range(n):
            self.step_fn(self.round + 1, self.steps == 0)
            self.steps += 1
        self.seconds += time.perf_counter() - t0

    def freeze(self, entries: Sequence[Entry]) -> None:
        """A request arrived: p = θ_now − θ_r, kept until the train request (before any load)."""
        if self._saved is None or self.frozen:
            return
        with torch.no_grad():
            for (_, t), saved in zip(entries, self._saved):
                torch.sub(_local(t).detach(), saved, out=saved)
        self.frozen = True

    def fold(self, entries: Sequence[Entry], round_no: int) -> tuple[int, int, float]:
        """After the train request's global model w was loaded: θ ← w + p when the progress was
        taken for `round_no`; (steps folded in, steps discarded, their seconds). Clears the state."""
        if self._saved is None:
            return 0, 0, 0.0
        self.freeze(entries)
        folded = self.steps if round_no == self.round + 1 else 0
        if folded:
            with torch.no_grad():
                for (_, t), progress in zip(entries, self._saved):
                    _local(t).add_(progress)
        out = (folded, self.steps - folded, self.seconds)
        self.clear()
        return out

    def clear(self) -> None:
        self._saved, self.round, self.budget, self.steps, self.frozen = None, 0, 0, 0, False
        self.seconds = 0.0
