"""The warm ClientApp executor's pool on real worker processes: hand-off, replacement, deaths and
the fall-back to Flower's subprocess executor. (A whole federation served by it, with workers
killed while idle and while handling a message: tests/test_e2e_warm.py.)"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from federation.ops import flower_exec as fx
from federation.ops.warm_executor import WarmClientAppExecutor

# A worker that speaks the pool's protocol (warm_worker.py): `ready` on its fd, then one task on
# stdin, which it writes to OUT/<pid>.json and exits with the code the task's token names.
WORKER = """
import json, os, sys
fd = int(sys.argv[sys.argv.index("--ready-fd") + 1])
os.write(fd, b"ready\\n"); os.close(fd)
line = sys.stdin.readline()
if line:
    task = json.loads(line)
    open(os.path.join(sys.argv[1], f"{os.getpid()}.json"), "w").write(line)
    sys.exit(int(task["token"].rpartition("-")[2]))
"""


def spec(task_id: int, exit_code: int = 0, task_type=fx.TaskType.CLIENT_APP) -> fx.ExecutionSpec:
    return fx.ExecutionSpec(task_type=task_type, runtime_api_address="127.0.0.1:9", token=f"secret-{exit_code}",
                            insecure=True, root_certificates_path=None, runtime_dependency_install=False,
                            parent_pid=os.getpid(), suppress_output=False, task_id=task_id)


def until(cond, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture
def pool(tmp_path):
    lines: list[str] = []
    ex = WarmClientAppExecutor(2, (sys.executable, "-c", WORKER, str(tmp_path)), log=lines.append)
    ex.lines = lines
    yield ex
    ex.close()
    for popen, _ in ex.busy.values():
        popen.kill()


def test_a_task_goes_to_a_ready_worker_by_its_stdin_and_a_replacement_starts_at_once(pool, tmp_path):
    pool.start()
    before = {w.popen.pid for w in pool.idle}
    assert pool.launch(spec(7)).status == fx.LaunchResultStatus.ACCEPTED
    (served,) = pool.busy
    assert served in before and len(pool.idle) == 2 and served not in {w.popen.pid for w in pool.idle}
    until(lambda: (tmp_path / f"{served}.json").exists())
    task = json.loads((tmp_path / f"{served}.json").read_text())
    assert task["token"] == "secret-0" and task["runtime_api_address"] == "127.0.0.1:9"
    assert "secret-0" not in " ".join(Path(f"/proc/{w.popen.pid}/cmdline").read_text() for w in pool.idle)
    assert f"task 7 handed to worker pid {served}" in pool.lines
    until(lambda: pool.busy[served][0].poll() is not None)
    pool.reconcile()
    assert pool.busy == {} and pool.served == {"warm": 1, "subprocess": 0}


def test_a_worker_that_fails_its_task_is_logged_and_one_killed_while_idle_is_replaced(pool):
    pool.start()
    pool.launch(spec(8, exit_code=3))
    (served,) = pool.busy
    until(lambda: pool.busy[served][0].poll() is not None)
    pool.reconcile()
    assert any(f"(pid {served}) serving task 8 exited with code 3" in line for line in pool.lines)
    until(lambda: all(w.ready for w in pool.idle) or pool.reconcile())
    victim = pool.idle[0].popen
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    pool.reconcile()
    assert victim.pid not in {w.popen.pid for w in pool.idle} and len(pool.idle) == 2
    assert any(f"idle worker (pid {victim.pid}) exited with code -9; starting another" in line for line in pool.lines)
    until(lambda: all(w.ready for w in pool.idle) or pool.reconcile())
    assert pool.launch(spec(9)).status == fx.LaunchResultStatus.ACCEPTED and pool.fallback is None


def test_a_pool_that_cannot_start_falls_back_to_flowers_executor_saying_so_once(tmp_path):
    lines: list[str] = []
    ex = WarmClientAppExecutor(2, (sys.executable, "-c", "raise SystemExit(5)"), log=lines.append)
    ex.start()
    assert ex.fallback is not None and ex.idle == []
    gave_up = [line for line in lines if "cannot start" in line]
    assert len(gave_up) == 1 and "3 workers in a row exited with code 5" in gave_up[0]
    assert "Flower's subprocess executor" in gave_up[0] and len(lines) == 3  # and the two deaths before it
    launched = []
    ex.cold.launch = lambda s: launched.append(s.task_id) or fx.LaunchResult.accepted()  # Flower's is not under test
    ex.launch(spec(11))
    ex.reconcile()
    assert launched == [11] and ex.served == {"warm": 0, "subprocess": 1} and ex.idle == [] and len(lines) == 3
    ex.close()


def test_other_task_types_go_to_flowers_executor(pool):
    pool.start()
    launched = []
    pool.cold.launch = lambda s: launched.append(s.task_type) or fx.LaunchResult.accepted()
    pool.launch(spec(12, task_type=fx.TaskType.AGENT_APP))
    assert launched == [fx.TaskType.AGENT_APP] and pool.busy == {}
