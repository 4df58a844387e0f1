"""The site supervisor's restart rules on real (small) child processes: back-off, budget, give-up,
cleanup before a restart, the SuperNode key hold, and the SuperLink link watch."""

from __future__ import annotations

import socket
import sys
import time

import pytest
from pydantic import ValidationError

from federation.config.restart_config import SiteRestarts
from federation.ops import site_supervisor
from federation.ops.launcher import Supervisor
from federation.ops.site_supervisor import SiteSupervisor, trainer_cleanup

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
CRASH = [sys.executable, "-c", "raise SystemExit(3)"]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _wait_dead(proc, timeout_s: float = 20) -> None:
    end = time.monotonic() + timeout_s
    while proc.alive():
        assert time.monotonic() < end
        time.sleep(0.02)


@pytest.fixture
def sup(tmp_path):
    s = Supervisor(tmp_path)
    yield s
    s.close()


def test_policy_backoff_doubles_up_to_its_cap_and_refuses_a_cap_below_the_start():
    p = SiteRestarts(backoff_s=1, backoff_max_s=5)
    assert [p.delay(n) for n in range(5)] == [1, 2, 4, 5, 5]
    with pytest.raises(ValidationError, match="backoff_max_s"):
        SiteRestarts(backoff_s=10, backoff_max_s=5)


def test_a_dead_process_is_restarted_after_its_backoff_then_given_up_when_the_budget_is_spent(sup):
    clock, lines = Clock(), []
    guard = SiteSupervisor(sup, SiteRestarts(max_restarts=2, window_s=100, backoff_s=4, backoff_max_s=8),
                           lines.append, clock)
    cleaned = []
    first = guard.watch("site x: trainer", lambda: sup.start("crash", CRASH), cleaned.append)
    _wait_dead(first)
    guard.tick()
    assert "site x: trainer exited with code 3" in lines[0] and "restarting in 4s (restart 1 of 2" in lines[1]
    guard.tick()  # not due yet
    assert guard.proc("site x: trainer") is first and not cleaned
    clock.t += 4
    guard.tick()
    second = guard.proc("site x: trainer")
    assert second is not first and cleaned == [first] and first not in sup.procs
    assert lines[-1].startswith("site x: trainer restarted (pid ")
    _wait_dead(second)
    guard.tick()
    assert "restarting in 8s (restart 2 of 2" in lines[-1]  # the back-off doubled
    clock.t += 8
    guard.tick()
    _wait_dead(guard.proc("site x: trainer"))
    guard.tick()
    assert guard.given_up == ["site x: trainer"] and "not restarted: its restart budget is spent" in lines[-1]
    # old restarts leave the window: a later death of a fresh watch would be restarted again
    assert guard._recent(guard.watched["site x: trainer"], clock.t + 101) == 0


def test_restarts_off_means_given_up_at_the_first_death(sup):
    lines = []
    guard = SiteSupervisor(sup, SiteRestarts(enabled=False), lines.append)
    _wait_dead(guard.watch("n", lambda: sup.start("crash", CRASH)))
    guard.tick()
    assert guard.given_up == ["n"] and "site restarts are off" in lines[-1]


def test_supernode_without_a_node_to_release_waits_for_the_key_hold(sup, tmp_path):
    clock, lines = Clock(), []
    guard = SiteSupervisor(sup, SiteRestarts(backoff_s=1), lines.append, clock)
    _wait_dead(guard.watch_supernode("x", lambda: sup.start("crash", CRASH), "127.0.0.1:1", tmp_path))
    guard.tick()
    assert "no node id in its log" in lines[-2]
    assert f"restarting in {site_supervisor.NODE_HOLD_S:.0f}s" in lines[-1]
    _wait_dead(guard.watch_supernode("y", lambda: sup.start("crash2", CRASH), "127.0.0.1:1", None))
    guard.tick()  # --insecure: a fresh key each start, nothing to wait for
    assert "restarting in 1s" in lines[-1]


def test_supernode_that_never_activated_waits_only_what_is_left_of_a_hold_since_the_site_started(sup, tmp_path):
    """No node id in the log: a node of this key can only have been activated by a process that died
    before this site started, so the wait ends NODE_HOLD_S after the start, and at once after that."""
    clock, lines = Clock(), []
    guard = SiteSupervisor(sup, SiteRestarts(backoff_s=1), lines.append, clock)
    clock.t += site_supervisor.NODE_HOLD_S - 20  # the trainer took that long; then its SuperNode was refused
    _wait_dead(guard.watch_supernode("x", lambda: sup.start("crash", CRASH), "127.0.0.1:1", tmp_path))
    guard.tick()
    assert "no node id in its log; waiting 20s" in lines[-2] and "restarting in 20s" in lines[-1]
    clock.t += 30
    _wait_dead(guard.watch_supernode("y", lambda: sup.start("crash2", CRASH), "127.0.0.1:1", tmp_path))
    guard.tick()
    assert "it never activated a node" in lines[-2] and "restarting in 1s" in lines[-1]


def test_a_node_id_an_earlier_life_logged_is_not_released_again_for_a_later_life(sup, tmp_path):
    """Restarts append to one log: a life that activated no node (its SuperLink was replaced and
    refused it before the coordinator registered the keys) is not held for the node of an earlier
    life, which belonged to the SuperLink that went away."""
    clock, lines = Clock(), []
    guard = SiteSupervisor(sup, SiteRestarts(backoff_s=1), lines.append, clock)
    lives = iter([[sys.executable, "-c", "print('SuperNode ID: 4242', flush=True); raise SystemExit(3)"], CRASH])
    first = guard.watch_supernode("x", lambda: sup.start("site-x-supernode", next(lives)), "127.0.0.1:1", tmp_path)
    _wait_dead(first)
    guard.tick()  # its own node: released, or (nothing listens at :1) waited for
    assert "could not deactivate its node" in lines[-2] and f"restarting in {site_supervisor.NODE_HOLD_S:.0f}s" in lines[-1]
    clock.t += site_supervisor.NODE_HOLD_S
    guard.tick()
    second = guard.proc("site x: SuperNode")
    assert second is not first and second.log == first.log and second.log_start > 0
    _wait_dead(second)
    guard.tick()
    assert "it never activated a node" in lines[-2] and "restarting in 2s" in lines[-1], lines[-2:]


def test_trainer_cleanup_kills_ranks_a_dead_torchrun_left_and_clears_the_socket(sup, tmp_path):
    cfg = tmp_path / "sites" / "x" / "trainer.json"
    sock = str(tmp_path / "x.sock")
    for path in (sock, sock + ".ready"):
        open(path, "w").close()
    rank = sup.start("rank", [*SLEEP, "--config", str(cfg)])  # stands in for an orphaned rank
    other = sup.start("other", [*SLEEP, "--config", str(tmp_path / "other.json")])
    dead = sup.start("torchrun", [*CRASH, "--config", str(cfg)])
    _wait_dead(dead)
    time.sleep(0.5)  # the children's environment is readable
    trainer_cleanup(sup, sock)(dead)
    _wait_dead(rank, 5)
    assert other.alive()
    assert not (tmp_path / "x.sock").exists() and not (tmp_path / "x.sock.ready").exists()


def test_link_watch_restarts_a_live_supernode_when_its_superlink_comes_back(sup):
    clock, lines = Clock(), []
    guard = SiteSupervisor(sup, SiteRestarts(), lines.append, clock)
    first = guard.watch("site x: SuperNode", lambda: sup.start("node", SLEEP))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        guard.watch_link("site x: SuperNode", f"127.0.0.1:{port}")
        guard.tick()  # down (not listening yet): nothing to do
        listener.listen()
        clock.t += site_supervisor.PROBE_EVERY_S
        guard.tick()  # up for the first time (the site started before its coordinator): nothing to do
        assert guard.proc("site x: SuperNode") is first and not lines
        listener.close()
        clock.t += site_supervisor.PROBE_EVERY_S
        guard.tick()  # down
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        clock.t += site_supervisor.PROBE_EVERY_S
        guard.tick()  # back: restart
    assert guard.proc("site x: SuperNode") is not first and not first.alive()
    assert "is back after being unreachable" in lines[0] and "SuperNode restarted" in lines[1]
    clock.t += site_supervisor.PROBE_EVERY_S
    guard.tick()  # down again: no restart until it comes back
    assert len(lines) == 2


def test_a_warm_superexec_that_exits_is_replaced_by_flowers_own(sup):
    """The warm SuperExec is started with its workers; should it exit, Flower's SuperExec (0 workers)
    takes its place, said in one line, and stays (a second death restarts Flower's again)."""
    clock, lines, asked = Clock(), [], []

    def start(workers: int):
        asked.append(workers)
        return sup.start(f"superexec-{len(asked)}", CRASH if workers else SLEEP)

    guard = SiteSupervisor(sup, SiteRestarts(backoff_s=0, backoff_max_s=0), lines.append, clock)
    first = guard.watch_superexec("x", start, 3)
    assert asked == [3]
    _wait_dead(first)
    guard.tick()  # notices the death
    guard.tick()  # restarts
    assert asked == [3, 0]
    fallback = [line for line in lines if "Flower's subprocess executor" in line]
    assert len(fallback) == 1 and fallback[0].startswith("site x: SuperExec: the warm ClientApp executor exited")
    second = guard.proc("site x: SuperExec")
    assert second.alive()
    second.popen.kill()
    _wait_dead(second)
    guard.tick()
    guard.tick()
    assert asked == [3, 0, 0] and len([line for line in lines if "Flower's subprocess executor" in line]) == 1
