"""The learning routes over a real feedback store and a planner that is away: a committed change answers 2xx."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from actors.learning.store.records import VersionScores
from actors.learning.store.sqlite import FeedbackDatabase
from deployments.learning import LearningRoutes
from settings import AppConfig, load
from tests.unit.learning_app import TINY_LORA_PARTS, Planner, guarded_learning_app


@pytest.fixture
def harness(tmp_path):
    cfg: AppConfig = load({"data_dir": str(tmp_path), "model": {"embedded": "tiny-llama"}})
    store = FeedbackDatabase(tmp_path, gate_defaults={"enabled": False, "held_out_share": 0.0})
    # As the model server runs the routes: behind the guard, here in local mode (no keys).
    app, actor, planner = guarded_learning_app(cfg, store, lora_parts=(*TINY_LORA_PARTS, "mlp.up_proj"))
    with TestClient(app) as client:
        yield client, store, actor, planner
    store.close()


def _publish(store: FeedbackDatabase, name: str) -> int:
    v = store.reserve_version(name)
    return store.publish_version(name, v.version, f"/adapters/{name}/v{v.version}", [], 1, 0.5).version


@pytest.mark.parametrize("mode", ["away", "dead", "hangs"])
def test_committed_changes_answer_2xx_while_the_planner_is_away(harness, mode):
    client, store, _, planner = harness
    planner.mode = mode
    r = client.post("/v1/adapters", json={"name": "tutor", "method": "sft", "mode": "off"})
    assert r.status_code == 201, r.text
    assert r.json()["model"] == "tiny-llama:tutor"  # the served name comes from the config, not the planner
    r = client.patch("/v1/adapters/tutor", json={"learning_rate": 0.004})
    assert r.status_code == 200 and r.json()["learning_rate"] == 0.004, r.text
    assert store.get_adapter("tutor").learning_rate == 0.004
    v1, v2 = _publish(store, "tutor"), _publish(store, "tutor")
    r = client.post("/v1/adapters/tutor/rollback", json={"version": v1})
    assert r.status_code == 200 and r.json()["current_version"] == v1, r.text
    r = client.post("/v1/adapters/tutor/promote", json={"version": v2})
    assert r.status_code == 200 and r.json()["current_version"] == v2, r.text
    assert store.current_version("tutor").version == v2
    assert planner.calls == 3  # PATCH, rollback and promote each told it (best effort); create needs it not
    assert client.get("/v1/adapters").status_code == 200 and client.get("/v1/adapters/tutor").status_code == 200


def test_an_adapter_created_with_only_its_name_gets_the_measured_defaults_of_its_method(harness):
    """Issue 37: sft defaults to 2e-3 on every linear layer (the sweep's choice); dpo keeps 5e-4 on q,v; a field
    the client sets is kept, and a PATCH of another field does not bring the default back."""
    client, store, _, _ = harness
    sft = client.post("/v1/adapters", json={"name": "plain", "mode": "off"}).json()
    assert (sft["learning_rate"], sft["lora"]["target_modules"], sft["lora"]["r"], sft["warmup_steps"]) == (
        2e-3,
        "all-linear",
        8,
        4,
    ), sft
    dpo = client.post("/v1/adapters", json={"name": "pref", "method": "dpo", "mode": "off"}).json()
    assert (dpo["learning_rate"], dpo["lora"]["target_modules"]) == (5e-4, ["q_proj", "v_proj"]), dpo
    own = client.post(
        "/v1/adapters",
        json={"name": "own", "mode": "off", "learning_rate": 1e-4, "lora": {"r": 4, "target_modules": ["q_proj"]}},
    ).json()
    assert (own["learning_rate"], own["lora"]["target_modules"]) == (1e-4, ["q_proj"]), own
    assert client.patch("/v1/adapters/own", json={"epochs": 2}).status_code == 200
    kept = store.get_adapter("own")
    assert (kept.learning_rate, kept.lora.target_modules) == (1e-4, ["q_proj"])


def test_a_create_whose_reply_was_lost_answers_201_once_and_409_after(harness):
    client, store, actor, _ = harness
    actor.die_after.add("create_adapter")  # committed, then the store "died" before replying
    body = {"name": "acme", "method": "dpo", "mode": "off"}
    r = client.post("/v1/adapters", json=body)
    assert r.status_code == 201, r.text
    assert [a.name for a in store.list_adapters()] == ["acme"]
    assert client.post("/v1/adapters", json=body).status_code == 409  # a plain second create is a conflict
    actor.die_after.add("create_adapter")
    r = client.post("/v1/adapters", json={**body, "name": "other"})
    assert r.status_code == 201, r.text
    # A create that died before it ran, whose resend meets another adapter of that name, is still 409.
    store.create_adapter({"name": "taken", "method": "sft"})
    actor.die_before.add("create_adapter")
    assert client.post("/v1/adapters", json={"name": "taken", "method": "dpo"}).status_code == 409


@pytest.mark.parametrize(
    "lora, param",
    [
        ({"r": "4"}, "lora.r"),
        ({"r": 4.0}, "lora.r"),
        ({"r": 0}, "lora.r"),
        ({"r": 16}, "lora.r"),  # max_lora_rank 8
        ({"target_modules": ["q_proj", "no_such_module"]}, "lora.target_modules"),
        ({"target_modules": ["self_attn"]}, "lora.target_modules"),  # not a layer LoRA wraps
        ({"target_modules": "q_proj"}, "lora.target_modules"),
    ],
)
def test_lora_settings_the_engine_cannot_serve_are_400_naming_the_field(harness, lora, param):
    client, store, _, _ = harness
    r = client.post("/v1/adapters", json={"name": "bad", "lora": lora})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == 400
    assert store.list_adapters() == []


def test_targets_match_as_peft_matches_them(harness):
    client, store, _, _ = harness
    for i, targets in enumerate(
        (["q_proj", "v_proj"], ["self_attn.q_proj"], ["model.layers.0.mlp.up_proj"], "all-linear", ["all-linear"])
    ):
        r = client.post("/v1/adapters", json={"name": f"ok-{i}", "lora": {"r": 8, "target_modules": targets}})
        assert r.status_code == 201, r.text
    assert store.get_adapter("ok-4").lora.target_modules == "all-linear"


def test_feedback_replays_its_idempotency_key_and_refuses_bad_ones(harness):
    client, store, actor, _ = harness
    store.create_adapter({"name": "tutor", "method": "sft", "mode": "off"})
    item = {"adapter": "tutor", "prompt": "2+2?", "completion": "4"}
    actor.die_after.add("submit_feedback")  # stored, reply lost: call_store sends it again with the request's key
    r = client.post("/v1/feedback", json=[item, item])
    assert r.status_code == 202 and len(r.json()["ids"]) == 2, r.text
    assert "idempotent-replayed" not in r.headers and store.queued("tutor") == 2
    key = {"Idempotency-Key": "client-1"}
    first = client.post("/v1/feedback", json=item, headers=key)
    again = client.post("/v1/feedback", json={"items": [item]}, headers=key)
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    assert store.queued("tutor") == 3
    r = client.post("/v1/feedback", json=[item, item], headers=key)
    assert r.status_code == 422 and r.json()["error"]["type"] == "idempotency_error", r.text
    assert r.json()["error"]["param"] == "Idempotency-Key"
    r = client.post("/v1/feedback", json=item, headers={"Idempotency-Key": "k" * 256})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Idempotency-Key", r.text
    assert store.queued("tutor") == 3


# ---- tenants (issue 29 item 1): the routes behind the request guard, with keys for acme, beta and the admin ----

KEYS = {tenant: f"sk-coserve-test-{tenant}-0123456789" for tenant in ("acme", "beta", "admin")}


@pytest.fixture
def tenants(tmp_path):
    """The learning routes behind the real RequestGuard with keys, over a real store; ``call(tenant, method, path,
    **kw)`` sends a request with that tenant's key."""
    from deployments.keys import KeyRing, digest
    from settings import LimitsConfig

    cfg: AppConfig = load({"data_dir": str(tmp_path), "model": {"embedded": "tiny-llama"}})
    store = FeedbackDatabase(tmp_path, gate_defaults={"enabled": False, "held_out_share": 0.0})
    app, _, _ = guarded_learning_app(
        cfg,
        store,
        keys=KeyRing({digest(k): t for t, k in KEYS.items()}),
        limits=LimitsConfig(requests_per_second=None, max_concurrent=None),
    )
    with TestClient(app) as client:

        def call(tenant: str, method: str, path: str, **kw: Any) -> Any:
            return client.request(method, path, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, **kw)

        yield call, store, cfg
    store.close()


def test_two_tenants_each_create_and_call_their_own_support(tenants):
    call, store, _ = tenants
    for tenant in ("beta", "acme"):  # beta first: acme's create must not meet beta's name (a 409 would leak it)
        r = call(tenant, "POST", "/v1/adapters", json={"name": "support", "mode": "off"})
        assert r.status_code == 201, r.text
        assert (r.json()["name"], r.json()["model"], r.json()["tenant"]) == ("support", "tiny-llama:support", tenant)
    assert sorted(a.name for a in store.list_adapters()) == ["acme/support", "beta/support"]
    assert call("acme", "POST", "/v1/adapters", json={"name": "support"}).status_code == 409  # its own, twice
    assert (
        call("acme", "POST", "/v1/feedback", json={"adapter": "support", "prompt": "p", "completion": "c"}).status_code
        == 202
    )
    assert (store.queued("acme/support"), store.queued("beta/support")) == (1, 0)
    r = call("acme", "PATCH", "/v1/adapters/support", json={"learning_rate": 0.01})
    assert r.status_code == 200 and store.get_adapter("acme/support").learning_rate == 0.01, r.text
    assert store.get_adapter("beta/support").learning_rate != 0.01
    assert [a["name"] for a in call("beta", "GET", "/v1/adapters").json()["data"]] == ["support"]
    # The admin names keys, in routes and in bodies; a bare name is the admin's own (or local mode's).
    listed = call("admin", "GET", "/v1/adapters").json()["data"]
    assert [(a["name"], a["model"]) for a in listed] == [
        ("acme/support", "tiny-llama:acme/support"),
        ("beta/support", "tiny-llama:beta/support"),
    ]
    assert call("admin", "GET", "/v1/adapters/acme/support").json()["tenant"] == "acme"
    assert call("admin", "GET", "/v1/adapters/support").status_code == 404
    r = call("admin", "POST", "/v1/adapters", json={"name": "ops", "tenant": "acme", "mode": "off"})
    assert (r.status_code, r.json()["name"], r.json()["tenant"]) == (201, "acme/ops", "acme"), r.text
    assert call("acme", "GET", "/v1/adapters/ops").json()["name"] == "ops"
    # A create's name is a bare name (the schema's pattern), the admin's too: the tenant goes in `tenant`.
    assert call("admin", "POST", "/v1/adapters", json={"name": "acme/x"}).status_code == 400
    r = call("admin", "POST", "/v1/feedback", json={"adapter": "beta/support", "prompt": "p", "completion": "c"})
    assert r.status_code == 202 and store.queued("beta/support") == 1, r.text


def test_another_tenants_adapter_is_as_absent_as_a_missing_one(tenants):
    call, store, _ = tenants
    assert call("beta", "POST", "/v1/adapters", json={"name": "beta-secret", "mode": "off"}).status_code == 201
    for method, suffix, body in (
        ("GET", "", None),
        ("PATCH", "", {"mode": "sync"}),
        ("POST", "/rollback", {"version": 1}),
        ("POST", "/promote", {"version": 1}),
    ):
        other = call("acme", method, f"/v1/adapters/beta-secret{suffix}", json=body)
        missing = call("acme", method, f"/v1/adapters/no-such{suffix}", json=body)
        keyed = call("acme", method, f"/v1/adapters/beta/beta-secret{suffix}", json=body)
        assert other.status_code == missing.status_code == keyed.status_code == 404, (other.text, missing.text)
        assert other.json()["error"]["message"] == missing.json()["error"]["message"].replace("no-such", "beta-secret")
    r = call("acme", "POST", "/v1/feedback", json={"adapter": "beta-secret", "prompt": "p", "completion": "poison"})
    assert r.status_code == 404 and store.queued("beta/beta-secret") == 0


def test_a_tenant_reads_no_server_path_and_not_its_key(tenants):
    call, store, cfg = tenants
    assert call("acme", "POST", "/v1/adapters", json={"name": "support", "mode": "off"}).status_code == 201
    path = f"{cfg.data_path}/adapters/@acme/support/v1"
    v = store.reserve_version("acme/support")
    store.publish_version("acme/support", v.version, path, [], 1, 0.5)
    store.pause_adapter("acme/support", f"node 0 could not serve version 1: cannot read {path}/adapter_config.json")
    mine = call("acme", "GET", "/v1/adapters/support").json()
    assert [set(ver) & {"path"} for ver in mine["versions"]] == [set()]
    assert mine["versions"][0]["adapter"] == "support"
    assert str(cfg.data_path) not in mine["paused_reason"] and "<server path>" in mine["paused_reason"]
    assert str(cfg.data_path) not in str(call("acme", "GET", "/v1/adapters").json())
    assert call("admin", "GET", "/v1/adapters/acme/support").json()["versions"][0]["path"] == path  # the operator's
    # A store refusal names the adapter as the tenant does (no "acme/"), as the admin's names the key.
    r = call("acme", "POST", "/v1/adapters/support/rollback", json={"version": 7})
    assert r.status_code == 404 and "acme/" not in r.json()["error"]["message"], r.text
    assert "'support'" in r.json()["error"]["message"]
    r = call("admin", "POST", "/v1/adapters/acme/support/rollback", json={"version": 7})
    assert r.status_code == 404 and "acme/support" in r.json()["error"]["message"], r.text


# ---- strict types (issue 29 item 3): no string (or float, or number for a flag) is coerced ----


@pytest.mark.parametrize(
    "body, param",
    [
        ({"lora": {"r": "256"}}, "lora.r"),
        ({"lora": {"r": 256}}, "lora.r"),
        ({"lora": {"alpha": "16"}}, "lora.alpha"),
        ({"lora": {"dropout": "0.1"}}, "lora.dropout"),
        ({"learning_rate": "0.001"}, "learning_rate"),
        ({"beta": "0.5"}, "beta"),
        ({"epochs": "2"}, "epochs"),
        ({"epochs": 2.0}, "epochs"),
        ({"periodic": {"every_samples": "5"}}, "periodic.every_samples"),
        ({"periodic": {"every_seconds": "30"}}, "periodic.every_seconds"),
        ({"gate": {"enabled": "false"}}, "gate.enabled"),
        ({"gate": {"enabled": 0}}, "gate.enabled"),
        ({"gate": {"max_eval_items": "8"}}, "gate.max_eval_items"),
        ({"gate": {"margin": "0.1"}}, "gate.margin"),
    ],
)
def test_a_create_with_a_string_where_a_number_is_meant_is_400_naming_the_field(harness, body, param):
    client, store, _, _ = harness
    r = client.post("/v1/adapters", json={"name": "strict", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == 400
    assert store.list_adapters() == []
    assert (
        client.post("/v1/adapters", json={"name": "strict", "learning_rate": 1, "lora": {"alpha": 16}}).status_code
        == 201
    )  # an integer where a float is meant is a number


@pytest.mark.parametrize(
    "change",
    [
        {"learning_rate": "0.01"},
        {"epochs": "3"},
        {"beta": "1"},
        {"gate": {"margin": "0.5"}},
        {"periodic": {"every_samples": "4"}},
    ],
)
def test_a_patch_with_a_string_where_a_number_is_meant_is_400(harness, change):
    client, store, _, _ = harness
    store.create_adapter({"name": "tutor", "mode": "periodic"})
    before = store.get_adapter("tutor")
    r = client.patch("/v1/adapters/tutor", json=change)
    assert r.status_code == 400, r.text
    assert store.get_adapter("tutor") == before


def test_the_openapi_schema_says_what_create_takes():
    """The schema the fuzzer generates from: lora.r at most the engine's max_lora_rank, numbers typed."""
    from deployments.openapi import install_openapi

    app = FastAPI()
    LearningRoutes(
        load({"data_dir": "/tmp/unused", "model": {"embedded": "tiny-llama"}, "engine": {"max_lora_rank": 8}}),
        Planner(),
    ).install(app)
    install_openapi(app, guarded=True, max_lora_rank=8)
    schemas = app.openapi()["components"]["schemas"]
    assert (
        schemas["LoraSettings"]["properties"]["r"] | {"type": "integer", "minimum": 1, "maximum": 8}
        == schemas["LoraSettings"]["properties"]["r"]
    )
    assert schemas["AdapterSpec"]["properties"]["epochs"]["type"] == "integer"
    assert {"/v1/adapters/{name}", "/v1/adapters/{name}/rollback"} <= set(app.openapi()["paths"])


def test_the_adapter_view_shows_the_served_versions_retention(harness):
    client, store, _, _ = harness
    assert client.post("/v1/adapters", json={"name": "tutor", "method": "sft", "mode": "off"}).status_code == 201
    assert client.get("/v1/adapters/tutor").json()["retention"] is None  # nothing served yet
    v1 = _publish(store, "tutor")
    store.record_scores(
        "tutor", v1, VersionScores(retention=-1.25, retention_base=-1.0, retention_prompts=24, score_s=0.8)
    )
    body = client.get("/v1/adapters/tutor").json()
    assert body["retention"] == {
        "version": v1,
        "score": -1.25,
        "base": -1.0,
        "lost": 0.25,
        "margin": body["gate"]["retention_margin"],
        "prompts": 24,
    }
    assert body["versions"][0]["retention"] == -1.25 and body["versions"][0]["score_s"] == 0.8
