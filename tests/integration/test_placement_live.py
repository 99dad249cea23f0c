"""LEMIX placement on the live app: requests succeed, and at low load it consolidates onto one node."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.helpers import placed_now, placed_since, restore_policies, switch_policies
from tests.integration.test_learning import trainer  # noqa: F401  (the trainer runs before training tests start)

MODEL = "tiny-llama"


@pytest.fixture
def lemix(ray_cluster, app_url, planner):
    before = switch_policies(planner, placement="lemix", placement_params={})
    time.sleep(1.0)  # routers adopt the policy at their next snapshot (every trace_flush_seconds)
    yield planner
    restore_policies(planner, before)
    time.sleep(1.0)


def test_lemix_serves_concurrent_requests(app_url, lemix):
    assert httpx.get(f"{app_url}/v1/status").json()["placement"] == "lemix"
    before = placed_now(app_url)
    client = openai.AsyncOpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def burst():
        return await asyncio.gather(
            *(client.completions.create(model=MODEL, prompt=f"lemix {i}", max_tokens=16) for i in range(16))
        )

    assert all(r.choices for r in asyncio.run(burst()))
    assert sum(placed_since(app_url, before, 16).values()) == 16


def test_lemix_consolidates_sequential_low_rate_requests(app_url, lemix):
    before = placed_now(app_url)
    for i in range(6):
        r = httpx.post(
            f"{app_url}/v1/completions", json={"model": MODEL, "prompt": f"slow {i}", "max_tokens": 8}, timeout=60
        )
        assert r.status_code == 200
        time.sleep(0.3)
    delta = list(placed_since(app_url, before, 6).values())
    assert sum(delta) == 6
    assert sorted(delta) == [0, 6], f"lemix spread low-rate requests over both nodes: {delta}"


# ---- training as placement tasks (LEMIX Eq. 4 on the grant path, Alg. 1's Q_train, SEPARATE) ------------------


def _nodes(app_url: str) -> list[dict]:
    return httpx.get(f"{app_url}/v1/status", timeout=30).json()["nodes"]


def _slow_prefill(planner, seconds: float) -> dict:
    """LEMIX params whose cost model says a prefill takes ``seconds`` more than the profile (a model whose
    prefill nearly fills the TTFT SLO); calibration off, so the plans stay as the profile says."""
    import dataclasses

    import ray

    before = switch_policies(planner, placement="lemix", placement_params={})  # its kwargs hold the profile's model
    cm = ray.get(planner.placement_kwargs.remote())["cost_model"]
    restore_policies(planner, before)
    cm = dataclasses.replace(cm, iteration=dataclasses.replace(cm.iteration, base=cm.iteration.base + seconds))
    return {"cost_model": cm, "calibration_rate": 0.0}


def test_eq4_holds_training_back_while_inference_would_miss_its_slo_and_the_step_reaches_the_routers(
    app_url, app_config, planner, trainer
):
    """With the grant path of LEMIX Eq. 4 (adapter mode hybrid, ``planner.iteration: null``), training waits
    while a stream of requests would miss τ_R (``training.slo_ttft_s``, 1 s) on both nodes, and runs once the
    stream stops; each granted step is a training task in the planner's Q_train^n and in the snapshot the
    routers commit, and leaves both when the trainer reports its passes."""
    import threading

    import ray

    from planners.types import TrainingPlacement

    policies = switch_policies(planner, iteration=None, placement="lemix", placement_params=_slow_prefill(planner, 1.0))
    name = "eq4-live"
    r = httpx.post(
        f"{app_url}/v1/adapters",
        json={
            "name": name,
            "method": "sft",
            "mode": "hybrid",
            "learning_rate": 1e-3,
            "lora": {"r": 4, "alpha": 8},
            "gate": {"enabled": False, "held_out_share": 0},
        },
        timeout=30,
    )
    assert r.status_code == 201, r.text
    stop, errors = threading.Event(), []

    def client(k: int) -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                r = c.post(f"{app_url}/v1/completions", json={"model": MODEL, "prompt": f"{k} load", "max_tokens": 24})
                if r.status_code != 200:
                    errors.append(r.text[:200])

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(6)]
    try:
        for t in threads:
            t.start()
        time.sleep(2.0)  # the stream is on: the planner has seen its requests in flight
        # Long items (512 tokens a pass): each step then runs for a few tenths of a second, long enough to be
        # seen in the snapshot the routers poll.
        r = httpx.post(
            f"{app_url}/v1/feedback",
            json={
                "items": [
                    {"adapter": name, "prompt": f"Eq4 fact {i}: " + "lorem ipsum " * 20, "completion": " value" * 40}
                    for i in range(8)
                ]
            },
            timeout=60,
        )
        assert r.status_code == 202, r.text
        # Up to 6 s of the stream: until the planner has held a step of this adapter back. Whether any step was
        # granted meanwhile is checked twice: in the grants seen now, and below, where every grant that carried
        # tokens must have come after the stream stopped.
        deadline = time.time() + 6.0
        while True:
            during = _nodes(app_url)
            held = sum(n["training_placement"]["eq4_deprioritized"] for n in during)
            asked = [g for n in during for g in n["training_grants"]["recent"] if g["adapter"] == name]
            if (held and asked) or time.time() > deadline:
                break
            time.sleep(0.25)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    stopped = time.time()
    assert not errors, errors[:3]
    try:
        # While the stream ran, Eq. 4 held the steps back on the nodes the trainer asked, and nothing was granted.
        refused = {n["node_id"]: n["training_placement"]["eq4_deprioritized"] for n in during}
        assert sum(refused.values()) > 0, during
        grants = [g for n in during for g in n["training_grants"]["recent"] if g["adapter"] == name]
        assert grants and all(g["tokens"] == 0 for g in grants), grants
        assert all("Eq. 4" in g["reason"] and "miss its SLO" in g["reason"] for g in grants), grants
        last = next(
            n["training_placement"]["last_deprioritized"]
            for n in during
            if n["training_placement"]["last_deprioritized"]
        )
        assert last["samples"] >= 1 and last["next_arrival"] > last["at"]

        # Once it stopped the steps run: each granted step is a training task on its node, which the
        # routers receive in the snapshot, until the passes are reported.
        seen: list[TrainingPlacement] = []
        deadline = time.time() + 120
        while time.time() < deadline:
            snap = ray.get(planner.routing_snapshot.remote(2**62))  # no traces: the training steps only
            seen += snap.training
            info = httpx.get(f"{app_url}/v1/adapters/{name}", timeout=30).json()
            if info["queued"] == 0 and info["current_version"]:
                break
            time.sleep(0.01)
        else:
            pytest.fail(f"{name} not trained after the stream stopped: {info}")
        assert seen, "no training step reached the routing snapshot"
        assert all(
            isinstance(p, TrainingPlacement)
            and p.task.kind == "training"
            and p.node_id in (0, 1)
            and p.task.batch_size >= 1
            for p in seen
        )
        after = _nodes(app_url)
        granted = [g for n in after for g in n["training_grants"]["recent"] if g["adapter"] == name and g["tokens"]]
        assert granted and min(g["at"] for g in granted) >= stopped - 1.0, (stopped, granted)
        assert all("keeps its SLO" in g["reason"] for g in granted), granted
        steps = httpx.get(f"{app_url}/v1/status", timeout=30).json()["training_placement"]["steps_recent"]
        assert {s["task_id"] for s in steps} >= {p.task.task_id for p in seen}
        deadline = time.time() + 30
        while any(n["training_placement"]["steps_in_queue"] for n in after) and time.time() < deadline:
            time.sleep(0.2)
            after = _nodes(app_url)
        for n in after:  # every step placed was released once its passes were reported
            tp = n["training_placement"]
            assert tp["steps_in_queue"] == [] and tp["steps_done"] == tp["steps_placed"], tp
        assert sum(n["training_placement"]["steps_placed"] for n in after) >= len({p.task.task_id for p in seen})
    finally:
        restore_policies(planner, policies)
        time.sleep(1.0)


def _trainer_workers(app_url: str, nodes: set[int], timeout: float = 180) -> dict:
    deadline, st = time.time() + timeout, {}
    while time.time() < deadline:
        st = httpx.get(f"{app_url}/v1/status", timeout=30).json().get("training") or {}
        if st.get("state") == "running" and {w["node_id"] for w in st.get("workers", [])} == nodes:
            return st
        time.sleep(1)
    pytest.fail(f"trainer not running on nodes {nodes} within {timeout}s: {st}")


def test_separate_trains_only_on_its_training_node_and_serves_only_on_the_other(app_url, planner, trainer):
    """``placement: separate`` (α = 0.5 on two nodes): node 1 trains and serves no inference, node 0 serves and
    trains nothing. Switched live, the trainer regroups its ranks onto node 1."""
    import ray
    from ray.util.state import list_actors

    policies = switch_policies(planner, placement="separate", placement_params={})
    try:
        st = _trainer_workers(app_url, {1})
        assert [w["node_id"] for w in st["workers"]] == [1]
        group = {loc.node_id: loc for loc in ray.get(planner.node_locations.remote())}
        assert [loc.trains for loc in group.values()] == [False, True]
        deadline = time.time() + 60
        here = ray.get_runtime_context().gcs_address  # this suite's cluster, even beside another on the machine
        while (
            len(
                ranks := list_actors(
                    filters=[("class_name", "=", "TrainRank"), ("state", "=", "ALIVE")], detail=True, address=here
                )
            )
            != 1
            and time.time() < deadline
        ):
            time.sleep(1)  # the old group's ranks are going away
        assert [a.placement_group_id for a in ranks] == [group[1].placement_group_id]

        status = httpx.get(f"{app_url}/v1/status", timeout=30).json()
        assert status["training_placement"]["training_nodes"] == [1]
        before = placed_now(app_url)
        asked = {n["node_id"]: n["training_grants"]["asked"] for n in status["nodes"]}
        for i in range(8):
            r = httpx.post(
                f"{app_url}/v1/completions", json={"model": MODEL, "prompt": f"sep {i}", "max_tokens": 4}, timeout=60
            )
            assert r.status_code == 200, r.text
        assert placed_since(app_url, before, 8) == {0: 8, 1: 0}  # inference never lands on the training node

        name = "separate-live"
        r = httpx.post(
            f"{app_url}/v1/adapters",
            json={
                "name": name,
                "method": "sft",
                "mode": "sync",
                "learning_rate": 1e-3,
                "lora": {"r": 4, "alpha": 8},
                "gate": {"enabled": False, "held_out_share": 0},
            },
            timeout=30,
        )
        assert r.status_code == 201, r.text
        r = httpx.post(
            f"{app_url}/v1/feedback",
            json={"items": [{"adapter": name, "prompt": "Separate fact:", "completion": " trained on node 1."}]},
            timeout=60,
        )
        assert r.status_code == 202, r.text
        deadline = time.time() + 120
        while (info := httpx.get(f"{app_url}/v1/adapters/{name}", timeout=30).json())["current_version"] is None:
            assert time.time() < deadline, info
            time.sleep(0.5)
        nodes = _nodes(app_url)
        grown = {n["node_id"]: n["training_grants"]["asked"] - asked[n["node_id"]] for n in nodes}
        assert grown[0] == 0 and grown[1] > 0, grown  # only the training node's rank asked for grants
        while (served := {n["node_id"]: n["adapters"].get(f"{MODEL}:{name}") for n in _nodes(app_url)})[0] != info[
            "current_version"
        ]:
            assert time.time() < deadline, served  # the inference node serves what node 1 trained
            time.sleep(0.2)
    finally:
        restore_policies(planner, policies)
        _trainer_workers(app_url, {0, 1})
        time.sleep(1.0)
