"""Optional local NER for names and places: a spaCy pipeline or a Hugging Face token classifier.

Nothing is downloaded, ever: the model is a directory on the site (`ner_model`). A NER detector
has no trigger (names have no cheap shape), so it reads whole documents and sets the corpus
throughput: a CPU spaCy `sm` model runs at roughly 0.1-1 MB/s per core, a transformer far
slower. That is the price of PERSON/LOCATION, which is why they are off by default.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .detector import Detector, Span

# model label -> our entity type (spaCy's OntoNotes and WikiNER schemes, CoNLL-style HF models)
LABELS = {"PER": "PERSON", "PERSON": "PERSON", "LOC": "LOCATION", "GPE": "LOCATION", "FAC": "LOCATION",
          "LOCATION": "LOCATION"}
CHUNK = 20_000  # characters per NER call; split at whitespace so no entity is cut


class NerModelError(ValueError):
    """The configured NER model cannot be used; the message says what to do."""


def model_kind(path: Path) -> str:
    """'spacy' or 'hf' from the directory's files."""
    if not path.exists():
        raise NerModelError(f"ner_model {path} does not exist on this site: copy the model directory there "
                            f"(nothing is downloaded) or remove PERSON/LOCATION from pii.entities")
    if not path.is_dir():
        raise NerModelError(f"ner_model {path} is a file: give the model's directory")
    if (path / "config.cfg").exists() or (path / "meta.json").exists():
        return "spacy"
    cfg = path / "config.json"
    if cfg.exists():
        try:
            data = json.loads(cfg.read_text())
        except ValueError as e:
            raise NerModelError(f"ner_model {path}: config.json is not JSON ({e})") from e
        if data.get("id2label") or any("TokenClassification" in a for a in data.get("architectures") or ()):
            return "hf"
    raise NerModelError(f"ner_model {path} is neither a spaCy pipeline (config.cfg or meta.json, as written by "
                        f"nlp.to_disk) nor a Hugging Face token-classification directory (config.json with id2label)")


def model_digest(path: Path) -> str:
    """Identifies the model's files (names, sizes, small files' bytes): enters cache keys."""
    h = hashlib.sha256()
    for p in sorted(x for x in path.rglob("*") if x.is_file()):
        st = p.stat()
        h.update(f"{p.relative_to(path)}\0{st.st_size}\0".encode())
        if st.st_size <= 1 << 20:
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def chunks(text: str, size: int = CHUNK):
    """(offset, piece) pairs covering text, cut at whitespace."""
    pos, n = 0, len(text)
    while pos < n:
        end = min(n, pos + size)
        if end < n:
            cut = max(text.rfind(" ", pos, end), text.rfind("\n", pos, end))
            end = cut + 1 if cut > pos else end
        yield pos, text[pos:end]
        pos = end


class NerDetector(Detector):
    """Whole-document detector for one or more entity types of one model."""

    trigger = None
    rank = 0

    def __init__(self, path: Path, entities: tuple[str, ...], kind: str):
        self.path, self.entities, self.kind = path, entities, kind
        self.entity = "+".join(entities)
        self.version = f"{kind}:{model_digest(path)}"
        self._runner = None  # the model loads on first use: building a scrubber stays cheap

    def load(self) -> None:
        if self._runner is None:
            self._runner = _spacy_runner(self.path) if self.kind == "spacy" else _hf_runner(self.path)

    def _run(self, text: str):
        self.load()
        return self._runner(text)

    def fingerprint(self) -> str:
        return f"ner:{self.kind}:{','.join(self.entities)}:{self.version}"

    def find(self, text: str) -> list[Span]:
        out = []
        for off, piece in chunks(text):
            for start, end, label, score in self._run(piece):
                ent = LABELS.get(label.upper().removeprefix("B-").removeprefix("I-"))
                if ent in self.entities and end > start:
                    out.append(Span(off + start, off + end, ent, score))
        return out


def _spacy_runner(path: Path):
    import spacy

    try:
        nlp = spacy.load(path)
    except (OSError, ValueError) as e:
        raise NerModelError(f"ner_model {path}: spaCy cannot load it ({e})") from e
    if not any(n.endswith("ner") or "ruler" in n for n in nlp.pipe_names):
        raise NerModelError(f"ner_model {path}: the spaCy pipeline has no entity recognizer "
                            f"(components: {nlp.pipe_names})")
    return lambda text: [(e.start_char, e.end_char, e.label_, 0.85) for e in nlp(text).ents]


def _hf_runner(path: Path):
    from transformers import AutoModelForTokenClassification, AutoTokenizer, pipeline

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForTokenClassification.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise NerModelError(f"ner_model {path}: transformers cannot load it locally ({e})") from e
    pipe = pipeline("token-classification", model=model, tokenizer=tok, aggregation_strategy="simple", device=-1)
    limit = tok.model_max_length if tok.model_max_length < 100_000 else 512
    max_chars = max(64, (limit - 2) // 2)  # at most 2 tokens per character, so no chunk is truncated

    def run(text: str):
        out = []
        for off, piece in chunks(text, max_chars):
            for r in pipe(piece):
                out.append((off + int(r["start"]), off + int(r["end"]), str(r["entity_group"]), float(r["score"])))
        return out

    return run


def load_ner(path: Path | None, entities: tuple[str, ...]) -> list[Detector]:
    if path is None:
        raise NerModelError(f"{list(entities)} need ner_model (a local spaCy or Hugging Face directory)")
    path = Path(path).expanduser()
    return [NerDetector(path, entities, model_kind(path))]
