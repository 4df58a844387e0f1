"""TEST HOOK, inert in production: announce each stage a round enters, and pause at one.

Fault-injection tests need to SIGKILL the coordinator *inside* a given stage (e.g. between a SecAgg
round's masked input and its unmask), which watching logs from outside cannot land reliably. With

  SOVFL_TEST_STAGE_HOOK=<file>    the ServerApp appends one JSON line per stage it enters: round,
                                  stage, pid and, in a SecAgg round, the digest of the round's
                                  SecAgg context and of each site's setup (the round's key material);
  SOVFL_TEST_STAGE_PAUSE=<r>:<s>  after announcing the first stage of round r whose name starts with
                                  s (e.g. "2:secagg stage 4"), it waits up to PAUSE_S before going
                                  on: the test kills it there, or lets it go on at once by creating
                                  `<file>.release` (a test waiting for a site to come back).

Neither variable is set in production: then `entered` is one environment lookup per stage.
Used by tests/test_e2e_resume.py, tests/fault_soak.py and the restart tests (tests/faults.py:
wait_for_stage, release_stage).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

HOOK = "SOVFL_TEST_STAGE_HOOK"
PAUSE = "SOVFL_TEST_STAGE_PAUSE"
PAUSE_S = 120.0  # a test that never kills does not hang the run: it goes on after this


def entered(stage: str, state: object = None, rnd: int | None = None) -> None:
    """The driver enters `stage` of round `rnd` (default: the round `state` belongs to; see the
    module docstring). Stages: each exchange's name, "aggregate" (the strategy's finish) and
    "checkpoint" (the round's checkpoint write)."""
    path = os.environ.get(HOOK)
    if not path:
        return
    inp = getattr(state, "inp", None)
    if rnd is None and inp is not None:
        rnd = inp.ctx.round
    line: dict = {"round": rnd, "stage": stage, "pid": os.getpid()}
    setups = getattr(state, "setups", None)
    if setups is not None and setups.plan is not None:
        line["secagg_ctx"] = setups.plan.ctx.digest().hex()
        line["setups"] = {site: hashlib.sha256(data).hexdigest()[:32] for site, (data, _) in setups.setups.items()}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())
    want_round, _, want_stage = os.environ.get(PAUSE, "").partition(":")
    if want_stage and want_round == str(rnd) and stage.startswith(want_stage):
        end = time.monotonic() + PAUSE_S
        while time.monotonic() < end and not os.path.exists(path + ".release"):
            time.sleep(0.2)
