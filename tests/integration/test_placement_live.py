"""LEMIX placement on the live app: requests succeed, and at low load it consolidates onto one node."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

MODEL = "tiny-llama"


@pytest.fixture
def lemix(ray_cluster, app_url, app_config):
    import ray

    planner = ray.get_actor(f"{app_config['name']}-planner", namespace="coserve")
    ray.get(planner.set_placement.remote("lemix"))
    yield planner
    ray.get(planner.set_placement.remote("round_robin"))


def _placed(app_url: str) -> list[int]:
    return [n["placed"] for n in httpx.get(f"{app_url}/v1/status").json()["nodes"]]


def test_lemix_serves_concurrent_requests(app_url, lemix):
    assert httpx.get(f"{app_url}/v1/status").json()["placement"] == "lemix"
    before = _placed(app_url)
    client = openai.AsyncOpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def burst():
        return await asyncio.gather(*(client.completions.create(model=MODEL, prompt=f"lemix {i}", max_tokens=16)
                                      for i in range(16)))

    assert all(r.choices for r in asyncio.run(burst()))
    assert sum(_placed(app_url)) - sum(before) == 16


def test_lemix_consolidates_sequential_low_rate_requests(app_url, lemix):
    before = _placed(app_url)
    for i in range(6):
        r = httpx.post(f"{app_url}/v1/completions", json={"model": MODEL, "prompt": f"slow {i}", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200
        time.sleep(0.3)
    delta = [a - b for a, b in zip(_placed(app_url), before)]
    assert sum(delta) == 6
    assert sorted(delta) == [0, 6], f"lemix spread low-rate requests over both nodes: {delta}"
