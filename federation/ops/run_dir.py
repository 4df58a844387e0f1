"""A run's working directory across restarts, and the `--resume` flags of `sovfl simulate` and
`sovfl coordinator` (the resume itself is federation/coordinator/resume.py, in the ServerApp).

`run.json` records which configuration file the run was started with, so that
`sovfl simulate --resume RUN_DIR` needs nothing else; a resume under another configuration is
refused by the ServerApp, field by field.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import time
from functools import partial
from pathlib import Path

from federation.config.schema import ConfigError, load_config

RUN_FILE = "run.json"


def prepare_workdir(workdir: Path, config_path: Path, resume: bool) -> None:
    """Record the run's configuration; on resume, keep the previous attempt's progress log under
    another name and drop its result (the resumed run writes its own)."""
    workdir = Path(workdir)
    if resume:
        if not (workdir / "checkpoints").is_dir() and not (workdir / RUN_FILE).exists():
            raise ConfigError(f"--resume: {workdir} holds no run to resume (no checkpoints/ and no {RUN_FILE})")
        from federation.coordinator.resume import precheck  # numpy and safetensors: only when resuming

        done = precheck(workdir / "checkpoints", load_config(config_path))
        print(f"resuming the run in {workdir}: " + (f"round {done} is the last completed" if done else
                                                    "no round completed yet, starting at round 1"))
        log = workdir / "progress.log"
        if log.exists():
            n = 1
            while (workdir / f"progress.{n}.log").exists():
                n += 1
            log.rename(workdir / f"progress.{n}.log")
        (workdir / "result.json").unlink(missing_ok=True)
        messages, nodes = release_stale_state(workdir / "superlink.db")
        if messages or nodes:
            print(f"resume: in the SuperLink's database, {messages} message(s) the stopped run left undelivered "
                  f"expired, {nodes} node(s) no longer held online")
    (workdir / RUN_FILE).write_text(json.dumps({"config": str(Path(config_path).resolve())}, indent=1) + "\n")


def release_stale_state(db: Path) -> tuple[int, int]:
    """Before a SuperLink restarts on a killed run's database: expire the messages the dead
    ServerApp left undelivered, and let the nodes' liveness lapse now; (messages, nodes) changed.

    flwr 1.41 keeps both. Undelivered messages go to the SuperNodes as soon as they reconnect,
    though they are of no use to the resumed run (a new Flower run), and one whose content the dead
    ServerApp had not finished pushing can keep a SuperNode waiting for it. A node still marked
    online refuses a restarted SuperNode of the same site ("could not be activated", exit code 305)
    until its heartbeat would have lapsed; a SuperNode that is in fact alive is marked online again
    by its next heartbeat. Written against flwr 1.41's schema; tables without the expected columns
    are left alone."""
    if not Path(db).exists():
        return 0, 0
    con = sqlite3.connect(db, timeout=30)
    try:
        def columns(table: str) -> set[str]:
            return {row[1] for row in con.execute(f"PRAGMA table_info({table})")}
        messages = nodes = 0
        now = time.time()
        with con:
            if {"delivered_at", "ttl"} <= columns("message_ins"):
                messages = con.execute("UPDATE message_ins SET ttl = 0 WHERE delivered_at = '' AND ttl > 0").rowcount
            if "online_until" in columns("node"):
                nodes = con.execute("UPDATE node SET online_until = ? WHERE online_until > ?", (now, now)).rowcount
        return messages, nodes
    finally:
        con.close()


def recorded_config(workdir: Path) -> str:
    """The configuration file a run in `workdir` was started with."""
    path = Path(workdir) / RUN_FILE
    try:
        return str(json.loads(path.read_text())["config"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"--resume {workdir}: no readable {RUN_FILE} naming the run's configuration; "
                          "pass the configuration file too (sovfl simulate CONFIG --resume RUN_DIR)") from None


def _simulate_args(fn, args: argparse.Namespace) -> int:
    """`sovfl simulate [CONFIG] --resume RUN_DIR`: RUN_DIR is the workdir; CONFIG defaults to the run's."""
    if args.resume:
        run_dir = Path(args.resume).resolve()
        if args.workdir and Path(args.workdir).resolve() != run_dir:
            raise ConfigError(f"--workdir {args.workdir} and --resume {args.resume} name different directories")
        args.workdir = str(run_dir)
        if args.config is None:
            args.config = recorded_config(run_dir)
    elif args.config is None:
        raise ConfigError("sovfl simulate: a configuration file is required (or --resume RUN_DIR)")
    return fn(args)


def register(simulate: argparse.ArgumentParser, coordinator: argparse.ArgumentParser) -> None:
    """Add `--resume` to the simulate and coordinator subcommands."""
    simulate.add_argument("--resume", metavar="RUN_DIR",
                          help="continue the run in RUN_DIR from its last completed round (its configuration "
                               "by default; a different one is refused)")
    for action in simulate._actions:  # CONFIG becomes optional: a resumed run knows its own
        if action.dest == "config":
            action.nargs, action.required, action.default = "?", False, None
    simulate.set_defaults(fn=partial(_simulate_args, simulate.get_default("fn")))
    coordinator.add_argument("--resume", action="store_true",
                             help="continue the run in --workdir from its last completed round (same configuration)")
