"""Replicas report one execution trace per request to the planner, under the request's X-Request-Id.

The placement router plans a request under the same id (HAProxy sets one when the client did not),
so the trace calibrates that plan.
"""

from __future__ import annotations

import time

import httpx


def test_trace_of_a_request_reaches_the_planner(ray_cluster, app_url, planner):
    import ray

    body = {"model": "tiny-llama", "prompt": "0123456789", "max_tokens": 7, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{app_url}/v1/completions", json=body, timeout=60,
                      headers={"X-Request-Id": "trace-me-1"}) as r:
        assert r.status_code == 200
        list(r.iter_lines())
    deadline = time.time() + 10
    trace = None
    while time.time() < deadline and trace is None:
        trace = next((t for t in ray.get(planner.recent_traces.remote()) if t.task_id == "trace-me-1"), None)
        time.sleep(0.2)
    assert trace is not None, "the replica's trace never reached the planner"
    assert trace.ok and trace.prompt_tokens == 11 and trace.output_tokens == 7  # 10 bytes + BOS
    assert trace.arrival <= trace.first_token <= trace.finish
