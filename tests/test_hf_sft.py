"""The site's chat data handed to TRL's `SFTTrainer` (`hf_callback.SiteData.sft_datasets`): one row
per conversation with our labels (-100 off the completion tokens), which SFTTrainer packs itself
(`packing=True`: best-fit, padding-free, position ids restarting per conversation). In process, on
a tiny Llama-style model whose tokenizer carries a ChatML template: the rows are the conversations
of the token cache, and in the batch SFTTrainer builds from them no conversation attends to another
and the labels stay ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_models import chat_llama_dir  # noqa: F401 - fixture
from site_trainer import chat_data, text_data
from site_trainer.chat_data import IGNORE, ChatSequences
from site_trainer.hf_callback import SiteData

SEQ = 256


def qa(i: int) -> dict:
    if i % 3 == 0:
        return {"prompt": f"How long do we keep file {i}?", "completion": f"{i % 5 + 1} years, then delete it."}
    return {"messages": [{"role": "system", "content": "You are the compliance desk."},
                         {"role": "user", "content": f"Question {i}: what is rule {i % 7}?"},
                         {"role": "assistant", "content": f"Rule {i % 7} says keep records for {i % 5 + 1} years."}]}


@pytest.fixture()
def site(tmp_path, chat_llama_dir):  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_llama_dir, local_files_only=True)
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(qa(i)) + "\n" for i in range(12)), encoding="utf-8")
    chat_data.build_chat_tokens([(f, None)], tok, tmp_path / "cache", template=tok.chat_template, max_tokens=SEQ,
                                val_fraction=0.0)
    cache = text_data.TokenCache.open(tmp_path / "cache")
    alone = ChatSequences.of(cache, "train", SEQ, tok.pad_token_id, packing=False)
    return SiteData(train=ChatSequences.of(cache, "train", SEQ, tok.pad_token_id), val=None, site_metrics={},
                    task=None), alone, tok


def test_sft_rows_are_the_cached_conversations_with_our_labels(site):
    data, alone, _ = site
    train, val = data.sft_datasets()
    assert val is None and len(train) == len(alone) == 12 and set(train.column_names) == {"input_ids", "labels"}
    for d in range(len(alone)):
        ref = alone[d]
        n = int(alone.ends[d] - alone.begins[d])  # the conversation's length (the padding follows it)
        assert train[d]["input_ids"] == ref["input_ids"][:n].tolist()
        assert train[d]["labels"] == ref["labels"][:n].tolist()
        assert any(x != IGNORE for x in train[d]["labels"]) and train[d]["labels"][0] == IGNORE


def test_sft_trainer_packs_them_without_conversations_seeing_each_other(site, tmp_path, chat_llama_dir):  # noqa: F811
    """The batch SFTTrainer builds (packed, padding-free): the logits of every conversation in it equal
    those of the conversation alone (1e-5), and its labels are ours."""
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    data, alone, tok = site
    train, _ = data.sft_datasets()
    model = AutoModelForCausalLM.from_pretrained(chat_llama_dir, local_files_only=True)
    args = SFTConfig(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_length=SEQ, packing=True,
                     gradient_checkpointing=False, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # padding-free: one flat row
    pos = batch["position_ids"][0]
    starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
    assert len(starts) - 1 >= 3  # several conversations in the batch
    docs = {tuple(alone[d]["input_ids"][:int(alone.ends[d] - alone.begins[d])].tolist()): d for d in range(len(alone))}
    model.eval()
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits[0]
        for begin, end in zip(starts, starts[1:]):
            ids = batch["input_ids"][0, begin:end]
            d = docs[tuple(ids.tolist())]  # a whole conversation of ours, never cut or merged
            assert batch["labels"][0, begin:end].tolist() == alone[d]["labels"][:end - begin].tolist()
            ref = model(input_ids=ids[None]).logits[0]
            torch.testing.assert_close(out[begin:end], ref, rtol=0, atol=1e-5)
        # without the position ids they would attend to each other: the check above can fail
        leaky = model(input_ids=batch["input_ids"], use_cache=False).logits[0]
    assert (leaky[starts[1]:starts[2]] - out[starts[1]:starts[2]]).abs().max() > 1e-3


def test_sft_datasets_refuses_data_that_is_not_chat(tmp_path):
    from site_trainer.session import SessionError

    with pytest.raises(SessionError, match="format: chat"):
        SiteData(train=torch.utils.data.TensorDataset(torch.zeros(2)), val=None, site_metrics={},
                 task=None).sft_datasets()
