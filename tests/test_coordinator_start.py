"""The coordinator's initial model (site_trainer.workloads.coordinator_start): the same arrays as
a plain copy of a fresh build, each its own copy, and built without holding the model twice (the start-up
is otherwise the ServerApp's peak)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch.nn as nn

from site_trainer import layout
from site_trainer.config import WorkloadConfig
from site_trainer.workloads import _take_exchanged, coordinator_model, coordinator_start

ROOT = Path(__file__).resolve().parents[1]


def test_same_arrays_as_a_plain_copy_of_a_fresh_build():
    cfg = WorkloadConfig(task="slm", options={"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32})
    initial, manifest = coordinator_start(cfg, seed=3)
    model, names = coordinator_model(cfg, 3)
    entries = layout.named_tensors(model)
    assert list(initial) == [s.name for s in layout.Layout.of(model, names).exchanged]
    for name, arr in initial.items():
        expected = layout.to_wire(entries[name].detach().contiguous()).copy()
        assert arr.dtype == expected.dtype and arr.shape == expected.shape and np.array_equal(arr, expected), name
    lay = layout.Layout.of(model, names)
    digest = layout.FrozenDigest()
    for name in lay.frozen:
        digest.update(name, entries[name].detach())
    assert manifest == lay.manifest(digest)  # what a site's trainer reports of the same build


def test_tied_tensors_are_copied_before_their_memory_goes_and_stay_independent():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as language models tie their embedding and output layer
    expected = emb.weight.detach().clone().numpy()  # not .numpy() of the weight itself: that would pin its storage
    out = _take_exchanged({"emb": emb.weight, "head": head.weight, "other": nn.Linear(2, 2).weight}, ["emb", "head", "other"])
    assert np.array_equal(out["emb"], expected) and np.array_equal(out["head"], expected)
    out["emb"][0, 0] += 1.0
    assert out["head"][0, 0] == expected[0, 0]  # copies, not views of one another
    assert emb.weight.untyped_storage().size() == 0  # released once its last name was taken


PROBE = """
import json, resource, sys
import numpy as np
from site_trainer.config import WorkloadConfig
from site_trainer.workloads import coordinator_start
cfg = WorkloadConfig(task="slm", options={"n_layer": 6, "n_embd": 512, "n_head": 8, "block_size": 64})
coordinator_start(WorkloadConfig(task="slm", options={"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 16}), 0)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
initial, _ = coordinator_start(cfg, 0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"model": sum(a.nbytes for a in initial.values()), "above": peak - base}))
"""


def test_start_up_holds_the_model_about_once():
    """Peak RSS of a fresh process building a ~20M-parameter slm model (float32, ~80 MB) above the
    same process after a tiny one: one copy plus one tensor, not two models."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["model"] > 50e6
    assert got["above"] < 1.45 * got["model"], got
