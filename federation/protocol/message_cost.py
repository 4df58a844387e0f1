"""Where one message's seconds go outside the link and the training, measured on both ends.

In a deployment every message to a site waits for things neither side's work explains: the
SuperNode's next pull (flwr 1.41 sleeps 3 s after a pull that finds nothing), the SuperExec's task
poll (`FLWR_SUPEREXEC_TASK_POLL_INTERVAL`), the ClientApp process that serves the message (a warm
worker handed the task, federation/ops/warm_executor.py, or with Flower's own executor a fresh
`flwr-clientapp` process and its imports), the message's object pulls, then on the way back the
SuperNode's 0.5 s check for the reply, its push and the coordinator's poll. Flower's code holds
those constants and is not ours to patch, so the metrics say how much of each message they took,
per site and stage:

  launch_s   push (coordinator's clock, when it starts pushing the stage) -> the task reaches its
             ClientApp process (site's clock): the other sites' messages pushed before this one,
             the SuperNode's poll sleep, its object pulls, the SuperExec's task poll, and the
             hand-off to a warm worker or the spawn of a fresh process
  startup_s  task reached -> our handler starts (site's clock): the message's and the app's pull
             from the SuperNode, the app's install, and in a fresh process also the interpreter,
             the flwr imports and loading our app (`app_import_s` of it: the part that is ours;
             0 in a warm worker, which paid it before its task)
  handler_s  our mods and calls: the trainer's work (`train_call_s` and the like) and data-path
             transfers (`bulk_*_s`) are inside it
  return_s   handler done (site) -> reply pulled (coordinator): the reply's serialization and push
             to the SuperNode, its 0.5 s reply check and push to the SuperLink, our poll (polling.py)
  total_s    push -> reply pulled (coordinator's clock alone): the four add up to it

Every split also says which executor served the message (`executor`: `warm` or `subprocess`,
Flower's own) and whether it came with its small records packed into one Flower object (`packed`:
1 or 0; protocol/record_pack.py; per site for the round, the share of its messages).

`launch_s` and `return_s` compare the two machines' wall clocks; on separate hosts they are only
as good as the clocks' agreement (NTP), while `total_s`, `startup_s` and `handler_s` are each read
on one clock. The site stamps its reply (`stamp`), the coordinator splits it (`split`).
"""

from __future__ import annotations

import os
import time

from flwr.app import MetricRecord, RecordDict

from federation.protocol import message_keys as keys


TASK_START_ENV = "SOVFL_TASK_START"  # a warm worker's: wall-clock time it was handed its one task
TTL_MARGIN_S = 10.0  # a message lives this long past its deadline, so a site's own timeout report still gets through


def process_start_wall() -> float | None:
    """The wall-clock time this process was created (Linux /proc, 10 ms ticks), or None where
    /proc is unavailable."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of proc(5): starttime, clock ticks after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


def task_start_wall() -> tuple[float | None, bool]:
    """When this process got its task (wall clock) and whether a warm worker serves it: the time
    the worker was handed the task (TASK_START_ENV), else the process's creation."""
    handed = os.environ.get(TASK_START_ENV)
    if handed:
        try:
            return float(handed), True
        except ValueError:
            pass
    return process_start_wall(), False


def stamp(content: RecordDict, handler_start: float, handler_end: float, app_import_s: float | None) -> None:
    """Add MSG_COST (wall-clock stamps of this process's task and its handler) to a reply's content."""
    rec = {"handler_start": handler_start, "handler_end": handler_end}
    started, warm = task_start_wall()
    if started is not None:
        rec["process_start"] = started
    if warm:
        rec["warm"] = 1.0
        app_import_s = 0.0  # paid before the task reached this worker
    if app_import_s is not None:
        rec["app_import_s"] = app_import_s
    content.metric_records[keys.MSG_COST] = MetricRecord(rec)


def split(content: RecordDict, pushed: float, pulled: float) -> dict[str, float]:
    """One message's seconds (module docstring) from the reply's MSG_COST and the coordinator's
    wall-clock times of the push and of the reply's pull, and the executor that served it; only
    `total_s` without the stamp."""
    out: dict = {"total_s": pulled - pushed}
    rec = content.metric_records.get(keys.MSG_COST)
    try:
        start, end = float(rec["handler_start"]), float(rec["handler_end"])
    except (TypeError, KeyError, ValueError):
        return out
    executor = "warm" if rec.get("warm") else "subprocess"
    out["packed"] = 1.0 if rec.get("packed") else 0.0
    out["handler_s"] = end - start
    out["return_s"] = pulled - end
    if "process_start" in rec:
        out["launch_s"] = float(rec["process_start"]) - pushed
        out["startup_s"] = start - float(rec["process_start"])
        if "app_import_s" in rec:
            out["app_import_s"] = float(rec["app_import_s"])
    else:
        out["launch_s"] = start - pushed  # launch and startup together
    return {**{k: round(v, 4) for k, v in out.items()}, "executor": executor}


def per_site(stages: list[dict]) -> dict[str, dict[str, float]]:
    """The round's summary for its metrics line: per site, its messages' mean of each part (from
    the `messages` of the stages' timings), how many messages that is and how many each executor
    served (`executors`)."""
    parts: dict[str, dict[str, list[float]]] = {}
    served: dict[str, dict[str, int]] = {}
    for stage in stages:
        for site, cost in (stage.get("messages") or {}).items():
            for k, v in cost.items():
                if k == "executor":
                    served.setdefault(site, {})[str(v)] = served.get(site, {}).get(str(v), 0) + 1
                else:
                    parts.setdefault(site, {}).setdefault(k, []).append(float(v))
    return {site: {"messages": len(p.get("total_s", [])), **{k: round(sum(v) / len(v), 4) for k, v in p.items()},
                   **({"executors": served[site]} if site in served else {})}
            for site, p in sorted(parts.items())}
