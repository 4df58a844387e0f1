"""Per-round choice of the update codec and the local steps from a round target (`federation.round_target_s`).

Pure functions over given figures, so the rule is tested without a link: each sampled site's
measured link (protocol/link_probe.LinkFigures), its seconds per local step (from earlier rounds),
the bytes each candidate codec puts on the wire and the model's bytes down. The rule:

1. The codec: the first of the ladder (least lossy first) whose slowest site's transfer (model
   down, update up, and on the data path two round trips; LinkFigures.transfer_s) takes at most
   `link_share` of the target. If none does, the
   last (the most compressed) and the choice says the target is missed, by how much.
2. The local steps: as many as the slowest site can compute in what the transfer and the round's
   fixed cost (`fixed_s`: Flower's delivery of the messages, ClientApp start-up, aggregation, as
   measured in the last round) leave of the target (the site with the least room decides), within
   [min_steps, max_steps]. In round 1 a site's step time is its trainer's estimate from its start
   (a timed forward and backward pass); where a site gave none, the sites keep their own
   `local_steps`. With `overlap` (federation.overlap) a site's steps run while its update travels
   and the coordinator works (site_trainer/overlap.py): a round then takes about max(transfer +
   fixed, steps x step time), so the steps get the whole target and neither the transfer nor the
   fixed cost comes off it (subtracting them would leave the ranks idle for exactly the time
   overlap exists to fill).

Every choice carries its reason in words; the driver logs it and puts it in the metrics line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from federation.protocol.codecs import parse_codec
from federation.protocol.codecs.floats import Bf16Values, Fp16Values
from federation.protocol.codecs.quantize import StochasticInt
from federation.protocol.codecs.sparsify import RandK, TopK
from federation.protocol.link_probe import LinkFigures


def wire_bytes(spec: str, numel: int) -> int:
    """About how many bytes codec `spec` puts on the wire for an update of `numel` float32 values:
    the kept values at the quantizer's width plus per-block scales, plus top-k's indices (Rice-coded
    gaps: about log2(numel/k) + 2 bits each; int32: 4 bytes); random-k sends no indices (shared
    seed). An estimate for choosing; the driver prefers what a codec really sent in an earlier round."""
    codec = parse_codec(spec)
    k = codec.sparsifier.k(numel) if codec.sparsifier is not None else numel
    values = codec.values
    if isinstance(values, StochasticInt):
        body = math.ceil(k * values.bits / 8)
        if getattr(values, "clip", None) is None:
            body += 4 * math.ceil(k / values.block_size)
    elif isinstance(values, (Fp16Values, Bf16Values)):
        body = 2 * k
    else:
        body = 4 * k
    index = 0
    if isinstance(codec.sparsifier, TopK):
        coding = codec.config.index_coding
        index = 4 * k if coding == "int32" else math.ceil(k * (math.log2(max(numel / max(k, 1), 1.0)) + 2) / 8)
    elif isinstance(codec.sparsifier, RandK):
        index = 0
    return int(body + index)


@dataclass(frozen=True)
class RoundChoice:
    """What round `round` runs with, and why."""

    round: int
    codec: str
    local_steps: int | None  # None: each site's own local_steps
    slowest: str | None  # the site whose transfer is longest under the chosen codec
    transfer_s: float  # that site's predicted transfer (down, up, two round trips)
    compute_s: float | None  # the slowest site's predicted compute at the chosen steps (None: unknown)
    fixed_s: float  # the round's cost outside the link and the sites' training, as measured last round
    fits: bool  # the slowest transfer fits its share of the target
    reason: str
    transfers: dict[str, float] = field(default_factory=dict)  # codec -> slowest site's transfer, s

    def metrics(self) -> dict:
        """The choice as the metrics line and the run report show it."""
        out = asdict(self)
        out["transfer_s"] = round(self.transfer_s, 4)
        out["compute_s"] = None if self.compute_s is None else round(self.compute_s, 4)
        out["fixed_s"] = round(self.fixed_s, 4)
        out["transfers"] = {k: round(v, 4) for k, v in self.transfers.items()}
        return out


def choose(rnd: int, target_s: float, links: Mapping[str, LinkFigures], step_s: Mapping[str, float],
           ladder: Sequence[str], up_bytes: Mapping[str, float], down_bytes: float, *, link_share: float = 0.5,
           min_steps: int = 1, max_steps: int = 1000, fallback_codec: str | None = None,
           fixed_s: float = 0.0, overlap: bool = False, estimated: frozenset[str] = frozenset()) -> RoundChoice:
    """The codec and local steps of round `rnd` for the sites in `links` (see the module docstring).

    `up_bytes[codec]` is what one site's update takes under each codec of `ladder`, `down_bytes`
    the model's bytes down; `step_s[site]` a site's seconds per local step (absent: unknown);
    `fixed_s` what a round costs besides (it comes off the steps' time, not the link's share;
    under `overlap` neither it nor the transfer does: the steps run behind them); `estimated` the
    sites whose step time is their trainer's estimate from its start, not a round's measure.
    Without link figures the round keeps `fallback_codec` (or the ladder's first) and the sites'
    own steps."""
    if not ladder:
        raise ValueError("the codec ladder is empty")
    if not links:
        codec = fallback_codec or ladder[0]
        return RoundChoice(rnd, codec, None, None, 0.0, None, fixed_s, False,
                           f"no link figures for the round's sites: codec {codec}, the sites' own local_steps")
    budget = link_share * target_s
    per_codec = {c: {s: f.transfer_s(up_bytes[c], down_bytes) for s, f in links.items()} for c in ladder}
    slowest_of = {c: max(t.items(), key=lambda kv: kv[1]) for c, t in per_codec.items()}
    transfers = {c: slowest_of[c][1] for c in ladder}
    chosen = next((c for c in ladder if transfers[c] <= budget), None)
    fits = chosen is not None
    codec = chosen if fits else ladder[-1]
    slowest, transfer = slowest_of[codec]
    if fits:
        looser = ladder[ladder.index(codec) - 1] if ladder.index(codec) else None
        why = (f"codec {codec}: slowest site {slowest} moves the model and its update in {transfer:.2f}s, within "
               f"{link_share:.0%} of the {target_s:g}s target ({budget:.2f}s)"
               + (f"; {looser} would take {transfers[looser]:.2f}s" if looser else ""))
    else:
        why = (f"codec {codec} (the most compressed of {list(ladder)}): slowest site {slowest} still needs "
               f"{transfer:.2f}s to move the model and its update, over {link_share:.0%} of the {target_s:g}s "
               f"target ({budget:.2f}s) by {transfer - budget:.2f}s")
    known = {s: step_s[s] for s in links if s in step_s and step_s[s] > 0}
    if len(known) < len(links):
        missing = sorted(set(links) - set(known))
        return RoundChoice(rnd, codec, None, slowest, transfer, None, fixed_s, fits,
                           f"{why}; local steps: the sites' own (no step time yet for {', '.join(missing)})", transfers)
    left = {s: target_s if overlap else target_s - fixed_s - per_codec[codec][s] for s in links}
    room = {s: left[s] / known[s] for s in links}
    tight = min(room, key=room.get)
    steps = max(min_steps, min(max_steps, math.floor(room[tight]))) if room[tight] >= 1 else min_steps
    compute = max(steps * known[s] for s in links)
    per_step = f"{known[tight]:.3f}s per step" + (" (its trainer's estimate at start-up)" if tight in estimated else "")
    bound = (" (at the upper bound max_local_steps)" if steps == max_steps and room[tight] > max_steps else
             " (at the lower bound min_local_steps)" if steps == min_steps and room[tight] < min_steps + 1 else "")
    if overlap:
        why += (f"; {steps} local steps{bound}: site {tight} fills the {left[tight]:.2f}s target at "
                f"{per_step} (overlap: the steps run behind its {per_codec[codec][tight]:.2f}s "
                f"transfer and the round's fixed {fixed_s:.2f}s)")
    else:
        fixed = f" and the round's fixed {fixed_s:.2f}s" if fixed_s else ""
        why += (f"; {steps} local steps{bound}: site {tight} has {left[tight]:.2f}s left of the target after its "
                f"transfer{fixed} at {per_step}")
    return RoundChoice(rnd, codec, steps, slowest, transfer, compute, fixed_s, fits, why, transfers)
