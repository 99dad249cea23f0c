"""The tenants app: one Serve app beside the session app for two test modules, since an app start is about 45
CPU-seconds of this suite (docs/testing.md): ``tests/e2e/test_fair_serving.py`` (API keys, four sequence slots, no
per-key cap or rate limit, so nothing but the fair admission stands between a flooding tenant and the slots) and
``tests/integration/test_adapter_faults.py`` (a data dir as an app upgraded in place would find it).

The data dir holds, before the app starts:
- ``oldmodel``: a served version trained for another base (a 128-wide model: its LoRA shapes do not fit) and queued
  feedback, so both the replica and the trainer meet it;
- ``broken`` (tenant acme, so keyed ``acme/broken``): ``target_modules: ["no_such_module"]``, written by an older
  release that did not check it (create now answers 400), with queued feedback. Its key sorts first, so the trainer
  meets it before any other adapter;
- ``beta/good``: tenant beta's adapter, no version yet.
Neither fault touches the fair test's tenants (``flood``, ``light``): a fault stays with its adapter.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.app_pool import AppPlan, AppSpec

NAME = "coserve-tenants"
PREFIX = "/tenants"
NO_GATE = {"enabled": False, "held_out_share": 0}


def _version_for_another_model(tmp: Path, adapters_root: Path, adapter: str, version: int) -> str:
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


def _upgraded_data(data: Path) -> None:
    """What an older release left in ``data`` (the module docstring)."""
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


def _tenants_app(data: Path) -> AppPlan:
    """The upgraded data dir, API keys for the admin and two tenants, and a one-node app of four sequence slots on it."""
    from deployments.keys import add_key

    _upgraded_data(data)
    keys = {t: add_key(data / "keys.yaml", t) for t in ("admin", "flood", "light")}
    config = {
        "name": NAME,
        "data_dir": str(data),
        "cluster": {"nodes": 1, "stages": 1, "bundle": {"CPU": 1}},
        "model": {"embedded": "tiny-llama", "max_model_len": 1024},
        "engine": {"max_num_seqs": 4, "kv_cache_memory_bytes": 64 * 2**20},
        "planner": {"placement": "round_robin"},
        "training": {"steps_per_version": 1, "micro_batch": 4},
        "auth": {"keys_file": "keys.yaml", "keys_env": None},
        "limits": {"requests_per_second": None, "max_concurrent": None},
    }
    return AppPlan(config, {"keys": keys}, headers={"Authorization": f"Bearer {keys['admin']}"})


def _ready(st: dict) -> bool:
    """Its node serves and its trainer runs (the faults test counts the trainer's starts)."""
    return st["ready_nodes"] == 1 and (st.get("training") or {}).get("state") == "running"


APP = AppSpec(NAME, _tenants_app, _ready, timeout_s=300, route_prefix=PREFIX)


def used_later(request: pytest.FixtureRequest, fixture: str) -> bool:
    """Whether a test after the requesting module's, in this session, uses ``fixture``."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if item.module is request.module]
    return bool(mine) and any(fixture in getattr(item, "fixturenames", ()) for item in items[mine[-1] + 1 :])
