"""Fault drills on the secured test app: kill the replica, a trainer rank, the planner and the feedback
store while a prober sends completions, health checks and feedback; each comes back within a minute,
nothing acknowledged is lost, no version is half-written, and the newest version is served again.

The drills are ``tests/drills.py``; the same drills under Locust load, with the embedded model and a
whole-app restart, are ``bench/faults.py`` (figures in docs/benchmarks.md).
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.drills import Prober, drill, kill_named, kill_planner, kill_rank, kill_replica, served_versions
from tests.e2e.secure.conftest import SERVED_ADAPTER

BASE = "tiny-llama"
ADAPTER = f"beta/{SERVED_ADAPTER}"  # beta's, trained once for the package; the admin key names it by its key


@pytest.fixture(scope="module")
def drilled(secure_app, served_adapter) -> dict:
    """The secured app with an adapter that has a served version, and a prober running against it."""
    url = secure_app["url"]
    headers = {"Authorization": f"Bearer {secure_app['keys']['admin']}"}
    served, newest = served_versions(url, headers, BASE, ADAPTER, timeout_s=300)
    if newest is None or served != newest:
        status = httpx.get(f"{url}/v1/status", headers=headers).json()
        info = httpx.get(f"{url}/v1/adapters/{ADAPTER}", headers=headers).json()
        pytest.fail(
            f"no served version: served={served} newest={newest} adapter={info} "
            f"training={status['training']} node={status['nodes'][0]}"
        )
    with Prober(url, BASE, ADAPTER, headers, period=0.5) as prober:
        yield {
            "url": url,
            "headers": headers,
            "prober": prober,
            "name": secure_app["name"],
            "store": "coserve-sec-store",
            "trainer": "coserve-sec-trainer",
            "adapters_root": secure_app["data_dir"] / "adapters",
        }


def _drill(d: dict, target: str, kill) -> dict:
    r = drill(
        target,
        kill,
        d["prober"],
        url=d["url"],
        headers=d["headers"],
        model=BASE,
        adapter=ADAPTER,
        store_name=d["store"],
        adapters_root=d["adapters_root"],
        settle_s=2.0,
    )
    print(r)
    assert r.acked > 0 and r.lost == 0, r
    assert r.half_written == 0, r
    assert r.served == r.newest and r.newest is not None, r
    assert all(s.split()[-1] in ("0", "503", "502", "stalled") for s in r.statuses), r  # never a 500
    return r


def test_planner_killed_comes_back_within_a_minute_and_inference_never_stops(drilled):
    r = _drill(drilled, "planner", lambda: kill_planner(drilled["name"]))
    assert r.recovery_s <= 60, r
    assert not any(s.startswith("completion") for s in r.statuses), r  # requests never wait on the planner


def test_feedback_store_killed_restarts_with_the_same_database(drilled):
    before = drilled["prober"].acked_ids()
    r = _drill(drilled, "store", lambda: kill_named(drilled["store"]))
    assert r.recovery_s <= 60, r
    assert drilled["prober"].acked[-1] > max(before)  # ids go on from the same database


def test_trainer_rank_killed_is_started_again(drilled):
    r = _drill(drilled, "rank", lambda: kill_rank(drilled["trainer"]))
    assert r.failed == 0, r  # serving and feedback do not depend on a trainer rank
    deadline = time.time() + 120
    while time.time() < deadline:
        training = httpx.get(f"{drilled['url']}/v1/status", headers=drilled["headers"]).json()["training"]
        if training.get("state") == "running" and training.get("workers"):
            return
        time.sleep(1)
    pytest.fail(f"the trainer did not start its ranks again: {training}")


def test_replica_killed_is_replaced_and_serves_the_newest_version(drilled):
    r = _drill(drilled, "replica", lambda: kill_replica(drilled["name"]))
    # One node: nothing else serves while the engine starts again, so the probes must have met the outage (a drill
    # that calls the app recovered before its probes answer measures nothing).
    assert r.failed > 0 and 0 < r.recovery_s <= 90, r
