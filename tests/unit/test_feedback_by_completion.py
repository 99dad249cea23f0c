"""Stored completions and feedback by completion id over the real store and the real routes behind the guard with
keys: a completion is its tenant's alone, the three feedback shapes, the version that answered, the daily quota."""

from __future__ import annotations

import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from actors.learning.store.completion_rows import ChatMessage, SamplingParams, StoredCompletion, UnknownCompletion
from actors.learning.store.sqlite import FeedbackDatabase
from deployments.keys import KeyRing, digest
from deployments.stored_completions import CompletionRecorder
from settings import load
from tests.unit.learning_app import guarded_learning_app

KEYS = {"k-acme": "acme", "k-beta": "beta"}
CHAT = [{"role": "user", "content": "Capital of Italy?"}]


def _as(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


def completion(
    ident: str,
    tenant: str,
    adapter: str | None,
    version: int | None,
    output: str,
    messages: list | None = None,
    age_s: float = 0.0,
) -> StoredCompletion:
    turns = CHAT if messages is None else messages
    return StoredCompletion(
        ident,
        tenant,
        "chat.completion",
        f"tiny-llama:{adapter}",
        adapter,
        version,
        f"<rendered>{turns[-1]['content']}",
        tuple(ChatMessage(**t) for t in turns),
        output,
        "stop",
        7,
        3,
        SamplingParams(temperature=0.0),
        time.time() - age_s,
    )


def harness(tmp_path: Path, limits: dict | None = None):
    cfg = load({"data_dir": str(tmp_path), "model": {"embedded": "tiny-llama"}, "limits": limits or {}})
    store = FeedbackDatabase(tmp_path, gate_defaults={"enabled": False, "held_out_share": 0.0})
    app, actor, _ = guarded_learning_app(cfg, store, keys=KeyRing({digest(k): t for k, t in KEYS.items()}))

    async def call_store(call):
        return await call(actor)

    CompletionRecorder(cfg, call_store, lambda model: None, "tiny-llama", lambda: "").install(app)
    return app, store


@pytest.fixture
def served(tmp_path):
    app, store = harness(tmp_path)
    for method in ("kto", "sft", "dpo"):
        store.create_adapter({"name": method, "tenant": "acme", "method": method, "mode": "off"})
    # Two answers of acme's kto adapter v3 to one prompt, one of beta's, one to another prompt.
    store.store_completion(completion("chatcmpl-a", "acme", "acme/kto", 3, "Rome."))
    store.store_completion(completion("chatcmpl-b", "acme", "acme/kto", 3, "Rome is the capital of Italy, a city..."))
    store.store_completion(completion("chatcmpl-x", "beta", None, 0, "Rome."))
    store.store_completion(completion("chatcmpl-e", "acme", "acme/kto", 3, ""))  # the model answered nothing
    store.store_completion(
        completion(
            "chatcmpl-o", "acme", "acme/kto", 3, "Paris.", messages=[{"role": "user", "content": "Capital of France?"}]
        )
    )
    with TestClient(app) as client:
        yield client, store
    store.close()


def rows(store: FeedbackDatabase) -> list[tuple]:
    with sqlite3.connect(store.path) as db:
        return db.execute(
            "SELECT adapter, kind, completion, chosen, rejected, label, completion_id, "
            "answered_version, tenant, messages FROM feedback ORDER BY id"
        ).fetchall()


def test_a_stored_completion_reads_back_in_openais_shape_to_its_own_tenant_only(served):
    client, store = served
    r = client.get("/v1/chat/completions/chatcmpl-a", headers=_as("k-acme"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["id"], body["object"], body["choices"][0]["message"]) == (
        "chatcmpl-a",
        "chat.completion",
        {"role": "assistant", "content": "Rome."},
    )
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert body["coserve"]["adapter_version"] == 3 and body["coserve"]["sampling"] == {"temperature": 0.0}
    # Another tenant's id answers exactly as a missing one.
    theirs = client.get("/v1/chat/completions/chatcmpl-x", headers=_as("k-acme"))
    missing = client.get("/v1/chat/completions/chatcmpl-none", headers=_as("k-acme"))
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["error"]["message"].replace("chatcmpl-x", "ID") == missing.json()["error"]["message"].replace(
        "chatcmpl-none", "ID"
    )
    assert client.delete("/v1/chat/completions/chatcmpl-a", headers=_as("k-beta")).status_code == 404
    r = client.delete("/v1/chat/completions/chatcmpl-a", headers=_as("k-acme"))
    assert r.status_code == 200 and r.json() == {
        "object": "chat.completion.deleted",
        "id": "chatcmpl-a",
        "deleted": True,
    }
    assert client.get("/v1/chat/completions/chatcmpl-a", headers=_as("k-acme")).status_code == 404
    assert client.get("/v1/chat/completions/chatcmpl-x", headers=_as("k-beta")).status_code == 200


def test_retention_ages_completions_out(tmp_path):
    store = FeedbackDatabase(tmp_path)
    store.store_completion(completion("chatcmpl-old", "acme", None, 0, "x", age_s=3 * 86400))
    store.store_completion(completion("chatcmpl-new", "acme", None, 0, "y"))
    with pytest.raises(UnknownCompletion):
        store.get_completion("chatcmpl-old", "acme", keep_days=2)  # past retention: gone for reads at once
    store.store_completion(completion("chatcmpl-3", "acme", None, 0, "z"), keep_days=2)  # a write prunes
    with sqlite3.connect(store.path) as db:
        assert sorted(r[0] for r in db.execute("SELECT id FROM completions")) == ["chatcmpl-3", "chatcmpl-new"]


def test_the_three_feedback_shapes_by_id(served):
    client, store = served
    r = client.post(
        "/v1/feedback",
        headers=_as("k-acme", **{"Idempotency-Key": "k1"}),
        json={
            "items": [
                {"completion_id": "chatcmpl-a", "rating": "up"},
                {"completion_id": "chatcmpl-b", "rating": "down"},
                {"completion_id": "chatcmpl-a", "adapter": "sft", "correction": "Rome, since 1871."},
                {"completion_id": "chatcmpl-a", "adapter": "dpo", "preferred_over": "chatcmpl-b"},
            ]
        },
    )
    assert r.status_code == 202, r.text
    assert r.json()["accepted"] == 4
    got = rows(store)
    chat = '[{"role": "user", "content": "Capital of Italy?"}]'
    assert got == [
        ("acme/kto", "label", "Rome.", None, None, 1, "chatcmpl-a", 3, "acme", chat),
        ("acme/kto", "label", "Rome is the capital of Italy, a city...", None, None, 0, "chatcmpl-b", 3, "acme", chat),
        # Answered by kto's v3, trained into sft: the answering version of another adapter is unknown.
        ("acme/sft", "sft", "Rome, since 1871.", None, None, None, "chatcmpl-a", None, "acme", chat),
        (
            "acme/dpo",
            "preference",
            None,
            "Rome.",
            "Rome is the capital of Italy, a city...",
            None,
            "chatcmpl-a",
            None,
            "acme",
            chat,
        ),
    ]
    # The same key again replays; the trainer sees the label as the item's own.
    again = client.post(
        "/v1/feedback",
        headers=_as("k-acme", **{"Idempotency-Key": "k1"}),
        json={
            "items": [
                {"completion_id": "chatcmpl-a", "rating": "up"},
                {"completion_id": "chatcmpl-b", "rating": "down"},
                {"completion_id": "chatcmpl-a", "adapter": "sft", "correction": "Rome, since 1871."},
                {"completion_id": "chatcmpl-a", "adapter": "dpo", "preferred_over": "chatcmpl-b"},
            ]
        },
    )
    assert again.status_code == 202 and again.headers.get("Idempotent-Replayed") == "true"
    assert [it.label for it in store.take("acme/kto", 10)] == [True, False]
    assert len(rows(store)) == 4


@pytest.mark.parametrize(
    "item, status, param",
    [
        ({"completion_id": "chatcmpl-a", "rating": "meh"}, 400, "rating"),
        ({"completion_id": "chatcmpl-a"}, 400, "rating"),
        ({"completion_id": "chatcmpl-a", "rating": "up", "correction": "x"}, 400, "rating"),
        ({"completion_id": "chatcmpl-a", "adapter": "sft", "correction": "  "}, 400, "correction"),
        ({"completion_id": "chatcmpl-a", "adapter": "dpo", "preferred_over": "chatcmpl-o"}, 400, "preferred_over"),
        ({"completion_id": "chatcmpl-a", "rating": "up", "prompt": "x"}, 400, "prompt"),
        ({"completion_id": "chatcmpl-a", "adapter": "sft", "rating": "up"}, 400, None),  # sft takes no labels
        ({"completion_id": 7, "rating": "up"}, 400, "completion_id"),
        ({"completion_id": "chatcmpl-e", "rating": "down"}, 400, "completion_id"),  # nothing to rate
        ({"completion_id": "chatcmpl-x", "rating": "up"}, 404, None),  # beta's: as absent as a missing one
        ({"completion_id": "chatcmpl-a", "adapter": "dpo", "preferred_over": "chatcmpl-x"}, 404, None),
        ({"completion_id": "chatcmpl-a", "adapter": "nope", "rating": "up"}, 404, None),
    ],
)
def test_bad_feedback_by_id_is_a_4xx_in_openais_shape_and_stores_nothing(served, item, status, param):
    client, store = served
    r = client.post(
        "/v1/feedback",
        headers=_as("k-acme"),
        json={"items": [{"adapter": "sft", "prompt": "p", "completion": "c"}, item]},
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param
    assert rows(store) == []


def test_the_staleness_of_trained_feedback_is_reported(served):
    client, store = served
    store.store_completion(completion("chatcmpl-v0", "acme", None, 0, "Rome."))  # the base model answered
    r = client.post(
        "/v1/feedback",
        headers=_as("k-acme"),
        json={
            "items": [
                {"completion_id": "chatcmpl-v0", "adapter": "kto", "rating": "up"},  # v0: on-policy for v1's training
                {"completion_id": "chatcmpl-a", "rating": "up"},
            ]
        },
    )  # v3's answer: off-policy for v1
    assert r.status_code == 202, r.text
    shown = client.get("/v1/adapters/kto", headers=_as("k-acme")).json()
    assert (shown["trained_on_policy"], shown["trained_off_policy"], shown["on_policy_share"]) == (0, 0, None)
    v = store.reserve_version("acme/kto")
    store.publish_version("acme/kto", v.version, "/x", r.json()["ids"], 2, 0.4)
    shown = client.get("/v1/adapters/kto", headers=_as("k-acme")).json()
    assert (shown["trained_on_policy"], shown["trained_off_policy"], shown["on_policy_share"]) == (1, 1, 0.5)


def test_feedback_past_the_daily_training_tokens_is_429_and_stores_nothing(tmp_path):
    app, store = harness(tmp_path, limits={"training_tokens_per_day": 60})
    store.create_adapter({"name": "kto", "tenant": "acme", "method": "kto", "mode": "off"})
    store.create_adapter({"name": "kto", "tenant": "beta", "method": "kto", "mode": "off"})
    item = {"adapter": "kto", "prompt": "Capital of Italy?", "completion": "Rome.", "label": True}
    with TestClient(app) as client:
        first = client.post("/v1/feedback", headers=_as("k-acme"), json=[item, item])
        assert first.status_code == 202, first.text
        over = client.post("/v1/feedback", headers=_as("k-acme"), json=[item] * 8)
        assert over.status_code == 429, over.text
        assert over.json()["error"]["type"] == "rate_limit_error"
        assert 0 < int(over.headers["Retry-After"]) <= 86401
        assert "training_tokens_per_day=60" in over.json()["error"]["message"]
        assert len(rows(store)) == 2  # nothing of the refused batch
        # Another tenant's allowance is its own.
        assert client.post("/v1/feedback", headers=_as("k-beta"), json=[item, item]).status_code == 202
    with sqlite3.connect(store.path) as db:
        per_tenant = dict(db.execute("SELECT tenant, SUM(tokens) FROM feedback GROUP BY tenant").fetchall())
    assert per_tenant.keys() == {"acme", "beta"} and 0 < per_tenant["acme"] <= 60
    store.close()


def test_a_schema_10_store_migrates_keeping_every_item_and_id(tmp_path):
    """An older store (feedback kinds sft and preference only, methods without kto) opens as schema 11:
    every row and id kept, the AUTOINCREMENT counter too, and labels and kto adapters are taken after."""
    old = subprocess.run(
        ["git", "show", "0392b9c:actors/learning/store/schema.py"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    if old.returncode != 0:
        pytest.skip("the schema-10 source is not in this checkout's history")
    namespace: dict = {}
    exec(old.stdout, namespace)
    db = sqlite3.connect(tmp_path / "feedback.sqlite3")
    db.executescript(namespace["SCHEMA"])
    db.execute(
        "INSERT INTO adapters (name, method, beta, learning_rate, lora_r, lora_alpha, lora_target_modules, "
        "lora_dropout, mode, created_at) VALUES ('a', 'sft', 0.1, 0.001, 8, 16, '[\"q_proj\"]', 0, 'off', 0)"
    )
    for _i in range(3):
        db.execute("INSERT INTO feedback (adapter, kind, prompt, completion, created_at) VALUES ('a','sft','p','c',0)")
    db.execute("DELETE FROM feedback WHERE id = 3")  # the counter must still never hand out 3 again
    db.execute("PRAGMA user_version = 10")
    db.commit()
    db.close()
    store = FeedbackDatabase(tmp_path)
    assert [it.id for it in store.take("a", 10)] == [1, 2]
    store.create_adapter({"name": "k", "method": "kto"})
    assert store.add_feedback([{"adapter": "k", "prompt": "p", "completion": "c", "label": False}]) == [4]
    assert [it.label for it in store.take("k", 10)] == [False]
    store.close()


def test_the_recorder_pins_the_version_at_admission_and_keeps_the_streamed_text(tmp_path):
    """A stream's completion names the version served when it was admitted, even when a newer one is served
    before the stream ends; its text is the concatenated deltas of choice 0, whatever the chunks' cuts."""
    import asyncio
    import json as _json
    from types import SimpleNamespace

    from starlette.responses import StreamingResponse

    from deployments.guard import PRINCIPAL
    from deployments.keys import Principal

    store = FeedbackDatabase(tmp_path)
    cfg = load({"data_dir": str(tmp_path), "model": {"embedded": "tiny-llama"}})
    served = {"tiny-llama:acme/kto": 3}

    async def call_store(call):
        class Q:
            def __getattr__(self, name):
                return SimpleNamespace(remote=lambda *a, **k: asyncio.to_thread(getattr(store, name), *a, **k))

        return await call(Q())

    recorder = CompletionRecorder(cfg, call_store, served.get, "tiny-llama", lambda: str(tmp_path / "no-model"))

    def sse(delta: dict, finish=None) -> str:
        return (
            "data: "
            + _json.dumps({"id": "chatcmpl-s", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
            + "\n\n"
        )

    async def engine():
        yield sse({"role": "assistant", "content": ""})
        served["tiny-llama:acme/kto"] = 4  # a newer version is served mid-stream
        text = sse({"content": "Ro"}) + sse({"content": "me."}, "stop") + "data: [DONE]\n\n"
        yield text[:17]  # an event cut across chunks
        yield text[17:]

    async def run():
        PRINCIPAL.set(Principal(tenant="acme", admin=False, key_id="k"))
        request = SimpleNamespace(
            model="tiny-llama:acme/kto",
            messages=CHAT,
            model_extra={"store": True},
            temperature=0.0,
            max_completion_tokens=8,
        )
        admitted = await recorder.admit(request, "tiny-llama:kto")
        response = await admitted.record(StreamingResponse(engine(), media_type="text/event-stream"))
        return [c async for c in response.body_iterator]

    chunks = asyncio.run(run())
    assert "".join(chunks).endswith("data: [DONE]\n\n")  # passed through untouched
    done = store.get_completion("chatcmpl-s", "acme")
    assert (done.output, done.version, done.finish_reason, done.model) == ("Rome.", 3, "stop", "tiny-llama:kto")
    assert done.params.given() == {"temperature": 0.0, "max_completion_tokens": 8} and done.turns() == CHAT
    store.close()
