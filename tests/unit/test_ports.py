"""The suite's ports come from below the ephemeral range and Serve's replica ports, where no other process's port-0
bind or replica can take them."""

from __future__ import annotations

import socket

from tests.ports import LOWEST, _top, free_port


def test_a_picked_port_is_below_the_ephemeral_range_and_free():
    high = _top()
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST <= p < high for p in ports), sorted(ports)
    assert len(ports) > 1  # picked at random, not one fixed port every lane and suite would share
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # nothing listens there


def test_a_port_in_use_is_not_picked(monkeypatch):
    import random

    taken = free_port()
    other = taken + 1 if taken + 1 < _top() else taken - 1
    picks = iter([taken, taken, other])
    with socket.socket() as held:
        held.bind(("127.0.0.1", taken))
        monkeypatch.setattr(random, "randrange", lambda lo, hi: next(picks))
        assert free_port() == other


def test_ports_for_one_server_are_all_different(monkeypatch):
    import random

    from tests.ports import free_ports

    a, b, c = free_ports(3)  # free now, whatever else runs on this machine
    picks = iter([a, a, b, a, c])
    monkeypatch.setattr(random, "randrange", lambda lo, hi: next(picks))
    assert free_ports(3) == [a, b, c]
