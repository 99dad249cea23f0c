"""Fault drills against a live app: a prober on the completion, health and feedback routes, the kills (the
model replica, a trainer rank, the planner, a named actor such as the feedback store), and what survived
each (acknowledged feedback lost, half-written adapter versions, the version served after recovery).

``tests/e2e/secure/test_fault_drills.py`` runs the drills on the secured test app; ``bench/faults.py``
runs the same drills under Locust load and prints their table (figures in docs/benchmarks.md). The
drills live here, with the tests, so no test imports the benchmarks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

NAMESPACE = "coserve"


@dataclass
class DrillResult:
    target: str
    sent: int
    failed: int
    recovery_s: float
    acked: int
    lost: int
    half_written: int
    served: int | None
    newest: int | None
    statuses: dict[str, int] = field(default_factory=dict)  # failed probe statuses, counted


class Prober:
    """Probes the completion, health and feedback routes every ``period`` seconds, each on its own thread.

    One thread per route: a completion that waits tens of seconds behind a saturated engine must not
    stop the health and feedback probes from measuring the outage (the first prober sent the three
    one after another and barely ran under Locust load). Keeps every outcome.

    A probe that takes longer than ``stall_s`` counts as failed ("stalled"), answered or not: with its
    one replica dead, the app's front door holds a request until a replacement answers, and a client
    that waited that long met an outage. A probe still waiting counts as failing now (``outcome``): a
    drill must not call the app recovered while its probes hang (the replica drill once did, 0 s after
    the kill, and passed)."""

    ROUTES = ("completion", "health", "feedback")

    def __init__(
        self,
        url: str,
        model: str,
        adapter: str,
        headers: dict[str, str],
        period: float = 0.5,
        stall_s: float = 10.0,
    ) -> None:
        self.url, self.model, self.adapter, self.headers, self.period = url, model, adapter, headers, period
        self.stall_s = stall_s
        self.log: list[tuple[float, float, str, int]] = []  # (sent, answered, route, status; 0: no answer)
        self.waiting: dict[str, float] = {}  # route -> when its probe in flight was sent
        self.acked: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(route,), daemon=True) for route in self.ROUTES]

    def __enter__(self) -> Prober:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def _send(self, client: httpx.Client, route: str, n: int) -> httpx.Response:
        if route == "completion":
            return client.post(
                f"{self.url}/v1/completions", json={"model": self.model, "prompt": f"probe {n}", "max_tokens": 4}
            )
        if route == "health":
            return client.get(f"{self.url}/health")
        return client.post(
            f"{self.url}/v1/feedback",
            json={"adapter": self.adapter, "prompt": f"probe {n}", "completion": f"answer {n}"},
        )

    def _run(self, route: str) -> None:
        n = 0
        with httpx.Client(headers=self.headers, timeout=30) as c:
            while not self._stop.is_set():
                n += 1
                sent = time.time()
                with self._lock:
                    self.waiting[route] = sent
                try:
                    r = self._send(c, route, n)
                    status = r.status_code
                except httpx.HTTPError:
                    r, status = None, 0
                with self._lock:
                    del self.waiting[route]
                    self.log.append((sent, time.time(), route, status))
                    if route == "feedback" and status == 202:
                        self.acked.extend(r.json()["ids"])
                self._stop.wait(self.period)

    def longest_wait(self) -> float:
        """Seconds the longest-waiting probe in flight has waited (0: none in flight)."""
        now = time.time()
        with self._lock:
            return max((now - sent for sent in self.waiting.values()), default=0.0)

    def acked_ids(self) -> list[int]:
        """The feedback ids the app acknowledged (202) so far."""
        with self._lock:
            return list(self.acked)

    def outcome(self, since: float) -> tuple[int, int, float, dict[str, int]]:
        """(probes answered after ``since``, how many failed, seconds from ``since`` to the last failure, failed
        statuses counted): a failure is a status outside 2xx ("0": no answer) or an answer after more than
        ``stall_s`` ("stalled"); a probe in flight for longer than that is failing now."""
        now = time.time()
        with self._lock:
            after = [
                (answered, route, s, answered - sent) for sent, answered, route, s in self.log if answered >= since
            ]
            hanging = [route for route, sent in self.waiting.items() if now - sent > self.stall_s]
        failed = [(t, route, s) for t, route, s, took in after if not 200 <= s < 300 or took > self.stall_s]
        failed += [(now, route, -1) for route in hanging]
        statuses: dict[str, int] = {}
        for _, route, s in failed:
            key = f"{route} {'stalled' if 200 <= s < 300 or s < 0 else s}"
            statuses[key] = statuses.get(key, 0) + 1
        return len(after), len(failed), (max(t for t, _, _ in failed) - since) if failed else 0.0, statuses


# ---- the kills -------------------------------------------------------------------------------


def kill_planner(app_name: str) -> None:
    """SIGKILL the planner's process (as ``kill -9`` would); Serve recreates the actor."""
    import ray

    from app.main import planner_of

    pid = ray.get(planner_of(app_name).__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)


def kill_replica(app_name: str, node: int = 0) -> None:
    """Kill node ``node``'s model server replica; Serve starts a replacement."""
    import ray

    from app.main import planner_of

    name = ray.get(planner_of(app_name).node_replicas.remote())[node]
    replica = ray.get_actor(name, namespace="serve")
    ray.kill(replica)
    # ray.kill returns before the process is gone: a drill that checked health at once could meet the dying replica
    # still answering and call the app recovered.
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            ray.get(replica.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{name} still answers 30 s after ray.kill")


def kill_named(name: str) -> None:
    """Kill a named actor of the app (the feedback store, the trainer); Ray restarts it (max_restarts=-1)."""
    import ray

    ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=False)


def kill_rank(trainer_name: str, wait_s: float = 180) -> None:
    """SIGKILL one trainer rank's process; the trainer starts its ranks again.

    Waits (up to ``wait_s``) for a running rank first: right after another drill (a planner restart
    starts a new trainer) the ranks may still be starting."""
    import ray

    deadline, status = time.time() + wait_s, {}
    while True:
        try:
            status = ray.get(ray.get_actor(trainer_name, namespace=NAMESPACE).status.remote(), timeout=30)
        except Exception as exc:  # the trainer itself is being restarted
            status = {"error": f"{type(exc).__name__}: {exc}"}
        # A rank of an earlier group may still be listed: only a live process is a rank to kill.
        pids = [w["pid"] for w in status.get("workers", []) if w.get("pid") and psutil.pid_exists(w["pid"])]
        if status.get("state") == "running" and pids:
            os.kill(pids[0], signal.SIGKILL)
            return
        if time.time() > deadline:
            raise RuntimeError(f"the trainer has no running rank to kill after {wait_s:.0f} s: {status}")
        time.sleep(1)


# ---- what survived ---------------------------------------------------------------------------


def lost_ids(store_name: str, ids: list[int], timeout_s: float = 60) -> int:
    """How many acknowledged feedback ids the store no longer has (asked until the store answers)."""
    import ray

    deadline = time.time() + timeout_s
    while True:
        try:
            store = ray.get_actor(store_name, namespace=NAMESPACE)
            present = ray.get(store.existing_feedback_ids.remote(ids), timeout=30)
            return len(set(ids) - set(present))
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(1)


def half_written(adapters_root: Path) -> int:
    """Version directories under ``adapters_root`` that lack their adapter files (a tenant's adapters are one
    level deeper, under ``@tenant/``)."""
    from actors.learning.versions.layout import ADAPTER_FILES, TENANT_DIR_PREFIX, VERSION_DIR_RE

    bad = 0
    if adapters_root.is_dir():
        adapters = [a for a in adapters_root.iterdir() if a.is_dir() and not a.name.startswith(TENANT_DIR_PREFIX)]
        adapters += [
            a for t in adapters_root.glob(f"{TENANT_DIR_PREFIX}*") if t.is_dir() for a in t.iterdir() if a.is_dir()
        ]
        for adapter in adapters:
            for d in adapter.iterdir():
                if VERSION_DIR_RE.match(d.name) and not all((d / f).is_file() for f in ADAPTER_FILES):
                    bad += 1
    return bad


def served_versions(
    url: str, headers: dict[str, str], model: str, adapter: str, timeout_s: float = 120
) -> tuple[int | None, int | None]:
    """(version node 0 serves, the adapter's current version), once they agree or ``timeout_s`` passed."""
    deadline = time.time() + timeout_s
    served = newest = None
    while time.time() < deadline:
        try:
            newest = httpx.get(f"{url}/v1/adapters/{adapter}", headers=headers, timeout=30).json()["current_version"]
            nodes = httpx.get(f"{url}/v1/status", headers=headers, timeout=30).json()["nodes"]
            served = nodes[0]["adapters"].get(f"{model}:{adapter}")
            if newest is not None and served == newest:
                break
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(1)
    return served, newest


def wait_healthy(url: str, headers: dict[str, str], timeout_s: float = 300) -> float:
    """Seconds until a completion and the adapters list both answer 200."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        try:
            if (
                httpx.get(f"{url}/health", timeout=10).status_code == 200
                and httpx.get(f"{url}/v1/adapters", headers=headers, timeout=10).status_code == 200
            ):
                return time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy within {timeout_s} s")


def drill(
    target: str,
    kill: Callable[[], None],
    prober: Prober,
    *,
    url: str,
    headers: dict[str, str],
    model: str,
    adapter: str,
    store_name: str,
    adapters_root: Path,
    settle_s: float = 5.0,
) -> DrillResult:
    """Kill ``target`` while ``prober`` runs, wait for recovery, and measure what the module docstring lists."""
    time.sleep(settle_s)
    t_kill = time.time()
    kill()
    wait_healthy(url, headers)
    time.sleep(settle_s)  # probes after recovery: a late failure would show up
    # The recovery ends at the last failed probe; keep probing until a quiet stretch follows it.
    deadline = time.time() + 120
    while time.time() < deadline:
        sent, failed, recovery, statuses = prober.outcome(t_kill)
        if time.time() - (t_kill + recovery) > settle_s and prober.longest_wait() < settle_s:
            break
        time.sleep(1)
    acked = prober.acked_ids()
    served, newest = served_versions(url, headers, model, adapter)
    return DrillResult(
        target=target,
        sent=sent,
        failed=failed,
        recovery_s=round(recovery, 1),
        acked=len(acked),
        lost=lost_ids(store_name, acked),
        half_written=half_written(adapters_root),
        served=served,
        newest=newest,
        statuses=statuses,
    )
