"""One large update over a shaped wide-area link: does the data path fill it?

The coordinator's data path server (coordinator/bulk_server.py) and a site's client
(site/bulk_client.py), the classes a federation runs, with mutual TLS from a freshly provisioned
PKI, move one blob of `--gb` GB up (the site's update, written to the coordinator's disk as it
lands) and down (the model) through a link shaped by benchmarks/shaped_link (network namespaces,
the kernel's tbf for the rate, a userspace delay line for the RTT: this kernel has no sch_netem).
The link is checked against its nominal rate and RTT first (within 10%), and the anchor is the link
itself: a plain TCP bulk transfer over the same link in the same run, which no protocol can beat.

    sudo .venv/bin/python benchmarks/bulk_shaped_link.py                      # 1 Gbit/s, 50 ms RTT, 1 GB
    sudo .venv/bin/python benchmarks/bulk_shaped_link.py --mbit 100 --rtt-ms 30 --gb 0.25

Last line: `RESULT link=<rate>/<rtt> gb=<size> up_mbit_s=<..> down_mbit_s=<..> link_mbit_s=<measured> fill=<min(up, down) / nominal>`
(target: fill >= 0.8).
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shaped_link import ShapedLink, check  # noqa: E402
from crypto.pki import CoordinatorBundle, SiteBundle, provision  # noqa: E402
from federation.coordinator.bulk_server import BulkServer  # noqa: E402
from federation.protocol.bulk import Blob, Ref  # noqa: E402
from federation.site.bulk_client import BulkClient  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mbit", type=float, default=1000.0)
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--streams", type=int, default=4)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bulk-shaped-"))
    provision(tmp / "pki", ["paris"], hosts=("127.0.0.1", "localhost"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = BulkServer(CoordinatorBundle.load(tmp / "pki" / "coordinator"), tmp / "coord", f"127.0.0.1:{port}").start()
    server.window(1, 1)
    data = np.random.default_rng(0).integers(0, 256, int(args.gb * 1e9), dtype=np.uint8)
    blob = Blob([data])
    t0 = time.perf_counter()
    root = blob.root
    print(f"# {blob.size / 1e9:.2f} GB blob, {blob.count} chunks, hashed in {time.perf_counter() - t0:.1f}s", flush=True)
    try:
        with ShapedLink(rate_mbit=args.mbit, rtt_ms=args.rtt_ms) as link:
            measured = check(link)
            off = measured.within(args.mbit, args.rtt_ms)
            print(f"# link {args.mbit:g} Mbit/s, {args.rtt_ms:g} ms: measured {measured}"
                  f"{'; OFF NOMINAL: ' + ', '.join(off) if off else ' (within 10% of nominal)'}", flush=True)
            client = BulkClient(f"127.0.0.1:{link.forward(('127.0.0.1', port))}",
                                SiteBundle.load(tmp / "pki" / "sites" / "paris"), streams=args.streams)
            t0 = time.perf_counter()
            client.upload(blob, 1, 1, deadline_s=3600)
            up_s = time.perf_counter() - t0
            got = server.take("paris", root, blob.size, blob.chunk)
            assert len(got) == blob.size
            del got
            server.release("paris", root)
            server.offer(blob)
            t0 = time.perf_counter()
            out = client.download(Ref(root, blob.size, blob.chunk, 0, blob.size, "numpy.ndarray"), deadline_s=3600)
            down_s = time.perf_counter() - t0
            assert bytes(out[:1 << 20]) == data[:1 << 20].tobytes() and len(out) == blob.size
            client.close()
    finally:
        server.stop()
    up, down = blob.size * 8 / 1e6 / up_s, blob.size * 8 / 1e6 / down_s
    print(f"# upload {up_s:.1f}s ({up:.0f} Mbit/s), download {down_s:.1f}s ({down:.0f} Mbit/s), {args.streams} streams")
    link_rate = min(measured.up_mbit, measured.down_mbit)
    print(f"RESULT link={args.mbit:g}Mbit/{args.rtt_ms:g}ms gb={blob.size / 1e9:.2f} up_mbit_s={up:.0f} "
          f"down_mbit_s={down:.0f} link_mbit_s={link_rate:.0f} fill={min(up, down) / args.mbit:.2f}")


if __name__ == "__main__":
    main()
