"""The test seam: every hook the fault and resume tests use, inert in production.

Fault-injection tests must kill the coordinator inside a given stage, make a site sit out a
round, and reproduce a site's random rounding, none of which watching logs from outside can do
reliably. Each hook is off unless a test switches it on, and each is read here or named here:

- `SOVFL_TEST_STAGE_HOOK=<file>` (environment of the ServerApp): `stage_entered` appends one JSON
  line per stage a round enters: round, stage, pid and, in a SecAgg round, the digest of the
  round's SecAgg context and of each site's setup (the round's key material). Stages: each
  exchange's name, "aggregate" (the strategy's finish) and "checkpoint" (the round's checkpoint).
- `SOVFL_TEST_STAGE_PAUSE=<r>:<s>`: after announcing the first stage of round r whose name starts
  with s (e.g. "2:secagg stage 4"), the ServerApp waits up to PAUSE_S before going on: the test
  kills it there, or lets it go on at once by creating `<file>.release`.
- node config `absent-rounds="3,7"` (a SuperNode's): `absent` makes the site answer the train
  messages of those rounds with a failure, as if it had been down; tests/fault_soak.py runs its
  reference with the rounds each site missed in the killed run, so that both runs aggregate the
  same sites in every round and compare bit for bit.
- `SOVFL_TEST_CODEC_SITE_SEED` (a site's environment, like the simulation's node config
  `codec-site-seed`): a fixed seed for the site's stochastic rounding (its codec's and SecAgg's
  fixed point, federation/site/codec_mod.py), so that two runs compare bit for bit.

Used by tests/faults.py (`stage_hook_env`, `wait_for_stage`, `release_stage`), tests/fault_soak.py,
tests/test_e2e.py and tests/test_e2e_resume.py. Switched off, `stage_entered` is one environment
lookup per stage and `absent` one node-config lookup per train message.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping

STAGE_HOOK = "SOVFL_TEST_STAGE_HOOK"
STAGE_PAUSE = "SOVFL_TEST_STAGE_PAUSE"
PAUSE_S = 120.0  # a test that never kills does not hang the run: it goes on after this
ABSENT_ROUNDS = "absent-rounds"


def stage_entered(stage: str, state: object = None, rnd: int | None = None) -> None:
    """The coordinator enters `stage` of round `rnd` (default: the round `state` belongs to)."""
    path = os.environ.get(STAGE_HOOK)
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
    want_round, _, want_stage = os.environ.get(STAGE_PAUSE, "").partition(":")
    if want_stage and want_round == str(rnd) and stage.startswith(want_stage):
        end = time.monotonic() + PAUSE_S
        while time.monotonic() < end and not os.path.exists(path + ".release"):
            time.sleep(0.2)


def absent(node_config: Mapping, rnd: int) -> str | None:
    """Why this site sits out round `rnd` (node config `absent-rounds`), or None."""
    spec = str(node_config.get(ABSENT_ROUNDS, "") or "")
    rounds = {int(x) for x in spec.split(",") if x.strip()}
    return f"test fault injected: absent from round {rnd} (node config absent-rounds)" if rnd in rounds else None
