"""Tiny Hugging Face causal LMs made on the spot: nothing is downloaded.

Each model directory is what a site operator would copy onto an air-gapped machine: config.json,
model.safetensors and the tokenizer files, written by `save_pretrained`. The tokenizer is a
byte-level BPE trained with `tokenizers` on Python standard-library sources; the weights are
random from a small config (seeded). Two architectures: Llama-style (RoPE, RMSNorm, SwiGLU,
grouped-query attention, untied head) and GPT-2-style (learned positions, LayerNorm, Conv1D,
tied head). Building one takes well under a second.

Used by tests/test_hf_*.py (as pytest fixtures) and by benchmarks/hf_finetune.py.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

EOS = "<|endoftext|>"
INIT_STD = 0.1  # wider than the usual 0.02: a random tiny model then has some structure for LoRA to steer
PAD = "<|pad|>"


def compliance_data():
    """The example's synthetic compliance conversations (examples/compliance_sft/compliance_data.py),
    imported from its file: the example is not a package."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "compliance_sft" / "compliance_data.py"
    spec = importlib.util.spec_from_file_location("compliance_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def stdlib_sources() -> tuple[Path, ...]:
    """The standard library's top-level .py files, sorted (the same list on every machine with this Python)."""
    return tuple(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))


@functools.lru_cache(maxsize=4)
def stdlib_text(max_bytes: int = 300_000) -> str:
    """Standard-library sources, module after module, up to `max_bytes` (the same on every call)."""
    out, size = [], 0
    for path in stdlib_sources():
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return "".join(out)[:max_bytes]


# A ChatML-style template: role headers and end-of-turn markers are special tokens; a role other than
# system, user or assistant is refused, as many models' templates do.
CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('this model knows no role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def train_tokenizer(out_dir: Path, vocab_size: int = 512, model_max_length: int = 256, chat: bool = False):
    """A byte-level BPE tokenizer (EOS and PAD specials) trained on stdlib text, saved to `out_dir`;
    with `chat`, also ChatML's specials and `CHAT_TEMPLATE` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [EOS, PAD] + (CHAT_SPECIALS if chat else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = stdlib_text()
    tok.train_from_iterator((text[i:i + 4096] for i in range(0, len(text), 4096)), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD,
                                   model_max_length=model_max_length)
    if chat:
        fast.add_special_tokens({"additional_special_tokens": CHAT_SPECIALS})
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _save(model, tokenizer, out_dir: Path) -> Path:
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def tiny_llama(out_dir: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               context: int = 256, tie: bool = False, vocab_size: int = 512, seed: int = 0, chat: bool = False) -> Path:
    """A Llama-style model with random weights; the head is untied unless `tie`; with `chat`, its
    tokenizer has a ChatML chat template (`CHAT_TEMPLATE`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_tokenizer(out_dir, vocab_size, context, chat=chat)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
                      tie_word_embeddings=tie, initializer_range=INIT_STD, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    return _save(LlamaForCausalLM(cfg), tok, out_dir)


def tiny_gpt2(out_dir: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, context: int = 128,
              vocab_size: int = 512, seed: int = 0) -> Path:
    """A GPT-2-style model with random weights; its head is tied to the token embedding (GPT-2's default)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = train_tokenizer(out_dir, vocab_size, context)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=hidden, n_layer=layers, n_head=heads, n_positions=context,
                     initializer_range=INIT_STD, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                     pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    return _save(GPT2LMHeadModel(cfg), tok, out_dir)


ARCHITECTURES = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def write_corpus(root: Path, files: int = 4, bytes_per_file: int = 6_000, jsonl_docs: int = 0) -> list[Path]:
    """Site-local text made of stdlib sources: `files` .txt files and, if asked, one .jsonl file."""
    import json

    root.mkdir(parents=True, exist_ok=True)
    text = stdlib_text()
    out = []
    for i in range(files):
        p = root / f"doc{i:03d}.txt"
        p.write_text(text[i * bytes_per_file:(i + 1) * bytes_per_file], encoding="utf-8")
        out.append(p)
    if jsonl_docs:
        p = root / "docs.jsonl"
        start = files * bytes_per_file
        with p.open("w", encoding="utf-8") as f:
            for j in range(jsonl_docs):
                f.write(json.dumps({"text": text[start + j * 800:start + (j + 1) * 800], "id": j}) + "\n")
        out.append(p)
    return out


# ---- pytest fixtures (import them into a test module to use them) ------------------------------
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    return tiny_gpt2(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="session")
def chat_llama_dir(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("chat-llama"), chat=True)


@pytest.fixture(scope="session", params=sorted(ARCHITECTURES))
def model_dir(request) -> Path:
    """Each architecture in turn."""
    return request.getfixturevalue(f"{request.param}_dir")
