"""The coordinator's checkpoints: one directory per completed round, atomic, checked, no pickle.

    checkpoints/round_0007/
        model.safetensors       arrays, one file per group (model, optimizer, downlink, ...)
        optimizer.safetensors
        state.json              everything else the next round needs (JSON, no pickle)
        manifest.json           format, round, and the SHA-256 and size of every other file

A checkpoint is written under a temporary name (`.tmp-round_0007-<id>/`), every file and the
directory fsynced, then renamed into place and the parent directory fsynced: a reader sees a
whole checkpoint or none, whatever the moment of a crash. On load the manifest is checked file by
file; a checkpoint that is truncated, corrupted or incomplete is reported with what is wrong and
the previous one is used. Only the newest `keep` checkpoints stay on disk.

Arrays go through safetensors (a JSON header and raw little-endian bytes) and everything else
through JSON: loading a checkpoint never runs code, unlike a pickle (or OpenFL's pickled state).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from crypto.durable import fsync_path, write_synced
from federation.protocol.codecs import Arrays

FORMAT = 1
MANIFEST = "manifest.json"
STATE = "state.json"
DEFAULT_KEEP = 3
_NAME = re.compile(r"^round_(\d{4,})$")
_GROUP = re.compile(r"^[a-z][a-z0-9_]*$")


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected, or one that cannot be written; the text says why."""


class CorruptCheckpoint(CheckpointError):
    """One checkpoint failed its checks (missing file, size or SHA-256 mismatch, bad JSON)."""


@dataclass
class Checkpoint:
    """A loaded, verified checkpoint."""

    round: int
    path: Path
    arrays: dict[str, Arrays]  # group -> name -> array
    state: dict
    skipped: list[str] = field(default_factory=list)  # newer checkpoints passed over, with the reason


def checkpoint_name(rnd: int) -> str:
    """The directory name of round `rnd`'s checkpoint."""
    return f"round_{rnd:04d}"


def _write_file(path: Path, data: bytes) -> dict:
    """Write and fsync one file; its manifest entry."""
    write_synced(path, data)
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def encode_arrays(arrays: Mapping[str, np.ndarray]) -> bytes:
    """safetensors bytes of named numeric arrays (object arrays and the like are refused)."""
    out = {}
    for name, arr in arrays.items():
        a = np.asarray(arr)
        if a.dtype.kind not in "fiub":
            raise CheckpointError(f"array {name!r} has dtype {a.dtype}: checkpoints hold numeric arrays only")
        out[name] = np.asarray(a, order="C")  # not ascontiguousarray: it makes a 0-dim array 1-dim
    return st_save(out)


_ST_DTYPES = {"f2": "F16", "f4": "F32", "f8": "F64", "i1": "I8", "i2": "I16", "i4": "I32", "i8": "I64",
              "u1": "U8", "u2": "U16", "u4": "U32", "u8": "U64", "b1": "BOOL"}
# safetensors' own order of the tensors in a file: by dtype, this rank descending, then by name
_ST_RANK = {c: i for i, c in enumerate(("BOOL", "U8", "I8", "I16", "U16", "F16", "I32", "U32", "F32", "F64",
                                        "I64", "U64"))}


def write_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> dict:
    """`encode_arrays`' file written tensor by tensor, never as one buffer of the model's size (the
    coordinator's memory at scale): the safetensors layout (8-byte header length, JSON
    header padded with spaces to 8 bytes, the tensors' bytes in the header's order, which is
    safetensors' own: by dtype, then name), the same bytes as `encode_arrays`, fsynced; its manifest
    entry."""
    named = {}
    for name, arr in arrays.items():
        a = np.asarray(arr)
        code = _ST_DTYPES.get(a.dtype.str[1:]) if a.dtype.byteorder in "<|=" else None
        if a.dtype.kind not in "fiub" or code is None:
            return _write_file(path, encode_arrays(arrays))  # what only safetensors' encoder knows (or refuses)
        named[name] = (a, code)
    order = sorted(named, key=lambda k: (-_ST_RANK[named[k][1]], k))
    header, offset = {}, 0
    for name in order:
        a, code = named[name]
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for part in (len(text).to_bytes(8, "little"), text):
            f.write(part)
            digest.update(part)
        for name in order:
            a = np.asarray(named[name][0], order="C")  # a copy only of a tensor that is not contiguous
            view = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
            f.write(view)
            digest.update(view)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "bytes": 8 + len(text) + offset}


class CheckpointStore:
    """The checkpoints of one run: write atomically, keep the newest `keep`, load the newest good one."""

    def __init__(self, directory: Path, keep: int = DEFAULT_KEEP, log: Callable[[str], None] | None = None):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory, self.keep = Path(directory), keep
        self.log = log or (lambda line: None)

    def path(self, rnd: int) -> Path:
        """Where round `rnd`'s checkpoint lives (whether or not it exists)."""
        return self.directory / checkpoint_name(rnd)

    def rounds(self) -> list[int]:
        """Rounds that have a checkpoint directory, newest first (not yet verified)."""
        if not self.directory.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.directory.iterdir() if p.is_dir())
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    # ---- writing -----------------------------------------------------------------------------
    def save(self, rnd: int, arrays: Mapping[str, Mapping[str, np.ndarray]], state: dict) -> Path:
        """Write round `rnd`'s checkpoint (array groups + JSON state), atomically; prune old ones."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".tmp-{checkpoint_name(rnd)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            files = {}
            for group, named in arrays.items():
                if not _GROUP.match(group):
                    raise CheckpointError(f"bad array group name {group!r}")
                files[f"{group}.safetensors"] = write_arrays(tmp / f"{group}.safetensors", named)
            files[STATE] = _write_file(tmp / STATE, json.dumps(state, sort_keys=True).encode())
            # safetensors stores names sorted; the order is part of a model (sites check it)
            order = {group: list(named) for group, named in arrays.items()}
            manifest = {"format": FORMAT, "round": rnd, "files": files, "order": order}
            _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            fsync_path(tmp)
            final = self.path(rnd)
            if final.exists():  # a round redone after its checkpoint was found unusable
                old = self.directory / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            fsync_path(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune()
        return final

    def prune(self) -> None:
        """Keep the newest `keep` checkpoints; remove leftovers of interrupted writes."""
        for rnd in self.rounds()[self.keep:]:
            shutil.rmtree(self.path(rnd), ignore_errors=True)
        for p in self.directory.iterdir():
            if p.name.startswith((".tmp-", ".old-")) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)

    # ---- reading -----------------------------------------------------------------------------
    def load(self, rnd: int) -> Checkpoint:
        """Round `rnd`'s checkpoint, verified against its manifest; CorruptCheckpoint says what is wrong."""
        return read_checkpoint(self.path(rnd))

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that passes its checks, None if there is no checkpoint at all.

        A newer one that fails is logged (what is wrong, which one is used instead) and listed in
        `skipped`; if every checkpoint fails, CheckpointError names each one and why."""
        skipped: list[str] = []
        for rnd in self.rounds():
            try:
                ckpt = self.load(rnd)
            except CorruptCheckpoint as err:
                skipped.append(f"{checkpoint_name(rnd)}: {err}")
                self.log(f"checkpoint {checkpoint_name(rnd)} is unusable ({err}); trying the previous one")
                continue
            if skipped:
                self.log(f"using checkpoint {checkpoint_name(rnd)} instead of the newer, unusable "
                         f"{', '.join(s.split(':')[0] for s in skipped)}")
            ckpt.skipped = skipped
            return ckpt
        if skipped:
            raise CheckpointError(f"no usable checkpoint in {self.directory}: " + "; ".join(skipped))
        return None


def read_checkpoint(path: Path) -> Checkpoint:
    """Load and verify one checkpoint directory (manifest, sizes, SHA-256, then parse)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpoint("no manifest.json (an incomplete write)") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CorruptCheckpoint(f"manifest.json is not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpoint(f"manifest.json is not a format-{FORMAT} manifest")
    blobs: dict[str, bytes] = {}
    for name, entry in manifest["files"].items():
        if "/" in name or name.startswith(".") or not isinstance(entry, dict):
            raise CorruptCheckpoint(f"manifest.json lists a bad entry {name!r}")
        try:
            data = (path / name).read_bytes()
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{name} is missing") from None
        if len(data) != entry.get("bytes"):
            raise CorruptCheckpoint(f"{name} has {len(data)} bytes, the manifest says {entry.get('bytes')} (truncated?)")
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise CorruptCheckpoint(f"{name}: SHA-256 does not match the manifest (corrupted)")
        blobs[name] = data
    if STATE not in blobs:
        raise CorruptCheckpoint("the manifest lists no state.json")
    try:
        state = json.loads(blobs.pop(STATE))
        arrays = {name.removesuffix(".safetensors"): st_load(data) for name, data in blobs.items()
                  if name.endswith(".safetensors")}
        order = manifest.get("order", {})
        arrays = {group: {k: named[k] for k in order.get(group, sorted(named))} for group, named in arrays.items()}
    except Exception as err:  # verified bytes that still do not parse: a writer bug, not a crash here
        raise CorruptCheckpoint(f"checked files do not parse ({type(err).__name__}: {err})") from None
    rnd = manifest.get("round")
    if not isinstance(rnd, int) or (_NAME.match(path.name) and int(_NAME.match(path.name).group(1)) != rnd):
        raise CorruptCheckpoint(f"manifest round {rnd!r} does not match the directory {path.name}")
    return Checkpoint(rnd, path, arrays, state)


# ---- the global model alone (tests, examples, tools) ---------------------------------------------
def save_checkpoint(directory: Path, rnd: int, model: Arrays, opt_state: Arrays, keep: int = DEFAULT_KEEP) -> Path:
    """A checkpoint of only the model and the optimizer state (tools and tests)."""
    return CheckpointStore(directory, keep).save(rnd, {"model": model, "optimizer": opt_state}, {"round": rnd})


def load_checkpoint(path: Path) -> tuple[int, Arrays, Arrays]:
    """(round, model, optimizer state) of a checkpoint directory, or of the newest good one in a
    checkpoints directory."""
    path = Path(path)
    ckpt = read_checkpoint(path) if (path / MANIFEST).exists() or _NAME.match(path.name) else CheckpointStore(path).latest()
    if ckpt is None:
        raise CheckpointError(f"no checkpoint in {path}")
    return ckpt.round, ckpt.arrays.get("model", {}), ckpt.arrays.get("optimizer", {})
