"""The coordinator's half of the envelope stage: verify (and unseal) each site's update.

A bad signature, an unknown or revoked site, a replayed round, a wrong federation or run, or a
tampered ciphertext becomes an `UpdateRejected` with its own reason, which the round counts.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from crypto.envelope import EnvelopeError, ReplayGuard, open_envelope, open_envelope_stream
from crypto.pki import CoordinatorBundle
from federation.protocol.envelope_layout import checked_layout, envelope_of, from_inner, signed_layout
from federation.protocol.pipeline import Payload, RoundContext, UpdateRejected


def _mapping_of(body: object) -> mmap.mmap | None:
    """The file map under an envelope body (a reply resolved from the data path), if any."""
    while isinstance(body, np.ndarray) and body.base is not None:
        body = body.base
    obj = body.obj if isinstance(body, memoryview) else body
    return obj if isinstance(obj, mmap.mmap) else None


def _dropper(mm: mmap.mmap | None):
    """`done_with` for open_envelope_stream: the pages of a mapped upload already read leave this
    process's memory (they are re-read from the file if ever touched again)."""
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    page = mmap.PAGESIZE

    def drop(lo: int, hi: int) -> None:
        lo -= lo % page
        if hi > lo:
            try:
                mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, ValueError):  # a closed map, or a kernel without it: only memory is at stake
                pass
    return drop


class PageDropper:
    """Drops the pages under a read-only array that views a mapped upload (no-op otherwise): called
    on each piece of a reply once it is read, so a large reply's file pages never add up in this
    process's memory."""

    def __init__(self) -> None:
        self._bases: dict[int, tuple[mmap.mmap, int]] = {}

    def __call__(self, arr: np.ndarray) -> None:
        mm = _mapping_of(arr)
        if mm is None or not arr.nbytes or not hasattr(mmap, "MADV_DONTNEED"):
            return
        key = id(mm)
        if key not in self._bases:
            self._bases[key] = (mm, np.frombuffer(mm, np.uint8).ctypes.data)
        mm, base = self._bases[key]
        lo = arr.ctypes.data - base
        if 0 <= lo and lo + arr.nbytes <= len(mm):
            _dropper(mm)(lo, lo + arr.nbytes)


class CoordinatorProtection:
    """`Stage` that opens envelopes with the coordinator's bundle; one replay guard per run, so a
    (run, round, site) envelope opens once."""

    name = "protection"

    def __init__(self, bundle: CoordinatorBundle, require_sealed: bool, replay: ReplayGuard):
        self.bundle, self.require_sealed, self.replay = bundle, require_sealed, replay
        self.trust = bundle.trust()

    def encode(self, payload: Payload, ctx: RoundContext) -> Payload:
        """Not the coordinator's job: sites seal (site/protection_mod.py)."""
        raise NotImplementedError("the coordinator does not send updates")

    def decode(self, payload: Payload, ctx: RoundContext) -> Payload:
        """The payload the site sealed, once its envelope verified as `ctx.site`'s for this round."""
        env = envelope_of(payload)
        try:
            opened = open_envelope(env, trust=self.trust, federation_id=self.bundle.federation_id,
                                   run_id=ctx.run_id, round=ctx.round, replay=self.replay,
                                   recipient_key=self.bundle.seal_key, require_sealed=self.require_sealed)
        except EnvelopeError as err:
            raise UpdateRejected(err.reason, str(err)) from None
        if opened.header.site != ctx.site:
            raise UpdateRejected("wrong_site", f"envelope signed by {opened.header.site!r}, sent by {ctx.site!r}")
        return from_inner(opened.payload, opened.header.meta)

    def decode_to_file(self, payload: Payload, ctx: RoundContext, path: Path) -> tuple[list, dict]:
        """`decode`, with the verified payload written to `path` chunk by chunk instead of held:
        (checked layout of the arrays in the file, payload meta). What the file holds is
        authentic only when this returns; on UpdateRejected the caller discards it."""
        env = envelope_of(payload)
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            def sink(offset: int, data: memoryview) -> None:
                while len(data):
                    done = os.pwrite(fd, data, offset)
                    data, offset = data[done:], offset + done

            header = open_envelope_stream(
                env, sink, trust=self.trust, federation_id=self.bundle.federation_id, run_id=ctx.run_id,
                round=ctx.round, replay=self.replay, recipient_key=self.bundle.seal_key,
                require_sealed=self.require_sealed, done_with=_dropper(_mapping_of(env.body)))
        except EnvelopeError as err:
            raise UpdateRejected(err.reason, str(err)) from None
        finally:
            os.close(fd)
        if header.site != ctx.site:
            raise UpdateRejected("wrong_site", f"envelope signed by {header.site!r}, sent by {ctx.site!r}")
        layout, meta = signed_layout(header.meta)
        return checked_layout(layout, header.payload_len), meta
