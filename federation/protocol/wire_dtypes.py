"""Tensors as they travel and as the coordinator keeps them.

bfloat16 tensors, which numpy lacks, travel as raw 2-byte words (`<u2`, site_trainer/layout.py):
half the bytes of float32, bit-exact. The coordinator keeps its global model and accumulates in
float32 (`to_master`): a sum of bf16 values in bf16 would lose the small updates of late rounds.
An update of a bf16 tensor may arrive as raw words (no codec) or as float32 (what a codec or the
SecAgg decoder gives back); both are checked against the tensor's master (float32) spec.
"""

from __future__ import annotations

import numpy as np

from federation.protocol.codecs import Arrays
from federation.protocol.codecs.base import RAW_BF16, bf16_to_float32

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
