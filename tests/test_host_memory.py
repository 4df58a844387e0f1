"""The host-memory policy of ZeRO ranks on the CPU (site_trainer/host_memory.py), in fresh processes.

The pattern a ZeRO rank lives on: large tensors allocated and freed again between small ones that
stay (here numpy arrays, which come from the same malloc as torch's CPU tensors).
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

CHURN = """
import json, sys
import numpy as np
from pathlib import Path
from site_trainer import host_memory

def rss():
    return int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:")).split()[1]) * 1024

applied = host_memory.return_freed_memory_eagerly() if sys.argv[1] == "policy" else None
np.ones(2**16).sum()  # one large block freed: glibc's defaults now serve blocks this size from the heap
with host_memory.long_lived():
    kept = np.ones(2**15)        # a long-lived tensor, placed in the heap; the policy is back after it
base = rss()
big, small = [], []
for _ in range(200):
    big.append(np.ones(2**15))   # 256 KiB, like a gathered block's tensors
    small.append(np.ones(64))    # 512 B that stays, like bookkeeping between them
del big
print(json.dumps({"applied": applied, "left_mib": (rss() - base) / 2**20}))
"""


def _left_after_free(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_freed_large_tensors_leave_the_resident_set_only_under_the_policy():
    default, policy = _left_after_free("default"), _left_after_free("policy")
    assert policy["applied"] is True
    assert default["left_mib"] > 30  # 50 MiB freed, still resident: heap holes between live blocks
    assert policy["left_mib"] < 5
