"""Feedback on what was served, on the session app (tiny model, real engines, real trainer): stored completions read
back as served, the version pinned at admission, the three feedback shapes by id, and a kto adapter that trains.

One shared app (the session's, no app of its own). It runs without API keys, so another tenant's id is checked on
the store's actor here; the HTTP 404 of another tenant's id, the 429 of limits.training_tokens_per_day and the bad
inputs are tests/unit/test_feedback_by_completion.py's, over the same routes and store behind the real guard.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.test_adapters import make_adapter

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "Name a colour."}]


BIAS: dict[str, float] = {}  # filled by the test: the random tiny model (and a random LoRA) can answer nothing
# printable, and an empty answer is nothing to rate; a bias towards "a" makes every answer non-empty text.


def chat(app_url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(
        f"{app_url}/v1/chat/completions",
        timeout=60,
        json={
            "model": model,
            "messages": CHAT,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "logit_bias": BIAS,
            **extra,
        },
    )


def stored(app_url: str, ident: str) -> httpx.Response:
    return httpx.get(f"{app_url}/v1/chat/completions/{ident}", timeout=30)


def feedback_rows(data_dir: Path) -> list[tuple]:
    with sqlite3.connect(Path(data_dir) / "feedback.sqlite3") as db:
        return db.execute(
            "SELECT adapter, kind, label, completion, chosen, rejected, completion_id, "
            "answered_version FROM feedback WHERE completion_id IS NOT NULL ORDER BY id"
        ).fetchall()


def test_stored_completions_pin_the_answering_version_and_take_feedback_by_id(app_url, planner, data_dir, tmp_path):
    import ray
    from transformers import AutoTokenizer

    from actors.learning.store.completion_rows import UnknownCompletion
    from actors.models.default_model import ensure

    BIAS[str(AutoTokenizer.from_pretrained(ensure(data_dir)).encode("a", add_special_tokens=False)[-1])] = 100.0
    store = ray.get(planner.feedback_store.remote())
    name = "thumbs"
    r = httpx.post(
        f"{app_url}/v1/adapters",
        timeout=30,
        json={"name": name, "method": "kto", "mode": "off", "store_completions": True, "gate": {"enabled": False}},
    )
    assert r.status_code == 201 and r.json()["store_completions"] is True, r.text
    assert (
        httpx.post(
            f"{app_url}/v1/adapters", timeout=30, json={"name": "thumbs-dpo", "method": "dpo", "mode": "off"}
        ).status_code
        == 201
    )

    def publish(seed: int) -> int:
        v = ray.get(store.reserve_version.remote(name)).version
        path = str(make_adapter(ensure(data_dir), tmp_path / f"{name}-v{v}", seed=seed))
        assert ray.get(store.publish_version.remote(name, v, path, [], 1, 0.0)).info.state == "served"
        ray.get(planner.load_adapter.remote(name))
        return v

    v1 = publish(1)
    # The base model, on request: stored with version 0; not stored without "store".
    base = chat(app_url, MODEL, store=True)
    assert base.status_code == 200, base.text
    shown = stored(app_url, base.json()["id"])
    assert shown.status_code == 200, shown.text
    body = shown.json()
    assert body["choices"][0]["message"]["content"] == base.json()["choices"][0]["message"]["content"]
    assert (body["object"], body["model"], body["coserve"]["adapter_version"]) == ("chat.completion", MODEL, 0)
    assert body["coserve"]["messages"] == CHAT and "Name a colour." in body["coserve"]["prompt"]
    assert body["coserve"]["sampling"]["temperature"] == 0
    assert body["usage"]["completion_tokens"] == base.json()["usage"]["completion_tokens"]
    assert stored(app_url, chat(app_url, MODEL).json()["id"]).status_code == 404

    # The adapter stores every request to it; the version that answered is v1.
    a = chat(app_url, f"{MODEL}:{name}")
    assert a.status_code == 200, a.text
    assert stored(app_url, a.json()["id"]).json()["coserve"]["adapter_version"] == v1

    # A stream: the version is pinned when the request is admitted. v2 is published and served while the
    # stream is read; the stored completion still names v1, and holds the streamed text.
    with httpx.stream(
        "POST",
        f"{app_url}/v1/chat/completions",
        timeout=60,
        json={
            "model": f"{MODEL}:{name}",
            "messages": CHAT,
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "logit_bias": BIAS,
        },
    ) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        v2 = publish(2)
        events = [first] + [line for line in lines if line.startswith("data:")]
    chunks = [json.loads(e[5:]) for e in events if e.strip() != "data: [DONE]"]
    streamed_id = chunks[0]["id"]
    text = "".join((c["choices"][0].get("delta") or {}).get("content") or "" for c in chunks if c["choices"])
    deadline = time.time() + 10
    while (got := stored(app_url, streamed_id)).status_code == 404 and time.time() < deadline:
        time.sleep(0.1)  # stored as the stream ends
    assert got.status_code == 200, got.text
    assert (got.json()["coserve"]["adapter_version"], got.json()["choices"][0]["message"]["content"]) == (v1, text)
    b = chat(app_url, f"{MODEL}:{name}")
    assert stored(app_url, b.json()["id"]).json()["coserve"]["adapter_version"] == v2

    # Feedback by id: a thumbs-up of v1's answer, a thumbs-down of v2's, and a pair of the two (dpo).
    r = httpx.post(
        f"{app_url}/v1/feedback",
        timeout=30,
        json={
            "items": [
                {"completion_id": a.json()["id"], "rating": "up"},
                {"completion_id": b.json()["id"], "rating": "down"},
                {"completion_id": a.json()["id"], "adapter": "thumbs-dpo", "preferred_over": base.json()["id"]},
            ]
        },
    )
    assert r.status_code == 202, r.text
    a_text, b_text = (x.json()["choices"][0]["message"]["content"] for x in (a, b))
    base_text = base.json()["choices"][0]["message"]["content"]
    assert feedback_rows(data_dir)[-3:] == [
        (name, "label", 1, a_text, None, None, a.json()["id"], v1),
        (name, "label", 0, b_text, None, None, b.json()["id"], v2),
        ("thumbs-dpo", "preference", None, None, a_text, base_text, a.json()["id"], None),
    ]

    # Only its own tenant reads it (local mode is tenant ''): another tenant's lookup is as absent as a missing id.
    with pytest.raises(UnknownCompletion):
        ray.get(store.get_completion.remote(a.json()["id"], "other"))
    r = httpx.delete(f"{app_url}/v1/chat/completions/{a.json()['id']}", timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert stored(app_url, a.json()["id"]).status_code == 404
    r = httpx.post(f"{app_url}/v1/feedback", timeout=30, json={"completion_id": a.json()["id"], "rating": "up"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_a_kto_adapter_trains_on_thumbs_and_reports_its_learning_budget(app_url):
    """Thumbs on served answers train a kto adapter in the running trainer (windowed, the base as reference); the
    trained items' staleness and the tenant's trainer seconds are reported."""
    name = "thumbs-train"
    r = httpx.post(
        f"{app_url}/v1/adapters",
        timeout=30,
        json={
            "name": name,
            "method": "kto",
            "store_completions": True,
            "learning_rate": 5e-3,
            "gate": {"enabled": False, "held_out_share": 0},
            "mode": "periodic",
            "periodic": {"every_samples": 4},
        },
    )
    assert r.status_code == 201, r.text
    ids = []
    for word in ("red", "blue", "green", "seven"):
        x = httpx.post(
            f"{app_url}/v1/chat/completions",
            timeout=60,
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Say {word}."}],
                "max_tokens": 8,
                "temperature": 0,
                "store": True,
            },
        )
        assert x.status_code == 200, x.text
        ids.append(x.json()["id"])
    r = httpx.post(
        f"{app_url}/v1/feedback",
        timeout=30,
        json=[
            {"completion_id": i, "adapter": name, "rating": "up" if k % 2 == 0 else "down"} for k, i in enumerate(ids)
        ],
    )
    assert r.status_code == 202, r.text
    deadline = time.time() + 180
    while time.time() < deadline:
        info = httpx.get(f"{app_url}/v1/adapters/{name}", timeout=30).json()
        if info["current_version"] and info["queued"] == 0:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no kto version within 180 s: {info}")
    assert sum(v["samples_trained"] for v in info["versions"]) >= 4 and info["versions"][-1]["loss"] is not None
    # The base model answered (version 0) and v1 trained from it: its items were on-policy (a later version's
    # items, trained from v1, would not be).
    assert info["trained_on_policy"] + info["trained_off_policy"] == 4 and info["trained_on_policy"] >= 1
    assert info["on_policy_share"] == info["trained_on_policy"] / 4
    status = httpx.get(f"{app_url}/v1/status", timeout=30).json()
    from actors.serving.fair_admission import LOCAL_TENANT

    local = status["tenants"][LOCAL_TENANT]  # local mode: every request and adapter is the admin's
    assert local["trainer_seconds"] > 0 and local["training_tokens"] > 0 and local["served_tokens"] > 0
    metrics = httpx.get(f"{app_url}/metrics", timeout=30).text
    assert "coserve_tenant_learning_trainer_seconds_total" in metrics
