"""The coordinator's stage test hook (federation/coordinator/stage_hook.py): inert without its
environment variables, an announcement per stage with it, a pause only at the stage asked for."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from federation.coordinator import stage_hook


def _state(rnd: int, setups=None) -> SimpleNamespace:
    return SimpleNamespace(inp=SimpleNamespace(ctx=SimpleNamespace(round=rnd)), setups=setups)


def test_inert_without_its_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(stage_hook.HOOK, raising=False)
    monkeypatch.setenv(stage_hook.PAUSE, "1:train")  # a pause alone does nothing either
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    stage_hook.entered("train", _state(1))
    assert time.monotonic() - t0 < 1.0 and list(tmp_path.iterdir()) == []


def test_announces_stages_with_secagg_key_material_and_pauses_at_the_one_asked(tmp_path, monkeypatch):
    hook = tmp_path / "stages.jsonl"
    monkeypatch.setenv(stage_hook.HOOK, str(hook))
    monkeypatch.setenv(stage_hook.PAUSE, "2:secagg stage 4")
    monkeypatch.setattr(stage_hook, "PAUSE_S", 0.3)
    plan = SimpleNamespace(ctx=SimpleNamespace(digest=lambda: b"\x01\x02"))
    setups = SimpleNamespace(plan=plan, setups={"a": (b"setup-a", None), "b": (b"setup-b", None)})
    timings = []
    for rnd, stage in ((1, "secagg stage 4"), (2, "secagg stage 3 (train)"), (2, "secagg stage 4")):
        t0 = time.monotonic()
        stage_hook.entered(stage, _state(rnd, setups))
        timings.append(time.monotonic() - t0)
    lines = [json.loads(x) for x in hook.read_text().splitlines()]
    assert [(x["round"], x["stage"]) for x in lines] == [(1, "secagg stage 4"), (2, "secagg stage 3 (train)"),
                                                         (2, "secagg stage 4")]
    assert lines[0]["secagg_ctx"] == "0102" and sorted(lines[0]["setups"]) == ["a", "b"]
    assert lines[0]["setups"]["a"] != lines[0]["setups"]["b"]
    assert timings[0] < 0.25 and timings[1] < 0.25 and timings[2] >= 0.3
