"""free_port picks loopback ports no outgoing connection can take before our server binds them."""

import socket

from federation.ops import supervisor


def test_ports_lie_outside_the_kernels_ephemeral_range_and_bind():
    lo, hi = supervisor._ephemeral_ports()
    for _ in range(50):
        port = supervisor.free_port()
        assert not lo <= port <= hi, (port, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free


def test_a_port_in_use_is_never_picked(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    monkeypatch.setattr(supervisor, "_ephemeral_ports", lambda: (taken + 1, 65535))
    with socket.socket() as other:  # a port free a moment ago: the pick after two taken ones
        other.bind(("127.0.0.1", 0))
        free = other.getsockname()[1]
    picks = iter([taken, taken, free])
    monkeypatch.setattr(supervisor._pick, "choice", lambda ports: next(picks))
    try:
        assert supervisor.free_port() == free
    finally:
        held.close()


def test_an_unreadable_range_falls_back_to_linuxs_default(monkeypatch, tmp_path):
    monkeypatch.setattr(supervisor, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert supervisor._ephemeral_ports() == (32768, 60999)
    (tmp_path / "range").write_text("40000\t50000\n")
    monkeypatch.setattr(supervisor, "EPHEMERAL_RANGE", tmp_path / "range")
    assert supervisor._ephemeral_ports() == (40000, 50000)


def test_a_range_that_leaves_no_port_outside_it_gets_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(supervisor, "_ephemeral_ports", lambda: (1024, 65535))
    port = supervisor.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
