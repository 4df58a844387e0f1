"""The built-in Hugging Face causal-LM task: a pretrained model from a local directory, fine-tuned
on a site's own text, with LoRA adapters (the default) or every weight.

Registered as `hf-causal-lm` (entry point group `sovereign_fl.workloads`). In the YAML:

    workload:
      task: hf-causal-lm
      options:
        model_dir: /models/compliance-7b      # config.json, *.safetensors, tokenizer files
        data: ["/srv/corpus/{site}/**/*.jsonl", "/srv/corpus/{site}/*.txt"]
        seq_len: 1024
        lora: {r: 16, alpha: 32, dropout: 0.05, target_modules: [q_proj, k_proj, v_proj, o_proj]}

Nothing is fetched from a hub: importing this module forces Hugging Face's offline mode, every
load is `local_files_only`, `model_dir` must be a directory, pickled weights (`*.bin`) and custom
modelling code (`auto_map`) are not loaded. Everything the options name is checked when the task
is constructed, before any process group work starts: missing files, a `seq_len` beyond the
model's context, a tokenizer larger than the embedding, LoRA target modules that match nothing,
and, on sites, data patterns that match nothing or match unreadable or unsupported files.

With `format: chat` the site's data are .jsonl conversations or prompt-completion rows, rendered
with the tokenizer's chat template and learned on the assistant's tokens only
(`site_trainer.chat_data`); otherwise raw text, every token learned.

The site's text goes through `site_trainer.text_data` (see its docstring): streamed, transformed
(the site's PII scrubber first, then `options.transforms`), tokenized once per site, cached by
content hash and read from a memory map. Only the adapters travel with LoRA (the framework's
default `exchanged`: the trainable parameters); the decoder layers are found by the framework
from the model's `_no_split_modules`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from pathlib import Path
from typing import Literal

os.environ["HF_HUB_OFFLINE"] = "1"  # before any Hugging Face import: they read it once
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator  # noqa: E402

from site_trainer import chat_data, text_data  # noqa: E402
from site_trainer.workload import Task, TaskContext, TaskData  # noqa: E402

CONFIG = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
DEFAULT_MAX_SEQ_LEN = 2048


class OptionsError(ValueError):
    """An option of the task cannot be used; the message names the field and the fix."""


def force_offline() -> None:
    """Hugging Face libraries read the offline switches at import; set them in the loaded modules too."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True


# ---- options ----------------------------------------------------------------------------------
class LoraOptions(BaseModel):
    """LoRA adapters (peft): only these train and travel; the base stays frozen on every site."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    r: int = Field(8, ge=1, le=4096, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scaling: the update is (alpha / r) * B @ A")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] | Literal["all-linear"] | None = Field(
        None, description="module names (suffixes) to adapt, 'all-linear', or null for peft's default for "
                          "the architecture (e.g. q_proj, v_proj for Llama; c_attn for GPT-2)")


def _as_list(value):
    return [value] if isinstance(value, str) else value


class Options(BaseModel):
    """Options of `hf-causal-lm`; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: Path = Field(description="local directory written by save_pretrained: config.json, *.safetensors, "
                                        "tokenizer files (never a hub id)")
    data: list[str] = Field(min_length=1, description="glob pattern(s) of the site's .txt/.jsonl files; "
                                                      "{site} and {partition} are replaced by the site's id and index")
    val_data: list[str] | None = Field(None, description="glob pattern(s) of validation files; replaces val_fraction")
    text_field: str = Field("text", min_length=1, description=".jsonl: the key holding each line's document")
    seq_len: int | None = Field(None, ge=2, description="tokens per training sequence; default: the model's "
                                                        f"context, at most {DEFAULT_MAX_SEQ_LEN}")
    val_fraction: float = Field(0.05, ge=0, lt=1, description="documents held out for evaluation (by a hash of "
                                                              "their text) when val_data is not given")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the frozen base weights (bfloat16 halves their memory; LoRA only)")
    lora: LoraOptions | None = Field(default_factory=LoraOptions, description="null: full fine-tuning")
    transforms: list[str] = Field(default_factory=list, description="document transforms ('pkg.module:object', "
                                  "an object or a no-argument factory) run on raw text before tokenization, after "
                                  "the site's PII scrubber")
    cache_stall_s: float = Field(300.0, gt=0, description="ranks waiting for rank 0's token cache give up after "
                                                          "this long without progress")
    format: Literal["text", "chat"] = Field(
        "text", description="text: documents, the loss on every token (continued pre-training); chat: .jsonl rows "
                            '{"messages": [...]} or {"prompt", "completion"} rendered with the chat template, the '
                            "loss on assistant/completion tokens only")
    chat_template: str | None = Field(None, description="chat: a Jinja chat template (its text, or the path of a "
                                                         "file holding it); default: the tokenizer's own")
    packing: bool = Field(True, description="chat: pack whole conversations into seq_len rows (position ids restart "
                                            "per conversation, attention never crosses one); false: one per row")

    _lists = field_validator("data", "val_data", mode="before")(_as_list)

    @field_validator("data", "val_data")
    @classmethod
    def _patterns(cls, value):
        if value is not None and any(not p.strip() for p in value):
            raise ValueError("an empty pattern; give a glob such as /srv/corpus/*.jsonl")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "Options":
        if self.val_data is not None and "val_fraction" in self.model_fields_set and self.val_fraction > 0:
            raise ValueError("set either val_data (validation files) or val_fraction (a share of the documents), "
                             "not both")
        if self.format == "text" and ("chat_template" in self.model_fields_set or "packing" in self.model_fields_set):
            raise ValueError("chat_template and packing apply to format: chat; set format: chat for .jsonl "
                             "conversations, or leave them out")
        if self.dtype == "bfloat16" and self.lora is None:
            raise ValueError("dtype bfloat16 stores frozen base weights in bf16, but with lora: null (full "
                             "fine-tuning) every weight trains and keeps float32 master weights: set dtype float32 "
                             "(train in bf16 with the site's mixed_precision: bf16) or enable lora")
        return self


# ---- the task ---------------------------------------------------------------------------------
class CausalLM(Task):
    """Fine-tune a local Hugging Face causal LM on site text (see the module docstring)."""

    Options = Options
    reads_text = True  # the framework gives the site's PII scrubber as ctx.document_transforms

    def __init__(self, options: Options, ctx: TaskContext):
        super().__init__(options, ctx)
        force_offline()
        self.log = ctx.log
        self.model_dir = check_model_dir(options.model_dir)
        self.config = _load("config", self.model_dir)
        self.tokenizer = _load("tokenizer", self.model_dir)
        self.seq_len = _seq_len(options.seq_len, self.config)
        _check_vocab(self.tokenizer, self.config, self.model_dir)
        if options.lora is not None:
            self._check_lora_targets()
        self.chat_template = _chat_template(options, self.tokenizer, self.model_dir) if options.format == "chat" \
            else None
        self.files: list[tuple[Path, str | None]] = []
        self.transforms: list[text_data.DocumentTransform] = []
        self.token_cache: text_data.TokenCache | None = None  # after build_data: its index holds the counts
        if ctx.role == "site":
            self.files = self.text_files(options, ctx)
            self.transforms = self.document_transforms()

    # ---- model ---------------------------------------------------------------------------
    @property
    def base_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.options.dtype == "bfloat16" else torch.float32

    def build_model(self) -> nn.Module:
        """The pretrained model (or, with parameters on the meta device, its structure), with LoRA."""
        from transformers import AutoModelForCausalLM

        _quiet_transformers()
        if _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(self.config, dtype=self.base_dtype, trust_remote_code=False)
        else:
            model = self.pretrained(self.base_dtype)
        _retie(model)
        if self.options.lora is None:
            return model
        model = _with_lora(model, self.lora_config(model))
        model.peft_config["default"].base_model_name_or_path = str(self.model_dir)
        return model

    def pretrained(self, dtype: torch.dtype) -> nn.Module:
        """The base model with the directory's weights; refuses a checkpoint missing some of them
        (transformers would initialise those at random and say so only in a log line)."""
        from transformers import AutoModelForCausalLM

        _quiet_transformers()
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=dtype, local_files_only=True, use_safetensors=True, trust_remote_code=False,
                output_loading_info=True)
        except (OSError, ValueError, RuntimeError) as err:
            raise OptionsError(f"model_dir: cannot load the weights in {self.model_dir}: {_first_line(err)}") from None
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            names = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
            raise OptionsError(f"model_dir: the weights in {self.model_dir} lack {len(missing)} tensor(s) that "
                               f"config.json's model needs ({names}); the checkpoint and config.json do not belong "
                               "together: export both with save_pretrained")
        unexpected = info.get("unexpected_keys") or ()
        if unexpected:
            self.log.warning("model_dir %s: %d tensor(s) in the weights are not used by the model (%s)", self.model_dir,
                             len(unexpected), ", ".join(sorted(unexpected)[:4]))
        return model

    def lora_config(self, model: nn.Module):
        from peft import LoraConfig
        from transformers.pytorch_utils import Conv1D

        lo = self.options.lora
        return LoraConfig(r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout, target_modules=lo.target_modules,
                          task_type="CAUSAL_LM", fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()))

    def _check_lora_targets(self) -> None:
        """Build the structure on the meta device (no memory) and apply LoRA: refuse targets that
        match nothing, or an architecture for which peft has no default, naming the field."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config, trust_remote_code=False)
        try:
            _with_lora(model, self.lora_config(model))
        except ValueError as err:
            linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                             if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
            raise OptionsError(f"lora.target_modules: {self.options.lora.target_modules!r} cannot be applied to "
                               f"{type(model).__name__} ({_first_line(err)}); name some of its linear layers: "
                               f"{', '.join(linear)}, or 'all-linear'") from None

    # ---- data ----------------------------------------------------------------------------
    @classmethod
    def text_files(cls, options: Options, ctx: TaskContext) -> list[tuple[Path, str | None]]:
        """The site's files: `data` (and `val_data`) with {site} and {partition} replaced, each with
        its split ("train"/"val", or None: chosen per document by val_fraction)."""
        o = options

        def expand(patterns: list[str]) -> list[str]:
            return [p.replace("{site}", str(ctx.site)).replace("{partition}", str(ctx.partition)) for p in patterns]

        try:
            train = text_data.find_files(expand(o.data), "data")
            val = text_data.find_files(expand(o.val_data), "val_data") if o.val_data is not None else []
        except text_data.DataError as err:
            raise OptionsError(str(err)) from None
        if o.format == "chat":
            txt = [p for p in train + val if p.suffix != ".jsonl"]
            if txt:
                raise OptionsError(f"{'data' if txt[0] in train else 'val_data'}: {txt[0]} is not .jsonl; format chat "
                                   'reads .jsonl rows {"messages": [...]} or {"prompt": ..., "completion": ...}: '
                                   "narrow the pattern to *.jsonl")
        if o.val_data is None:
            return [(p, None) for p in train]
        both = sorted(set(train) & set(val))
        if both:
            raise OptionsError(f"val_data: {both[0]} is matched by data too ({len(both)} such file(s)); a document "
                               "must be in one split: narrow one of the patterns")
        return [(p, "train") for p in train] + [(p, "val") for p in val]

    def document_transforms(self) -> list[text_data.DocumentTransform]:
        """The transforms run on each document before tokenization, in order: those the framework
        gives this site (its PII scrubber, `TaskContext.document_transforms`), then `options.transforms`."""
        found = list(self.ctx.document_transforms)
        for i, path in enumerate(self.options.transforms):
            found.append(_load_transform(path, f"transforms[{i}]"))
        return found

    def build_data(self) -> TaskData:
        if self.ctx.workdir is None:
            raise OptionsError("hf-causal-lm needs the site's workdir for its token cache; none was given")
        o = self.options
        if o.format == "chat":
            return self._build_chat_data()
        corpus = text_data.Corpus(self.files, text_field=o.text_field,
                                  val_fraction=o.val_fraction if o.val_data is None else 0.0,
                                  transforms=self.transforms)
        cache = self.token_cache = text_data.prepare(corpus, self.tokenizer, Path(self.ctx.workdir),
                                                     stall_s=o.cache_stall_s)
        train, val = cache.sequences("train", self.seq_len), cache.sequences("val", self.seq_len)
        if len(train) == 0:
            raise text_data.DataError(
                f"data: the site's text gives {train.tokens} training token(s), fewer than seq_len + 1 = "
                f"{self.seq_len + 1}; add text or lower seq_len")
        if len(val) == 0 and (o.val_data is not None or o.val_fraction > 0):
            self.log.warning("site %s: no validation sequence (%d validation token(s), seq_len %d); evaluation is off. "
                             "Name validation files with val_data or raise val_fraction", self.ctx.site, val.tokens,
                             self.seq_len)
        if self.ctx.rank == 0:
            self.log.info("site %s: %d training and %d validation sequence(s) of %d tokens", self.ctx.site, len(train),
                          len(val), self.seq_len)
        return TaskData(train=train, val=val if len(val) else None)

    def _build_chat_data(self) -> TaskData:
        """Chat rows -> the chat token cache -> packed rows of whole conversations (chat_data.py)."""
        o = self.options
        corpus = chat_data.ChatCorpus(self.files, val_fraction=o.val_fraction if o.val_data is None else 0.0,
                                      transforms=self.transforms, template=self.chat_template, max_tokens=self.seq_len)
        cache = self.token_cache = text_data.prepare(corpus, self.tokenizer, Path(self.ctx.workdir),
                                                     stall_s=o.cache_stall_s)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        train, val = (chat_data.ChatSequences.of(cache, s, self.seq_len, pad, o.packing) for s in ("train", "val"))
        st = cache.index["stats"]
        if len(train) == 0:
            raise text_data.DataError(f"data: no training conversation ({sum(st['bad_lines'].values())} bad row(s): "
                                      f"{dict(st['bad_lines'])}); add rows or lower val_fraction")
        if len(val) == 0 and (o.val_data is not None or o.val_fraction > 0):
            self.log.warning("site %s: no validation conversation; evaluation is off. Name validation files with "
                             "val_data or raise val_fraction", self.ctx.site)
        if self.ctx.rank == 0:
            self.log.info("site %s: %d training conversation(s) in %d row(s) of %d tokens (%s), %d validation; "
                          "%d completion token(s) to learn, %d conversation(s) cut at seq_len, %d bad row(s)%s",
                          self.ctx.site, train.documents, len(train), self.seq_len,
                          "packed" if o.packing else "one per row", val.documents, sum(st["targets"].values()),
                          sum(st["truncated"].values()), sum(st["bad_lines"].values()),
                          "".join(f"; {f}: {dict(r)}" for f, r in sorted(st["bad_by_file"].items())))
        return TaskData(train=train, val=val if len(val) else None)

    # ---- training ------------------------------------------------------------------------
    def loss(self, model: nn.Module, batch: torch.Tensor | dict) -> torch.Tensor:
        """Mean next-token cross-entropy: over every token of the batch's packed sequences (text,
        seq_len + 1 tokens each), or over the assistant/completion tokens only (chat rows)."""
        if isinstance(batch, dict):
            nll, n = chat_data.loss_sums(model, _on(batch, self.ctx.device))
            return nll / n.clamp(min=1)
        ids = batch.to(self.ctx.device, non_blocking=True)
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    def evaluate(self, model: nn.Module, batch: torch.Tensor | dict) -> dict:
        """Text: the summed per-sequence loss; every sequence has seq_len targets, so the reported
        eval_loss is the mean token negative log-likelihood (nats) and exp(eval_loss) the perplexity.
        Chat: the summed loss over completion tokens and their count as `examples`, so eval_loss is
        the mean over every completion token of the validation set (and an evaluation's
        num_examples counts those tokens)."""
        if isinstance(batch, dict):
            nll, n = chat_data.loss_sums(model, _on(batch, self.ctx.device))
            return {"loss": nll.detach(), "examples": n}
        n = int(batch.shape[0])
        return {"loss": self.loss(model, batch).detach() * n, "examples": n}

    # ---- the artefact --------------------------------------------------------------------
    def export(self, model: nn.Module, out_dir: Path, merge: bool = False) -> list[Path]:
        """A `save_pretrained` directory that `AutoModelForCausalLM.from_pretrained(out_dir)` loads.

        LoRA: the adapter and the tokenizer in `out_dir` (transformers loads the base from
        `model_dir`, recorded in adapter_config.json); with `merge`, the merged full model (in the
        base checkpoint's dtype) and the tokenizer in `out_dir`, the adapter in `out_dir/adapter`.
        Full fine-tuning: the full model and the tokenizer (`merge` does not apply).
        """
        from peft import PeftModel

        force_offline()
        _quiet_transformers()
        out_dir = Path(out_dir)
        if out_dir.exists() and any(out_dir.iterdir()):  # stale adapter files would change what loads
            raise FileExistsError(f"export: {out_dir} is not empty; give a new or empty directory")
        model = getattr(model, "module", model)  # a DDP wrapper, if given one
        if not isinstance(model, PeftModel):
            if merge:
                self.log.info("export: merge applies to LoRA adapters only; writing the fully fine-tuned model")
            return self._save(model, out_dir)
        adapter_dir = out_dir / "adapter" if merge else out_dir
        written = self._save(model, adapter_dir)
        if not merge:
            return written
        with _peft_quiet():
            merged = PeftModel.from_pretrained(self.pretrained(torch.float32), adapter_dir, local_files_only=True)
            merged = merged.merge_and_unload()
        stored = getattr(self.config, "dtype", None)
        merged.to(stored if isinstance(stored, torch.dtype) else torch.float32)
        return written + self._save(merged, out_dir)

    def _save(self, model: nn.Module, out_dir: Path) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)
        return sorted(p for p in out_dir.iterdir() if p.is_file())


# ---- helpers ----------------------------------------------------------------------------------
def check_model_dir(path: Path) -> Path:
    """The absolute model directory, if it holds a config, safetensors weights and a tokenizer."""
    d = Path(path).expanduser().absolute()
    if not d.is_dir():
        raise OptionsError(f"model_dir: {d} is not a directory. Models are never fetched from a hub: on a connected "
                           "machine, save the model and tokenizer with save_pretrained and copy that directory here")
    if not (d / CONFIG).is_file():
        raise OptionsError(f"model_dir: {d} has no {CONFIG}; copy the whole save_pretrained directory")
    if not any(d.glob("*.safetensors")):
        pickled = sorted(p.name for p in d.glob("*.bin"))
        hint = (f"it holds {', '.join(pickled[:2])}, pickled weights that are not loaded (unpickling can run code): "
                "re-save with save_pretrained(safe_serialization=True)" if pickled
                else "copy the model's *.safetensors files (and model.safetensors.index.json if sharded)")
        raise OptionsError(f"model_dir: {d} has no *.safetensors weights; {hint}")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise OptionsError(f"model_dir: {index} is unreadable ({err}); copy it again") from None
        absent = [s for s in shards if not (d / s).is_file()]
        if absent:
            raise OptionsError(f"model_dir: {d} lacks weight shard(s) {', '.join(absent[:3])} named in "
                               f"{index.name}; copy every shard")
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise OptionsError(f"model_dir: {d} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the "
                           "tokenizer into it with tokenizer.save_pretrained")
    return d


def _load(what: str, d: Path):
    """AutoConfig or AutoTokenizer from the local directory only; failures name the directory."""
    from transformers import AutoConfig, AutoTokenizer

    loader = AutoConfig if what == "config" else AutoTokenizer
    try:
        return loader.from_pretrained(d, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as err:
        hint = ("; custom modelling code (auto_map) is not run: use a model type built into transformers"
                if "trust_remote_code" in str(err) or "model_type" in str(err) else "")
        raise OptionsError(f"model_dir: cannot load the {what} from {d}: {_first_line(err)}{hint}") from None


def context_length(config) -> int | None:
    for name in CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _seq_len(wanted: int | None, config) -> int:
    ctx = context_length(config)
    if wanted is None:
        return min(ctx or DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQ_LEN)
    if ctx is not None and wanted > ctx:
        raise OptionsError(f"seq_len: {wanted} is above the model's context of {ctx} tokens "
                           f"({next(n for n in CONTEXT_FIELDS if getattr(config, n, None) == ctx)} in config.json); "
                           f"set seq_len to at most {ctx}")
    return wanted


def _check_vocab(tokenizer, config, d: Path) -> None:
    if tokenizer.eos_token_id is None:
        raise OptionsError(f"model_dir: the tokenizer in {d} has no EOS token, which separates documents; set "
                           "eos_token in its tokenizer_config.json")
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise OptionsError(f"model_dir: the tokenizer in {d} has {len(tokenizer)} tokens but the model's embedding "
                           f"only {vocab} (config.json vocab_size); they do not belong together")


def _on(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _chat_template(options: Options, tokenizer, d: Path) -> str:
    """format chat: the configured template (its text, or a file's), else the tokenizer's; checked
    by rendering a user/assistant exchange."""
    value = options.chat_template
    if value is not None and "{" not in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise OptionsError(f"chat_template: {value!r} is neither a Jinja template nor a file; give the template's "
                               "text or the path of a .jinja file")
        value = path.read_text(encoding="utf-8")
    if value is None:
        value = getattr(tokenizer, "chat_template", None)
        if isinstance(value, dict):  # several named templates: the default one
            value = value.get("default")
    if not value:
        raise OptionsError(f"chat_template: the tokenizer in {d} has no chat template and none is configured; set "
                           "workload.options.chat_template to the model's template (Jinja text or a .jinja file), "
                           "or save the tokenizer with its chat_template")
    if not getattr(tokenizer, "is_fast", False):
        raise OptionsError(f"model_dir: format chat needs a fast tokenizer (tokenizer.json) in {d}, to map the "
                           "template's text to tokens; save the tokenizer with transformers' fast tokenizer")
    try:
        chat_data.check_template(tokenizer, value)
    except ValueError as err:
        raise OptionsError(f"chat_template: cannot use it on a user/assistant exchange: {err}") from None
    return value


def _load_transform(path: str, field: str) -> text_data.DocumentTransform:
    """'pkg.module:attr': a DocumentTransform, or a no-argument factory of one."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise OptionsError(f"{field}: {path!r} is not 'package.module:object'")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise OptionsError(f"{field}: cannot import {path!r} ({err}); is its package installed in the site's "
                           "environment?") from None
    if not _is_transform(obj) and callable(obj):
        try:
            obj = obj()
        except Exception as err:  # noqa: BLE001 - user code: any failure is reported the same way
            raise OptionsError(f"{field}: {path!r} is not a document transform, and calling it as a factory with no "
                               f"arguments failed ({type(err).__name__}: {err})") from None
    if not _is_transform(obj):
        raise OptionsError(f"{field}: {path!r} is not a document transform: it needs __call__(path, text) -> str | "
                           "None and a string `fingerprint` (see site_trainer.text_data.DocumentTransform)")
    return obj


def _is_transform(obj) -> bool:
    return callable(obj) and isinstance(getattr(obj, "fingerprint", None), str)


def _with_lora(model: nn.Module, config) -> nn.Module:
    from peft import get_peft_model

    with _peft_quiet():
        return get_peft_model(model, config)


@contextlib.contextmanager
def _peft_quiet():
    """peft 0.21 reads a property that transformers 5 deprecates, with a FutureWarning each time."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def _parameters_on_meta() -> bool:
    """Is this build inside a context that puts new parameters on the meta device (the framework's
    ZeRO build on ranks that get their shards streamed from rank 0)?"""
    return nn.Linear(1, 1, bias=False).weight.is_meta


def _retie(model: nn.Module) -> None:
    """Tie what the model declares tied (embedding and head), by direct assignment: a meta-device
    context that patches `register_parameter` (accelerate's init_empty_weights) gives each tied
    name its own meta parameter, and transformers' own tie_weights goes through that patch."""
    mapping = model.get_expanded_tied_weights_keys(all_submodels=True) if hasattr(
        model, "get_expanded_tied_weights_keys") else {}
    for target, source in mapping.items():
        parent_name, _, name = target.rpartition(".")
        parent = model.get_submodule(parent_name)
        src = model.get_parameter(source)
        if parent._parameters.get(name) is not src:
            parent._parameters[name] = src


def _quiet_transformers() -> None:
    """No progress bars in the site's logs (one bar per load and save otherwise)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
