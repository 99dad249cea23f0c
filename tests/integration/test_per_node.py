"""training.scope per_node (LEMIX §V-B): each node trains and serves its own copy from the feedback routed to it.

A second app (two nodes, scope per_node) runs beside the session app in the same Ray cluster,
under the route prefix /pernode, with its own data dir and store. Real engines, real trainer.
"""

from __future__ import annotations

import time

import httpx
import pytest

BASE = "tiny-llama"
READY_S = 420


@pytest.fixture(scope="module")
def url(ray_cluster, app_url, tmp_path_factory) -> str:
    from ray import serve

    from app.main import build_app

    cfg = {
        "name": "coserve-pernode",
        "data_dir": str(tmp_path_factory.mktemp("pernode-data")),
        "cluster": {"nodes": 2, "stages": 1, "bundle": {"CPU": 1}},
        "model": {"embedded": "tiny-llama", "max_model_len": 1024},
        "engine": {"max_num_seqs": 8, "kv_cache_memory_bytes": 64 * 2**20},
        "planner": {"placement": "round_robin"},
        "training": {"scope": "per_node", "steps_per_version": 1, "micro_batch": 4},
    }
    serve.run(build_app(cfg), name="pernode", route_prefix="/pernode")
    base = f"{app_url}/pernode"
    deadline, st = time.time() + READY_S, {}
    while time.time() < deadline:
        try:
            st = httpx.get(f"{base}/v1/status", timeout=10).json()
            training = st.get("training") or {}
            if training.get("state") == "failed":
                pytest.fail(f"per_node trainer failed: {training}")
            if st["ready_nodes"] == 2 and training.get("state") == "running" and len(training.get("workers", {})) == 2:
                break
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(1)
    else:
        pytest.fail(f"per_node app not ready within {READY_S}s: {st}")
    yield base
    serve.delete("pernode")


def _adapter(url: str, name: str) -> dict:
    r = httpx.get(f"{url}/v1/adapters/{name}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _served(url: str, model: str) -> dict[int, int | None]:
    nodes = httpx.get(f"{url}/v1/status", timeout=30).json()["nodes"]
    return {n["node_id"]: n["adapters"].get(model) for n in nodes}


def test_each_node_trains_and_serves_its_own_copy(url):
    name, model = "local", f"{BASE}:local"
    # No quality gate and no held-out slice: every item trains, every version is served at once.
    r = httpx.post(f"{url}/v1/adapters", json={"name": name, "method": "sft", "mode": "sync",
                                               "learning_rate": 5e-3, "lora": {"r": 4, "alpha": 8},
                                               "gate": {"enabled": False, "held_out_share": 0}}, timeout=30)
    assert r.status_code == 201, r.text
    deadline, info = time.time() + 300, {}
    for round_ in range(2):  # two rounds: each node's copy gets two versions
        items = [{"adapter": name, "prompt": f"Node fact {round_}.{i}:", "completion": f" value {i}."}
                 for i in range(4)]
        r = httpx.post(f"{url}/v1/feedback", json={"items": items}, timeout=60)
        assert r.status_code == 202, r.text
        while time.time() < deadline:
            info = _adapter(url, name)
            heads = {int(k): v for k, v in info["node_versions"].items()}
            if info["queued"] == 0 and len(heads) == 2 and all(
                    sum(v["node"] == n for v in info["versions"]) > round_ for n in (0, 1)):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"per_node copies not trained within 300 s: {info}")

    # Each batch of four was split two and two; each node's versions trained only its own items.
    by_node = {n: [v for v in info["versions"] if v["node"] == n] for n in (0, 1)}
    assert [sum(v["samples_trained"] for v in by_node[n]) for n in (0, 1)] == [4, 4], info["versions"]
    assert all(v["node"] in (0, 1) for v in info["versions"])
    heads = {int(k): v for k, v in info["node_versions"].items()}
    assert heads == {n: by_node[n][-1]["version"] for n in (0, 1)} and info["current_version"] == max(heads.values())
    assert by_node[0][1]["parent"] == by_node[0][0]["version"]  # node 0's line continues its own weights

    # Each node serves its own copy's newest version, and requests for base:adapter are answered.
    deadline = time.time() + 60
    while _served(url, model) != heads:
        assert time.time() < deadline, (_served(url, model), heads)
        time.sleep(0.2)
    for _ in range(4):  # round robin: both nodes
        r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Node fact 1:", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text

    # Rolling back node 0's copy leaves node 1's alone.
    first0 = by_node[0][0]["version"]
    r = httpx.post(f"{url}/v1/adapters/{name}/rollback", json={"version": first0}, timeout=60)
    assert r.status_code == 200, r.text
    assert {int(k): v for k, v in r.json()["node_versions"].items()} == {0: first0, 1: heads[1]}
    assert _served(url, model) == {0: first0, 1: heads[1]}
