"""A party's audit log: append-only JSON lines, each entry chained to the one before by hash and
signed with the party's provisioned Ed25519 key.

One line per entry, ``{"i", "t", "kind", "fields", "prev", "sig"}``: `i` counts from 0, `prev` is
the hash of entry i-1 (`GENESIS` for entry 0), `sig` the Ed25519 signature over the entry's
canonical JSON without `sig`, and an entry's hash is SHA-256 over its canonical JSON with `sig`,
so a head (index, hash) names one exact history and who signed it. Entry 0 (`log_opened`) holds
the party, its role and its public key; every later entry must verify under that key.

Writers in several processes (a site's ClientApp is one process per message) append under an
exclusive `flock`; each append reads the current head from the file's tail, never from memory.
A writer killed mid-line leaves one torn last line: the next writer cuts it off and records what
it cut (`torn_tail`: offset, bytes, their SHA-256) as its first entry, so the gap is in the chain.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from crypto.pki.keys import canonical_json, public_key_fingerprint, raw_public

LOG_NAME = "audit.jsonl"
GENESIS = "0" * 64
OPENED = "log_opened"


class AuditLogError(RuntimeError):
    """The log cannot be written as asked (another party's log, a corrupt last line)."""


@dataclass(frozen=True)
class Head:
    """Where a log stands: its last entry's index and hash (index -1: empty)."""

    index: int
    hash: str

    def as_dict(self) -> dict:
        """The head as record fields."""
        return {"index": self.index, "hash": self.hash}


def log_path(where: str | Path) -> Path:
    """The log file of a workdir (or `where` itself when it names a file)."""
    p = Path(where)
    return p if p.suffix == ".jsonl" or p.is_file() else p / LOG_NAME


def signed_bytes(entry: dict) -> bytes:
    """What an entry's signature covers: the entry without `sig`."""
    return canonical_json({k: v for k, v in entry.items() if k != "sig"})


def entry_hash(entry: dict) -> str:
    """The entry's hash (its signature included): what the next entry's `prev` and a head hold."""
    return hashlib.sha256(canonical_json(entry)).hexdigest()


def key_of(entry: dict) -> ed25519.Ed25519PublicKey:
    """The public key an opening entry names."""
    return ed25519.Ed25519PublicKey.from_public_bytes(base64.b64decode(entry["fields"]["public_key"]))


def digest_of(data: bytes | str | dict | list) -> str:
    """``sha256:<hex>`` of bytes, text or a JSON value (canonical form): the digests entries hold."""
    if isinstance(data, (dict, list)):
        data = canonical_json(data)
    if isinstance(data, str):
        data = data.encode()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def split_tail(data: bytes) -> tuple[bytes, bytes]:
    """(whole lines, torn rest): the bytes after the last newline are a line whose write never ended."""
    cut = data.rfind(b"\n") + 1
    return data[:cut], data[cut:]


def _last_line(f) -> tuple[bytes, int, int]:
    """(the last whole line, the offset where whole lines end, the file's size), read from the tail."""
    size = f.seek(0, os.SEEK_END)
    pos, buf = size, b""
    while pos > 0:
        step = min(4096, pos)
        pos -= step
        f.seek(pos)
        buf = f.read(step) + buf
        whole, _ = split_tail(buf)
        if whole.count(b"\n") >= 2 or (pos == 0 and whole):
            break
    whole, torn = split_tail(buf)
    end = size - len(torn)
    lines = whole.rstrip(b"\n").split(b"\n")
    return (lines[-1] if whole else b""), end, size


class AuditLog:
    """The party's log at `path`, opened (entry 0 written) if it is new. `opening`: fields of the
    opening entry (federation, CA fingerprint, ...). A log opened by another key is refused."""

    def __init__(self, path: str | Path, key: ed25519.Ed25519PrivateKey, party: str, role: str,
                 opening: dict | None = None):
        self.path, self.key = log_path(path), key
        self.public = raw_public(key.public_key())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked() as f:
            first = f.readline()
            if not first.endswith(b"\n"):  # new, or torn within its first line: start over
                if first:
                    f.truncate(0)
                self._write(f, GENESIS, -1, OPENED, {"party": party, "role": role,
                                                     "public_key": base64.b64encode(self.public).decode(),
                                                     "key_fingerprint": public_key_fingerprint(key.public_key()),
                                                     **(opening or {})})
                return
            try:
                opened = json.loads(first)
                theirs = base64.b64decode(opened["fields"]["public_key"])
            except (ValueError, KeyError, TypeError) as err:
                raise AuditLogError(f"{self.path}: entry 0 is not an opening entry ({err})") from None
            if theirs != self.public:
                raise AuditLogError(f"{self.path} is the log of another key "
                                    f"({opened['fields'].get('party')!r}); this party's key cannot continue it")

    def _locked(self):
        """The file, opened for reading and appending, under an exclusive lock."""
        return _Locked(self.path)

    def _entry(self, prev: str, last: int, kind: str, fields: dict) -> tuple[bytes, Head]:
        entry: dict[str, Any] = {"i": last + 1, "t": round(time.time(), 6), "kind": kind, "fields": fields,
                                 "prev": prev}
        entry["sig"] = base64.b64encode(self.key.sign(signed_bytes(entry))).decode()
        return canonical_json(entry) + b"\n", Head(entry["i"], entry_hash(entry))

    def _write(self, f, prev: str, last: int, kind: str, fields: dict) -> Head:
        line, head = self._entry(prev, last, kind, fields)
        self._write_lines(f, line)
        return head

    def append(self, kind: str, **fields: Any) -> Head:
        """Append one entry; the log's new head."""
        return self.extend([(kind, fields)])

    def extend(self, entries: list[tuple[str, dict]]) -> Head:
        """Append `entries` (kind, fields) in one write; the log's new head. A torn last line is cut
        off and recorded first."""
        with self._locked() as f:
            line, end, size = _last_line(f)
            if not line:
                raise AuditLogError(f"{self.path} holds no opening entry")
            try:
                last = json.loads(line)
                head = Head(int(last["i"]), entry_hash(last))
            except (ValueError, KeyError, TypeError) as err:
                raise AuditLogError(f"{self.path}: its last entry does not parse ({err}); "
                                    "run `sovfl audit verify` on it") from None
            if size > end:  # a writer died mid-line: cut it off, and say so in the chain
                f.seek(end)
                torn = f.read()
                f.truncate(end)
                entries = [("torn_tail", {"offset": end, "bytes": len(torn), "digest": digest_of(torn)}), *entries]
            out = []
            for kind, fields in entries:
                text, head = self._entry(head.hash, head.index, kind, fields)
                out.append(text)
            if out:
                self._write_lines(f, b"".join(out))
            return head

    @staticmethod
    def _write_lines(f, data: bytes) -> None:
        f.seek(0, os.SEEK_END)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())

    def head(self) -> Head:
        """The log's current head."""
        with self._locked() as f:
            line, _, _ = _last_line(f)
        last = json.loads(line)
        return Head(int(last["i"]), entry_hash(last))


class _Locked:
    """The log file opened read-write under an exclusive `flock`, released on exit."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.f = os.fdopen(fd, "r+b")
        fcntl.flock(self.f.fileno(), fcntl.LOCK_EX)
        return self.f

    def __exit__(self, *exc) -> None:
        try:
            fcntl.flock(self.f.fileno(), fcntl.LOCK_UN)
        finally:
            self.f.close()
