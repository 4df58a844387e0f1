"""The SuperNode run by federation/ops/supernode_main.py: its hard-coded sleeps and its object
retry changed as federation.supernode_polls says, the flwr code it changes pinned, and the
launcher's choice of program. (Every end-to-end test runs its sites' SuperNodes this way; tests/test_e2e_warm.py checks
that they do.)"""

from __future__ import annotations

import json
import sys
import types

import pytest
from pydantic import ValidationError

from conftest import digits_site
from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError, pull_objects

from federation.config.supernode_polls import FLOWER_OBJECT_WAIT_S, SUPERNODE_POLLS_ENV, SupernodePolls
from federation.ops import launcher
from federation.ops import supernode_main as sm
from site_trainer.config import SiteConfig


class FakeTime:
    """A `time` that records sleeps instead of sleeping."""

    def __init__(self):
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    def monotonic(self) -> float:
        return 42.0


@pytest.fixture
def fake_time(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(sm, "time", fake)
    return fake


def test_after_a_reply_the_idle_sleep_starts_short_and_grows_back_to_flowers(fake_time):
    clock = sm.PromptClock(SupernodePolls(first_s=0.1, growth=2.0, reply_check_s=0.05))
    clock.sleep(3)  # no reply yet: Flower's sleep
    clock.replied()
    for _ in range(7):
        clock.sleep(3)
    clock.sleep(0.5)  # the reply check
    clock.sleep(1.25)  # any other sleep is left alone
    clock.replied()
    clock.sleep(3)
    assert fake_time.slept == [3.0, 0.1, 0.2, 0.4, 0.8, 1.6, 3.0, 3.0, 0.05, 1.25, 0.1]
    assert clock.monotonic() == 42.0  # everything else is the real module's


def flwr_module(**functions):
    """What apply() changes in flwr's SuperNode module, Flower's own pull_objects among it."""
    return types.SimpleNamespace(time=sm.time, pull_objects=pull_objects, **functions)


def test_apply_changes_only_that_modules_time_and_notes_each_push(fake_time):
    pushed = []
    module = flwr_module(_push_messages=lambda *a, **kw: pushed.append((a, kw)) or "sent")
    clock = sm.apply(SupernodePolls(first_s=0.2), module)
    assert module.time is clock and module._push_messages(1, x=2) == "sent" and pushed == [((1,), {"x": 2})]
    module.time.sleep(3)
    assert fake_time.slept == [0.2]


def test_a_push_that_fails_still_counts_as_a_reply(fake_time):
    def push(*_):
        raise ConnectionError("SuperLink away")

    module = flwr_module(_push_messages=push)
    clock = sm.apply(SupernodePolls(first_s=0.3), module)
    with pytest.raises(ConnectionError):
        module._push_messages()
    clock.sleep(3)
    assert fake_time.slept == [0.3]


def test_an_object_still_being_pushed_is_asked_for_again_on_the_settings_schedule():
    module = flwr_module(_push_messages=lambda: None)
    sm.apply(SupernodePolls(object_retry_s=0.01, object_retry_cap_s=0.04), module)
    assert module.pull_objects.func is pull_objects
    assert module.pull_objects.keywords == {"initial_backoff": 0.01, "backoff_cap": 0.04,
                                            "max_tries_per_object": int(FLOWER_OBJECT_WAIT_S / 0.04)}
    asks = []

    def pull(object_id):  # the SuperLink: the object arrives after its third ask
        asks.append(object_id)
        if len(asks) < 3:
            raise ObjectUnavailableError(object_id)
        return b"content"

    assert module.pull_objects(["obj"], pull_object_fn=pull) == {"obj": b"content"}  # Flower's own loop, our waits
    assert asks == ["obj"] * 3


def test_the_installed_flwr_has_the_sleeps_this_changes():
    assert sm.differences() == [], ("flwr's SuperNode changed; adapt federation/ops/supernode_main.py (or set "
                                    "federation.supernode_polls.enabled: false)")


def test_a_flwr_without_those_sleeps_is_named_and_left_alone():
    def start_client_internal():
        while True:
            _push_messages()  # noqa: F821 - read, never run

    def _push_messages():
        return None

    def old_pull_objects(object_ids, pull_object_fn):
        return {}

    module = types.SimpleNamespace(time=sm.time, start_client_internal=start_client_internal,
                                   _push_messages=_push_messages, pull_objects=old_pull_objects)
    diff = sm.differences(module)
    assert any("pull_objects does not take initial_backoff" in d for d in diff), diff
    assert any("start_client_internal no longer calls time.sleep(3)" in d for d in diff), diff
    assert any("_push_messages no longer calls time.sleep(0.5)" in d for d in diff), diff
    assert sm.differences(types.SimpleNamespace()) == [
        f"{sm.MODULE} has no module-level `time`",
        f"{sm.MODULE}.pull_objects does not take initial_backoff, backoff_cap and max_tries_per_object",
        f"{sm.MODULE} has no function _pull_and_store_message", f"{sm.MODULE} has no function start_client_internal",
        f"{sm.MODULE} has no function _push_messages"]


def test_settings_out_of_range_are_refused_with_the_field_named():
    with pytest.raises(ValidationError, match="first_s"):
        SupernodePolls(first_s=5)
    with pytest.raises(ValidationError, match="reply_check_s"):
        SupernodePolls(reply_check_s=0)
    with pytest.raises(ValidationError, match="growth"):
        SupernodePolls(growth=1.0)
    with pytest.raises(ValidationError, match="object_retry_s"):
        SupernodePolls(object_retry_s=2)
    with pytest.raises(ValidationError, match="object_retry_cap_s .0.1. is below object_retry_s"):
        SupernodePolls(object_retry_s=0.2, object_retry_cap_s=0.1)


class Recorder:
    def __init__(self):
        self.started = []

    def start(self, name, argv, extra_env=None):
        self.started.append((name, argv, extra_env or {}))
        return name


@pytest.mark.parametrize("polls", [SupernodePolls(), SupernodePolls(enabled=False), None])
def test_the_launcher_runs_our_supernode_only_with_polls_enabled(polls, tmp_path):
    sup = Recorder()
    site = SiteConfig.model_validate(digits_site(0, "s1", 1))
    launcher.start_supernode(sup, site, "127.0.0.1:1", str(tmp_path / "s.sock"), insecure=True, polls=polls)
    ((_, argv, env),) = sup.started
    if polls is not None and polls.enabled:
        assert argv[:3] == [sys.executable, "-m", "federation.ops.supernode_main"]
        assert SupernodePolls.model_validate(json.loads(env[SUPERNODE_POLLS_ENV])) == polls
    else:
        assert argv[0].endswith("flower-supernode") and SUPERNODE_POLLS_ENV not in env
    assert "--superlink" in argv and "127.0.0.1:1" in argv
