"""A front door that holds (issue 29), on the live app: thousands of half-sent requests neither hold HAProxy
nor keep ``/health`` from answering, HAProxy cuts them at ``ingress.haproxy.request_timeout_s``, one client
address gets at most ``maxconn_per_source`` connections, and nothing of the front door listens beyond
loopback while ``http_options.host`` is 127.0.0.1.

Run (starts Ray, Serve and vLLM; not beside a benchmark):
``.venv/bin/python -m pytest -q tests/e2e/secure/test_front_door.py``.
"""

from __future__ import annotations

import ipaddress
import json
import resource
import selectors
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from deployments.front_door import FrontDoor

FLOOD = 2000
FLOOD_SOURCE = "127.0.0.2"  # loopback too (127/8), but another client address than the probes' 127.0.0.1


@pytest.fixture
def many_fds():
    """Room for the flood's sockets beside the suite's own (Ray's clients, httpx)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FLOOD + 2048
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}: cannot hold {FLOOD} sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _half_sent(host: str, port: int, i: int, prefix: str) -> socket.socket | None:
    """A connection from FLOOD_SOURCE that sends part of a request and then nothing: every other one stops in
    the request line, the rest after complete headers, in the body (Content-Length says more is coming)."""
    try:
        s = socket.create_connection((host, port), timeout=5, source_address=(FLOOD_SOURCE, 0))
    except OSError:
        return None
    if i % 2:
        part = f"POST {prefix}/v1/chat/completions HTT"
    else:
        part = (
            f"POST {prefix}/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f'Content-Length: 100\r\n\r\n{{"model": '
        )
    try:
        s.sendall(part.encode())
    except OSError:  # closed at once: over the per-source cap
        pass
    s.setblocking(False)
    return s


def _closed_by_the_server(socks: list[socket.socket], within_s: float) -> tuple[list[bytes], int]:
    """Reads every socket until the server closes it or ``within_s`` passes: what each received, and how
    many are still open at the end."""
    sel = selectors.DefaultSelector()
    got: dict[int, bytes] = {}
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
        got[s.fileno()] = b""
    open_ = len(socks)
    deadline = time.monotonic() + within_s
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            s = key.fileobj
            try:
                data = s.recv(65536)
            except (ConnectionResetError, BlockingIOError, OSError) as exc:
                if isinstance(exc, BlockingIOError):
                    continue
                data = b""
            if data:
                got[s.fileno()] += data
                continue
            sel.unregister(s)
            open_ -= 1
    sel.close()
    return list(got.values()), open_


def test_half_sent_requests_do_not_hold_the_front_door(secure_app, many_fds):
    door = FrontDoor.from_environment()  # what Serve was started with (tests/conftest.py, app/serve_env.py)
    url = secure_app["url"]
    parts = urlsplit(url)
    host, port, prefix = parts.hostname, parts.port, parts.path.rstrip("/")
    try:
        socket.create_connection((host, port), timeout=5, source_address=(FLOOD_SOURCE, 0)).close()
    except OSError as exc:
        pytest.skip(f"cannot connect from {FLOOD_SOURCE}: {exc}")
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200

    socks: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        for i in range(FLOOD):
            s = _half_sent(host, port, i, prefix)
            if s is not None:
                socks.append(s)
        opened_s = time.monotonic() - t0
        assert len(socks) >= min(FLOOD, door.maxconn_per_source or FLOOD), f"only {len(socks)} connections opened"

        # While the flood holds what it can, another client is served at once.
        for _ in range(3):
            t = time.perf_counter()
            r = httpx.get(f"{url}/health", timeout=5)
            took = time.perf_counter() - t
            assert r.status_code == 200 and took < 1.0, f"/health took {took:.3f} s ({r.status_code}) during the flood"
        if door.maxconn_per_source is not None and time.monotonic() - t0 < door.request_timeout_s - 2:
            # The flood's address is at its cap (its first connections are still held): one more connection
            # from it is closed, never served (HAProxy may reset it while it connects, or right after).
            answer = b""
            try:
                extra = socket.create_connection((host, port), timeout=5, source_address=(FLOOD_SOURCE, 0))
            except (ConnectionResetError, ConnectionRefusedError):
                extra = None
            if extra is not None:
                extra.settimeout(5)
                try:
                    extra.sendall(f"GET {prefix}/health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                    answer = extra.recv(65536)
                except OSError:
                    pass
                finally:
                    extra.close()
            assert not answer.startswith(b"HTTP/1.1 200"), answer[:200]

        # HAProxy cuts every held connection once request_timeout_s has passed since it arrived.
        received, still_open = _closed_by_the_server(socks, door.request_timeout_s + opened_s + 5)
        assert still_open == 0, f"{still_open} half-sent requests still open after {door.request_timeout_s} s"
        timed_out = [r for r in received if r.startswith(b"HTTP/1.1 408")]
        assert timed_out, "no half-sent request got HAProxy's 408"
        if door.maxconn_per_source is not None:
            assert len(timed_out) <= door.maxconn_per_source, len(timed_out)
        body = json.loads(timed_out[0].split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout"
        assert not any(r.startswith(b"HTTP/1.1 2") for r in received)
    finally:
        for s in socks:
            s.close()
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def _serve_processes() -> tuple[dict[int, str], dict[int, int]]:
    """The front door's processes: Serve's actors (controller, HAProxy managers, proxies, every replica and
    router) and everything they started (HAProxy, vLLM's engine processes), by pid with a label; and the
    port of each actor's Ray core-worker server (Ray's own RPC, bound to the node's address by Ray)."""
    import psutil
    import ray
    from ray._private import state
    from ray.util.state import list_actors

    here = ray.get_runtime_context().gcs_address  # this suite's cluster, even beside another on the machine
    actors = [
        a
        for a in list_actors(
            address=here, filters=[("state", "=", "ALIVE")], limit=10_000, raise_on_missing_output=False
        )
        if a.ray_namespace == "serve" and a.pid
    ]
    ray_ports = {
        info["Pid"]: info["Address"]["Port"]
        for info in state.actors(actor_state_name="ALIVE").values()
        if info.get("Pid")
    }
    labels: dict[int, str] = {}
    for a in actors:
        labels[a.pid] = f"{a.class_name} {a.name}"
        try:
            for child in psutil.Process(a.pid).children(recursive=True):
                labels.setdefault(child.pid, f"{child.name()} (child of {a.class_name})")
        except psutil.NoSuchProcess:
            continue
    return labels, ray_ports


def test_nothing_of_the_front_door_listens_beyond_loopback(secure_app):
    import psutil
    from ray.serve.context import _get_global_client

    host = _get_global_client().http_config.host
    assert host == "127.0.0.1", f"this check is for http_options.host 127.0.0.1, not {host}"
    labels, ray_ports = _serve_processes()
    grpc_wildcards: dict[int, int] = {}  # replica pid -> its listeners on [::]
    assert any(label.startswith("haproxy") for label in labels.values()), labels
    assert any(label.startswith("HAProxyManager") for label in labels.values()), labels
    listening, outside = [], []
    for pid, label in labels.items():
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            if c.status != psutil.CONN_LISTEN:
                continue
            ip, port = c.laddr.ip, c.laddr.port
            listening.append((label, ip, port))
            if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
                continue
            if ray_ports.get(pid) == port:
                continue  # the actor's Ray core-worker RPC server: Ray's cluster plane, not the app's
            if ip == "::" and label.startswith("ServeReplica") and grpc_wildcards.get(pid, 0) == 0:
                # Serve's inter-deployment gRPC server: every replica binds one on [::]:0 (Ray 2.60, Replica:
                # add_port_to_grpc_server(server, "[::]:0"), no host setting), Ray's cluster plane like the
                # core-worker port. One per replica; a second wildcard listener would be the app's.
                grpc_wildcards[pid] = 1
                continue
            outside.append(f"{label} (pid {pid}) listens on {ip}:{port}")
    assert listening, "found no listener at all: the process lookup is broken"
    assert not outside, outside


def test_one_node_is_served_without_a_routing_round_trip(secure_app):
    """The secured app has one node: HAProxy sends its requests straight to the replica, with no call to a
    placement router on the way (the session app beside it, two nodes, asks its router for each request)."""
    import re

    from ray import serve

    apps = serve.status().applications
    assert set(apps[secure_app["name"]].deployments) == {"ModelServer"}
    assert "PlacementRouter" in apps["coserve"].deployments
    labels, _ = _serve_processes()
    haproxy = next(pid for pid, label in labels.items() if label.startswith("haproxy"))
    argv = open(f"/proc/{haproxy}/cmdline", "rb").read().decode().split("\0")
    cfg = open(argv[argv.index("-f") + 1]).read()
    backend_of = {m.group(2): m.group(1) for m in re.finditer(r"acl is_(\S+) path_beg (\S+)", cfg)}
    routed = set(re.findall(r"set-var\(txn\.ingress_request_router_app\) str\((\S+)\)", cfg))
    assert backend_of["/sec/"] not in routed and backend_of["/"] in routed, (backend_of, routed)
    r = httpx.post(
        f"{secure_app['url']}/v1/completions",
        json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {secure_app['keys']['acme']}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
