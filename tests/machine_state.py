"""What the machine was doing while the suite ran, for the end of `make test`'s output: CPU busy and
stolen (a hypervisor giving the cores to others), the highest load average and the least memory
available. End-to-end tests run on deadlines; when a CI run fails them all at once, these figures
tell a machine that was starved from a change that made rounds slow."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field


def _cpu() -> tuple[int, int, int]:
    """(busy, steal, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal, sum(fields[:8])


def _mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


@dataclass
class MachineState:
    """Sampled every `every_s` seconds on a daemon thread from `start()` to `summary()`."""

    every_s: float = 5.0
    max_load: float = 0.0
    min_avail_gib: float = float("inf")
    _t0: float = 0.0
    _cpu0: tuple[int, int, int] = (0, 0, 0)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> MachineState:
        self._t0, self._cpu0 = time.monotonic(), _cpu()
        self._read()
        threading.Thread(target=self._sample, daemon=True, name="machine-state").start()
        return self

    def _read(self) -> None:
        self.max_load = max(self.max_load, os.getloadavg()[0])
        self.min_avail_gib = min(self.min_avail_gib, _mem_available_gib())

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self._read()

    def summary(self) -> str:
        self._stop.set()
        busy, steal, total = (b - a for a, b in zip(self._cpu0, _cpu()))
        total = max(total, 1)
        return (f"machine: {os.cpu_count()} cores, {time.monotonic() - self._t0:.0f}s; CPU busy {100 * busy / total:.0f}%, "
                f"stolen {100 * steal / total:.1f}%; load average up to {self.max_load:.1f}; "
                f"memory available down to {self.min_avail_gib:.1f} GiB")
