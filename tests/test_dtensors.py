"""DTensor checks without the DTensor package: a rank that never shards does not import it, and
the checks still tell a real DTensor (FSDP2's kind) from a plain tensor once it exists."""

import subprocess
import sys

import torch

from site_trainer.dtensors import gathered, is_dtensor, local_part


def test_a_rank_that_does_not_shard_never_imports_the_dtensor_package():
    """What a rank imports to train under DDP or alone: the service, the built-in loop, a local
    checkpoint's module. The package (sympy, symbolic shapes) is the largest cost after torch."""
    code = ("import sys\n"
            "import site_trainer.service, site_trainer.local_trainer, site_trainer.local_checkpoint\n"
            "heavy = [m for m in ('torch.distributed.tensor', 'torch.distributed.checkpoint', 'sympy') "
            "if m in sys.modules]\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", f"imported at start: {out.stdout.strip()}; stderr: {out.stderr[-2000:]}"


def test_plain_tensors_are_not_dtensors_and_pass_through():
    t = torch.arange(6.0)
    assert not is_dtensor(t)
    assert local_part(t) is t
    assert gathered(t) is t


def test_a_real_dtensor_is_told_apart_and_gathered(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(12.0).reshape(4, 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    assert is_dtensor(sharded)
    assert not is_dtensor(sharded.to_local())
    assert torch.equal(local_part(sharded), full)  # one rank holds the whole dim-0 range
    assert not is_dtensor(gathered(sharded))
    assert torch.equal(gathered(sharded), full)
