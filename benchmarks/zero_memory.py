"""Peak memory per rank under ddp, zero2 and zero3 with Adam, measured, next to the ZeRO theory.

Theory for P fp32 parameters, Adam (two fp32 moments) and K ranks, in bytes per rank:
  ddp 16P (weights 4P, gradients 4P, moments 8P) · zero2 4P + 12P/K · zero3 16P/K.

Measured: K gloo ranks on CPU, each wrapping the workloads' byte-level GPT with
`site_trainer.strategies.wrap` (ZeRO ranks build it on the meta device and allocate only their
shards, as the trainer does). Per rank: the peak resident set during three training steps
(/proc VmHWM, reset after setup) minus the resident set before the model existed, so it holds
the model states plus whatever the strategy needs on top (gathered blocks, activations, gloo
buffers). glibc is told to mmap every large block, so freed tensors leave the resident set.

    python benchmarks/zero_memory.py [--ranks 4] [--layers 64] [--embd 256]

Last line: RESULT zero2_vs_theory=<measured/theory> zero3_vs_theory=<measured/theory> (target <= 1.2).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc at start-up: set before the ranks spawn

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from site_trainer import strategies, workloads  # noqa: E402
from site_trainer.config import WorkloadConfig  # noqa: E402

MIB = 2**20


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rank(rank: int, world: int, port: int, strategy: str, wl: WorkloadConfig, out: "mp.Queue") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cpu")
    strategies.check_supported(strategy, "gloo", device)  # also warms up gloo's collectives
    dist.all_reduce(torch.zeros(1024))
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (1, 16), generator=g)
    y = torch.randint(0, 256, (1, 16), generator=g)
    loss_fn = workloads.loss_fn(wl)
    sharded = strategy in strategies.SHARDED
    # Warm-up on a tiny copy: the first run of every kernel pages torch's code in, which is
    # resident memory too but no part of what a strategy costs.
    tiny = workloads.make_model(wl.model_copy(update={"n_layer": 1, "n_embd": 16, "n_head": 1}), 0)
    tiny = strategies.wrap(tiny, strategy, None, False, device)
    tiny_opt = torch.optim.Adam(tiny.parameters(), lr=1e-4, foreach=False)
    for _ in range(2):
        loss_fn(tiny, x, y)[0].backward()
        tiny_opt.step()
        tiny_opt.zero_grad(set_to_none=True)
    del tiny, tiny_opt
    before = _rss("VmRSS")
    module = workloads.make_model(wl, 0, device="meta" if sharded else None)
    params = sum(p.numel() for p in module.parameters())
    model = strategies.wrap(module, strategy, None, False, device)
    if sharded:
        module.to_empty(device=device)
        with torch.no_grad():
            for p in module.parameters():
                p.to_local().normal_(0, 0.02, generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    for _ in range(3):
        loss, _ = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out.put((rank, params, _rss("VmHWM") - before))
    dist.barrier()
    dist.destroy_process_group()


def measure(strategy: str, world: int, wl: WorkloadConfig) -> tuple[int, int]:
    """(P, peak bytes of the worst rank) for one strategy, in fresh processes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, strategy, wl, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise SystemExit(f"{strategy}: a rank exited with {p.exitcode}")
    return results[0][1], max(r[2] for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--embd", type=int, default=256)
    args = ap.parse_args()
    wl = WorkloadConfig(name="slm", n_layer=args.layers, n_head=8, n_embd=args.embd, block_size=16)
    k = args.ranks
    ratios = {}
    print(f"{'strategy':<8} {'measured MiB/rank':>18} {'theory MiB/rank':>16} {'ratio':>7}")
    for strategy in ("ddp", "zero2", "zero3"):
        p, peak = measure(strategy, k, wl)
        theory = {"ddp": 16 * p, "zero2": 4 * p + 12 * p / k, "zero3": 16 * p / k}[strategy]
        ratios[strategy] = peak / theory
        print(f"{strategy:<8} {peak / MIB:>18.1f} {theory / MIB:>16.1f} {ratios[strategy]:>7.3f}", flush=True)
    print(f"model: byte-level GPT, P={p:,} parameters, K={k} ranks (gloo, CPU), Adam fp32")
    print(f"RESULT zero2_vs_theory={ratios['zero2']:.3f} zero3_vs_theory={ratios['zero3']:.3f}")


if __name__ == "__main__":
    main()
