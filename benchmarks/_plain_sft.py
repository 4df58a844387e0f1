"""The SFT row's anchor in benchmarks/hf_finetune.py: a plain TRL `SFTTrainer` run, as a team writes it
without sovereign-fl.

`from_pretrained`, the site's .jsonl rows loaded as a `datasets.Dataset` of conversations
(prompt-completion rows as a user and an assistant turn), `SFTTrainer` with a peft `LoraConfig`,
either `packing=True` (spec `packing`; best-fit, padding-free: TRL's packing, one flat row per batch)
or not (each conversation a row, padded to the batch's longest), at `max_length=seq_len`, AdamW with
transformers' warm-up + cosine schedule, DDP through the Trainer when there are several ranks. TRL
tokenizes with the tokenizer's chat template itself. None of the framework's code runs here.

    torchrun --nproc-per-node K benchmarks/_plain_sft.py SPEC.json

SPEC.json: as benchmarks/_plain_hf.py's (model_dir, files, seq_len, batch_size, lr, warmup_steps,
total_steps, lora, steps, untimed_steps, seed) and `packing`. Rank 0 prints one JSON line: the real (non-padding)
tokens/s over the timed steps, all ranks, after the untimed ones.
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def rows(files: list[str]) -> list[dict]:
    out = []
    for f in files:
        for line in Path(f).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            out.append({"messages": row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                                            {"role": "assistant", "content": row["completion"]}]})
    return out


def main() -> None:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.manual_seed(spec["seed"])
    untimed, steps = spec["untimed_steps"], spec["steps"]
    lora = spec["lora"]
    args = SFTConfig(output_dir=str(Path(sys.argv[1]).with_suffix(".out")), per_device_train_batch_size=spec["batch_size"],
                     learning_rate=spec["lr"], lr_scheduler_type="cosine", warmup_steps=spec["warmup_steps"],
                     max_steps=untimed + steps, max_length=spec["seq_len"], packing=bool(spec.get("packing", True)), gradient_checkpointing=False,
                     save_strategy="no", logging_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True,
                     ddp_find_unused_parameters=False, seed=spec["seed"], dataloader_drop_last=True)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                             target_modules=lora["target_modules"], task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows(spec["files"])),
                         processing_class=tok, peft_config=peft_config)

    clock: dict = {"tokens": 0}
    step_fn = trainer.training_step

    def training_step(model, inputs, *a, **kw):  # count the real tokens of the timed steps (not the padding)
        if trainer.state.global_step >= untimed:
            mask = inputs.get("attention_mask")
            clock["tokens"] += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
        return step_fn(model, inputs, *a, **kw)

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == untimed:
                clock["t0"] = time.perf_counter()
            elif state.global_step == untimed + steps:
                clock["t1"] = time.perf_counter()

    trainer.training_step = training_step
    trainer.add_callback(Clock())
    trainer.train()
    tokens = torch.tensor(float(clock["tokens"]))
    if dist.is_initialized():
        dist.all_reduce(tokens)
    if int(os.environ.get("RANK", "0")) == 0:
        wall = clock["t1"] - clock["t0"]
        print(json.dumps({"tokens_per_s": float(tokens) / wall, "tokens": float(tokens), "wall_s": wall}), flush=True)


if __name__ == "__main__":
    main()
