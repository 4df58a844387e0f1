"""The flwr internals the warm ClientApp executor relies on (federation/ops/flower_exec.py) are those
of the installed flwr; a change in any of them fails here with a message that names it."""

from __future__ import annotations

import functools
import inspect
import re
from pathlib import Path

import pytest

from federation.ops import flower_exec as fx
from federation.ops.warm_executor import WarmClientAppExecutor

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_flwr_has_every_internal_the_warm_executor_uses():
    diff = fx.differences()
    assert diff == [], ("flwr changed what the warm ClientApp executor relies on; adapt "
                        "federation/ops/flower_exec.py (or run sites with federation.warm_clientapps: 0):\n  "
                        + "\n  ".join(diff))
    fx.check()


def test_the_pinned_flwr_is_the_one_the_internals_were_read_from():
    pin = re.search(r'"flwr(?:\[[^\]]*\])?==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin is not None and pin.group(1) == fx.FLWR_VERSION


def test_a_changed_signature_is_named_in_the_error(monkeypatch):
    def run_clientapp(address, token):  # what a new flwr might have
        del address, token

    monkeypatch.setitem(fx.CALLS, "run_clientapp", (run_clientapp, fx.CALLS["run_clientapp"][1]))
    with pytest.raises(fx.FlowerInternalsChanged, match=r"run_clientapp takes \('address', 'token'\)") as err:
        fx.check()
    assert "warm_clientapps: 0" in str(err.value)


def test_the_warm_executor_has_flowers_executor_interface():
    """Every method of flwr's Executor protocol, with its parameters."""
    for name, params in fx.EXECUTOR_METHODS.items():
        assert tuple(inspect.signature(getattr(WarmClientAppExecutor, name)).parameters) == params, name


def test_prompt_object_pulls_keeps_flowers_function_and_only_changes_its_backoff(monkeypatch):
    original = fx.run_clientapp_module.pull_and_inflate_object_from_tree
    monkeypatch.setattr(fx.run_clientapp_module, "pull_and_inflate_object_from_tree", original)
    fx.prompt_object_pulls(0.05, 0.25)
    fx.prompt_object_pulls(0.05, 0.25)  # twice: still one layer over Flower's function
    pull = fx.run_clientapp_module.pull_and_inflate_object_from_tree
    assert isinstance(pull, functools.partial) and pull.func is original
    assert pull.keywords == {"initial_backoff": 0.05, "backoff_cap": 0.25, "max_tries_per_object": 20000}
