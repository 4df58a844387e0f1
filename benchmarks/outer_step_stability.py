"""Does the global loss fall round after round? The outer optimizer, the overlap fold, the codec's clip
and the data size, each switched on and off in a small federated causal-LM run that fits on a CPU.

Three sites, each its own region of the standard library's sources, train a small Llama-style model
(tests/hf_models.tiny_llama: random weights, a byte-level BPE trained on stdlib text) with a
persistent AdamW (as the site trainer keeps it across rounds) for H local steps a round; the update
Δ = θ − w goes through the uplink as `benchmarks/wan_time_to_loss.py` sends it (int8 with a common
clip, stochastic rounding, error feedback: SecAgg+'s encoding), and the coordinator's real
`ServerOptimizer` (federation/coordinator/aggregate.py) takes the outer step on the mean. With
`overlap` the sites keep stepping while their update travels (all H steps, as on a slow link) and
fold the next global model in as site_trainer/overlap.py does: θ ← w_{r+1} + (θ_now − θ_r).
Each global model is evaluated on every site's validation text (fixed windows, weighted by count).

What differs from a deployment: one process, no Flower, no masks (SecAgg+ sums masked int8 words
that decode to the same sum; masks do not change values), the downlink is exact. It measures the
algorithm, not time. `max_rise` is the largest round-to-round rise of the global eval loss (in %).

    python benchmarks/outer_step_stability.py --rounds 10 --local-steps 60 --text-kb 60 --also-text-kb 900

Settings: `lr/momentum` (Nesterov; 0.7/0.9 is DiLoCo's, 0.7/0.5 the schema's default), `avg` (outer lr 1,
no momentum: plain averaging of the deltas), `no-overlap` (0.7/0.9 without overlap), `dense` (0.7/0.9,
the delta uncompressed). Each run prints a JSON line (eval loss per round, the sites' mean training
loss, the passes over a site's training text); last line:
    RESULT max_rise_pct[<setting>@<kB>]=<..> ...
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from federation.coordinator.aggregate import ServerOptimizer  # noqa: E402


@dataclass(frozen=True)
class Setting:
    name: str
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    overlap: bool = True
    clip: float | None = 0.05  # None: the dense delta travels
    text_kb: int = 0  # per site; 0: --text-kb


def int8_clip(x: np.ndarray, clip: float, rng: np.random.Generator) -> np.ndarray:
    """SecAgg+'s int8 encoding of x (values in [-clip, clip], 255 levels, stochastic rounding), decoded."""
    scale = clip / 127.0
    y = np.clip(x, -clip, clip) / scale
    low = np.floor(y)
    q = low + (rng.random(y.shape) < (y - low))
    return (q * scale).astype(np.float32)


def flat(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().astype(np.float32)


def load_flat(model, vec: np.ndarray) -> None:
    import torch

    i = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(torch.from_numpy(vec[i:i + n]).view_as(p))
            i += n


class Site:
    def __init__(self, model_dir: Path, tokens: np.ndarray, val: np.ndarray, args, seed: int):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.tokens, self.args = tokens, args
        self.gen = torch.Generator().manual_seed(seed)
        n = args.seq_len
        starts = np.arange(0, len(val) - n - 1, n)[: args.eval_windows]
        self.val = torch.from_numpy(np.stack([val[s:s + n] for s in starts]).astype(np.int64))
        self.residual: np.ndarray | None = None
        self.seen = 0

    def steps(self, k: int) -> float:
        import torch

        loss = math.nan
        n, b = self.args.seq_len, self.args.batch
        self.model.train()
        for _ in range(k):
            s = torch.randint(0, len(self.tokens) - n - 1, (b,), generator=self.gen).numpy()
            x = torch.from_numpy(np.stack([self.tokens[i:i + n] for i in s]).astype(np.int64))
            out = self.model(input_ids=x, labels=x)
            out.loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            loss = out.loss.item()
            self.seen += b * n
        return loss

    def eval_loss(self, w: np.ndarray) -> float:
        import torch

        load_flat(self.model, w)
        self.model.eval()
        with torch.no_grad():
            return float(self.model(input_ids=self.val, labels=self.val).loss)


def site_data(model_dir: Path, text_kb: int, seq_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    import hf_models
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    per = text_kb * 1000
    text = hf_models.stdlib_text(max_bytes=3 * per + 1000)
    out = []
    for s in range(3):
        chunk = text[s * per:(s + 1) * per]
        cut = int(len(chunk) * 0.9)
        ids = lambda t: np.asarray(tok(t)["input_ids"], dtype=np.int32)  # noqa: E731
        out.append((ids(chunk[:cut]), ids(chunk[cut:])))
    return out


def run(setting: Setting, model_dir: Path, data, args) -> dict:
    import torch

    torch.manual_seed(args.seed)
    sites = [Site(model_dir, tr, va, args, args.seed * 10 + i) for i, (tr, va) in enumerate(data)]
    w = flat(sites[0].model)
    opt = ServerOptimizer("diloco", "delta", setting.lr, momentum=setting.momentum, nesterov=setting.nesterov)
    rng = np.random.default_rng(args.seed)
    weights = np.array([len(s.val) for s in sites], float)
    evals = [float(np.average([s.eval_loss(w) for s in sites], weights=weights))]
    train_losses, theta_sent = [], [None] * len(sites)
    t0 = time.monotonic()
    for r in range(args.rounds):
        deltas, tl = [], []
        for i, s in enumerate(sites):
            if setting.overlap and theta_sent[i] is not None:
                # background steps from θ_r while the update travelled, then the fold into w_{r+1}
                load_flat(s.model, theta_sent[i])  # (evaluation loaded the global model)
                tl.append(s.steps(args.local_steps))
                load_flat(s.model, w + (flat(s.model) - theta_sent[i]))
            else:
                load_flat(s.model, w)
                tl.append(s.steps(args.local_steps))
            theta = flat(s.model)
            d = theta - w
            if setting.clip is not None:
                x = d + (s.residual if s.residual is not None else 0.0)
                sent = int8_clip(x, setting.clip, rng)
                s.residual = x - sent
                d = sent
            deltas.append(d)
            theta_sent[i] = theta
        mean = np.mean(deltas, axis=0).astype(np.float32)
        w = opt.step({"w": w}, {"w": mean})["w"]
        evals.append(float(np.average([s.eval_loss(w) for s in sites], weights=weights)))
        train_losses.append(round(float(np.mean(tl)), 3))
    rises = [100.0 * (b - a) / a for a, b in zip(evals, evals[1:])]
    passes = sites[0].seen / len(sites[0].tokens)
    return {"setting": setting.name, "lr": setting.lr, "momentum": setting.momentum, "nesterov": setting.nesterov,
            "overlap": setting.overlap, "clip": setting.clip, "text_kb": setting.text_kb or args.text_kb,
            "eval": [round(e, 4) for e in evals], "train": train_losses, "max_rise_pct": round(max(rises), 2),
            "passes": round(passes, 2), "seconds": round(time.monotonic() - t0, 1)}


SETTINGS = {
    "diloco-0.7/0.9": Setting("diloco-0.7/0.9"),
    "avg": Setting("avg", lr=1.0, momentum=0.0),
    "no-overlap": Setting("no-overlap", overlap=False),
    "dense": Setting("dense", clip=None),
    "0.7/0.5": Setting("0.7/0.5", momentum=0.5),
    "0.5/0.8": Setting("0.5/0.8", lr=0.5, momentum=0.8),
    "1.0/0.5": Setting("1.0/0.5", lr=1.0, momentum=0.5),
    "0.7/0.9-heavy": Setting("0.7/0.9-heavy", nesterov=False),
}


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {list(SETTINGS)}")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--local-steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4, help="inner AdamW lr")
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--text-kb", type=int, default=60, help="per site (90%% train)")
    ap.add_argument("--also-text-kb", type=int, default=0, help="run every setting again with this much text")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON lines of every run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import hf_models

    wd = Path(tempfile.mkdtemp(prefix="outer-step-"))
    model_dir = hf_models.tiny_llama(wd / "model", hidden=args.embd, layers=args.layers, heads=max(1, args.embd // 32),
                                     kv_heads=max(1, args.embd // 32), context=2 * args.seq_len,
                                     vocab_size=args.vocab, seed=args.seed)
    sizes = [args.text_kb] + ([args.also_text_kb] if args.also_text_kb else [])
    results = []
    for kb in sizes:
        data = site_data(model_dir, kb, args.seq_len)
        for name in args.settings.split(","):
            res = run(replace(SETTINGS[name], text_kb=kb), model_dir, data, args)
            results.append(res)
            print(json.dumps(res), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(res) + "\n")
    worst = {f"{r['setting']}@{r['text_kb']}kB": r["max_rise_pct"] for r in results}
    print("RESULT " + " ".join(f"max_rise_pct[{k}]={v}" for k, v in worst.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
