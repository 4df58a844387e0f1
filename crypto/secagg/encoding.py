"""Fixed-point encoding of weighted float updates into Z_{2^b}, and decoding of their sum.

Scheme (the same clip range `c` for all sites, from the config):
  levels L = floor((2^b - 1) / (n * W))     n = clients in the round, W = max integer weight
             (or, ring width chosen for given levels: b = bit length of n * W * L, `for_levels`)
  t_i      = (clip(x_i, -c, c) + c) * L / (2c)           in [0, L]
  v_i      = stochastic_round(w_i * t_i)                  in [0, w_i * L]  (w_i integer, 0 <= w_i <= W)
and the ring vector of a client is [v_i (P words), w_i (1 word)]. The server learns
S = sum v_i and w = sum w_i over the m <= n contributing clients; S <= n * W * L <= 2^b - 1, so the
sum never wraps. Decoding: mean = S * 2c / (L * w) - c, the w-weighted mean of the clipped inputs.

Rounding is floor(y + U) with U = r / 2^16 and r uniform 16-bit words from an AES-CTR stream
(prg.py) keyed by 16 bytes drawn from a seeded numpy Generator (reproducible) or os.urandom: the
same PRG as the masks, several times faster than numpy's float generators. 16 bits of noise make
the rounding probability exact to 2^-16, i.e. a bias below 2^-16 of a step. y is computed in
float64 (w * L * x needs up to 32 integer bits plus the 16 bits the noise acts on).

Weighting happens before rounding (rounding w_i * t_i rather than multiplying an already rounded
t_i by w_i), so each client adds at most one unit of error however large its weight.

Error bound, per coordinate (`FixedPointCodec.error_bound`):
  |decoded - sum_i w_i clip(x_i) / w|  <=  m * 2c / (L * w)  +  c * 2^-23
(stochastic rounding moves each v_i by at most 1; dividing by w * L / 2c; the last term covers
rounding the float64 result to float32). With w_i >= 1, m / w <= 1, so the bound is at most one
quantization step 2c / L. Stochastic rounding makes the error zero-mean (up to 2^-16 of a step), so it does not bias the average round after round.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from . import ring
from .errors import SecAggConfigError
from .prg import expand


def _reject_nan(x: np.ndarray) -> None:
    if np.isnan(x).any():
        raise ValueError("the update contains NaN")


def noise_key(rng: np.random.Generator | None) -> bytes:
    """AES-128 key of the rounding noise stream: from `rng` (reproducible) or os.urandom."""
    return rng.bytes(16) if rng is not None else os.urandom(16)


@dataclass(frozen=True)
class FixedPointCodec:
    """Encoder/decoder shared by all sites of a round (same clip, bits, levels)."""

    clip: float
    bits: int
    levels: int
    max_weight: int

    @classmethod
    def for_round(cls, clip: float, bits: int, max_weight: int, n_clients: int) -> FixedPointCodec:
        """Pick the most levels such that n_clients inputs of weight <= max_weight cannot wrap."""
        ring.check_bits(bits)
        if clip <= 0 or not np.isfinite(clip):
            raise SecAggConfigError("clip must be a positive finite number")
        levels = ((1 << bits) - 1) // (n_clients * max_weight)
        if levels < 2:
            raise SecAggConfigError(
                f"a {bits}-bit ring cannot hold {n_clients} inputs of weight <= {max_weight} "
                "with 2 or more quantization levels: raise bits or lower max_weight"
            )
        return cls(float(clip), bits, levels, max_weight)

    @classmethod
    def for_levels(cls, clip: float, levels: int, max_weight: int, n_clients: int) -> FixedPointCodec:
        """The narrowest ring that sums n_clients inputs of `levels` levels and weight <= max_weight
        without wrapping: b = bit length of n * W * L (at least 8 bits). When the values are
        already on the grid of L steps over [-clip, clip] (a clip-and-scale integer codec with the
        same clip), encoding them adds no rounding error at all."""
        if clip <= 0 or not np.isfinite(clip):
            raise SecAggConfigError("clip must be a positive finite number")
        if levels < 2:
            raise SecAggConfigError(f"levels must be at least 2, got {levels}")
        bits = max(ring.MIN_BITS, (n_clients * max_weight * levels).bit_length())
        if bits > ring.MAX_BITS:
            raise SecAggConfigError(
                f"{n_clients} inputs of weight <= {max_weight} at {levels} levels need a {bits}-bit ring, more "
                f"than {ring.MAX_BITS}: lower max_weight or use a coarser codec"
            )
        return cls(float(clip), bits, int(levels), max_weight)

    def check_round(self) -> None:
        """Refuse parameters under which one input's words, or its weight word, could leave the ring
        (a site checks what the coordinator announces before it encodes anything)."""
        ring.check_bits(self.bits)
        if not (self.clip > 0 and np.isfinite(self.clip)) or self.levels < 2 or self.max_weight < 1:
            raise SecAggConfigError(f"unusable fixed-point parameters {self}")
        if self.levels * self.max_weight > (1 << self.bits) - 1:
            raise SecAggConfigError(f"{self.levels} levels x weight {self.max_weight} do not fit a {self.bits}-bit ring")

    @property
    def step(self) -> float:
        """One quantization step in float units: 2c / L."""
        return 2.0 * self.clip / self.levels

    def check_weight(self, weight: int) -> int:
        if isinstance(weight, bool) or int(weight) != weight or not 0 <= weight <= self.max_weight:
            raise ValueError(f"weight must be an integer in [0, {self.max_weight}], got {weight!r}")
        return int(weight)

    def encode_into(self, x: np.ndarray, weight: int, out: np.ndarray, noise: np.ndarray, scratch: np.ndarray) -> None:
        """Encode the float piece `x` into uint32 `out`: five in-place passes and a max, no temporaries.

        `noise` holds len(x) uniform uint16 words r (U = r / 2^16 drives the rounding); `scratch`
        is a float64 buffer of at least len(x). Computes floor(x * s + r / 2^16 + W / 2) with
        s = W / 2c, W = weight * levels, working in units of 2^-16 so that r adds as an integer.

        Clipping is checked on the result rather than scanned for beforehand: an in-range x gives
        v in [0, W]; a value above the range gives W (what clipping gives) or more, one below it 0
        or a negative (wrapping past 2^31), and NaN/inf give 2^31, so `max(out) > W` flags exactly
        the pieces whose result differs from the clipped one; only those are encoded again,
        clipped, from the same noise. A NaN raises ValueError, so no scan for NaN is needed
        beforehand either. Run it under `np.errstate(invalid="ignore")`: the first conversion of
        such a piece sets that flag.
        """
        n = x.shape[0]
        t = scratch[:n]
        top = weight * self.levels
        if top == 0:  # weight 0: every word is floor(U) = 0 (and inf * 0 must not become NaN)
            _reject_nan(x)
            out[:] = 0
            return
        s = top / (2.0 * self.clip) * 65536.0
        for clip in (False, True) if self._checkable else (True,):
            np.copyto(t, x)  # then scale in float64: x * s in float32 would round w*L*x/2c to 24 bits
            np.multiply(t, s, out=t)
            if clip:
                _reject_nan(x)
                np.clip(t, -top * 32768.0, top * 32768.0, out=t)  # +-inf clip too
            self._round_into(t, noise, top, out)
            if clip or int(out.max()) <= top:
                return

    @property
    def _checkable(self) -> bool:
        """Whether every encoded word is below 2^31, so int32 conversion and the range check apply."""
        return self.levels * self.max_weight < 1 << 31

    def _round_into(self, t: np.ndarray, noise: np.ndarray, top: int, out: np.ndarray) -> None:
        """out = floor(t / 2^16 + noise / 2^16 + top / 2), t scaled x (float64, overwritten)."""
        np.add(t, noise, out=t)
        np.multiply(t, 2.0**-16, out=t)
        # t + top/2 >= 0 when in range: truncation is floor. Below 2^31 the float -> int32
        # conversion is the fast SIMD one (NaN and overflow give INT_MIN = 2^31 as uint32).
        dst = out.view(np.int32) if self._checkable else out
        np.add(t, top / 2.0, out=dst, casting="unsafe")

    def encode(self, x: np.ndarray, weight: int, rng: np.random.Generator) -> np.ndarray:
        """The whole ring vector [v (P words), weight] of one client (tests, small vectors)."""
        w = self.check_weight(weight)
        x = np.asarray(x).reshape(-1)
        p = x.shape[0]
        out = np.empty(p + 1, dtype=np.uint32)
        noise = expand(noise_key(rng), (p + 1) // 2).view(np.uint16)[:p]  # half-word i: parameter i
        with np.errstate(invalid="ignore"):
            self.encode_into(x, w, out[:-1], noise, np.empty(p))
        out[-1] = w
        return out

    def decode_into(self, ring_sum: np.ndarray, weight_total: int, out: np.ndarray) -> None:
        """Weighted mean of the clipped inputs from a chunk of the unmasked sum."""
        if weight_total <= 0:
            raise ValueError("the total weight of the contributors is 0: nothing to average")
        mean = ring_sum * (self.step / weight_total)  # float64, one chunk at a time
        mean -= self.clip
        np.copyto(out, mean, casting="same_kind")

    def decode(self, ring_vector: np.ndarray) -> np.ndarray:
        """Float32 mean from a whole unmasked sum [S (P words), w] (tests, small vectors)."""
        out = np.empty(ring_vector.shape[0] - 1, dtype=np.float32)
        self.decode_into(ring_vector[:-1], int(ring_vector[-1]), out)
        return out

    def error_bound(self, contributors: int, weight_total: int) -> float:
        """Max per-coordinate |decoded - weighted mean of clipped inputs| (see module doc)."""
        return contributors * self.step / weight_total + self.clip * 2.0**-23
