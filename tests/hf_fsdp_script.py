"""A Hugging Face Trainer script that asks for FSDP2 through its TrainingArguments (Trainer's own
accelerate integration), federated by the callback: run by tests/test_hf_callback_fsdp.py as a site.
After the federation ends each rank prints what accelerate made of the request."""

import os

import torch
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from site_trainer import hf_callback, session

cfg = session.site_config()
opts, site = cfg.options, cfg.site
args = TrainingArguments(
    output_dir=os.path.join(cfg.workdir, "fsdp"), per_device_train_batch_size=site.batch_size,
    per_device_eval_batch_size=site.batch_size, learning_rate=site.lr, lr_scheduler_type="constant",
    save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=site.backend == "gloo", seed=cfg.seed,
    fsdp="full_shard auto_wrap",
    fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
model = AutoModelForCausalLM.from_pretrained(opts["model_dir"], dtype=torch.float32, local_files_only=True)
lora = opts["lora"]
model = get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                         task_type="CAUSAL_LM"))
data = hf_callback.site_data(cfg)
trainer = Trainer(model=model, args=args, train_dataset=data.train, eval_dataset=data.val)
hf_callback.federate(trainer)
trainer.train()
params = dict(trainer.model.named_parameters())
lora_a = next(p for n, p in params.items() if ".lora_A." in n)
print(f"rank {args.process_index}: federation ended; fsdp_enabled={trainer.is_fsdp_enabled} "
      f"distributed_type={trainer.accelerator.distributed_type.value} "
      f"wrapped={type(trainer.model_wrapped).__name__} dtensor={isinstance(lora_a, DTensor)}", flush=True)
