"""LoRA adapters by name and version: loaded through the planner, served as `base:adapter`."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

MODEL = "tiny-llama"


def make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A real peft LoRA adapter with random (non-zero) B matrices, so it changes the output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(out)
    return out


def greedy(app_url: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{app_url}/v1/completions",
        timeout=60,
        json={"model": model, "prompt": "adapter test", "max_tokens": 16, "temperature": 0},
    )


def test_adapter_versions_are_served_and_listed(app_url, planner, data_dir, tmp_path):
    """Versions are published in the store (the one record of what is served); the planner serves what it says."""
    import ray

    from actors.models.default_model import ensure

    model_dir = ensure(data_dir)
    store = ray.get(planner.feedback_store.remote())
    name = "loaded"
    ray.get(store.create_adapter.remote({"name": name, "method": "sft", "gate": {"enabled": False}}))
    base_text = greedy(app_url, MODEL).json()["choices"][0]["text"]
    assert greedy(app_url, f"{MODEL}:{name}").status_code == 404

    def publish(seed: int) -> tuple[int, str]:
        v = ray.get(store.reserve_version.remote(name)).version
        path = str(make_adapter(model_dir, tmp_path / f"{name}-v{v}", seed=seed))
        assert ray.get(store.publish_version.remote(name, v, path, [], 1, 0.0)).info.state == "served"
        return v, path

    v1, p1 = publish(1)
    res = ray.get(planner.load_adapter.remote(name))
    assert (res.model, res.version, res.nodes) == (f"{MODEL}:{name}", v1, (0, 1))

    ids = [m["id"] for m in httpx.get(f"{app_url}/v1/models").json()["data"]]
    assert f"{MODEL}:{name}" in ids and ids[0] == MODEL
    # Every node serves it: round robin sends consecutive requests to both replicas.
    texts_v1 = {greedy(app_url, f"{MODEL}:{name}").json()["choices"][0]["text"] for _ in range(4)}
    assert len(texts_v1) == 1, "the two replicas serve different weights for one version"
    (text_v1,) = texts_v1
    assert text_v1 != base_text
    assert greedy(app_url, MODEL).json()["choices"][0]["text"] == base_text  # base unaffected

    v2, p2 = publish(2)
    ray.get(planner.load_adapter.remote(name))
    r = greedy(app_url, f"{MODEL}:{name}")
    assert r.json()["model"] == f"{MODEL}:{name}"
    assert r.json()["choices"][0]["text"] != text_v1
    nodes = httpx.get(f"{app_url}/v1/status").json()["nodes"]
    assert [n["adapters"].get(f"{MODEL}:{name}") for n in nodes] == [v2] * 2

    # A late push of an older version changes nothing: the store says v2.
    ray.get(planner.load_adapter.remote(name))
    assert greedy(app_url, f"{MODEL}:{name}").json()["choices"][0]["text"] != text_v1
    # A rollback in the store, then any push: the nodes serve what the store says, v1.
    ray.get(store.rollback.remote(name, v1))
    ray.get(planner.load_adapter.remote(name))
    assert greedy(app_url, f"{MODEL}:{name}").json()["choices"][0]["text"] == text_v1

    # Nobody tells the planner: it follows the store's served versions by itself (a long poll on the store).
    v3, _ = publish(3)
    deadline = time.time() + 15
    while [n["adapters"].get(f"{MODEL}:{name}") for n in httpx.get(f"{app_url}/v1/status").json()["nodes"]] != [v3] * 2:
        assert time.time() < deadline, "the nodes did not follow the store's publish"
        time.sleep(0.2)

    ray.get(store.update_adapter.remote(name, {"mode": "off"}))


def test_what_nodes_serve_always_agrees_with_the_store(app_url, planner, data_dir, tmp_path):
    """40 rounds of two concurrent promotes of one adapter, then a publish landing during a rollback: after
    each, the adapter API and every node agree, and the rollback is never undone by a late publish."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from actors.models.default_model import ensure

    store = ray.get(planner.feedback_store.remote())
    name = "races"
    ray.get(store.create_adapter.remote({"name": name, "method": "sft", "mode": "off", "gate": {"enabled": False}}))
    path = str(make_adapter(ensure(data_dir), tmp_path / name, seed=3))
    for _ in range(3):
        v = ray.get(store.reserve_version.remote(name)).version
        ray.get(store.publish_version.remote(name, v, path, [], 1, 0.0))
    ray.get(planner.load_adapter.remote(name))

    def promote(version: int) -> int:
        return httpx.post(f"{app_url}/v1/adapters/{name}/promote", json={"version": version}, timeout=120).status_code

    def agree() -> tuple[int, list]:
        current = httpx.get(f"{app_url}/v1/adapters/{name}", timeout=30).json()["current_version"]
        served = [n["adapters"].get(f"{MODEL}:{name}") for n in httpx.get(f"{app_url}/v1/status").json()["nodes"]]
        return current, served

    rng = random.Random(0)
    with ThreadPoolExecutor(2) as pool:
        for _ in range(40):
            a, b = rng.sample([1, 2, 3], 2)
            assert list(pool.map(promote, [a, b])) == [200, 200]
            current, served = agree()
            assert current in (a, b) and served == [current] * len(served), (a, b, current, served)

        # The trainer publishes v4 while a client rolls back to v1: whichever commits last wins in the
        # store, and the nodes serve exactly that, even though the trainer's load arrives last.
        v4 = ray.get(store.reserve_version.remote(name)).version
        rolled = pool.submit(
            lambda: httpx.post(f"{app_url}/v1/adapters/{name}/rollback", json={"version": 1}, timeout=120).status_code
        )
        try:
            ray.get(store.publish_version.remote(name, v4, path, [], 1, 0.0))
        except Exception as exc:  # the rollback committed first: the trainer's publish is refused (VersionConflict)
            assert "VersionConflict" in type(exc).__name__ + str(exc), exc
        assert rolled.result() == 200
        ray.get(planner.load_adapter.remote(name))  # the trainer's push, after the rollback
        current, served = agree()
        assert served == [current] * len(served) and current in (1, v4), (current, served)
        if current == v4:  # the publish committed after the rollback: roll back again, then the late push
            assert httpx.post(f"{app_url}/v1/adapters/{name}/rollback", json={"version": 1}).status_code == 200
            ray.get(planner.load_adapter.remote(name))
            current, served = agree()
            assert current == 1 and served == [1] * len(served), (current, served)
