"""Fuzz adapters for federation/protocol: the records one side of a round reads from the other.

Every input is what crosses the wire: a Flower RecordDict serialized by Flower's own protobuf serde
(`recorddict_to_proto`), preceded by one *selector* byte where the receiver's side has a setting
the sender does not choose (the federation's codec, the model a site holds, the record key of a
SecAgg request, the stage a reply answers). The adapter parses the bytes as Flower's transport
does and then makes the receiver's real calls, in the order the receiving code makes them:

  update-record      coordinator, plain round (coordinator/plain_round.py: receive_update):
                     payload_records.from_records -> [CodecStage.decode with each built-in codec,
                     or envelope_layout.envelope_of for a signed update] -> wire_dtypes.to_master ->
                     pipeline.check_update (the model has a bf16 tensor that travels as <u2 words)
  codec-payload      every built-in codec's `Codec.decode` (codecs/*), on the records a site sends
  codec-spec         codecs.parse_codec of a spec string the other side chose (round config, downlink)
  envelope-layout    coordinator, after an envelope opened: envelope_layout.from_inner (signed layout
                     JSON + the opened buffer; an authenticated but hostile site controls both)
  downlink-record    site (site/downlink_mod.py: receive_global): downlink_steps.reconstruct over
                     from_records, or the dense model through from_records(copy=False)
  round-config       site: round_config.RoundConfig.from_record of the CONFIG record
  status-record      coordinator: status_record.site_name / num_examples of a reply's STATUS
  secagg-request     site: secagg_records.Request.parse (SECAGG and SECAGG_SETUP records) and the
                     SecAggConfig JSON it carries, as site/secagg_mod.py reads it
  secagg-reply       coordinator: secagg_records.check_reply, reply_bytes, signature_of (setup and
                     unmask replies) and parse_chunks (stage-3 masked chunks)

A byte string Flower's own deserializer refuses never reaches our code (the SuperLink parses the
protobuf); it counts as the rejection `flower_refused`. The structure-aware strategy edits the
parsed records (an Array's .npy bytes, its dtype and shape, a config value's type and size, keys
dropped, added and renamed) and serializes them again, so most inputs get past Flower's parse.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
from hypothesis import strategies as st

from .mutate import PROGRAM, Reader, apply_byte_program, apply_json_program, dump_json, hostile_value, mutated_bytes

# ---- wire form ------------------------------------------------------------------------------------


class FlowerRefused(ValueError):
    """Flower's deserializer refuses the bytes: the message never reaches sovereign-fl's code."""

    reason = "flower_refused"


def records_bytes(rd: Any) -> bytes:
    """A RecordDict as it travels (Flower's protobuf serde)."""
    from flwr.common import serde

    return serde.recorddict_to_proto(rd).SerializeToString(deterministic=True)


def records_of(data: bytes) -> Any:
    """The RecordDict the receiver gets from `data`, or FlowerRefused."""
    from flwr.common import serde
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    try:
        return serde.recorddict_from_proto(ProtoRecordDict.FromString(data))
    except Exception as err:  # protobuf DecodeError, Flower's own checks: whatever Flower refuses
        raise FlowerRefused(f"Flower does not deserialize these bytes ({type(err).__name__}: {err})"[:300]) from None


def _split(data: bytes, variants: Sequence[Any]) -> tuple[Any, Any]:
    if not data:
        raise FlowerRefused("empty input (no selector byte)")
    return variants[data[0] % len(variants)], records_of(data[1:])


def _message(rd: Any, run_id: int = 0, kind: str = "train") -> Any:
    """A Message carrying `rd`, as the receiver sees it (Flower run `run_id`)."""
    from flwr.app import Message
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 1, 1
    try:
        return Message(rd, dst_node_id=1, message_type=kind)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


# ---- structure-aware edits of records ---------------------------------------------------------------

INT64 = (0, 1, -1, 2, 7, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53 + 1, 2**62, 2**63 - 1,
         -(2**63), -(2**31))
DTYPES = ("<f4", "<f2", "<u2", "<i4", "<i8", "|u1", "|i1", "<f8", "|b1", ">f4", ">u2", "|O", "<U4", "|V8", "<c8",
          "<M8[s]", "float32", "uint8", "")
SHAPES: tuple[Any, ...] = ((), (0,), (1,), (3,), (-1,), (2**40,), (2**31, 2**31), (2**32, 2**32, 2**32), (5, 4),
                           (4, 5), (20,), (2**63 - 1,), (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                                            1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1))


def _scalar(r: Reader) -> Any:
    """A config value of any type a ConfigRecord holds, hostile in size or kind."""
    k = r.u() % 12
    if k == 0:
        return r.pick(INT64)
    if k == 1:
        return r.pick((float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e308, 0.5, 2.0**63))
    if k == 2:
        return r.pick(("", "identity", "steps", "full", "hold", "topk:0.25", "x" * 5000, "\x00", "0" * 30, "-1",
                       "int8:block=0", "randk:1e-300", "topk:nan", "int4:clip=inf", "a/b", "999999999999"))
    if k == 3:
        return r.raw(r.u() % 40)
    if k == 4:
        return bool(r.u() % 2)
    if k == 5:
        return [r.pick(INT64) for _ in range(r.u() % 4)]
    if k == 6:
        return ["x", "y"][: r.u() % 3]
    if k == 7:
        return b"\0" * (r.u(2) % 5000)
    if k == 8:
        value = hostile_value(r)
        return value if isinstance(value, (int, float, str)) and not isinstance(value, bool) and (
            not isinstance(value, int) or -(2**63) <= value < 2**63) else "hostile"
    if k == 9:
        return r.raw(r.u() % 16).decode("utf-8", "replace")
    return int.from_bytes(r.raw(8).ljust(8, b"\0"), "big", signed=True)


def npy_bytes(shape: Any, dtype: str, body: bytes, fortran: bool = False, version: int = 1) -> bytes:
    """A .npy header claiming `shape` and `dtype` (any: nothing is checked here), then `body`."""
    header = "{'descr': %r, 'fortran_order': %r, 'shape': %r, }" % (dtype, fortran, tuple(shape))
    pad = 64 - (10 + len(header) + 1) % 64
    text = (header + " " * pad + "\n").encode("latin1")
    if version == 1 and len(text) < 65536:
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + body
    return b"\x93NUMPY\x02\x00" + struct.pack("<I", len(text)) + text + body


def _edit_array(arr: Any, r: Reader, seeds: Sequence[bytes]) -> Any:
    from flwr.app import Array

    data, dtype, shape = bytes(arr.data), arr.dtype, list(arr.shape)
    k = r.u() % 7
    if k == 5 and data[:8] == b"\x93NUMPY\x01\x00":  # the values only: header kept, length kept
        start = 10 + int.from_bytes(data[8:10], "little")
        body = apply_byte_program(data[start:], r.raw(r.u() % 12 + 1), [], 1 << 16)
        data = data[:start] + body[: len(data) - start].ljust(len(data) - start, b"\0")
    elif k == 0:  # the .npy bytes: header and data
        data = apply_byte_program(data, r.raw(r.u() % 12 + 1), [bytes(x) for x in seeds], 1 << 16)
    elif k == 1:  # a header that claims another size, dtype or order, over the same data
        body = data[128:] if data[:6] == b"\x93NUMPY" else data
        data = npy_bytes(r.pick(SHAPES), r.pick(DTYPES) or "<f4", body[: r.u(2)] if r.u() % 2 else body,
                         fortran=r.u() % 4 == 0, version=1 + r.u() % 2)
    elif k == 2:  # Flower's own dtype/shape fields disagree with the data
        dtype = r.pick(DTYPES)
    elif k == 3:
        shape = [int(x) for x in r.pick(SHAPES) if 0 <= x < 2**63]
    elif k == 4:  # the data cut
        data = data[: r.u(2) % (len(data) + 1)]
    elif k == 6:  # not numpy at all
        return Array(dtype=dtype, shape=tuple(shape), stype=r.pick(("torch.Tensor", "", "numpy.ndarray")), data=data)
    return Array(dtype=dtype, shape=tuple(shape), stype="numpy.ndarray", data=data)


def apply_record_program(rd: Any, program: bytes, seeds: Sequence[bytes]) -> Any:
    """Edits of a RecordDict's records (in place on a fresh parse of a seed)."""
    from flwr.app import ArrayRecord, ConfigRecord

    r = Reader(program)
    while r.more():
        kind = r.u() % 8
        groups = [(k, v) for k, v in rd.items()]
        if not groups or kind == 7:  # a record of the other kind (or a new one) under some key
            key = r.pick(("update", "update_meta", "global", "downlink", "config", "secagg", "secagg_setup",
                          "secagg_chunks", "status", "x")) if r.u() % 2 else (groups[0][0] if groups else "x")
            rd[key] = ConfigRecord({"x": 1}) if r.u() % 2 else ArrayRecord()
            continue
        key, rec = groups[r.u() % len(groups)]
        names = list(rec.keys())
        if isinstance(rec, ArrayRecord):
            if kind in (0, 1, 2) and names:
                name = names[r.u() % len(names)]
                rec[name] = _edit_array(rec[name], r, seeds)
            elif kind == 3 and names:
                del rec[names[r.u() % len(names)]]
            elif kind == 4 and names:  # rename
                name = names[r.u() % len(names)]
                rec[r.pick(("values", "scales", "indices", "index_unary", "index_low", "0/values", "w", "b", "e",
                            "envelope", "000000000000", "x/y", "-1", "9" * 25, ""))] = rec.pop(name)
            else:  # add an array claiming any size
                from flwr.app import Array

                rec[r.pick(("values", "scales", "w", "extra", "0/values", "000000000008"))] = Array(
                    dtype="float32", shape=(1,), stype="numpy.ndarray",
                    data=npy_bytes(r.pick(SHAPES), r.pick(DTYPES) or "<f4", r.raw(r.u() % 32)))
        else:
            if kind in (0, 1, 2, 3) and names:
                try:
                    rec[names[r.u() % len(names)]] = _scalar(r)
                except Exception:  # a value Flower's ConfigRecord refuses: no such message exists
                    continue
            elif kind == 4 and names:
                del rec[names[r.u() % len(names)]]
            else:
                try:
                    rec[r.pick(("codec", "numel", "layout", "summed", "k", "seed", "server_round", "rice_r", "mode",
                                "target", "steps", "0.base", "0.codec", "stage", "round", "run", "ctx", "data",
                                "sig", "sig_header", "x"))] = _scalar(r)
                except Exception:
                    continue
    return rd


def _record_edit(seed: bytes, program: bytes, seeds: Sequence[bytes]) -> bytes:
    try:
        rd = records_of(seed[1:])
    except FlowerRefused:
        return seed
    selector = bytes([program[0]]) if program and program[0] < 16 else seed[:1]
    try:
        return selector + records_bytes(apply_record_program(rd, program[1:], seeds))
    except Exception:  # a combination Flower's serializer refuses: no such message is sent
        return seed


def _edit(kind: int, seed: bytes, program: bytes, seeds: Sequence[bytes], max_size: int) -> bytes:
    if kind == 0:  # byte edits of the serialized form (mostly refused by Flower's parser)
        return apply_byte_program(seed, program, seeds, max_size)
    return _record_edit(seed, program, seeds)


def records_strategy(seeds: Sequence[Any], max_size: int = 1 << 16) -> st.SearchStrategy[bytes]:
    """Record-level edits (seven in eight), else byte edits of the serialized form. (One strategy
    with a kind draw: hypothesis's one_of would merge repeated branches.)"""
    raw = [s for s in seeds if isinstance(s, bytes) and s]
    if not raw:
        return mutated_bytes(raw, max_size)
    return st.builds(_edit, st.integers(0, 7), st.sampled_from(raw), PROGRAM, st.just(raw), st.just(max_size))


# ---- fixed parties: the model, the round --------------------------------------------------------------

SPEC = {"b": ("<f4", (5,)), "e": ("<u2", (3,)), "w": ("<f4", (4, 5))}  # "e": a bf16 tensor as raw words
FEDERATION, RUN_ID, ROUND, SEED = "fuzz-fed", 11, 3, 12345
UPDATE_CODECS = ("identity", "fp16", "bf16", "int8", "int4", "int16", "int8:clip=0.5", "int16:clip=0.5",
                 "int4:clip=0.5", "topk:0.25", "topk:0.25:index=int32+fp16", "topk:0.25+int8", "randk:0.25",
                 "randk:0.5+int4:clip=0.5", "randk:0.5+int8:clip=0.5")
UPDATE_VARIANTS = (*UPDATE_CODECS, "signed")


def model(scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    from federation.protocol.codecs.floats import bf16_bits

    return {"b": (rng.standard_normal(5) * scale).astype(np.float32),
            "e": bf16_bits((rng.standard_normal(3) * scale).astype(np.float32)),
            "w": (rng.standard_normal((4, 5)) * scale).astype(np.float32)}


def _ctx() -> Any:
    from federation.protocol.pipeline import RoundContext
    from federation.protocol.update_codec import round_seed

    return RoundContext(FEDERATION, RUN_ID, ROUND, "site-a", round_seed(SEED, ROUND))


def _update_payload(spec: str) -> Any:
    """A site's update through its real pipeline: the codec stage (error feedback on)."""
    from federation.protocol.pipeline import Payload
    from federation.protocol.update_codec import CodecStage

    payload = Payload(model(0.01), {})
    if spec == "identity":
        return payload
    return CodecStage.from_spec(spec, True, site_seed=1).encode(payload, _ctx())


def update_record_seeds() -> list[bytes]:
    from federation.protocol import message_keys as keys
    from federation.protocol.envelope_layout import as_payload
    from federation.protocol.payload_records import to_records

    from .crypto_targets import envelope_seeds

    out = [bytes([i]) + records_bytes(to_records(_update_payload(spec), keys.UPDATE, keys.UPDATE_META))
           for i, spec in enumerate(UPDATE_CODECS)]
    signed = UPDATE_VARIANTS.index("signed")
    out += [bytes([signed]) + records_bytes(to_records(as_payload(env), keys.UPDATE, keys.UPDATE_META))
            for env in envelope_seeds()]
    return out


def decode_update_record(data: bytes) -> object:
    """What the coordinator's plain round does with a site's update records (a federation whose
    codec is the selector's; "signed": the envelope is taken out and its header parsed, as the
    envelope opener does first)."""
    from crypto.envelope import EnvelopeError, EnvelopeHeader
    from federation.protocol import message_keys as keys
    from federation.protocol.codecs import UpdateSpec
    from federation.protocol.envelope_layout import envelope_of
    from federation.protocol.payload_records import from_records
    from federation.protocol.pipeline import Pipeline, UpdateRejected, check_update
    from federation.protocol.update_codec import CodecStage
    from federation.protocol.wire_dtypes import master_spec, to_master

    variant, rd = _split(data, UPDATE_VARIANTS)
    payload = from_records(rd, keys.UPDATE, keys.UPDATE_META)
    if variant == "signed":
        env = envelope_of(payload)
        try:
            return EnvelopeHeader.decode(env.header)
        except EnvelopeError as err:
            raise UpdateRejected(err.reason, str(err)) from None
    stages = () if variant == "identity" else (CodecStage.from_spec(variant, True, layout=UpdateSpec.of(model())),)
    payload = Pipeline(stages).decode(payload, _ctx())
    arrays = to_master(payload.arrays, SPEC)
    check_update(arrays, master_spec(SPEC))
    return arrays


# ---- codec payloads ---------------------------------------------------------------------------------

def codec_payload_seeds() -> list[bytes]:
    from federation.protocol.payload_records import to_records

    out = []
    for i, spec in enumerate(UPDATE_CODECS):
        payload = _update_payload(spec)
        meta = {k[len("codec."):]: v for k, v in payload.meta.items()}
        if spec == "identity":  # the identity codec's own payload (the pipeline skips it)
            from federation.protocol.codecs import CodecRound, parse_codec

            enc, _ = parse_codec(spec).encode(model(0.01), None, CodecRound(ROUND, _ctx().seed, 1))
            payload.arrays, meta = enc.arrays, enc.meta
        out.append(bytes([i]) + records_bytes(to_records(type(payload)(dict(payload.arrays), meta))))
    return out


def decode_codec_payload(data: bytes) -> object:
    """`Codec.decode` of the selector's codec on a payload's arrays (copied out of the records, as
    the coordinator does) and metadata; the round context is checked too."""
    from federation.protocol.codecs import CodecRound, Encoded, UpdateSpec, parse_codec
    from federation.protocol.payload_records import from_records

    spec, rd = _split(data, UPDATE_CODECS)
    payload = from_records(rd)
    return parse_codec(spec).decode(Encoded(payload.arrays, payload.meta), UpdateSpec.of(model()),
                                    CodecRound(ROUND, _ctx().seed))


def codec_spec_seeds() -> list[bytes]:
    from federation.protocol.codecs import parse_codec

    return [parse_codec(spec).spec.encode() for spec in UPDATE_CODECS] + [b"topk:1%:index=int32+int16:block=64"]


def decode_codec_spec(data: bytes) -> object:
    """A codec spec string from the other side (the round config's `codec`, a downlink step's
    `codec`): parsed and built, as a site does before it decodes or encodes with it."""
    from federation.protocol.codecs import parse_codec

    from .mutate import as_text

    return parse_codec(as_text(data))


# ---- the signed layout inside an envelope -------------------------------------------------------------

def envelope_layout_seeds() -> list[bytes]:
    from federation.protocol.envelope_layout import inner

    out = []
    for spec in ("identity", "topk:0.25+int8", "randk:0.5+int4:clip=0.5"):
        buf, meta = inner(_update_payload(spec))
        out.append(struct.pack(">I", len(meta)) + meta + buf.tobytes())
    return out


def _layout_parts(data: bytes) -> tuple[bytes, bytes]:
    n = int.from_bytes(data[:4].ljust(4, b"\0"), "big")
    return data[4:4 + n], data[4 + n:]


def decode_envelope_layout(data: bytes) -> object:
    """`from_inner` on an opened envelope: its signed metadata and its buffer (a uint8 array)."""
    from federation.protocol.envelope_layout import from_inner

    meta, buf = _layout_parts(data)
    return from_inner(np.frombuffer(buf, dtype=np.uint8), meta)


def _layout_edit(seed: bytes, program: bytes, seeds: Sequence[bytes]) -> bytes:
    meta, buf = _layout_parts(seed)
    doc = apply_json_program(json.loads(meta), program[1:])
    text = dump_json(doc)
    if program[0] & 1:
        buf = buf[: len(buf) * (program[0] >> 1) // 128]
    return struct.pack(">I", len(text)) + text + buf


def envelope_layout_strategy(seeds: Sequence[Any]) -> st.SearchStrategy[bytes]:
    raw = [s for s in seeds if isinstance(s, bytes)]
    good = []
    for s in raw:
        try:
            json.loads(_layout_parts(s)[0])
            good.append(s)
        except ValueError:
            continue
    edits = st.builds(_layout_edit, st.sampled_from(good or raw), PROGRAM, st.just(raw))
    return st.one_of(edits, edits, mutated_bytes(raw, 1 << 15))


# ---- downlink ---------------------------------------------------------------------------------------

DOWNLINK_CODECS = ("identity", "fp16", "int8", "topk:0.25+int8", "randk:0.5+int4:clip=0.5", "bf16")


@lru_cache(maxsize=None)
def _downlink() -> tuple[list[bytes], list[tuple[str, dict[str, np.ndarray]] | None]]:
    """Seeds from the coordinator's real DownlinkSender, each with the selector of the model the site
    holds: for each codec the full model to a new site, steps to a site that holds the first
    reference, hold to a site that holds the new one. Returns (seeds, held models by selector)."""
    from federation.coordinator.downlink_sender import DownlinkSender
    from federation.protocol import message_keys as keys
    from flwr.app import RecordDict

    base = {k: np.asarray(v, np.float32) for k, v in model().items()}
    holds: list[tuple[str, dict[str, np.ndarray]] | None] = [None]
    out = []
    for spec in DOWNLINK_CODECS:
        sender = DownlinkSender(spec, seed=SEED)
        out.append(bytes([0]) + records_bytes(RecordDict(sender.stage(base, str)(1))))
        if sender.codec is None:
            continue
        holds.append((sender.digest, sender.reference))
        sender.heard(1, {keys.MODEL_DIGEST: sender.digest})
        moved = {k: v + np.float32(0.01) for k, v in base.items()}
        out.append(bytes([len(holds) - 1]) + records_bytes(RecordDict(sender.stage(moved, str)(1))))
        holds.append((sender.digest, sender.reference))
        sender.heard(1, {keys.MODEL_DIGEST: sender.digest})
        out.append(bytes([len(holds) - 1]) + records_bytes(RecordDict(sender.stage(moved, str)(1))))
    return out, holds


def downlink_seeds() -> list[bytes]:
    return _downlink()[0]


def decode_downlink_record(data: bytes) -> object:
    """What a site does with a train message's GLOBAL (and DOWNLINK) records, holding the model the
    selector picks (none, or a reference of one of the senders above): site/downlink_mod.py."""
    from federation.protocol import message_keys as keys
    from federation.protocol.downlink_steps import reconstruct
    from federation.protocol.payload_records import from_records

    holds = _downlink()[1]
    held, rd = _split(data, holds)
    if keys.DOWNLINK not in rd.config_records:  # the dense model (dense_global)
        return from_records(rd, keys.GLOBAL, keys.DOWNLINK, copy=False).arrays
    return reconstruct(from_records(rd, keys.GLOBAL, keys.DOWNLINK), held)


# ---- round config -------------------------------------------------------------------------------------

def round_config_seeds() -> list[bytes]:
    from federation.protocol import message_keys as keys
    from federation.protocol.round_config import RoundConfig
    from flwr.app import RecordDict

    cfgs = [RoundConfig(), RoundConfig(round=4, federation="f", update_kind="weights", seed=2**63 - 1,
                                       codec="topk:0.01+int8", error_feedback=False, seal=True, evaluate=True,
                                       deadline_s=12.5)]
    return [b"\0" + records_bytes(RecordDict({keys.CONFIG: c.to_record()})) for c in cfgs]


def decode_round_config(data: bytes) -> object:
    from federation.protocol import message_keys as keys
    from federation.protocol.round_config import RoundConfig

    _, rd = _split(data, ("site",))
    return RoundConfig.from_record(rd.config_records.get(keys.CONFIG))


# ---- the STATUS record of every reply ----------------------------------------------------------------------

def status_record_seeds() -> list[bytes]:
    from federation.protocol import message_keys as keys
    from flwr.app import ConfigRecord, RecordDict

    records = [ConfigRecord({"site": "site-a", "ok": True, "error": "", "num_examples": 900, "ranks": 2}),
               ConfigRecord({"site": "site-b", "ok": True, "error": "", "num_examples": 360,
                             "rank_digests": ["0a684289fde0b0ae"], keys.MODEL_DIGEST: "4f0ae23489627e14"})]
    return [b"\0" + records_bytes(RecordDict({keys.STATUS: r})) for r in records]


def decode_status_record(data: bytes) -> object:
    """What the coordinator reads of a reply's STATUS (discovery, a train reply's count), as
    federation/coordinator does through federation.protocol.status_record."""
    from federation.protocol import message_keys as keys
    from federation.protocol.status_record import StatusError, num_examples, site_name

    _, rd = _split(data, ("coordinator",))
    status = rd.config_records.get(keys.STATUS)
    if status is None:
        raise StatusError("no status record")
    return site_name(status), num_examples(status)


# ---- SecAgg+ records ------------------------------------------------------------------------------------

FLOWER_RUN = 77


def _secagg_ctx() -> Any:
    from crypto.secagg import RoundContext
    from federation.protocol.secagg_records import context_run_id

    from .fixtures import SECAGG_CTX

    return RoundContext(context_run_id(FEDERATION, FLOWER_RUN), SECAGG_CTX.round, SECAGG_CTX.graph_seed)


REQUEST_KEYS = ("secagg", "secagg_setup")


def secagg_request_seeds() -> list[bytes]:
    from federation.protocol import message_keys as keys
    from federation.protocol.secagg_records import request_record
    from flwr.app import RecordDict

    from .fixtures import SECAGG_CONFIG, secagg_round

    ctx, cfg, req = _secagg_ctx(), SECAGG_CONFIG.model_dump_json(), secagg_round().requests
    return [
        bytes([1]) + records_bytes(RecordDict({keys.SECAGG_SETUP: request_record(keys.SETUP, ctx, cfg, req["plan"])})),
        bytes([0]) + records_bytes(RecordDict({keys.SECAGG: request_record(
            keys.MASKED_INPUT, ctx, cfg, req["masked_input"], weight=3, vector_len=21)})),
        bytes([0]) + records_bytes(RecordDict({keys.SECAGG: request_record(keys.UNMASK, ctx, cfg, req["unmask"])})),
    ]


def decode_secagg_request(data: bytes) -> object:
    """A site reads a SecAgg request (Request.parse) and the config it carries (as secagg_mod does:
    a config that does not validate is a malformed request)."""
    from crypto.secagg import MalformedMessageError, SecAggConfig
    from federation.protocol.secagg_records import Request
    from pydantic import ValidationError

    key, rd = _split(data, REQUEST_KEYS)
    req = Request.parse(_message(rd, FLOWER_RUN), key)
    try:
        SecAggConfig.model_validate_json(req.config_json)
    except (ValidationError, ValueError) as err:
        raise MalformedMessageError(f"secagg config does not validate: {str(err)[:200]}") from None
    return req


REPLY_STAGES = ("setup", "masked input", "unmask")
VECTOR_LEN, BITS = 21, 13


def secagg_reply_seeds() -> list[bytes]:
    from crypto.secagg import ring
    from federation.protocol import message_keys as keys
    from federation.protocol.secagg_records import Request, chunk_key, reply_record
    from federation.protocol.payload_records import to_array
    from flwr.app import ArrayRecord, RecordDict

    from .fixtures import secagg_round

    sent = secagg_round().sent
    sig = secagg_round().advert_sig
    req_rd = records_of(secagg_request_seeds()[0][1:])
    setup_req = Request.parse(_message(req_rd, FLOWER_RUN), keys.SECAGG_SETUP)
    unmask_req = Request.parse(_message(records_of(secagg_request_seeds()[2][1:]), FLOWER_RUN), keys.SECAGG)
    masked_req = Request.parse(_message(records_of(secagg_request_seeds()[1][1:]), FLOWER_RUN), keys.SECAGG)
    rng = np.random.default_rng(3)
    words = rng.integers(0, 2**BITS, VECTOR_LEN, dtype=np.uint64).astype(np.uint32)
    chunks = ArrayRecord({chunk_key(off): to_array(ring.pack_words(words[off:off + 8], BITS))
                          for off in range(0, VECTOR_LEN, 8)})
    return [
        bytes([0]) + records_bytes(RecordDict({keys.SECAGG_SETUP: reply_record(
            setup_req, sig, data=sent["setup"], advert=sent["advert"], advert_sig_header=sig.header,
            advert_sig=sig.signature)})),
        bytes([1]) + records_bytes(RecordDict({keys.SECAGG: reply_record(masked_req, sig),
                                               keys.SECAGG_CHUNKS: chunks})),
        bytes([2]) + records_bytes(RecordDict({keys.SECAGG: reply_record(unmask_req, None, data=sent["unmask"])})),
    ]


def decode_secagg_reply(data: bytes) -> object:
    """The coordinator reads a site's reply to one stage (coordinator/secagg_round.py): the record
    answers this stage of this round, then its bytes and signatures, or its masked chunks."""
    from federation.protocol import message_keys as keys
    from federation.protocol.secagg_records import check_reply, parse_chunks, reply_bytes, signature_of

    stage, rd = _split(data, REPLY_STAGES)
    reply, ctx = _message(rd, FLOWER_RUN), _secagg_ctx()
    if stage == "setup":
        rec = check_reply(reply, keys.SETUP, ctx, key=keys.SECAGG_SETUP)
        return reply_bytes(rec), reply_bytes(rec, "advert"), signature_of(rec), signature_of(rec, "advert_")
    if stage == "unmask":
        rec = check_reply(reply, keys.UNMASK, ctx)
        return reply_bytes(rec), signature_of(rec)
    rec = check_reply(reply, keys.MASKED_INPUT, ctx)
    return parse_chunks(reply, VECTOR_LEN, BITS), signature_of(rec)



# ---- inputs claiming a huge size (tests/fuzzing/claims.py) ---------------------------------------------

def _claiming_records(seed: bytes, record: str, shape: tuple[int, ...], dtype: str = "<f4") -> bytes:
    """`seed` with every Array of `record` replaced by a .npy header claiming `shape` over 16 bytes
    (Flower's own shape field is int32: it says (1,); the header is what np.load would allocate)."""
    from flwr.app import Array

    rd = records_of(seed[1:])
    rec = rd.array_records[record]
    for name in list(rec.keys()):
        rec[name] = Array(dtype=str(np.dtype(dtype)), shape=(1,), stype="numpy.ndarray",
                          data=npy_bytes(shape, dtype, b"\0" * 16))
    return seed[:1] + records_bytes(rd)


def protocol_claims() -> list[tuple[str, str, Any]]:
    """(what, decoder, input maker) of the protocol decoders' size claims."""
    from federation.protocol import message_keys as keys

    huge = 2**40
    return [
        ("update array whose .npy header claims 2**40 float32", "update-record",
         lambda: _claiming_records(update_record_seeds()[0], keys.UPDATE, (huge,))),
        ("update array whose .npy header claims (2**32, 2**32, 2**32): wraps to 0 in int64", "update-record",
         lambda: _claiming_records(update_record_seeds()[0], keys.UPDATE, (2**32, 2**32, 2**32))),
        ("codec values whose .npy header claims 2**40 int8", "codec-payload",
         lambda: _claiming_records(codec_payload_seeds()[3], "arrays", (huge,), "|i1")),
        ("downlink model whose .npy header claims 2**40 float32 (dense, read as a view)", "downlink-record",
         lambda: _claiming_records(downlink_seeds()[0], keys.GLOBAL, (huge,))),
        ("masked chunk whose .npy header claims 2**40 bytes", "secagg-reply",
         lambda: _claiming_records(secagg_reply_seeds()[1], keys.SECAGG_CHUNKS, (huge,), "|u1")),
        ("signed layout naming a 2**40-element tensor", "envelope-layout",
         lambda: _layout_claim([["w", "<f4", [huge], 0]])),
        ("signed layout naming a (2**32, 2**32) tensor: wraps to 0 in int64", "envelope-layout",
         lambda: _layout_claim([["w", "<f4", [2**32, 2**32], 0]])),
        ("signed update whose envelope header is the int 2**40 (bytes(n) would allocate it)", "update-record",
         lambda: _envelope_meta_claim(huge)),
    ]


def _layout_claim(layout: list) -> bytes:
    meta = json.dumps({"layout": layout, "meta": {}}).encode()
    return struct.pack(">I", len(meta)) + meta + b"\0" * 64


def _envelope_meta_claim(value: int) -> bytes:
    from federation.protocol import message_keys as keys
    from federation.protocol.envelope_layout import HEADER

    seed = update_record_seeds()[-1]
    rd = records_of(seed[1:])
    rd.config_records[keys.UPDATE_META][HEADER] = value
    return seed[:1] + records_bytes(rd)
