"""What a run leaves on disk after each round: its checkpoint, then its metrics line.

A resume rewrites metrics.jsonl from the checkpoint's history (resume.py), so a line is never
written for a round that has no checkpoint. During `Coordinator.run` both are written on a thread
of their own (checkpoint_writer.py) while the next round goes on; a round run on its own
(`Coordinator.run_round`: tools, tests) writes them before returning.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from federation.config.schema import ExperimentConfig
from federation.coordinator.checkpoint import CheckpointStore
from federation.coordinator.checkpoint_writer import CheckpointWriter
from federation.coordinator.resume import checkpoint_job
from federation.coordinator.run_state import RunState
from federation.coordinator.strategy import RoundOutcome
from federation.protocol import testing_hooks


class RunLog:
    """The run's checkpoints and metrics.jsonl under `workdir`.

    `background`: write each round's checkpoint and line on a thread (`wait_for_write` waits for it);
    `wait_s`: this round's waits for the previous round's write."""

    def __init__(self, workdir: Path, cfg: ExperimentConfig, run_id: int, state: Callable[[], RunState],
                 progress: Callable[[str], None]):
        self.cfg, self.run_id, self.state = cfg, run_id, state
        self.metrics_path = workdir / "metrics.jsonl"
        self.checkpoints = CheckpointStore(workdir / "checkpoints", cfg.federation.checkpoint_keep, progress)
        self.writer = CheckpointWriter()
        self.background = False
        self.wait_s = 0.0
        self.listeners: list[Callable[[dict], None]] = []  # each line as written (the run's trackers)

    def wait_for_write(self) -> None:
        """Wait for the checkpoint being written in the background, if any (its error is raised)."""
        self.wait_s += self.writer.wait()

    def commit(self, rnd: int, line: dict) -> None:
        """Checkpoint round `rnd`, then append its metrics line `line` (added to the history). In the
        background, both are written from a snapshot taken here: `round_s` then leaves the write out
        and `timing.checkpoint_s` is the write's own seconds."""
        state = self.state()
        state.history.append(line)
        testing_hooks.stage_entered("checkpoint", rnd=rnd)  # inert unless a test sets SOVFL_TEST_STAGE_HOOK
        self.wait_for_write()
        if self.background:
            write_checkpoint = checkpoint_job(state, rnd, self.cfg, self.run_id, self.checkpoints)
            record, path = json.loads(json.dumps(line)), self.metrics_path

            def write() -> None:
                t0 = time.monotonic()
                write_checkpoint()
                record["timing"]["checkpoint_s"] = round(time.monotonic() - t0, 4)
                with path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                self._written(record)

            self.writer.start(write, lambda _: line["timing"].update(checkpoint_s=record["timing"].get("checkpoint_s")))
            return
        t0 = time.monotonic()
        checkpoint_job(state, rnd, self.cfg, self.run_id, self.checkpoints)()
        # known only after the write: the checkpoint's copy of this line lacks it (a resumed run's
        # metrics.jsonl shows that round without checkpoint_s and with round_s short by as much)
        spent = time.monotonic() - t0
        line["round_s"] += spent
        line["timing"].update(checkpoint_s=round(spent, 4), round_s=round(line["round_s"], 4))
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        self._written(json.loads(json.dumps(line)))

    def _written(self, record: dict) -> None:
        for listener in self.listeners:
            listener(record)


def run_result(history: list[dict], rounds: int, rejections: Mapping[str, int], messages: dict[str, int]) -> dict:
    """The run's result (result.json) from its metrics lines."""
    evals = [(h["eval_model_round"], h["eval_loss"]) for h in history if "eval_loss" in h]
    if history and "final_eval_loss" in history[-1]:
        evals.append((rounds, history[-1]["final_eval_loss"]))
    trained = [loss for model_round, loss in evals if model_round >= 1]
    return {
        "status": "ok" if any(h["status"] == "aggregated" for h in history) else "failed",
        "rounds": len(history),
        "aggregated_rounds": sum(h["status"] == "aggregated" for h in history),
        # the global model evaluated after round 1, and after the last round
        "first_loss": trained[0] if trained else None,
        "last_loss": trained[-1] if trained else None,
        "rejections": dict(rejections),
        "messages_per_site": messages,
    }


def round_summary(rnd: int, rounds: int, line: dict) -> str:
    """The operator's line for a finished round."""
    losses = ", ".join(f"{k}={v['loss']:.4f}" for k, v in line["sites"].items())
    ev = (f" eval_loss={line['eval_loss']:.4f} (model of round {line['eval_model_round']})"
          if "eval_loss" in line else "")
    acc = f" eval_acc={line['eval_accuracy']:.3f}" if "eval_accuracy" in line else ""
    fin = f" final_eval_loss={line['final_eval_loss']:.4f}" if "final_eval_loss" in line else ""
    return (f"round {rnd}/{rounds} {line['status']}: {len(line['sites'])} site(s) "
            f"[{losses}]{ev}{acc}{fin} in {line['round_s']:.1f}s")


def metrics_line(rnd: int, out: RoundOutcome, sampled: int, rejections: Mapping[str, int], dense: int,
                 more: Callable[[dict], None]) -> dict:
    """Round `rnd`'s metrics line as its outcome says it, `more(line)` adding the parts' figures
    (`dense`: the model's bytes, for the compression ratio)."""
    line = {"round": rnd, "sites": out.per_site, "failed": out.failed, "sampled": sampled,
            "bytes_down": out.bytes_down, "bytes_up": out.bytes_up, "rejections": dict(rejections), **out.extra}
    more(line)
    if out.per_site:
        line["compression_ratio"] = dense * len(out.per_site) / max(
            1, sum(s.get("upload_bytes", dense) for s in out.per_site.values()))
    return line
