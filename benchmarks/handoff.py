"""The trainer <-> ClientApp hand-off in GB/s, against a plain memory copy of the same bytes.

Each round the ClientApp leaves the global model in a shared-memory file (the file the bulk mod
downloaded it into, or its copy), rank 0 of the trainer loads it into the model, and after training
rank 0 writes the update into the file the ClientApp and the data path read. Both directions run
here on the path users run: a real `site_trainer.session.Session` (a gloo group of one rank, or
nccl on a GPU) serving Train requests through `Session.serve_one`, the very load (`_begin`:
`open_global` + `load`) and update packing (`_pack_update`) the trainer service runs. Its reply
says how long each took (`load_s`, `pack_s`); nothing of it is re-implemented here. The update goes
into one of the trainer's own files, allocated and mapped once for its life (`update_files`: the
first round allocates it while it trains; the stand-in training here, one add to every weight,
ends when that allocation has, and the wait is printed); the reply's handle names it with a
generation, and like the ClientApp this script leaves such a file in place.

The model: bf16 tensors of 32 MiB (a 1.5B Llama's matrices are 8-100 MiB), `--mb` MB of them in
all, every one exchanged; full fine-tuning, the update a delta (the default `update_kind`). The
anchor: `numpy.copyto` of as many bytes between two buffers already in memory (`Memcpy`), timed
right after each round, so that both sides of a ratio ran at the same load. Each direction's ratio
is its best round's against the copy beside it; the GB/s are the best of the timed rounds (on a
shared machine the others measure the neighbours); the load average is printed beside them.

    python benchmarks/handoff.py [--mb 500,3000] [--rounds 3] [--device cpu|cuda]

Last line: RESULT in_gbps_<size>=.. out_gbps_<size>=.. memcpy_gbps_<size>=.. ratio_in_<size>=..
ratio_out_<size>=.. load=.. ratio_to_memcpy=<the lowest of the four ratios>
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from site_trainer import handoff  # noqa: E402
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig  # noqa: E402
from site_trainer.session import Session  # noqa: E402

TENSOR_BYTES = 32 * 2**20


class Blocks(nn.Module):
    """bf16 parameters of TENSOR_BYTES each (the last one smaller) adding up to `nbytes`."""

    def __init__(self, nbytes: int, device: torch.device):
        super().__init__()
        sizes = [TENSOR_BYTES] * (nbytes // TENSOR_BYTES) + ([nbytes % TENSOR_BYTES] if nbytes % TENSOR_BYTES else [])
        self.w = nn.ParameterList(nn.Parameter(torch.zeros(n // 2, dtype=torch.bfloat16, device=device))
                                  for n in sizes)


def global_file(model: Blocks, seed: int) -> handoff.Handle:
    """The global model as the ClientApp leaves it: finite bf16 words (one random 32 MiB block, repeated)."""
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 2**16, size=TENSOR_BYTES // 2, dtype=np.uint16) & np.uint16(0xBFFF)  # finite
    spec = {f"w.{i}": ("<u2", tuple(p.shape)) for i, p in enumerate(model.w)}
    with handoff.Writer(spec, tag="bench-global") as w:
        for i, p in enumerate(model.w):
            w.write(f"w.{i}", block[: p.numel()])
    return w.handle


class Memcpy:
    """The anchor: numpy.copyto of a given number of bytes between two buffers already in memory,
    through a window of WINDOW bytes (far beyond any cache, so as fast per byte as one big copy)
    copied again until the count is reached; timed right beside each round, at the same load."""

    WINDOW = 256 * 2**20

    def __init__(self) -> None:
        self.src = np.ones(self.WINDOW, dtype=np.uint8)
        self.dst = np.ones(self.WINDOW, dtype=np.uint8)

    def gbps(self, nbytes: int) -> float:
        t0, left = time.perf_counter(), nbytes
        while left > 0:
            n = min(left, self.WINDOW)
            np.copyto(self.dst[:n], self.src[:n])
            left -= n
        return nbytes / (time.perf_counter() - t0) / 1e9


def rounds(nbytes: int, n: int, device: torch.device, tmp: Path, copy: Memcpy
           ) -> tuple[list[float], list[float], list[float]]:
    """GB/s in (load) and out (pack) of `n` timed Train rounds after one warm-up round, and of the
    memory copy of as many bytes timed right after each."""
    cfg = TrainerConfig(site=SiteConfig(id="bench", partition=0, backend="nccl" if device.type == "cuda" else "gloo"),
                        workload=WorkloadConfig(task="slm"), num_partitions=1, socket=str(tmp / "s.sock"),
                        workdir=str(tmp))
    model = Blocks(nbytes, device)
    sess = Session(model, cfg, device=device)
    glob = global_file(model, 0)
    gin, gout, waits, mem = [], [], [], []
    try:
        for r in range(n + 1):
            def body(rnd):
                with torch.no_grad():  # "training": every weight moves, so the delta is not zero
                    for p in model.w:
                        p.add_(1.0)
                # The update's file is allocated while the first round trains (Session._begin); a real
                # round trains for seconds, this one for a moment: let it end when the allocation has.
                t0 = time.perf_counter()
                if getattr(sess._current, "update", None) is not None:  # (a trainer that allocates ahead)
                    sess._current.update.allocated()
                waits.append(time.perf_counter() - t0)
                rnd.report(num_examples=1)
            reply = sess.serve_one("Train", {"round": r + 1, "global": glob.to_json(),
                                             "config": {"update_kind": "delta"}}, body)
            if not reply.get("ok"):
                raise SystemExit(f"handoff: the trainer refused the round: {reply}")
            if not handoff.owned_path(reply["update"]):  # one of the trainer's own files stays for the next round
                handoff.release(reply["update"]["path"])
            if r:
                gin.append(nbytes / reply["metrics"]["load_s"] / 1e9)
                gout.append(nbytes / reply["metrics"]["pack_s"] / 1e9)
                mem.append(copy.gbps(nbytes))
        print(f"  {nbytes / 1e6:.0f} MB: the update file's allocation (first round) outlasted the round's training "
              f"by {max(waits):.2f} s (not in the figures: a real round trains longer)", flush=True)
    finally:
        handoff.release(glob.path)
        del sess, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return gin, gout, mem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", default="500,3000", help="model sizes in MB (10^6 bytes), comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per size, after one warm-up round")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    sizes = [int(float(x) * 1e6) for x in args.mb.split(",")]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU(s), device {device}, torch threads "
          f"{torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    copy = Memcpy()
    parts, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="sovfl-handoff-") as d:
        for nbytes in sizes:
            gin, gout, mem = rounds(nbytes, args.rounds, device, Path(d), copy)
            r_in = max(a / m for a, m in zip(gin, mem))  # each round against the copy timed beside it
            r_out = max(a / m for a, m in zip(gout, mem))
            print(f"{nbytes / 1e6:.0f} MB: model in {max(gin):.2f} GB/s (median {statistics.median(gin):.2f}), "
                  f"update out {max(gout):.2f} GB/s (median {statistics.median(gout):.2f}), memcpy {max(mem):.2f} "
                  f"GB/s (median {statistics.median(mem):.2f}); best ratio to the copy beside it: in {r_in:.2f}, "
                  f"out {r_out:.2f}; load average {os.getloadavg()[0]:.2f}", flush=True)
            tag = f"{nbytes / 1e6:.0f}mb"
            parts += [f"in_gbps_{tag}={max(gin):.2f}", f"out_gbps_{tag}={max(gout):.2f}",
                      f"memcpy_gbps_{tag}={max(mem):.2f}", f"ratio_in_{tag}={r_in:.2f}", f"ratio_out_{tag}={r_out:.2f}"]
            ratios += [r_in, r_out]
    dist.destroy_process_group()
    print(f"RESULT {' '.join(parts)} load={os.getloadavg()[0]:.2f} ratio_to_memcpy={min(ratios):.2f}")


if __name__ == "__main__":
    main()
