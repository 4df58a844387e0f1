"""SLM-sized updates: our bulk data path against Flower's own path, moving the same bytes, in one run.

Both sides run real processes on loopback, started by the project's launcher:

- ours: `sovfl simulate` (federation/ops/launcher.py) of the built-in `slm` task sized to the model
  asked for, 2 sites x 1 rank, full fine-tuning (every parameter travels), once sealed and signed
  (`--rounds`, default 2: the configuration that failed in round 1 before the data path) and once
  with SecAgg+ (1 round). The model goes down and the update comes up on the coordinator's data
  path (coordinator/bulk_server.py), SuperLink with its database as in production;
- Flower: `flwr run` of benchmarks/flower_fedavg_app (flwr.serverapp.strategy.FedAvg as shipped,
  a NumPy ClientApp), on an in-memory SuperLink (the database one fails at this size),
  the same number of sites and the same parameter shapes (read from our run's checkpoint), random
  weights (Flower stores chunks by content: a zero model would travel as one chunk), 1 round.

Per hop: ours, the bytes each site's ClientApp moved on the data path over the seconds it took
(`bulk_down_*`, `bulk_up_*` of the metrics lines: TLS, chunk hashing on both ends, files written on
the coordinator); Flower, 6 hops per site (ServerApp -> SuperLink -> SuperNode -> ClientApp and
back) over its train stage's wall time less the ClientApp's own work. Also printed, for ours, the
same end-to-end accounting (2 hops over the train stage less the trainer calls), which charges
everything else of ours (sealing, the /dev/shm hand-off, ClientApp start-up, Flower's polling) to
the transfer. Memory: every process of the run sampled from /proc every 0.2 s; the coordinator's
peak is the ServerApp's peak RSS less that of the same ServerApp with a tiny model (imports, torch,
Flower), over P x 4 bytes.

    .venv/bin/python benchmarks/large_update.py                            # 101M parameters (n_layer 8, n_embd 1024)
    .venv/bin/python benchmarks/large_update.py --n-layer 12 --n-embd 1408 # about 286M
    .venv/bin/python benchmarks/large_update.py --skip-flower               # ours only
    .venv/bin/python benchmarks/large_update.py --n-layer 26 --n-embd 1280 --site-dtype bfloat16  # 512M, bf16 sites

Per process kind it prints the peak and (peak - the tiny-model run's peak) / model bytes. On a
shared machine `--min-available-gb` (default 1) stops the run, killing only its own processes,
when the machine's MemAvailable falls below it, and prints the peaks reached.

The run also measures what any authenticated hop can move here at most (benchmarks/_tls_ceiling.py:
bare mutual TLS sockets, the receiver hashing and writing every byte, 2 streams at once like the 2
sites): the ceiling of any design that encrypts, verifies and stores what it moves, printed as
`tls_ceiling_mb_s_per_hop` beside the two paths' figures.

Last line: `RESULT params=<P> ours_mb_s_per_hop=<..> flower_mb_s_per_hop=<..> speedup=<ours/flower> coordinator_peak_ratio=<..> rounds_ok=<n> rounds_asked=<n> tls_ceiling_mb_s_per_hop=<..>`
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._tls_ceiling import tls_ceiling_mb_s  # noqa: E402
from benchmarks.round_latency import run_flower  # noqa: E402
from federation.ops import launcher  # noqa: E402

KINDS = (("flwr-serverapp", "coordinator"), ("flower-superlink", "superlink"), ("flower-supernode", "supernode"),
         ("federation.ops.supernode_main", "supernode"), ("federation.ops.warm_worker", "clientapp"),
         ("flwr-clientapp", "clientapp"), ("site_trainer", "trainer"))


class MemorySampler:
    """Peak resident memory of every process below this one, by kind, sampled from /proc."""

    def __init__(self, period_s: float = 0.2, min_available: int = 0):
        self.period_s, self.peak = period_s, defaultdict(int)
        self.min_available, self.aborted = min_available, ""  # a shared machine: stop before it runs out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            procs = _procs()
            below = _descendants(me, procs)
            total = defaultdict(int)
            for pid in below:
                cmd, rss = procs[pid][1], procs[pid][2]
                kind = next((k for key, k in KINDS if key in cmd), None)
                if kind:
                    self.peak[kind] = max(self.peak[kind], rss)
                    total[kind] += rss
            for kind, v in total.items():
                self.peak[f"{kind} (all)"] = max(self.peak[f"{kind} (all)"], v)
            self.peak["all processes"] = max(self.peak["all processes"], sum(procs[p][2] for p in below))
            if self.min_available and not self.aborted and (avail := _mem_available()) < self.min_available:
                self.aborted = (f"MemAvailable {avail / 1e9:.1f} GB < {self.min_available / 1e9:.1f} GB with this run at "
                                f"{self.peak['all processes'] / 1e9:.1f} GB: run stopped (its processes killed)")
                print(f"  ABORT: {self.aborted}", flush=True)
                for pid in below:  # only the processes this benchmark started
                    try:
                        os.kill(pid, 9)
                    except OSError:
                        pass
            self._stop.wait(self.period_s)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def _procs() -> dict[int, tuple[int, str, int]]:
    """pid -> (parent, command line, RSS bytes)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/status") as f:
                st = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            rss = int(st.get("VmRSS", "0 kB").split()[0]) * 1024
            out[int(d)] = (int(st["PPid"]), cmd, rss)
        except (OSError, ValueError, KeyError):
            continue
    return out


def _descendants(root: int, procs: dict[int, tuple[int, str, int]]) -> set[int]:
    kids = defaultdict(list)
    for pid, (ppid, _, _) in procs.items():
        kids[ppid].append(pid)
    seen, todo = set(), [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in seen:
                seen.add(k)
                todo.append(k)
    return seen


def write_config(path: Path, n_layer: int, n_embd: int, rounds: int, protection: dict, dtype: str = "float32") -> Path:
    cfg = {
        "federation": {
            "name": "large-update", "rounds": rounds, "quorum": 2, "update_kind": "delta", "evaluate": False,
            "deadlines": {"connect_s": 600, "round_s": 1800, "evaluate_s": 600, "secagg_stage_s": 600,
                          "trainer_start_s": 900},
            **protection,
        },
        "workload": {"task": "slm", "options": {"n_layer": n_layer, "n_head": 8, "n_embd": n_embd, "block_size": 32,
                                                 "corpus_bytes_per_site": 60000, "val_fraction": 0.05, "dtype": dtype}},
        "sites": [{"id": f"site{i}", "ranks": 1, "partition": i, "local_steps": 1, "batch_size": 1, "lr": 0.001,
                   "optimizer": "sgd"} for i in range(2)],
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


MIN_AVAILABLE = [0]  # bytes (--min-available-gb)


def run_ours(workdir: Path, config: Path, name: str) -> tuple[list[dict], dict, dict]:
    """One `sovfl simulate` run: its metrics lines, result and memory peaks."""
    with MemorySampler(min_available=MIN_AVAILABLE[0]) as mem:
        try:
            result = launcher.simulate(config, workdir / name, progress=lambda line: print(f"  [{name}] {line}", flush=True))
        except Exception:
            if mem.aborted:
                print(f"  [{name}] peaks when stopped: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in sorted(mem.peak.items())))
                raise SystemExit(f"large_update: {mem.aborted}") from None
            raise
    lines = [json.loads(x) for x in (workdir / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return lines, result, dict(mem.peak)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the sealed run (the SecAgg+ run has 1)")
    ap.add_argument("--site-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the slm task's weights on the sites (bfloat16: half the memory and bytes; "
                         "e.g. --n-layer 26 --n-embd 1280 --site-dtype bfloat16 for 512M parameters)")
    ap.add_argument("--skip-flower", action="store_true")
    ap.add_argument("--skip-secagg", action="store_true")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--min-available-gb", type=float, default=1.0,
                    help="stop the run (kill its processes) if the machine's MemAvailable drops below this")
    args = ap.parse_args()
    MIN_AVAILABLE[0] = int(args.min_available_gb * 1e9)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    wd = args.workdir or Path(tempfile.mkdtemp(prefix="large-update-"))
    wd.mkdir(parents=True, exist_ok=True)
    print(f"# workdir {wd}", flush=True)

    _, _, tiny_mem = run_ours(wd, write_config(wd / "tiny.yaml", 1, 64, 1, {"seal": True}), "tiny")
    runs = {"sealed": ({"seal": True}, args.rounds)}
    if not args.skip_secagg:
        runs["secagg"] = ({"secagg": {"enabled": True, "threshold": 2, "clip": 0.5}}, 1)
    out, rounds_ok, rounds_asked, params = {}, 0, 0, 0
    for name, (protection, rounds) in runs.items():
        t0 = time.monotonic()
        lines, result, mem = run_ours(wd, write_config(wd / f"{name}.yaml", args.n_layer, args.n_embd, rounds, protection,
                                                       args.site_dtype), name)
        out[name] = (lines, mem, time.monotonic() - t0)
        rounds_asked += rounds
        rounds_ok += int(result.get("aggregated_rounds", 0))
    shapes = model_shapes_of(wd / "sealed")
    params = sum(_prod(s) for s in shapes)
    model_mb = params * (2 if args.site_dtype == "bfloat16" else 4) / 1e6  # what travels each way per site

    print(f"# {params:,} {args.site_dtype} parameters ({model_mb:.0f} MB on the wire), 2 sites x 1 rank")
    bytes_moved = seconds = 0.0
    for name, (lines, mem, wall) in out.items():
        for line in lines:
            stage = next((s for s in line["timing"]["stages"] if s["stage"] in ("train", "secagg stage 3 (train)")), None)
            sites = line["sites"]
            moved = sum(s.get("bulk_up_bytes", 0) + s.get("bulk_down_bytes", 0) for s in sites.values())
            took = sum(s.get("bulk_up_s", 0) + s.get("bulk_down_s", 0) for s in sites.values())
            bytes_moved, seconds = bytes_moved + moved, seconds + took
            e2e = (2 * model_mb / max(1e-9, stage["seconds"] - line["timing"]["site_work_s"])) if stage else float("nan")
            print(f"  ours {name:6s} round {line['round']}: {line['status']}, {line['round_s']:.1f}s, data path "
                  f"{moved / 1e6:.0f} MB in {took:.1f} site-seconds ({moved / 1e6 / max(took, 1e-9):.0f} MB/s per hop); "
                  f"end to end {e2e:.0f} MB/s per hop; paths {line.get('data_path')}")
        peaks = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in sorted(mem.items()))
        print(f"  ours {name}: run {wall:.0f}s; peak RSS {peaks}")
        ratios = ", ".join(f"{k} {(v - tiny_mem.get(k, 0)) / (model_mb * 1e6):.2f}" for k, v in sorted(mem.items())
                           if k in ("clientapp", "trainer", "supernode", "superlink", "coordinator"))
        print(f"  ours {name}: per process, (peak - tiny-model peak) / model bytes: {ratios}")
    ours_rate = bytes_moved / 1e6 / max(seconds, 1e-9)
    coord_peak = max(mem.get("coordinator", 0) for _, mem, _ in out.values())
    ratio = (coord_peak - tiny_mem.get("coordinator", 0)) / (params * 4)
    print(f"  coordinator: peak {coord_peak / 1e9:.2f} GB, tiny-model ServerApp {tiny_mem.get('coordinator', 0) / 1e9:.2f} "
          f"GB, difference / (P x 4 B) = {ratio:.2f}")

    flower_rate = float("nan")
    if not args.skip_flower:
        t0 = time.monotonic()
        flower = run_flower(wd, wd / "sealed.yaml", shapes, 1, database=False, timeout_s=3600, random_init=True)
        r = flower["rounds"]["1"]
        transfer = r["train_s"] - r.get("train_work_s", 0.0)
        flower_rate = 6 * params * 4 / 1e6 / transfer  # the anchor app moves float32 arrays of the same shapes
        print(f"  flower FedAvg (in-memory SuperLink): train stage {r['train_s']:.1f}s, ClientApp work "
              f"{r.get('train_work_s', 0):.1f}s, 6 hops x {params * 4 / 1e6:.0f} MB per site: {flower_rate:.1f} MB/s per hop; "
              f"run {time.monotonic() - t0:.0f}s")
    ceiling = tls_ceiling_mb_s(size=min(max(params * 4, 256 << 20), 1 << 30), streams=2)  # handshakes negligible
    print(f"  ceiling: bare mutual TLS + SHA-256 + file write, 2 streams at once (benchmarks/_tls_ceiling.py): "
          f"{ceiling:.0f} MB/s per stream = {ceiling / flower_rate:.1f} x Flower's rate per hop")
    print(f"RESULT params={params} ours_mb_s_per_hop={ours_rate:.1f} flower_mb_s_per_hop={flower_rate:.1f} "
          f"speedup={ours_rate / flower_rate:.1f} coordinator_peak_ratio={ratio:.2f} rounds_ok={rounds_ok} rounds_asked={rounds_asked} "
          f"tls_ceiling_mb_s_per_hop={ceiling:.0f}")


def model_shapes_of(run: Path) -> list[list[int]]:
    """The parameter shapes of a run's checkpointed model."""
    from federation.coordinator.checkpoint import load_checkpoint

    _, model, _ = load_checkpoint(run / "checkpoints")
    return [list(model[k].shape) for k in sorted(model)]


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
