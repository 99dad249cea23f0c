"""LEMIX placement on the live app: requests succeed, and at low load it consolidates onto one node."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.helpers import placed_now, placed_since

MODEL = "tiny-llama"


@pytest.fixture
def lemix(ray_cluster, app_url, planner):
    import ray

    ray.get(planner.set_placement.remote("lemix"))
    time.sleep(1.0)  # routers adopt the policy at their next snapshot (every trace_flush_seconds)
    yield planner
    ray.get(planner.set_placement.remote("round_robin"))
    time.sleep(1.0)


def test_lemix_serves_concurrent_requests(app_url, lemix):
    assert httpx.get(f"{app_url}/v1/status").json()["placement"] == "lemix"
    before = placed_now(app_url)
    client = openai.AsyncOpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def burst():
        return await asyncio.gather(*(client.completions.create(model=MODEL, prompt=f"lemix {i}", max_tokens=16)
                                      for i in range(16)))

    assert all(r.choices for r in asyncio.run(burst()))
    assert sum(placed_since(app_url, before, 16).values()) == 16


def test_lemix_consolidates_sequential_low_rate_requests(app_url, lemix):
    before = placed_now(app_url)
    for i in range(6):
        r = httpx.post(f"{app_url}/v1/completions", json={"model": MODEL, "prompt": f"slow {i}", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200
        time.sleep(0.3)
    delta = list(placed_since(app_url, before, 6).values())
    assert sum(delta) == 6
    assert sorted(delta) == [0, 6], f"lemix spread low-rate requests over both nodes: {delta}"
