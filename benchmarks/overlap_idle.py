"""How much of a round a site's ranks sit idle, with and without `federation.overlap`.

A real trainer service (torchrun, `python -m site_trainer`, the byte-level GPT task) is driven as
the relay drives it (`_trainer_bench.Service`): each round the relay writes the global model,
sends Train, reads the update, and then the link is busy for `--link-s` seconds (the update's
upload, the other sites, the aggregation and the download of the next model, stood in for by a
wait) before the next round's model (the global model plus the update: one site, FedAvg) is sent.
Without overlap the ranks wait through it; with overlap they take up to `local_steps` steps of the
next round meanwhile and fold the new model in when it arrives (site_trainer/overlap.py).

Reported per mode, over the steady rounds (from the third on): the round period (reply to reply),
the trainer's `idle_fraction`, the steps taken in the background, and tokens/s in the foreground
and in the background (while the link is busy). The anchor is the same trainer with overlap off
(no other federated framework overlaps; Flower's sites always wait).

    python benchmarks/overlap_idle.py [--backend nccl] [--ranks 1] [--rounds 6] [--local-steps 40]
                                      [--link-s 2.0] [--layers 4] [--embd 256] [--block 128] [--batch 16]
                                      [--precision fp32|bf16] [--max-steps-factor 1.0]

Last line: RESULT link_s=<..> round_s_off=<..> round_s_on=<..> speedup=<off/on> idle_off=<..>
idle_on=<..> bg_tokens_per_s=<..> fg_tokens_per_s=<..>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _trainer_bench import Service, trainer_config  # noqa: E402
from site_trainer import endpoint, handoff  # noqa: E402
from site_trainer.config import WorkloadConfig  # noqa: E402


def run(tmp: Path, args: argparse.Namespace, overlap: bool) -> list[dict]:
    wl = WorkloadConfig(task="slm", options={"n_layer": args.layers, "n_head": 4, "n_embd": args.embd,
                                             "block_size": args.block, "corpus_bytes_per_site": 400_000})
    name = "on" if overlap else "off"
    cfg = trainer_config(tmp, name, wl, args.ranks, args.local_steps, batch_size=args.batch, backend=args.backend,
                         mixed_precision=args.precision or ("bf16" if args.backend == "nccl" else "fp32"))
    svc = Service(tmp / f"svc-{name}", cfg, start_timeout_s=600)
    print(f"overlap={name}: the trainer runs on {svc.info['device']} in {svc.info['compute']}", flush=True)
    rows, last = [], None
    try:
        for rnd in range(1, args.rounds + 1):
            h = handoff.write_arrays(svc.model, "bench-global")
            try:
                reply = endpoint.call(svc.cfg.socket, "Train", {"round": rnd, "global": h.to_json(), "timeout_s": 600,
                                      "config": {"update_kind": "delta", "overlap": overlap,
                                                 "overlap_max_steps_factor": args.max_steps_factor}}, timeout_s=600)
            finally:
                handoff.release(h.path)
            assert reply["ok"], reply
            now = time.perf_counter()
            upd = handoff.Handle.from_json(reply["update"])
            for k, d in handoff.map_arrays(upd).items():
                svc.model[k] = svc.model[k] + np.asarray(d)
            handoff.release(upd.path)
            m = reply["metrics"]
            rows.append({"round": rnd, "period_s": now - last if last is not None else None, **m})
            last = now
            time.sleep(args.link_s)  # the link and the coordinator are busy; the ranks are not waited for
    finally:
        svc.close()
    return rows


def summary(rows: list[dict], tokens_per_step: int) -> dict:
    steady = [r for r in rows if r["round"] >= 3]
    fg_steps = sum(r["steps"] - r.get("background_steps", 0) for r in steady)
    bg_steps = sum(r.get("background_steps", 0) for r in steady)
    bg_s = sum(r.get("background_s", 0.0) for r in steady)
    return {"round_s": statistics.median(r["period_s"] for r in steady),
            "idle": statistics.median(r["idle_fraction"] for r in steady),
            "bg_steps": bg_steps / len(steady),
            "fg_tokens_per_s": fg_steps * tokens_per_step / max(sum(r["train_s"] for r in steady), 1e-9),
            "bg_tokens_per_s": bg_steps * tokens_per_step / bg_s if bg_s else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--local-steps", type=int, default=40)
    ap.add_argument("--link-s", type=float, default=2.0, help="seconds the link is busy between a reply and the next model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                    help="the trainer's mixed_precision (default: bf16 with nccl, fp32 with gloo)")
    ap.add_argument("--max-steps-factor", type=float, default=1.0,
                    help="federation.overlap_max_steps_factor: background steps up to this x local steps")
    args = ap.parse_args()
    if args.rounds < 3:
        raise SystemExit("--rounds must be at least 3 (the first two are not steady)")
    tokens_per_step = args.batch * args.block * args.ranks
    out = {}
    with tempfile.TemporaryDirectory(prefix="sovfl-overlap-") as d:
        for overlap in (False, True):
            rows = run(Path(d), args, overlap)
            out[overlap] = summary(rows, tokens_per_step)
            for r in rows:
                print(f"  overlap={'on' if overlap else 'off'} round {r['round']}: period "
                      f"{r['period_s'] or 0:.2f} s, train_s {r['train_s']:.2f}, steps {r['steps']:.0f} "
                      f"({r.get('background_steps', 0):.0f} in the background), idle "
                      f"{r.get('idle_fraction', float('nan')):.2f}", flush=True)
    off, on = out[False], out[True]
    print(f"{args.local_steps} local steps (background up to x{args.max_steps_factor}), link busy {args.link_s} s per "
          f"round, {args.ranks} rank(s), {args.backend}: "
          f"round {off['round_s']:.2f} s -> {on['round_s']:.2f} s, idle {off['idle']:.2f} -> {on['idle']:.2f}, "
          f"{on['bg_steps']:.1f} steps per round taken while the link is busy")
    print(f"RESULT link_s={args.link_s} round_s_off={off['round_s']:.3f} round_s_on={on['round_s']:.3f} "
          f"speedup={off['round_s'] / on['round_s']:.2f} idle_off={off['idle']:.3f} idle_on={on['idle']:.3f} "
          f"bg_tokens_per_s={on['bg_tokens_per_s']:.0f} fg_tokens_per_s={on['fg_tokens_per_s']:.0f}")


if __name__ == "__main__":
    main()
