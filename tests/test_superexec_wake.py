"""The SuperNode's wake of its warm SuperExec: a real abstract UNIX socket between two ends, the
SuperNode side sending one wake per stored message (never for an empty pull), the launcher giving
both processes of a site the same fresh name, and the SuperExec asking at once when woken."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from conftest import ROOT, digits_site
from federation.config.supernode_polls import SupernodePolls
from federation.ops import launcher, superexec_wake
from federation.ops import supernode_main as sm
from site_trainer.config import SiteConfig
from test_supernode_polls import Recorder


@pytest.fixture
def name():
    return superexec_wake.new_name("t")


def test_a_wake_ends_the_wait_at_once_and_no_wake_waits_the_timeout(name):
    listener = superexec_wake.listen(name)
    try:
        threading.Timer(0.2, superexec_wake.send, (name,)).start()
        t0 = time.monotonic()
        assert listener.wait(10.0) is True
        assert time.monotonic() - t0 < 5.0  # woken, not timed out
        t0 = time.monotonic()
        assert listener.wait(0.3) is False
        assert time.monotonic() - t0 >= 0.29
    finally:
        listener.close()


def test_wakes_queued_meanwhile_are_taken_by_one_wait(name):
    listener = superexec_wake.listen(name)
    try:
        for _ in range(5):
            superexec_wake.send(name)
        assert listener.wait(0.0) is True
        assert listener.wait(0.05) is False  # all five served by the one ask
    finally:
        listener.close()


def test_without_a_listener_a_wake_is_silent_and_an_unusable_name_gives_none(name):
    superexec_wake.send(name)  # nobody listens: no error (the SuperExec asks on its own)
    assert superexec_wake.listen(None) is None and superexec_wake.listen("") is None
    first = superexec_wake.listen(name)
    try:
        assert superexec_wake.listen(name) is None  # taken: the caller polls at its interval instead
    finally:
        first.close()
    assert superexec_wake.new_name("a") != superexec_wake.new_name("a")


def test_the_supernode_wakes_as_each_messages_objects_start_to_come(name, monkeypatch):
    """Flower's SuperNode creates a message's task, then pulls its objects (pull_objects, which an
    empty pull never reaches): the wake goes out there, once per message, before the objects."""
    monkeypatch.setenv(superexec_wake.WAKE_ENV, name)
    listener = superexec_wake.listen(name)
    woken_before_pull = []

    def pull_objects(object_ids, pull_object_fn, **kw):
        woken_before_pull.append(listener.wait(1.0))
        return {i: b"x" for i in object_ids}

    module = types.SimpleNamespace(time=sm.time, pull_objects=pull_objects, _push_messages=lambda *a, **kw: None)
    sm.apply(SupernodePolls(), module)
    try:
        assert module.pull_objects(["a", "b"], pull_object_fn=None) == {"a": b"x", "b": b"x"}
        assert module.pull_objects([], pull_object_fn=None) == {}
        assert woken_before_pull == [True, True]
        assert listener.wait(0.05) is False  # one wake a message
    finally:
        listener.close()


def test_without_a_wake_name_the_supernode_sends_none(name, monkeypatch):
    monkeypatch.delenv(superexec_wake.WAKE_ENV, raising=False)
    listener = superexec_wake.listen(name)
    module = types.SimpleNamespace(time=sm.time, pull_objects=lambda object_ids, pull_object_fn, **kw: {},
                                   _push_messages=lambda *a, **kw: None)
    sm.apply(SupernodePolls(), module)
    try:
        assert module.pull_objects(["a"], pull_object_fn=None) == {}
        assert listener.wait(0.05) is False
    finally:
        listener.close()


def test_a_flwr_that_pulls_objects_before_creating_the_task_is_named():
    def _pull_and_store_message():
        pull_objects()  # noqa: F821 - read, never run
        state.create_task()  # noqa: F821

    module = types.SimpleNamespace(time=sm.time, _pull_and_store_message=_pull_and_store_message)
    assert f"{sm.MODULE}._pull_and_store_message pulls a message's objects before it creates its task" in \
        sm.differences(module)


class Guard:
    """The site supervisor's two watches, each starting its process once."""

    def watch_supernode(self, site, start, *_):
        return start()

    def watch_superexec(self, site, start, parents):
        return start(parents)


@pytest.mark.parametrize("warm,polls", [(1, SupernodePolls()), (0, SupernodePolls()), (1, SupernodePolls(enabled=False))])
def test_the_launcher_gives_a_sites_supernode_and_warm_superexec_one_fresh_name(warm, polls, tmp_path):
    """Only when the SuperNode runs as supernode_main (polls enabled) is there one to send wakes;
    otherwise the warm SuperExec gets no name and polls at its 0.2 s interval."""
    sup = Recorder()
    site = SiteConfig.model_validate(digits_site(0, "s1", 1))
    launcher.watch_site_node(Guard(), sup, site, "127.0.0.1:1", str(tmp_path / "s.sock"), None, True, {}, warm,
                             polls)
    envs = {name: env for name, _, env in sup.started}
    if warm and not polls.enabled:
        assert all(superexec_wake.WAKE_ENV not in env for env in envs.values()) and "site-s1-superexec" in envs
    elif warm:
        node, exe = envs["site-s1-supernode"], envs["site-s1-superexec"]
        assert node[superexec_wake.WAKE_ENV] == exe[superexec_wake.WAKE_ENV]
        assert node[superexec_wake.WAKE_ENV].startswith("sovfl-superexec-wake-s1-")
    else:
        assert list(envs) == ["site-s1-supernode"] and superexec_wake.WAKE_ENV not in envs["site-s1-supernode"]


def test_flowers_superexec_in_its_place_gets_no_name(tmp_path):
    sup = Recorder()
    launcher.start_superexec(sup, "s1", 1234, 0, wake="w")
    ((_, argv, env),) = sup.started
    assert argv[0].endswith("flower-superexec") and superexec_wake.WAKE_ENV not in env


def test_a_woken_superexec_asks_at_once_not_at_its_idle_poll(name):
    """The warm SuperExec's own loop against a stand-in Runtime API that counts asks and hands out a
    task only once it is woken. Its idle poll is set to a minute, so a task launched within the
    test's deadline was asked for because of the wake; while idle it asked once, not every 0.2 s."""
    script = textwrap.dedent(f"""
        import os, sys, threading, time, types
        sys.path.insert(0, {str(ROOT)!r})
        from federation.ops import flower_exec as fx, superexec_wake, warm_superexec
        superexec_wake.IDLE_POLL_S = 60.0
        asks, launched, ready = [], [], threading.Event()

        class Client:
            def AcquireTask(self, req):
                asks.append(time.monotonic())
                if ready.is_set() and not launched:
                    return types.SimpleNamespace(HasField=lambda f: True, token="tok", task="task")
                return types.SimpleNamespace(HasField=lambda f: False, token="")

            def close(self):
                pass

        class Executor:
            def reconcile(self): pass
            def get_eligible_capacity(self, types_, **kw): return types_, set()
            def close(self): pass

        class Plugin:
            supported_task_types = ["clientapp"]
            def __init__(self, **kw): pass
            def launch_task(self, token, task):
                launched.append(time.monotonic())
                return None

        fx.RuntimeHttpClient = types.SimpleNamespace(from_server_address=lambda **kw: Client())
        fx.AutoExecPlugin = Plugin
        fx._handle_launch_result = lambda *a: None
        fx.register_signal_handlers = lambda **kw: None
        def woke():
            end = time.monotonic() + 60
            while not asks and time.monotonic() < end:
                time.sleep(0.01)
            time.sleep(1.0)  # the loop is in its idle wait by now
            idle_asks = len(asks)
            ready.set()
            superexec_wake.send(os.environ[superexec_wake.WAKE_ENV])
            end = time.monotonic() + 30
            while not launched and time.monotonic() < end:
                time.sleep(0.01)
            print(idle_asks, len(launched), flush=True)
            os._exit(0)
        threading.Thread(target=woke, daemon=True).start()
        warm_superexec.serve("127.0.0.1:1", True, None, Executor())
    """)
    env = {**os.environ, superexec_wake.WAKE_ENV: name, "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    idle_asks, launched = out.stdout.split()
    assert (idle_asks, launched) == ("1", "1"), out.stdout
