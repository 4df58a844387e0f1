"""The SecAgg+ round protocol, coordinator and site sides, without processes.

A fake Grid hands each message, serialized and deserialized as on the wire, to the real site
handlers (`federation.secagg_site`) with a per-node Context that goes through protobuf between
messages (as a fresh ClientApp process would see it), and the real `Coordinator` drives rounds with
`SecAggRound`. Sites' "training" returns a known update, so the exact sum can be checked.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
from flwr.supercore.task_identity import TaskIdentity

from crypto.pki import CoordinatorBundle
from crypto.secagg import FixedPointCodec, SecAggConfig
from federation.site import secagg_mod as secagg_site
from federation.protocol.update_codec import CodecStage, round_seed
from federation.protocol.codecs import UpdateSpec
from federation.config.schema import parse_config
from federation.coordinator.aggregate import ServerOptimizer
from federation.coordinator.driver import Coordinator
from federation.protocol.pipeline import Payload, Pipeline, RoundContext
from federation.coordinator.secagg_round import SecAggRound, round_weights
from federation.protocol.message_keys import SECAGG as RECORD
from federation.protocol.message_keys import SECAGG_CHUNKS as CHUNKS
from federation.protocol.secagg_records import parse_chunks

RUN_ID = 4242
SHAPES = {"w": (6, 5), "b": (5,), "z": (3,)}


@pytest.fixture(autouse=True)
def _task_identity():
    """Messages created outside a ServerApp process need Flower's task identity."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def site_update(name: str, rnd: int) -> dict[str, np.ndarray]:
    seed = int.from_bytes(hashlib.sha256(f"{name}/{rnd}".encode()).digest()[:4], "big")
    rng = np.random.default_rng(seed)
    return {k: (rng.normal(size=s) * 0.05).astype(np.float32) for k, s in SHAPES.items()}


class FakeSite:
    """One SuperNode + ClientApp: secagg handlers are the real ones."""

    def __init__(self, name: str, node_id: int, num_examples: int, node_config: dict | None = None):
        self.name, self.node_id, self.num_examples = name, node_id, num_examples
        self.context = context_to_proto(Context(run_id=RUN_ID, node_id=node_id, node_config=dict(node_config or {}),
                                                state=RecordDict(), run_config={}))
        self.silent: set[tuple[int, int]] = set()  # (round, stage) without any reply: vanished / hung
        self.tamper = None  # (stage, round, reply Message) -> reply Message
        self.codec_state: dict = {}

    def handle(self, msg: Message) -> Message | None:
        ctx = context_from_proto(self.context)  # a fresh ClientApp process: state as the SuperNode kept it
        rec = msg.content.config_records.get(RECORD)
        stage = int(rec["stage"]) if rec is not None else 0
        rnd = int(rec["round"]) if rec is not None else 0
        if (rnd, stage) in self.silent:
            return None
        try:
            reply = self._run(msg, ctx)
        except Exception as err:  # what Flower's run_clientapp does with an exception
            reply = Message(Error(code=0, reason=f"{type(err)}:<'{err}'>"), reply_to=msg)
        self.context = context_to_proto(ctx)
        if self.tamper is not None and rec is not None:
            reply = self.tamper(stage, rnd, reply)
        return reply

    def _run(self, msg: Message, ctx: Context) -> Message:
        status = ConfigRecord({"site": self.name, "ok": True, "error": "", "num_examples": self.num_examples})
        if msg.metadata.message_type == "query":
            if RECORD in msg.content.config_records:
                return secagg_site.on_query(msg, ctx, self.name)
            return Message(RecordDict({"status": status}), reply_to=msg)
        assert msg.metadata.message_type == "train"
        cfg = msg.content.config_records["config"]
        rnd = int(cfg["round"])
        upd = site_update(self.name, rnd)
        stages = []
        if cfg["codec"] != "identity":
            stage = CodecStage.from_spec(str(cfg["codec"]), bool(cfg["error_feedback"]), state=self.codec_state)
            stages.append(stage)
        payload = Pipeline(tuple(stages)).encode(Payload(upd),
                                                 RoundContext(str(cfg["federation"]), RUN_ID, rnd, self.name,
                                                              int(cfg["seed"])))
        out = secagg_site.on_train(msg, ctx, self.name, payload, self.num_examples)
        out["status"] = status
        out["metrics"] = MetricRecord({"loss": 1.0 / rnd, "train_s": 0.01})
        return Message(out, reply_to=msg)


class FakeGrid:
    def __init__(self, sites: list[FakeSite]):
        self.sites = {s.node_id: s for s in sites}
        self.replies: dict[str, Message] = {}
        self.max_pulled = 0
        self.tamper_out = None  # Message -> Message: what a malicious coordinator sends instead

    def get_node_ids(self):
        return list(self.sites)

    def push_messages(self, msgs):
        ids = []
        for m in msgs:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid
            wire = message_from_proto(message_to_proto(m))
            if self.tamper_out is not None:
                wire = self.tamper_out(wire)
            reply = self.sites[m.metadata.dst_node_id].handle(wire)
            if reply is not None:
                reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                self.replies[mid] = message_from_proto(message_to_proto(reply))
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        out = [self.replies.pop(i) for i in list(ids) if i in self.replies]
        self.max_pulled = max(self.max_pulled, sum(1 for m in out if m.has_content() and CHUNKS in m.content.array_records))
        return out


def make(tmp_path: Path, n: int = 5, secagg: dict | None = None, codec: str = "identity",
         node_config: dict[str, dict] | None = None, examples: list[int] | None = None,
         strategy: str = "fedavg", pki: Path | None = None) -> tuple[Coordinator, FakeGrid]:
    """Coordinator and sites "a", "b", ...; with `pki` (provisioned for those names) sites sign with
    their bundles and the coordinator verifies with its own."""
    names = [chr(ord("a") + i) for i in range(n)]
    if pki is not None:
        node_config = {s: {"bundle-dir": str(pki / "sites" / s), **(node_config or {}).get(s, {})} for s in names}
    cfg = parse_config({
        "federation": {"name": "unit", "rounds": 6, "quorum": 2, "codec": codec, "evaluate": False, "strategy": strategy,
                       "deadlines": {"round_s": 1.0, "secagg_stage_s": 0.6, "connect_s": 5},
                       "secagg": {"enabled": True, "threshold": 3, "neighbours": n - 1, "clip": 0.5, "bits": 32,
                                  **(secagg or {})}},
        "sites": [{"id": s, "partition": i} for i, s in enumerate(names)],
    })
    examples = examples or [100 + 10 * i for i in range(n)]
    sites = [FakeSite(s, (2**63 + 1000 + 17 * i), examples[i], (node_config or {}).get(s)) for i, s in enumerate(names)]
    grid = FakeGrid(sites)
    initial = {k: np.zeros(s, dtype=np.float32) for k, s in SHAPES.items()}
    bundle = CoordinatorBundle.load(pki / "coordinator") if pki is not None else None
    coord = Coordinator(grid, cfg, tmp_path / "coord", RUN_ID, initial, lambda line: None, bundle)
    assert isinstance(coord.protocol, SecAggRound)
    coord.wait_for_sites()
    return coord, grid


def expected_mean(coord: Coordinator, rnd: int, contributors: list[str], clip: float) -> dict[str, np.ndarray]:
    by_name = {s.name: s for s in coord.sites.values()}
    weights = round_weights({s.node_id: s.num_examples for s in by_name.values()}, coord.fed.secagg.max_weight)
    tot, acc = 0, {k: np.zeros(s) for k, s in SHAPES.items()}
    for name in contributors:
        w = weights[by_name[name].node_id]
        for k, v in site_update(name, rnd).items():
            acc[k] += np.clip(v.astype(np.float64), -clip, clip) * w
        tot += w
    return {k: v / tot for k, v in acc.items()}


def check_exact(coord, line, rnd, dumps: Path, contributors):
    info = line["secagg"]
    assert info["contributors"] == sorted(contributors) and line["status"] == "aggregated"
    ring = sum(np.load(dumps / c / f"round_{rnd:04d}.npy").astype(np.uint64) for c in contributors)
    ring = (ring % 2**32).astype(np.uint32)
    assert hashlib.sha256(ring.tobytes()).hexdigest() == info["ring_sum_sha256"]
    codec = FixedPointCodec.for_round(info["clip"], info["bits"], coord.fed.secagg.max_weight, info["roster"])
    decoded = codec.decode(ring)
    bound = codec.error_bound(len(contributors), int(ring[-1]))
    assert bound == pytest.approx(info["error_bound"])
    want = expected_mean(coord, rnd, contributors, info["clip"])
    flat_want = UpdateSpec.of(want).flatten({k: v.astype(np.float32) for k, v in want.items()})
    exact = np.concatenate([want[k].reshape(-1) for k in sorted(want)])
    assert np.abs(decoded.astype(np.float64) - exact).max() <= bound
    assert flat_want.shape == decoded.shape
    return decoded


def test_weights_keep_ratios_when_scaled():
    assert round_weights({1: 300, 2: 600}, 1000) == {1: 300, 2: 600}
    w = round_weights({1: 3000, 2: 6000, 3: 1}, 1000)
    assert w == {1: 500, 2: 1000, 3: 1}


def test_rounds_with_dropouts_at_every_stage_then_abort_then_recovery(tmp_path):
    dumps = tmp_path / "dumps"
    faults = {"a": "round=2,after=advertise", "b": "round=3,after=share", "c": "round=4,after=masked;round=5,after=masked",
              "d": "round=5,after=masked", "e": "round=5,after=masked"}
    node_config = {s: {"secagg-dump-dir": str(dumps / s), **({"secagg-fault": f} if f else {})}
                   for s, f in faults.items()}
    coord, grid = make(tmp_path, node_config=node_config)
    model0 = {k: v.copy() for k, v in coord.model.items()}
    lines, after = {}, {}
    for rnd in range(1, 7):
        before = {k: v.copy() for k, v in coord.model.items()}
        lines[rnd] = line = coord.train_round(rnd)
        after[rnd] = {k: v.copy() for k, v in coord.model.items()}
        if line["status"] == "aggregated":
            # FedAvg on deltas: the new global moved by exactly the decoded mean
            decoded = np.concatenate([(coord.model[k] - before[k]).reshape(-1) for k in sorted(SHAPES)])
            assert line["secagg"]["error_bound"] < 1e-5
            mean = check_exact(coord, line, rnd, dumps, line["secagg"]["contributors"])
            np.testing.assert_allclose(decoded, mean, atol=1e-7)
    everyone = list("abcde")
    assert lines[1]["secagg"]["contributors"] == everyone and not lines[1]["failed"]
    # vanished after advertising keys: not in the sum, no mask of it is left
    assert lines[2]["secagg"]["contributors"] == list("bcde") and "a" in lines[2]["failed"]
    assert lines[2]["secagg"]["roster"] == 5 and lines[2]["secagg"]["dropped"] == []
    # vanished after sharing keys: its pairwise masks were removed from the survivors' sum
    assert lines[3]["secagg"]["contributors"] == list("acde") and lines[3]["secagg"]["dropped"] == ["b"]
    assert "test fault injected" in lines[3]["failed"]["b"]
    # vanished after sending its masked input: it is in the sum, its self mask rebuilt from shares
    assert lines[4]["secagg"]["contributors"] == everyone and "c" in lines[4]["secagg"]["unmask_missing"]
    assert set(lines[4]["sites"]) == set(everyone)
    # three vanish before unmasking: fewer than t = 3 shares -> clean abort, model unchanged
    r5 = lines[5]
    assert r5["status"] == "skipped" and r5["sites"] == {}
    assert "aborted in stage 4 (unmask)" in r5["secagg"]["aborted"] and "threshold 3" in r5["secagg"]["aborted"]
    assert all("round aborted" in r5["failed"][s] for s in "ab")
    # and the next round is a normal one
    assert lines[6]["status"] == "aggregated" and lines[6]["secagg"]["contributors"] == everyone
    # the aborted round left the global model as round 4 made it
    assert all(np.array_equal(after[5][k], after[4][k]) for k in SHAPES)
    assert any(np.abs(coord.model[k] - model0[k]).max() > 0 for k in SHAPES)
    # the coordinator never held two masked vectors at once
    assert grid.max_pulled == 1
    # sites forgot their round secrets after answering the unmask request (b: after round 6)
    state = context_from_proto(grid.sites[min(grid.sites)].context).state.config_records[RECORD]
    assert "client" not in state and state["last_round"] == 6


def test_masked_bytes_are_four_per_parameter_in_chunks(tmp_path):
    coord, grid = make(tmp_path, n=4, secagg={"chunk_bytes": 64, "threshold": 2})
    seen = []
    site = next(iter(grid.sites.values()))

    def spy(stage, rnd, reply):
        if stage == 3:
            rec = reply.content.array_records[CHUNKS]
            seen.extend((k, a.dtype, a.shape) for k, a in rec.items())
        return reply

    site.tamper = spy
    line = coord.train_round(1)
    p = sum(int(np.prod(s)) for s in SHAPES.values())
    assert line["status"] == "aggregated"
    assert len(seen) == -(-(p + 1) // 16) and all(d == "uint32" and len(s) == 1 for _, d, s in seen)
    assert sum(s[0] for _, _, s in seen) == p + 1
    assert line["sites"][site.name]["upload_bytes"] == 4 * (p + 1)


def _corrupt_chunks(reply):
    rec = reply.content.array_records[CHUNKS]
    key = sorted(rec)[0]
    rec[key] = Array(rec[key].numpy().astype(np.int64))
    return reply


def _drop_chunk(reply):
    rec = reply.content.array_records[CHUNKS]
    if len(rec) > 1:
        del rec[sorted(rec)[-1]]
    return reply


def _wrong_round(reply):
    if RECORD in reply.content.config_records:
        reply.content.config_records[RECORD]["round"] = 99
    return reply


@pytest.mark.parametrize("stage,tamper,reason", [
    (3, _corrupt_chunks, "secagg_malformed"),
    (3, _drop_chunk, "secagg_malformed"),
    (1, _wrong_round, "secagg_replayed"),
    (2, _wrong_round, "secagg_replayed"),
])
def test_hostile_site_is_rejected_counted_and_dropped(tmp_path, stage, tamper, reason):
    dumps = tmp_path / "dumps"
    coord, grid = make(tmp_path, node_config={s: {"secagg-dump-dir": str(dumps / s)} for s in "abcde"},
                       secagg={"chunk_bytes": 64})
    bad = next(s for s in grid.sites.values() if s.name == "b")
    bad.tamper = lambda st, rnd, reply: tamper(reply) if st == stage and not reply.has_error() else reply
    line = coord.train_round(1)
    assert line["rejections"] == {reason: 1}
    assert line["failed"]["b"].startswith(f"rejected {reason}")
    check_exact(coord, line, 1, dumps, list("acde"))


def test_replayed_advert_from_an_earlier_round_is_rejected(tmp_path):
    coord, grid = make(tmp_path, n=4, secagg={"threshold": 2})
    bad = next(s for s in grid.sites.values() if s.name == "a")
    kept = {}

    def replay(stage, rnd, reply):
        if stage == 1 and rnd == 1:
            kept["data"] = reply.content.config_records[RECORD]["data"]
        elif stage == 1 and rnd == 2:
            reply.content.config_records[RECORD]["data"] = kept["data"]
        return reply

    bad.tamper = replay
    assert coord.train_round(1)["status"] == "aggregated"
    line = coord.train_round(2)
    assert line["status"] == "aggregated" and line["secagg"]["contributors"] == ["b", "c", "d"]
    assert line["rejections"] == {"secagg_replayed": 1}


def test_silent_sites_hit_the_stage_deadline_and_too_few_abort_at_stage_2(tmp_path):
    coord, grid = make(tmp_path)
    for s in grid.sites.values():
        if s.name in "abc":
            s.silent.add((1, 2))
    line = coord.train_round(1)
    assert line["status"] == "skipped" and line["sites"] == {}
    assert "aborted in stage 2 (share keys)" in line["secagg"]["aborted"]
    assert all(line["failed"][s].startswith("stage 2 (share keys): deadline") for s in "abc")
    assert coord.train_round(2)["status"] == "aggregated"


@pytest.mark.parametrize("codec", ["randk:0.5", "randk:0.5+int8:clip=0.2", "int16:clip=0.4"])
def test_linear_codecs_decode_to_the_plain_weighted_mean(tmp_path, codec):
    coord, grid = make(tmp_path, n=4, codec=codec, secagg={"threshold": 2})
    line = coord.train_round(1)
    assert line["status"] == "aggregated"
    # the same sites' payloads through the plaintext codec path give the same mean, within a step
    layout = UpdateSpec.of(coord.model)
    weights = round_weights({s.node_id: s.num_examples for s in coord.sites.values()}, 1000)
    stage = CodecStage.from_spec(codec, True, layout=layout)
    acc = np.zeros(layout.numel)
    for s in grid.sites.values():
        # what each site sent (error-feedback state: the site's own, one round old -> empty here)
        st = CodecStage.from_spec(codec, True, state={})
        ctx = RoundContext("unit", RUN_ID, 1, s.name, round_seed(0, 1))
        payload = Pipeline((st,)).encode(Payload(site_update(s.name, 1)), ctx)
        dec = Pipeline((stage,)).decode(payload, ctx).arrays
        acc += layout.flatten(dec).astype(np.float64) * weights[s.node_id]
    want = acc / sum(weights.values())
    got = layout.flatten(coord.model)
    # stochastic rounding in the plaintext codec differs per draw: compare within two codec steps
    step = 0.2 / 127 if "int8" in codec else (0.4 / 32767 if "int16" in codec else 0)
    assert np.abs(got - np.clip(want, -0.5, 0.5)).max() <= 2 * step + line["secagg"]["error_bound"] + 1e-6


def test_fedadam_gets_a_mean_update_like_plain_rounds(tmp_path):
    coord, _ = make(tmp_path, n=4, strategy="fedadam", secagg={"threshold": 2})
    start = {k: v.copy() for k, v in coord.model.items()}
    seen = []
    step = coord.opt.step
    coord.opt.step = lambda model, mean: seen.append(mean) or step(model, mean)
    line = coord.train_round(1)
    assert line["status"] == "aggregated" and all(np.isfinite(v).all() for v in coord.model.values())
    # the server optimizer got the plaintext weighted mean of the sites' (clipped) updates, within the SecAgg bound
    want = expected_mean(coord, 1, list("abcd"), line["secagg"]["clip"])
    assert len(seen) == 1 and set(seen[0]) == set(SHAPES)
    for k in SHAPES:
        assert np.abs(seen[0][k].astype(np.float64) - want[k]).max() <= line["secagg"]["error_bound"] + 1e-7, k
    # and FedAdam moved the model as it would with that plaintext mean from a plain round
    ref = ServerOptimizer("fedadam", "delta", coord.fed.effective_server_lr).step(
        start, {k: v.astype(np.float32) for k, v in want.items()})
    for k in SHAPES:
        np.testing.assert_allclose(coord.model[k], ref[k], rtol=0, atol=1e-5)


# ---- the site handlers on their own --------------------------------------------------------------

def _query(stage: int, rnd: int, run: str = f"unit/{RUN_ID}", request: bytes = b"", node: int = 77) -> Message:
    m = Message(RecordDict({RECORD: ConfigRecord({
        "stage": stage, "round": rnd, "run": run, "graph_seed": b"\x01" * 32,
        "config": SecAggConfig(threshold=2).model_dump_json(), "request": request})}),
        dst_node_id=node, message_type="query", ttl=30)
    m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    return message_from_proto(message_to_proto(m))


def _ctx(node: int = 77) -> Context:
    return Context(run_id=RUN_ID, node_id=node, node_config={}, state=RecordDict(), run_config={})


def test_site_refuses_out_of_order_replayed_and_foreign_requests():
    ctx = _ctx()
    r = secagg_site.on_query(_query(2, 1, request=b"x"), ctx, "a")
    assert not r.content.config_records["status"]["ok"] and "no SecAgg state" in r.content.config_records["status"]["error"]
    r = secagg_site.on_query(_query(1, 1), ctx, "a")
    assert r.content.config_records["status"]["ok"]
    assert len(r.content.config_records[RECORD]["data"]) > 64
    ctx = context_from_proto(context_to_proto(ctx))  # the next ClientApp process
    r = secagg_site.on_query(_query(1, 1), ctx, "a")  # keys are advertised once per round
    assert "already started" in r.content.config_records["status"]["error"]
    r = secagg_site.on_query(_query(1, 2, run="unit/999"), ctx, "a")  # another Flower run
    assert "ReplayedMessageError" in r.content.config_records["status"]["error"]
    r = secagg_site.on_query(_query(2, 2, request=b"x"), ctx, "a")  # state is for round 1
    assert "ReplayedMessageError" in r.content.config_records["status"]["error"]
    r = secagg_site.on_query(_query(3, 1), ctx, "a")
    assert "train message" in r.content.config_records["status"]["error"]
    bad = _query(1, 3)
    bad.content.config_records[RECORD]["graph_seed"] = b"short"
    assert "Malformed" in secagg_site.on_query(bad, ctx, "a").content.config_records["status"]["error"]


def test_values_vector_is_the_codec_value_order():
    upd = site_update("a", 1)
    flat = secagg_site.values_vector(Payload(upd))
    np.testing.assert_array_equal(flat, UpdateSpec.of(upd).flatten(upd))
    st = CodecStage.from_spec("randk:0.25", False)
    payload = st.encode(Payload(upd), RoundContext("f", 1, 1, "a", 5))
    np.testing.assert_array_equal(secagg_site.values_vector(payload), payload.arrays["values"])


def test_parse_chunks_refuses_partial_or_overlapping_uploads():
    def reply(chunks):
        rd = RecordDict({CHUNKS: ArrayRecord({f"{o:012d}": Array(np.asarray(w, dtype=np.uint32)) for o, w in chunks})})
        return Message(rd, dst_node_id=1, message_type="train")

    assert [o for o, _ in parse_chunks(reply([(0, [1, 2]), (2, [3])]), 3, 32)] == [0, 2]
    for chunks, length in (([(0, [1, 2])], 3), ([(0, [1, 2]), (1, [3, 4])], 3), ([(1, [1, 2])], 3)):
        with pytest.raises(Exception, match="cover|gap|overlap"):
            parse_chunks(reply(chunks), length, 32)
    with pytest.raises(Exception, match="outside"):
        parse_chunks(reply([(0, [1, 2**20])]), 2, 16)
