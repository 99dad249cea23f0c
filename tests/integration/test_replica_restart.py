"""A crashed model server: the service keeps answering from the other node, and Serve brings the node back."""

from __future__ import annotations

import time

import httpx

from tests.helpers import placed_now, placed_since

MODEL = "tiny-llama"


def test_killed_replica_is_replaced_and_requests_keep_succeeding(ray_cluster, app_url, planner):
    import ray

    name = ray.get(planner.node_replicas.remote())[1]
    ray.kill(ray.get_actor(name, namespace="serve"))  # as if the process crashed

    body = {"model": MODEL, "prompt": "are you there", "max_tokens": 4}
    codes = [httpx.post(f"{app_url}/v1/completions", json=body, timeout=60).status_code for _ in range(10)]
    assert codes == [200] * 10, codes

    deadline = time.time() + 240
    while time.time() < deadline:
        nodes = httpx.get(f"{app_url}/v1/status").json()["nodes"]
        replaced = ray.get(planner.node_replicas.remote())[1] not in (name, None)
        if replaced and nodes[1]["state"] == "ready":
            break  # Serve's replacement registered as node 1 (Serve hands it the dead replica's rank)
        assert nodes[0]["state"] == "ready"
        time.sleep(1)
    assert replaced and nodes[1]["state"] == "ready", nodes
    assert nodes[1]["error"] is None
    # The replacement serves again: round robin reaches it once the routers see it (Serve tells them
    # about a new replica within seconds).
    before = placed_now(app_url)
    deadline, sent = time.time() + 60, 0
    while time.time() < deadline:
        for _ in range(4):
            assert httpx.post(f"{app_url}/v1/completions", json=body, timeout=60).status_code == 200
        sent += 4
        if placed_since(app_url, before, sent)[1] > 0:
            break
    assert placed_since(app_url, before, sent)[1] > 0
