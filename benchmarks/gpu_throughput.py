"""Tokens/s per GPU of the site trainer service against a plain torchrun loop, NCCL and bf16.

Workload: the byte-level GPT (site_trainer/tasks/slm.py, vocabulary 256) scaled to about 125M
parameters (18 blocks, width 768, 12 heads, 1024-token sequences), 16 sequences per GPU per step,
fused AdamW, bf16 compute and gradient reduction with fp32 master weights. For each strategy
(ddp, zero2, zero3):
  plain — benchmarks/_plain_torchrun.py: DDP or FSDP2 written with torch alone, the same model,
          data, batch, optimizer and precision, timed over rounds x steps steps after a warm-up;
  ours  — the trainer service (`python -m site_trainer` under torchrun), driven as the Flower
          relay drives it: per round the global model goes into a shared-memory hand-off file, a
          Train request crosses the Unix socket, every rank loads the model, trains `--steps`
          steps, and the update comes back through rank 0's hand-off file, read in full. One
          warm-up round, then `--rounds` timed rounds; the time is the relay's wall time, so the
          hand-off in both directions is included.
Printed per variant: tokens/s per GPU and peak CUDA memory (max_memory_allocated, worst rank;
plain: over the timed steps; ours: the largest of the timed rounds, each with its load and training).

    python benchmarks/gpu_throughput.py [--nproc N] [--steps 30] [--rounds 3] [--strategies ddp,zero2,zero3]
    python benchmarks/gpu_throughput.py --smoke      # CPU, gloo, fp32, a tiny GPT: checks the machinery

On CUDA it uses NCCL and bf16 and refuses to run otherwise (no silent fall-back). With one GPU the
world size is 1: zero2/zero3 then measure FSDP2's overhead, not its memory savings.
Last line: RESULT tokens_per_s_ours=<..> tokens_per_s_plain=<..> ratio=<ours/plain>, the geometric
means over the strategies run.

--model hf-1.5b: the built-in task `hf-causal-lm` (full fine-tuning) on a Qwen2-1.5B-shaped Llama built
here from a config (random weights, hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, vocabulary
151936, tied embeddings: about 1.54B parameters) with a tokenizer trained on stdlib text, saved with
save_pretrained; nothing is downloaded. --model hf-tiny is the same machinery at toy size (CPU smoke).
MFU for both sides: model FLOPs per token 6 N + 12 L H S (N parameters, L layers, H width, S sequence
length; PaLM's appendix B) x tokens/s per GPU / the GPU's dense bf16 peak (`--peak-tflops`, default
989 for an H100/H200 SXM). RESULT lines: one per strategy, then the geometric means.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _trainer_bench import Service, plain, trainer_config  # noqa: E402
from site_trainer.config import WorkloadConfig  # noqa: E402

GIB = 2**30
GPT_125M = WorkloadConfig(task="slm", options={"n_layer": 18, "n_head": 12, "n_embd": 768, "block_size": 1024,
                                               "corpus_bytes_per_site": 400_000})
PEAK_TFLOPS = 989.0  # H100/H200 SXM, dense bf16
HF_SHAPES = {  # name: (hidden, layers, heads, kv_heads, mlp, vocab, seq_len)
    "hf-1.5b": (1536, 28, 12, 2, 8960, 151936, 1024),
    "hf-tiny": (64, 2, 4, 2, 128, 512, 32),
}
GPT_SMOKE = WorkloadConfig(task="slm", options={"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32,
                                                "corpus_bytes_per_site": 20_000})


def environment(smoke: bool, nproc: int) -> str:
    """Print what runs where; on CUDA, stop unless NCCL, bf16 and `nproc` GPUs are all there."""
    print(f"torch {torch.__version__}", flush=True)
    if smoke:
        print(f"--smoke: CPU, gloo, fp32, {nproc} rank(s), a tiny GPT (checks the machinery; no GPU figures)")
        return "cpu"
    if not torch.cuda.is_available():
        raise SystemExit("gpu_throughput: no CUDA device is visible to torch (torch.cuda.is_available() is False); "
                         "this benchmark measures GPUs: run it on a GPU machine, or pass --smoke on CPU")
    if not dist.is_nccl_available():
        raise SystemExit(f"gpu_throughput: this torch ({torch.__version__}) has no NCCL; install a CUDA build of torch")
    if torch.cuda.device_count() < nproc:
        raise SystemExit(f"gpu_throughput: --nproc {nproc} needs {nproc} GPUs, {torch.cuda.device_count()} visible")
    if not torch.cuda.is_bf16_supported():
        raise SystemExit(f"gpu_throughput: {torch.cuda.get_device_name(0)} has no bf16; this benchmark is bf16 only")
    print(f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{nproc} x {torch.cuda.get_device_name(0)}")
    if nproc == 1:
        print("world size 1 (one GPU): zero2/zero3 shard over a single rank, so they show FSDP2's overhead, "
              "not its memory savings")
    return "cuda"


def hf_workload(tmp: Path, name: str) -> tuple[WorkloadConfig, dict]:
    """A Llama-style model of HF_SHAPES[name] saved under `tmp` (random weights, a local tokenizer), and
    some stdlib text: the hf-causal-lm workload of full fine-tuning over them; (workload, shape)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import hf_models
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, mlp, vocab, seq = HF_SHAPES[name]
    out = tmp / name
    tok = hf_models.train_tokenizer(out, 2048, seq)
    cfg = LlamaConfig(vocab_size=max(vocab, len(tok)), hidden_size=hidden, intermediate_size=mlp,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      max_position_embeddings=seq, tie_word_embeddings=True, initializer_range=hf_models.INIT_STD,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init at GPU speed where there is one
        model = LlamaForCausalLM(cfg)
    hf_models._save(model.cpu(), tok, out)
    params = sum(p.numel() for p in model.parameters())
    del model
    files = hf_models.write_corpus(tmp / "data" / "gpu", files=8, bytes_per_file=200_000)
    wl = WorkloadConfig(task="hf-causal-lm", options={"model_dir": str(out), "data": [str(files[0].parent / "*.txt")],
                                                      "seq_len": seq, "val_fraction": 0.0, "lora": None})
    return wl, {"params": params, "layers": layers, "hidden": hidden, "seq": seq}


def mfu(tokens_per_s: float, shape: dict, peak_tflops: float) -> float:
    """Model FLOPs utilisation: (6 N + 12 L H S) FLOPs per token at `tokens_per_s`, over the peak."""
    per_token = 6 * shape["params"] + 12 * shape["layers"] * shape["hidden"] * shape["seq"]
    return tokens_per_s * per_token / (peak_tflops * 1e12)


def check_handoff_space(model_bytes: int) -> None:
    """The hand-off files (global model in, update out) live in /dev/shm: a container's default
    64 MiB there would fail the first round, so say so before starting anything."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free < 3 * model_bytes:
        raise SystemExit(f"gpu_throughput: /dev/shm has {shutil.disk_usage(shm).free / GIB:.2f} GiB free, the "
                         f"hand-off needs about {3 * model_bytes / GIB:.2f} GiB (two model-sized files and slack); "
                         "enlarge it (e.g. docker --shm-size=8g)")


def check_placement(what: str, device: str, compute: str, want_device: str, want_compute: str) -> None:
    if not device.startswith(want_device) or compute != want_compute:
        raise SystemExit(f"gpu_throughput: {what} trained on {device} in {compute}, expected {want_device} in "
                         f"{want_compute}; refusing to report figures for the wrong setup")


def run_ours(tmp: Path, cfg_path: Path, rounds: int, world: int, block: int, want: tuple[str, str]) -> dict:
    svc = Service(tmp, cfg_path, start_timeout_s=600)
    try:
        check_placement("the trainer service", svc.info["device"], svc.info["compute"], *want)
        svc.round(0)  # warm-up: kernels, NCCL channels, the first hand-off
        tokens, seconds, peak = 0, 0.0, 0
        for r in range(1, rounds + 1):
            wall, m = svc.round(r)
            tokens += m["samples_seen"] * block
            seconds += wall
            peak = max(peak, int(m.get("cuda_peak_bytes", 0)))
            train_s = m["train_s"]
        return {"tokens_per_s": tokens / seconds / world, "cuda_peak_bytes": peak,
                "train_share": train_s / wall}
    finally:
        svc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=1, help="GPUs (ranks) of the site, one node")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (plain: rounds x steps timed steps)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per GPU per step")
    ap.add_argument("--strategies", default="ddp,zero2,zero3")
    ap.add_argument("--model", default="gpt-125m", choices=["gpt-125m", *HF_SHAPES])
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="the GPU's dense bf16 peak, for MFU")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, fp32, a tiny model, few steps")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.rounds, args.batch = min(args.steps, 3), min(args.rounds, 2), min(args.batch, 4)
        if args.model == "hf-1.5b":
            args.model = "hf-tiny"
    device = environment(args.smoke, args.nproc)
    site = {"backend": "gloo", "mixed_precision": "fp32"} if args.smoke else {"backend": "nccl", "mixed_precision": "bf16"}
    site["pii"] = {"enabled": False}  # generated stdlib text; the plain loop scrubs nothing either (no Presidio there)
    want = (device, site["mixed_precision"])
    ours_all, plain_all = [], []
    with tempfile.TemporaryDirectory(prefix="sovfl-gpu-") as d:
        tmp = Path(d)
        if args.model in HF_SHAPES:
            wl, shape = hf_workload(tmp, args.model)
            params, block = shape["params"], shape["seq"]
            print(f"model: Llama-style causal LM built from a config, {params:,} parameters ({shape['layers']} "
                  f"layers, width {shape['hidden']}, {block} tokens), task hf-causal-lm, full fine-tuning",
                  flush=True)
        else:
            from site_trainer import workloads

            wl = GPT_SMOKE if args.smoke else GPT_125M
            params = sum(a.size for a in workloads.initial_weights(wl, 0).values())
            block = wl.options["block_size"]
            o = wl.options
            shape = {"params": params, "layers": o["n_layer"], "hidden": o["n_embd"], "seq": block}
            print(f"model: byte-level GPT, {params:,} parameters ({o['n_layer']} blocks, width {o['n_embd']}, "
                  f"{o['n_head']} heads, {block} tokens)", flush=True)
        check_handoff_space(4 * params)
        print(f"{args.batch} sequences per GPU per step, fused AdamW, {site['mixed_precision']}; {args.rounds} timed "
              f"rounds x {args.steps} steps", flush=True)
        lines = []
        for strategy in args.strategies.split(","):
            cfg_path = trainer_config(tmp, f"gpu-{strategy}", wl, args.nproc, args.steps, parallelism=strategy,
                                      batch_size=args.batch, lr=3e-4, **site)
            p = plain(cfg_path, args.rounds * args.steps, warmup=args.steps)
            check_placement("the plain loop", p["device"], p["compute"], *want)
            p_tok = p["tokens_per_s"] / args.nproc
            o = run_ours(tmp / f"svc-{strategy}", cfg_path, args.rounds, args.nproc, block, want)
            plain_all.append(p_tok)
            ours_all.append(o["tokens_per_s"])
            m_o, m_p = mfu(o["tokens_per_s"], shape, args.peak_tflops), mfu(p_tok, shape, args.peak_tflops)
            print(f"{strategy:<6} plain {p_tok:>10,.0f} tokens/s/GPU, MFU {m_p:.3f}, peak {p['cuda_peak_bytes'] / GIB:6.2f} "
                  f"GiB | ours {o['tokens_per_s']:>10,.0f} tokens/s/GPU, MFU {m_o:.3f}, peak "
                  f"{o['cuda_peak_bytes'] / GIB:6.2f} GiB | ratio {o['tokens_per_s'] / p_tok:.3f} (training "
                  f"{100 * o['train_share']:.0f}% of a round's relay time)", flush=True)
            lines.append(f"RESULT strategy={strategy} model={args.model} steps={args.steps} "
                         f"tokens_per_s_ours={o['tokens_per_s']:.0f} tokens_per_s_plain={p_tok:.0f} "
                         f"ratio={o['tokens_per_s'] / p_tok:.3f} mfu_ours={m_o:.3f} mfu_plain={m_p:.3f}")
            print(lines[-1], flush=True)  # now, and again at the end: a run cut short keeps what it measured
    gmean = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))  # noqa: E731
    o, p = gmean(ours_all), gmean(plain_all)
    print(f"geometric means over {args.strategies} ({'CPU smoke run' if args.smoke else f'{args.nproc} GPU(s)'})")
    for line in lines:
        print(line)
    print(f"RESULT tokens_per_s_ours={o:.0f} tokens_per_s_plain={p:.0f} ratio={o / p:.3f}")


if __name__ == "__main__":
    main()
