"""The anchor of benchmarks/hf_finetune.py: a plain PyTorch/transformers fine-tuning loop.

What a user writes without sovereign-fl: `AutoModelForCausalLM.from_pretrained`, peft's
`get_peft_model` for LoRA, the site's text tokenized in memory and packed into sequences, DDP when
there are several ranks, fused AdamW with transformers' warm-up + cosine schedule, bf16 autocast
when asked. None of the framework's code runs here.

    torchrun --nproc-per-node K benchmarks/_plain_hf.py SPEC.json

SPEC.json: {model_dir, files, seq_len, batch_size, grad_accum, lr, warmup_steps, total_steps,
lora: {r, alpha, dropout, target_modules} | null, steps, untimed_steps, bf16, seed, chat}.
With `chat` (the SFT row): the files are .jsonl conversations, each rendered and tokenized with the
tokenizer's chat template (`apply_chat_template`), cut at seq_len, packed whole into rows of
seq_len tokens with position ids restarting per conversation (transformers then keeps attention
inside each), the loss on every real token (masking some targets changes no compute).
Rank 0 prints one JSON line: tokens/s and samples/s over the timed steps (after the untimed ones).
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def packed(files: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Every file's text tokenized, EOS after each document, cut into rows of seq_len + 1 tokens."""
    ids: list[int] = []
    for f in files:
        lines = Path(f).read_text(encoding="utf-8").splitlines() if f.endswith(".jsonl") else None
        docs = [json.loads(x)["text"] for x in lines if x.strip()] if lines is not None else [Path(f).read_text()]
        for doc in docs:
            ids.extend(tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"] + [tokenizer.eos_token_id])
    n = (len(ids) - 1) // seq_len
    flat = torch.tensor(ids[:n * seq_len + 1])
    return torch.stack([flat[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])


def packed_chat(files: list[str], tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, position ids, labels) rows of seq_len tokens: whole conversations, next fit."""
    convs = []
    for f in files:
        for line in Path(f).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            msgs = row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                           {"role": "assistant", "content": row["completion"]}]
            convs.append(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"][:seq_len])
    rows, current = [], []
    for c in convs:
        if sum(map(len, current)) + len(c) > seq_len:
            rows.append(current)
            current = []
        current.append(c)
    rows.append(current)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(rows), seq_len), pad)
    pos = torch.zeros((len(rows), seq_len), dtype=torch.long)
    labels = torch.full((len(rows), seq_len), -100)
    for r, row in enumerate(rows):
        at = 0
        for c in row:
            ids[r, at:at + len(c)] = torch.tensor(c)
            labels[r, at + 1:at + len(c)] = torch.tensor(c[1:])
            pos[r, at:at + len(c)] = torch.arange(len(c))
            at += len(c)
        pos[r, at:] = torch.arange(seq_len - at)
    return ids, pos, labels


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], local_files_only=True, dtype=torch.float32)
    if spec["lora"]:
        from peft import LoraConfig, get_peft_model

        lo = spec["lora"]
        model = get_peft_model(model, LoraConfig(r=lo["r"], lora_alpha=lo["alpha"], lora_dropout=lo["dropout"],
                                                 target_modules=lo["target_modules"], task_type="CAUSAL_LM"))
    model.train()
    tok = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    chat = bool(spec.get("chat"))
    if chat:
        data, positions, labels = packed_chat(spec["files"], tok, spec["seq_len"])
    else:
        data = packed(spec["files"], tok, spec["seq_len"])
    mine = torch.arange(len(data))[rank::world]
    if world > 1:
        model = DDP(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec["lr"], weight_decay=0.0,
                            fused=True)
    sched = get_cosine_schedule_with_warmup(opt, spec["warmup_steps"], spec["total_steps"])
    gen = torch.Generator().manual_seed(spec["seed"] + rank)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(spec["bf16"]))
    b, k = spec["batch_size"], spec["grad_accum"]

    def run(steps: int) -> float:
        loss = torch.zeros(())
        for _ in range(steps):
            for i in range(k):
                pick = mine[torch.randint(len(mine), (b,), generator=gen)]
                ids = data[pick]
                sync = model.no_sync() if world > 1 and i < k - 1 else contextlib.nullcontext()
                with sync, autocast:
                    if chat:
                        logits = model(input_ids=ids, position_ids=positions[pick], use_cache=False).logits
                        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[pick][:, 1:].flatten(),
                                               ignore_index=-100)
                    else:
                        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
                        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
                (loss / k).backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return float(loss)

    run(spec["untimed_steps"])
    dist.barrier()
    t0 = time.perf_counter()
    loss = run(spec["steps"])
    dist.barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        samples = spec["steps"] * k * b * world
        print(json.dumps({"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
                          "tokens_per_s": samples * spec["seq_len"] / seconds, "last_loss": loss}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
