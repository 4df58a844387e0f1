"""Utility of record-level DP-SGD (sites[].privacy): the model at epsilon 1, 3 and 8 (delta 1e-5)
against the same run without DP, on `digits` and on `hf-causal-lm` (LoRA).

Each site is the real built-in loop (`LocalTrainer`: Poisson sampling, per-record clipping, one
noise draw per logical batch, the accountant, the budget) answering Train and Evaluate requests
through its session exactly as it answers the relay (global model in a hand-off file, the update
back in one); the rounds are averaged by the coordinator's own `WeightedMean` and
`ServerOptimizer` (FedAvg on deltas). What differs from a deployment: the sites run one after the
other in this process (one rank each, a one-rank gloo group), with no Flower in between; that
changes no value. The noise of each site is calibrated to the target epsilon over the run's
rounds x local_steps (RDP accountant).

    digits:       3 sites (iid, 479 training images each), MLP hidden 64, SGD lr 2.0, batch 256
                  (Poisson, q 0.53), 5 local steps, C 1.0; eval accuracy over the sites' held-out images
    hf-causal-lm: 2 sites, a Llama-style model built here (random weights, a BPE tokenizer trained
                  on stdlib text), LoRA r 8, stdlib sources as site text; eval loss (nats/token)

    python benchmarks/dp_utility.py [--digits-rounds 40] [--hf-rounds 10]

Last line:
    RESULT eps=8 loss_dp=<hf eval loss at eps 8> loss_nodp=<..> digits_acc_eps8=<..> digits_acc_nodp=<..>
(target: the digits accuracy drop at epsilon 8 under 3 points).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from federation.coordinator.aggregate import ServerOptimizer, WeightedMean  # noqa: E402
from site_trainer import handoff  # noqa: E402
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig  # noqa: E402
from site_trainer.local_trainer import LocalTrainer  # noqa: E402
from site_trainer.workloads import initial_weights  # noqa: E402

EPSILONS = (1.0, 3.0, 8.0)
DELTA = 1e-5


def federate(workload: WorkloadConfig, sites: list[dict], rounds: int, workdir: Path, privacy: dict | None) -> dict:
    """FedAvg over `sites` (LocalTrainer each) for `rounds`; the final model's eval figures (weighted
    by the sites' held-out examples) and each site's final epsilon."""
    trainers = []
    for i, s in enumerate(sites):
        site = SiteConfig(**{**s, "id": f"s{i}", "partition": i,
                             "privacy": {"enabled": True, "delta": DELTA, **privacy} if privacy else {}})
        trainers.append(LocalTrainer(TrainerConfig(site=site, workload=workload, num_partitions=len(sites),
                                                   socket="/nonexistent", workdir=str(workdir / f"s{i}"),
                                                   rounds=rounds, seed=0)))
    model = initial_weights(workload, 0)
    opt = ServerOptimizer("fedavg", "delta")
    eps = {}
    for rnd in range(1, rounds + 1):
        mean = WeightedMean()
        for t in trainers:
            reply = _request(t, "Train", model, rnd)
            upd = handoff.Handle.from_json(reply["update"])
            mean.add({k: v.copy() for k, v in handoff.map_arrays(upd).items()}, reply["num_examples"])
            handoff.release(upd.path)
            eps[t.cfg.site.id] = reply["metrics"].get("dp_epsilon", 0.0)
        model = opt.step(model, mean.result())
    out: dict = {"eps": max(eps.values()) if privacy else float("inf")}
    n = 0
    for t in trainers:
        reply = _request(t, "Evaluate", model, rounds + 1)
        k = reply["num_examples"]
        for key in ("eval_loss", "eval_accuracy"):
            if key in reply["metrics"]:
                out[key] = out.get(key, 0.0) + reply["metrics"][key] * k
        n += k
    return {k: (v / n if k.startswith("eval_") else v) for k, v in out.items()}


def _request(t: LocalTrainer, method: str, model: dict, rnd: int) -> dict:
    h = handoff.write_arrays(model, f"dp-bench-{rnd}")
    try:
        reply = t.run_request(method, {"round": rnd, "config": {"update_kind": "delta"}, "global": h.to_json()})
    finally:
        handoff.release(h.path)
    if not reply.get("ok"):
        raise RuntimeError(f"{method} round {rnd}: {reply.get('error')}")
    return reply


def digits(tmp: Path, rounds: int) -> dict:
    wl = WorkloadConfig(task="digits", options={"hidden": 64})
    sites = [{"local_steps": 5, "batch_size": 256, "lr": 2.0}] * 3  # large batches: the noise is sigma C / batch
    out = {}
    for eps in (None, *EPSILONS):
        t0 = time.perf_counter()
        privacy = {"epsilon": eps, "max_grad_norm": 1.0} if eps else None
        res = federate(wl, sites, rounds, tmp / f"digits-{eps}", privacy)
        out[eps] = res
        print(f"digits  eps={eps or 'off':>4}: accuracy {res['eval_accuracy']:.4f}, eval loss {res['eval_loss']:.4f}, "
              f"epsilon spent {res['eps']:.3f} ({time.perf_counter() - t0:.1f}s)", flush=True)
    return out


def causal_lm(tmp: Path, rounds: int) -> dict:
    import hf_models

    model_dir = hf_models.tiny_llama(tmp / "model", hidden=64, layers=2, heads=4, kv_heads=2)
    for site in ("s0", "s1"):
        hf_models.write_corpus(tmp / "corpus" / site, files=6, bytes_per_file=20_000)
    wl = WorkloadConfig(task="hf-causal-lm", options={
        "model_dir": str(model_dir), "data": str(tmp / "corpus" / "{site}" / "*"), "seq_len": 32,
        "val_fraction": 0.1, "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}})
    sites = [{"local_steps": 5, "batch_size": 32, "lr": 3e-3, "optimizer": "adamw"}] * 2
    out = {}
    for eps in (None, *EPSILONS):
        t0 = time.perf_counter()
        privacy = {"epsilon": eps, "max_grad_norm": 1.0} if eps else None
        res = federate(wl, sites, rounds, tmp / f"hf-{eps}", privacy)
        out[eps] = res
        print(f"hf-lora eps={eps or 'off':>4}: eval loss {res['eval_loss']:.4f}, epsilon spent {res['eps']:.3f} "
              f"({time.perf_counter() - t0:.1f}s)", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--digits-rounds", type=int, default=40)
    p.add_argument("--hf-rounds", type=int, default=10)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            dig = digits(tmp, args.digits_rounds)
            hf = causal_lm(tmp, args.hf_rounds)
    finally:
        dist.destroy_process_group()
    print(f"digits accuracy drop at epsilon 8: {100 * (dig[None]['eval_accuracy'] - dig[8.0]['eval_accuracy']):.2f} "
          "points (target < 3)")
    print(f"RESULT eps=8 loss_dp={hf[8.0]['eval_loss']:.4f} loss_nodp={hf[None]['eval_loss']:.4f} "
          f"digits_acc_eps8={dig[8.0]['eval_accuracy']:.4f} digits_acc_nodp={dig[None]['eval_accuracy']:.4f}")


if __name__ == "__main__":
    main()
