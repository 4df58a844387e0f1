"""`sovfl health`: a container health check that needs nothing but the standard library.

The coordinator is healthy while its SuperLink accepts connections (`--tcp 127.0.0.1:9092`); a
site's node 0 while its trainer's endpoint (the Unix socket rank 0 serves, `--unix`, a glob since
the default socket name carries the site and a start time) accepts them. It connects and closes:
no request reaches the process, and the exit code (0 healthy, 1 not) is all a runtime reads.
The images run it as `python -m federation.ops.health_cmd` (this module imports nothing of the
project: 0.2 s, where `sovfl health` loads the whole CLI, seconds on a loaded host, past a
probe's timeout).
"""

from __future__ import annotations

import argparse
import glob
import socket
import sys


def tcp_accepts(address: str, timeout_s: float) -> bool:
    """Whether HOST:PORT accepts a TCP connection within `timeout_s`."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def unix_accepts(pattern: str, timeout_s: float) -> bool:
    """Whether a Unix socket matching `pattern` accepts a connection within `timeout_s`."""
    for path in sorted(glob.glob(pattern)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            try:
                s.connect(path)
                return True
            except OSError:
                continue
    return False


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when every given endpoint accepts a connection, 1 (naming the first that does not) otherwise."""
    checks = [(f"tcp {a}", tcp_accepts, a) for a in args.tcp or []] + \
             [(f"unix {p}", unix_accepts, p) for p in args.unix or []]
    if not checks:
        print("sovfl health: give --tcp HOST:PORT and/or --unix PATH_GLOB", file=sys.stderr)
        return 2
    for label, check, target in checks:
        if not check(target, args.timeout):
            print(f"unhealthy: {label} does not accept connections", file=sys.stderr)
            return 1
    print("healthy")
    return 0


def _arguments(h: argparse.ArgumentParser) -> None:
    h.add_argument("--tcp", action="append", help="HOST:PORT that must accept a TCP connection (repeatable)")
    h.add_argument("--unix", action="append", help="a Unix socket path or glob; one match must accept (repeatable)")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds per connection attempt (default 3)")


def add_parser(sub) -> None:
    """Register `sovfl health` on the CLI's subparsers."""
    h = sub.add_parser("health", help="container health check: endpoints accept connections (exit 0) or not (1)")
    _arguments(h)
    h.set_defaults(fn=cmd_health)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m federation.ops.health_cmd", description=__doc__.split("\n")[0])
    _arguments(parser)
    sys.exit(cmd_health(parser.parse_args()))
