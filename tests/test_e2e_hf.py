"""End to end: the Hugging Face causal-LM task federated over a real SuperLink, SuperNodes, ClientApp
processes and torchrun trainer pools, on tiny Llama-style models built here (nothing downloaded),
then `sovfl export` of the run.

Two federations, each checked for several things (a federation costs about a minute here):
- LoRA on chat data (format chat: synthetic compliance conversations, the loss on assistant tokens
  only), SecAgg+ on, 3 rounds with evaluation, sites a and b with 2 ranks each, and site c whose base
  model has other weights. Site a runs the built-in task; site b runs the example's TRL
  `SFTTrainer` script through the callback (`sites[].script`: examples/compliance_sft/train_sft.py,
  SFTTrainer packing the site's conversations itself, DDP through the Trainer's accelerate). The completion-only eval loss falls round after round; c
  is refused by name at discovery and every round completes with a and b; only
  the adapters travel (bytes up per site: the adapter's values as 32-bit ring words, plus the
  weight word; not the model); each new global adapter is the weighted mean of the deltas the
  sites returned (their `dump_updates` files) within the SecAgg quantization bound (< 1e-6); both
  ranks of a site hold the same weights; the exported adapter loads with transformers and
  generates, and the exported merged model is exactly base + (alpha / r) B A.
- full fine-tuning (no LoRA), site a under zero2 and site b under ddp, 2 ranks each: every weight
  travels and each round's global model is the weighted mean of the sites' weights (1e-6); the
  exported model is the last checkpoint, loads and generates.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, assert_weighted_mean_rounds, live_marked, sovfl, write_config
from federation.coordinator.checkpoint import load_checkpoint
from federation.ops import launcher
from hf_models import compliance_data, tiny_llama, write_corpus

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=300)]

DEADLINES = {"connect_s": 120, "round_s": 180, "evaluate_s": 120, "secagg_stage_s": 60, "trainer_start_s": 240}
SITE = {"local_steps": 3, "batch_size": 4, "lr": 0.01, "optimizer": "adamw", "dump_updates": True}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("base"), chat=True)


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chats")
    for i, site in enumerate("abc"):
        compliance_data().write_site(root / site, i, rows=160)
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i, site in enumerate("abc"):
        write_corpus(root / site, files=2, bytes_per_file=3000 + 500 * i)
    return root


def _simulate(tmp_path: Path, cfg: dict, marker: str, monkeypatch) -> tuple[Path, list[dict], str]:
    monkeypatch.setenv(launcher.MARKER, marker)
    path = write_config(tmp_path / "hf.yaml", cfg)
    run, out = tmp_path / "run", []
    result = launcher.simulate(path, run, out.append)
    assert result["status"] == "ok", "\n".join(out) + "\n" + launcher.tail(run / "logs" / "flwr-run.log")
    assert live_marked(marker) == []
    log = (run / "progress.log").read_text()  # the coordinator's own record of its progress lines
    return run, [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()], log


def _flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(arrays[k], np.float64).reshape(-1) for k in sorted(arrays)])


def _numel(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "np") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())


def _export(run: Path, out: Path, *extra: str) -> None:
    proc = sovfl("export", str(run), "--out", str(out), *extra, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _generates(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok("def main():\n    return", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 8 and tok.decode(out[0, ids.shape[1]:])


def chat_workload(base: Path, chats: Path) -> dict:
    return {"task": "hf-causal-lm",
            "options": {"model_dir": str(base), "format": "chat", "data": str(chats / "{site}" / "train.jsonl"),
                        "val_data": str(chats / "{site}" / "val.jsonl"), "seq_len": 256, "lora": LORA}}


def test_lora_chat_secagg_two_sites_two_ranks_refused_base_and_export(tmp_path, base, chats, marker, monkeypatch):
    import torch
    from safetensors.torch import load_file

    other = tiny_llama(tmp_path / "other-base", seed=1, chat=True)  # same architecture, other weights
    chat_site = {**SITE, "lr": 0.02}
    script = ROOT / "examples" / "compliance_sft" / "train_sft.py"  # b: TRL's SFTTrainer with the callback
    sites = [{"id": "a", "ranks": 2, "partition": 0, **chat_site},
             {"id": "b", "ranks": 2, "partition": 1, **chat_site, "script": str(script)},
             {"id": "c", "ranks": 1, "partition": 2, **chat_site, "workload_options": {"model_dir": str(other)}}]
    cfg = {"federation": {"name": "hf-lora", "rounds": 3, "quorum": 2, "update_kind": "delta", "evaluate": True,
                          "deadlines": DEADLINES,
                          "secagg": {"enabled": True, "threshold": 2, "clip": 1.0, "bits": 32}},
           "workload": chat_workload(base, chats),
           "sites": sites}
    run, lines, log = _simulate(tmp_path, cfg, marker, monkeypatch)

    # the completion-only eval loss (every site's validation conversations) falls round after round
    losses = [line["eval_loss"] for line in lines] + [lines[-1]["final_eval_loss"]]
    assert [line["eval_model_round"] for line in lines] == [0, 1, 2]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1, losses
    for s in ("a", "b"):  # the same chat data path (b's script reads it through hf_callback.site_data)
        trainer_log = (run / "logs" / f"site-{s}-trainer.log").read_text()
        assert "completion token(s) to learn" in trainer_log and "packed" in trainer_log
    b_log = (run / "logs" / "site-b-trainer.log").read_text()
    assert "Packing train dataset" in b_log  # SFTTrainer packed b's conversations itself
    assert "rank 0: federation ended" in b_log and "rank 1: federation ended" in b_log  # train() returned on stop

    # c is left out by name before any update is averaged, counted once; the rounds go on with a and b
    assert "site c REFUSED" in log and "frozen base weights differ" in log
    assert [x["status"] for x in lines] == ["aggregated"] * 3
    for line in lines:
        assert set(line["sites"]) == {"a", "b"} and line["secagg"]["contributors"] == ["a", "b"]
        assert set(line["failed"]) == {"c"} and "frozen base weights differ" in line["failed"]["c"]
        assert "start the site from the coordinator's base model" in line["failed"]["c"]
        assert line["rejections"] == {"manifest_mismatch": 1}
    assert not (run / "sites" / "c" / "updates").exists()  # c never trained

    from site_trainer.workloads import initial_weights
    from federation.config.schema import load_config

    previous = initial_weights(load_config(tmp_path / "hf.yaml").workload, 0)
    adapter_numel = sum(v.size for v in previous.values())
    assert all(".lora_A." in k or ".lora_B." in k for k in previous)
    assert 0 < 20 * adapter_numel < _numel(base)
    for rnd, line in enumerate(lines, start=1):
        for s in ("a", "b"):
            info = line["sites"][s]
            assert info["dense_bytes"] == 4 * adapter_numel  # the adapter, float32: not the model
            assert info["upload_bytes"] == 4 * (adapter_numel + 1)  # its 32-bit ring words and the weight
            assert len(info["rank_digests"]) == 2 and len(set(info["rank_digests"])) == 1  # ranks agree
        weights = {s: line["sites"][s]["weight"] for s in ("a", "b")}
        assert weights == {s: line["sites"][s]["samples"] for s in ("a", "b")}
        returned = {}
        for s in ("a", "b"):
            with np.load(run / "sites" / s / "updates" / f"round_{rnd:04d}.npz") as z:
                returned[s] = _flat({k: z[k] for k in z.files})
        mean = sum(returned[s] * w for s, w in weights.items()) / sum(weights.values())
        assert np.abs(mean).max() > 1e-5  # training moved the adapters
        assert line["secagg"]["error_bound"] < 1e-6
        _, model, _ = load_checkpoint(run / "checkpoints" / f"round_{rnd:04d}")
        np.testing.assert_allclose(_flat(model) - _flat(previous), mean, rtol=0, atol=1e-6)
        previous = model

    # sovfl export: the adapter (transformers loads it over the base and generates), the merged model
    _export(run, tmp_path / "adapter")
    _export(run, tmp_path / "merged", "--merge")
    _generates(tmp_path / "adapter")
    _generates(tmp_path / "merged")
    got, base_w = load_file(tmp_path / "merged" / "model.safetensors"), load_file(base / "model.safetensors")
    adapted = set()
    for k, a in previous.items():
        if ".lora_A." in k:
            prefix = k.split(".lora_A.")[0]
            name = prefix.removeprefix("base_model.model.") + ".weight"
            ba = torch.from_numpy(previous[f"{prefix}.lora_B.default.weight"] @ a)
            torch.testing.assert_close(got[name], base_w[name] + (LORA["alpha"] / LORA["r"]) * ba, rtol=0, atol=1e-6)
            adapted.add(name)
    assert adapted and all(torch.equal(got[n], w) for n, w in base_w.items() if n not in adapted)


def test_full_fine_tuning_zero2_site_and_export(tmp_path, base, corpus, marker, monkeypatch):
    import torch
    from safetensors.torch import load_file

    sites = [{"id": "a", "ranks": 2, "partition": 0, "parallelism": "zero2", **SITE, "lr": 0.001},
             {"id": "b", "ranks": 2, "partition": 1, **SITE, "lr": 0.001}]
    cfg = {"federation": {"name": "hf-full", "rounds": 2, "quorum": 2, "update_kind": "weights", "evaluate": False,
                          "deadlines": DEADLINES},
           "workload": {"task": "hf-causal-lm",
                        "options": {"model_dir": str(base), "data": str(corpus / "{site}" / "*.txt"), "seq_len": 32,
                                    "val_fraction": 0.0, "lora": None}},
           "sites": sites}
    run, lines, log = _simulate(tmp_path, cfg, marker, monkeypatch)
    assert_weighted_mean_rounds(run, {"a", "b"}, ranks=2, rounds=2)
    numel = _numel(base)
    for line in lines:  # every weight travels (Llama's head is untied: nothing is sent twice)
        assert all(info["dense_bytes"] == info["upload_bytes"] == 4 * numel for info in line["sites"].values())
    assert "parallelism zero2" in (run / "logs" / "site-a-trainer.log").read_text()

    _export(run, tmp_path / "full")
    _generates(tmp_path / "full")
    _, model, _ = load_checkpoint(run / "checkpoints" / "round_0002")
    got = load_file(tmp_path / "full" / "model.safetensors")
    assert set(got) == set(model)
    assert all(torch.equal(got[k], torch.from_numpy(v)) for k, v in model.items())
