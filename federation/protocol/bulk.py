"""The bulk data path, what both ends share: blobs, their chunk digests, and references to them.

Flower carries control; tensors of SLM size travel on the project's own channel (a gRPC service of
the coordinator, mutual TLS with the provisioned certificates: coordinator/bulk_server.py and
site/bulk_client.py). Every Array of a message at least `INLINE_MAX` bytes long leaves the Flower
message: the data of all of them, concatenated in record order, is one *blob*, and each Array is
replaced by a small reference Array (stype `REF_STYPE`, data the JSON of its place in the blob).
The receiving end fetches the blob and puts views of it back, so everything above this layer
(codecs, envelopes, SecAgg chunks, the downlink model) is unchanged and every check it makes on
the bytes (signatures, seals, SecAgg signatures) still runs on the bytes that arrived.

A blob is cut into `CHUNK` byte chunks, each with its own SHA-256; the blob's name (`root`) is the
SHA-256 of its size, chunk size and chunk digests. Chunks can therefore travel on several streams
at once, in any order, be checked one by one as they land, and a broken transfer resumes with the
chunks still missing. Hashing runs on a thread pool (hashlib releases the GIL on large buffers).
The reference is part of the message the site signs (or masks and signs), so a stream that does
not hash to it is refused, and bytes that hash to it but are not what the site signed fail the
signature above this layer.

numpy-free and torch-free: the ClientApp imports it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from flwr.app import Array, ArrayRecord, RecordDict

from federation.protocol.pipeline import UpdateRejected

CHUNK = 4 << 20  # bytes per chunk: one gRPC message, one digest
INLINE_MAX = 1 << 20  # Arrays smaller than this stay in the Flower message (measured: benchmarks/large_update.py)
REF_STYPE = "sovfl.bulk-ref/1"
MAX_BLOB = 1 << 40  # 1 TiB: a bound a hostile header cannot exceed (the disk is the real one)
_DOMAIN = b"sovfl-bulk-blob-v1"
_DIGEST_WINDOW = 8  # chunks hashed at once (a file-backed blob reads them: 32 MiB in memory)


class BulkRefused(UpdateRejected):
    """A transfer or a reference is refused; `reason` is a stable code (counted as `bulk_<code>`)."""

    def __init__(self, code: str, detail: str):
        super().__init__(f"bulk_{code}", detail)
        self.code = code


def chunk_count(size: int, chunk: int = CHUNK) -> int:
    """How many chunks a blob of `size` bytes has (at least one, so an empty blob has a digest)."""
    return max(1, -(-size // chunk))


def chunk_len(size: int, index: int, chunk: int = CHUNK) -> int:
    """The length of chunk `index` of a blob of `size` bytes."""
    return max(0, min(chunk, size - index * chunk))


def root_of(size: int, chunk: int, digests: list[bytes]) -> str:
    """The blob's name: SHA-256 over its size, chunk size and chunk digests (hex)."""
    h = hashlib.sha256(_DOMAIN)
    h.update(size.to_bytes(8, "big") + chunk.to_bytes(8, "big"))
    for d in digests:
        h.update(d)
    return h.hexdigest()


def _sha(buf) -> bytes:
    return hashlib.sha256(buf).digest()


_POOL: ThreadPoolExecutor | None = None


def hash_pool() -> ThreadPoolExecutor:
    """One pool per process for chunk digests (hashlib frees the GIL on buffers over 2 KiB)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="bulk-hash")
    return _POOL


def digests_of(pieces: list) -> list[bytes]:
    """SHA-256 of every piece, in parallel."""
    if len(pieces) <= 1:
        return [_sha(p) for p in pieces]
    return list(hash_pool().map(_sha, pieces))


class Blob:
    """Buffers that travel as one blob, chunked without copying them (a chunk that straddles two
    buffers is the only copy made)."""

    def __init__(self, buffers: list, chunk: int = CHUNK):
        self.buffers = [memoryview(b).cast("B") for b in buffers]
        self.chunk = chunk
        self.size = sum(len(b) for b in self.buffers)
        self.count = chunk_count(self.size, chunk)
        self._starts = []
        pos = 0
        for b in self.buffers:
            self._starts.append(pos)
            pos += len(b)
        self._digests: list[bytes] | None = None
        self._fd: int | None = None
        self.path: str | None = None

    def piece(self, index: int):
        """Chunk `index`: a view into one buffer, or a copy of the parts of several (read from the
        file once spilled)."""
        lo = index * self.chunk
        hi = lo + chunk_len(self.size, index, self.chunk)
        if self._fd is not None:
            return os.pread(self._fd, hi - lo, lo)
        parts = []
        for start, buf in zip(self._starts, self.buffers):
            end = start + len(buf)
            if end <= lo or start >= hi:
                continue
            parts.append(buf[max(lo, start) - start:min(hi, end) - start])
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    @classmethod
    def of_file(cls, path: str, chunk: int = CHUNK) -> "Blob":
        """The blob a file holds, its chunks read from the file when asked for (the site's sealed
        update: never in memory whole). `close()` deletes the file."""
        fd = os.open(path, os.O_RDONLY)
        blob = cls([], chunk)
        blob.size = os.fstat(fd).st_size
        blob.count = chunk_count(blob.size, chunk)
        blob._fd, blob.path = fd, path
        return blob

    @property
    def digests(self) -> list[bytes]:
        """The chunk digests (computed once, `_DIGEST_WINDOW` chunks at a time: a blob served from
        a file never has more than that many chunks in memory)."""
        if self._digests is None:
            out: list[bytes] = []
            for lo in range(0, self.count, _DIGEST_WINDOW):
                out += digests_of([self.piece(i) for i in range(lo, min(self.count, lo + _DIGEST_WINDOW))])
            self._digests = out
        return self._digests

    @property
    def root(self) -> str:
        """The blob's name."""
        return root_of(self.size, self.chunk, self.digests)

    def spill(self, path: str) -> None:
        """Write the blob to `path` and serve its chunks from there: the buffers are let go, so a
        blob offered for a whole stage (the model) costs the page cache, not the process's memory.
        Digests are computed first, from the buffers."""
        self.digests  # noqa: B018 (computed from the buffers while they are here)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for i in range(self.count):
                os.pwrite(fd, self.piece(i), i * self.chunk)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self._fd, self.path, self.buffers = fd, path, []

    @classmethod
    def written(cls, fd: int, path: str, size: int, chunk: int, digests: list[bytes]) -> "Blob":
        """The blob `BlobWriter` wrote to `path` (open as `fd`), served from there."""
        blob = cls([], chunk)
        blob.size, blob.count = size, chunk_count(size, chunk)
        blob._fd, blob.path, blob._digests = fd, path, digests
        return blob

    def close(self) -> None:
        """Delete the spilled file (chunks can no longer be read)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = None


def _hash_and_write(fd: int, offset: int, parts: list) -> bytes:
    """One chunk, given as the pieces of buffers it spans: written at `offset`, its SHA-256."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
        view = part
        while len(view):
            done = os.pwrite(fd, view, offset)
            view, offset = view[done:], offset + done
    return h.digest()


class BlobWriter:
    """Writes a blob to a file from buffers given one after another (the model, tensor by tensor),
    taking the chunk digests as it goes: a window of `_DIGEST_WINDOW` chunks is hashed and written
    at once on the hash pool, so what is held is that window's views into the caller's buffers,
    never the blob. `finish()` gives the `Blob`, served from the file; the same blob, chunk for
    chunk and digest for digest, as `Blob(buffers).spill(path)` makes: the coordinator never
    serializes the whole model to offer it."""

    def __init__(self, path: str, chunk: int = CHUNK):
        self.path, self.chunk = path, chunk
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.size = 0
        self.digests: list[bytes] = []
        self._parts: list = []  # the chunk being filled: views of the buffers it spans
        self._fill = 0
        self._window: list[tuple[int, list]] = []  # full chunks not written yet: (offset, parts)

    def write(self, buf) -> None:
        """Append `buf` (any buffer): its full chunks are on disk when this returns, the tail that
        starts the next chunk is copied (at most one chunk)."""
        view = memoryview(buf).cast("B")
        while len(view):
            take = min(len(view), self.chunk - self._fill)
            self._parts.append(view[:take])
            self._fill += take
            self.size += take
            view = view[take:]
            if self._fill == self.chunk:
                self._window.append((self.size - self.chunk, self._parts))
                self._parts, self._fill = [], 0
                if len(self._window) >= _DIGEST_WINDOW:
                    self._flush()
        self._flush()
        if self._parts:  # the caller may reuse or free `buf` once this returns: keep a copy of the short tail
            self._parts = [b"".join(self._parts)]

    def _flush(self) -> None:
        if not self._window:
            return
        window, self._window = self._window, []
        if len(window) == 1:
            self.digests.append(_hash_and_write(self.fd, *window[0]))
        else:
            self.digests += list(hash_pool().map(lambda w: _hash_and_write(self.fd, *w), window))

    def finish(self) -> Blob:
        """The blob written (the last, short chunk included), served from the file."""
        if self._parts or not self.digests:  # a short last chunk; an empty blob has one empty chunk
            self._window.append((self.size - self._fill, self._parts))
            self._parts, self._fill = [], 0
        self._flush()
        return Blob.written(self.fd, self.path, self.size, self.chunk, self.digests)

    def abort(self) -> None:
        """Close and delete the file (a write failed)."""
        try:
            os.close(self.fd)
        finally:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def check_manifest(root: str, size: int, chunk: int, digests: list[bytes]) -> None:
    """That `digests` (from the other end) are the chunk digests of the blob named `root`."""
    if not (0 <= size <= MAX_BLOB) or not (64 << 10 <= chunk <= 64 << 20):
        raise BulkRefused("bad_manifest", f"size {size} or chunk size {chunk} out of range")
    if len(digests) != chunk_count(size, chunk) or any(len(d) != 32 for d in digests):
        raise BulkRefused("bad_manifest", f"{len(digests)} chunk digests for a blob of {chunk_count(size, chunk)} chunks")
    if root_of(size, chunk, digests) != root:
        raise BulkRefused("bad_manifest", "the chunk digests do not hash to the blob's name")


# ---- references in Flower messages ------------------------------------------------------------
@dataclass(frozen=True)
class Ref:
    """Where one Array's data lies in a blob."""

    root: str
    size: int
    chunk: int
    offset: int
    length: int
    stype: str

    def encode(self) -> bytes:
        """The reference as the data of its Array."""
        return json.dumps({"root": self.root, "size": self.size, "chunk": self.chunk, "offset": self.offset,
                           "length": self.length, "stype": self.stype}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data) -> "Ref":
        """A reference from another party's bytes, checked (BulkRefused `ref_malformed`)."""
        try:
            d = json.loads(bytes(data[:4096]).decode())
            ref = cls(str(d["root"]), int(d["size"]), int(d["chunk"]), int(d["offset"]), int(d["length"]),
                      str(d["stype"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError, OverflowError) as err:
            raise BulkRefused("ref_malformed", f"unreadable reference ({type(err).__name__})") from None
        if (len(ref.root) != 64 or any(c not in "0123456789abcdef" for c in ref.root) or not 0 <= ref.size <= MAX_BLOB
                or ref.offset < 0 or ref.length < 0 or ref.offset + ref.length > ref.size):
            raise BulkRefused("ref_malformed", f"reference outside its blob ({ref.offset}+{ref.length} of {ref.size})")
        return ref


def _big(rd: RecordDict, inline_max: int) -> Iterator[tuple[str, str, Array]]:
    for rkey, rec in rd.array_records.items():
        for akey, arr in rec.items():
            if arr.stype != REF_STYPE and len(arr.data) >= inline_max:
                yield rkey, akey, arr


def big_records(rd: RecordDict, inline_max: int = INLINE_MAX) -> dict[str, ArrayRecord]:
    """The ArrayRecords of `rd` with an Array that would leave the message."""
    keys = dict.fromkeys(rkey for rkey, _, _ in _big(rd, inline_max))
    return {k: rd.array_records[k] for k in keys}


def has_big(rd: RecordDict, inline_max: int = INLINE_MAX) -> bool:
    """Whether any Array of `rd` would leave the message."""
    return next(_big(rd, inline_max), None) is not None


def offload(rd: RecordDict, inline_max: int = INLINE_MAX, chunk: int = CHUNK) -> tuple[Blob, RecordDict] | None:
    """The blob of `rd`'s large Arrays and a copy of `rd` with references in their place (`rd` itself
    is left as it is, so another message may still carry it inline); None if nothing is large."""
    big = list(_big(rd, inline_max))
    if not big:
        return None
    blob = Blob([arr.data for _, _, arr in big], chunk)
    root, out, offset = blob.root, RecordDict(), 0
    replaced: dict[str, dict[str, Array]] = {}
    for rkey, akey, arr in big:
        ref = Ref(root, blob.size, chunk, offset, len(arr.data), arr.stype)
        offset += len(arr.data)
        replaced.setdefault(rkey, {})[akey] = Array(dtype=arr.dtype, shape=tuple(arr.shape), stype=REF_STYPE,
                                                    data=ref.encode())
    for key, rec in rd.items():
        if key in replaced:
            out[key] = ArrayRecord({k: replaced[key].get(k, a) for k, a in rec.items()})
        else:
            out[key] = rec
    return blob, out


def refs(rd: RecordDict) -> dict[str, list[tuple[str, str, Ref]]]:
    """root -> the (record, array, reference) of every reference Array in `rd` (BulkRefused)."""
    found: dict[str, list[tuple[str, str, Ref]]] = {}
    for rkey, rec in rd.array_records.items():
        for akey, arr in rec.items():
            if arr.stype == REF_STYPE:
                ref = Ref.decode(arr.data)
                found.setdefault(ref.root, []).append((rkey, akey, ref))
    for root, entries in found.items():
        if len({(r.size, r.chunk) for _, _, r in entries}) != 1:
            raise BulkRefused("ref_malformed", f"references to blob {root[:12]} disagree on its size")
    return found


def ref_bytes(rd: RecordDict) -> int:
    """Bytes the references of `rd` stand for (what the data path moves for this message); 0 when a
    reference is unreadable (the receiving end refuses it)."""
    try:
        return sum(r.length for entries in refs(rd).values() for _, _, r in entries)
    except BulkRefused:
        return 0


def resolve(rd: RecordDict, fetch: Callable[[Ref], object]) -> int:
    """Put the data of every reference in `rd` back, from `fetch(ref)` (the whole blob the reference
    names, a buffer, fetched once per blob); the bytes resolved."""
    total = 0
    for root, entries in refs(rd).items():
        buf = memoryview(fetch(entries[0][2])).cast("B")
        total += len(buf)
        for rkey, akey, ref in entries:
            old = rd.array_records[rkey][akey]
            arr = Array(dtype=old.dtype, shape=tuple(old.shape), stype=ref.stype, data=b"")
            arr.data = buf[ref.offset:ref.offset + ref.length]  # a view: the blob is held once
            rd.array_records[rkey][akey] = arr
    return total
