"""Downlink compression in process: the coordinator's side (a real `Coordinator`, no Grid needed to
build messages) and the site's side (`reconstruct`, and the relay's receive path with its reference
file), joined through real Flower records."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import RecordDict

from federation.protocol.codecs import UpdateSpec
from federation.config.schema import parse_config
from federation.coordinator.driver import Coordinator, Site
from federation.protocol.downlink_steps import DownlinkError, reconstruct
from federation.protocol.message_keys import DOWNLINK as RECORD
from federation.protocol.message_keys import DOWNLINK_TARGET
from federation.protocol.message_keys import MODEL_DIGEST as DIGEST_KEY
from federation.site.downlink_mod import offer_held, receive_global
from federation.site.trainer_call import TrainerFailed
from federation.site.site_store import ReferenceStore
from federation.protocol.payload_records import from_records, to_records
from site_trainer import handoff

SHAPES = {"0.weight": (32, 64), "0.bias": (32,), "2.weight": (10, 32), "2.bias": (10,)}
DENSE = 4 * sum(int(np.prod(s)) for s in SHAPES.values())


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in SHAPES.items()}


def moved(m: dict[str, np.ndarray], step: int, scale: float = 0.01) -> dict[str, np.ndarray]:
    """The next global model (a new dict, as the server optimizer returns)."""
    rng = np.random.default_rng(1000 + step)
    return {k: (v + rng.normal(0, scale, v.shape)).astype(np.float32) for k, v in m.items()}


def coordinator(tmp_path, downlink: str, sites=("a", "b", "c")) -> Coordinator:
    cfg = parse_config({"federation": {"name": "dl", "downlink_codec": downlink, "evaluate": False},
                        "sites": [{"id": s, "partition": i} for i, s in enumerate(sites)]})
    coord = Coordinator(None, cfg, tmp_path / "coord", 1, model())  # no Grid: only messages are built
    coord.sites = {i + 1: Site(i + 1, s, 100) for i, s in enumerate(sites)}
    return coord


class SiteSide:
    """What a site's relay does with a model message, kept in memory: reconstruct, then report."""

    def __init__(self, node: int):
        self.node, self.held = node, None

    def receive(self, rd: RecordDict, coord: Coordinator | None = None) -> dict[str, np.ndarray]:
        arrays, digest = reconstruct(from_records(rd, "global", RECORD), self.held)
        self.held = (digest, arrays)
        if coord is not None:  # the digest travels in the reply's status
            coord.downlink.heard(self.node, {DIGEST_KEY: digest})
        return arrays


def test_off_by_default_sends_the_dense_model_without_downlink_record(tmp_path):
    coord = coordinator(tmp_path, "identity")
    rd = coord.model_message(1, 30)(1)
    assert RECORD not in rd.config_records and "config" in rd.config_records
    got = from_records(rd, "global").arrays
    assert all(np.array_equal(got[k], coord.model[k]) for k in SHAPES)
    line = coord.downlink.round_metrics()
    assert line["modes"] == {"dense": 1} and line["dense_bytes"] == DENSE
    assert DENSE < line["bytes"]["a"] < DENSE + 200 * len(SHAPES)  # float32 data plus each array's header


@pytest.mark.parametrize("spec", ["int8", "fp16", "topk:0.1+int8", "randk:0.25+int4:clip=0.05"])
def test_site_holds_the_coordinator_reference_bit_for_bit(tmp_path, spec):
    """First the full model (exact), then encoded steps: after each, the site's model equals the
    coordinator's reference in every bit, and the messages of sites in the same state are shared."""
    coord = coordinator(tmp_path, spec)
    sites = {n: SiteSide(n) for n in (1, 2)}
    for version in range(6):
        if version:
            coord.model = moved(coord.model, version)
        content = coord.model_message(version + 1, 30)
        rds = {n: content(n) for n in sites}
        assert rds[1]["global"] is rds[2]["global"]  # serialized once per stage
        for n, site in sites.items():
            got = site.receive(rds[n], coord)
            assert site.held[0] == coord.downlink.digest
            assert all(np.array_equal(got[k], coord.downlink.reference[k]) for k in SHAPES)
            if version == 0:  # the full model: lossless
                assert all(np.array_equal(got[k], coord.model[k]) for k in SHAPES)
        line = coord.downlink.round_metrics()
        assert line["modes"] == ({"full": 2} if version == 0 else {"steps": 2})
        if version and spec == "int8":
            assert all(b * 3 < DENSE for b in line["bytes"].values()) and line["ratio"] > 3


def test_int8_error_is_bounded_by_one_step_and_does_not_accumulate(tmp_path):
    coord = coordinator(tmp_path, "int8")
    site = SiteSide(1)
    site.receive(coord.model_message(1, 30)(1), coord)
    worst = []
    for version in range(1, 31):
        before = site.held[1]
        coord.model = moved(coord.model, version)
        got = site.receive(coord.model_message(version, 30)(1), coord)
        flat = UpdateSpec.of(got).flatten  # int8 blocks run over the flat vector in sorted-name order
        delta = flat(coord.model) - flat(before)
        err = np.abs(flat(got) - flat(coord.model))
        for start in range(0, delta.size, 128):  # below the block's scale max|delta|/127 (+ rounding)
            bound = np.abs(delta[start:start + 128]).max() / 127
            assert err[start:start + 128].max() <= bound * 1.001 + 1e-7
        worst.append(max(float(np.abs(got[k] - coord.model[k]).max()) for k in SHAPES))
    assert max(worst[-10:]) <= 1.5 * max(worst[:10])  # the residual is re-sent, not piled up


def test_sites_behind_get_the_missed_steps_and_others_the_full_model(tmp_path):
    coord = coordinator(tmp_path, "int8")
    a, b, c = SiteSide(1), SiteSide(2), SiteSide(3)
    first = coord.model_message(1, 30)
    a.receive(first(1), coord)
    b.receive(first(2), coord)
    for version in (1, 2):  # b misses two model versions
        coord.model = moved(coord.model, version)
        a.receive(coord.model_message(version + 1, 30)(1), coord)
    content = coord.model_message(3, 30)  # the model did not change: a holds it already
    rd_a, rd_b, rd_c = content(1), content(2), content(3)
    assert rd_a[RECORD]["mode"] == "hold" and not rd_a["global"]
    assert rd_b[RECORD]["mode"] == "steps" and rd_b[RECORD]["steps"] == 2
    assert rd_c[RECORD]["mode"] == "full"  # never had a model
    a.receive(rd_a, coord)
    b.receive(rd_b, coord)
    c.receive(rd_c, coord)
    assert a.held[0] == b.held[0] == c.held[0] == coord.downlink.digest
    # a site whose reply failed reported nothing: it may hold anything, so it gets the full model
    coord.model = moved(coord.model, 3)
    coord.model_message(4, 30)(1)  # sent, no reply
    assert coord.model_message(5, 30)(1)[RECORD]["mode"] == "full"
    coord.downlink.heard(2, {DIGEST_KEY: "0" * 32})  # reports a model the coordinator never made
    assert coord.model_message(5, 30)(2)[RECORD]["mode"] == "full"


def _steps_message(tmp_path) -> tuple[RecordDict, SiteSide]:
    coord = coordinator(tmp_path, "int8")
    site = SiteSide(1)
    site.receive(coord.model_message(1, 30)(1), coord)
    coord.model = moved(coord.model, 1)
    return coord.model_message(2, 30)(1), site


def _corrupt(rd: RecordDict, key: str, fn) -> RecordDict:
    payload = from_records(rd, "global", RECORD)
    if key in payload.arrays:
        payload.arrays[key] = fn(payload.arrays[key])
    else:
        fn(payload.meta)
    return to_records(payload, "global", RECORD)


MALFORMED = [
    ("truncated values", "0/values", lambda a: a[:-5], "step 0 does not decode.*truncated"),
    ("NaN scale", "0/scales", lambda a: np.where(np.arange(a.size) == 3, np.nan, a).astype(np.float32),
     "step 0 does not decode.*NaN"),
    ("wrong base", "meta", lambda m: m.__setitem__("0.base", "f" * 32), "steps apply to model.*but this site holds"),
    ("wrong target", "meta", lambda m: m.__setitem__("target", "e" * 32), "reconstructed model has digest"),
    ("unknown mode", "meta", lambda m: m.__setitem__("mode", "patch"), "unknown mode 'patch'"),
    ("no target", "meta", lambda m: m.pop("target"), "without a valid 'target'"),
    ("step count", "meta", lambda m: m.__setitem__("steps", 0), "'steps' must be an int"),
]


@pytest.mark.parametrize("label,key,fn,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_downlink_message_is_a_clear_site_error(tmp_path, label, key, fn, message):
    rd, site = _steps_message(tmp_path)
    held = site.held
    with pytest.raises(DownlinkError, match=message):
        site.receive(_corrupt(rd, key, fn))
    assert site.held is held  # nothing changed on the site


def test_relay_keeps_the_reference_in_the_workdir(tmp_path):
    """receive_global: dense messages go through a temporary shared-memory file; downlink messages
    rebuild the model in the reference file (which the trainer reads in place), survive a new
    relay process, and a bad one leaves the reference untouched."""
    coord = coordinator(tmp_path, "int8")
    store_dir = tmp_path / "site" / "downlink"
    first = receive_global(coord.model_message(1, 30)(1), "a", lambda: store_dir)
    coord.downlink.heard(1, first.status)
    path = first.handle.path
    assert path.startswith(str(store_dir)) and not first.temporary
    assert all(np.array_equal(v, coord.model[k]) for k, v in handoff.map_arrays(first.handle).items())
    coord.model = moved(coord.model, 1)
    rd = coord.model_message(2, 30)(1)
    bad = _corrupt(rd, "0/values", lambda a: a[:-1])
    with pytest.raises(DownlinkError):
        receive_global(bad, "a", lambda: store_dir)
    assert ReferenceStore(store_dir).load()[0] == first.status[DIGEST_KEY]
    second = receive_global(rd, "a", lambda: store_dir)
    assert second.status[DIGEST_KEY] == coord.downlink.digest != first.status[DIGEST_KEY]
    got = handoff.map_arrays(second.handle)
    assert list(got) == list(SHAPES)  # the trainer checks tensor order
    assert all(np.array_equal(got[k], coord.downlink.reference[k]) for k in SHAPES)
    assert sorted(p.name for p in store_dir.iterdir()) == sorted(["reference.json", second.handle.path.split("/")[-1]])
    coord.downlink.heard(1, second.status)
    third = receive_global(coord.model_message(2, 30)(1), "a", lambda: store_dir)  # hold
    assert third.handle.path == second.handle.path
    third.release()
    assert ReferenceStore(store_dir).load()[0] == coord.downlink.digest  # release keeps the reference
    dense = receive_global(coordinator(tmp_path / "x", "identity").model_message(1, 30)(1), "a", lambda: store_dir)
    assert dense.temporary and dense.status == {}
    dense.release()
    with pytest.raises(FileNotFoundError):
        handoff.map_arrays(dense.handle)


class _Holds:
    """A trainer that shows the model it holds (`export`), counting the calls; `fail`: it cannot."""

    def __init__(self, arrays: dict[str, np.ndarray] | None, fail: bool = False):
        self.arrays, self.fail, self.calls = arrays, fail, 0

    def export(self, timeout_s: float):
        self.calls += 1
        if self.fail:
            raise TrainerFailed("trainer at /x.sock did not answer Export within 5s")
        return handoff.write_arrays(self.arrays, tag="test-export") if self.arrays is not None else None


def test_a_site_holding_the_starting_model_says_so_at_discovery_and_round_1_sends_none(tmp_path):
    """offer_held: the trainer's model, bit for bit the coordinator's, becomes the site's reference and
    the discovery status says so; the coordinator's next message to it is `hold` (no arrays), which
    the site turns into that very model; asked again, the store answers without the trainer."""
    coord = coordinator(tmp_path, "int8")
    target = coord.downlink_target()[DOWNLINK_TARGET]
    store_dir = tmp_path / "site" / "downlink"
    trainer = _Holds(model())
    held, what = offer_held(trainer, lambda: store_dir, target, 5.0)
    assert held == {DIGEST_KEY: target} and "is not sent" in what and trainer.calls == 1
    assert not any(p.name.startswith("sovfl-test-export") for p in handoff.scratch_dir().iterdir())  # unlinked
    coord.downlink.heard(1, held)
    rd = coord.model_message(1, 30)(1)
    assert len(rd.array_records["global"]) == 0 and rd.config_records[RECORD]["mode"] == "hold"
    glob = receive_global(rd, "a", lambda: store_dir)
    assert all(np.array_equal(v, coord.model[k]) for k, v in handoff.map_arrays(glob.handle).items())
    assert glob.status == {DIGEST_KEY: target}
    again, what = offer_held(trainer, lambda: store_dir, target, 5.0)
    assert again == held and trainer.calls == 1 and "its reference" in what
    assert coord.downlink.round_metrics()["modes"] == {"hold": 1}


@pytest.mark.parametrize("trainer,needle", [
    (_Holds(model(seed=1)), "is not the coordinator's"),  # another starting point: the model is sent
    (_Holds(None), "shows no model"),
    (_Holds(model(), fail=True), "did not answer Export"),
    (object(), "no export"),  # a user's trainer written without it
], ids=["other-model", "none", "trainer-failed", "no-export"])
def test_a_site_that_cannot_show_the_starting_model_is_sent_it(tmp_path, trainer, needle):
    coord = coordinator(tmp_path, "int8")
    target = coord.downlink_target()[DOWNLINK_TARGET]
    store_dir = tmp_path / "site" / "downlink"
    held, what = offer_held(trainer, lambda: store_dir, target, 5.0)
    assert held == {} and needle in what and "the model is sent" in what
    assert ReferenceStore(store_dir).load() is None  # nothing kept
    coord.downlink.heard(1, held)
    assert coord.model_message(1, 30)(1).config_records[RECORD]["mode"] == "full"


def test_a_site_whose_store_cannot_be_found_is_sent_the_model(tmp_path):
    def nowhere():
        raise TrainerFailed("cannot find the site's workdir for its store")
    held, what = offer_held(_Holds(model()), nowhere, "ab" * 16, 5.0)
    assert held == {} and "cannot find the site's workdir" in what and "the model is sent" in what


def test_raw_bf16_words_are_held_as_the_coordinator_s_float32_reference(tmp_path):
    """A bf16 model travels as raw words; the coordinator's reference is their exact float32, and so
    is what the site keeps of its trainer's export."""
    words = {k: (v.view(np.uint32) >> 16).astype("<u2") for k, v in model().items()}
    cfg = parse_config({"federation": {"name": "dl", "downlink_codec": "int8", "evaluate": False},
                        "sites": [{"id": "a", "partition": 0}]})
    coord = Coordinator(None, cfg, tmp_path / "coord", 1, words)
    target = coord.downlink_target()[DOWNLINK_TARGET]
    held, _ = offer_held(_Holds(words), lambda: tmp_path / "site", target, 5.0)
    assert held == {DIGEST_KEY: target}
    kept = ReferenceStore(tmp_path / "site").load()[1]
    assert all(kept[k].dtype == np.float32 and np.array_equal(kept[k], coord.downlink.reference[k]) for k in words)


def test_without_a_downlink_codec_discovery_names_no_model(tmp_path):
    assert coordinator(tmp_path, "identity").downlink_target() == {}
