"""The SecAgg+ messages on Flower's Message API, both halves of the format.

  record         in                           coordinator -> site               site -> coordinator
  SECAGG_SETUP   any message of round r - 1   round r's plan (members, their    `data`: the site's setup
                 (train, unmask, a prepare    channel keys), config             (mask key, commitment,
                 query) or discovery                                            sealed shares) + `advert`,
                                                                                both signed; or `error`
  SECAGG         train message of round r     stage 3: the ring, the live       SECAGG_CHUNKS: one uint8
                 (with the model and CONFIG)  neighbours' keys and envelopes,   Array per masked chunk,
                                              their advert signatures           packed at the ring's bits,
                                              (`relayed`), `weight`,            keyed by its word offset;
                                              `vector_len`                      + the signed manifest
  SECAGG         query of round r             stage 4: survivors / dropped      seed shares of survivors,
                                                                                key shares of dropped ones

Every request record holds: stage, round, run (the SecAgg round context's run id,
"<federation>/<flower run id>"), graph_seed (32 bytes), config (the SecAggConfig as JSON) and
request (the crypto library's bytes: the plan, the masked-input or the unmask request). Replies
echo stage, round and ctx (the SHA-256 of the round context), carry `data` (setup, unmask) and, from
a site with a bundle, `sig_header` + `sig`: its Ed25519 signature over the content (stage 3: the
manifest of its chunks), and for a setup `advert_sig_header` + `advert_sig` over its advert.
The coordinator writes requests and reads replies (coordinator/secagg_round.py); the site reads
requests and writes replies (site/secagg_mod.py). numpy + flwr + crypto only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import ConfigRecord, Message

import crypto.secagg as secagg
from crypto.secagg import MalformedMessageError, ReplayedMessageError, ring
from crypto.secagg.signing import Signature
from federation.protocol import message_keys as keys
from federation.protocol.payload_records import MalformedRecord, parse_array

OFFSET_DIGITS = 12  # chunk Array keys: the chunk's word offset, zero-padded (at most twice that here)


def context_run_id(federation: str, flower_run_id: int) -> str:
    """The SecAgg round context's run id: binds keys and messages to this federation and Flower run."""
    return f"{federation}/{int(flower_run_id)}"


# ---- coordinator -> site --------------------------------------------------------------------------
def request_record(stage: int, ctx: secagg.RoundContext, config_json: str, request: bytes = b"",
                   **extra) -> ConfigRecord:
    """The record of a stage's request to one site (SECAGG, or SECAGG_SETUP for stage SETUP)."""
    return ConfigRecord({"stage": stage, "round": ctx.round, "run": ctx.run_id, "graph_seed": ctx.graph_seed,
                         "config": config_json, "request": request, **extra})


@dataclass(frozen=True)
class Request:
    """A SecAgg request as the site reads it, checked to belong to this Flower run."""

    stage: int
    ctx: secagg.RoundContext
    config_json: str
    request: bytes
    record: ConfigRecord

    @classmethod
    def parse(cls, msg: Message, key: str = keys.SECAGG) -> "Request":
        """The request under `key` in `msg`, or a SecAggMessageError naming what is wrong with it."""
        rec = msg.content.config_records.get(key)
        if rec is None:
            raise MalformedMessageError(f"no '{key}' record in the message")
        try:
            stage, rnd, run = int(rec["stage"]), int(rec["round"]), str(rec["run"])
            seed, config, request = rec["graph_seed"], str(rec["config"]), rec.get("request", b"")
            if not isinstance(seed, bytes) or not isinstance(request, bytes):
                raise TypeError("graph_seed and request must be bytes")
            ctx = secagg.RoundContext(run, rnd, seed)
        except (KeyError, TypeError, ValueError, OverflowError) as err:  # OverflowError: int(inf)
            raise MalformedMessageError(f"secagg request is malformed ({type(err).__name__}: {err})") from None
        if stage not in keys.STAGE_NAMES or (stage == keys.SETUP) != (key == keys.SECAGG_SETUP):
            raise MalformedMessageError(f"secagg stage {stage} in record '{key}'")
        if not run.endswith(f"/{int(msg.metadata.run_id)}"):
            raise ReplayedMessageError(f"secagg request for run {run!r}, this is Flower run {msg.metadata.run_id}")
        return cls(stage, ctx, config, request, rec)


def chunk_key(offset: int) -> str:
    """The SECAGG_CHUNKS key of the chunk starting at word `offset`."""
    return f"{offset:0{OFFSET_DIGITS}d}"


# ---- site -> coordinator --------------------------------------------------------------------------
def reply_record(req: Request, sig: Signature | None, **extra) -> ConfigRecord:
    """The record of a site's reply to `req`, signed when `sig` is given."""
    rec = ConfigRecord({"stage": req.stage, "round": req.ctx.round, "ctx": req.ctx.digest(), **extra})
    if sig is not None:
        rec["sig_header"], rec["sig"] = sig.header, sig.signature
    return rec


def check_reply(reply: Message, stage: int, ctx: secagg.RoundContext, key: str = keys.SECAGG) -> ConfigRecord:
    """The reply's record under `key`, if it answers this stage of this round; else a SecAggMessageError."""
    rec = reply.content.config_records.get(key) if reply.has_content() else None
    if rec is None:
        raise MalformedMessageError(f"stage-{stage} reply without a '{key}' record")
    try:
        if not isinstance(rec["ctx"], bytes):
            raise TypeError("ctx must be bytes")
        got = (int(rec["stage"]), int(rec["round"]), rec["ctx"])
    except (KeyError, TypeError, ValueError, OverflowError) as err:  # OverflowError: int(inf)
        raise MalformedMessageError(f"stage-{stage} reply record is malformed ({type(err).__name__}: {err})") from None
    if got != (stage, ctx.round, ctx.digest()):
        raise ReplayedMessageError(f"reply made for stage {got[0]} of round {got[1]} (or another run), "
                                   f"expected stage {stage} of round {ctx.round}")
    return rec


def reply_bytes(rec: ConfigRecord, field: str = "data") -> bytes:
    """The `data` (or another bytes field) of a reply."""
    data = rec.get(field)
    if not isinstance(data, bytes):
        raise MalformedMessageError(f"reply record has no '{field}' bytes")
    return data


def signature_of(rec: ConfigRecord, prefix: str = "") -> Signature | None:
    """The reply's signature fields (`<prefix>sig_header`, `<prefix>sig`), None when it has none."""
    header, sig = rec.get(prefix + "sig_header"), rec.get(prefix + "sig")
    if header is None and sig is None:
        return None
    if not isinstance(header, bytes) or not isinstance(sig, bytes):
        raise MalformedMessageError(f"reply signature fields {prefix}sig_header / {prefix}sig are not bytes")
    return Signature(header, sig)


@dataclass(frozen=True)
class Chunk:
    """One masked chunk of a stage-3 reply: its word offset, its words and its bytes on the wire."""

    offset: int
    words: np.ndarray | None  # uint32, each < 2^bits (None from parse_chunks(unpack=False): `unpacked()`)
    packed: np.ndarray  # uint8, what travelled (and what the manifest hashes)
    count: int = 0  # words in the chunk
    bits: int = 32

    def unpacked(self) -> np.ndarray:
        """The chunk's words (unpacked now if parse_chunks left them packed; it checked they unpack)."""
        return self.words if self.words is not None else ring.unpack_words(self.packed, self.bits, self.count)


def parse_chunks(reply: Message, length: int, bits: int, unpack: bool = True) -> list[Chunk]:
    """All masked chunks of a stage-3 reply, validated before any is added to the sum.

    They must be 1-D uint8 arrays, keyed by their word offset, that tile [0, length) exactly, each
    holding its words packed at `bits` bits with zero padding (ring.unpack_words): a site's vector
    is added whole or not at all (a partial one could not be taken out of the sum again).
    `unpack=False`: each chunk's packing is checked (its length and zero padding: what makes
    `ring.unpack_words` fail) but its words are left packed, for the caller to unpack one chunk at a
    time (`Chunk.unpacked`): a reply's words are then never held whole beside the sum."""
    rec = reply.content.array_records.get(keys.SECAGG_CHUNKS)
    if rec is None:
        raise MalformedMessageError(f"stage-3 reply without a '{keys.SECAGG_CHUNKS}' array record")
    arrays = []
    for key, arr in rec.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 2 * OFFSET_DIGITS):
            raise MalformedMessageError(f"masked chunk key {key!r} is not a word offset")
        if arr.dtype != "uint8" or len(arr.shape) != 1:
            raise MalformedMessageError(f"masked chunk {key} is {arr.dtype} {tuple(arr.shape)}, expected 1-D uint8")
        try:
            packed = parse_array(arr, key, copy=unpack)  # checked before its claimed size is allocated; unpack=False: a view
        except MalformedRecord as err:
            raise MalformedMessageError(f"masked chunk {key} does not parse ({err.detail})") from None
        if packed.dtype != np.uint8 or packed.ndim != 1 or packed.shape[0] == 0:
            raise MalformedMessageError(f"masked chunk {key} holds {packed.dtype} {packed.shape}")
        arrays.append((int(key), packed))
    arrays.sort(key=lambda c: c[0])
    if not arrays or arrays[0][0] != 0:
        raise MalformedMessageError("masked chunks leave a gap at word 0")
    chunks = []
    for i, (off, packed) in enumerate(arrays):
        end = arrays[i + 1][0] if i + 1 < len(arrays) else length
        if end <= off or end > length:
            raise MalformedMessageError(f"masked chunks overlap or run past the vector's {length} words at word {off}")
        try:
            words = ring.unpack_words(packed, bits, end - off) if unpack else _check_packing(packed, bits, end - off)
        except ValueError as err:
            raise MalformedMessageError(f"masked chunk at {off} does not cover words [{off}, {end}) exactly: {err}") from None
        chunks.append(Chunk(off, words, packed, end - off, bits))
    return chunks


def _check_packing(packed: np.ndarray, bits: int, count: int) -> None:
    """What `ring.unpack_words` checks before it unpacks (ValueError): the length of `count` words at
    `bits` bits, and zero padding bits after the last one."""
    if packed.shape[0] != ring.packed_nbytes(count, bits):
        raise ValueError(f"{packed.shape[0]} bytes cannot hold exactly {count} words of {bits} bits")
    spare = count * bits % 8
    if spare and int(packed[-1]) >> spare:
        raise ValueError("the padding bits after the last word are not zero")
