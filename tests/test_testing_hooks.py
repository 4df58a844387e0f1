"""The test seam (federation/protocol/testing_hooks.py): the coordinator's stage hook is inert
without its environment variables, announces each stage with them and pauses only at the stage
asked for; a site's `absent-rounds` is off unless set."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from federation.protocol import testing_hooks
from federation.protocol.testing_hooks import absent


def _state(rnd: int, setups=None) -> SimpleNamespace:
    return SimpleNamespace(inp=SimpleNamespace(ctx=SimpleNamespace(round=rnd)), setups=setups)


def test_inert_without_its_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(testing_hooks.STAGE_HOOK, raising=False)
    monkeypatch.setenv(testing_hooks.STAGE_PAUSE, "1:train")  # a pause alone does nothing either
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    testing_hooks.stage_entered("train", _state(1))
    assert time.monotonic() - t0 < 1.0 and list(tmp_path.iterdir()) == []


def test_announces_stages_with_secagg_key_material_and_pauses_at_the_one_asked(tmp_path, monkeypatch):
    hook = tmp_path / "stages.jsonl"
    monkeypatch.setenv(testing_hooks.STAGE_HOOK, str(hook))
    monkeypatch.setenv(testing_hooks.STAGE_PAUSE, "2:secagg stage 4")
    monkeypatch.setattr(testing_hooks, "PAUSE_S", 0.3)
    plan = SimpleNamespace(ctx=SimpleNamespace(digest=lambda: b"\x01\x02"))
    setups = SimpleNamespace(plan=plan, setups={"a": (b"setup-a", None), "b": (b"setup-b", None)})
    timings = []
    for rnd, stage in ((1, "secagg stage 4"), (2, "secagg stage 3 (train)"), (2, "secagg stage 4")):
        t0 = time.monotonic()
        testing_hooks.stage_entered(stage, _state(rnd, setups))
        timings.append(time.monotonic() - t0)
    lines = [json.loads(x) for x in hook.read_text().splitlines()]
    assert [(x["round"], x["stage"]) for x in lines] == [(1, "secagg stage 4"), (2, "secagg stage 3 (train)"),
                                                         (2, "secagg stage 4")]
    assert lines[0]["secagg_ctx"] == "0102" and sorted(lines[0]["setups"]) == ["a", "b"]
    assert lines[0]["setups"]["a"] != lines[0]["setups"]["b"]
    assert timings[0] < 0.25 and timings[1] < 0.25 and timings[2] >= 0.3


def test_absent_rounds_names_the_rounds_a_site_sits_out_and_nothing_else():
    cfg = {"absent-rounds": "3, 7"}
    assert absent(cfg, 3) and "absent from round 3" in absent(cfg, 3)
    assert absent(cfg, 7) is not None
    assert absent(cfg, 4) is None
    assert absent({}, 3) is None and absent({"absent-rounds": ""}, 1) is None
