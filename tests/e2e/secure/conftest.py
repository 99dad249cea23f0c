"""The secured app these tests share: API keys, tight limits, one node, under route prefix /sec beside the session app."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.app_pool import AppPlan, AppSpec

SECURE_PREFIX = "/sec"


def _secure_app(data: Path) -> AppPlan:
    """API keys for six tenants, tight limits, one node, training on."""
    from deployments.keys import add_key

    keys = {t: add_key(data / "keys.yaml", t) for t in ("admin", "acme", "beta", "flood", "conc", "quota")}
    config = {
        "name": "coserve-sec",
        "data_dir": str(data),
        "cluster": {"nodes": 1, "stages": 1, "bundle": {"CPU": 1}},
        "model": {"embedded": "tiny-llama", "max_model_len": 1024},
        "engine": {"max_num_seqs": 16, "kv_cache_memory_bytes": 64 * 2**20},
        "planner": {"placement": "round_robin"},
        "auth": {"keys_file": "keys.yaml", "keys_env": None},
        "limits": {
            "requests_per_second": 20,
            "burst": 40,
            "max_concurrent": 4,
            "max_tokens": 32,
            "feedback_max_items": 16,
            "feedback_max_item_bytes": 1024,
            "adapters_per_tenant": 3,
        },
    }
    return AppPlan(config, {"keys": keys})


APP = AppSpec("coserve-sec", _secure_app, route_prefix=SECURE_PREFIX)


@pytest.fixture(scope="package")
def secure_app(app_url, app_pool) -> dict:
    """A second app beside the session app, under route prefix /sec, with API keys
    and tight limits: one node, training on. Yields its base URL, the keys by tenant, its config and its app name;
    removed when this package's tests are done, so the rest of the suite runs beside the session app alone."""
    app = app_pool.serve(APP)
    yield {
        "url": app.url,
        "keys": app.plan.extras["keys"],
        "config": app.plan.config,
        "name": APP.name,
        "data_dir": app.data_dir,
    }
    app_pool.remove(APP.name)


SERVED_ADAPTER = "beta-served"


@pytest.fixture(scope="package")
def served_adapter(secure_app) -> str:
    """An adapter of tenant beta (created by the admin) with a served version, trained from beta's feedback.

    One for the package: the drills probe it and the tenancy tests fence it off; training it once
    keeps the package within the suite's time budget."""
    import httpx

    url, name = secure_app["url"], SERVED_ADAPTER
    admin = {"Authorization": f"Bearer {secure_app['keys']['admin']}"}
    beta = {"Authorization": f"Bearer {secure_app['keys']['beta']}"}
    r = httpx.post(
        f"{url}/v1/adapters",
        headers=admin,
        json={"name": name, "tenant": "beta", "method": "sft", "mode": "sync", "gate": {"enabled": False}},
    )
    assert r.status_code == 201, r.text
    assert r.json()["tenant"] == "beta"
    items = [{"adapter": name, "prompt": f"q{i}", "completion": f"a{i}"} for i in range(4)]
    assert httpx.post(f"{url}/v1/feedback", headers=beta, json=items).status_code == 202
    deadline, info = time.time() + 300, {}
    while time.time() < deadline:
        info = httpx.get(f"{url}/v1/adapters/{name}", headers=beta).json()
        models = httpx.get(f"{url}/v1/models", headers=beta).json()["data"]
        if info["current_version"] and f"tiny-llama:{name}" in {m["id"] for m in models}:
            return name
        time.sleep(1)
    pytest.fail(f"beta's adapter was not served within 300 s: {info}")
