"""Resume a run from its last completed round (`sovfl coordinator --resume`, `sovfl simulate --resume`).

After every round (aggregated or skipped) the driver writes the round's checkpoint of its `RunState`
(`checkpoint_job`: on a thread of its own while the next round goes on, checkpoint_writer.py),
before the round's metrics line reaches metrics.jsonl. The checkpoint (checkpoint.py) holds everything the next
round depends on, so a resumed run is the run that would have happened:

- the global model and the server optimizer's state (FedAdam/FedYogi moments, DiLoCo's momentum
  buffer);
- the round number; the seed schedule (`round_seed` of every round done, checked on resume
  against this code's schedule, so an upgrade that changed it is caught, not silently mixed);
- the downlink reference model, its encoded steps and step counter (sites train on the
  reference; its next step is seeded by the counter);
- the run-wide rejection counts and the metrics history: on resume metrics.jsonl is rewritten
  from the checkpoint, so each round appears exactly once whatever the moment of the crash;
- the configuration: a resume under a different configuration is refused, naming each field
  that changed (only `federation.deadlines`, `federation.checkpoint_keep`,
  `federation.site_restarts`, `federation.data_path` and `federation.receive_workers` may change:
  they do not enter the computation).

What is deliberately not restored, and why:

- The round that was in flight is run again from its start. With secure aggregation it is a new
  SecAgg+ round: the resumed ServerApp is a new Flower run, every stage message and signed
  envelope binds (federation, Flower run, round), and sites make fresh key pairs, seeds and masks
  for it; a masked vector or key share of the dead round is refused by the replay checks of the
  new one. Reusing the dead round's state would be unsafe: a site whose masked input reached the
  old coordinator, re-masked with the same pairwise seeds but a different update, would let the
  difference of the two masked vectors reveal the difference of its updates. Fresh keys make
  each masked vector a one-time pad again.
- Attested admission is redone: every site is re-attested on fresh nonces at the first resumed
  round. A restarted coordinator trusts evidence, not a file that claims a site was admitted.
- What each site reported holding of the downlink model (node ids may change over a restart):
  each site says again at discovery whether its store holds the restored reference (then it is
  sent nothing, site/downlink_mod.py `offer_held`); any other gets the full reference once, which
  is bit for bit what it would have rebuilt.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from crypto.durable import write_atomic
from federation.config.schema import ConfigError
from federation.coordinator.checkpoint import Checkpoint, CheckpointError, CheckpointStore
from federation.coordinator.run_state import RunState
from federation.protocol.codecs.base import Encoded
from federation.protocol.downlink_steps import Step, model_digest
from federation.protocol.update_codec import round_seed

RESUMABLE = ("federation.deadlines", "federation.checkpoint_keep", "federation.site_restarts",
             "federation.data_path", "federation.receive_workers")  # may differ on resume


class ResumeRefused(ConfigError):
    """The run cannot be resumed as asked (another configuration, a model of another shape, ...)."""


# ---- configuration ---------------------------------------------------------------------------
def config_document(cfg) -> dict:
    """The configuration as the JSON document checkpoints keep."""
    return json.loads(cfg.model_dump_json())


def changed_fields(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two JSON documents differ (`sites[1].lr`, `federation.rounds`)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                out.append(path)
            else:
                out += changed_fields(old[key], new[key], path)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [p for i, (a, b) in enumerate(zip(old, new)) for p in changed_fields(a, b, f"{prefix}[{i}]")]
    return [] if old == new else [prefix or "(the whole configuration)"]


def _value(doc: Any, path: str) -> Any:
    """The value at a dotted path of `changed_fields` (for the refusal message)."""
    for part in path.replace("[", ".[").split("."):
        if not part:
            continue
        try:
            doc = doc[int(part[1:-1])] if part.startswith("[") else doc[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return "(absent)"
    return doc


def check_config(saved: dict, current: dict) -> list[str]:
    """The fields that changed and may change; raises ResumeRefused naming the others."""
    changed = changed_fields(saved, current)
    allowed = [p for p in changed if p.startswith(RESUMABLE)]
    refused = [p for p in changed if p not in allowed]
    if refused:
        detail = "; ".join(f"{p}: {json.dumps(_value(saved, p))} -> {json.dumps(_value(current, p))}"
                           for p in refused[:20])
        more = f" (and {len(refused) - 20} more)" if len(refused) > 20 else ""
        raise ResumeRefused(
            f"cannot resume: the configuration differs from the checkpointed run's in {len(refused)} field(s): "
            f"{detail}{more}. Resume with the original configuration, or start a new run (another --workdir)")
    return allowed


# ---- writing ---------------------------------------------------------------------------------
def _downlink_arrays(state: RunState) -> tuple[dict, dict]:
    dl = state.downlink
    arrays: dict[str, np.ndarray] = {}
    if dl.reference is not None:
        arrays.update({f"reference/{k}": v for k, v in dl.reference.items()})
    steps = []
    for i, step in enumerate(dl.steps):
        arrays.update({f"step{i}/{k}": v for k, v in step.encoded.arrays.items()})
        steps.append({"base": step.base, "meta": dict(step.encoded.meta), "arrays": list(step.encoded.arrays)})
    state = {"spec": dl.spec, "digest": dl.digest, "version": dl.version, "steps": steps,
             "reference": dl.reference is not None, "current": dl._source is state.model}
    return arrays, state


def checkpoint_job(state: RunState, rnd: int, cfg, run_id: int, store: CheckpointStore) -> Callable[[], Path]:
    """Round `rnd`'s checkpoint of `state` as it is now (its metrics line is the last of
    `state.history`) into `store`; the returned call writes it, on the driver's thread or on one of its own
    (run_log.py, `CheckpointWriter`). What the next round changes before it waits for the write is
    copied here: the JSON state (serialized now), the lists of arrays. The arrays themselves are
    taken as they are: the model and the optimizer's state change only when the next round's
    mean update is applied, and the driver waits for the write before that; the downlink's
    reference and steps are replaced, never written into, when the next model goes out."""
    down_arrays, down_state = _downlink_arrays(state)
    arrays = {"model": dict(state.model), "optimizer": dict(state.opt.state())}
    if down_arrays:
        arrays["downlink"] = down_arrays
    seed = cfg.federation.seed
    doc = json.loads(json.dumps({
        "round": rnd,
        "rounds": cfg.federation.rounds,
        "config": config_document(cfg),
        "seed_schedule": {"seed": seed, "round_seeds": [round_seed(seed, r) for r in range(1, rnd + 1)]},
        "rejections": dict(state.rejections),
        "downlink": down_state,
        "metrics": state.history,
        "flower_run_id": int(run_id),
    }))

    def write() -> Path:
        doc["model_digest"] = model_digest(arrays["model"])
        return store.save(rnd, arrays, doc)

    return write


def checkpoint_round(state: RunState, rnd: int, cfg, run_id: int, store: CheckpointStore) -> Path:
    """Checkpoint the run after round `rnd` (its metrics line is the last of `state.history`)."""
    return checkpoint_job(state, rnd, cfg, run_id, store)()


# ---- reading ---------------------------------------------------------------------------------
def _restore_downlink(state: RunState, arrays: dict, st: dict) -> None:
    dl = state.downlink
    if st.get("spec") != dl.spec:
        raise ResumeRefused(f"checkpointed downlink codec {st.get('spec')!r} is not {dl.spec!r}")
    if st.get("reference"):
        dl.reference = {k[len("reference/"):]: v for k, v in arrays.items() if k.startswith("reference/")}
    dl.digest, dl.version = st.get("digest"), int(st.get("version", 0))
    dl.steps = [Step(s["base"], Encoded({k: arrays[f"step{i}/{k}"] for k in s["arrays"]}, dict(s["meta"])))
                for i, s in enumerate(st.get("steps", []))]
    if dl.reference is not None and model_digest(dl.reference) != dl.digest:
        raise CheckpointError("the downlink reference does not match its recorded digest")
    dl._source = state.model if st.get("current") else None


def _check_seeds(sched: dict) -> None:
    seeds = sched.get("round_seeds", [])
    ours = [round_seed(int(sched.get("seed", 0)), r) for r in range(1, len(seeds) + 1)]
    if seeds != ours:
        first = next(i for i, (a, b) in enumerate(zip(seeds, ours), start=1) if a != b)
        raise ResumeRefused(f"cannot resume: this coordinator's seed schedule differs from the checkpointed run's "
                            f"from round {first} on (another version of sovereign-fl?)")


def restore(state: RunState, ckpt: Checkpoint, cfg, spec: dict, metrics_path: Path,
            progress: Callable[[str], None]) -> RunState:
    """`state` with `ckpt` put into it: model, optimizer, downlink, counters, history (the optimizer
    and the downlink sender restored in place); metrics.jsonl at `metrics_path` rewritten.
    `spec`: the workload's tensors (name -> dtype, shape), which the checkpoint's must be."""
    st = ckpt.state
    changed = check_config(st.get("config", {}), config_document(cfg))
    if changed:
        progress(f"resume: accepted changes to {', '.join(changed)} (they do not enter the computation)")
    _check_seeds(st.get("seed_schedule", {}))
    model = ckpt.arrays.get("model", {})
    if {k: (v.dtype.str, tuple(v.shape)) for k, v in model.items()} != spec:
        raise ResumeRefused("cannot resume: the checkpointed model's tensors (names, dtypes or shapes) are not the "
                            "workload's")
    if model_digest(model) != st.get("model_digest"):
        raise CheckpointError(f"{ckpt.path.name}: the model does not match its recorded digest")
    history = list(st.get("metrics", []))
    state = replace(state, model=model, rejections=Counter(st.get("rejections", {})), history=history,
                    aggregated={int(line["round"]): sorted(line.get("sites", {})) for line in history
                                if line.get("status") == "aggregated"},  # error feedback goes on from these rounds
                    start_round=ckpt.round + 1)
    state.opt.load_state(ckpt.arrays.get("optimizer", {}))
    _restore_downlink(state, ckpt.arrays.get("downlink", {}), st.get("downlink", {}))
    dropped = write_metrics(metrics_path, history)
    if dropped:
        progress(f"resume: dropped {dropped} metrics line(s) of round(s) after {ckpt.round}, which run again")
    return state


def write_metrics(path: Path, history: list[dict]) -> int:
    """Replace metrics.jsonl by `history` (atomically); how many lines of later rounds it had."""
    before = 0
    if path.exists():
        before = sum(1 for line in path.read_text(errors="replace").splitlines() if line.strip())
    write_atomic(path, "".join(json.dumps(line) + "\n" for line in history))
    return max(0, before - len(history))


def resume_run(state: RunState, store: CheckpointStore, cfg, spec: dict, metrics_path: Path,
               progress: Callable[[str], None]) -> RunState:
    """`state` continued from the newest usable checkpoint in `store` (falling back past damaged
    ones, with a message); a run with no checkpoint yet starts at round 1 (`state` as it is)."""
    ckpt = store.latest()
    if ckpt is None:
        progress(f"resume: no checkpoint in {store.directory}; starting at round 1")
        write_metrics(metrics_path, [])
        return state
    state = restore(state, ckpt, cfg, spec, metrics_path, progress)
    rounds = cfg.federation.rounds
    left = rounds - ckpt.round
    progress(f"resume: continuing from {ckpt.path.name} (round {ckpt.round} of {rounds} done, "
             f"model {model_digest(state.model)[:12]}); {max(0, left)} round(s) to go"
             + ("; the round in flight when the run stopped runs again from its start" if left > 0 else ""))
    return state


def precheck(checkpoints: Path, cfg) -> int | None:
    """Before any process starts (`sovfl ... --resume`): the round the run would resume from, or
    None; ResumeRefused if the configuration changed. Attestation settings are left to the
    ServerApp's check, which sees them resolved."""
    try:
        ckpt = CheckpointStore(checkpoints).latest()
    except CheckpointError as err:
        raise ResumeRefused(f"cannot resume: {err}") from None
    if ckpt is None:
        return None
    saved, current = dict(ckpt.state.get("config", {})), config_document(cfg)
    for doc in (saved, current):
        doc["federation"] = {k: v for k, v in dict(doc.get("federation", {})).items() if k != "attestation"}
    check_config(saved, current)
    return ckpt.round
