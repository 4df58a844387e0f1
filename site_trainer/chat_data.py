"""Chat and instruction data: `.jsonl` conversations rendered with the model's chat template, the
loss on assistant (completion) tokens only, packed so that no document sees another.

    rows -> parse -> document transforms on every message's content (PII scrubber first)
         -> chat template -> tokens + target mask -> cut at seq_len -> cache -> packed sequences

- Rows, one per line: the conversational form `{"messages": [{"role": ..., "content": ...}, ...]}`
  (every assistant message is learned) or the prompt-completion form `{"prompt": ..., "completion":
  ...}`, each a string (a user turn, an assistant turn) or a list of messages (only the completion
  is learned).
- Targets: the characters each assistant turn adds to the rendered text (its content and the
  template's end-of-turn marker), found by rendering the conversation up to that turn with and
  without the generation prompt; tokens that start inside them are targets, every other token
  (system, user, the template's role headers) is not. The template must render a conversation's
  beginning as the whole conversation begins (every common template does); a row where it does
  not is counted, not guessed at.
- Bad rows (neither form, a role the template rejects, an empty completion, a template that fails,
  nothing to learn within seq_len, ...) are counted per file and reason in the cache index with up
  to five `file:line` examples (never the text) and logged; a file whose every row is bad is an
  error naming it.
- The cache (site_trainer/text_data.py's machinery: built once per site by rank 0, keyed by content)
  holds per split the token ids, a uint8 target mask and each conversation's end offset. The key
  includes the template and seq_len (conversations are cut at seq_len when built).
- `ChatSequences` packs whole conversations into rows of seq_len tokens (best fit decreasing: the
  longest first, each into the fullest row it fits, so rows are nearly full: measured 86% -> 95% of
  real tokens on the compliance example at seq_len 512, next fit in order before; the rest padded, never a target). Position ids restart at 0 for every conversation: Hugging Face
  models then mask attention block-diagonally (transformers' packed-sequence detection when no
  attention mask is given), so no token attends to, or is predicted from, another conversation.
  The first token of every conversation is never a target. `packing: false` puts one conversation
  per row instead.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from site_trainer import text_data
from site_trainer.text_data import CorpusStats, DataError, Piece
from site_trainer.workload import Dataset

CHAT_VERSION = 1
IGNORE = -100  # the label of a token the loss skips (transformers' and torch's convention)
BATCH_CHARS = 1 << 20  # rendered text tokenized per tokenizer call

NEITHER_FORM = 'neither {"messages": [...]} nor {"prompt": ..., "completion": ...}'


class BadRow(ValueError):
    """A row that cannot be learned from; its message is the reason (counted, never the row's text)."""


@dataclass
class Row:
    where: str  # file:line
    split: str
    messages: list[dict]
    n_prompt: int | None  # prompt-completion form: how many leading messages are the prompt


# ---- rows ---------------------------------------------------------------------------------------
def _messages(value, what: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user" if what == "prompt" else "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRow(f"{what} is neither a string nor a non-empty list of messages")
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise BadRow(f"{what} holds a message without a string role and a content")
        if not isinstance(m["content"], str):
            raise BadRow(f"{what} holds a message whose content is not a string")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def parse_row(obj: dict) -> tuple[list[dict], int | None]:
    """(messages, number of prompt messages or None) of one row; BadRow with the reason otherwise."""
    if "messages" in obj:
        messages, n_prompt = _messages(obj["messages"], "messages"), None
        learned = [m for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
        if not learned:
            raise BadRow("no assistant message after the first message")
        if not any(m["content"].strip() for m in learned):
            raise BadRow("empty completion")
    elif "prompt" in obj and "completion" in obj:
        prompt, completion = _messages(obj["prompt"], "prompt"), _messages(obj["completion"], "completion")
        if not any(m["content"].strip() for m in completion):
            raise BadRow("empty completion")
        messages, n_prompt = prompt + completion, len(prompt)
    else:
        raise BadRow(NEITHER_FORM)
    if not all(text_data.encodable(m["role"]) and text_data.encodable(m["content"]) for m in messages):
        raise BadRow("a message holds an unpaired surrogate (invalid Unicode)")
    return messages, n_prompt


def row_in_val(messages: list[dict], fraction: float) -> bool:
    """The split of a row, by a hash of its raw messages (before any transform), order-free."""
    return text_data.in_val(json.dumps(messages, sort_keys=True, ensure_ascii=False), fraction)


# ---- the template -------------------------------------------------------------------------------
def render(tokenizer, template: str, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _render(tokenizer, template: str, messages: list[dict], generation_prompt: bool) -> str:
    try:
        return render(tokenizer, template, messages, generation_prompt)
    except Exception as err:  # noqa: BLE001 - the template is user code (Jinja): any failure is the row's
        text = str(err)
        rejected = sorted({m["role"] for m in messages if m["role"] not in ("user", "assistant") and m["role"] in text})
        if rejected:
            raise BadRow(f"the chat template rejects role {rejected[0]!r}") from None
        raise BadRow(f"the chat template failed to render ({type(err).__name__})") from None


def target_spans(tokenizer, template: str, messages: list[dict], n_prompt: int | None
                 ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans the loss is on: each assistant turn's
    addition (prompt-completion: everything after the prompt and its generation prompt)."""
    full = _render(tokenizer, template, messages, False)
    if n_prompt is not None:
        starts = [(n_prompt, len(messages))]
    else:
        starts = [(i, i + 1) for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    spans = []
    for first, end in starts:
        before = _render(tokenizer, template, messages[:first], True)
        upto = full if end == len(messages) else _render(tokenizer, template, messages[:end], False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise BadRow("the chat template renders a conversation's beginning differently from the whole "
                         "conversation, so its assistant tokens cannot be found")
        if len(upto) > len(before):
            spans.append((len(before), len(upto)))
    return full, spans


def check_template(tokenizer, template: str) -> None:
    """Raise ValueError unless `template` renders a user/assistant exchange with findable targets."""
    try:
        _, spans = target_spans(tokenizer, template, [{"role": "user", "content": "Hello?"},
                                                      {"role": "assistant", "content": "Hello."}], None)
    except BadRow as err:
        raise ValueError(str(err)) from None
    if not spans:
        raise ValueError("an assistant turn renders as nothing")


def template_fingerprint(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()


# ---- building ----------------------------------------------------------------------------------
def read_rows(files: Sequence[tuple[Path, str | None]], val_fraction: float, stats: CorpusStats) -> Iterator[Row]:
    for path, split in files:
        stats.files += 1
        stats.bytes += path.stat().st_size
        for where, obj in text_data.jsonl_objects(path, stats):
            try:
                messages, n_prompt = parse_row(obj)
            except BadRow as err:
                stats.bad_line(str(err), where)
                continue
            yield Row(where, split or ("val" if row_in_val(messages, val_fraction) else "train"), messages, n_prompt)


def transformed_rows(rows: Iterator[Row], transforms: Sequence[text_data.DocumentTransform],
                     stats: CorpusStats) -> Iterator[Row | None]:
    """Each row with every message's content run through the transforms (in order, as for text);
    None in place of a row a transform dropped a message of (counted as a bad row)."""
    if not transforms:
        yield from rows
        return
    queued: collections.deque[Row] = collections.deque()

    def pieces() -> Iterator[Piece]:
        for row in rows:
            queued.append(row)
            for m in row.messages:
                yield Piece(row.where.rsplit(":", 1)[0], m["content"], row.split, last=True)

    out = text_data.apply_transforms(pieces(), transforms, stats)
    for first in out:
        row = queued.popleft()
        texts = [first.text] + [next(out).text for _ in row.messages[1:]]
        if any(t is None for t in texts):
            stats.bad_line("a document transform dropped a message", row.where)
            yield None
            continue
        yield Row(row.where, row.split, [{**m, "content": t} for m, t in zip(row.messages, texts)], row.n_prompt)


class _Sink:
    """One split's three files, written as rows arrive: tokens, target mask, conversation ends."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype):
        self.split, self.dtype, self.tokens, self.docs, self.targets = split, dtype, 0, 0, 0
        self.files = {k: (out_dir / f"{split}.{k}").open("wb") for k in ("tokens", "labels", "ends")}

    def write(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.files["tokens"].write(ids.astype(self.dtype).tobytes())
        self.files["labels"].write(mask.astype(np.uint8).tobytes())
        self.tokens += len(ids)
        self.docs += 1
        self.targets += int(mask.sum())
        self.files["ends"].write(np.asarray([self.tokens], np.int64).tobytes())

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def entry(self) -> dict:
        return {"file": f"{self.split}.tokens", "tokens": self.tokens, "documents": self.docs, "targets": self.targets,
                "arrays": {"labels": {"file": f"{self.split}.labels", "dtype": "|u1", "count": self.tokens},
                           "ends": {"file": f"{self.split}.ends", "dtype": "<i8", "count": self.docs}}}


def build_chat_tokens(files: Sequence[tuple[Path, str | None]], tokenizer, out_dir: Path, *, template: str,
                      max_tokens: int, val_fraction: float, transforms: Sequence[text_data.DocumentTransform] = (),
                      progress: Callable[[CorpusStats], None] | None = None) -> dict:
    """Render, tokenize and cut every row of `files` into `out_dir`; returns the index (also
    `out_dir/index.json`). DataError naming the files none of whose rows can be learned from."""
    dtype = text_data.token_dtype(len(tokenizer))
    stats = CorpusStats()
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    sinks = {s: _Sink(out_dir, s, dtype) for s in ("train", "val")}
    good: collections.Counter = collections.Counter()  # file -> rows kept
    pending: list[tuple[Row, str, list[tuple[int, int]]]] = []

    def flush() -> None:
        if not pending:
            return
        enc = tokenizer([text for _, text, _ in pending], add_special_tokens=False, return_offsets_mapping=True,
                        return_attention_mask=False, return_token_type_ids=False, verbose=False)
        for (row, _, spans), ids, offsets in zip(pending, enc["input_ids"], enc["offset_mapping"]):
            ids = np.asarray(ids, np.int64)
            starts = np.asarray([o[0] for o in offsets], np.int64)
            mask = np.zeros(len(ids), bool)
            for a, b in spans:
                mask |= (starts >= a) & (starts < b)
            mask[:1] = False  # nothing before it in its document: never a target
            if len(ids) > max_tokens:
                ids, mask = ids[:max_tokens], mask[:max_tokens]
                cut = True
            else:
                cut = False
            if not mask.any():
                stats.bad_line("no completion token within the first seq_len tokens", row.where)
                continue
            stats.truncated[row.split] += int(cut)
            stats.targets[row.split] += int(mask.sum())
            stats.tokens[row.split] += len(ids)
            stats.documents += 1
            stats.split_documents[row.split] += 1
            good[row.where.rsplit(":", 1)[0]] += 1
            sinks[row.split].write(ids, mask)
        pending.clear()

    try:
        size = 0
        for row in transformed_rows(read_rows(files, val_fraction, stats), transforms, stats):
            if row is not None:
                try:
                    text, spans = target_spans(tokenizer, template, row.messages, row.n_prompt)
                except BadRow as err:
                    stats.bad_line(str(err), row.where)
                else:
                    pending.append((row, text, spans))
                    size += len(text)
                    if size >= BATCH_CHARS:
                        flush()
                        size = 0
            if progress is not None:
                progress(stats)
        flush()
    finally:
        for s in sinks.values():
            s.close()
    useless = [str(p) for p, _ in files if not good[str(p)] and stats.bad_by_file.get(str(p))]
    if useless:
        def why(f: str) -> str:
            reasons = sorted(stats.bad_by_file[f].items(), key=lambda kv: -kv[1])
            return ", ".join(f"{r}: {n}" for r, n in reasons[:3])

        raise DataError(f"data: no row of {useless[0]} can be learned from ({why(useless[0])})"
                        + (f"; nor of {len(useless) - 1} other file(s)" if len(useless) > 1 else "")
                        + '. Rows must be {"messages": [{"role": ..., "content": ...}, ...]} with an assistant turn, '
                          'or {"prompt": ..., "completion": ...}, that the chat template renders within seq_len')
    reports = {t.fingerprint: t.report() for t in transforms if callable(getattr(t, "report", None))}
    eos = tokenizer.eos_token_id
    index = {"version": text_data.FORMAT_VERSION, "format": "chat", "chat_version": CHAT_VERSION,
             "dtype": dtype.str, "eos_id": int(eos) if eos is not None else None, "max_tokens": int(max_tokens),
             "template_sha256": template_fingerprint(template),
             "splits": {s: sink.entry() for s, sink in sinks.items()},
             "stats": stats.to_json(), "transform_reports": reports, "build_s": round(time.perf_counter() - t0, 3)}
    text_data.write_json(out_dir / "index.json", index)
    return index


@dataclass
class ChatCorpus(text_data.Corpus):
    """Chat rows to build with `text_data.prepare`: the template and the cut enter the cache key."""

    template: str = ""
    max_tokens: int = 2048

    def settings(self) -> dict:
        return {"format": "chat", "chat_version": CHAT_VERSION, "chat_template": self.template,
                "max_tokens": self.max_tokens, "val_fraction": self.val_fraction,
                "transforms": [t.fingerprint for t in self.transforms]}

    def build(self, tokenizer, out_dir: Path, progress: Callable[[CorpusStats], None] | None = None) -> dict:
        return build_chat_tokens(self.files, tokenizer, out_dir, template=self.template, max_tokens=self.max_tokens,
                                 val_fraction=self.val_fraction, transforms=self.transforms, progress=progress)


# ---- reading -----------------------------------------------------------------------------------
def pack(lengths: np.ndarray, seq_len: int, packing: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(conversation indices, row offsets): row r holds conversations `docs[offsets[r]:offsets[r + 1]]`
    (ascending). Packed: best fit decreasing (longest first, each into the row with the least room
    that still fits it, else a new row); deterministic, so every rank gets the same rows. Unpacked:
    one conversation per row, in order."""
    n = len(lengths)
    if not packing or n == 0:
        return np.arange(n, dtype=np.int64), np.arange(n + 1, dtype=np.int64)
    room: dict[int, list[int]] = collections.defaultdict(list)  # free tokens -> rows with exactly that room
    free: list[int] = []  # the distinct free-token counts of open rows, sorted
    rows: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[i])
        k = bisect.bisect_left(free, need)
        if k < len(free):  # the row with the least room that fits
            space = free[k]
            r = room[space].pop()
            if not room[space]:
                del free[k]
        else:
            r, space = len(rows), seq_len
            rows.append([])
        rows[r].append(i)
        left = space - need
        if left > 0:
            if not room[left]:
                bisect.insort(free, left)
            room[left].append(r)
    docs = np.concatenate([np.sort(np.asarray(r, np.int64)) for r in rows])
    offsets = np.zeros(len(rows) + 1, np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    return docs, offsets


class ChatSequences(Dataset):
    """Rows of `seq_len` tokens of whole conversations: a dict of int64 tensors `input_ids`,
    `labels` (the token id where it is a target, -100 elsewhere; shifted by the loss, as in
    transformers) and `position_ids` (restarting at 0 for every conversation, and for the padding).

    The token and mask files are mapped lazily in the process that reads them; the conversation
    ends (8 bytes each) and the packing are held in memory.
    """

    def __init__(self, cache_dir: Path, entry: dict, dtype: str, seq_len: int, pad_id: int, packing: bool = True):
        self.dir, self.entry, self.dtype = Path(cache_dir), entry, np.dtype(dtype)
        self.seq_len, self.pad_id, self.tokens = int(seq_len), int(pad_id), int(entry["tokens"])
        ends_info = entry["arrays"]["ends"]
        ends = np.fromfile(self.dir / ends_info["file"], np.int64, count=ends_info["count"])
        self.ends = ends
        self.begins = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        lengths = ends - self.begins
        if len(lengths) and lengths.max() > self.seq_len:
            raise DataError(f"token cache {self.dir}: a conversation of {int(lengths.max())} tokens is longer than "
                            f"seq_len {self.seq_len}; it was built for another seq_len: delete it to rebuild")
        self.docs, self.offsets = pack(lengths, self.seq_len, packing)
        self.targets = int(entry.get("targets", 0))
        self._maps: tuple[np.memmap, np.memmap] | None = None

    @staticmethod
    def of(cache: text_data.TokenCache, split: str, seq_len: int, pad_id: int, packing: bool = True
           ) -> "ChatSequences":
        return ChatSequences(cache.path, cache.index["splits"][split], cache.index["dtype"], seq_len, pad_id, packing)

    @property
    def documents(self) -> int:
        return len(self.ends)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row_documents(self, index: int) -> list[int]:
        """The conversations (indices in the cache's order) row `index` holds, in row order."""
        return self.docs[self.offsets[index]:self.offsets[index + 1]].tolist()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"sequence {index} of {n}")
        if self._maps is None:
            if self.tokens == 0:
                raise IndexError("no tokens")
            self._maps = (np.memmap(self.dir / self.entry["file"], dtype=self.dtype, mode="r", shape=(self.tokens,)),
                          np.memmap(self.dir / self.entry["arrays"]["labels"]["file"], dtype=np.uint8, mode="r",
                                    shape=(self.tokens,)))
        ids_map, mask_map = self._maps
        ids = np.full(self.seq_len, self.pad_id, np.int64)
        labels = np.full(self.seq_len, IGNORE, np.int64)
        pos = np.zeros(self.seq_len, np.int64)
        at = 0
        for d in self.docs[self.offsets[index]:self.offsets[index + 1]].tolist():
            a, b = int(self.begins[d]), int(self.ends[d])
            e = at + b - a
            ids[at:e] = ids_map[a:b]
            labels[at:e] = np.where(mask_map[a:b].astype(bool), ids[at:e], IGNORE)
            pos[at:e] = np.arange(b - a)
            at = e
        pos[at:] = np.arange(self.seq_len - at)  # the padding: a block of its own
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(pos)}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def conversations(self) -> dict[str, list[list[int]]]:
        """Every conversation unpacked, unpadded: `input_ids` and `labels` (-100 off its completion
        tokens), one list each per conversation: what TRL's `SFTTrainer` takes as a tokenized
        dataset, to pack itself (`hf_callback.SiteData.sft_datasets`)."""
        if self.tokens == 0:
            return {"input_ids": [], "labels": []}
        ids = np.fromfile(self.dir / self.entry["file"], dtype=self.dtype, count=self.tokens).astype(np.int64)
        mask = np.fromfile(self.dir / self.entry["arrays"]["labels"]["file"], dtype=np.uint8,
                           count=self.tokens).astype(bool)
        labels = np.where(mask, ids, IGNORE)
        return {"input_ids": [ids[a:b].tolist() for a, b in zip(self.begins.tolist(), self.ends.tolist())],
                "labels": [labels[a:b].tolist() for a, b in zip(self.begins.tolist(), self.ends.tolist())]}


def loss_sums(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token negative log-likelihood over the target tokens, their count) of a batch of
    `ChatSequences` rows, with float32 logits."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    targets = batch["labels"][:, 1:]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                                            ignore_index=IGNORE, reduction="sum")
    return nll, (targets != IGNORE).sum()
