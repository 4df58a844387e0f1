"""How an update travels inside a signed (and maybe sealed) envelope, both halves of the format.

The envelope covers the whole payload: the arrays are laid out back to back in one buffer whose
layout and metadata travel inside the signed header (`inner`), so nothing about an update is
unauthenticated. The site packs (site/protection_mod.py), the coordinator unpacks
(coordinator/envelope_opener.py); the layout is checked before any array is viewed, so hostile
bytes become an `UpdateRejected`, never objects or reads past the buffer.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np

from crypto.envelope import Envelope
from federation.protocol.codecs import Arrays
from federation.protocol.pipeline import Payload, UpdateRejected

ARRAY = "envelope"  # the payload array holding the envelope body
HEADER, SIGNATURE = "envelope_header", "envelope_signature"  # payload meta fields
_ALLOWED_KINDS = set("fiub")  # numeric and bool dtypes only; never objects
_MAX_DIMS = 32
_DTYPE = re.compile(r"[<>|=][fiub][1248]")  # a plain numeric dtype's .str


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def pack(arrays: Arrays) -> tuple[np.ndarray, list]:
    """All arrays back to back in one uint8 buffer, and the layout to find them again."""
    layout, offset = [], 0
    for name, a in arrays.items():
        layout.append([name, a.dtype.str, list(a.shape), offset])
        offset += a.nbytes
    buf = np.empty(offset, dtype=np.uint8)
    for (name, _, _, off), a in zip(layout, arrays.values()):
        buf[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return buf, layout


def unpack(buf: np.ndarray, layout: list) -> Arrays:
    """The arrays `pack` laid out, as views of `buf`; UpdateRejected if the layout is unusable."""
    return {name: buf[off:off + math.prod(shape) * dt.itemsize].view(dt).reshape(shape)
            for name, dt, shape, off in checked_layout(layout, len(buf))}


def checked_layout(layout: list, size: int) -> list[tuple[str, np.dtype, tuple[int, ...], int]]:
    """(name, dtype, shape, offset) of each array of a signed layout over a `size`-byte payload,
    checked as `unpack` checks it (UpdateRejected "malformed"): for a payload read from a file."""
    out = []
    try:
        for name, dtype, shape, off in layout:
            # only what `pack` writes ('<f4', '|u1', ...): numpy parses other strings with ast (SyntaxError)
            dt = np.dtype(dtype) if isinstance(dtype, str) and _DTYPE.fullmatch(dtype) else None
            if dt is None or dt.kind not in _ALLOWED_KINDS or dt.hasobject or dt.subdtype is not None:
                raise ValueError(f"dtype {str(dtype)[:40]} not allowed")
            if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(_is_count(d) for d in shape)
                    and _is_count(off)):
                raise ValueError(f"{str(name)[:40]} has no valid shape and offset")
            n = math.prod(shape) * dt.itemsize  # Python ints: a huge shape cannot wrap to a small size
            if off + n > size:
                raise ValueError(f"{name} runs past the payload")
            out.append((str(name), dt, tuple(shape), off))
    except (TypeError, ValueError) as err:
        raise UpdateRejected("malformed", f"signed payload layout is unusable: {err}") from None
    return out


def inner(payload: Payload) -> tuple[np.ndarray, bytes]:
    """Site: the buffer to envelope and the metadata to sign with it (layout + payload meta)."""
    buf, layout = pack(payload.arrays)
    return buf, json.dumps({"layout": layout, "meta": payload.meta}, separators=(",", ":")).encode()


def from_inner(buf: np.ndarray, signed_meta: bytes) -> Payload:
    """Coordinator: the payload `inner` packed, from an opened envelope's buffer and signed meta."""
    layout, meta = signed_layout(signed_meta)
    return Payload(unpack(buf, layout), meta)


def signed_layout(signed_meta: bytes) -> tuple[list, dict]:
    """(layout, payload meta) of an envelope's signed metadata (UpdateRejected "malformed")."""
    try:
        doc = json.loads(signed_meta)
        return doc["layout"], dict(doc.get("meta", {}))
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise UpdateRejected("malformed", f"signed metadata is not the expected JSON: {err}") from None


def as_payload(env: Envelope) -> Payload:
    """An envelope as the payload that goes on the wire."""
    body = np.frombuffer(env.body, dtype=np.uint8) if isinstance(env.body, bytes) else np.asarray(env.body)
    return Payload({ARRAY: body}, {HEADER: env.header, SIGNATURE: env.signature})


def envelope_of(payload: Payload) -> Envelope:
    """The envelope a wire payload carries; UpdateRejected("unsigned") when it carries none."""
    try:
        header, signature, body = payload.meta[HEADER], payload.meta[SIGNATURE], payload.arrays[ARRAY]
    except KeyError as err:
        raise UpdateRejected("unsigned", f"update carries no signed envelope (missing {err})") from None
    if not isinstance(header, bytes) or not isinstance(signature, bytes):  # bytes(2**40) would allocate 1 TiB
        raise UpdateRejected("malformed", f"envelope header and signature must be bytes, got "
                             f"{type(header).__name__} and {type(signature).__name__}")
    if body.dtype != np.uint8 or body.ndim != 1:
        raise UpdateRejected("malformed", f"envelope body must be 1-D uint8, got {body.dtype} {body.shape}")
    return Envelope(header, signature, body)
