"""A shaped link others can run: each site's traffic to the coordinator through an emulated link of
a given rate and RTT (network namespaces, a veth pair, the kernel's tbf, a userspace delay line).

    from benchmarks.shaped_link import ShapedLink, check
    with ShapedLink(rate_mbit=100, rtt_ms=30) as link:
        print(check(link))                           # measured rate each way and RTT
        port = link.forward(("127.0.0.1", 9092))    # point the site at 127.0.0.1:port

link.py says how it is built and what it does not emulate; check.py how it is measured;
`python -m benchmarks.shaped_link --help` holds links up from the command line;
benchmarks/shaped_link_check.py checks two links against their nominal figures.
"""

from benchmarks.shaped_link.check import Measured, check
from benchmarks.shaped_link.link import LinkError, ShapedLink, available

__all__ = ["LinkError", "Measured", "ShapedLink", "available", "check"]
