"""The link probe (federation/site/link_probe.py) on shaped links, against the links' nominal figures
and against the harness's own measurement of the same link (benchmarks/shaped_link/check.py: plain
TCP sockets, the anchor).

For each link: the harness's check, then the probe of a real BulkServer through that link by a
site's BulkClient (mutual TLS with freshly provisioned certificates, gRPC, one stream), both ways.
Needs root (network namespaces, tc). Not part of `make test`; tests/test_link_probe.py holds the
probe within 20% of nominal on two links.

    sudo python benchmarks/link_probe_check.py [--links 100/30,1000/10,50/50,20/100:80]

A link is RATE/RTT (Mbit/s / ms), or UP/RTT:DOWN for an asymmetric one. Last line:
    RESULT links=<n> worst_probe_vs_nominal=<ratio> worst_probe_vs_harness=<ratio> worst_rtt_ratio=<probe/nominal>
where each ratio is the one furthest from 1 over every link and direction.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shaped_link import ShapedLink, available, check  # noqa: E402
from crypto.pki import CoordinatorBundle, SiteBundle, provision  # noqa: E402
from federation.coordinator.bulk_server import BulkServer  # noqa: E402
from federation.protocol import link_probe as lp  # noqa: E402
from federation.site.bulk_client import BulkClient  # noqa: E402
from federation.site.link_probe import probe  # noqa: E402


def _link(text: str) -> tuple[float, float, float | None]:
    rate, _, rest = text.partition("/")
    rtt, _, down = rest.partition(":")
    return float(rate), float(rtt), float(down) if down else None


def _furthest(ratios: list[float]) -> float:
    return max(ratios, key=lambda r: abs(r - 1.0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", default="100/30,1000/10,50/50,20/100:80")
    ap.add_argument("--seconds", type=float, default=0.5, help="the probe's probe_seconds")
    args = ap.parse_args()
    why = available()
    if why:
        print(f"cannot run: {why}")
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="probe-check-"))
    provision(tmp, ["site"], hosts=("127.0.0.1", "localhost"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = BulkServer(CoordinatorBundle.load(tmp / "coordinator"), tmp, f"127.0.0.1:{port}").start()
    vs_nominal, vs_harness, rtt_ratio = [], [], []
    try:
        for text in args.links.split(","):
            rate, rtt, down = _link(text)
            with ShapedLink(rate, rtt, down) as link:
                harness = check(link)
                client = BulkClient(f"127.0.0.1:{link.forward(('127.0.0.1', server.port))}",
                                    SiteBundle.load(tmp / "sites" / "site"))
                try:
                    fig = probe(client, lp.ProbeSettings(seconds=args.seconds, max_bytes=1 << 30))
                finally:
                    client.close()
            want_down = down or rate
            print(f"link {text}: harness up {harness.up_mbit:.1f} down {harness.down_mbit:.1f} Mbit/s RTT "
                  f"{harness.rtt_ms:.2f} ms; probe up {fig.up_mbit:.1f} down {fig.down_mbit:.1f} Mbit/s RTT "
                  f"{fig.rtt_ms:.2f} ms ({fig.up_bytes / 1e6:.0f}/{fig.down_bytes / 1e6:.0f} MB measured)", flush=True)
            vs_nominal += [fig.up_mbit / rate, fig.down_mbit / want_down]
            vs_harness += [fig.up_mbit / harness.up_mbit, fig.down_mbit / harness.down_mbit]
            rtt_ratio.append(fig.rtt_ms / rtt if rtt else 1.0)
    finally:
        server.stop()
    print(f"RESULT links={len(rtt_ratio)} worst_probe_vs_nominal={_furthest(vs_nominal):.3f} "
          f"worst_probe_vs_harness={_furthest(vs_harness):.3f} worst_rtt_ratio={_furthest(rtt_ratio):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
