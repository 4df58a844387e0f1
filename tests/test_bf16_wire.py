"""bfloat16 on the wire: a bf16 model's update travels as raw 2-byte words, and the coordinator keeps
and averages float32, through the real Coordinator, ClientApp mods (codec, SecAgg+ masking) and
Flower's serialization (in process; the trainer side of the raw words is tests/test_exchange.py).

The global model is 1.0 and each site's delta a few bf16 ulps of 2**-10: bf16 could not hold the
new model (1 + 2**-10 rounds to 1 in bf16), float32 holds it exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from federation.ops.inprocess import FunctionTrainer, task_identity
from federation.protocol.codecs.floats import bf16_bits
from federation.protocol import message_keys as keys
from federation.protocol.codecs import UpdateSpec
from federation.protocol.payload_records import array_bytes, to_records
from federation.protocol.pipeline import Payload
from federation.protocol.round_config import RoundConfig
from federation.protocol.wire_dtypes import to_master

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._fedsim import RUN_ID, coordinator, simulated_sites  # noqa: E402

SHAPES = {"w": (6, 5), "b": (5,)}
NUMEL = 35
STEPS = (2.0**-10, 3 * 2.0**-10)  # each site's delta (exact in bf16)
COUNTS = (10, 30)


def _trainer(s: int, workdir: Path, seen: list) -> FunctionTrainer:
    def train(glob: dict, config: RoundConfig):
        seen.append({k: v.dtype.str for k, v in glob.items()})
        return {k: bf16_bits(np.full(v.shape, STEPS[s], np.float32)) for k, v in glob.items()}, {"loss": 1.0}
    return FunctionTrainer(train, COUNTS[s], workdir / f"site{s}")


@pytest.mark.parametrize("federation, upload, down", [
    ({}, 2 * NUMEL, "<u2"),  # raw words both ways: half of float32
    ({"codec": "bf16"}, 2 * NUMEL, "<u2"),  # a codec reads the words as their float32 values
    ({"secagg": {"enabled": True, "clip": 1.0}}, 4 * (NUMEL + 1), "<u2"),  # masked ring words (+ the weight)
    ({"downlink_codec": "int8"}, 2 * NUMEL, "<f4"),  # a downlink codec's reference is float32
    ({"strategy": "diloco", "secagg": {"enabled": True, "clip": 1.0}}, 4 * (NUMEL + 1), "<u2"),  # outer Nesterov
])
def test_bf16_updates_travel_as_words_and_average_in_float32(tmp_path, federation, upload, down):
    initial = {k: bf16_bits(np.ones(s, np.float32)) for k, s in SHAPES.items()}  # as initial_weights gives bf16
    seen: list = []
    sites = simulated_sites([_trainer(s, tmp_path, seen) for s in range(2)], 0)
    with task_identity(RUN_ID):
        coord = coordinator(tmp_path, initial, sites, rounds=1, quorum=2, update_kind="delta", **federation)
        assert all(v.dtype == np.float32 and (v == 1.0).all() for v in coord.model.values())  # float32 master
        line = coord.run_round(1)
    assert line["status"] == "aggregated", line["failed"]
    assert line["rejections"] == {}
    assert seen == [{"w": down, "b": down}] * 2
    if down == "<u2":  # the master rounded to bf16 words: what the trainer would have made of float32
        def sent(arrays: dict) -> int:  # bytes of the GLOBAL record (array data and .npy headers)
            return array_bytes(to_records(Payload(arrays), keys.GLOBAL, keys.DOWNLINK).array_records[keys.GLOBAL])

        assert set(line["downlink"]["bytes"].values()) == {sent(initial)}
        assert sent({k: np.ones(s, np.float32) for k, s in SHAPES.items()}) - sent(initial) == 2 * NUMEL
    assert [s["upload_bytes"] for s in line["sites"].values()] == [upload, upload]
    scale = 0.7 * 1.5 if federation.get("strategy") == "diloco" else 1.0  # a first outer step: lr (1 + momentum)
    mean = scale * (COUNTS[0] * STEPS[0] + COUNTS[1] * STEPS[1]) / sum(COUNTS)
    bound = scale * line["secagg"]["error_bound"] if "secagg" in line else 0.0
    for k, v in coord.model.items():
        assert v.dtype == np.float32
        np.testing.assert_allclose(v, 1.0 + mean, rtol=0, atol=bound)
        assert (v != 1.0).all()  # in bf16 the update would have vanished


def test_raw_words_become_float32_only_where_the_model_travels_so():
    spec = {"w": ("<u2", (2,)), "f": ("<f4", (2,))}
    words = bf16_bits(np.array([1.5, -2.0], np.float32))
    out = to_master({"w": words, "f": words}, spec)
    assert out["w"].dtype == np.float32 and out["w"].tolist() == [1.5, -2.0]
    assert out["f"] is words  # a float32 tensor sent as words is left for check_update to refuse
    flat = UpdateSpec.of({"w": words}).flatten({"w": words})  # what the codecs and SecAgg read
    assert flat.dtype == np.float32 and flat.tolist() == [1.5, -2.0]
    nan = words.copy()
    nan[0] = 0x7FC0
    with pytest.raises(Exception, match=r"\['w'\] contain NaN"):
        UpdateSpec.of({"w": nan}).flatten({"w": nan})
