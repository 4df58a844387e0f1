"""A 1.5B-parameter federation on one GPU: the seed's own scale through every real part.

Two sites of one rank each share the GPU (a Qwen2-1.5B-shaped Llama built from a config, random
weights, nothing downloaded: `gpu_throughput.hf_workload`), full fine-tuning with the built-in task
`hf-causal-lm`, bf16 with fp32 master weights, ZeRO-2, gradient accumulation, `--steps` local steps
a round; updates signed and sealed to the coordinator, every byte of them on the data path. It runs
`sovfl simulate`'s own launcher (`launcher.simulate`): a real SuperLink, SuperNodes, ClientApps and
torchrun trainers on loopback. The anchor for memory is the model itself: the coordinator's peak
resident memory (the ServerApp process's VmHWM, sampled while the run lasts) over P x 4 bytes, the
float32 model it must hold.

    python benchmarks/gpu_federation.py                # on a GPU machine (not yet timed there; limited to 510 s by gpu_run.sh)
    python benchmarks/gpu_federation.py --smoke        # on a CPU: the same machinery at toy size

Last line: RESULT params=<P> rounds_aggregated=<n of --rounds> status=<ok|...> round_s=<median>
bytes_up_per_round=<..> coordinator_peak_gb=<..> coordinator_peak_ratio=<peak / (P x 4 B)>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_throughput import check_handoff_space, environment, hf_workload  # noqa: E402 - the same model

from federation.ops import launcher  # noqa: E402
from federation.ops.supervisor import MARKER, marked_pids  # noqa: E402

GIB = 1 << 30


def coordinator_pids(marker: str) -> list[int]:
    """The run's ServerApp processes (the coordinator's code runs there)."""
    out = []
    for pid in marked_pids(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"flwr-serverapp") for a in argv):
            out.append(pid)
    return out


def peak_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakWatch(threading.Thread):
    """Samples the coordinator's peak resident memory until stopped (VmHWM only grows: the last
    sample before the process ends is its peak)."""

    def __init__(self, marker: str, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.marker, self.every_s, self.peak, self.seen = marker, every_s, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            pids = coordinator_pids(self.marker)
            self.seen = max(self.seen, len(pids))
            self.peak = max([self.peak, *(peak_kib(p) for p in pids)])


def config(wl: dict, args: argparse.Namespace) -> dict:
    site = ({"backend": "gloo", "mixed_precision": "fp32"} if args.smoke else
            {"backend": "nccl", "mixed_precision": "bf16"})
    long_s = 1800
    return {
        "federation": {"name": "gpu-federation", "rounds": args.rounds, "quorum": 2, "update_kind": "delta",
                       "seal": True, "evaluate": False,
                       "deadlines": {"connect_s": long_s, "round_s": long_s, "trainer_start_s": long_s,
                                     "evaluate_s": long_s}},
        "workload": wl,
        "sites": [{"id": name, "ranks": 1, "partition": i, "parallelism": "zero2", "local_steps": args.steps,
                   "batch_size": args.batch, "grad_accum": args.grad_accum, "lr": 3e-4,
                   "pii": {"enabled": False}, **site}  # generated stdlib text: no PII scrubber (no Presidio there)
                  for i, name in enumerate(("paris", "frankfurt"))],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="hf-1.5b", choices=["hf-1.5b", "hf-tiny"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50, help="local steps a round (DiLoCo's H)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, fp32, the tiny model, 2 steps")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the run here (default: a temporary folder)")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.steps = "hf-tiny", min(args.steps, 2)
    environment(args.smoke, 1)
    marker = f"gpu-federation-{uuid.uuid4().hex[:12]}"
    os.environ[MARKER] = marker
    with tempfile.TemporaryDirectory(prefix="sovfl-gpufed-") as d:
        tmp = Path(d)
        wl, shape = hf_workload(tmp, args.model)
        params = shape["params"]
        check_handoff_space(2 * 4 * params)  # two sites' hand-off files (the data path's files live on disk)
        print(f"model: {params:,} parameters ({shape['layers']} layers, width {shape['hidden']}, {shape['seq']} "
              f"tokens); 2 sites x 1 rank on one device, zero2, {args.steps} steps x {args.grad_accum} x "
              f"{args.batch} sequences a round, sealed updates on the data path", flush=True)
        cfg_path = tmp / "gpu-federation.yaml"
        cfg_path.write_text(yaml.safe_dump(config({"task": wl.task, "options": wl.options}, args), sort_keys=False))
        run = args.workdir or tmp / "run"
        watch = PeakWatch(marker)
        watch.start()
        t0 = time.monotonic()
        result = launcher.simulate(cfg_path, run, lambda line: print(line, flush=True))
        wall = time.monotonic() - t0
        watch.done.set()
        watch.join()
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
            if (run / "metrics.jsonl").exists() else []
    done = [x for x in lines if x.get("status") == "aggregated"]
    round_s = statistics.median(x["round_s"] for x in done) if done else float("nan")
    up = statistics.median(x.get("bytes_up", 0) for x in done) if done else 0
    peak = watch.peak * 1024
    print(f"{len(done)}/{args.rounds} round(s) aggregated in {wall:.0f} s (median round {round_s:.1f} s); the "
          f"coordinator's peak resident memory {peak / GIB:.2f} GiB = {peak / (4 * params):.2f} x the float32 model "
          f"({'seen' if watch.seen else 'NOT seen: no ServerApp process found, the figure is 0'})", flush=True)
    print(f"RESULT params={params} rounds_aggregated={len(done)} status={result.get('status')} "
          f"round_s={round_s:.2f} bytes_up_per_round={up} coordinator_peak_gb={peak / 1e9:.3f} "
          f"coordinator_peak_ratio={peak / (4 * params):.3f}")
    return 0 if result.get("status") == "ok" and len(done) == args.rounds else 1


if __name__ == "__main__":
    raise SystemExit(main())
