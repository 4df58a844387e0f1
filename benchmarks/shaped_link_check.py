"""Check the shaped-link harness (benchmarks/shaped_link/) against its nominal figures.

Builds a link at 100 Mbit/s with 30 ms RTT and one at 1 Gbit/s with 50 ms RTT, measures each with
a bulk TCP transfer each way and a ping-pong (plain Python sockets), and prints one RESULT line
per link: measured / nominal for the rate each way and the RTT. Exits 1 if any figure is more
than 10% off. Needs root (network namespaces, tc). Run: `python benchmarks/shaped_link_check.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shaped_link import ShapedLink, available, check  # noqa: E402

LINKS = [(100.0, 30.0), (1000.0, 50.0)]


def main() -> int:
    why = available()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    bad = 0
    for rate, rtt in LINKS:
        with ShapedLink(rate, rtt) as link:
            m = check(link, seconds=3.0)
        off = m.within(rate, rtt)
        bad += bool(off)
        for what in off:
            print(f"OFF {link.describe()}: {what}")
        print(f"RESULT link={rate:g}Mbit/{rtt:g}ms up_mbit={m.up_mbit:.1f} down_mbit={m.down_mbit:.1f} "
              f"rtt_ms={m.rtt_ms:.2f} up_ratio={m.up_mbit / rate:.3f} down_ratio={m.down_mbit / rate:.3f} "
              f"rtt_ratio={m.rtt_ms / rtt:.3f} within_10pct={'yes' if not off else 'no'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
