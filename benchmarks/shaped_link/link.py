"""A shaped link between a site and the coordinator: network namespaces, a veth pair, tbf, a delay line.

    site process ──▶ 127.0.0.1:<port>   entry relay (host)          adds the downlink's RTT/2
                        │ socket made in namespace <ns>-s
                        ▼
                 veth <if>s ── tbf rate ──▶ veth <if>c  (10.213.<n>.2 -> 10.213.<n>.1, a /30 that
                 (namespace <ns>-s)   ◀── tbf rate ── (namespace <ns>-c)   exists only in them)
                        │ socket listening in namespace <ns>-c
                        ▼
                 exit relay (host)                   adds the uplink's RTT/2
                        │
                        ▼
                 target 127.0.0.1:<coordinator port>

The rate is the kernel's token bucket (tbf) on the egress of each end of the veth pair, so each
direction has its own; the veth's MTU is raised so that headers cost under 1% of the rate. The
delay is userspace (relay.py: sch_netem is not in this kernel): each direction's RTT/2 is added
after the rate limit, where the bytes in flight are at most rate x RTT/2, without serialising
delay and throughput; what the path adds of its own (the relays, the kernel, timers: about 1 ms,
measured when the link is built) comes off the line, so the RTT end to end is the nominal one.
The relays run in two processes of their own (by path, stdlib only). Every
address, interface and qdisc lives in the two namespaces the link creates and deletes; the host
only sees loopback connections, so nothing outside this machine, nor its own network, is touched.

What it does not emulate: the relays terminate TCP (like a performance-enhancing proxy), so an
end-to-end connection's congestion control sees loopback, not the RTT: a transfer runs at the
link's rate from its first byte (no slow start over the RTT), and a new connection costs no round
trip to set up. Request/response exchanges and bulk transfers see the link's RTT and rate, which
is what a federation round's time is made of. No loss, no jitter.

Needs root (ip netns, tc) and the `ip`/`tc` tools; `check()` (check.py) measures what a link
gives. Used as a context manager:

    with ShapedLink(rate_mbit=100, rtt_ms=30) as link:
        port = link.forward(("127.0.0.1", 9092))   # the site connects to 127.0.0.1:port
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.shaped_link.check import TargetServer, ping_ms

RELAY = Path(__file__).with_name("relay.py")
MTU = 9000
_numbers = itertools.count(1)


class LinkError(RuntimeError):
    """The link could not be built (not root, no `ip`/`tc`, a command failed); the text says which."""


def _run(*cmd: str) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise LinkError(f"{cmd[0]!r} not found: the shaped link needs iproute2 (ip, tc)") from None
    if proc.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def available() -> str | None:
    """None if this machine can build shaped links; otherwise why not (for a skip message)."""
    if os.geteuid() != 0:
        return "shaped links need root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"shaped links need {tool!r} (iproute2)"
    return None


@dataclass
class ShapedLink:
    """One emulated link: `rate_mbit` each way (or `down_mbit` for the downlink), `rtt_ms` round trip."""

    rate_mbit: float
    rtt_ms: float
    down_mbit: float | None = None
    name: str = field(default_factory=lambda: "sl" + uuid.uuid4().hex[:6])  # 8 chars: interface names <= 15
    ports: dict[tuple[str, int], int] = field(default_factory=dict)  # target -> local port
    overhead_ms: float = 0.0  # the path's own RTT (relays, kernel, timers), taken off the delay line
    _relays: list[subprocess.Popen] = field(default_factory=list)
    _number: int = 0

    def __post_init__(self):
        if self.rate_mbit <= 0 or (self.down_mbit is not None and self.down_mbit <= 0) or self.rtt_ms < 0:
            raise ValueError(f"rate must be positive and rtt non-negative: {self.rate_mbit} Mbit/s, {self.rtt_ms} ms")

    @property
    def site_ns(self) -> str:
        return f"{self.name}-s"

    @property
    def coord_ns(self) -> str:
        return f"{self.name}-c"

    @property
    def coord_addr(self) -> str:
        return f"10.213.{self._number}.1"

    # ---- building ---------------------------------------------------------------------------
    def __enter__(self) -> "ShapedLink":
        why = available()
        if why:
            raise LinkError(why)
        self._number = next(_numbers) % 250 + 1  # per process: each link has its namespaces, so reuse is fine
        try:
            self._build()
            self._calibrate()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        s, c = self.site_ns, self.coord_ns
        vs, vc = f"{self.name}s", f"{self.name}c"
        for ns in (s, c):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # enough socket memory for a full bandwidth-delay product even where TCP's RTT is not ~0
            for key in ("tcp_rmem", "tcp_wmem"):  # per namespace; sh rather than sysctl (procps may be absent)
                _run("ip", "netns", "exec", ns, "sh", "-c", f"echo '4096 262144 67108864' > /proc/sys/net/ipv4/{key}")
        _run("ip", "link", "add", vs, "netns", s, "mtu", str(MTU), "type", "veth", "peer", "name", vc,
             "netns", c, "mtu", str(MTU))
        n = self._number
        _run("ip", "-n", s, "addr", "add", f"10.213.{n}.2/30", "dev", vs)
        _run("ip", "-n", c, "addr", "add", f"10.213.{n}.1/30", "dev", vc)
        for ns, dev, mbit in ((s, vs, self.rate_mbit), (c, vc, self.down_mbit or self.rate_mbit)):
            self._shape(ns, dev, mbit)
            _run("ip", "-n", ns, "link", "set", dev, "up")

    def _calibrate(self) -> None:
        """Measure the RTT the path gives with the nominal delay line and take what it adds of its
        own (four relay crossings, the kernel, timers waking late: about 1 ms here) off the line,
        so that the RTT end to end is the nominal one; 1 Gbit/s at 10 ms measured 11.2 ms without.
        The fastest of 40 exchanges: a busy machine only adds to some, and the median of a loaded
        moment took 4.5 ms off a 20 ms link."""
        if self.rtt_ms <= 0:
            return
        server = TargetServer()
        try:
            got = ping_ms(self.forward(server.address), pings=40, stat=min)
        finally:
            server.close()
            self._stop_relay()
            self.ports = {}
        self.overhead_ms = min(max(0.0, got - self.rtt_ms), self.rtt_ms)

    @staticmethod
    def _shape(ns: str, dev: str, mbit: float) -> None:
        """tbf at `mbit`: a bucket of 4 ms of traffic (at least a few frames), a queue of 20 ms."""
        byte_rate = mbit * 1e6 / 8
        burst = max(int(byte_rate * 0.004), 4 * (MTU + 14))
        # tbf's rate counts each frame's bytes: TCP/IP/Ethernet headers (~66 of a 9014-byte frame) are
        # paid for, so the bucket runs at rate x frame/payload and the bytes the application sees
        # arrive at the nominal rate
        frame_rate = byte_rate * (MTU + 14) / (MTU - 52)
        _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(frame_rate * 8)}bit",
             "burst", str(burst), "latency", "20ms")

    def forward(self, target: tuple[str, int]) -> int:
        """A local port (127.0.0.1) whose connections reach `target` through the link."""
        target = (str(target[0]), int(target[1]))
        if target in self.ports:
            return self.ports[target]
        self._restart_relay([*self.ports, target])
        return self.ports[target]

    def _restart_relay(self, targets: list[tuple[str, int]]) -> None:
        # two processes (the entry and the exit side, one core each at a high rate), each with every
        # route: restarted with the whole list (earlier targets keep their ports, but connections
        # open through them are cut), so add forwards before the traffic starts
        self._stop_relay()
        half = (self.rtt_ms - self.overhead_ms) / 2000
        byte_rate = max(self.rate_mbit, self.down_mbit or 0) * 1e6 / 8
        common = {"max_queue_bytes": int(4 * byte_rate * half) + (8 << 20), "realtime": 10}
        exits = [{"listen": [self.coord_addr, 7000 + i], "listen_ns": self.coord_ns, "connect": list(target),
                  "connect_ns": None, "delay_forward": half, "delay_backward": 0.0}  # uplink's RTT/2
                 for i, target in enumerate(targets)]
        entries = [{"listen": ["127.0.0.1", self.ports.get(target, 0)],  # a target's port stays what it was
                    "listen_ns": None, "connect": [self.coord_addr, 7000 + i],
                    "connect_ns": self.site_ns, "delay_forward": 0.0, "delay_backward": half}  # downlink's
                   for i, target in enumerate(targets)]
        self._start(exits, common)
        ports = self._start(entries, common)
        self.ports = dict(zip(targets, ports))

    def _start(self, routes: list[dict], common: dict) -> list[int]:
        proc = subprocess.Popen([sys.executable, str(RELAY), json.dumps({"routes": routes, **common})],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._relays.append(proc)
        line = proc.stdout.readline()
        if not line.startswith("READY"):
            raise LinkError(f"the delay relay did not start: {line.strip()} {proc.stderr.read().strip()}")
        return [int(p) for p in line.split()[1:]]

    # ---- tearing down -----------------------------------------------------------------------
    def _stop_relay(self) -> None:
        while self._relays:
            proc = self._relays.pop()
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Stop the relay and delete both namespaces (and with them the veth pair and its qdiscs)."""
        self._stop_relay()
        for ns in (self.site_ns, self.coord_ns):
            if Path(f"/var/run/netns/{ns}").exists():
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def describe(self) -> str:
        down = f", down {self.down_mbit:g} Mbit/s" if self.down_mbit else ""
        own = f" ({self.overhead_ms:.1f} ms of it the path's own)" if self.overhead_ms else ""
        return f"{self.rate_mbit:g} Mbit/s{down}, RTT {self.rtt_ms:g} ms{own}"
