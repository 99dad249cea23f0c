"""LoRA adapters by name and version: loaded through the planner, served as `base:adapter`."""

from __future__ import annotations

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
    return httpx.post(f"{app_url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": "adapter test", "max_tokens": 16, "temperature": 0})


def test_adapter_versions_are_served_and_listed(app_url, planner, data_dir, tmp_path):
    import ray

    from actors.default_model import ensure

    model_dir = ensure(data_dir)
    base_text = greedy(app_url, MODEL).json()["choices"][0]["text"]
    assert greedy(app_url, f"{MODEL}:acme").status_code == 404

    v1 = make_adapter(model_dir, tmp_path / "acme-v1", seed=1)
    res = ray.get(planner.load_adapter.remote("acme", 1, str(v1)))
    assert (res.model, res.version, res.nodes) == (f"{MODEL}:acme", 1, (0, 1))

    ids = [m["id"] for m in httpx.get(f"{app_url}/v1/models").json()["data"]]
    assert ids == [MODEL, f"{MODEL}:acme"]
    # Every node serves it: round robin sends consecutive requests to both replicas.
    texts_v1 = {greedy(app_url, f"{MODEL}:acme").json()["choices"][0]["text"] for _ in range(4)}
    assert len(texts_v1) == 1, "the two replicas serve different weights for one version"
    (text_v1,) = texts_v1
    assert text_v1 != base_text
    assert greedy(app_url, MODEL).json()["choices"][0]["text"] == base_text  # base unaffected

    v2 = make_adapter(model_dir, tmp_path / "acme-v2", seed=2)
    ray.get(planner.load_adapter.remote("acme", 2, str(v2)))
    r = greedy(app_url, f"{MODEL}:acme")
    assert r.json()["model"] == f"{MODEL}:acme"
    assert r.json()["choices"][0]["text"] != text_v1
    nodes = httpx.get(f"{app_url}/v1/status").json()["nodes"]
    assert [n["adapters"] for n in nodes] == [{f"{MODEL}:acme": 2}] * 2

    # An older version never replaces a newer one.
    ray.get(planner.load_adapter.remote("acme", 1, str(v1)))
    assert greedy(app_url, f"{MODEL}:acme").json()["choices"][0]["text"] != text_v1

    ray.get(planner.unload_adapter.remote("acme"))
    assert greedy(app_url, f"{MODEL}:acme").status_code == 404
    assert [m["id"] for m in httpx.get(f"{app_url}/v1/models").json()["data"]] == [MODEL]
