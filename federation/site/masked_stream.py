"""A SecAgg+ masked update made from the trainer's hand-off file into a file, never whole in the
ClientApp: a site's extra memory for the transfer is bounded by the chunk window.

Masking is elementwise with AES-CTR mask streams, so the update is read a slice at a time from
the trainer's file (`UpdateValues`: the values in the order the coordinator decodes them, sorted
names, bf16 words widened exactly to float32), encoded into ring words, masked, packed at the
ring's width and written chunk by chunk (`mask_to_file`), by the same crypto code that masks a
whole vector (`SecAggClient.masked_input_from`): the chunks are bit for bit those of the whole
path. The file holds each chunk's .npy bytes, as the reply's SECAGG_CHUNKS Arrays would carry
them, back to back; it is one bulk blob, and the reply's record holds one reference per chunk
(`MaskedFile.records`), so the coordinator parses it chunk by chunk
(protocol/secagg_records.parse_chunks). The signed manifest is computed on the stream.

The file's size is known before anything is masked and is reserved on disk then: once the masks
are drawn (single use) no write can run out of room half way.
"""

from __future__ import annotations

import bisect
import errno
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
from flwr.app import Array, ArrayRecord

from crypto.secagg import ChunkManifest, SecAggClient, ring
from federation.protocol.bulk import REF_STYPE, Blob, Ref
from federation.protocol.codecs import UpdateError
from federation.protocol.codecs.base import RAW_BF16, bf16_to_float32
from federation.protocol.message_keys import SECAGG_CHUNKS
from federation.protocol.secagg_records import chunk_key
from federation.site import update_stream
from federation.site.update_stream import npy_header, scratch_path
from site_trainer import handoff

_CHECK_VALUES = 1 << 22  # values per read of the finiteness pass (16 MiB of float32)


class UpdateValues:
    """The float values of the update in a hand-off file, in `UpdateSpec` order (sorted names),
    read a slice at a time: what `secagg_mod.values_vector` builds whole for an identity payload."""

    def __init__(self, reader: handoff.Reader):
        self.reader = reader
        self._spans: list[tuple[int, int, handoff.Entry]] = []  # (first value, values, entry)
        pos = 0
        for name in sorted(e.name for e in reader.handle.entries):
            e = reader.handle_entry(name)
            dt = np.dtype(e.dtype)
            if dt != RAW_BF16 and dt.kind != "f":
                raise UpdateError(f"update tensor {name!r} has dtype {dt}; updates must be floating point "
                                  "(or bfloat16 as raw <u2 words)")
            n = int(np.prod(e.shape, dtype=np.int64))
            self._spans.append((pos, n, e))
            pos += n
        self.length = pos
        self._starts = [s for s, _, _ in self._spans]
        self._out = np.empty(0, np.float32)
        self._raw = bytearray()

    def read(self, offset: int, n: int) -> np.ndarray:
        """Values [offset, offset + n) as float32: a view of one reused buffer, valid until the next call."""
        if offset < 0 or n < 0 or offset + n > self.length:
            raise ValueError(f"values [{offset}, {offset + n}) outside the update's {self.length}")
        if self._out.shape[0] < n:
            self._out = np.empty(n, np.float32)
        out = self._out[:n]
        i, pos = max(0, bisect.bisect_right(self._starts, offset) - 1), offset
        while pos < offset + n:
            start, count, e = self._spans[i]
            take = min(start + count, offset + n) - pos
            if take > 0:
                dt = np.dtype(e.dtype)
                nbytes = take * dt.itemsize
                if len(self._raw) < nbytes:
                    self._raw = bytearray(nbytes)
                raw = memoryview(self._raw)[:nbytes]
                self.reader.read_range(e.name, (pos - start) * dt.itemsize, raw)
                words = np.frombuffer(raw, dtype=dt)
                dst = out[pos - offset:pos - offset + take]
                if dt == RAW_BF16:
                    np.copyto(dst, bf16_to_float32(words))
                else:
                    np.copyto(dst, words, casting="unsafe")  # float64 -> float32, as UpdateSpec.flatten
                pos += take
            i += 1
        return out

    def check_finite(self) -> None:
        """UpdateError naming every tensor holding NaN or Inf (what `UpdateSpec.flatten` refuses):
        read once before any mask is drawn, a window at a time."""
        bad = []
        for start, count, e in self._spans:
            for lo in range(0, count, _CHECK_VALUES):
                if not np.isfinite(self.read(start + lo, min(_CHECK_VALUES, count - lo))).all():
                    bad.append(e.name)
                    break
        if bad:
            raise UpdateError(f"update tensors {bad} contain NaN or Inf (local training diverged?); "
                              "do not send this update")

    def whole(self) -> np.ndarray:
        """All values in a fresh array (test hooks only: the point of this class is not to)."""
        out = self.read(0, self.length).copy()
        self._out = np.empty(0, np.float32)
        return out


@dataclass
class MaskedFile:
    """A masked update in a file: each chunk's .npy Array bytes back to back (one bulk blob)."""

    blob: Blob
    # per chunk: its word offset, file offset, .npy bytes, packed bytes
    chunks: list[tuple[int, int, int, int]] = field(default_factory=list)
    record_key: ClassVar[str] = SECAGG_CHUNKS  # the reply's record that references the file

    @property
    def packed_bytes(self) -> int:
        """The masked words on the wire (without the .npy headers), as the coordinator counts them."""
        return sum(c[3] for c in self.chunks)

    def records(self) -> ArrayRecord:
        """SECAGG_CHUNKS with a reference to the blob in place of each chunk (the bulk mod uploads it)."""
        root = self.blob.root
        out = {}
        for word, pos, length, nbytes in self.chunks:
            ref = Ref(root, self.blob.size, self.blob.chunk, pos, length, "numpy.ndarray")
            out[chunk_key(word)] = Array(dtype="uint8", shape=(nbytes,), stype=REF_STYPE, data=ref.encode())
        return ArrayRecord(out)

    def inline_records(self) -> ArrayRecord:
        """SECAGG_CHUNKS with the chunks themselves, read from the file (Flower's path needs them whole)."""
        out = {}
        fd = os.open(str(self.blob.path), os.O_RDONLY)
        try:
            for word, pos, length, nbytes in self.chunks:
                data = os.pread(fd, length, pos)
                if len(data) != length:
                    raise OSError(f"masked update file {self.blob.path} ended before byte {pos + length}")
                out[chunk_key(word)] = Array(dtype="uint8", shape=(nbytes,), stype="numpy.ndarray", data=data)
        finally:
            os.close(fd)
        return ArrayRecord(out)

    def close(self) -> None:
        """Delete the file."""
        self.blob.close()


def chunk_layout(length: int, chunk_words: int, bits: int) -> list[tuple[int, int, bytes]]:
    """(word offset, packed bytes, .npy header) of each chunk of a ring vector of `length` words."""
    out = []
    for off in range(0, length, chunk_words):
        nbytes = ring.packed_nbytes(min(chunk_words, length - off), bits)
        out.append((off, nbytes, npy_header(nbytes)))
    return out


def reserve(path: Path, size: int) -> int:
    """A fresh file of `size` bytes with its blocks reserved (OSError: no room), as an open fd."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it: sized below
                raise
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        handoff.release(str(path))
        raise
    return fd


class MaskedWriter:
    """The file a masked update is written into, sized and reserved before masking starts."""

    def __init__(self, length: int, chunk_words: int, bits: int, tag: str, directory: str | Path | None = None):
        self.layout = chunk_layout(length, chunk_words, bits)
        self.bits = bits
        self.size = sum(len(h) + n for _, n, h in self.layout)
        self.path = scratch_path(f"{tag}-masked", directory or update_stream.sealed_dir())  # on disk, as sealed updates
        self.fd = reserve(self.path, self.size)
        self.manifest = ChunkManifest()
        self._next, self._pos = 0, 0
        self.chunks: list[tuple[int, int, int, int]] = []

    def add(self, offset: int, words: np.ndarray) -> None:
        """Pack the next chunk's words and write its .npy bytes; the manifest hashes what is written."""
        want, nbytes, head = self.layout[self._next]
        if offset != want or ring.packed_nbytes(words.shape[0], self.bits) != nbytes:
            raise ValueError(f"masked chunk at word {offset} ({words.shape[0]} words) is not the layout's "
                             f"chunk {self._next} at word {want}")
        packed = ring.pack_words(words, self.bits)
        self.manifest.add(offset, words.shape[0], packed)
        _write_all(self.fd, head, self._pos)
        _write_all(self.fd, memoryview(packed).cast("B"), self._pos + len(head))
        self.chunks.append((offset, self._pos, len(head) + nbytes, nbytes))
        self._pos += len(head) + nbytes
        self._next += 1

    def finish(self) -> MaskedFile:
        """The file as a blob (its chunk digests computed a window at a time)."""
        if self._next != len(self.layout):
            raise ValueError(f"masked update ended after {self._next} of {len(self.layout)} chunks")
        os.close(self.fd)
        self.fd = -1
        blob = Blob.of_file(str(self.path))
        try:
            blob.digests  # noqa: B018 (the blob's name, hashed from the file a window at a time)
        except BaseException:
            blob.close()
            raise
        return MaskedFile(blob, self.chunks)

    def discard(self) -> None:
        """Close and delete the file (a masking that failed)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        handoff.release(str(self.path))


def _write_all(fd: int, data, pos: int) -> None:
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], pos + done)


def writer_for(client: SecAggClient, values: UpdateValues, bits: int, tag: str,
               directory: str | Path | None = None) -> MaskedWriter:
    """The reserved file for `client`'s masked input of `values` in a `bits`-bit ring (OSError: no
    room; nothing is masked yet, so the caller can still mask in memory)."""
    return MaskedWriter(values.length + 1, client.config.chunk_words(bits), bits, tag, directory)


def mask_to_file(client: SecAggClient, request: bytes, values: UpdateValues, weight: int, writer: MaskedWriter,
                 rng: np.random.Generator | None = None) -> tuple[MaskedFile, bytes]:
    """Stage 3 of `client` on the update `values` reads, into `writer`'s file: the MaskedFile and
    the manifest to sign. The file is deleted if masking fails."""
    try:
        for offset, words in client.masked_input_from(request, values.length, values.read, weight, rng=rng):
            writer.add(offset, words)
        return writer.finish(), writer.manifest.encode()
    except BaseException:
        writer.discard()
        raise


__all__ = ["MaskedFile", "MaskedWriter", "UpdateValues", "chunk_layout", "mask_to_file", "writer_for"]
