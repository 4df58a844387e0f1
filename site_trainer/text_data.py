"""A site's text, from files to packed token sequences, built once per site and read from disk.

    files (globs) -> documents -> document transforms (PII scrubber, ...) -> tokens -> cache -> sequences

- Files: `.txt` and `.jsonl`, found by glob patterns (sorted, so every run and every rank sees the
  same order). A `.txt` file is one document; a large one is read in pieces of about
  `piece_chars` characters cut at blank lines (then at line ends), so memory stays bounded
  whatever the file size. A `.jsonl` file holds one document per line, in the line's `text_field`;
  lines that are not JSON objects with a string there are skipped, counted by reason and the
  first few reported as `file:line`. Undecodable UTF-8 bytes are replaced and counted.
- Document transforms (`DocumentTransform`) run on the raw text before anything is tokenized, in
  order; one may rewrite a document or drop it (None). This is where the site's PII scrubber
  plugs in (site_trainer/pii); each transform's `fingerprint` enters the cache key.
- Tokens: the model's tokenizer without special tokens, EOS after every document, written as one
  flat uint16 (or uint32 for vocabularies over 65,536) stream per split, incrementally: the corpus
  is never in memory. Sequence i of length L is tokens[i*L : i*L + L + 1] (inputs and shifted
  targets share L tokens; every token after the first is a target exactly once, a short tail
  is left out). Documents run into each other inside a sequence, separated by EOS, as in GPT
  pre-training.
- Validation: the files of `val_data` if given, else a `val_fraction` of the documents chosen by
  a hash of their text (identical documents land in the same split; no order dependence).
- Cache: `<workdir>/text_cache/<key>/` holding `train.tokens`, `val.tokens` and `index.json`
  (counts, bad lines, dropped documents). The key hashes every file's content, path and role,
  the tokenizer, the transforms' fingerprints and the settings above, so an unchanged corpus is
  reused and any change re-tokenizes. The sequence length is not part of it: a new `seq_len`
  reuses the tokens. Builds go to a temporary directory renamed into place when complete, so a
  half-written cache is never read. The two newest caches are kept.
- Once per site: with several ranks, rank 0 hashes and builds; the others wait for it, failing
  if it reports an error or stops making progress for `stall_s` (every wait has a deadline).
  The ranks of a site must share the workdir (as local checkpoints already require); a rank that
  cannot see rank 0's files is refused with that fix.
- `PackedSequences` is a map-style dataset over the memory-mapped stream: each rank reads only the
  sequences it samples.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import itertools
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from crypto.durable import write_atomic
from site_trainer.workload import Dataset

log = logging.getLogger("sovfl.text")

SUFFIXES = (".txt", ".jsonl")
FORMAT_VERSION = 1
PIECE_CHARS = 4 << 20  # characters of a .txt file read at a time (then cut at a blank line)
MAX_LINE_BYTES = 64 << 20  # a .jsonl line longer than this is skipped (counted), not read whole
BATCH_CHARS = 1 << 20  # text tokenized per tokenizer call
CACHE_DIR = "text_cache"
KEEP_CACHES = 2
REPORT_BAD_LINES = 5  # bad .jsonl lines named in the log, per reason


class DataError(ValueError):
    """Site data that cannot be used; the message names the pattern or file and what to do."""


@runtime_checkable
class DocumentTransform(Protocol):
    """Rewrites or drops one document before tokenization; called on one rank per site only.

    `__call__(path, text)` returns the new text, or None to drop the document. For a large `.txt`
    file it is called once per piece (cut at a blank line), and None drops that piece.
    `fingerprint` must change whenever the output for the same input may change (version,
    settings): it is part of the token cache's key. A transform may also define
    `map(items: Iterable[tuple[str, str]]) -> Iterable[str | None]`, one output per input and in
    order, to work on the stream as a whole (e.g. over a process pool); it is then used instead
    of `__call__`. A transform may also define `report() -> dict` (JSON-serialisable counts, never
    text): it is called once after a build and stored in the cache index under
    `transform_reports[fingerprint]`, so that a reused cache still has it; `restore_report(report)`,
    if defined, is called on every rank after `prepare` with that stored report (None if the build
    stored none). Transforms must not log or return document text anywhere else.
    """

    fingerprint: str

    def __call__(self, path: str, text: str) -> str | None: ...


# ---- files ------------------------------------------------------------------------------------
def find_files(patterns: Sequence[str], field_name: str = "data") -> list[Path]:
    """The files matched by `patterns` (glob, `**` recursive), sorted and de-duplicated.

    Refuses, naming the pattern: one that matches no file, a matched file of another type, or one
    that cannot be opened.
    """
    found: dict[Path, str] = {}
    for pattern in patterns:
        matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(pattern), recursive=True))
        files = [m for m in matches if m.is_file()]
        if not files:
            where = Path(os.path.expanduser(pattern)).absolute()
            raise DataError(f"{field_name}: pattern {pattern!r} matches no file (looked for {where}); "
                            "check the path, or put the site's .txt/.jsonl files there")
        for f in files:
            if f.suffix not in SUFFIXES:
                raise DataError(f"{field_name}: pattern {pattern!r} matches {f}, which is neither .txt nor .jsonl; "
                                f"narrow the pattern (e.g. {pattern.rstrip('*')}*.jsonl) or convert the file")
            try:
                with f.open("rb") as fh:
                    fh.read(1)
            except OSError as err:
                raise DataError(f"{field_name}: pattern {pattern!r} matches {f}, which cannot be read "
                                f"({err.strerror}); fix its permissions or leave it out") from None
            found.setdefault(f.absolute(), pattern)
    return sorted(found)


def file_digest(path: Path) -> str:
    """A file's SHA-256 (read once per process while its size and modification time stay: the
    token cache's key and the site's data snapshot read the same files at start-up)."""
    st = path.stat()
    return _file_digest(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- documents --------------------------------------------------------------------------------
@dataclass
class CorpusStats:
    """What the build read, skipped and wrote; stored in the cache index and logged."""

    files: int = 0
    bytes: int = 0
    documents: int = 0
    undecodable_bytes: int = 0
    empty_documents: int = 0
    bad_lines: Counter = field(default_factory=Counter)  # reason -> count
    bad_line_examples: dict = field(default_factory=dict)  # reason -> ["file:line", ...]
    dropped: Counter = field(default_factory=Counter)  # transform fingerprint -> pieces dropped
    changed: Counter = field(default_factory=Counter)  # transform fingerprint -> pieces rewritten
    tokens: Counter = field(default_factory=Counter)  # split -> tokens
    split_documents: Counter = field(default_factory=Counter)  # split -> documents
    bad_by_file: dict = field(default_factory=dict)  # file -> {reason: count}
    # chat data (site_trainer/chat_data.py): per split, conversations cut at seq_len and the tokens
    # the loss is computed on (assistant / completion tokens)
    truncated: Counter = field(default_factory=Counter)
    targets: Counter = field(default_factory=Counter)

    def bad_line(self, reason: str, where: str) -> None:
        self.bad_lines[reason] += 1
        per_file = self.bad_by_file.setdefault(where.rsplit(":", 1)[0], {})
        per_file[reason] = per_file.get(reason, 0) + 1
        examples = self.bad_line_examples.setdefault(reason, [])
        if len(examples) < REPORT_BAD_LINES:
            examples.append(where)
            log.warning("skipped %s: %s", where, reason)

    def to_json(self) -> dict:
        return {k: dict(v) if isinstance(v, Counter) else v for k, v in self.__dict__.items()}


_undecodable = [0]


def _count_and_replace(err: UnicodeDecodeError) -> tuple[str, int]:
    _undecodable[0] += err.end - err.start
    return "\ufffd", err.end


codecs.register_error("sovfl-count-replace", _count_and_replace)


def _txt_pieces(path: Path, piece_chars: int) -> Iterator[str]:
    """A .txt file in pieces of about `piece_chars` characters, cut after a blank line if one comes
    within 4x that, else after a line end, else anywhere (a file without newlines)."""
    with path.open("r", encoding="utf-8", errors="sovfl-count-replace", newline="") as f:
        buf: list[str] = []
        size = 0
        while True:
            line = f.readline(piece_chars)
            if not line:
                break
            buf.append(line)
            size += len(line)
            if size >= piece_chars and (not line.strip() or size >= 4 * piece_chars):
                yield "".join(buf)
                buf, size = [], 0
        if buf:
            yield "".join(buf)


def jsonl_objects(path: Path, stats: CorpusStats) -> Iterator[tuple[str, dict]]:
    """(`file:line`, object) for each line of a .jsonl file that is a JSON object; blank lines are
    passed over, other lines (over-long, not UTF-8, not JSON, not an object) counted by reason."""
    with path.open("rb") as f:
        for lineno in itertools.count(1):
            raw = f.readline(MAX_LINE_BYTES)
            if not raw:
                return
            where = f"{path}:{lineno}"
            if len(raw) == MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # skip the rest of the over-long line
                    raw = f.readline(MAX_LINE_BYTES)
                stats.bad_line(f"line over {MAX_LINE_BYTES >> 20} MiB", where)
                continue
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except UnicodeDecodeError:
                stats.bad_line("not UTF-8", where)
                continue
            except ValueError:
                stats.bad_line("not valid JSON", where)
                continue
            if not isinstance(obj, dict):
                stats.bad_line("not a JSON object", where)
                continue
            yield where, obj


def _jsonl_documents(path: Path, text_field: str, stats: CorpusStats) -> Iterator[str]:
    for where, obj in jsonl_objects(path, stats):
        if text_field not in obj:
            stats.bad_line(f"no {text_field!r} field", where)
        elif not isinstance(obj[text_field], str):
            stats.bad_line(f"{text_field!r} is not a string", where)
        elif not encodable(obj[text_field]):
            stats.bad_line(f"{text_field!r} holds an unpaired surrogate (invalid Unicode)", where)
        else:
            yield obj[text_field]


def encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class Piece:
    """A document, or a piece of one (large .txt files), on its way to the tokenizer."""

    path: str
    text: str | None
    split: str  # "train" or "val"
    last: bool  # the last piece of its document: EOS follows


def in_val(text: str, fraction: float) -> bool:
    """Deterministic, order-free choice of validation documents: a hash of the text below `fraction`."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(text[:1 << 16].encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64 < fraction


def read_pieces(files: Sequence[tuple[Path, str | None]], text_field: str, val_fraction: float,
                stats: CorpusStats, piece_chars: int = PIECE_CHARS) -> Iterator[Piece]:
    """Every document of `files` as pieces, streamed. A file's split is given ("train"/"val") or,
    when None, chosen per document by `in_val`."""
    for path, split in files:
        stats.files += 1
        stats.bytes += path.stat().st_size
        before = _undecodable[0]
        if path.suffix == ".jsonl":
            docs: Iterable[Iterable[str]] = ([d] for d in _jsonl_documents(path, text_field, stats))
        else:
            docs = [_txt_pieces(path, piece_chars)]
        for pieces in docs:
            pieces = iter(pieces)
            first = next(pieces, "")
            if not first.strip():
                stats.empty_documents += 1
                continue
            stats.documents += 1
            doc_split = split or ("val" if in_val(first, val_fraction) else "train")
            stats.split_documents[doc_split] += 1
            current = first
            for nxt in pieces:
                yield Piece(str(path), current, doc_split, last=False)
                current = nxt
            yield Piece(str(path), current, doc_split, last=True)
        stats.undecodable_bytes += _undecodable[0] - before


def apply_transforms(pieces: Iterator[Piece], transforms: Sequence[DocumentTransform],
                     stats: CorpusStats) -> Iterator[Piece]:
    """Run each transform over the stream in order; a dropped piece keeps its place with text None
    (so that its document still ends with EOS when earlier pieces were kept)."""
    for t in transforms:
        pieces = _apply_one(pieces, t, stats)
    return pieces


_END = object()


def _apply_one(pieces: Iterator[Piece], t: DocumentTransform, stats: CorpusStats) -> Iterator[Piece]:
    fp = t.fingerprint
    live, meta = itertools.tee(pieces)
    inputs = ((p.path, p.text) for p in live if p.text is not None)
    outputs = iter(t.map(inputs)) if callable(getattr(t, "map", None)) else (t(path, text) for path, text in inputs)
    for p in meta:
        if p.text is None:
            yield p
            continue
        try:
            out = next(outputs)
        except StopIteration:
            raise RuntimeError(f"document transform {fp!r} returned fewer outputs than it was given") from None
        if out is not None and not isinstance(out, str):
            raise TypeError(f"document transform {fp!r} returned {type(out).__name__}; it must return str or None")
        if out is None:
            stats.dropped[fp] += 1
        elif out != p.text:
            stats.changed[fp] += 1
        yield replace(p, text=out)
    if next(outputs, _END) is not _END:
        raise RuntimeError(f"document transform {fp!r} returned more outputs than it was given")


# ---- tokens -----------------------------------------------------------------------------------
def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def tokenizer_fingerprint(tokenizer) -> str:
    """What decides the token ids: the tokenizer's full definition, its EOS and the library version."""
    import tokenizers

    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow (Python) tokenizer: its vocabulary and class stand for it
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(f"{type(tokenizer).__name__}|{tokenizer.eos_token_id}|{len(tokenizer)}|{tokenizers.__version__}".encode())
    return h.hexdigest()


class Progress:
    """Rank 0's heartbeat for the waiting ranks (a small JSON file) and a log line every 30 s."""

    def __init__(self, path: Path, nonce: str, total_bytes: int):
        self.path, self.nonce, self.total, self.beats = path, nonce, total_bytes, 0
        self.t0 = self.last_beat = self.last_log = time.monotonic()

    def __call__(self, stats: CorpusStats, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_beat >= 2.0:
            self.last_beat, self.beats = now, self.beats + 1
            write_json(self.path, {"nonce": self.nonce, "beat": self.beats, "files": stats.files,
                                    "bytes": stats.bytes, "tokens": sum(stats.tokens.values())})
        if now - self.last_log >= 30.0:
            self.last_log = now
            log.info("tokenizing site text: %d file(s), %.1f of %.1f MB, %d tokens, %.1f MB/s", stats.files,
                     stats.bytes / 1e6, self.total / 1e6, sum(stats.tokens.values()),
                     stats.bytes / 1e6 / max(now - self.t0, 1e-9))


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


def build_tokens(files: Sequence[tuple[Path, str | None]], tokenizer, out_dir: Path, *, text_field: str,
                 val_fraction: float, transforms: Sequence[DocumentTransform] = (),
                 piece_chars: int = PIECE_CHARS, progress: Callable[[CorpusStats], None] | None = None) -> dict:
    """Tokenize `files` into `out_dir/{train,val}.tokens`, streaming; returns the index (also the
    content of `out_dir/index.json`, written last)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the model's tokenizer has no EOS token, which separates documents; "
                        "set eos_token in tokenizer_config.json")
    dtype = token_dtype(len(tokenizer))
    stats = CorpusStats()
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    sinks = {s: (out_dir / f"{s}.tokens").open("wb") for s in ("train", "val")}
    eos_arr = np.asarray([eos], dtype=dtype)
    pending: list[Piece] = []
    open_doc = {"train": False, "val": False}  # tokens of the current document written, EOS owed

    def flush() -> None:
        texts = [p.text for p in pending if p.text]
        ids = iter(tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                             return_token_type_ids=False, verbose=False)["input_ids"] if texts else [])
        for p in pending:
            if p.text:
                arr = np.asarray(next(ids), dtype=dtype)
                sinks[p.split].write(arr.tobytes())
                stats.tokens[p.split] += len(arr)
                open_doc[p.split] = open_doc[p.split] or len(arr) > 0
            if p.last and open_doc[p.split]:
                sinks[p.split].write(eos_arr.tobytes())
                stats.tokens[p.split] += 1
                open_doc[p.split] = False
        pending.clear()

    try:
        size = 0
        for piece in apply_transforms(read_pieces(files, text_field, val_fraction, stats, piece_chars), transforms,
                                      stats):
            pending.append(piece)
            size += len(piece.text or "")
            if size >= BATCH_CHARS:
                flush()
                size = 0
            if progress is not None:
                progress(stats)
        flush()
    finally:
        for f in sinks.values():
            f.close()
    seconds = time.perf_counter() - t0
    reports = {t.fingerprint: t.report() for t in transforms if callable(getattr(t, "report", None))}
    index = {"version": FORMAT_VERSION, "dtype": dtype.str, "eos_id": int(eos),
             "splits": {s: {"file": f"{s}.tokens", "tokens": int(stats.tokens[s]),
                            "documents": int(stats.split_documents[s])} for s in ("train", "val")},
             "stats": stats.to_json(), "transform_reports": reports, "build_s": round(seconds, 3)}
    write_json(out_dir / "index.json", index)
    return index


# ---- the cache --------------------------------------------------------------------------------
class PackedSequences(Dataset):
    """Sequences of `seq_len + 1` token ids (int64 tensors) over a memory-mapped token stream.

    Sequence i is tokens[i*seq_len : i*seq_len + seq_len + 1]. The file is mapped lazily in the
    process that reads it (pickles without the mapping), and only the pages of the sequences read
    are touched.
    """

    def __init__(self, path: Path, dtype: str, tokens: int, seq_len: int):
        self.path, self.dtype, self.tokens, self.seq_len = Path(path), np.dtype(dtype), int(tokens), int(seq_len)
        self._map: np.memmap | None = None

    def __len__(self) -> int:
        return max(0, (self.tokens - 1) // self.seq_len)

    def __getitem__(self, index: int) -> torch.Tensor:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"sequence {index} of {n}")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.tokens,))
        start = index * self.seq_len
        return torch.from_numpy(self._map[start:start + self.seq_len + 1].astype(np.int64))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_map": None}


@dataclass(frozen=True)
class TokenCache:
    """A complete cache directory: its index and a dataset per split."""

    path: Path
    index: dict

    @staticmethod
    def open(path: Path) -> "TokenCache":
        """Open and check a cache (index present, files of the size it says); DataError if not."""
        try:
            index = json.loads((path / "index.json").read_text())
        except (OSError, ValueError) as err:
            raise DataError(f"token cache {path} is unreadable ({err}); delete it to rebuild") from None
        if index.get("version") != FORMAT_VERSION:
            raise DataError(f"token cache {path} has format {index.get('version')}, this code reads "
                            f"{FORMAT_VERSION}; delete it to rebuild")
        item = np.dtype(index["dtype"]).itemsize
        for split, info in index["splits"].items():
            expected = [(info["file"], info["tokens"] * item)]
            expected += [(a["file"], a["count"] * np.dtype(a["dtype"]).itemsize)  # chat data: labels, documents
                         for a in info.get("arrays", {}).values()]
            for name, size in expected:
                f = path / name
                if not f.is_file() or f.stat().st_size != size:
                    raise DataError(f"token cache {path}: {split} tokens are damaged ({f}); delete the directory to "
                                    "rebuild")
        return TokenCache(path, index)

    def sequences(self, split: str, seq_len: int) -> PackedSequences:
        info = self.index["splits"][split]
        return PackedSequences(self.path / info["file"], self.index["dtype"], info["tokens"], seq_len)


def cache_key(files: Sequence[tuple[Path, str | None]], tokenizer_fp: str, settings: dict) -> str:
    """Content hash of the files (and their paths and roles), the tokenizer and the settings."""
    h = hashlib.sha256()
    h.update(json.dumps({"version": FORMAT_VERSION, "tokenizer": tokenizer_fp, "settings": settings},
                        sort_keys=True).encode())
    for path, split in files:
        h.update(f"\n{path}|{split}|{path.stat().st_size}|{file_digest(path)}".encode())
    return h.hexdigest()[:24]


def _prune(root: Path, keep: Path) -> None:
    """Remove all but the `KEEP_CACHES` newest complete caches (always keeping `keep`), and stale
    temporary directories of builds that did not finish."""
    done = sorted((p for p in root.iterdir() if (p / "index.json").is_file()),
                  key=lambda p: (p / "index.json").stat().st_mtime, reverse=True)
    for old in [p for p in done if p != keep][KEEP_CACHES - 1:]:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob("*.tmp-*"):
        if time.time() - tmp.stat().st_mtime > 24 * 3600:
            shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class Corpus:
    """What to tokenize, and how: the inputs of `prepare`."""

    files: list[tuple[Path, str | None]]  # (file, "train" | "val" | None: split by val_fraction)
    text_field: str = "text"
    val_fraction: float = 0.0
    transforms: Sequence[DocumentTransform] = ()
    piece_chars: int = PIECE_CHARS

    def settings(self) -> dict:
        """What decides the cache's content besides the files and the tokenizer: part of its key."""
        return {"text_field": self.text_field, "val_fraction": self.val_fraction, "piece_chars": self.piece_chars,
                "transforms": [t.fingerprint for t in self.transforms]}

    def build(self, tokenizer, out_dir: Path, progress: Callable[[CorpusStats], None] | None = None) -> dict:
        """Tokenize into `out_dir` (a fresh directory); returns the index. Other formats (chat data,
        site_trainer/chat_data.py) override this and `settings`."""
        return build_tokens(self.files, tokenizer, out_dir, text_field=self.text_field,
                            val_fraction=self.val_fraction, transforms=self.transforms, piece_chars=self.piece_chars,
                            progress=progress)


def prepare(corpus: Corpus, tokenizer, workdir: Path, stall_s: float = 300.0) -> TokenCache:
    """The site's token cache for `corpus`, built once per site. Collective when torch.distributed is
    initialised with several ranks (every rank of the site calls it); otherwise builds directly."""
    root = Path(workdir) / CACHE_DIR
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
    rank = torch.distributed.get_rank() if distributed else 0
    key, cache, nonce, problem = None, None, uuid.uuid4().hex, None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            key = cache_key(corpus.files, tokenizer_fingerprint(tokenizer), corpus.settings())
            cache = _reuse(root / key)
        except OSError as err:  # told to every rank below, so that none waits for a build that never comes
            problem = f"rank 0 cannot prepare the token cache in {root}: {err}"
    if distributed:
        msg = [key, cache is not None, nonce, problem]
        torch.distributed.broadcast_object_list(msg, src=0)
        key, ready, nonce, problem = msg
    if problem:
        raise DataError(problem)
    if distributed:
        _check_shared(root, nonce, rank)
        if rank != 0:
            cache = TokenCache.open(root / key) if ready else _wait(root, key, nonce, stall_s, rank)
    if cache is None:
        cache = _build(corpus, tokenizer, root, key, nonce)
    _restore_reports(corpus.transforms, cache.index)
    return cache


def _restore_reports(transforms: Sequence[DocumentTransform], index: dict) -> None:
    """Give each transform that asks (`restore_report(report)`) the report its build stored, on every
    rank, whether this run built the cache or reused one (so the transform need not have run)."""
    stored = index.get("transform_reports", {})
    for t in transforms:
        restore = getattr(t, "restore_report", None)
        if callable(restore):
            restore(stored.get(t.fingerprint))


def _reuse(path: Path) -> TokenCache | None:
    """The complete cache at `path`, or None (a damaged one is removed, to be rebuilt)."""
    if not (path / "index.json").is_file():
        return None
    try:
        cache = TokenCache.open(path)
    except DataError as err:
        log.warning("%s", err)
        shutil.rmtree(path, ignore_errors=True)
        return None
    log.info("token cache %s reused: %s", path, _summary(cache.index))
    return cache


def _summary(index: dict) -> str:
    s, st = index["splits"], index["stats"]
    bad = sum(st["bad_lines"].values())
    chat = ""
    if index.get("format") == "chat":
        chat = (f"; {sum(st.get('targets', {}).values()):,} completion token(s), "
                f"{sum(st.get('truncated', {}).values())} conversation(s) cut at {index.get('max_tokens')} tokens")
        if bad:
            chat += "; bad rows by reason: " + ", ".join(f"{r}: {n}" for r, n in sorted(st["bad_lines"].items()))
    return (f"{st['files']} file(s), {st['documents']} document(s), {s['train']['tokens']:,} train and "
            f"{s['val']['tokens']:,} validation tokens; {bad} bad line(s), {st['undecodable_bytes']} undecodable "
            f"byte(s), {st['empty_documents']} empty document(s), dropped by transforms: {st['dropped'] or 0}{chat}")


def _check_shared(root: Path, nonce: str, rank: int) -> None:
    """Collective: every rank must see rank 0's files; refuse together, naming the fix, if one cannot."""
    probe = root / f".probe-{nonce}"
    if rank == 0:
        with contextlib.suppress(OSError):  # a failed write shows as a rank that cannot see it
            probe.write_text(socket.gethostname())
    torch.distributed.barrier()
    seen = torch.tensor([1 if probe.is_file() else 0])
    torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.barrier()
    if rank == 0:
        probe.unlink(missing_ok=True)
    if not int(seen.item()):
        raise DataError(f"some ranks of this site cannot see the files rank 0 writes in {root} (this is host "
                        f"{socket.gethostname()}, rank {rank}): the nodes of a site must share a writable workdir, "
                        "as for local checkpoints; give every node the same --workdir on shared storage")


def _build(corpus: Corpus, tokenizer, root: Path, key: str, nonce: str) -> TokenCache:
    target = root / key
    tmp = root / f"{key}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    error = root / f"{key}.error"
    error.unlink(missing_ok=True)
    total = sum(p.stat().st_size for p, _ in corpus.files)
    progress = Progress(root / f"{key}.progress", nonce, total)
    log.info("tokenizing %d file(s), %.1f MB, into %s", len(corpus.files), total / 1e6, target)
    progress(CorpusStats(), force=True)
    try:
        corpus.build(tokenizer, tmp, progress)
        if target.exists():  # a leftover that failed its check
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        write_json(error, {"nonce": nonce, "error": f"{type(err).__name__}: {err}"})
        raise
    finally:
        (root / f"{key}.progress").unlink(missing_ok=True)
    cache = TokenCache.open(target)
    log.info("token cache %s built in %.1fs: %s", target, cache.index["build_s"], _summary(cache.index))
    _prune(root, target)
    return cache


def _wait(root: Path, key: str, nonce: str, stall_s: float, rank: int) -> TokenCache:
    """A rank other than 0: wait for rank 0's cache; fail on its error or after `stall_s` without progress."""
    target, error, beat = root / key, root / f"{key}.error", root / f"{key}.progress"
    last_change, last_seen, last_log = time.monotonic(), None, time.monotonic()
    while True:
        if (target / "index.json").is_file():
            return TokenCache.open(target)
        try:
            failed = json.loads(error.read_text())
        except (OSError, ValueError):
            failed = None
        if failed and failed.get("nonce") == nonce:
            raise DataError(f"rank 0 could not build the token cache: {failed.get('error')}")
        try:
            seen = beat.read_text()
        except OSError:
            seen = None
        now = time.monotonic()
        if seen != last_seen:
            last_seen, last_change = seen, now
        if now - last_change > stall_s:
            raise DataError(f"rank {rank}: rank 0 made no progress on the token cache {target} for {stall_s:.0f}s "
                            "(its heartbeat file stopped changing); check rank 0's log, or raise cache_stall_s "
                            "for a slow document transform")
        if now - last_log >= 60.0:
            last_log = now
            log.info("rank %d: waiting for rank 0's token cache (%s)", rank, seen or "starting")
        time.sleep(0.2)
