"""The SecAgg+ messages on Flower's Message API, both halves of the format.

  stage  message  coordinator -> site (SECAGG record)          site -> coordinator
  1      query    round context, config (JSON)                 SECAGG: public keys (advert bytes)
  2      query    the neighbours' adverts, + `relayed`: their  SECAGG: Shamir shares of b_u and s_u,
                  advert signatures                            sealed to each neighbour
  3      train    the global model + CONFIG (as in a plain     SECAGG_CHUNKS: one uint32 Array per
                  round) + SECAGG: the envelopes addressed to  masked chunk, keyed by its word offset
                  this site, its `weight`, `vector_len`        (4 bytes per parameter), + SECAGG
  4      query    survivors / dropped neighbours               SECAGG: seed shares of survivors, key
                                                               shares of dropped neighbours

Every request record holds: stage, round, run (the SecAgg round context's run id,
"<federation>/<flower run id>"), graph_seed (32 bytes), config (the SecAggConfig as JSON) and, from
stage 2 on, request (the crypto library's request bytes). Replies echo stage, round and ctx (the
SHA-256 of the round context), carry `data` (stages 1, 2, 4) and, from a site with a bundle,
`sig_header` + `sig`: its Ed25519 signature over the content (stage 3: the manifest of its chunks).
The coordinator writes requests and reads replies (coordinator/secagg_round.py); the site reads
requests and writes replies (site/secagg_mod.py). numpy + flwr + crypto only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import ConfigRecord, Message

import crypto.secagg as secagg
from crypto.secagg import MalformedMessageError, ReplayedMessageError
from crypto.secagg.signing import Signature
from federation.protocol import message_keys as keys

OFFSET_DIGITS = 12  # chunk Array keys: the chunk's word offset, zero-padded (at most twice that here)


def context_run_id(federation: str, flower_run_id: int) -> str:
    """The SecAgg round context's run id: binds keys and messages to this federation and Flower run."""
    return f"{federation}/{int(flower_run_id)}"


# ---- coordinator -> site --------------------------------------------------------------------------
def request_record(stage: int, ctx: secagg.RoundContext, config_json: str, request: bytes = b"",
                   **extra) -> ConfigRecord:
    """The SECAGG record of a stage's request to one site."""
    return ConfigRecord({"stage": stage, "round": ctx.round, "run": ctx.run_id, "graph_seed": ctx.graph_seed,
                         "config": config_json, "request": request, **extra})


@dataclass(frozen=True)
class Request:
    """A SECAGG request as the site reads it, checked to belong to this Flower run."""

    stage: int
    ctx: secagg.RoundContext
    config_json: str
    request: bytes
    record: ConfigRecord

    @classmethod
    def parse(cls, msg: Message) -> "Request":
        """The request of `msg`, or a SecAggMessageError naming what is wrong with it."""
        rec = msg.content.config_records.get(keys.SECAGG)
        if rec is None:
            raise MalformedMessageError(f"no '{keys.SECAGG}' record in the message")
        try:
            stage, rnd, run = int(rec["stage"]), int(rec["round"]), str(rec["run"])
            seed, config, request = rec["graph_seed"], str(rec["config"]), rec.get("request", b"")
            if not isinstance(seed, bytes) or not isinstance(request, bytes):
                raise TypeError("graph_seed and request must be bytes")
            ctx = secagg.RoundContext(run, rnd, seed)
        except (KeyError, TypeError, ValueError) as err:
            raise MalformedMessageError(f"secagg request is malformed ({type(err).__name__}: {err})") from None
        if stage not in keys.STAGE_NAMES:
            raise MalformedMessageError(f"unknown secagg stage {stage}")
        if not run.endswith(f"/{int(msg.metadata.run_id)}"):
            raise ReplayedMessageError(f"secagg request for run {run!r}, this is Flower run {msg.metadata.run_id}")
        return cls(stage, ctx, config, request, rec)


def chunk_key(offset: int) -> str:
    """The SECAGG_CHUNKS key of the chunk starting at word `offset`."""
    return f"{offset:0{OFFSET_DIGITS}d}"


# ---- site -> coordinator --------------------------------------------------------------------------
def reply_record(req: Request, sig: Signature | None, **extra) -> ConfigRecord:
    """The SECAGG record of a site's reply to `req`, signed when `sig` is given."""
    rec = ConfigRecord({"stage": req.stage, "round": req.ctx.round, "ctx": req.ctx.digest(), **extra})
    if sig is not None:
        rec["sig_header"], rec["sig"] = sig.header, sig.signature
    return rec


def check_reply(reply: Message, stage: int, ctx: secagg.RoundContext) -> ConfigRecord:
    """The reply's SECAGG record, if it answers this stage of this round; else a SecAggMessageError."""
    rec = reply.content.config_records.get(keys.SECAGG)
    if rec is None:
        raise MalformedMessageError(f"stage-{stage} reply without a '{keys.SECAGG}' record")
    try:
        if not isinstance(rec["ctx"], bytes):
            raise TypeError("ctx must be bytes")
        got = (int(rec["stage"]), int(rec["round"]), rec["ctx"])
    except (KeyError, TypeError, ValueError) as err:
        raise MalformedMessageError(f"stage-{stage} reply record is malformed ({type(err).__name__}: {err})") from None
    if got != (stage, ctx.round, ctx.digest()):
        raise ReplayedMessageError(f"reply made for stage {got[0]} of round {got[1]} (or another run), "
                                   f"expected stage {stage} of round {ctx.round}")
    return rec


def reply_bytes(rec: ConfigRecord) -> bytes:
    """The `data` of a stage-1, -2 or -4 reply."""
    data = rec.get("data")
    if not isinstance(data, bytes):
        raise MalformedMessageError("reply record has no 'data' bytes")
    return data


def signature_of(rec: ConfigRecord) -> Signature | None:
    """The reply's signature fields, None when it has none."""
    header, sig = rec.get("sig_header"), rec.get("sig")
    if header is None and sig is None:
        return None
    if not isinstance(header, bytes) or not isinstance(sig, bytes):
        raise MalformedMessageError("reply signature fields sig_header / sig are not bytes")
    return Signature(header, sig)


def parse_chunks(reply: Message, length: int, bits: int) -> list[tuple[int, np.ndarray]]:
    """All masked chunks of a stage-3 reply, validated before any is added to the sum.

    They must be 1-D uint32 arrays, keyed by their word offset, that tile [0, length) exactly with
    words inside Z_2^bits: a site's vector is added whole or not at all (a partial one could not
    be taken out of the sum again)."""
    rec = reply.content.array_records.get(keys.SECAGG_CHUNKS)
    if rec is None:
        raise MalformedMessageError(f"stage-3 reply without a '{keys.SECAGG_CHUNKS}' array record")
    chunks = []
    for key, arr in rec.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 2 * OFFSET_DIGITS):
            raise MalformedMessageError(f"masked chunk key {key!r} is not a word offset")
        if arr.dtype != "uint32" or len(arr.shape) != 1:
            raise MalformedMessageError(f"masked chunk {key} is {arr.dtype} {tuple(arr.shape)}, expected 1-D uint32")
        try:
            words = arr.numpy()
        except Exception as err:  # hostile bytes: whatever numpy raises while parsing them
            raise MalformedMessageError(f"masked chunk {key} does not parse ({type(err).__name__})") from None
        if words.dtype != np.uint32 or words.ndim != 1 or words.shape[0] == 0:
            raise MalformedMessageError(f"masked chunk {key} holds {words.dtype} {words.shape}")
        chunks.append((int(key), words))
    chunks.sort(key=lambda c: c[0])
    pos = 0
    for off, words in chunks:
        if off != pos:
            raise MalformedMessageError(f"masked chunks leave a gap or overlap at word {min(off, pos)}")
        pos += words.shape[0]
        if bits < 32 and int(words.max()) >> bits:
            raise MalformedMessageError(f"masked chunk at {off} holds words outside Z_2^{bits}")
    if pos != length:
        raise MalformedMessageError(f"masked chunks cover {pos} words, the round's vector has {length}")
    return chunks
