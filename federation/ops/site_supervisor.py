"""Keeps a site's processes running: a dead trainer pool or SuperNode is started again.

`sovfl site` and `sovfl simulate` start each site's torchrun (its trainer ranks), its SuperNode and
its SuperExec through a `SiteSupervisor`; their wait loops call `tick()`, which notices a process that died
(a rank SIGKILLed takes its torchrun down with it: torchrun runs with no restarts of its own) and
restarts it after a back-off, within the budget of `federation.site_restarts`
(federation/config/restart_config.py). Every restart is a line on the progress output.

What a restart brings back:
- trainer: the same socket and workdir, so the ranks resume from the site's newest local
  checkpoint (sites[].checkpoint_every) and the relay finds them where it did; the codec
  residual and the downlink reference live in the site store (federation/site/site_store.py),
  files the restart does not touch. The round in flight when a rank died loses this site (the
  coordinator's quorum rules apply); the site trains again from the next round on.
- SuperNode: the same provisioned key, hence the same node at the SuperLink, which the coordinator
  keeps addressing. A SuperNode killed without deactivating stays "online" at the SuperLink until
  its heartbeat expires (flwr 1.41: 2 x 30 s), and the SuperLink refuses to activate the same key
  again before that: the node it logged is deactivated with the site's key first, or the restart
  waits that long. A SuperNode that never activated a node (one that asked before its
  coordinator registered the sites' keys) waits at most until that long after the site started.
- SuperExec (the warm ClientApp executor, federation.warm_clientapps): independent of the
  SuperNode's restarts (it asks the same Runtime API port again until the SuperNode is back);
  should it exit, Flower's own `flower-superexec` takes its place for the rest of the run, said in
  one line.
- link watch (`sovfl site`): a SuperNode whose SuperLink was up, then unreachable, and is back (a
  restarted coordinator) is restarted too, gracefully (it deactivates itself): flwr 1.41 SuperNodes
  that stay connected across a SuperLink restart receive the new run's messages but start no
  ClientApp. A site started before its coordinator is left to connect by the SuperNode's own
  retries: restarting it while the coordinator registers the sites' keys is refused (exit 305) and
  would cost the key's hold.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE

from federation.config.restart_config import SiteRestarts
from federation.ops import supernode_release
from federation.ops.supervisor import OWNER, Proc, Supervisor, marked_pids

NODE_HOLD_S = HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL  # a killed SuperNode's key stays active this long
PROBE_EVERY_S = 2.0


@dataclass
class Watched:
    """One supervised process: how to start it again and what is left of its past lives."""

    name: str
    start: Callable[[], Proc]
    proc: Proc
    cleanup: Callable[[Proc], None] | None = None
    hold: Callable[[Proc], float] | None = None  # the shortest wait before restarting this dead process
    restarts: list[float] = field(default_factory=list)  # when each restart happened (monotonic)
    due: float | None = None  # when the pending restart may start
    given_up: bool = False


class SiteSupervisor:
    """Restarts the processes it watches when they die, within a budget; `tick()` does the work."""

    def __init__(self, sup: Supervisor, policy: SiteRestarts, progress: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic):
        self.sup, self.policy, self.progress, self.clock = sup, policy, progress, clock
        self.started = clock()
        self.watched: dict[str, Watched] = {}
        # name -> (address, reachable at the last probe, next probe, reachable at any probe so far)
        self.links: dict[str, tuple[str, bool | None, float, bool]] = {}

    def watch(self, name: str, start: Callable[[], Proc], cleanup: Callable[[Proc], None] | None = None,
              hold: Callable[[Proc], float] | None = None) -> Proc:
        """Start `start()` now and restart it whenever it dies; `cleanup(dead)` runs before each restart,
        not before `hold(dead)` seconds."""
        proc = start()
        self.watched[name] = Watched(name, start, proc, cleanup, hold)
        return proc

    def watch_trainer(self, site: str, start: Callable[[], Proc], socket_path: str) -> Proc:
        """A site's trainer pool on this node (its torchrun), restarted from its local checkpoint."""
        return self.watch(f"site {site}: trainer", start, trainer_cleanup(self.sup, socket_path))

    def watch_supernode(self, site: str, start: Callable[[], Proc], superlink: str, bundle: Path | None) -> Proc:
        """A site's SuperNode. With `bundle` (authenticated) its key is first freed at the SuperLink
        (supernode_release.py), or, if that fails, the restart waits for the key's hold to expire."""
        name = f"site {site}: SuperNode"

        def hold(dead: Proc) -> float:
            if bundle is None:
                return 0.0
            node_id = supernode_release.logged_node_id(dead.log, dead.log_start)  # its own life's node
            if node_id is None:
                return self._unlogged_hold(name)
            why = supernode_release.release(superlink, bundle, node_id)
            if why is None:
                self.progress(f"{name}: node {node_id} deactivated at the SuperLink with the site's key")
                return 0.0
            self.progress(f"{name}: could not deactivate its node at the SuperLink ({why}); waiting for its "
                          f"heartbeat to expire ({NODE_HOLD_S:g}s)")
            return float(NODE_HOLD_S)
        return self.watch(name, start, hold=hold)

    def _unlogged_hold(self, name: str) -> float:
        """The wait before restarting a SuperNode that logged no node id in its life: it activated
        none. The SuperLink refuses an unregistered key (a site that asked before its coordinator
        registered the keys, also after a coordinator restart) and a key still active alike. This
        supervisor never starts a SuperNode while a node of an earlier life may hold the key (it
        released that node, waited for it to expire, or stopped the life gracefully), so only a
        process that died before this supervisor started can hold it, and that hold ends at most
        NODE_HOLD_S after the start. A node id logged by an earlier life (perhaps at a SuperLink
        that has since been replaced) says nothing about this one."""
        left = NODE_HOLD_S - (self.clock() - self.started)
        if left <= 0:
            self.progress(f"{name}: no node id in its log: it never activated a node, and no other SuperNode of "
                          f"this key can still hold one ({NODE_HOLD_S:g}s since the site started)")
            return 0.0
        self.progress(f"{name}: no node id in its log; waiting {left:.0f}s, until {NODE_HOLD_S:g}s after the site "
                      "started, for any node of this key activated before it to expire")
        return left

    def watch_superexec(self, site: str, start: Callable[[int], Proc], parents: int) -> Proc:
        """A site's warm SuperExec, `start(parents)`. Should it exit, what restarts in its place is
        Flower's own SuperExec, `start(0)` (a fresh ClientApp process per message), said in one line."""
        name = f"site {site}: SuperExec"
        lives = [parents]

        def start_next() -> Proc:
            if len(lives) == 2 and parents:
                self.progress(f"{name}: the warm ClientApp executor exited; Flower's subprocess executor "
                              "(flower-superexec, a fresh flwr-clientapp process per message) serves the site from now on")
            proc = start(lives[-1])
            lives.append(0)
            return proc
        return self.watch(name, start_next)

    def watch_link(self, name: str, address: str) -> None:
        """Restart `name` (a SuperNode) when `address` (its SuperLink) comes back after being unreachable.
        A SuperLink first seen up after the SuperNode started (a site started before its coordinator)
        is not "back": the SuperNode never served another one and connects by its own retries."""
        self.links[name] = (address, None, 0.0, False)

    def proc(self, name: str) -> Proc:
        """The current process of `name`."""
        return self.watched[name].proc

    @property
    def given_up(self) -> list[str]:
        """The processes that used up their restart budget and stay down."""
        return [w.name for w in self.watched.values() if w.given_up]

    def tick(self) -> None:
        """Notice deaths, schedule and run restarts, probe SuperLinks; never blocks for long."""
        now = self.clock()
        for w in self.watched.values():
            if w.given_up:
                continue
            if w.proc.alive():
                continue
            if w.due is None:
                self._schedule(w, now)
            elif now >= w.due:
                self._restart(w, now)
        for name in list(self.links):
            self._probe(name, now)

    def _recent(self, w: Watched, now: float) -> int:
        w.restarts = [t for t in w.restarts if now - t < self.policy.window_s]
        return len(w.restarts)

    def _schedule(self, w: Watched, now: float) -> None:
        code, log = w.proc.popen.returncode, w.proc.log
        recent = self._recent(w, now)
        if not self.policy.enabled or recent >= self.policy.max_restarts:
            w.given_up = True
            why = ("site restarts are off (federation.site_restarts.enabled)" if not self.policy.enabled else
                   f"its restart budget is spent ({recent} restart(s) within {self.policy.window_s:g}s, "
                   "federation.site_restarts.max_restarts)")
            self.progress(f"{w.name} exited with code {code}; not restarted: {why} (log: {log})")
            return
        self.progress(f"{w.name} exited with code {code} (log: {log})")
        delay = self.policy.delay(recent)
        if w.hold is not None:
            delay = max(delay, w.hold(w.proc))
        w.due = self.clock() + delay
        self.progress(f"{w.name}: restarting in {delay:.0f}s (restart {recent + 1} of {self.policy.max_restarts} "
                      f"within {self.policy.window_s:g}s)")

    def _restart(self, w: Watched, now: float) -> None:
        dead = w.proc
        with contextlib.suppress(ProcessLookupError, PermissionError):  # stragglers of its group
            os.killpg(dead.popen.pid, signal.SIGKILL)
        if w.cleanup is not None:
            w.cleanup(dead)
        with contextlib.suppress(ValueError):
            self.sup.procs.remove(dead)
        w.restarts.append(now)
        w.due = None
        try:
            w.proc = w.start()
        except Exception as err:  # noqa: BLE001 - a failed start is one more death, retried within budget
            self.progress(f"{w.name}: restart failed: {err}")
            w.due = now + self.policy.delay(len(w.restarts))
            return
        self.progress(f"{w.name} restarted (pid {w.proc.popen.pid})")

    def _probe(self, name: str, now: float) -> None:
        address, reachable, next_probe, seen_up = self.links[name]
        if now < next_probe:
            return
        up = _reachable(address)
        self.links[name] = (address, up, now + PROBE_EVERY_S, seen_up or up)
        w = self.watched.get(name)
        if seen_up and reachable is False and up and w is not None and not w.given_up and w.proc.alive():
            self.progress(f"{name}: the SuperLink at {address} is back after being unreachable; restarting the "
                          "SuperNode so that it serves the SuperLink's new runs")
            self.sup.stop(w.proc)  # SIGTERM first: the SuperNode deactivates itself, its key is free at once
            with contextlib.suppress(ValueError):
                self.sup.procs.remove(w.proc)
            w.proc = w.start()
            self.progress(f"{name} restarted (pid {w.proc.popen.pid})")


def _reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def trainer_cleanup(sup: Supervisor, socket_path: str) -> Callable[[Proc], None]:
    """Before a trainer restart: kill ranks of the dead torchrun still alive (a torchrun killed
    itself leaves them running, serving the socket) and clear the socket's files."""

    def cleanup(dead: Proc) -> None:
        argv = [str(a) for a in dead.popen.args]
        needle = argv[argv.index("--config") + 1].encode() if "--config" in argv else None
        left = []
        for pid in marked_pids(sup.owner, OWNER) if needle else []:
            try:
                if needle in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
                    left.append(pid)
            except (OSError, ProcessLookupError):
                continue
        end = time.monotonic() + 10  # SIGKILLed ranks go within moments; never wait forever
        while left and time.monotonic() < end:
            left = [pid for pid in left if Path(f"/proc/{pid}").exists() and not _zombie(pid)]
            time.sleep(0.05)
        for path in (socket_path, socket_path + ".ready") if socket_path else ():  # nodes >= 1 serve none
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return cleanup


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def keep_running(guard: SiteSupervisor, poll_s: float = 0.5) -> int:
    """`sovfl site`'s loop: restart what dies until a process is given up (exit 1) or Ctrl-C/SIGTERM."""
    while not guard.given_up:
        guard.tick()
        time.sleep(poll_s)
    print(f"sovfl site: {', '.join(guard.given_up)}: stopped for good (restart budget spent); stopping the site",
          file=sys.stderr)
    return 1
