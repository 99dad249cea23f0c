"""A crashed model server: requests in flight and new ones are answered by the other node, and Serve brings the node back."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.helpers import placed_now, placed_since

MODEL = "tiny-llama"


def test_killed_replica_is_replaced_and_requests_keep_succeeding(ray_cluster, app_url, planner, data_dir, tmp_path):
    import ray

    from actors.models.default_model import ensure
    from tests.integration.test_adapters import make_adapter

    # An adapter both nodes serve before the kill: the replacement must serve it too, and the planner must know.
    store = ray.get(planner.feedback_store.remote())
    adapter = "kept-through-restart"
    ray.get(store.create_adapter.remote({"name": adapter, "method": "sft", "gate": {"enabled": False}}))
    v = ray.get(store.reserve_version.remote(adapter)).version
    path = str(make_adapter(ensure(data_dir), tmp_path / adapter, seed=5))
    assert ray.get(store.publish_version.remote(adapter, v, path, [], 1, 0.0)).info.state == "served"
    assert ray.get(planner.load_adapter.remote(adapter)).nodes == (0, 1)
    served = f"{MODEL}:{adapter}"

    name = ray.get(planner.node_replicas.remote())[1]
    victim = ray.get_actor(name, namespace="serve")
    # Requests in flight on both nodes when one dies (round robin puts half of them on the victim):
    # HAProxy sends those that got no answer to the other replica (app/serve_env.py, retry-on
    # empty-response), so their clients see answers, not errors.
    long = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 600, "ignore_eos": True}

    def timed_post() -> tuple[httpx.Response, float]:
        r = httpx.post(f"{app_url}/v1/completions", json=long, timeout=180)
        return r, time.time()

    with ThreadPoolExecutor(8) as pool:
        in_flight = [pool.submit(timed_post) for _ in range(8)]
        time.sleep(1.0)
        killed_at = time.time()
        ray.kill(victim)  # as if the process crashed
        answers = [f.result() for f in in_flight]
    assert all(done > killed_at for _, done in answers), "every request should still have been running at the kill"
    assert [r.status_code for r, _ in answers] == [200] * 8, [(r.status_code, r.text[:80]) for r, _ in answers]
    assert all(r.json()["usage"]["completion_tokens"] == 600 for r, _ in answers)

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
    # The replacement loaded the node's adapters as it joined, and said so: no publish has happened since.
    deadline = time.time() + 10
    while httpx.get(f"{app_url}/v1/status").json()["nodes"][1]["adapters"].get(served) != v:
        assert time.time() < deadline, httpx.get(f"{app_url}/v1/status").json()["nodes"][1]
        time.sleep(0.2)
    assert ray.get(store.get_adapter.remote(adapter)).current_version == v
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
    ray.get(store.update_adapter.remote(adapter, {"mode": "off"}))
