"""Per-document results by content hash, under the scrubber's fingerprint: a re-run only scrubs
what changed, and training after `sovfl scrub` reads the scrubbed text instead of scrubbing again.

Layout: <root>/<fingerprint>/<key[:2]>/<key>.json (counts, samples: no original text) and, for a
changed document, <key>.txt (its scrubbed text). A new configuration, model or library version
gives a new fingerprint, hence a fresh directory; old ones can be deleted at will. Directories are
0700 and files 0600: scrubbed text is still the site's data. Writes are atomic (rename), so
concurrent workers and interrupted runs never leave a half-written entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

from crypto.durable import write_atomic

from .scrubber import DocResult, Sample

ENTRY_VERSION = 1


def content_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def private_dir(path: Path) -> Path:
    """mkdir -p with every directory it creates 0700."""
    missing = []
    p = Path(path)
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)
    return Path(path)


def write_private(path: Path, data: bytes) -> None:
    """Atomically write `data` to `path` as 0600, creating 0700 directories."""
    private_dir(path.parent)
    write_atomic(path, data, 0o600)


class ScrubCache:
    def __init__(self, root: Path, fingerprint: str):
        self.root = Path(root)
        self.dir = self.root / fingerprint

    def _paths(self, key: str) -> tuple[Path, Path]:
        d = self.dir / key[:2]
        return d / f"{key}.json", d / f"{key}.txt"

    def get(self, key: str, original: str | None = None) -> DocResult | None:
        """The cached result for content `key`; its text is `original` when scrubbing changed
        nothing (pass the original to get it back), the stored scrubbed text otherwise."""
        meta_p, text_p = self._paths(key)
        try:
            meta = json.loads(meta_p.read_text(encoding="utf-8"))
            if meta.get("v") != ENTRY_VERSION:
                return None
            if meta["dropped"]:
                text = None
            elif meta["changed"]:
                text = text_p.read_text(encoding="utf-8")
            else:
                text = original
        except (OSError, ValueError, KeyError):
            return None  # absent or damaged: scrub again
        return DocResult(text=text, counts=Counter(meta["counts"]), nbytes=meta["nbytes"],
                         seconds=meta["seconds"], samples=[Sample(**s) for s in meta["samples"]])

    def put(self, key: str, res: DocResult, original: str) -> None:
        meta_p, text_p = self._paths(key)
        changed = res.text is not None and res.text != original
        if changed:
            write_private(text_p, res.text.encode("utf-8", "surrogatepass"))
        meta = {"v": ENTRY_VERSION, "nbytes": res.nbytes, "seconds": res.seconds, "dropped": res.dropped,
                "changed": changed, "counts": dict(res.counts), "samples": [s.to_json() for s in res.samples]}
        write_private(meta_p, json.dumps(meta, ensure_ascii=False).encode("utf-8"))


def surrogate_key(root: Path, create: bool = True) -> bytes | None:
    """The site's secret for `action: replace` surrogates: <root>/surrogate.key, made on first use
    (0600). Deleting it changes every surrogate, hence the fingerprint and the cache directory.
    None when absent and not `create` (a dry run writes nothing)."""
    p = Path(root) / "surrogate.key"
    if not p.exists():
        if not create:
            return None
        private_dir(p.parent)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32))
            try:
                os.link(tmp, p)  # fails if another process made it first: theirs is the key
            except FileExistsError:
                pass
        finally:
            Path(tmp).unlink(missing_ok=True)
    return p.read_bytes()
