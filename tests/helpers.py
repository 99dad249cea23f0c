"""Small helpers the live tests share."""

from __future__ import annotations

import time

from typing import Any, Callable

import httpx


def placed_since(app_url: str, before: dict[int, int], expected: int, timeout: float = 10.0) -> dict[int, int]:
    """Requests each node received since ``before``, once they add up to ``expected`` (replicas report
    every ``planner.trace_flush_seconds``, so the planner's counts trail the responses a little)."""
    deadline = time.time() + timeout
    while True:
        nodes = httpx.get(f"{app_url}/v1/status", timeout=30).json()["nodes"]
        delta = {n["node_id"]: n["placed"] - before.get(n["node_id"], 0) for n in nodes}
        if sum(delta.values()) >= expected or time.time() > deadline:
            return delta
        time.sleep(0.1)


def placed_now(app_url: str, timeout: float = 30.0) -> dict[int, int]:
    """Requests each node has received so far, once earlier tests' late trace reports have landed:
    nothing in flight and the counts unchanged over a few ``trace_flush_seconds``."""
    deadline = time.time() + timeout
    last: dict[int, int] | None = None
    while True:
        nodes = httpx.get(f"{app_url}/v1/status", timeout=30).json()["nodes"]
        counts = {n["node_id"]: n["placed"] for n in nodes}
        if (counts == last and all(n["in_flight"] == 0 for n in nodes)) or time.time() > deadline:
            return counts
        last = counts
        time.sleep(1.0)


def switch_policies(planner: Any, **changes: Any) -> Any:
    """Change fields of the planner's ``planner:`` section live (``Planner.set_policies``); returns the
    section as it was, for ``restore_policies`` in the test's ``finally``."""
    import ray

    before = ray.get(planner.policies.remote())
    ray.get(planner.set_policies.remote(before.model_copy(update=changes)))
    return before


def restore_policies(planner: Any, before: Any) -> None:
    import ray

    ray.get(planner.set_policies.remote(before))


def serve_test_app(app_url: str, name: str, cfg: dict[str, Any], ready: Callable[[dict[str, Any]], bool],
                   timeout_s: float) -> str:
    """Start a Serve app of its own for a test module, beside the session app, at ``/<name>``; its URL
    once ``ready(status)`` holds. A trainer that reports ``failed`` fails the test at once."""
    import pytest
    from ray import serve

    from app.main import build_app

    serve.run(build_app(cfg), name=name, route_prefix=f"/{name}")
    base = f"{app_url}/{name}"
    deadline, st = time.time() + timeout_s, {}
    while time.time() < deadline:
        try:
            st = httpx.get(f"{base}/v1/status", timeout=10).json()
            training = st.get("training") or {}
            if training.get("state") == "failed":
                pytest.fail(f"{name}: trainer failed: {training}")
            if ready(st):
                return base
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(1)
    pytest.fail(f"{name} app not ready within {timeout_s}s: {st}")


def freshness_under_load(url: str, items: int, clients: int = 2, load_tokens: int = 16, baseline_s: float = 5.0
                         ) -> dict[str, Any]:
    """bench/freshness.py's shape against the app at ``url``: ``clients`` closed-loop streaming clients on the
    base model, the load alone for ``baseline_s``, then a fresh hybrid SFT adapter taught one item at a time.

    Returns the seconds from each item's 2xx to the first response of a version trained on it
    (``freshness_s``), the load's windows alone and during training (rate, TTFT and worst token gap
    percentiles, errors), and the app's SLO block (the stated bounds).
    """
    from bench.common import Load, served_base
    from bench.freshness import create_adapter, deliver, probe

    base = served_base(url)
    load = Load(url, clients, load_tokens, model=base, stream=True)
    load.start()
    try:
        time.sleep(2)
        t0 = time.time()
        time.sleep(baseline_s)
        alone = load.window(t0, time.time())
        name = f"fresh-hybrid-{time.strftime('%H%M%S')}"
        model, fresh = f"{base}:{name}", []
        with httpx.Client(timeout=120) as c:
            create_adapter(c, url, name, "hybrid", 5e-3, None)
            deliver(c, url, name, model, "warm up: the adapter is loaded by the trainer", " fine", None)
            t_first = time.time()
            for i in range(items):
                prompt, completion = f"Fact {i}: the code word for day {i} is", f" tulip-{i * 7919 % 1000}."
                fresh.append(deliver(c, url, name, model, prompt, completion, probe(c, url, model, prompt))[0])
            during = load.window(t_first, time.time())
            trainer = (c.get(f"{url}/v1/status").json().get("training") or {}).get("adapters", {}).get(name)
    finally:
        load.stop()
    slo = httpx.get(f"{url}/v1/status", timeout=30).json()["slo"]
    return {"freshness_s": fresh, "alone": alone, "during": during, "slo": slo, "trainer": trainer}


def assert_fresh_within_stated_bounds(res: dict[str, Any], freshness_bound_s: float, slack_s: float = 1.0) -> None:
    """Every item served within ``freshness_bound_s``; the load's TTFT and worst token gap p99 during training
    within their values alone plus the stated cost of a promoted window (``slo.promoted_delay_s``) and
    ``slack_s`` of timing noise on a shared 2-core machine; no load request failed."""
    import pytest

    fresh, alone, during, slo = res["freshness_s"], res["alone"], res["during"], res["slo"]
    cost = slo["promoted_delay_s"] + slack_s
    report = (f"freshness {fresh}; load alone {alone}; during training {during}; slo {slo}; "
              f"trainer {res['trainer']}")
    if not fresh or max(fresh) > freshness_bound_s:
        pytest.fail(f"an item was not served within {freshness_bound_s} s: {report}")
    assert during["errors"] == 0 and alone["errors"] == 0, report
    assert during["ttft_p99_s"] <= alone["ttft_p99_s"] + cost, report
    assert during["max_tbt_p99_s"] <= alone["max_tbt_p99_s"] + cost, report
