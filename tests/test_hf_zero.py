"""hf-causal-lm under ZeRO as the framework runs it: built on the meta device on every rank, sharded
by decoder layer with FSDP2, rank 0's weights streamed in, trained: the same weights as one process.

One 2-rank torchrun (tests/hf_zero_worker.py, gloo on CPU) runs every case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from hf_models import gpt2_dir, llama_dir, write_corpus  # noqa: F401 - fixtures

CASES = {  # name: (lora, dtype of the frozen base, reshard_after_forward: zero3 if True, zero2 if False)
    "lora-zero3": ({"r": 4, "dropout": 0.0}, "float32", True),
    "lora-bf16base-zero2": ({"r": 4, "dropout": 0.0}, "bfloat16", False),
    "full-zero3": (None, "float32", True),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory, llama_dir, gpt2_dir):  # noqa: F811
    tmp = tmp_path_factory.mktemp("hfzero")
    write_corpus(tmp / "corpus", files=3, bytes_per_file=4000)
    cases = [json.dumps({"name": f"{arch}-{name}", "model_dir": str(d), "corpus": str(tmp / "corpus" / "*"),
                         "lora": lora, "dtype": dtype, "reshard": reshard})
             for arch, d in (("llama", llama_dir), ("gpt2", gpt2_dir))
             for name, (lora, dtype, reshard) in CASES.items()]
    out = tmp / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(ROOT / "tests" / "hf_zero_worker.py"), str(out), str(tmp / "work"), *cases],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sharded_training_from_a_meta_build_equals_one_process(results, arch, case):
    r = results[f"{arch}-{case}"]
    assert r["units"] == 2  # each decoder layer its own unit, found from _no_split_modules
    assert r["moved"] > 1e-3  # the steps really trained
    assert r["diff"] <= 1e-6, r
    assert r["tied"] is (arch == "gpt2")  # GPT-2's head stays its embedding through sharding
