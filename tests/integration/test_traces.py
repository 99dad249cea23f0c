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
    with httpx.stream(
        "POST", f"{app_url}/v1/completions", json=body, timeout=60, headers={"X-Request-Id": "trace-me-1"}
    ) as r:
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


def _engine_counters(app_url: str, timeout: float = 30.0) -> dict[int, tuple[int, int, int]]:
    """Each node's engine (iterations, steps_with_waiting, waiting_peak) from ``/v1/status``, once nothing
    is in flight and the counters stayed the same over a few reports (the replicas report every
    ``planner.trace_flush_seconds``, and once more when their last request ends)."""
    deadline = time.time() + timeout
    last: dict[int, tuple[int, int, int]] | None = None
    while True:
        nodes = httpx.get(f"{app_url}/v1/status", timeout=30).json()["nodes"]
        counters = {
            n["node_id"]: (0, 0, 0)
            if n["engine"] is None
            else (n["engine"]["iterations"], n["engine"]["steps_with_waiting"], n["engine"]["waiting_peak"])
            for n in nodes
        }
        idle = all(n["in_flight"] == 0 and (n["engine"] is None or n["engine"]["requests"] == 0) for n in nodes)
        if (idle and counters == last) or time.time() > deadline:
            return counters
        last = counters
        time.sleep(1.0)


def test_engine_reports_the_steps_that_left_requests_waiting_in_vllm(ray_cluster, app_url, app_config):
    """vLLM queues a request only when a step cannot start it (``engine.max_num_seqs`` running, no token
    budget or KV blocks left). One request never waits; a burst of three times ``max_num_seqs`` per
    node does, and the replica's stat logger counts those steps and the longest queue."""
    from concurrent.futures import ThreadPoolExecutor

    def stream(k: int, max_tokens: int) -> bool:
        body = {
            "model": "tiny-llama",
            "prompt": f"{k}: the plan ships small steps",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{app_url}/v1/completions", json=body, timeout=120) as r:
            list(r.iter_lines())
            return r.status_code == 200

    before = _engine_counters(app_url)
    assert stream(0, 16)
    single = _engine_counters(app_url)
    assert sum(single[n][0] - before[n][0] for n in before) >= 16  # the request's steps were seen
    assert {n: c[1:] for n, c in single.items()} == {n: c[1:] for n, c in before.items()}  # and none left one waiting

    seqs, nodes = app_config["engine"]["max_num_seqs"], app_config["cluster"]["nodes"]
    burst = 3 * seqs * nodes  # round robin: 3 × max_num_seqs per node, all at once
    with ThreadPoolExecutor(burst) as pool:
        assert all(pool.map(lambda k: stream(k, 64), range(1, burst + 1)))
    after = _engine_counters(app_url)
    print(
        f"engine counters (iterations, steps_with_waiting, waiting_peak): before {before}, after one request "
        f"{single}, after a burst of {burst}: {after}"
    )
    for n in after:
        assert after[n][1] > single[n][1], f"node {n}: no step left a request waiting during the burst"
        assert 1 <= after[n][2] <= burst
