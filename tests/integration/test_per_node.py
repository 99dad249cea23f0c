"""training.scope per_node (LEMIX §V-B): each node trains and serves its own copy from the feedback routed to it.

A second app (two nodes, scope per_node) runs beside the session app in the same Ray cluster,
under the route prefix /pernode, with its own data dir and store. Real engines, real trainer.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.app_pool import AppPlan, AppSpec
from tests.helpers import restore_policies, switch_policies

BASE = "tiny-llama"
READY_S = 420


def _per_node_app(data) -> AppPlan:
    return AppPlan(
        {
            "name": "coserve-pernode",
            "data_dir": str(data),
            "cluster": {"nodes": 2, "stages": 1, "bundle": {"CPU": 1}},
            "model": {"embedded": "tiny-llama", "max_model_len": 1024},
            "engine": {"max_num_seqs": 8, "kv_cache_memory_bytes": 64 * 2**20},
            "planner": {"placement": "round_robin"},
            "training": {"scope": "per_node", "steps_per_version": 1, "micro_batch": 4},
        }
    )


def _ready(st: dict) -> bool:
    training = st.get("training") or {}
    return st["ready_nodes"] == 2 and training.get("state") == "running" and len(training.get("workers", {})) == 2


APP = AppSpec("pernode", _per_node_app, _ready, READY_S)


@pytest.fixture(scope="module")
def url(app_url, app_pool) -> str:
    """The per-node app beside the session app."""
    yield app_pool.serve(APP).url
    app_pool.remove(APP.name)


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
    r = httpx.post(
        f"{url}/v1/adapters",
        json={
            "name": name,
            "method": "sft",
            "mode": "sync",
            "learning_rate": 5e-3,
            "lora": {"r": 4, "alpha": 8},
            "gate": {"enabled": False, "held_out_share": 0},
        },
        timeout=30,
    )
    assert r.status_code == 201, r.text
    deadline, info = time.time() + 300, {}
    for round_ in range(2):  # two rounds: each node's copy gets two versions
        items = [
            {"adapter": name, "prompt": f"Node fact {round_}.{i}:", "completion": f" value {i}."} for i in range(4)
        ]
        r = httpx.post(f"{url}/v1/feedback", json={"items": items}, timeout=60)
        assert r.status_code == 202, r.text
        while time.time() < deadline:
            info = _adapter(url, name)
            heads = {int(k): v for k, v in info["node_versions"].items()}
            if (
                info["queued"] == 0
                and len(heads) == 2
                and all(sum(v["node"] == n for v in info["versions"]) > round_ for n in (0, 1))
            ):
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
        r = httpx.post(
            f"{url}/v1/completions", json={"model": model, "prompt": "Node fact 1:", "max_tokens": 4}, timeout=60
        )
        assert r.status_code == 200, r.text

    # Rolling back node 0's copy leaves node 1's alone.
    first0 = by_node[0][0]["version"]
    r = httpx.post(f"{url}/v1/adapters/{name}/rollback", json={"version": first0}, timeout=60)
    assert r.status_code == 200, r.text
    assert {int(k): v for k, v in r.json()["node_versions"].items()} == {0: first0, 1: heads[1]}
    assert _served(url, model) == {0: first0, 1: heads[1]}


def test_lemix_places_feedback_on_the_node_its_score_prefers(url):
    """Under placement lemix each new item is a training task placed by Eq. 1–3: while a request is planned on
    one node (a cost model whose prefill takes 30 s, so its plan is long), the item's forward there would wait
    behind it, and the item goes to the other node, whose copy then learns it."""
    import dataclasses
    import threading

    import ray

    from actors.control.planner import find_planner

    planner = find_planner("pernode")
    before = switch_policies(planner, placement="lemix", placement_params={})  # its kwargs hold the profile's model
    cm = ray.get(planner.placement_kwargs.remote())["cost_model"]
    slow = dataclasses.replace(cm, iteration=dataclasses.replace(cm.iteration, base=cm.iteration.base + 30.0))
    switch_policies(planner, placement_params={"cost_model": slow, "calibration_rate": 0.0})
    name = "placed"
    r = httpx.post(
        f"{url}/v1/adapters",
        json={
            "name": name,
            "method": "sft",
            "mode": "sync",
            "learning_rate": 5e-3,
            "lora": {"r": 4, "alpha": 8},
            "gate": {"enabled": False, "held_out_share": 0},
        },
        timeout=30,
    )
    assert r.status_code == 201, r.text
    done = threading.Event()

    def long_request() -> None:
        try:
            httpx.post(
                f"{url}/v1/completions",
                json={"model": BASE, "prompt": "busy", "max_tokens": 400, "ignore_eos": True},
                timeout=120,
            )
        finally:
            done.set()

    try:
        threading.Thread(target=long_request, daemon=True).start()
        deadline, busy = time.time() + 30, None
        while busy is None:  # the planner has the request in flight and planned on its node
            assert time.time() < deadline and not done.is_set(), "the request was never seen in flight"
            st = httpx.get(f"{url}/v1/status", timeout=30).json()
            busy = next(
                (
                    n["node_id"]
                    for n in st["nodes"]
                    if n["in_flight"] and (n["training_placement"]["plan"].get("forward_free_at") or 0) > time.time()
                ),
                None,
            )
            time.sleep(0.05)
        idle = 1 - busy
        items = [{"adapter": name, "prompt": f"Placed fact {i}:", "completion": f" value {i}."} for i in range(2)]
        r = httpx.post(f"{url}/v1/feedback", json={"items": items}, timeout=60)
        assert r.status_code == 202, r.text
        st = httpx.get(f"{url}/v1/status", timeout=30).json()
        choices = st["training_placement"]["feedback_recent"][-2:]
        assert [c["node_id"] for c in choices] == [idle, idle], choices
        for c in choices:  # JSON keys: node ids as strings
            assert c["how"] == "lemix" and c["scores"][str(idle)] > c["scores"][str(busy)], c
            assert c["response_s"][str(busy)] > c["response_s"][str(idle)] + 10, c
            assert c["tokens"] > 4  # ℓ: the item's prompt and completion tokens
        by_node = {n["node_id"]: n["training_placement"]["feedback_items"] for n in st["nodes"]}
        assert by_node[idle] >= 2

        # The idle node's copy learns both items; the busy node's copy none of them.
        deadline, info = time.time() + 180, {}
        while time.time() < deadline:
            info = _adapter(url, name)
            if info["queued"] == 0 and info["versions"]:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"{name} not trained: {info}")
        assert {v["node"] for v in info["versions"]} == {idle}
        assert sum(v["samples_trained"] for v in info["versions"]) == 2
    finally:
        done.wait(120)
        restore_policies(planner, before)
