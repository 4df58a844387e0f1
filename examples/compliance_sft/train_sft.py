"""A TRL `SFTTrainer` fine-tuning script, federated by three added lines (marked FEDERATION).

sovfl starts it on every rank of a site whose config says `script: train_sft.py` (run.py --trainer);
by hand: `SOVFL_TRAINER_CONFIG=trainer.json torchrun --nproc-per-node 2 train_sft.py`. It reads the
workload's options (model_dir, lora, seq_len, data with format: chat), so its model is the
federation's; SFTTrainer packs the site's conversations (`packing=True`: position ids restart per
conversation) and learns on the assistant tokens only. Needs `pip install 'sovereign-fl[trl]'`.
"""

import os

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from site_trainer import hf_callback, session

cfg = session.site_config()  # this site's options (model_dir, data, lora, seq_len), batch size, lr
opts, site = cfg.options, cfg.site
args = SFTConfig(
    output_dir=os.path.join(cfg.workdir, "sft"), per_device_train_batch_size=site.batch_size,
    per_device_eval_batch_size=site.batch_size, gradient_accumulation_steps=site.grad_accum,
    learning_rate=site.lr, lr_scheduler_type="constant", max_length=opts.get("seq_len", 512), packing=True,
    gradient_checkpointing=False, save_strategy="no", logging_steps=10, report_to=[], disable_tqdm=True,
    use_cpu=site.backend == "gloo", ddp_find_unused_parameters=False, seed=cfg.seed)

model = AutoModelForCausalLM.from_pretrained(opts["model_dir"], dtype=torch.float32, local_files_only=True)
tokenizer = AutoTokenizer.from_pretrained(opts["model_dir"], local_files_only=True)
lora = opts.get("lora") or {}
peft_config = LoraConfig(r=lora.get("r", 8), lora_alpha=lora.get("alpha", 16), lora_dropout=lora.get("dropout", 0.05),
                         target_modules=lora.get("target_modules"), task_type="CAUSAL_LM")

data = hf_callback.site_data(cfg)  # FEDERATION: the site's chat rows, PII-scrubbed, templated, labels -100 off answers
train, val = data.sft_datasets()  # FEDERATION: one tokenized conversation per row, for SFTTrainer to pack
trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=val, processing_class=tokenizer,
                     peft_config=peft_config)
hf_callback.federate(trainer, site_metrics=data.site_metrics)  # FEDERATION: rounds, weights in, updates out
trainer.train()  # ends when the coordinator stops the site (or on SIGTERM)
print(f"rank {trainer.args.process_index}: federation ended", flush=True)
