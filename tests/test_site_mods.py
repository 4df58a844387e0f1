"""The site as a trainer call wrapped in mods: the codec residual stays in the site's own store.

Against a real trainer endpoint (site_trainer.endpoint over a Unix socket, tensors through hand-off
files, a numpy handler instead of torch ranks): the ClientApp never sends the trainer any state and
never calls PutState, the residual is written to <workdir>/residual/ and read back in the next round
by a fresh ClientApp process, also after a SuperNode restart (a new context, nothing in
context.state), and it is exactly what the codec did not send. The in-process federation then runs
the real coordinator strategies against these mods (benchmarks/_fedsim.py does the same at scale).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto

from federation.ops.inprocess import FunctionTrainer, InProcessSite, task_identity, wire
from federation.protocol import message_keys as keys
from federation.protocol.codecs import UpdateSpec, parse_codec
from federation.protocol.payload_records import from_records, to_array
from federation.protocol.pipeline import RoundContext
from federation.protocol.round_config import RoundConfig
from federation.protocol.update_codec import CodecStage
from federation.site.client_app import build_client_app
from federation.site.codec_mod import encode_update
from federation.site.site_store import SiteStore
from site_trainer import endpoint, handoff

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._fedsim import RUN_ID, coordinator  # noqa: E402

CODEC = "topk:0.1+int8"
SHAPES = {"w": (12, 8), "b": (8,)}


def update_for(rnd: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rnd)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


class FakeService:
    """The trainer service's endpoint, answered by numpy: records every method and request."""

    def __init__(self, tmp_path):
        self.workdir, self.calls = tmp_path / "site", []
        self.socket = str(tmp_path / "t.sock")
        self.server = endpoint.serve(self.socket, self.handle)

    def handle(self, method: str, req: dict) -> dict:
        self.calls.append((method, dict(req)))
        if method == "Info":
            return {"ok": True, "num_examples": 10, "ranks": 1, "workdir": str(self.workdir)}
        if method == "Train":
            glob = handoff.map_arrays(handoff.Handle.from_json(req["global"]))
            assert set(glob) == set(SHAPES)
            h = handoff.write_arrays(update_for(int(req["round"])), tag="upd", directory=self.workdir)
            return {"ok": True, "update": h.to_json(), "num_examples": 10, "metrics": {"loss": 1.0}, "rank_digests": ["d"]}
        return {"ok": False, "error": f"unexpected method {method}"}


@pytest.fixture
def service(tmp_path):
    svc = FakeService(tmp_path)
    svc.workdir.mkdir()
    yield svc
    svc.server.stop(0)


def new_context(service: FakeService, **node_config) -> bytes:
    """A SuperNode's context (started afresh: nothing in its state)."""
    node_config = {"site-id": "a", "trainer-socket": service.socket, **node_config}
    return context_to_proto(Context(run_id=7, node_id=3, node_config=node_config, state=RecordDict(), run_config={}))


def train_message(rnd: int, aggregated: list[str] | None = None) -> Message:
    config = RoundConfig(round=rnd, federation="f", codec=CODEC, error_feedback=True, seed=99, deadline_s=20,
                         aggregated=aggregated or [])
    glob = ArrayRecord({k: to_array(np.zeros(s, np.float32)) for k, s in SHAPES.items()})
    with task_identity(7):
        msg = Message(RecordDict({keys.CONFIG: config.to_record(), keys.GLOBAL: glob}), dst_node_id=3,
                      message_type="train", ttl=60)
    msg.metadata.__dict__["_message_id"] = f"m{rnd}"
    return wire(msg)


def run(app, ctx_proto: bytes, rnd: int, aggregated: list[str] | None = None) -> tuple[Message, bytes]:
    """One message through a fresh ClientApp process: the reply and the context the SuperNode keeps."""
    ctx = context_from_proto(ctx_proto)
    reply = app(train_message(rnd, aggregated), ctx)
    return reply, context_to_proto(ctx)


def test_residual_lives_in_the_site_store_and_never_goes_to_the_trainer(service):
    app = build_client_app()  # the deployment's: the trainer service over its socket
    ctx = new_context(service)
    reply, ctx = run(app, ctx, 1)
    assert reply.content.config_records[keys.STATUS]["ok"], reply.content.config_records[keys.STATUS]["error"]
    metrics = reply.content.metric_records[keys.METRICS]
    assert metrics["state_arrays_in"] == 0 and metrics["upload_bytes"] * 4 < metrics["dense_bytes"]
    store = SiteStore(service.workdir)
    kept = {k: np.array(v) for k, v in store.residual.load(before=2).items()}
    assert set(kept) == set(SHAPES)
    assert json.loads((service.workdir / "residual" / "residual-1.json").read_text())["round"] == 1
    # the residual is exactly what the codec did not send: update - decoded(sent)
    sent = from_records(reply.content, keys.UPDATE, keys.UPDATE_META)
    decoded = CodecStage(parse_codec(CODEC, error_feedback=True), layout=UpdateSpec.of(kept)).decode(
        sent, RoundContext("f", 7, 1, "a", 99)).arrays
    for k, v in update_for(1).items():
        np.testing.assert_allclose(decoded[k] + kept[k], v, rtol=0, atol=1e-5)

    # round 2 after a SuperNode restart: a new context; the residual comes from the store
    reply, _ = run(app, new_context(service), 2)
    assert reply.content.metric_records[keys.METRICS]["state_arrays_in"] == len(SHAPES)
    assert json.loads((service.workdir / "residual" / "residual-2.json").read_text())["round"] == 2
    assert store.residual.rounds() == [1, 2]  # round 1's stays for a rerun of round 2

    methods = [m for m, _ in service.calls]
    assert "PutState" not in methods and methods.count("Train") == 2
    trains = [req for m, req in service.calls if m == "Train"]
    assert all("with_state" not in req for req in trains)  # the trainer is never asked for a residual
    assert all(req["config"]["codec"] == CODEC and req["round"] in (1, 2) for req in trains)


def test_a_rerun_round_starts_from_the_residual_its_first_attempt_started_from(service):
    """A coordinator resumed after its sites encoded round 2 asks for round 2 again: the site sends
    exactly what the first attempt sent (not the dead attempt's residual folded in twice), and the
    round after it reads the rerun's residual. Rounding is seeded so two encodes can be compared."""
    app, seeded = build_client_app(), {"codec-site-seed": "5"}

    def sent(rnd: int) -> tuple[dict, float]:
        reply, _ = run(app, new_context(service, **seeded), rnd)
        payload = from_records(reply.content, keys.UPDATE, keys.UPDATE_META)
        return {k: np.array(v) for k, v in payload.arrays.items()}, \
            reply.content.metric_records[keys.METRICS]["state_arrays_in"]

    store = SiteStore(service.workdir)
    sent(1)
    first, used = sent(2)
    after_first = {k: np.array(v) for k, v in store.residual.load(before=3).items()}
    again, used_again = sent(2)  # the rerun
    assert used == used_again == len(SHAPES)
    assert first.keys() == again.keys() and all(np.array_equal(first[k], again[k]) for k in first)
    after_rerun = store.residual.load(before=3)
    assert all(np.array_equal(after_first[k], after_rerun[k]) for k in after_first)
    # what the rerun would have sent from the dead attempt's residual (no rewind) is another payload
    cfg = RoundConfig(round=2, federation="f", codec=CODEC, error_feedback=True, seed=99, deadline_s=20)
    stale, _, _ = encode_update(update_for(2), after_first, cfg, RoundContext("f", 7, 2, "a", 99), site_seed=5)
    assert not all(np.array_equal(first[k], np.asarray(stale.arrays[k])) for k in first)

    for rnd in (3, 4, 5):
        sent(rnd)
    assert store.residual.rounds() == [3, 4, 5]  # the newest three; older files are gone
    assert len(list((service.workdir / "residual").glob("sovfl-residual-*"))) == 3
    sent(4)  # a rerun after a fallback to an older checkpoint drops the dead timeline's round 5
    assert store.residual.rounds() == [3, 4]


def test_an_update_encoded_but_never_aggregated_leaves_no_trace_in_the_residual(service):
    """Round 2's update was encoded, then its SecAgg round aborted: the coordinator says the site's
    last aggregated round is 1, and round 3 is encoded from round 1's residual, exactly as by a site
    that sat round 2 out."""
    app, seeded = build_client_app(), {"codec-site-seed": "5"}
    store = SiteStore(service.workdir)
    run(app, new_context(service, **seeded), 1, ["a:0", "b:0"])
    after_1 = {k: np.array(v) for k, v in store.residual.load(before=2).items()}
    run(app, new_context(service, **seeded), 2, ["a:1", "b:1"])  # encoded; the round then aborted
    assert store.residual.rounds() == [1, 2]
    reply, _ = run(app, new_context(service, **seeded), 3, ["a:1", "b:1"])
    sent = {k: np.array(v) for k, v in from_records(reply.content, keys.UPDATE, keys.UPDATE_META).arrays.items()}
    cfg = RoundConfig(round=3, federation="f", codec=CODEC, error_feedback=True, seed=99, deadline_s=20)
    want, _, _ = encode_update(update_for(3), after_1, cfg, RoundContext("f", 7, 3, "a", 99), site_seed=5)
    assert all(np.array_equal(sent[k], np.asarray(want.arrays[k])) for k in sent)
    # without the rewind, round 2's residual would have been used: another payload
    stale, _, _ = encode_update(update_for(3), store.residual.load(before=3), cfg, RoundContext("f", 7, 3, "a", 99),
                                site_seed=5)
    assert not all(np.array_equal(sent[k], np.asarray(stale.arrays[k])) for k in sent)
    # a site never aggregated (0) starts afresh; a malformed entry reads as "not aggregated"
    assert RoundConfig(round=3, aggregated=["a:0"]).aggregated_round("a") == 0
    assert RoundConfig(round=3, aggregated=["a:x", "b:2"]).aggregated_round("a") == 0
    assert RoundConfig(round=3).aggregated_round("a") is None
    assert store.residual.load(before=3, at=0) == {} and store.residual.load(before=3, at=7) == {}


def test_the_last_aggregated_residual_outlives_any_run_of_lost_rounds(service):
    """Round 1 aggregated, then rounds 2-5 encoded and lost (aborted, or the site's reply came too
    late): round 6 is still encoded from round 1's residual, though the store keeps only the newest
    3 others (make soak found madrid, lost for 3 rounds, encoding its 4th from nothing)."""
    app, seeded = build_client_app(), {"codec-site-seed": "5"}
    store = SiteStore(service.workdir)
    run(app, new_context(service, **seeded), 1, ["a:0"])
    after_1 = {k: np.array(v) for k, v in store.residual.load(before=2).items()}
    for rnd in (2, 3, 4, 5):
        run(app, new_context(service, **seeded), rnd, ["a:1"])
    assert store.residual.rounds() == [1, 3, 4, 5]
    reply, _ = run(app, new_context(service, **seeded), 6, ["a:1"])
    assert reply.content.metric_records[keys.METRICS]["state_arrays_in"] == len(SHAPES)
    sent = {k: np.array(v) for k, v in from_records(reply.content, keys.UPDATE, keys.UPDATE_META).arrays.items()}
    cfg = RoundConfig(round=6, federation="f", codec=CODEC, error_feedback=True, seed=99, deadline_s=20)
    want, _, _ = encode_update(update_for(6), after_1, cfg, RoundContext("f", 7, 6, "a", 99), site_seed=5)
    assert all(np.array_equal(sent[k], np.asarray(want.arrays[k])) for k in sent)
    run(app, new_context(service, **seeded), 7, ["a:6"])  # round 6 aggregated: round 1's may go now
    assert store.residual.rounds() == [5, 6, 7]


def test_in_process_federation_runs_the_real_round_with_the_mods(tmp_path):
    """Two simulated sites with a codec: the coordinator's PlainRound decodes what their mods encoded,
    and each site's residual store fills (benchmarks/_fedsim.py runs the same at scale)."""
    model = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    trainers = [FunctionTrainer(lambda glob, cfg, s=s: ({k: v + s for k, v in update_for(cfg.round).items()}, {"loss": 0.5}),
                                10 * (s + 1), tmp_path / f"site{s}") for s in range(2)]
    sites = [InProcessSite(f"site{s}", s + 1, t, run_id=RUN_ID) for s, t in enumerate(trainers)]
    with task_identity(RUN_ID):
        coord = coordinator(tmp_path, model, sites, codec="int8", error_feedback=True, rounds=2)
        lines = [coord.run_round(r) for r in (1, 2)]
    assert [x["status"] for x in lines] == ["aggregated", "aggregated"]
    assert [x["sites"]["site0"]["state_arrays_in"] for x in lines] == [0, len(SHAPES)]
    assert all((tmp_path / f"site{s}" / "residual" / "residual-2.json").exists() for s in range(2))
    assert all(x["sites"][f"site{s}"]["upload_bytes"] < x["sites"][f"site{s}"]["dense_bytes"] for x in lines for s in range(2))
