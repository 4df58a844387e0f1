"""Continue a prompt with the federated byte-level GPT from a coordinator checkpoint."""

from __future__ import annotations

import argparse

import torch

from federation.config.schema import load_config
from federation.coordinator.checkpoint import load_checkpoint
from site_trainer.workloads import coordinator_model


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: bytes, n: int, temperature: float, seed: int) -> bytes:
    torch.manual_seed(seed)
    idx = torch.tensor([list(prompt) or [10]], dtype=torch.long)
    for _ in range(n):
        logits = model(idx[:, -model.block_size:])[:, -1, :] / max(temperature, 1e-4)
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1)
        idx = torch.cat([idx, nxt], dim=1)
    return bytes(idx[0].tolist())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("config")
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--bytes", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = load_config(args.config)
    if cfg.workload.task != "slm":
        raise SystemExit(f"{args.config}: workload is '{cfg.workload.name}'; sampling needs 'slm'")
    rnd, weights, _ = load_checkpoint(args.checkpoint)
    model, exchanged = coordinator_model(cfg.workload, cfg.federation.seed)
    missing = set(exchanged) - set(weights)
    if missing:
        raise SystemExit(f"{args.checkpoint}: not a checkpoint of this workload (missing {sorted(missing)[:3]})")
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    model.eval()
    print(f"# global model after round {rnd}")
    print(generate(model, args.prompt.encode(), args.bytes, args.temperature, args.seed).decode("utf-8", "replace"))


if __name__ == "__main__":
    main()
