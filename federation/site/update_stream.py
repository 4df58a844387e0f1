"""The ClientApp's large tensors as files, never whole in its memory: a site's extra memory
for a transfer is bounded by the chunk window, not by the update's size.

Down: the bulk mod writes each verified chunk of the model's blob into a file in /dev/shm
(`download_file`) and the downlink mod hands the trainer that very file: the blob is the GLOBAL
record's .npy Arrays back to back, so each tensor's raw bytes lie at a known offset in it
(`handle_in_blob`), and the trainer reads them from there.

Up: the trainer's update hand-off file is read a chunk at a time (`PackedSource`, the byte stream
`protocol/envelope_layout.pack` would build in memory), signed and sealed chunk by chunk
(`crypto/envelope_stream.py`) into a file holding the envelope body as one .npy uint8 Array
(`seal_to_file`), and the bulk mod uploads that file's chunks (`protocol/bulk.Blob.of_file`). If
the upload fails the body is read back into the Flower message (Flower's path needs it whole).
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import ClassVar
from io import BytesIO
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord

from crypto.envelope_stream import body_length, make_envelope_stream
from crypto.pki import SiteBundle
from federation.protocol.bulk import REF_STYPE, Blob, Ref
from federation.protocol.message_keys import UPDATE
from federation.protocol.envelope_layout import ARRAY, HEADER, SIGNATURE
from federation.protocol.payload_records import MalformedRecord, parse_array
from federation.protocol.pipeline import RoundContext
from site_trainer import handoff

_SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
_ALIGN = 64  # where appended arrays start in a downloaded file (as handoff.py lays out its own)


def scratch_path(tag: str, directory: str | Path | None = None) -> Path:
    """A fresh file name of this process in `directory` (default /dev/shm)."""
    base = Path(directory) if directory else (_SHM or Path(tempfile.gettempdir()))
    return base / f"sovfl-{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


# ---- down: the model's blob as a hand-off file -------------------------------------------------
@dataclass
class DownloadedBlob:
    """A blob downloaded into a file, mapped read-only (pages are read only where touched)."""

    path: str
    view: memoryview  # the whole file, for `protocol.bulk.resolve` (the Arrays' data are views of it)

    def release(self) -> None:
        """Unlink the file (views stay valid while mapped)."""
        handoff.release(self.path)


def download_file(size: int, fill) -> DownloadedBlob:
    """A fresh file of `size` bytes in /dev/shm, filled by `fill(fd)` (the bulk client writes each
    verified chunk at its place), then mapped without reading it."""
    path = scratch_path("blob")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        fill(fd)
        view = memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)) if size else memoryview(b"")
    except BaseException:
        os.close(fd)
        handoff.release(str(path))
        raise
    os.close(fd)
    return DownloadedBlob(str(path), view)


def handle_in_blob(rec, places: dict[str, tuple[str, int]]) -> handoff.Handle | None:
    """A hand-off handle onto the file the record's large Arrays were downloaded into; the small
    ones that stayed in the Flower message (under `INLINE_MAX`) are appended to that file. None if
    none was downloaded, or they lie in several files (then the caller copies). `places`: array
    key -> (file, offset of its Array data). Each Array's .npy header is checked as `parse_array`
    checks it (MalformedRecord)."""
    paths = {where[0] for key, where in places.items() if key in rec}
    if len(paths) != 1:
        return None
    path = paths.pop()
    entries, inline = [], []
    for key, arr in rec.items():
        view = parse_array(arr, key, copy=False)  # downloaded: reads the header only, the data stays in the file
        if not view.flags.c_contiguous:
            return None  # a Fortran-ordered .npy: its bytes are not the tensor's C layout
        if key in places:
            start = len(memoryview(arr.data).cast("B")) - view.nbytes
            entries.append(handoff.Entry(key, view.dtype.str, tuple(view.shape), places[key][1] + start))
        else:
            entries.append(None)
            inline.append((len(entries) - 1, key, view))
    if inline:
        fd = os.open(path, os.O_RDWR)
        try:
            end = os.fstat(fd).st_size
            for i, key, view in inline:
                end = -(-end // _ALIGN) * _ALIGN
                data, done = memoryview(view.reshape(-1).view(np.uint8)), 0
                while done < len(data):
                    done += os.pwrite(fd, data[done:], end + done)
                entries[i] = handoff.Entry(key, view.dtype.str, tuple(view.shape), end)
                end += view.nbytes
            os.ftruncate(fd, max(end, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    return handoff.Handle(path, tuple(entries))


# ---- up: the update's hand-off file, sealed into a file --------------------------------------
class PackedSource:
    """The arrays of a hand-off file as the one contiguous byte stream `envelope_layout.pack`
    lays out (in the file's order), read a range at a time."""

    def __init__(self, reader: handoff.Reader):
        self.reader = reader
        self.layout, self._spans, offset = [], [], 0
        for e in reader.handle.entries:
            self.layout.append([e.name, e.dtype, list(e.shape), offset])
            self._spans.append((offset, e.nbytes, e.name))
            offset += e.nbytes
        self.size = offset

    def read(self, offset: int, length: int) -> bytearray:
        """Bytes [offset, offset + length) of the packed stream."""
        out = bytearray(length)
        view, pos = memoryview(out), offset
        for start, n, name in self._spans:
            if pos >= offset + length:
                break
            if start + n <= pos or n == 0:
                continue
            take = min(start + n, offset + length) - pos
            self.reader.read_range(name, pos - start, view[pos - offset:pos - offset + take])
            pos += take
        if pos != offset + length:
            raise ValueError(f"packed update has {self.size} bytes; asked for [{offset}, {offset + length})")
        return out

    def signed_meta(self, meta: dict) -> bytes:
        """What `envelope_layout.inner` signs with the payload: the layout and the payload's meta."""
        return json.dumps({"layout": self.layout, "meta": meta}, separators=(",", ":")).encode()


def npy_header(nbytes: int) -> bytes:
    """The .npy header of a 1-D uint8 array of `nbytes` (what `payload_records.to_array` writes)."""
    buf = BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": (nbytes,)})
    return buf.getvalue()


@dataclass
class SealedFile:
    """The envelope of an update, its body in a file as the data of one .npy uint8 Array."""

    blob: Blob  # the file: .npy header + body
    header: bytes
    signature: bytes
    body_len: int
    record_key: ClassVar[str] = UPDATE  # the reply's record that references the file

    def records(self) -> tuple[ArrayRecord, ConfigRecord]:
        """The reply's UPDATE record (one reference to the blob) and UPDATE_META (header, signature)."""
        ref = Ref(self.blob.root, self.blob.size, self.blob.chunk, 0, self.blob.size, "numpy.ndarray")
        arr = Array(dtype="uint8", shape=(self.body_len,), stype=REF_STYPE, data=ref.encode())
        return ArrayRecord({ARRAY: arr}), ConfigRecord({HEADER: self.header, SIGNATURE: self.signature})

    def inline_records(self) -> ArrayRecord:
        """The UPDATE record with the body itself (read from the file: Flower's path needs it whole)."""
        data = bytearray(self.blob.size)
        view, done = memoryview(data), 0
        fd = os.open(self.blob.path, os.O_RDONLY)
        try:
            while done < len(data):
                n = os.preadv(fd, [view[done:]], done)
                if n <= 0:
                    raise OSError(f"sealed update file {self.blob.path} ended at byte {done}")
                done += n
        finally:
            os.close(fd)
        return ArrayRecord({ARRAY: Array(dtype="uint8", shape=(self.body_len,), stype="numpy.ndarray",
                                         data=bytes(data))})

    def close(self) -> None:
        """Delete the file."""
        self.blob.close()


def sealed_dir() -> str:
    """Where sealed updates are written: the temporary directory (on disk)."""
    return tempfile.gettempdir()


def seal_to_file(reader: handoff.Reader, bundle: SiteBundle, seal: bool, ctx: RoundContext, meta: dict | None = None,
                 directory: str | Path | None = None) -> SealedFile:
    """Sign (and seal) the update in `reader` into a file, a chunk window at a time (SealedFile).
    The file goes to `directory`, default the temporary directory (a disk: its pages are page
    cache the kernel can write back, where /dev/shm would hold another copy in memory)."""
    src = PackedSource(reader)
    body_len = body_length(src.size, _ENVELOPE_CHUNK, seal)
    head = npy_header(body_len)
    path = scratch_path(f"{bundle.name}-sealed", directory or sealed_dir())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, len(head) + body_len)
        os.pwrite(fd, head, 0)

        def write(offset: int, data) -> None:
            view, done = memoryview(data).cast("B"), 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], len(head) + offset + done)

        hbytes, signature, written = make_envelope_stream(
            src.read, src.size, write, signing_key=bundle.sign_key, federation_id=bundle.federation_id,
            run_id=ctx.run_id, round=ctx.round, site=bundle.name, meta=src.signed_meta(meta or {}),
            seal_to=bundle.coordinator_seal_public if seal else None, chunk_size=_ENVELOPE_CHUNK)
        assert written == body_len
    except BaseException:
        os.close(fd)
        handoff.release(str(path))
        raise
    os.close(fd)
    blob = Blob.of_file(str(path))
    try:
        blob.digests  # noqa: B018 (the blob's name, hashed from the file a window at a time)
    except BaseException:
        blob.close()
        raise
    return SealedFile(blob, hbytes, signature, body_len)


def reader_records(reader: handoff.Reader) -> ArrayRecord:
    """The update in `reader` as the UPDATE record `to_records` makes: each tensor read once, straight
    into its .npy bytes (one copy of the update in this process, not a mapping plus a copy)."""
    out = {}
    for e in reader.handle.entries:
        head = BytesIO()
        shape = tuple(e.shape)
        np.lib.format.write_array_header_1_0(head, {"descr": e.dtype, "fortran_order": False, "shape": shape})
        h = head.getvalue()
        data = bytearray(len(h) + e.nbytes)
        data[:len(h)] = h
        if e.nbytes:
            reader.read_range(e.name, 0, memoryview(data)[len(h):])
        out[e.name] = Array(dtype=str(np.dtype(e.dtype)), shape=shape, stype="numpy.ndarray", data=bytes(data))
    return ArrayRecord(out)


_ENVELOPE_CHUNK = 4 << 20  # crypto.envelope.DEFAULT_CHUNK, what make_envelope uses for updates


__all__ = ["DownloadedBlob", "PackedSource", "SealedFile", "MalformedRecord", "download_file", "handle_in_blob",
           "reader_records", "seal_to_file"]
