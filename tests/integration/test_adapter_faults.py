"""Faults stay with their adapter: one tenant's broken adapter, or a stored version of another model, pauses only
that adapter; the others train and are served, and the trainer rank is not restarted for it.

A Serve app of its own (tiny model, one node) starts on a data dir that already holds, as an app
upgraded in place would find it:
- ``oldmodel``: a served version trained for another base (a 128-wide model: its LoRA shapes do
  not fit) and queued feedback, so both the replica and the trainer meet it;
- ``broken`` (tenant acme, so keyed ``acme/broken``): ``target_modules: ["no_such_module"]``, written by an
  older release that did not check it (create now answers 400), with queued feedback. Its key sorts
  first, so the trainer meets it before any other adapter.
Then tenant beta's adapter (``beta/good``; the app runs without keys, so requests name keys) gets feedback
through HTTP.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import httpx
import pytest

from tests.app_pool import AppPlan, AppSpec

BASE = "tiny-llama"
READY_S = 300
NO_GATE = {"enabled": False, "held_out_share": 0}


def _version_for_another_model(tmp, adapters_root, adapter: str, version: int):
    """A real peft version of ``adapter`` trained for a 128-wide tiny Llama (the served one is 256 wide)."""
    from actors.learning.lora.bank import AdapterBank
    from actors.learning.lora.steps import save_adapter_version
    from actors.models import default_model

    other = default_model.build(
        tmp / "other-model",
        dataclasses.replace(default_model.DEFAULT_SPEC, hidden_size=128, num_heads=2, intermediate_size=256),
    )
    bank = AdapterBank(other, dtype="float32")
    lora = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}
    model, opt = bank.train(adapter, lora, None, None, 1e-3)
    return save_adapter_version(
        model, opt, adapters_root, adapter, version, {"parent": None}, peft_name=bank.peft_name(adapter)
    )


def _faults_app(data: Path) -> AppPlan:
    """The data dir as an app upgraded in place would find it (the module's docstring), and a one-node app on it."""
    from actors.learning.store.sqlite import FeedbackDatabase

    with FeedbackDatabase(data) as store:
        store.create_adapter(
            {"name": "oldmodel", "method": "sft", "mode": "sync", "lora": {"r": 4, "alpha": 8}, "gate": NO_GATE}
        )
        v = store.reserve_version("oldmodel")
        path = _version_for_another_model(
            data.with_name(data.name + "-other"), data / "adapters", "oldmodel", v.version
        )
        assert store.publish_version("oldmodel", v.version, path, [], 4, 1.0).state == "served"
        store.add_feedback([{"adapter": "oldmodel", "prompt": f"Old {i}:", "completion": " x."} for i in range(2)])
        store.create_adapter(
            {
                "name": "broken",
                "tenant": "acme",
                "method": "sft",
                "mode": "sync",
                "lora": {"r": 4, "alpha": 8, "target_modules": ["no_such_module"]},
                "gate": NO_GATE,
            }
        )
        store.add_feedback([{"adapter": "acme/broken", "prompt": "Break:", "completion": " now."}])
        store.create_adapter(
            {
                "name": "good",
                "tenant": "beta",
                "method": "sft",
                "mode": "hybrid",
                "learning_rate": 5e-3,
                "lora": {"r": 4, "alpha": 8},
                "gate": NO_GATE,
            }
        )
    return AppPlan(
        {
            "name": "coserve-faults",
            "data_dir": str(data),
            "cluster": {"nodes": 1, "stages": 1, "bundle": {"CPU": 1}},
            "model": {"embedded": "tiny-llama", "max_model_len": 1024},
            "engine": {"max_num_seqs": 8, "kv_cache_memory_bytes": 64 * 2**20},
            "training": {"steps_per_version": 1, "micro_batch": 4},
        }
    )


APP = AppSpec(
    "faults",
    _faults_app,
    ready=lambda st: st["ready_nodes"] == 1 and (st.get("training") or {}).get("state") == "running",
    timeout_s=READY_S,
)


@pytest.fixture(scope="module")
def url(app_url, app_pool) -> str:
    """The faults app beside the session app."""
    yield app_pool.serve(APP).url
    app_pool.remove(APP.name)


def _adapter(url: str, name: str) -> dict:
    r = httpx.get(f"{url}/v1/adapters/{name}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_one_adapters_fault_pauses_only_that_adapter(url):
    items = [{"adapter": "beta/good", "prompt": f"Beta fact {i}:", "completion": f" value {i}."} for i in range(4)]
    r = httpx.post(f"{url}/v1/feedback", json={"items": items}, timeout=60)
    assert r.status_code == 202, r.text
    deadline, info, st = time.time() + 180, {}, {}
    while time.time() < deadline:
        info = _adapter(url, "beta/good")
        st = httpx.get(f"{url}/v1/status", timeout=30).json()
        if info["current_version"] and st["nodes"][0]["adapters"].get(f"{BASE}:beta/good") == info["current_version"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"beta's adapter was not trained and served beside the broken ones: {info} {st.get('training')}")

    broken = _adapter(url, "acme/broken")
    assert broken["paused_reason"] and "no_such_module" in broken["paused_reason"], broken
    assert broken["queued"] == 1 and broken["current_version"] is None  # nothing lost, nothing published
    old = _adapter(url, "oldmodel")
    # Paused by whichever met it first: the replica checking v1 before serving it, or the trainer loading it.
    reason = old["paused_reason"] or ""
    assert "trained for another model" in reason or "size mismatch" in reason, old
    assert old["queued"] == 2 and old["current_version"] == 1
    # The trainer went on: one group of ranks, never restarted for an adapter's fault.
    training = st["training"]
    assert training["state"] == "running" and training["worker_starts"] == 1, training
    # The node serves the base model and beta's version; the version that does not fit is not served.
    assert f"{BASE}:oldmodel" not in st["nodes"][0]["adapters"]
    waits = st["training_waits"]
    assert waits["acme/broken"]["why"].startswith("paused: ") and waits["acme/broken"]["queued"] == 1
    for model in (BASE, f"{BASE}:beta/good"):
        r = httpx.post(
            f"{url}/v1/completions", json={"model": model, "prompt": "Beta fact 1:", "max_tokens": 4}, timeout=60
        )
        assert r.status_code == 200, r.text
