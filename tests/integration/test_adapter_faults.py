"""Faults stay with their adapter: one tenant's broken adapter, or a stored version of another model, pauses only
that adapter; the others train and are served, and the trainer rank is not restarted for it.

On the tenants app (``tests/tenants_app.py``: tiny model, one node, API keys), which starts on a data dir that already
holds, as an app upgraded in place would find it, ``oldmodel`` (a served version trained for another base, with queued
feedback: both the replica and the trainer meet it) and ``acme/broken`` (a target module the model lacks, written by
an older release that did not check it, with queued feedback). Then tenant beta's adapter (``beta/good``; the admin's
key names it by its key) gets feedback through HTTP.
"""

from __future__ import annotations

import time

import httpx
import pytest

BASE = "tiny-llama"


@pytest.fixture(scope="module")
def faults_app(tenants_app) -> tuple[str, dict[str, str]]:
    """The tenants app's URL and the admin's headers."""
    return tenants_app.url, tenants_app.plan.headers


def _adapter(url: str, headers: dict[str, str], name: str) -> dict:
    r = httpx.get(f"{url}/v1/adapters/{name}", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_one_adapters_fault_pauses_only_that_adapter(faults_app):
    url, headers = faults_app
    items = [{"adapter": "beta/good", "prompt": f"Beta fact {i}:", "completion": f" value {i}."} for i in range(4)]
    r = httpx.post(f"{url}/v1/feedback", json={"items": items}, headers=headers, timeout=60)
    assert r.status_code == 202, r.text
    deadline, info, st = time.time() + 180, {}, {}
    while time.time() < deadline:
        info = _adapter(url, headers, "beta/good")
        st = httpx.get(f"{url}/v1/status", headers=headers, timeout=30).json()
        if info["current_version"] and st["nodes"][0]["adapters"].get(f"{BASE}:beta/good") == info["current_version"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"beta's adapter was not trained and served beside the broken ones: {info} {st.get('training')}")

    broken = _adapter(url, headers, "acme/broken")
    assert broken["paused_reason"] and "no_such_module" in broken["paused_reason"], broken
    assert broken["queued"] == 1 and broken["current_version"] is None  # nothing lost, nothing published
    old = _adapter(url, headers, "oldmodel")
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
            f"{url}/v1/completions",
            json={"model": model, "prompt": "Beta fact 1:", "max_tokens": 4},
            headers=headers,
            timeout=60,
        )
        assert r.status_code == 200, r.text
