"""Tensors as they travel and as the coordinator keeps them.

bfloat16 tensors, which numpy lacks, travel as raw 2-byte words (`<u2`, site_trainer/layout.py):
half the bytes of float32, bit-exact. The coordinator keeps its global model and accumulates in
float32 (`to_master`): a sum of bf16 values in bf16 would lose the small updates of late rounds.
An update of a bf16 tensor may arrive as raw words (no codec) or as float32 (what a codec or the
SecAgg decoder gives back); both are checked against the tensor's master (float32) spec.
The dense global model goes down as bf16 words too (`WireCopy`): the site would round float32 to
bf16 on load anyway (round-to-nearest-even, as torch does), so it ends up with the same weights
for half the bytes. (With a downlink codec the codec's reference is float32, as for any model.)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from federation.protocol.codecs import Arrays
from federation.protocol.codecs.base import RAW_BF16, bf16_to_float32
from federation.protocol.codecs.floats import bf16_bits

Spec = dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype string, shape)


def master_dtype(wire: str) -> str:
    """The dtype the coordinator keeps a tensor that travels as `wire` in."""
    return "<f4" if np.dtype(wire) == RAW_BF16 else wire


def master_spec(spec: Spec) -> Spec:
    """`spec` (as updates travel) with bf16 words replaced by float32."""
    return {k: (master_dtype(d), s) for k, (d, s) in spec.items()}


def to_master(arrays: Arrays, spec: Spec) -> Arrays:
    """`arrays` with the tensors `spec` says travel as raw bf16 words, and that arrive so, as exact
    float32; anything else is returned as it is (a view, no copy), for `check_update` to judge."""
    out = {}
    for name, arr in arrays.items():
        wire = spec.get(name, (None,))[0]
        raw = wire is not None and np.dtype(wire) == RAW_BF16 and arr.dtype == RAW_BF16
        out[name] = bf16_to_float32(arr) if raw else arr
    return out


class WireView(Mapping):
    """The master model as it travels, each bf16 tensor rounded to words when it is read (and not
    kept): a writer that takes the tensors one at a time (the data path's offer file) never holds
    the wire copy whole; one that takes them all (a Flower message) holds what it serializes."""

    def __init__(self, master: Arrays, raw: frozenset[str]):
        self.master, self.raw = master, raw

    def __getitem__(self, name: str) -> np.ndarray:
        value = self.master[name]
        return bf16_bits(value) if name in self.raw else value

    def __iter__(self) -> Iterator[str]:
        return iter(self.master)

    def __len__(self) -> int:
        return len(self.master)


class WireCopy:
    """The master model as it travels down (bf16 tensors as words)."""

    def __init__(self, spec: Spec):
        self.raw = frozenset(k for k, (d, _) in spec.items() if np.dtype(d) == RAW_BF16)

    def of(self, master: Arrays) -> Arrays:
        """`master` with its bf16 tensors rounded to words as they are read (`master` itself when
        there are none). Nothing is cached: a copy kept beside the model would be half the
        model's size for a bf16 model, for the whole round."""
        if not self.raw:
            return master
        return WireView(master, self.raw)  # type: ignore[return-value]
