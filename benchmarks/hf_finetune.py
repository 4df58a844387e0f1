"""Fine-tuning a Hugging Face causal LM: the site trainer service against a plain transformers loop.

One run, side by side, for LoRA and for full fine-tuning of the same local model on the same text,
and for LoRA on chat data (the SFT row: `format: chat`, synthetic compliance conversations from
examples/compliance_sft, rendered with the model's chat template, packed whole into rows of
`--sft-seq-len` with position ids restarting per conversation):
  plain — lora/full: benchmarks/_plain_hf.py under torchrun: from_pretrained, peft, the text
          tokenized in memory, DDP, fused AdamW, transformers' warm-up + cosine schedule;
          sft: benchmarks/_plain_sft.py, TRL's SFTTrainer on the same rows, both ways a team runs
          it: packed (`packing=True`: best fit, padding-free) and unpacked (padded per batch); the
          faster of the two (median) is the anchor. A few untimed steps, then `--steps` timed steps;
  ours  — the trainer service (`python -m site_trainer` under torchrun) running the built-in task
          `hf-causal-lm`, driven as the Flower relay drives it: per round the global tensors go
          into a shared-memory hand-off file, a Train request crosses the Unix socket, the ranks
          load, train `--steps` steps and hand the update back through rank 0's hand-off file,
          which the relay reads in full. One warm-up round, then timed rounds; the time is the
          relay's wall time, so the hand-off both ways and the token cache reads are in it.
The sides alternate (`--repeats` plain runs and service rounds, the service started once per mode,
the order flipped every repeat) so that the load of a shared machine hits both alike; the medians
are compared. Tokens/s count input tokens (sequences x seq_len) for lora/full, and real tokens (not
padding) for the SFT row, where the padding-free SFTTrainer has none and ours packs rows nearly full.
Bytes per round are the bytes of the update the trainer actually handed off, for each mode.

The model: a Llama-style model built here from a config (random weights, `--hidden`, `--layers`,
a byte-level BPE tokenizer trained on stdlib text), saved with save_pretrained to a temporary
directory; the text: Python standard-library sources as .txt files. Nothing is downloaded.

    python benchmarks/hf_finetune.py [--ranks 1] [--steps 20] [--repeats 5]

Last line:
    RESULT lora_ratio=<ours/plain> full_ratio=<ours/plain> sft_ratio=<ours/plain> lora_bytes_ratio=<full / lora>
(medians; targets: the three ratios >= 0.95 on CPU). `--modes sft` runs the SFT row alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from pydantic import ValidationError  # noqa: E402

from _trainer_bench import Service, _child_env, torchrun  # noqa: E402

LORA = {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
SITE = "bench"


class NotRunnable(RuntimeError):
    """The trainer service cannot run this workload yet (says why)."""


def build_inputs(tmp: Path, args) -> tuple[Path, list[Path]]:
    import hf_models

    model_dir = hf_models.tiny_llama(tmp / "model", hidden=args.hidden, layers=args.layers, heads=args.hidden // 32,
                                     kv_heads=max(1, args.hidden // 64), context=2 * max(args.seq_len, args.sft_seq_len),
                                     vocab_size=args.vocab, chat=True)
    files = hf_models.write_corpus(tmp / "data" / SITE, files=12, bytes_per_file=25_000)
    sys.path.insert(0, str(ROOT / "examples" / "compliance_sft"))
    import compliance_data

    compliance_data.write_site(tmp / "chat" / SITE, 0, rows=1000)
    return model_dir, files


def task_options(model_dir: Path, tmp: Path, seq_len: int, lora: dict | None, chat: bool = False) -> dict:
    if chat:
        return {"model_dir": str(model_dir), "format": "chat", "data": str(tmp / "chat" / "{site}" / "train.jsonl"),
                "seq_len": seq_len, "val_fraction": 0.0, "lora": lora}
    return {"model_dir": str(model_dir), "data": str(tmp / "data" / "{site}" / "*.txt"), "seq_len": seq_len,
            "val_fraction": 0.0, "lora": lora}


def plain(tmp: Path, spec: dict, ranks: int) -> dict:
    path = tmp / f"plain-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    anchor = "_plain_sft.py" if spec.get("chat") else "_plain_hf.py"  # SFT row: TRL's SFTTrainer
    out = subprocess.run([*torchrun(ranks), str(ROOT / "benchmarks" / anchor), str(path)], capture_output=True,
                         text=True, cwd=ROOT, timeout=1800, env={**os.environ, **_child_env()})
    if out.returncode != 0:
        raise SystemExit(f"plain loop failed (exit {out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def trainer_config(tmp: Path, name: str, options: dict, args) -> Path:
    """The service's TrainerConfig for the hf-causal-lm task (the workload form)."""
    from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig

    site = {"id": SITE, "ranks": args.ranks, "partition": 0, "local_steps": args.steps, "batch_size": args.batch,
            "lr": args.lr, "optimizer": "adamw", "warmup_steps": args.warmup, "lr_schedule": "cosine",
            "pii": {"enabled": False}}  # synthetic text; the plain loop scrubs nothing either
    try:
        cfg = TrainerConfig(site=SiteConfig(**site), workload=WorkloadConfig(task="hf-causal-lm", options=options),
                            num_partitions=1, seed=0, rounds=args.rounds + 1, socket=str(tmp / f"{name}.sock"),
                            workdir=str(tmp / name))
    except (ValidationError, ValueError, TypeError) as err:
        raise NotRunnable(f"this checkout's trainer service cannot be configured with the hf-causal-lm task and a "
                          f"warm-up + cosine schedule ({str(err).splitlines()[0]} ...); it needs the workload "
                          "machinery (Task loader, session, schedule)") from None
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / f"{name}.json"
    path.write_text(cfg.model_dump_json())
    return path


def parameter_count(options: dict) -> int:
    from site_trainer.tasks.hf_causal_lm import CausalLM
    from site_trainer.workload import TaskContext

    task = CausalLM(CausalLM.Options.model_validate(options), TaskContext(role="coordinator"))
    return sum(p.numel() for p in task.build_model().parameters())


def real_tokens_per_row(workdir: Path, seq_len: int) -> float:
    """The mean real (non-padding) tokens of our packed chat rows: the service's token cache's
    training conversations over the rows they pack into (the rows a round samples are shuffled, so a
    round's real tokens are its rows x this)."""
    from site_trainer import text_data
    from site_trainer.chat_data import ChatSequences

    (index,) = sorted(workdir.glob("**/text_cache/*/index.json"))
    seqs = ChatSequences.of(text_data.TokenCache.open(index.parent), "train", seq_len, 0)
    return seqs.tokens / len(seqs)


def measure(tmp: Path, mode: str, options: dict, spec: dict, args, run_ours: bool) -> dict:
    """Alternate, `--repeats` times, one plain run of `--steps` timed steps and one timed round of
    the service (started once, after a warm-up round), so that the machine's load hits both sides
    alike; tokens/s per side (best and median) and the update bytes of every timed round."""
    relay = None
    if run_ours:  # the first global model comes from the task, as on the coordinator (workloads.initial_weights)
        relay = Service(tmp / mode, trainer_config(tmp / mode, "svc", options, args), start_timeout_s=600)
    try:
        per_row = float(spec["seq_len"])
        if relay is not None:
            relay.round(0)  # warm-up, like the plain loop's untimed steps
            if spec.get("chat"):  # real tokens, as the padding-free SFTTrainer counts them
                per_row = real_tokens_per_row(tmp / mode, spec["seq_len"])
                print(f"  {mode}: our packed rows hold {per_row:.1f} real tokens of {spec['seq_len']} on average",
                      flush=True)
        # the SFT row's anchor is SFTTrainer both ways (packed, padding-free; unpacked, padded): the faster counts
        anchors = {"plain": spec, "padded": {**spec, "packing": False}} if spec.get("chat") else {"plain": spec}
        plain_tps, ours_tps, sizes = {a: [] for a in anchors}, [], set()
        for i in range(args.repeats):
            line = f"  {mode} {i}:"
            # alternate which side goes first, so that a drift of the machine's load favours neither
            for side in ((*anchors, "ours") if i % 2 == 0 else ("ours", *reversed(anchors))):
                if side in anchors:
                    plain_tps[side].append(plain(tmp, anchors[side], args.ranks)["tokens_per_s"])
                    line += f" {side} {plain_tps[side][-1]:,.0f} tokens/s"
                elif relay is not None:
                    wall, m = relay.round(i + 1)
                    ours_tps.append(m["samples_seen"] * per_row / wall)
                    sizes.add(m["update_bytes"])
                    line += f" ours {ours_tps[-1]:,.0f} tokens/s (update {m['update_bytes']:,} bytes)"
            print(line, flush=True)
    finally:
        if relay is not None:
            relay.close()
    if len(sizes) > 1:
        raise SystemExit(f"{mode}: update sizes differ between rounds: {sorted(sizes)}")
    best = max(plain_tps, key=lambda a: statistics.median(plain_tps[a]))  # the stronger anchor
    if len(plain_tps) > 1:
        print("  " + ", ".join(f"SFTTrainer {'packed' if a == 'plain' else 'padded'} median "
                               f"{statistics.median(v):,.0f} tokens/s" for a, v in plain_tps.items())
              + f"; the anchor is the faster ({'packed' if best == 'plain' else 'padded'})", flush=True)
    return {"plain": plain_tps[best], "ours": ours_tps, "bytes": sizes.pop() if sizes else 0}


def ratio(r: dict) -> float:
    """ours / plain, median against median of the alternated repetitions."""
    return statistics.median(r["ours"]) / statistics.median(r["plain"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1, help="ranks of the site (and of the plain loop)")
    ap.add_argument("--steps", type=int, default=20, help="local steps per round, and timed steps per plain run")
    ap.add_argument("--repeats", type=int, default=5, help="plain runs and service rounds, alternated; the medians "
                                                           "are compared (shared machines are noisy)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--sft-seq-len", type=int, default=512, help="the SFT row's seq_len: several conversations "
                                                                 "(about 190 tokens each) pack into a row")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--modes", default="lora,full,sft", help="rows to run: lora, full, sft (chat data)")
    args = ap.parse_args()
    modes = [m for m in ("lora", "full", "sft") if m in args.modes.split(",")]
    args.rounds = args.repeats  # the service's run length, for its cosine schedule
    with tempfile.TemporaryDirectory(prefix="sovfl-hfbench-") as d:
        tmp = Path(d)
        model_dir, files = build_inputs(tmp, args)
        params = parameter_count(task_options(model_dir, tmp, args.seq_len, None))
        print(f"model: Llama-style, {params:,} parameters ({args.layers} layers, width {args.hidden}, vocabulary "
              f"{args.vocab}); {args.ranks} rank(s), {args.repeats} x {args.steps} timed steps per side, "
              f"{args.batch} x {args.seq_len} tokens per rank per step", flush=True)
        try:
            trainer_config(tmp / "probe", "probe", task_options(model_dir, tmp, args.seq_len, LORA), args)
            missing = None
        except NotRunnable as err:
            missing = err
            print(f"ours: cannot run in this checkout: {err}; timing the plain loop only, no RESULT", flush=True)
        results: dict[str, dict] = {}
        for mode in modes:
            lora, chat = (None if mode == "full" else LORA), mode == "sft"
            data = [str(tmp / "chat" / SITE / "train.jsonl")] if chat else [str(f) for f in files]
            seq_len = args.sft_seq_len if chat else args.seq_len
            spec = {"model_dir": str(model_dir), "files": data, "seq_len": seq_len,
                    "batch_size": args.batch, "grad_accum": 1, "lr": args.lr, "warmup_steps": args.warmup,
                    "total_steps": 2 * args.steps, "lora": lora, "steps": args.steps, "untimed_steps": 3,
                    "bf16": False, "seed": 0, "chat": chat}
            r = results[mode] = measure(tmp, mode, task_options(model_dir, tmp, seq_len, lora, chat), spec, args,
                                        missing is None)
            line = f"{mode}: plain median {statistics.median(r['plain']):,.0f} (best {max(r['plain']):,.0f}) tokens/s"
            if missing is None:
                line += (f", ours median {statistics.median(r['ours']):,.0f} (best {max(r['ours']):,.0f}) tokens/s, "
                         f"ratio of medians {ratio(r):.3f} (of bests {max(r['ours']) / max(r['plain']):.3f}); "
                         f"update {r['bytes']:,} bytes per round")
            print(line, flush=True)
        if missing is not None:
            raise SystemExit(2)
        ratios = " ".join(f"{m}_ratio={ratio(results[m]):.3f}" for m in modes)
        extra = (f" lora_bytes_ratio={results['full']['bytes'] / results['lora']['bytes']:.1f}"
                 if {"lora", "full"} <= set(modes) else "")
        print(f"RESULT {ratios}{extra}")


if __name__ == "__main__":
    main()
