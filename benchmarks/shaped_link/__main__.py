"""Hold shaped links up from the command line (root): one per --rate/--rtt, each forwarding the
given targets, until interrupted. Each forward is printed as `FORWARD <target> -> 127.0.0.1:<port>`;
point the site's processes at the local port instead of the coordinator's.

    sudo python -m benchmarks.shaped_link --rate 100 --rtt 30 --forward 127.0.0.1:9092 --check
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from benchmarks.shaped_link.check import check
from benchmarks.shaped_link.link import LinkError, ShapedLink


def _target(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.shaped_link", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, required=True, help="Mbit/s each way (the uplink with --down)")
    ap.add_argument("--down", type=float, default=None, help="downlink Mbit/s (default: --rate)")
    ap.add_argument("--rtt", type=float, required=True, help="round-trip time, ms")
    ap.add_argument("--forward", type=_target, action="append", default=[], help="HOST:PORT to reach (repeat)")
    ap.add_argument("--check", action="store_true", help="measure the link first; exit 1 if >10%% off nominal")
    args = ap.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with ShapedLink(args.rate, args.rtt, args.down) as link:
            if args.check:
                m = check(link)
                off = m.within(args.rate, args.rtt, down_mbit=args.down)
                print(f"CHECK {link.describe()}: up {m.up_mbit:.1f} Mbit/s, down {m.down_mbit:.1f} Mbit/s, "
                      f"RTT {m.rtt_ms:.2f} ms" + (f"; OFF: {'; '.join(off)}" if off else "; ok"), flush=True)
                if off:
                    return 1
            for target in args.forward:
                link.forward(target)
            for target, port in link.ports.items():
                if target in args.forward:
                    print(f"FORWARD {target[0]}:{target[1]} -> 127.0.0.1:{port}", flush=True)
            try:
                stop.wait()
            except KeyboardInterrupt:
                pass
    except LinkError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
