"""Flower's SuperNode, asking for its next message soon after each reply: `python -m federation.ops.supernode_main`.

flwr 1.41's SuperNode (flwr/supernode/start_client_internal.py) pulls a message from its
SuperLink, hands it to a ClientApp, checks every 0.5 s whether the reply is there, pushes it and
pulls again; a pull that finds nothing is followed by a 3 s sleep. Both sleeps are hard-coded. In
a round a site's next message (the next stage, the next round) is sent soon after its reply, once
the other sites have replied too, so it finds the SuperNode asleep: each message waits 1.5 s on
average, up to 3 s, before the site even sees it.

This module runs Flower's own SuperNode, same arguments, same code, with those sleeps changed
in its process only, as `federation.supernode_polls` sets them (passed in SUPERNODE_POLLS_ENV):
- after each reply it pushed, the sleep after an empty pull starts at `first_s` and grows by
  `growth` per empty pull up to Flower's 3 s: a message sent t seconds after the reply waits at
  most `first_s` + t x (growth - 1) for the next pull, and a site left idle costs its SuperLink a
  few more pulls, then what it always did;
- the reply check, and the wait for a reply's content, sleep `reply_check_s`, not 0.5 s (each is
  a look at the SuperNode's own memory).
- a message object not at the SuperLink yet is asked for again after `object_retry_s`, the wait
  doubling up to `object_retry_cap_s` (Flower: 1 s doubling to 10 s). The SuperLink hands out a
  message as soon as the coordinator registered it, while the coordinator still pushes the
  stage's objects (two at a time, flwr's http_grid), so a prompt SuperNode finds some of them
  missing; with Flower's 1 s it then waits most of a second for an object that arrives within a
  tenth. The extra asks last only while a push is under way (a few per message), and an object
  still missing after that is asked for no more often than every cap.
- with a wake name in its environment (superexec_wake.py, set by the launcher when the site's
  warm SuperExec serves its Runtime API), each message wakes that SuperExec as its objects start
  to come (its task exists by then), so the SuperExec asks for the task at once instead of at its
  next poll, and its worker starts while the objects arrive, as it would have after a poll.
The sleeps are reached through the module's `time`, `_push_messages` and `pull_objects`, each
looked up when called; `differences()` says when an installed flwr's code no longer has them,
and the SuperNode then runs as Flower ships it, said in one line. Without SUPERNODE_POLLS_ENV it
runs unchanged.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
import time

from federation.config.supernode_polls import (FLOWER_IDLE_SLEEP_S, FLOWER_OBJECT_WAIT_S, FLOWER_REPLY_CHECK_S,
                                               SUPERNODE_POLLS_ENV, SupernodePolls)
from federation.ops.superexec_wake import WAKE_ENV
from federation.ops.superexec_wake import send as send_wake

MODULE = "flwr.supernode.start_client_internal"


class PromptClock:
    """What Flower's SuperNode module sees as `time`: the real module, but for its two sleeps."""

    def __init__(self, polls: SupernodePolls):
        self.polls = polls
        self.next_idle_s = float(FLOWER_IDLE_SLEEP_S)

    def __getattr__(self, name: str):
        return getattr(time, name)

    def replied(self) -> None:
        """A reply was pushed: the next message is likely soon."""
        self.next_idle_s = self.polls.first_s

    def sleep(self, seconds: float) -> None:
        """Flower's idle sleep as the schedule after a reply says, its reply check shortened, others kept."""
        if seconds == FLOWER_IDLE_SLEEP_S:
            seconds = self.next_idle_s
            self.next_idle_s = min(float(FLOWER_IDLE_SLEEP_S), self.next_idle_s * self.polls.growth)
        elif seconds == FLOWER_REPLY_CHECK_S:
            seconds = self.polls.reply_check_s
        time.sleep(seconds)


def differences(module=None) -> list[str]:
    """What in the installed flwr's SuperNode differs from what this module changes (empty: nothing)."""
    module = module or importlib.import_module(MODULE)
    out = []
    if getattr(module, "time", None) is not time:
        out.append(f"{MODULE} has no module-level `time`")
    pull = getattr(module, "pull_objects", None)
    if pull is None or not {"initial_backoff", "backoff_cap", "max_tries_per_object"} <= set(_params(pull)):
        out.append(f"{MODULE}.pull_objects does not take initial_backoff, backoff_cap and max_tries_per_object")
    for fn, needles in (("_pull_and_store_message", ("create_task(", "pull_objects(")),
                        ("start_client_internal", (f"time.sleep({FLOWER_IDLE_SLEEP_S})", "_push_messages(")),
                        ("_push_messages", (f"time.sleep({FLOWER_REPLY_CHECK_S})",))):
        try:
            source = inspect.getsource(getattr(module, fn))
        except (AttributeError, OSError, TypeError):
            out.append(f"{MODULE} has no function {fn}")
            continue
        out += [f"{MODULE}.{fn} no longer calls {needle}" for needle in needles if needle not in source]
        if fn == "_pull_and_store_message" and 0 <= source.find("pull_objects(") < source.find("create_task("):
            out.append(f"{MODULE}.{fn} pulls a message's objects before it creates its task")
    return out


def apply(polls: SupernodePolls, module=None) -> PromptClock:
    """Change the SuperNode's sleeps in this process (module docstring)."""
    module = module or importlib.import_module(MODULE)
    clock = PromptClock(polls)
    push = module._push_messages

    def push_and_note(*args, **kwargs):
        try:
            return push(*args, **kwargs)
        finally:
            clock.replied()

    module.time = clock
    module._push_messages = push_and_note
    pull = functools.partial(
        module.pull_objects, initial_backoff=polls.object_retry_s, backoff_cap=polls.object_retry_cap_s,
        max_tries_per_object=max(1, int(FLOWER_OBJECT_WAIT_S / polls.object_retry_cap_s)))
    wake = os.environ.get(WAKE_ENV)
    if wake:
        def wake_and_pull(*args, **kwargs):
            send_wake(wake)  # the message's task was just created (differences() checks that order)
            return pull(*args, **kwargs)

        module.pull_objects = wake_and_pull
    else:
        module.pull_objects = pull
    return clock


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def main() -> None:
    """Apply the polls from SUPERNODE_POLLS_ENV (if the flwr allows), then run Flower's SuperNode."""
    from flwr.supernode.cli import flower_supernode

    raw = os.environ.get(SUPERNODE_POLLS_ENV)
    polls = SupernodePolls.model_validate(json.loads(raw)) if raw else SupernodePolls(enabled=False)
    if polls.enabled:
        diff = differences()
        if diff:
            print(f"sovfl supernode: the SuperNode sleeps as Flower ships it (3 s after an empty pull): "
                  f"{'; '.join(diff)}", file=sys.stderr, flush=True)
        else:
            apply(polls)
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
