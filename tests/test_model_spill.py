"""The global model on disk while a SecAgg+ round holds its ring (federation/coordinator/model_spill.py,
the coordinator's memory at scale): the step written into the mean's (the ring's) arrays is the
in-place step bit for bit, a round that takes no step gets its model back in memory, and the
coordinator side of a real SecAgg+ round holds the ring, not the ring and the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from federation.coordinator.aggregate import ServerOptimizer
from federation.coordinator.model_spill import restore_model, spill_model

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"emb": (1000, 700), "w": (3, 5), "b": (0,), "s": (), "big": (5_000_001,)}  # 5M: more than one slice


def _arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


@pytest.mark.parametrize("kind,lr", [("delta", 1.0), ("delta", 0.7), ("weights", 1.0), ("weights", 0.3)])
def test_the_step_into_the_mean_is_the_in_place_step_bit_for_bit(tmp_path, kind, lr):
    opt = ServerOptimizer("fedavg", kind, lr)
    expected = opt.step(_arrays(1), _arrays(2), consume=True, in_place=True)  # the model in memory
    model, mean = _arrays(1), _arrays(2)
    assert spill_model(model, tmp_path) > 0
    assert not list(tmp_path.iterdir())  # unlinked once mapped: it goes with the last map
    assert all(not a.flags.writeable for a in model.values())
    targets = {k: v for k, v in mean.items()}
    got = opt.step(model, mean, consume=True, in_place=True)
    assert list(got) == list(SHAPES)
    for k, v in got.items():
        assert v.dtype == np.float32 and v.shape == SHAPES[k]
        assert np.array_equal(v.view(np.uint32), expected[k].view(np.uint32)), k
        assert np.shares_memory(v, targets[k]) or v.size == 0  # written into the mean's own array
        assert v.flags.writeable


def test_spill_then_restore_gives_the_same_model_in_memory(tmp_path):
    model = _arrays(3)
    before = {k: v.copy() for k, v in model.items()}
    held = model  # the driver's dict: changed in place, every holder sees it
    assert spill_model(model, tmp_path) > 0
    assert spill_model(model, tmp_path) == 0  # already on disk
    assert held is model and all(np.array_equal(model[k], before[k]) for k in before)
    restore_model(model)
    for k, v in model.items():
        assert v.flags.writeable and np.array_equal(v, before[k]) and v.shape == before[k].shape
    restore_model(model)  # nothing spilled: nothing done
    assert all(np.array_equal(model[k], before[k]) for k in before)


def test_a_disk_that_refuses_the_model_leaves_it_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model = _arrays(4)
    arrays = dict(model)
    assert spill_model(model, blocker / "spill") == 0
    assert all(model[k] is arrays[k] for k in model)


PROBE = """
import json, mmap, sys
from pathlib import Path
import numpy as np
from crypto.secagg import SecAggClient, SecAggConfig, SecAggServer, new_context
from crypto.secagg.simulation import make_plan
from federation.coordinator.aggregate import ServerOptimizer
from federation.coordinator.model_spill import spill_model
from federation.coordinator.secagg_round import in_ring_mean
from federation.protocol.codecs import UpdateSpec
from federation.protocol.malloc_policy import return_freed_tensors

def vm(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

work, params = Path(sys.argv[1]), int(sys.argv[2])
return_freed_tensors()  # as the ServerApp does
for i in (1, 2):  # the sites' updates, in files: their pages are dropped as the clients read them
    rng = np.random.default_rng(i)
    with open(work / f"u{i}.f32", "wb") as f:
        for lo in range(0, params, 1 << 22):
            f.write((rng.standard_normal(min(1 << 22, params - lo), dtype=np.float32) * 1e-2).tobytes())
cfg = SecAggConfig(threshold=2, clip=0.5)
plan, channel = make_plan(cfg, new_context("t", 1), [1, 2])  # (warms the crypto imports before the baseline)
base = vm("VmRSS")
model = {"emb": np.full((params // 2,), 0.5, np.float32), "rest": np.full((params - params // 2,), 0.25, np.float32)}
server = SecAggServer(cfg, plan, vector_len=params)
clients = {}
for i in (1, 2):
    clients[i], setup = SecAggClient.setup(cfg, plan, i, channel[i])
    server.receive_setup(i, setup)
live = server.close_setup(weight_bound=100)
spill_model(model, work / "spill")  # what SecAggRound does once the train messages are built
for i in live:
    x = np.memmap(work / f"u{i}.f32", np.float32, "r")
    for offset, words in clients[i].masked_input(server.masked_input_request(i), x, 10 + i):
        server.add_masked_chunk(i, offset, words)
        x._mmap.madvise(mmap.MADV_DONTNEED)
    del x
for i in server.close_masked_input():
    server.receive_unmask(i, clients[i].unmask(server.unmask_request(i)))
result = server.finish()
mean = in_ring_mean(result, UpdateSpec.of(model))
del result
model = ServerOptimizer("fedavg", "delta", 1.0).step(model, mean, consume=True, in_place=True)
peak = vm("VmHWM")
u = (np.fromfile(work / "u1.f32", np.float32, 1000) * 11 + np.fromfile(work / "u2.f32", np.float32, 1000) * 12) / 23
print(json.dumps({"model": params * 4, "above": peak - base, "close": float(np.abs(model["emb"][:1000] - 0.5 - u).max())}))
"""


def test_a_secagg_rounds_coordinator_side_holds_the_ring_not_the_ring_and_the_model(tmp_path):
    """Peak RSS of a fresh process running the coordinator's side of a real SecAgg+ round (the
    crypto server's ring, two real clients masking chunk by chunk, the sum decoded into the ring,
    FedAvg's step) over a ~128 MB model, above the process before the model was made: the ring and
    windows once the model is on disk (the previous path held the model and the ring: over 2 x)."""
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), str(32_000_000)], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["close"] < 1e-3  # the new model is the old one plus the weighted mean (fixed-point error aside)
    assert got["above"] < 1.6 * got["model"], got
