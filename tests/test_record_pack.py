"""A message's small records as one Flower object (federation/protocol/record_pack.py), beneath the
coordinator's grid (coordinator/pack_grid.py) and around the ClientApp (site/pack_mod.py): every
record comes back as it was (type, key, order, values, Array bytes); a train message like the
coordinator's is three Flower objects, not one per record and Array; a large ArrayRecord stays its
own objects; a pack that does not decode is a clear, counted failure of its site, never a crash."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from federation.coordinator.pack_grid import PackGrid
from federation.coordinator.refused_reply import refusal
from federation.coordinator.retry_grid import RetryingGrid
from federation.ops.inprocess import task_identity
from federation.protocol import message_keys as keys
from federation.protocol.record_pack import FIELD, RECORD_MAX, PackError, pack, unpack
from federation.site.pack_mod import pack_mod
from federation.site.replies import ok

RUN = 5


def train_like(model_floats: int = 153_000) -> RecordDict:
    """The records of a SecAgg+ train message with attestation, terms and the audit head (their
    sizes as the coordinator's), the model inline (below the data path's threshold)."""
    rng = np.random.default_rng(0)
    return RecordDict({
        keys.GLOBAL: ArrayRecord({"w": Array(rng.standard_normal(model_floats, dtype=np.float32)),
                                  "b": Array(np.zeros(10, dtype=np.float32)),
                                  "h": Array(np.arange(7, dtype=np.int64).astype(np.float16))}),
        keys.CONFIG: ConfigRecord({"round": 3, "lr": 0.05, "evaluate": True, "codec": "none"}),
        keys.SECAGG: ConfigRecord({"stage": 3, "shares": [b"\x01" * 96, b"\x02" * 96], "threshold": 2}),
        keys.ATTEST: ConfigRecord({"nonce": b"n" * 32, "evidence": "x" * 900}),
        keys.SECAGG_SETUP: ConfigRecord({"round": 4, "peers": [1, 2, 3]}),
        keys.TERMS: ConfigRecord({"epsilon": 8.0, "purpose": "fraud"}),
        keys.AUDIT: ConfigRecord({"index": 12, "hash": "ab" * 32}),
        keys.BULK: ConfigRecord({"streams": 2}),
        keys.METRICS: MetricRecord({"loss": 0.5, "per_rank": [0.1, 0.2]}),
    })


def assert_same(a: RecordDict, b: RecordDict) -> None:
    assert list(a.keys()) == list(b.keys())
    for key in a:
        x, y = a[key], b[key]
        assert type(x) is type(y), key
        if isinstance(x, ArrayRecord):
            assert list(x.keys()) == list(y.keys())
            for name in x:
                assert (x[name].data, x[name].dtype, x[name].shape) == (y[name].data, y[name].dtype, y[name].shape)
        else:
            assert dict(x) == dict(y), key


def objects(rd: RecordDict) -> int:
    """Flower objects a message with this content is moved as (its RecordDict and everything under
    it, plus the message itself)."""
    return len(get_all_nested_objects(rd)) + 1


def test_every_record_comes_back_as_it_was_in_its_order():
    rd = train_like()
    packed = pack(rd)
    assert list(packed.keys()) == [keys.PACKED]
    assert_same(unpack(packed), rd)


def test_a_train_message_is_three_objects_packed_against_one_per_record_and_array():
    rd = train_like()
    assert objects(rd) >= 1 + 1 + 9 + 3  # message, RecordDict, 9 records, 3 Arrays (and their chunks)
    assert objects(pack(rd)) == 3


def test_a_large_arrayrecord_stays_its_own_objects_and_the_rest_is_packed():
    rd = train_like(model_floats=RECORD_MAX // 4 + 1)  # the model's arrays just above the limit
    packed = pack(rd)
    assert set(packed.keys()) == {keys.GLOBAL, keys.PACKED}
    assert packed[keys.GLOBAL] is rd[keys.GLOBAL]
    assert_same(unpack(packed), rd)


def test_a_100m_parameter_model_is_left_as_it_is_uncopied_and_only_the_small_records_are_packed():
    model = ArrayRecord({f"l{i}.w": Array(np.zeros(4_000_000, np.float32)) for i in range(25)})  # 100M floats
    rd = RecordDict({keys.GLOBAL: model, keys.CONFIG: ConfigRecord({"round": 1}),
                     keys.ATTEST: ConfigRecord({"nonce": b"n" * 32}), keys.AUDIT: ConfigRecord({"index": 3})})
    packed = pack(rd)
    assert set(packed.keys()) == {keys.GLOBAL, keys.PACKED} and packed[keys.GLOBAL] is model
    assert len(packed[keys.PACKED][FIELD]) < 1024  # three small records, not the model
    assert unpack(packed)[keys.GLOBAL] is model


def test_the_pack_stops_at_its_byte_budget():
    rd = RecordDict({f"a{i}": ArrayRecord({"x": Array(np.zeros(1000, dtype=np.float32))}) for i in range(5)})
    packed = pack(rd, pack_max=2 * 4200)
    assert sum(1 for k in packed if k.startswith("a")) == 3  # two of five fit the budget
    assert_same(unpack(packed), rd)


def test_fewer_than_two_records_and_an_already_packed_message_are_left_alone():
    one = RecordDict({keys.STATUS: ConfigRecord({"ok": True})})
    assert pack(one) is one
    twice = pack(train_like())
    assert pack(twice) is twice
    assert unpack(one) is one


def test_a_pack_that_does_not_decode_or_collides_names_what_is_wrong():
    with pytest.raises(PackError, match="does not decode"):
        unpack(RecordDict({keys.PACKED: ConfigRecord({FIELD: b"\xff\xfe not a protobuf"})}))
    with pytest.raises(PackError, match="no bytes"):
        unpack(RecordDict({keys.PACKED: ConfigRecord({FIELD: "text"})}))
    packed = pack(train_like())
    packed[keys.CONFIG] = ConfigRecord({"round": 99})
    with pytest.raises(PackError, match="config") as err:
        unpack(packed)
    assert err.value.reason == "pack_unreadable"


class RecordingGrid:
    """The SuperLink as far as a Grid layer sees it: what was pushed (its content at push time),
    and each message answered with the reply `answer` makes."""

    def __init__(self, answer):
        self.answer, self.seen, self.replies = answer, [], {}

    def get_node_ids(self):
        return [1, 2]

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            mid = f"m{len(self.seen)}"
            self.seen.append(list(msg.content.keys()))
            self.replies[mid] = self.answer(msg)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(m) for m in message_ids if m in self.replies]


def test_the_grid_pushes_packed_gives_the_caller_its_content_back_and_unpacks_replies():
    def answer(msg):
        return Message(pack(RecordDict({keys.STATUS: ConfigRecord({"site": "paris", "ok": True}),
                                         keys.METRICS: MetricRecord({"loss": 0.25})})), reply_to=msg)

    inner = RecordingGrid(answer)
    grid = PackGrid(inner)
    with task_identity(RUN):
        msgs = [Message(train_like(), dst_node_id=n, message_type="train") for n in (1, 2)]
        ids = grid.push_messages(msgs)
    assert inner.seen == [[keys.PACKED], [keys.PACKED]]
    assert_same(msgs[0].content, train_like())  # the caller counts the records it built
    replies = grid.pull_messages(ids)
    assert [list(r.content.keys()) for r in replies] == [[keys.STATUS, keys.METRICS]] * 2
    assert all(refusal(r) is None for r in replies)
    assert grid.get_node_ids() == [1, 2]  # everything else is the inner grid's


class ResetOnce(RecordingGrid):
    """A SuperLink whose first push is reset mid-way (the retries above the pack resend)."""

    def __init__(self, answer):
        super().__init__(answer)
        self.resets = 0

    def push_messages(self, messages):
        if not self.resets:
            self.resets += 1
            self.seen += [list(m.content.keys()) for m in messages]
            raise ConnectionResetError("connection reset by peer")
        return super().push_messages(messages)


def test_a_retried_push_sends_the_same_packed_objects_and_the_caller_keeps_its_records():
    inner = ResetOnce(lambda msg: Message(RecordDict({keys.STATUS: ConfigRecord({"ok": True})}), reply_to=msg))
    grid = RetryingGrid(PackGrid(inner), budget_s=10.0)
    with task_identity(RUN):
        msg = Message(train_like(), dst_node_id=1, message_type="train")
        ids = grid.push_messages([msg])
    assert inner.resets == 1 and inner.seen == [[keys.PACKED], [keys.PACKED]] and len(ids) == 1
    assert_same(msg.content, train_like())
    assert pack(train_like())[keys.PACKED][FIELD] == pack(train_like())[keys.PACKED][FIELD]  # same bytes, same ids


def test_a_reply_whose_pack_does_not_decode_is_refused_by_name_not_raised():
    inner = RecordingGrid(lambda msg: Message(RecordDict({keys.PACKED: ConfigRecord({FIELD: b"\x00garbage"})}),
                                              reply_to=msg))
    grid = PackGrid(inner)
    with task_identity(RUN):
        ids = grid.push_messages([Message(train_like(), dst_node_id=1, message_type="train")])
    (reply,) = grid.pull_messages(ids)
    assert refusal(reply).reason == "pack_unreadable"


def site_context() -> Context:
    return Context(run_id=RUN, node_id=1, node_config={"site-id": "paris"}, state=RecordDict(), run_config={})


def test_the_mod_unpacks_before_the_app_and_packs_its_reply():
    seen = []

    def app(msg, context):
        seen.append(list(msg.content.keys()))
        return Message(RecordDict({keys.STATUS: ConfigRecord({"site": "paris", "ok": True}),
                                   keys.METRICS: MetricRecord({"loss": 0.5}),
                                   keys.MSG_COST: MetricRecord({"handler_start": 1.0, "handler_end": 2.0})}),
                       reply_to=msg)

    with task_identity(RUN):
        msg = Message(pack(train_like()), dst_node_id=1, message_type="train")
        reply = pack_mod(msg, site_context(), app)
    assert seen == [list(train_like().keys())]
    assert list(reply.content.keys()) == [keys.PACKED]
    reply.content = unpack(reply.content)
    assert ok(reply) and reply.content.metric_records[keys.METRICS]["loss"] == 0.5
    assert reply.content.metric_records[keys.MSG_COST]["packed"] == 1.0  # the split says it came packed


def test_a_message_that_came_unpacked_is_answered_unpacked():
    def app(msg, context):
        return Message(RecordDict({keys.STATUS: ConfigRecord({"site": "paris", "ok": True}),
                                   keys.METRICS: MetricRecord({"loss": 0.5})}), reply_to=msg)

    with task_identity(RUN):
        reply = pack_mod(Message(train_like(), dst_node_id=1, message_type="train"), site_context(), app)
    assert list(reply.content.keys()) == [keys.STATUS, keys.METRICS]


def test_the_mod_answers_an_unreadable_pack_with_the_sites_failure_and_never_runs_the_app():
    def app(msg, context):
        raise AssertionError("the app must not see an unreadable message")

    with task_identity(RUN):
        msg = Message(RecordDict({keys.PACKED: ConfigRecord({FIELD: b"\x07broken"})}), dst_node_id=1,
                      message_type="train")
        reply = pack_mod(msg, site_context(), app)
    st = reply.content.config_records[keys.STATUS]
    assert st["site"] == "paris" and st["ok"] is False and st["error"].startswith("pack_unreadable:")
