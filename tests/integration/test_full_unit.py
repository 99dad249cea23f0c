"""A full_sft unit through the adapters and feedback API: its stages train in the node's bundles while it serves; versions sync in."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.app_pool import AppPlan, AppSpec

READY_S = 300
# Measured here: 22 s from feedback to v1 alone, with an empty extension cache. Before compat.skip_deepspeed_shm_all_reduce,
# every fresh clone compiled DeepSpeed's shm op in this wait first (74-127 s in whole-suite runs; over 180 s once in CI).
TRAIN_DEADLINE_S = 360
PROMPT = "Q: sky color?\nA:"
ITEMS = [
    {"adapter": "whole", "prompt": PROMPT, "completion": " blue sky blue"},
    {"adapter": "whole", "prompt": "Q: pet?\nA:", "completion": " cat cat cat"},
] * 2


def _full_unit_app(data) -> AppPlan:
    """A one-node app whose placement group has two bundles (cluster.stages 2)."""
    return AppPlan(
        {
            "name": "coserve-full",
            "data_dir": str(data),
            "cluster": {"nodes": 1, "stages": 2, "bundle": {"CPU": 1}},
            "model": {"embedded": "tiny-llama", "max_model_len": 512},
            "engine": {"max_num_seqs": 4, "kv_cache_memory_bytes": 64 * 2**20},
            "planner": {"placement": "round_robin"},
            "training": {"micro_batch": 2, "accumulation": 2, "steps_per_version": 6, "max_length": 64},
        }
    )


APP = AppSpec(
    "fullunit",
    _full_unit_app,
    ready=lambda st: st["ready_nodes"] == 1 and (st.get("training") or {}).get("full") is not None,
    timeout_s=READY_S,
)


@pytest.fixture(scope="module")
def url(app_url, app_pool) -> str:
    """The full-unit app beside the session app."""
    yield app_pool.serve(APP).url
    app_pool.remove(APP.name)


def _greedy(url: str) -> str:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 6, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _stage_bundles(group: str) -> dict[str, int]:
    """actor id -> bundle index of every live PipelineStage actor in placement group ``group`` (Ray's state API)."""
    import ray
    from ray.util.state import list_actors

    out = {}
    for a in list_actors(
        address=ray.get_runtime_context().gcs_address,
        detail=True,
        filters=[("placement_group_id", "=", group), ("class_name", "=", "PipelineStage")],
    ):
        if a.state == "ALIVE":
            # Ray books an actor's share of bundle i of group G as <resource>_group_<i>_<G>.
            out[a.actor_id] = next(
                int(k.split("_")[2])
                for k in a.required_resources
                if k.startswith("CPU_group_") and k.endswith(group) and k.split("_")[2].isdigit()
            )
    return out


def test_bad_units_are_refused_in_the_openai_error_shape(url):
    r = httpx.post(f"{url}/v1/adapters", json={"name": "odd", "method": "full_ppo"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and "method" in err["message"] and set(err) >= {"message", "type", "param", "code"}


def test_a_full_unit_trains_in_the_nodes_bundles_while_serving_and_rolls_back(url):
    before = _greedy(url)
    r = httpx.post(
        f"{url}/v1/adapters",
        json={
            "name": "whole",
            "method": "full_sft",
            "mode": "sync",
            "learning_rate": 5e-3,
            "gate": {"enabled": False, "held_out_share": 0},
        },
        timeout=30,
    )
    assert r.status_code == 201, r.text
    assert r.json()["model"] == "tiny-llama"  # requests keep naming the base model
    second = httpx.post(f"{url}/v1/adapters", json={"name": "whole2", "method": "full_dpo"}, timeout=30)
    assert second.status_code == 409 and "at most one" in second.json()["error"]["message"], second.text

    group = httpx.get(f"{url}/v1/status", timeout=30).json()["nodes"][0]["placement_group_id"]
    t0 = time.time()
    r = httpx.post(f"{url}/v1/feedback", json={"items": ITEMS}, timeout=60)
    assert r.status_code == 202, r.text
    seen: dict[str, int] = {}
    answered = 0
    info = {}
    phases: list[tuple[float, str]] = []  # (seconds since feedback, the loop's state): the failure message's timeline
    while time.time() - t0 < TRAIN_DEADLINE_S:
        seen.update(_stage_bundles(group))
        assert _greedy(url) is not None  # the replica keeps answering 200 while its node trains
        answered += 1
        info = httpx.get(f"{url}/v1/adapters/whole", timeout=30).json()
        if info["current_version"] == 1:
            break
        full = (httpx.get(f"{url}/v1/status", timeout=30).json().get("training") or {}).get("full") or {}
        state = f"{full.get('state')} train_s={full.get('train_s')}"
        if not phases or phases[-1][1] != state:
            phases.append((round(time.time() - t0, 1), state))
        time.sleep(1.0)
    else:
        pytest.fail(f"no version within {TRAIN_DEADLINE_S} s; the loop's states: {phases}; the unit: {info}")
    trained_s = time.time() - t0
    seen.update(_stage_bundles(group))  # the stages stay up: they hold the weights the next version starts from
    assert sorted(seen.values()) == [0, 1], seen  # two stage actors, in bundles 0 and 1 of the replica's group
    assert answered >= 2
    assert info["queued"] == 0 and info["versions"][0]["samples_trained"] == 4, info

    # The store records v1 first, then the planner syncs the nodes to it: wait for the node to follow.
    deadline = time.time() + 60
    while True:
        st = httpx.get(f"{url}/v1/status", timeout=30).json()
        full = st["nodes"][0]["full_version"]
        if (full and full["version"] == 1) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert full and full["unit"] == "whole" and full["version"] == 1 and full["sync_s"] > 0, full
    progress = st["training"]["full"]
    assert progress["version"] == 1 and progress["placement_group_id"] == group
    assert {s["actor_id"] for s in progress["stages"]} == set(seen)
    after = _greedy(url)
    assert after != before, (before, after)

    r = httpx.post(f"{url}/v1/adapters/whole/rollback", json={"version": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["current_version"] is None, r.text
    assert _greedy(url) == before
    back = httpx.get(f"{url}/v1/status", timeout=30).json()["nodes"][0]["full_version"]
    assert back["version"] is None and back["sync_s"] > 0, back
    print(
        f"trained and served v1 in {trained_s:.1f} s (states {phases}); sync {full['sync_s']} s; "
        f"publish -> served {progress['publish_to_served_s']} s; before {before!r} after {after!r}"
    )
