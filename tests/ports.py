"""Free TCP ports for the suite's servers, picked below the kernel's ephemeral range.

A port found free by binding port 0 is an ephemeral one: between the pick and the server's bind, any process that
binds port 0 (a Ray cluster starting in the other lane opens dozens of gRPC servers so) may be handed the same port.
A fresh-clone run of 2026-11-30 lost its apps lane so: HAProxy, started a few seconds after the pick, could not
bind 127.0.0.1:43255 ("Address already in use"). Below the ephemeral range only an explicit bind takes a port.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ray's `ray start` gives its workers ports 10002-19999 by default and refuses a component port inside that range
# (the job-submit test's head names its ports).
LOWEST = 20000
# Serve's replicas take their own HTTP ports from 30000 up (direct ingress, RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT).
HIGHEST = 30000


def _top() -> int:
    return min(HIGHEST, _ephemeral_start())


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, from [20000, 30000) below the ephemeral range."""
    high = _top()
    if high - LOWEST < 1000:  # a kernel that hands out nearly every port: the ephemeral pick, as before
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = random.randrange(LOWEST, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{LOWEST}, {high}) after 200 tries")


def free_ports(n: int) -> list[int]:
    """``n`` different free ports (for a server that binds several at once, e.g. ``ray start`` with every port named)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports
