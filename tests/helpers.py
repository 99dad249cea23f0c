"""Small helpers the live tests share."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

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


class StreamingClients:
    """Closed-loop streaming completion clients on one model; each request's finish, success, TTFT and largest
    gap between two streamed pieces (its worst time between tokens)."""

    def __init__(self, url: str, model: str, clients: int, max_tokens: int) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.samples: list[tuple[float, bool, float | None, float | None]] = []  # (finish, ok, ttft, worst gap)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> StreamingClients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=130)

    def _request(self, c: httpx.Client, i: int, t0: float) -> tuple[bool, float | None, float | None]:
        body = {
            "model": self.model,
            "prompt": f"Client {i} asks about the weather at {t0:.3f}.",
            "max_tokens": self.max_tokens,
            "temperature": 0.8,
            "stream": True,
        }
        ttft = last = gap = None
        with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return False, None, None
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    now = time.time()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gap = max(gap or 0.0, now - last)
                    last = now
        return ttft is not None, ttft, gap

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as c:
            while not self._stop.is_set():
                t0 = time.time()
                try:
                    ok, ttft, gap = self._request(c, i, t0)
                except httpx.HTTPError:
                    ok, ttft, gap = False, None, None
                self.samples.append((time.time(), ok, ttft, gap))

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Requests, errors, rate and the TTFT and worst-gap p50/p99 (nearest rank) of requests finished in [t0, t1]."""
        done = [s for s in self.samples if t0 <= s[0] <= t1]
        ok = [s for s in done if s[1]]
        ttft = [s[2] for s in ok if s[2] is not None]
        gaps = [s[3] for s in ok if s[3] is not None]
        return {
            "requests": len(ok),
            "errors": len(done) - len(ok),
            "rate": len(ok) / max(1e-9, t1 - t0),
            "ttft_p50_s": _nearest_rank(ttft, 50),
            "ttft_p99_s": _nearest_rank(ttft, 99),
            "max_tbt_p50_s": _nearest_rank(gaps, 50),
            "max_tbt_p99_s": _nearest_rank(gaps, 99),
        }


def _nearest_rank(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def taught_and_served(
    c: httpx.Client, url: str, adapter: str, model: str, prompt: str, completion: str, timeout_s: float = 300.0
) -> float:
    """Post one feedback item to ``adapter``; seconds from its 2xx until every ready node serves a version
    trained on it (``model`` is ``base:adapter``). Fails the test when the adapter pauses or time runs out."""
    import pytest

    c.post(
        f"{url}/v1/feedback", json={"adapter": adapter, "prompt": prompt, "completion": completion}
    ).raise_for_status()
    accepted = time.time()
    while True:
        info = c.get(f"{url}/v1/adapters/{adapter}").json()
        if info["queued"] == 0 and info["current_version"]:
            break
        if time.time() - accepted > timeout_s or info.get("paused_reason"):
            pytest.fail(f"item not trained within {time.time() - accepted:.0f} s: {info}")
        time.sleep(0.05)
    version = info["current_version"]
    while True:
        nodes = [n for n in c.get(f"{url}/v1/status").json()["nodes"] if n["state"] == "ready"]
        served = [n["adapters"].get(model) for n in nodes]
        if nodes and None not in served and min(served) >= version:
            return time.time() - accepted
        if time.time() - accepted > timeout_s:
            pytest.fail(f"version {version} not served within {timeout_s:.0f} s: {served}")
        time.sleep(0.05)


def freshness_under_load(
    url: str, items: int, clients: int = 2, load_tokens: int = 16, baseline_s: float = 5.0
) -> dict[str, Any]:
    """bench/freshness.py's shape against the app at ``url``: ``clients`` closed-loop streaming clients on the
    base model, the load alone for ``baseline_s``, then a fresh hybrid SFT adapter (gate on, nothing held out,
    no retention check, as the bench's) taught one item at a time.

    Returns the seconds from each item's 2xx to the first response of a version trained on it
    (``freshness_s``), the load's windows alone and during training (rate, TTFT and worst token gap
    percentiles, errors), and the app's SLO block (the stated bounds).
    """
    base = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    with StreamingClients(url, base, clients, load_tokens) as load:
        time.sleep(2)
        t0 = time.time()
        time.sleep(baseline_s)
        alone = load.window(t0, time.time())
        name = f"fresh-hybrid-{time.strftime('%H%M%S')}"
        model, fresh = f"{base}:{name}", []
        with httpx.Client(timeout=120) as c:
            c.post(
                f"{url}/v1/adapters",
                json={
                    "name": name,
                    "method": "sft",
                    "mode": "hybrid",
                    "learning_rate": 5e-3,
                    "gate": {"held_out_share": 0, "retention": False},
                },
            ).raise_for_status()
            taught_and_served(c, url, name, model, "warm up: the adapter is loaded by the trainer", " fine")
            t_first = time.time()
            for i in range(items):
                prompt, completion = f"Fact {i}: the code word for day {i} is", f" tulip-{i * 7919 % 1000}."
                fresh.append(taught_and_served(c, url, name, model, prompt, completion))
            during = load.window(t_first, time.time())
            trainer = (c.get(f"{url}/v1/status").json().get("training") or {}).get("adapters", {}).get(name)
    slo = httpx.get(f"{url}/v1/status", timeout=30).json()["slo"]
    return {"freshness_s": fresh, "alone": alone, "during": during, "slo": slo, "trainer": trainer}


def assert_fresh_within_stated_bounds(res: dict[str, Any], freshness_bound_s: float, slack_s: float = 1.0) -> None:
    """Every item served within ``freshness_bound_s``; the load's TTFT and worst token gap p99 during training
    within their values alone plus the stated cost of a promoted window (``slo.promoted_delay_s``) and
    ``slack_s`` of timing noise on a shared 2-core machine; no load request failed."""
    import pytest

    fresh, alone, during, slo = res["freshness_s"], res["alone"], res["during"], res["slo"]
    cost = slo["promoted_delay_s"] + slack_s
    report = f"freshness {fresh}; load alone {alone}; during training {during}; slo {slo}; trainer {res['trainer']}"
    if not fresh or max(fresh) > freshness_bound_s:
        pytest.fail(f"an item was not served within {freshness_bound_s} s: {report}")
    assert during["errors"] == 0 and alone["errors"] == 0, report
    assert during["ttft_p99_s"] <= alone["ttft_p99_s"] + cost, report
    assert during["max_tbt_p99_s"] <= alone["max_tbt_p99_s"] + cost, report


def smollm2_cache() -> Path:
    """The real default model the live tests serve, from the cache ``make serve`` uses (``COSERVE_DATA_DIR``, else
    the default data dir): fetched and converted on the machine's first run only, since a conversion takes
    about 30 s. tests/integration/test_smollm2.py converts a fresh copy each session and checks it."""
    import os

    from actors.models import smollm2
    from settings import DEFAULT_DATA_DIR

    return smollm2.ensure(Path(os.environ.get("COSERVE_DATA_DIR") or DEFAULT_DATA_DIR).expanduser())
