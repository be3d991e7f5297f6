"""free_port hands out ports outside the kernel's ephemeral range: a port there can be taken as
the local port of an outgoing connection before the listener it was picked for binds it (an etcd
member of the test suite failed to start that way: address already in use)."""

from __future__ import annotations

import socket

from motor import ports


def test_a_free_port_is_outside_the_ephemeral_range_and_can_be_bound():
    with open(ports.EPHEMERAL_RANGE, encoding="ascii") as handle:
        low, high = (int(value) for value in handle.read().split())
    for _ in range(20):
        port = ports.free_port()
        assert not low <= port <= high, f"{port} is in the ephemeral range {low}-{high}"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # As every listener Motor starts binds (gRPC, aiohttp, uvicorn): a port whose last
            # connection is still in TIME_WAIT is free for a listener, and free_port may give it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "_outside_ephemeral_range", lambda: range(busy, busy + 1))
        port = ports.free_port()  # the only candidate is taken: any port the kernel says is free
        assert port != busy


def test_a_port_handed_out_and_not_bound_yet_is_not_handed_out_again(monkeypatch):
    # (a node manager's gRPC and /metrics listeners were once given the same port: one exited)
    first = ports.free_port()
    picks = iter([first, first, first])  # the random pick lands on it again, still free

    def choice(candidates):
        return next(picks, None) or candidates[0]

    monkeypatch.setattr(ports.random, "choice", choice)
    second = ports.free_port()
    assert ports.port_is_free(first, "127.0.0.1")  # nothing bound it: only the memory keeps it apart
    assert second != first
