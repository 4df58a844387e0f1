"""The warm ClientApp executor on real parent processes: a task forked from a warm parent,
workers' exits, a parent's death and replacement, a parent that would fork with a thread alive,
and the fall-back to Flower's subprocess executor. (A whole federation served by it, with a
parent killed while idle and a worker killed while handling a message: tests/test_e2e_warm.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from federation.ops import flower_exec as fx
from federation.ops.warm_executor import WarmClientAppExecutor

# A parent that runs the real fork loop (warm_worker.fork_per_task) without Flower's imports; its
# workers write their task to OUT/<pid>.json, wait for OUT/go (if the token says so) and exit with
# the code the task's token names.
PARENT = """
import json, os, sys, threading, time
from federation.ops.warm_worker import fork_per_task
fd = int(sys.argv[sys.argv.index("--events-fd") + 1])
if sys.argv[2] == "thread":
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
os.write(fd, b"ready\\n")
task = fork_per_task(fd)
if task:
    out = sys.argv[1]
    mine = os.path.join(out, f"{os.getpid()}.json")
    with open(mine + ".part", "w") as f:  # whole or absent: the test reads it as soon as it exists
        f.write(json.dumps(task))
    os.replace(mine + ".part", mine)
    while task["token"].startswith("wait") and not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.02)
    sys.exit(int(task["token"].rpartition("-")[2]))
"""


def spec(task_id: int, exit_code: int = 0, task_type=fx.TaskType.CLIENT_APP, wait: bool = False) -> fx.ExecutionSpec:
    return fx.ExecutionSpec(task_type=task_type, runtime_api_address="127.0.0.1:9",
                            token=f"{'wait' if wait else 'secret'}-{exit_code}", insecure=True,
                            root_certificates_path=None, runtime_dependency_install=False, parent_pid=os.getpid(),
                            suppress_output=False, task_id=task_id)


def until(cond, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


def executor(tmp_path, size: int = 1, mode: str = "plain", **kw) -> WarmClientAppExecutor:
    lines: list[str] = []
    ex = WarmClientAppExecutor(size, (sys.executable, "-c", PARENT, str(tmp_path), mode), log=lines.append, **kw)
    ex.lines = lines
    return ex


@pytest.fixture
def pool(tmp_path):
    ex = executor(tmp_path)
    yield ex
    (tmp_path / "go").touch()
    ex.close()


def test_a_task_is_forked_from_the_warm_parent_and_its_token_never_reaches_argv(pool, tmp_path):
    pool.start()
    (parent,) = pool.parents
    assert pool.launch(spec(7, wait=True)).status == fx.LaunchResultStatus.ACCEPTED
    (worker,) = pool.busy
    assert worker != parent.pid and pool.parents == [parent]
    assert Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(parent.pid)  # its parent's child
    until(lambda: (tmp_path / f"{worker}.json").exists())
    (tmp_path / "go").touch()
    task = json.loads((tmp_path / f"{worker}.json").read_text())
    assert task["token"] == "wait-0" and task["runtime_api_address"] == "127.0.0.1:9" and task["task_id"] == 7
    assert abs(task["handed_at"] - time.time()) < 60
    assert "wait-0" not in Path(f"/proc/{parent.pid}/cmdline").read_text()
    assert f"task 7 handed to worker pid {worker}" in pool.lines
    until(lambda: pool.reconcile() or not pool.busy)
    assert pool.served == {"warm": 1, "subprocess": 0} and pool.parents == [parent] and parent.alive()


def test_tasks_at_once_each_get_their_own_worker(pool, tmp_path):
    pool.start()
    for task_id in (1, 2, 3):
        pool.launch(spec(task_id, wait=True))
    assert len(pool.busy) == 3 and sorted(t for _, t in pool.busy.values()) == [1, 2, 3]
    until(lambda: all((tmp_path / f"{pid}.json").exists() for pid in pool.busy))
    assert len({json.loads((tmp_path / f"{pid}.json").read_text())["task_id"] for pid in pool.busy}) == 3
    (tmp_path / "go").touch()
    until(lambda: pool.reconcile() or not pool.busy)


def test_a_failed_worker_is_logged_and_a_killed_parent_is_replaced_while_its_worker_goes_on(pool, tmp_path):
    pool.start()
    pool.launch(spec(8, exit_code=3))
    (failed,) = pool.busy
    until(lambda: pool.reconcile() or not pool.busy)
    assert any(f"(pid {failed}) serving task 8 exited with code 3" in line for line in pool.lines)
    pool.launch(spec(9, wait=True))
    (running,) = pool.busy
    (parent,) = pool.parents
    os.kill(parent.pid, signal.SIGKILL)
    until(lambda: pool.reconcile() or (pool.parents and pool.parents[0] is not parent))
    assert any(f"warm parent (pid {parent.pid}) exited with code -9; its running worker(s) (pid {running}) go on; "
               "starting another" in line for line in pool.lines), pool.lines
    assert os.path.exists(f"/proc/{running}") and pool.busy == {}
    until(lambda: pool.reconcile() or pool.parents[0].ready)
    assert pool.launch(spec(10)).status == fx.LaunchResultStatus.ACCEPTED and pool.fallback is None
    assert pool.served == {"warm": 3, "subprocess": 0}


def test_a_parent_with_a_thread_alive_refuses_to_fork_and_the_pool_falls_back(tmp_path):
    ex = executor(tmp_path, mode="thread")
    ex.start()
    launched = []
    ex.cold.launch = lambda s: launched.append(s.task_id) or fx.LaunchResult.accepted()  # Flower's is not under test
    ex.launch(spec(4))
    assert launched == [4] and ex.fallback is not None and "2 Python threads" in ex.fallback
    assert ex.served == {"warm": 0, "subprocess": 1} and ex.parents == [] and ex.busy == {}
    assert sum("cannot start" in line for line in ex.lines) == 1
    assert not list(tmp_path.glob("*.json"))  # nothing was forked
    ex.close()


def test_a_pool_that_cannot_start_falls_back_to_flowers_executor_saying_so_once(tmp_path):
    lines: list[str] = []
    ex = WarmClientAppExecutor(2, (sys.executable, "-c", "raise SystemExit(5)"), log=lines.append)
    ex.start()
    assert ex.fallback is not None and ex.parents == []
    gave_up = [line for line in lines if "cannot start" in line]
    assert len(gave_up) == 1 and "3 parents in a row exited with code 5" in gave_up[0]
    assert "Flower's subprocess executor" in gave_up[0] and len(lines) == 3  # and the two deaths before it
    launched = []
    ex.cold.launch = lambda s: launched.append(s.task_id) or fx.LaunchResult.accepted()
    ex.launch(spec(11))
    ex.reconcile()
    assert launched == [11] and ex.served == {"warm": 0, "subprocess": 1} and ex.parents == [] and len(lines) == 3
    ex.close()


def test_other_task_types_go_to_flowers_executor(pool):
    pool.start()
    launched = []
    pool.cold.launch = lambda s: launched.append(s.task_type) or fx.LaunchResult.accepted()
    pool.launch(spec(12, task_type=fx.TaskType.AGENT_APP))
    assert launched == [fx.TaskType.AGENT_APP] and pool.busy == {}


def test_the_real_parent_forks_from_one_thread_and_reseeds_numpys_generator(tmp_path):
    """warm_worker's own imports leave one thread (OpenBLAS held to one), and two workers draw
    different numbers from numpy's global generator."""
    code = """
import json, os, sys
from federation.ops import warm_worker as w
w.warm_up()
assert w.fork_safety() is None, w.fork_safety()
import numpy
fd = int(sys.argv[sys.argv.index("--events-fd") + 1])
os.write(fd, b"ready\\n")
task = w.fork_per_task(fd)
if task:
    mine = os.path.join(sys.argv[1], f"{os.getpid()}.json")
    with open(mine + ".part", "w") as f:  # whole or absent: the test reads it as soon as it exists
        f.write(json.dumps(numpy.random.random()))
    os.replace(mine + ".part", mine)
"""
    ex = WarmClientAppExecutor(1, (sys.executable, "-c", code, str(tmp_path)), log=lambda line: None)
    try:
        ex.start()
        assert ex.fallback is None
        workers = []
        for task_id in (1, 2):
            ex.launch(spec(task_id))
            workers += [pid for pid in ex.busy if pid not in workers]
        until(lambda: all((tmp_path / f"{pid}.json").exists() for pid in workers))
        draws = {(tmp_path / f"{pid}.json").read_text() for pid in workers}
        assert len(workers) == 2 and len(draws) == 2
    finally:
        ex.close()


def test_flowers_telemetry_event_in_a_worker_starts_no_process():
    """Flower's ClientApp runtime builds a telemetry payload in every worker (telemetry off only
    skips the send); after the real warm-up, building it starts no process (`file` for
    platform.architecture), and without the warm-up it does (the check can fail)."""
    code = """
import subprocess, sys
from federation.ops import warm_worker as w
if sys.argv[1] == "warm":
    w.warm_up()
def no_process(*args, **kwargs):
    raise AssertionError(f"a process started: {args[:1]}")
subprocess.Popen = no_process
from flwr.supercore.telemetry import EventType, create_event
print(create_event(EventType.FLWR_CLIENTAPP_RUN_ENTER, None))
"""
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "OPENBLAS_NUM_THREADS": "1"}
    runs = {mode: subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, env=env,
                                 cwd=Path(__file__).resolve().parents[1], timeout=120) for mode in ("warm", "cold")}
    assert runs["warm"].returncode == 0 and runs["warm"].stdout.strip() == "disabled", runs["warm"].stderr
    assert runs["cold"].returncode != 0 and "a process started" in runs["cold"].stderr, runs["cold"].stderr
