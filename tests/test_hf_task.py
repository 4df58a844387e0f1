"""The built-in Hugging Face causal-LM task, called through the workload interface on tiny models
made in the tests (Llama-style and GPT-2-style): options and bad input, offline use, what travels,
tied weights, meta-device builds, training, evaluation and the exported artefact."""

from __future__ import annotations

import json
import math
import shutil
import socket
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from hf_models import gpt2_dir, llama_dir, model_dir, write_corpus  # noqa: F401 - fixtures
from site_trainer.tasks.hf_causal_lm import CausalLM, Options, OptionsError
from site_trainer.text_data import DataError
from site_trainer.workload import TaskContext

SEQ = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root / "paris", files=4, bytes_per_file=5000, jsonl_docs=20)
    return root


def make(model_dir: Path, corpus: Path | None = None, work: Path | None = None, role: str = "site",  # noqa: F811
         **options) -> CausalLM:
    defaults = {"seq_len": SEQ} if "val_data" in options else {"seq_len": SEQ, "val_fraction": 0.3}
    opts = Options.model_validate({"model_dir": str(model_dir), "data": str((corpus or Path("/none")) / "{site}" / "*"),
                                   **defaults, **options})
    return CausalLM(opts, TaskContext(role=role, site="paris", workdir=work, seed=0))


def batches(data, n: int, size: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([data[int(i)] for i in torch.randint(len(data), (size,), generator=g)]) for _ in range(n)]


def mean_loss(task: CausalLM, model, data) -> float:
    model.eval()
    with torch.no_grad():
        sums = [task.evaluate(model, b) for b in batches(data, 4, seed=99)]
    model.train()
    return float(sum(s["loss"] for s in sums) / sum(s["examples"] for s in sums))


def train(task: CausalLM, model, data, steps: int, lr: float) -> None:
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for b in batches(data, steps):
        task.loss(model, b).backward()
        opt.step()
        opt.zero_grad()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


# ---- options ----------------------------------------------------------------------------------
def test_options_defaults_and_errors_that_name_the_field():
    o = Options.model_validate({"model_dir": "/m", "data": "/d/*.jsonl"})
    assert o.data == ["/d/*.jsonl"] and o.lora.r == 8 and o.dtype == "float32" and o.text_field == "text"
    cases = [
        ({"model_dir": "/m", "data": "/d", "learning_rate": 1}, "learning_rate"),
        ({"model_dir": "/m"}, "data"),
        ({"model_dir": "/m", "data": []}, "data"),
        ({"model_dir": "/m", "data": "  "}, "empty pattern"),
        ({"model_dir": "/m", "data": "/d", "lora": {"r": 0}}, "lora.r"),
        ({"model_dir": "/m", "data": "/d", "lora": {"rank": 4}}, "lora.rank"),
        ({"model_dir": "/m", "data": "/d", "seq_len": 1}, "seq_len"),
        ({"model_dir": "/m", "data": "/d", "dtype": "float16"}, "dtype"),
        ({"model_dir": "/m", "data": "/d", "val_data": "/v", "val_fraction": 0.1}, "either val_data"),
        ({"model_dir": "/m", "data": "/d", "dtype": "bfloat16", "lora": None}, "set dtype float32"),
    ]
    for raw, words in cases:
        with pytest.raises(ValidationError) as err:
            Options.model_validate(raw)
        assert words in str(err.value), (raw, str(err.value))
    assert Options.model_validate({"model_dir": "/m", "data": "/d", "val_data": "/v"}).val_data == ["/v"]


def broken_copy(src: Path, dst: Path, drop: tuple[str, ...] = (), edit: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    if edit:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(edit)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_model_directory_that_cannot_be_used_is_refused_naming_the_file(tmp_path, llama_dir):  # noqa: F811
    def refused(path, *words):
        with pytest.raises(OptionsError) as err:
            make(path)
        msg = str(err.value)
        assert msg.startswith("model_dir:") and all(w in msg for w in words), msg

    refused(Path("meta-llama/Llama-3.1-8B"), "is not a directory", "never fetched from a hub")
    refused(broken_copy(llama_dir, tmp_path / "noconf", drop=("config.json",)), str(tmp_path / "noconf"),
            "no config.json")
    refused(broken_copy(llama_dir, tmp_path / "noweights", drop=("model.safetensors",)), "no *.safetensors")
    pickled = broken_copy(llama_dir, tmp_path / "pickled", drop=("model.safetensors",))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80")
    refused(pickled, "pytorch_model.bin", "pickled weights", "safe_serialization=True")
    refused(broken_copy(llama_dir, tmp_path / "notok", drop=("tokenizer.json",)), "has no tokenizer",
            "tokenizer.save_pretrained")
    sharded = broken_copy(llama_dir, tmp_path / "sharded")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model.safetensors"}}))
    refused(sharded, "model-00001-of-00002.safetensors", "copy every shard")
    refused(broken_copy(llama_dir, tmp_path / "custom", edit={"model_type": "my-private-arch"}),
            "cannot load the config", str(tmp_path / "custom"))
    refused(broken_copy(llama_dir, tmp_path / "smallvocab", edit={"vocab_size": 100}), "512 tokens", "only 100")


def test_a_checkpoint_missing_tensors_is_refused_not_initialised_at_random(tmp_path, llama_dir):  # noqa: F811
    from safetensors.torch import load_file, save_file

    d = broken_copy(llama_dir, tmp_path / "partial")
    state = load_file(d / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    task = make(d, role="coordinator", lora=None)
    with pytest.raises(OptionsError, match=r"lack 1 tensor\(s\).*model.layers.1.mlp.down_proj.weight"):
        task.build_model()


def test_a_sequence_longer_than_the_context_is_refused_with_both_numbers(gpt2_dir):  # noqa: F811
    with pytest.raises(OptionsError) as err:
        make(gpt2_dir, role="coordinator", seq_len=200)
    assert "seq_len: 200" in str(err.value) and "context of 128" in str(err.value)
    assert "n_positions" in str(err.value) or "max_position_embeddings" in str(err.value)
    default = CausalLM(Options(model_dir=gpt2_dir, data=["/x"]), TaskContext(role="coordinator"))
    assert default.seq_len == 128  # the model's context when not given


def test_site_data_is_checked_on_sites_only(tmp_path, llama_dir, corpus):  # noqa: F811
    with pytest.raises(OptionsError, match=r"data: pattern '.*/nowhere/paris/\*' matches no file"):
        make(llama_dir, tmp_path / "nowhere")
    make(llama_dir, tmp_path / "nowhere", role="coordinator")  # the coordinator has no site data
    make(llama_dir, tmp_path / "nowhere", role="export")
    (tmp_path / "mixed" / "paris").mkdir(parents=True)
    (tmp_path / "mixed" / "paris" / "a.pdf").write_bytes(b"%PDF")
    with pytest.raises(OptionsError, match="a.pdf, which is neither .txt nor .jsonl"):
        make(llama_dir, tmp_path / "mixed")
    with pytest.raises(OptionsError, match="matched by data too"):
        make(llama_dir, corpus, val_data=str(corpus / "paris" / "*.jsonl"))


def test_lora_targets_and_transforms_that_cannot_be_used_are_named(llama_dir, corpus):  # noqa: F811
    with pytest.raises(OptionsError) as err:
        make(llama_dir, corpus, lora={"target_modules": ["query_key_value"]})
    assert str(err.value).startswith("lora.target_modules") and "q_proj" in str(err.value)
    make(llama_dir, corpus, lora={"target_modules": "all-linear"})
    with pytest.raises(OptionsError, match=r"transforms\[0\]: cannot import 'no_such_pkg.scrub:Scrubber'"):
        make(llama_dir, corpus, transforms=["no_such_pkg.scrub:Scrubber"])
    with pytest.raises(OptionsError, match=r"transforms\[1\]: 'json:dumps' is not a document transform"):
        make(llama_dir, corpus, transforms=["test_hf_task:Shout", "json:dumps"])
    task = make(llama_dir, corpus, transforms=["test_hf_task:Shout", "test_hf_task:make_shout"])
    assert [t.fingerprint for t in task.transforms] == ["shout-v1", "shout-v1"]


class Shout:
    """A user's document transform, named by import path in the options."""

    fingerprint = "shout-v1"

    def __call__(self, path: str, text: str) -> str:
        return text.upper()


def make_shout() -> Shout:
    return Shout()


def test_too_little_text_for_one_sequence_is_a_clear_error(tmp_path, llama_dir):  # noqa: F811
    (tmp_path / "tiny" / "paris").mkdir(parents=True)
    (tmp_path / "tiny" / "paris" / "a.txt").write_text("just a few words")
    task = make(llama_dir, tmp_path / "tiny", tmp_path / "work")
    with pytest.raises(DataError, match=r"fewer than seq_len \+ 1 = 33; add text or lower seq_len"):
        task.build_data()


# ---- offline ------------------------------------------------------------------------------------
def test_nothing_reaches_for_the_network(tmp_path, llama_dir, corpus, monkeypatch):  # noqa: F811
    """With the offline switches off to begin with, the task builds, trains, exports, and its
    artefacts load and generate without a single connection or name lookup being attempted."""
    import huggingface_hub.constants

    attempts = []

    def deny(*args, **kwargs):
        attempts.append(args[1:] if args else kwargs)
        raise OSError("network access attempted in an air-gapped test")

    monkeypatch.setattr(socket.socket, "connect", deny)
    monkeypatch.setattr(socket.socket, "connect_ex", deny)
    monkeypatch.setattr(socket, "create_connection", deny)
    monkeypatch.setattr(socket, "getaddrinfo", deny)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    task = make(llama_dir, corpus, tmp_path / "work", lora={"r": 4})
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True
    model = task.build_model()
    data = task.build_data()
    train(task, model, data.train, 2, 1e-2)
    task.export(model, tmp_path / "out", merge=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for d in (tmp_path / "out", tmp_path / "out" / "adapter"):
        loaded = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
        AutoTokenizer.from_pretrained(d, local_files_only=True)
        loaded.generate(torch.tensor([[5, 6]]), max_new_tokens=3, do_sample=False)
    assert attempts == []


# ---- what travels, tied weights, builds ---------------------------------------------------------
def test_with_lora_only_the_adapters_travel(model_dir, corpus):  # noqa: F811
    task = make(model_dir, corpus, role="coordinator", lora={"r": 4})
    model = task.build_model()
    names = task.exchanged(model)
    cfg = task.config
    if cfg.model_type == "llama":  # peft's defaults: q_proj and v_proj
        head = cfg.hidden_size // cfg.num_attention_heads
        per_layer = [(cfg.hidden_size, cfg.hidden_size), (cfg.hidden_size, cfg.num_key_value_heads * head)]
    else:  # GPT-2: c_attn, one fused q/k/v projection
        per_layer = [(cfg.n_embd, 3 * cfg.n_embd)]
    layers = cfg.num_hidden_layers
    assert len(names) == 2 * len(per_layer) * layers
    assert all(".lora_A." in n or ".lora_B." in n for n in names)
    state = model.state_dict()
    sent = sum(state[n].numel() * state[n].element_size() for n in names)
    assert sent == 4 * layers * sum(4 * (i + o) for i, o in per_layer)  # r (in + out) float32 values per target
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sent < 0.05 * everything
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def _tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_tied_embeddings_stay_tied_and_travel_once(gpt2_dir, llama_dir, corpus):  # noqa: F811
    from accelerate import init_empty_weights

    full = make(gpt2_dir, corpus, role="coordinator", lora=None)
    model = full.build_model()
    assert _tied(model)
    names = full.exchanged(model)
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    with init_empty_weights():  # its register_parameter patch unties what transformers ties
        meta = full.build_model()
    assert _tied(meta) and meta.transformer.wte.weight.is_meta
    lora = make(gpt2_dir, corpus, role="coordinator").build_model()
    assert _tied(lora.get_base_model())
    untied = make(llama_dir, corpus, role="coordinator", lora=None).build_model()
    assert not _tied(untied) and "lm_head.weight" in full.exchanged(untied)


@pytest.mark.parametrize("lora", [{"r": 4}, None], ids=["lora", "full"])
def test_a_meta_device_build_has_the_real_structure_and_real_buffers(model_dir, corpus, lora):  # noqa: F811
    """What ZeRO ranks other than 0 do: parameters on the meta device, buffers real; rank 0's
    weights are streamed in by name, so names, shapes and dtypes must match the real build."""
    from accelerate import init_empty_weights

    task = make(model_dir, corpus, role="coordinator", lora=lora)
    real = task.build_model()
    with init_empty_weights():
        meta = task.build_model()
    assert all(p.is_meta for p in meta.parameters())
    r, m = real.state_dict(), meta.state_dict()
    assert list(r) == list(m)
    assert all(r[k].shape == m[k].shape and r[k].dtype == m[k].dtype for k in r)
    assert task.exchanged(real) == task.exchanged(meta)
    for name, buf in meta.named_buffers():
        assert not buf.is_meta and torch.equal(buf, dict(real.named_buffers())[name])
    with torch.device("meta"):
        assert all(p.is_meta for p in task.build_model().parameters())


def test_lora_initialisation_follows_the_seeded_torch_rng(llama_dir, corpus):  # noqa: F811
    task = make(llama_dir, corpus, role="coordinator", lora={"r": 4})

    def adapters(seed: int) -> dict:
        torch.manual_seed(seed)
        model = task.build_model()
        return {n: model.state_dict()[n] for n in task.exchanged(model)}

    a, b, c = adapters(0), adapters(0), adapters(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "lora_A" in k)
    assert all(not v.any() for k, v in a.items() if "lora_B" in k)  # B = 0: the first global model is the base


def test_decoder_layers_are_declared_for_generic_discovery(model_dir, corpus):  # noqa: F811
    """The framework finds the sharding units from `_no_split_modules`, through a PeftModel too."""
    for lora in ({"r": 4}, None):
        model = make(model_dir, corpus, role="coordinator", lora=lora).build_model()
        classes = set(model._no_split_modules)
        layers = [m for m in model.modules() if type(m).__name__ in classes]
        assert len(layers) == 2


def test_bfloat16_base_keeps_adapters_in_float32(llama_dir, corpus):  # noqa: F811
    task = make(llama_dir, corpus, role="coordinator", dtype="bfloat16", lora={"r": 4})
    model = task.build_model()
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}


# ---- training and evaluation -------------------------------------------------------------------
@pytest.mark.parametrize("lora", [{"r": 8, "dropout": 0.0, "target_modules": "all-linear"}, None], ids=["lora", "full"])
def test_training_steps_reduce_the_loss(tmp_path, model_dir, corpus, lora):  # noqa: F811
    task = make(model_dir, corpus, tmp_path / "work", lora=lora)
    torch.manual_seed(0)
    model = task.build_model()
    data = task.build_data()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = mean_loss(task, model, data.val)
    train(task, model, data.train, 12, 1e-2 if lora else 3e-3)
    after = mean_loss(task, model, data.val)
    assert after < before - 0.2, (before, after)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


def test_evaluation_sums_are_the_mean_token_loss(tmp_path, llama_dir, corpus):  # noqa: F811
    task = make(llama_dir, corpus, tmp_path / "work", lora=None)
    model = task.build_model().eval()
    data = task.build_data()
    batch = batches(data.val, 1, size=5)[0]
    with torch.no_grad():
        out = task.evaluate(model, batch)
        reference = model(input_ids=batch, labels=batch).loss  # transformers' own shifted loss
    assert out["examples"] == 5
    assert math.isclose(float(out["loss"]) / 5, float(reference), rel_tol=1e-5)


# ---- the artefact -------------------------------------------------------------------------------
def test_adapter_export_loads_with_transformers_and_generates(tmp_path, model_dir, corpus):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task = make(model_dir, corpus, tmp_path / "work", lora={"r": 4})
    model = task.build_model()
    train(task, model, task.build_data().train, 3, 1e-2)
    files = task.export(model, tmp_path / "out")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in files}
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(model_dir)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    ids = tok("def main():\n    return", return_tensors="pt")["input_ids"]
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=1e-5)
    out = loaded.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 8 and tok.decode(out[0, ids.shape[1]:])


def test_merged_export_equals_base_plus_adapters(tmp_path, model_dir, corpus):  # noqa: F811
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    task = make(model_dir, corpus, tmp_path / "work", lora={"r": 4, "alpha": 12})
    model = task.build_model()
    train(task, model, task.build_data().train, 3, 1e-2)
    task.export(model, tmp_path / "out", merge=True)
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "out" / "adapter_config.json").exists()  # the top level is a plain model
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert type(merged).__name__ == type(model.get_base_model()).__name__
    ids = torch.randint(2, 500, (2, 20), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(logits(merged, ids), logits(model, ids), rtol=0, atol=1e-4)
    # weight by weight: W + (alpha / r) B A on the adapted layers, the base bit for bit elsewhere
    base = load_file(model_dir / "model.safetensors")
    got = merged.state_dict()
    adapted = {n.split(".lora_A.")[0] for n in task.exchanged(model) if ".lora_A." in n}
    assert len(adapted) == len(task.exchanged(model)) // 2 > 0
    state = model.state_dict()
    conv = task.config.model_type == "gpt2"  # Conv1D stores weights transposed
    for prefix in adapted:
        name = prefix.removeprefix("base_model.model.") + ".weight"
        ba = state[f"{prefix}.lora_B.default.weight"] @ state[f"{prefix}.lora_A.default.weight"]
        torch.testing.assert_close(got[name], base[name] + 3.0 * (ba.T if conv else ba), rtol=0, atol=1e-6)
    for name, w in base.items():
        if not any(name == p.removeprefix("base_model.model.") + ".weight" for p in adapted):
            assert torch.equal(got[name], w), name


def test_full_fine_tuning_exports_the_whole_model_tied(tmp_path, gpt2_dir, corpus):  # noqa: F811
    from transformers import AutoModelForCausalLM

    task = make(gpt2_dir, corpus, tmp_path / "work", lora=None)
    model = task.build_model()
    train(task, model, task.build_data().train, 3, 3e-3)
    task.export(model, tmp_path / "out", merge=True)  # merge does not apply: the whole model
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert _tied(loaded)
    trained = model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    assert loaded.generate(torch.tensor([[5, 6]]), max_new_tokens=4, do_sample=False).shape == (1, 6)


def test_merged_export_keeps_the_checkpoint_dtype(tmp_path, llama_dir, corpus):  # noqa: F811
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True, dtype=torch.bfloat16).save_pretrained(bf16)
    for f in llama_dir.glob("tokenizer*"):
        shutil.copy(f, bf16)
    task = make(bf16, corpus, tmp_path / "work", lora={"r": 4})
    model = task.build_model()
    task.export(model, tmp_path / "out", merge=True)
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    with safe_open(tmp_path / "out" / "adapter" / "adapter_model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    with pytest.raises(FileExistsError, match="is not empty"):
        task.export(model, tmp_path / "out")
