"""The planner's routing snapshot is a long poll: it answers a router at once when something changed (a request's
trace, a report) and otherwise only at the end of the router's wait, so an idle app's routers ask rarely."""

from __future__ import annotations

import threading
import time

import httpx

NO_TRACES = 2**62  # a sequence number past every trace: the answer carries none unless one arrives


def test_an_unchanged_snapshot_waits_and_a_request_answers_the_wait(app_url, planner):
    import ray

    held = ray.get(planner.routing_snapshot.remote(NO_TRACES))
    assert held.version != -1 and held.traces == ()

    # Nothing new for the router: the planner holds the call until something changes or the wait ends. (An idle
    # replica's heartbeat may change it in between: then the answer carries a new version.)
    t0 = time.monotonic()
    same = ray.get(planner.routing_snapshot.remote(NO_TRACES, held.version, 1.5))
    waited = time.monotonic() - t0
    assert same.version != held.version or waited >= 1.4, (waited, same.version, held.version)

    # A request while a router waits: its report answers the wait long before the wait's end.
    latest = ray.get(planner.routing_snapshot.remote(held.seq))
    answer: list = []
    waiter = threading.Thread(
        target=lambda: answer.append(
            (ray.get(planner.routing_snapshot.remote(latest.seq, latest.version, 60.0)), time.monotonic())
        )
    )
    t0 = time.monotonic()
    waiter.start()
    time.sleep(0.5)
    body = {"model": "tiny-llama", "prompt": "long poll", "max_tokens": 2}
    assert httpx.post(f"{app_url}/v1/completions", json=body, timeout=60).status_code == 200
    waiter.join(timeout=30)
    assert answer, "the long poll did not answer within 30 s of a request"
    snapshot, at = answer[0]
    assert at - t0 < 30 and (snapshot.version != latest.version or snapshot.traces), snapshot
