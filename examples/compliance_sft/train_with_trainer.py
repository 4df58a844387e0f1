"""A Hugging Face Trainer fine-tuning script, federated by two added lines (marked FEDERATION).

sovfl starts it on every rank of a site whose config says `script: train_with_trainer.py` (see
federation.yaml); by hand: `SOVFL_TRAINER_CONFIG=trainer.json torchrun --nproc-per-node 2
train_with_trainer.py`. It reads the same workload options as the built-in task (model_dir, lora,
data, format: chat), so its model is the federation's. TRL's SFTTrainer is a Trainer: it is
federated by the same `hf_callback.federate(trainer)` call.
"""

import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from site_trainer import hf_callback, session

cfg = session.site_config()  # this site's options (model_dir, data, lora, ...), batch size, lr
opts, site = cfg.options, cfg.site
args = TrainingArguments(
    output_dir=os.path.join(cfg.workdir, "hf-trainer"), per_device_train_batch_size=site.batch_size,
    per_device_eval_batch_size=site.batch_size, gradient_accumulation_steps=site.grad_accum,
    learning_rate=site.lr, lr_scheduler_type="constant", save_strategy="no", logging_steps=10,
    report_to=[], disable_tqdm=True, use_cpu=site.backend == "gloo", ddp_find_unused_parameters=False, seed=cfg.seed)

model = AutoModelForCausalLM.from_pretrained(opts["model_dir"], dtype=torch.float32, local_files_only=True)
lora = opts.get("lora") or {}
model = get_peft_model(model, LoraConfig(r=lora.get("r", 8), lora_alpha=lora.get("alpha", 16),
                                         lora_dropout=lora.get("dropout", 0.05),
                                         target_modules=lora.get("target_modules"), task_type="CAUSAL_LM"))

data = hf_callback.site_data(cfg)  # FEDERATION: the site's chat rows, PII-scrubbed, packed, labels -100 off completions
trainer = Trainer(model=model, args=args, train_dataset=data.train, eval_dataset=data.val)
hf_callback.federate(trainer, site_metrics=data.site_metrics)  # FEDERATION: rounds, weights in, updates out
trainer.train()  # ends when the coordinator stops the site (or on SIGTERM)
print(f"rank {trainer.args.process_index}: federation ended", flush=True)
