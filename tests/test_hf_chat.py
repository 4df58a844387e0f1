"""Chat and instruction data in the Hugging Face causal-LM task (site_trainer/chat_data.py): rows
rendered with the tokenizer's chat template, targets only on assistant/completion tokens, packing
that never lets a conversation see another, the token cache keyed by the template, bad rows counted
per file and reason; on a tiny Llama-style model whose tokenizer carries a ChatML template."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_models import CHAT_TEMPLATE, chat_llama_dir, llama_dir  # noqa: F401 - fixtures
from site_trainer import chat_data, text_data
from site_trainer.chat_data import IGNORE, ChatCorpus, ChatSequences
from site_trainer.tasks.hf_causal_lm import CausalLM, Options, OptionsError
from site_trainer.text_data import DataError
from site_trainer.workload import TaskContext

SEQ = 96
CONV = [{"role": "system", "content": "Answer as the bank's compliance desk."},
        {"role": "user", "content": "Must we report a cash deposit of 12,000 EUR?"},
        {"role": "assistant", "content": "Yes: file a cash transaction report within 15 days."},
        {"role": "user", "content": "And for 9,000 EUR?"},
        {"role": "assistant", "content": "Not by amount alone; report it if it looks structured."}]


@pytest.fixture(scope="module")
def tok(chat_llama_dir):  # noqa: F811
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_llama_dir, local_files_only=True)


def jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def qa(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Question {i}: what is rule {i % 7}?"},
                         {"role": "assistant", "content": f"Rule {i % 7} says keep records for {i % 5 + 1} years."}]}


def build(files, tok, out: Path, template: str = CHAT_TEMPLATE, max_tokens: int = SEQ, **kw) -> dict:
    return chat_data.build_chat_tokens([(f, None) for f in files], tok, out, template=template,
                                       max_tokens=max_tokens, val_fraction=kw.pop("val_fraction", 0.0), **kw)


def cache_of(out: Path) -> text_data.TokenCache:
    return text_data.TokenCache.open(out)


# ---- targets ----------------------------------------------------------------------------------
def test_labels_are_ignored_exactly_on_template_system_and_user_tokens(tmp_path, tok):
    """Token by token: the rendered conversation is the template's pieces in order; only the
    assistant contents and the end-of-turn marker closing them are targets."""
    f = jsonl(tmp_path / "a.jsonl", [{"messages": CONV}])
    build([f], tok, tmp_path / "out", max_tokens=256)
    row = ChatSequences.of(cache_of(tmp_path / "out"), "train", 256, tok.pad_token_id)[0]
    pieces: list[tuple[str, bool]] = []
    for m in CONV:
        learned = m["role"] == "assistant"
        pieces += [(f"<|im_start|>{m['role']}\n", False), (m["content"], learned), ("<|im_end|>", learned),
                   ("\n", learned)]
    ids, want = [], []
    for text, learned in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        want += [learned] * len(piece)
    n = len(ids)
    assert row["input_ids"][:n].tolist() == ids  # the template rendered and tokenized as expected
    expected = [i if w else IGNORE for i, w in zip(ids, want)]
    for t in range(n):
        assert int(row["labels"][t]) == expected[t], (t, tok.decode([ids[t]]))
    assert (row["labels"][n:] == IGNORE).all() and (row["input_ids"][n:] == tok.pad_token_id).all()
    assert sum(want) > 10 and want.count(False) > 10
    learned = tok.decode([i for i, w in zip(ids, want) if w])
    assert learned == CONV[2]["content"] + "<|im_end|>\n" + CONV[4]["content"] + "<|im_end|>\n"


def test_prompt_completion_rows_learn_the_completion_only(tmp_path, tok):
    f = jsonl(tmp_path / "pc.jsonl", [{"prompt": "Define AML.", "completion": "Anti-money laundering."},
                                      {"prompt": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Define KYC."}],
                                       "completion": [{"role": "assistant", "content": "Know your customer."}]}])
    index = build([f], tok, tmp_path / "out")
    seqs = ChatSequences.of(cache_of(tmp_path / "out"), "train", SEQ, tok.pad_token_id, packing=False)
    got = [tok.decode([int(i) for i in seqs[k]["labels"] if i != IGNORE]) for k in range(2)]
    assert got == ["Anti-money laundering.<|im_end|>\n", "Know your customer.<|im_end|>\n"]
    assert index["stats"]["targets"]["train"] == sum(len(tok(g, add_special_tokens=False)["input_ids"]) for g in got)


# ---- packing ------------------------------------------------------------------------------------
def test_packed_conversations_do_not_see_each_other(tmp_path, tok, chat_llama_dir):  # noqa: F811
    """The logits of a conversation packed after others equal those of the conversation alone, and
    the loss of a packed row is the sum of its conversations' losses."""
    from transformers import AutoModelForCausalLM

    seq = 256
    f = jsonl(tmp_path / "a.jsonl", [qa(i) for i in range(12)])
    build([f], tok, tmp_path / "out", max_tokens=seq)
    packed = ChatSequences.of(cache_of(tmp_path / "out"), "train", seq, tok.pad_token_id)
    alone = ChatSequences.of(cache_of(tmp_path / "out"), "train", seq, tok.pad_token_id, packing=False)
    assert len(alone) == 12 and len(packed) < 12
    model = AutoModelForCausalLM.from_pretrained(chat_llama_dir, local_files_only=True).eval()
    row = packed[0]
    pos = row["position_ids"]
    starts = [t for t in range(seq) if pos[t] == 0]
    assert len(starts) >= 3  # several conversations (and the padding) in the row
    with torch.no_grad():
        # use_cache=False, as in training: transformers looks for packed conversations only without a KV cache
        out = model(input_ids=row["input_ids"][None], position_ids=pos[None], use_cache=False).logits[0]
        nll_packed, _ = chat_data.loss_sums(model, {k: v[None] for k, v in row.items()})
        nll_alone = 0.0
        docs = packed.row_documents(0)  # the conversations of the row, in order (then the padding, if any)
        bounds = starts[:len(docs)] + [starts[len(docs)] if len(starts) > len(docs) else seq]
        for j, d in enumerate(docs):
            one = alone[d]
            begin, end = bounds[j], bounds[j + 1]
            length = end - begin
            assert torch.equal(one["input_ids"][:length], row["input_ids"][begin:end])
            ref = model(input_ids=one["input_ids"][None, :length]).logits[0]
            torch.testing.assert_close(out[begin:end], ref, rtol=0, atol=1e-5)
            nll_alone += float(chat_data.loss_sums(model, {k: v[None] for k, v in one.items()})[0])
    assert float(nll_packed) == pytest.approx(nll_alone, rel=1e-5)
    # without position ids the model would let them attend to each other: the check above can fail
    with torch.no_grad():
        leaky = model(input_ids=row["input_ids"][None]).logits[0]
    assert (leaky[starts[1]:starts[2]] - out[starts[1]:starts[2]]).abs().max() > 1e-3


def test_packing_is_best_fit_decreasing_and_keeps_every_conversation_once():
    """Every conversation in exactly one row, no row over seq_len, the rows as few as best fit
    decreasing makes them (next fit in order would need 5 rows here, best fit 3), the same on every call."""
    lengths = np.array([60, 50, 45, 40, 30, 20, 10, 5, 40])
    docs, offsets = chat_data.pack(lengths, 100)
    rows = [docs[offsets[r]:offsets[r + 1]].tolist() for r in range(len(offsets) - 1)]
    assert sorted(docs.tolist()) == list(range(len(lengths)))
    assert all(sum(lengths[r]) <= 100 for r in rows) and all(r == sorted(r) for r in rows)
    assert len(rows) == 3 == -(-int(lengths.sum()) // 100)  # as few rows as the tokens allow
    again, _ = chat_data.pack(lengths, 100)
    assert np.array_equal(docs, again)
    one, offs = chat_data.pack(lengths, 100, packing=False)
    assert one.tolist() == list(range(9)) and offs.tolist() == list(range(10))


def test_loss_equals_transformers_own_loss_on_the_same_labels(tmp_path, tok, chat_llama_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    f = jsonl(tmp_path / "a.jsonl", [{"messages": CONV}])
    build([f], tok, tmp_path / "out", max_tokens=256)
    one = ChatSequences.of(cache_of(tmp_path / "out"), "train", 256, tok.pad_token_id, packing=False)[0]
    model = AutoModelForCausalLM.from_pretrained(chat_llama_dir, local_files_only=True).eval()
    batch = {k: v[None] for k, v in one.items()}
    with torch.no_grad():
        nll, n = chat_data.loss_sums(model, batch)
        theirs = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    torch.testing.assert_close(nll / n, theirs, rtol=1e-6, atol=1e-6)


# ---- bad rows and truncation --------------------------------------------------------------------
def test_bad_rows_are_counted_per_file_and_reason_never_a_crash(tmp_path, tok):
    long = {"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"}]}
    cut = {"messages": [{"role": "user", "content": "short?"}, {"role": "assistant", "content": "yes " * 300}]}
    mixed = jsonl(tmp_path / "mixed.jsonl", [
        qa(1), "not json", "[1, 2]", {"text": "a document"},
        {"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "  "}]},
        {"prompt": "Q?", "completion": ""},
        {"messages": [{"role": "tool", "content": "{}"}, {"role": "assistant", "content": "A."}]},
        {"messages": [{"role": "user", "content": "Q?"}]},
        {"messages": [{"role": "user", "content": ["image"]}, {"role": "assistant", "content": "A."}]},
        long, cut, qa(2)])
    other = jsonl(tmp_path / "other.jsonl", [qa(3), {"prompt": "Q?"}])
    index = build([mixed, other], tok, tmp_path / "out")
    st = index["stats"]
    assert st["documents"] == 4 and index["splits"]["train"]["documents"] == 4  # qa 1, 2, 3 and the cut one
    assert st["bad_by_file"] == {
        str(mixed): {"not valid JSON": 1, "not a JSON object": 1, chat_data.NEITHER_FORM: 1, "empty completion": 2,
                     "the chat template rejects role 'tool'": 1, "no assistant message after the first message": 1,
                     "messages holds a message whose content is not a string": 1,
                     "no completion token within the first seq_len tokens": 1},
        str(other): {chat_data.NEITHER_FORM: 1}}
    assert st["bad_line_examples"]["empty completion"] == [f"{mixed}:5", f"{mixed}:6"]  # file:line, never the text
    assert st["truncated"] == {"train": 1}
    ends = np.fromfile(tmp_path / "out" / "train.ends", np.int64)
    assert np.diff(np.concatenate([[0], ends])).max() == SEQ  # the cut conversation keeps seq_len tokens
    assert "4 document(s)" in text_data._summary(index) and "1 conversation(s) cut at 96" in text_data._summary(index)


def test_a_file_without_a_usable_row_is_an_error_naming_it(tmp_path, tok):
    good = jsonl(tmp_path / "good.jsonl", [qa(1)])
    bad = jsonl(tmp_path / "bad.jsonl", [{"text": "pre-training text"}, {"prompt": "x", "completion": " "}])
    with pytest.raises(DataError, match="no row of .*bad.jsonl can be learned from") as err:
        build([good, bad], tok, tmp_path / "out")
    assert "empty completion: 1" in str(err.value) and "neither" in str(err.value)


def test_a_template_that_fails_on_a_row_is_counted(tmp_path, tok):
    strict = CHAT_TEMPLATE.replace("{% for m in messages %}",
                                   "{% if messages[0]['role'] == 'system' %}{{ undefined_fn() }}{% endif %}"
                                   "{% for m in messages %}")
    f = jsonl(tmp_path / "a.jsonl", [qa(1), {"messages": CONV}])
    st = build([f], tok, tmp_path / "out", template=strict)["stats"]
    assert st["documents"] == 1 and st["bad_lines"] == {"the chat template failed to render (UndefinedError)": 1}


# ---- transforms (the PII scrubber's place) --------------------------------------------------------
class MaskIban:
    fingerprint = "mask-iban-v1"

    def __init__(self):
        self.seen: list[str] = []

    def __call__(self, path: str, text: str) -> str | None:
        self.seen.append(text)
        return text.replace("DE89370400440532013000", "<IBAN>")


def test_transforms_run_on_every_message_content_before_the_template(tmp_path, tok):
    rows = [{"messages": [{"role": "system", "content": "Desk."},
                          {"role": "user", "content": "Block DE89370400440532013000?"},
                          {"role": "assistant", "content": "DE89370400440532013000 is blocked."}]},
            {"prompt": "Is DE89370400440532013000 ours?", "completion": "Yes."}]
    f = jsonl(tmp_path / "a.jsonl", rows)
    t = MaskIban()
    index = build([f], tok, tmp_path / "out", transforms=[t])
    assert t.seen == ["Desk.", "Block DE89370400440532013000?", "DE89370400440532013000 is blocked.",
                      "Is DE89370400440532013000 ours?", "Yes."]  # contents only, never the template's text
    ids = np.fromfile(tmp_path / "out" / "train.tokens", np.dtype(index["dtype"]))
    text = tok.decode([int(i) for i in ids])
    assert "DE8937" not in text and text.count("<IBAN>") == 3 and "<|im_start|>assistant" in text
    assert index["stats"]["changed"] == {"mask-iban-v1": 3}


# ---- the cache ------------------------------------------------------------------------------------
def test_cache_is_reused_and_rebuilt_when_the_template_changes(tmp_path, tok, monkeypatch):
    calls = []
    original = chat_data.build_chat_tokens
    monkeypatch.setattr(chat_data, "build_chat_tokens", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    f = jsonl(tmp_path / "data" / "a.jsonl", [qa(i) for i in range(6)])
    work = tmp_path / "work"

    def prepare(template: str = CHAT_TEMPLATE, max_tokens: int = SEQ) -> text_data.TokenCache:
        return text_data.prepare(ChatCorpus([(f, None)], template=template, max_tokens=max_tokens), tok, work)

    first = prepare()
    assert len(calls) == 1
    again = prepare()
    assert len(calls) == 1 and again.path == first.path  # reused
    other = CHAT_TEMPLATE.replace("<|im_end|>\n", "<|im_end|>")
    assert other != CHAT_TEMPLATE
    changed = prepare(other)
    assert len(calls) == 2 and changed.path != first.path
    assert changed.index["template_sha256"] != first.index["template_sha256"]
    assert changed.index["splits"]["train"]["tokens"] < first.index["splits"]["train"]["tokens"]  # one '\n' less per turn
    prepare(max_tokens=SEQ // 2)  # the cut is part of the key
    assert len(calls) == 3
    text = text_data.prepare(text_data.Corpus([(f, None)]), tok, work)  # text format: another cache
    assert text.path not in (first.path, changed.path) and text.index.get("format") is None


# ---- the task ---------------------------------------------------------------------------------------
def make(model_dir: Path, data: Path, work: Path | None = None, **options) -> CausalLM:
    opts = Options.model_validate({"model_dir": str(model_dir), "data": str(data / "*"), "seq_len": SEQ,
                                   "format": "chat", "val_fraction": 0.3, **options})
    return CausalLM(opts, TaskContext(role="site", site="paris", workdir=work, seed=0))


def test_task_refuses_a_tokenizer_without_template_and_text_files(tmp_path, llama_dir, chat_llama_dir):  # noqa: F811
    data = tmp_path / "data"
    jsonl(data / "a.jsonl", [qa(1)])
    with pytest.raises(OptionsError, match="has no chat template and none is configured"):
        make(llama_dir, data)
    assert make(llama_dir, data, chat_template=CHAT_TEMPLATE).chat_template == CHAT_TEMPLATE
    tpl = tmp_path / "chatml.jinja"
    tpl.write_text(CHAT_TEMPLATE)
    assert make(llama_dir, data, chat_template=str(tpl)).chat_template == CHAT_TEMPLATE
    with pytest.raises(OptionsError, match="chat_template: cannot use it"):
        make(chat_llama_dir, data, chat_template="{{ messages[0]['content'] }}")  # no assistant turn rendered
    (data / "b.txt").write_text("text")
    with pytest.raises(OptionsError, match=r"b.txt is not .jsonl; format chat"):
        make(chat_llama_dir, data)
    with pytest.raises(ValueError, match="apply to format: chat"):
        Options.model_validate({"model_dir": "/m", "data": "/d", "packing": False})


def test_task_trains_and_evaluates_on_completion_tokens(tmp_path, chat_llama_dir):  # noqa: F811
    data = tmp_path / "data"
    jsonl(data / "a.jsonl", [qa(i) for i in range(60)])
    task = make(chat_llama_dir, data, tmp_path / "work", lora={"r": 4, "alpha": 8, "dropout": 0.0})
    td = task.build_data()
    assert task.token_cache.index["format"] == "chat" and td.val is not None and len(td.train) > 0
    model = task.build_model()
    batch = torch.utils.data.default_collate([td.val[i] for i in range(len(td.val))])

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            out = task.evaluate(model, batch)
        model.train()
        return float(out["loss"] / out["examples"])

    out = task.evaluate(model, batch)
    assert int(out["examples"]) == int((batch["labels"][:, 1:] != IGNORE).sum())  # completion tokens
    before = eval_loss()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
    g = torch.Generator().manual_seed(0)
    for _ in range(15):
        rows = [td.train[int(i)] for i in torch.randint(len(td.train), (4,), generator=g)]
        task.loss(model, torch.utils.data.default_collate(rows)).backward()
        opt.step()
        opt.zero_grad()
    assert eval_loss() < before - 0.1


# ---- the site's PII scrubber on chat rows ---------------------------------------------------------
PII_ROWS = [
    {"messages": [{"role": "system", "content": "Compliance desk."},
                  {"role": "user", "content": "Freeze the account DE89370400440532013000 of jeanne.martin@banque-exemple.fr?"},
                  {"role": "assistant", "content": "Yes; write to jeanne.martin@banque-exemple.fr once it is frozen."}]},
    {"prompt": "Who logged in from 192.168.12.34?", "completion": "An operator; the log is kept five years."},
]
PII_VALUES = ["DE89370400440532013000", "jeanne.martin@banque-exemple.fr", "192.168.12.34"]


def test_the_sites_pii_scrubber_runs_on_every_message_and_sovfl_scrub_reads_chat_rows(tmp_path, chat_llama_dir):  # noqa: F811
    from site_trainer.config import SiteConfig
    from site_trainer.pii import transform

    data = tmp_path / "data"
    jsonl(data / "a.jsonl", PII_ROWS * 3)
    site = SiteConfig(id="paris", partition=0)
    opts = Options.model_validate({"model_dir": str(chat_llama_dir), "data": str(data / "*"), "seq_len": 256,
                                   "format": "chat", "val_fraction": 0.0})

    def build(work: Path):
        transforms = transform.site_transforms(site.pii, CausalLM, work, site.id)
        task = CausalLM(opts, TaskContext(role="site", site=site.id, workdir=work, document_transforms=transforms))
        task.build_data()
        return task, transforms

    # sovfl scrub's path first: it fills the scrubber's cache from the chat rows' messages
    report, skipped = transform.scrub_documents([(data / "a.jsonl", None)], site.pii, tmp_path / "work",
                                                text_field=None)
    assert skipped == {} and report.documents == 3 * 5  # every message's content, not the template
    task, transforms = build(tmp_path / "work")
    assert transforms[0].scrubber.report.documents_cached == transforms[0].scrubber.report.documents == 15
    ids = np.fromfile(task.token_cache.path / "train.tokens", np.dtype(task.token_cache.index["dtype"]))
    text = task.tokenizer.decode(ids.tolist())
    assert not [v for v in PII_VALUES if v in text]
    assert text.count("<EMAIL_ADDRESS>") == 6 and text.count("<IBAN_CODE>") == 3 and text.count("<IP_ADDRESS>") == 3
    assert text.count("<|im_start|>assistant") == 6  # the template's own tokens are untouched
    metrics = transform.round_metrics(transforms)
    assert metrics["pii_EMAIL_ADDRESS"] == 6 and metrics["pii_IBAN_CODE"] == 3 and metrics["pii_IP_ADDRESS"] == 3
