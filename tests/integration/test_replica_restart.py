"""A crashed replica: the service keeps answering from the other node, the node comes back."""

from __future__ import annotations

import time

import httpx

MODEL = "tiny-llama"


def test_killed_replica_is_restarted_and_requests_keep_succeeding(ray_cluster, app_url, app_config):
    import ray

    planner = ray.get_actor(f"{app_config['name']}-planner", namespace="coserve")
    replica = ray.get(planner.replicas.remote())[1]
    ray.kill(replica, no_restart=False)  # as if the process crashed; Ray restarts the actor

    body = {"model": MODEL, "prompt": "are you there", "max_tokens": 4}
    codes = [httpx.post(f"{app_url}/v1/completions", json=body, timeout=60).status_code for _ in range(10)]
    assert codes == [200] * 10, codes

    deadline = time.time() + 240
    while time.time() < deadline:
        nodes = httpx.get(f"{app_url}/v1/status").json()["nodes"]
        if nodes[1]["state"] == "ready":
            break
        assert nodes[0]["state"] == "ready"
        time.sleep(2)
    assert nodes[1]["state"] == "ready", nodes
    assert nodes[1]["error"] is None
    # The restarted node serves again: round robin reaches it.
    before = nodes[1]["placed"]
    for _ in range(4):
        assert httpx.post(f"{app_url}/v1/completions", json=body, timeout=60).status_code == 200
    assert httpx.get(f"{app_url}/v1/status").json()["nodes"][1]["placed"] > before
