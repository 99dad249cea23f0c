"""Keys, tenants and limits on a live app with API keys: nobody reaches another tenant's adapter, the
prefix cache is per tenant, and every limit answers a clear 4xx (never a 5xx)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

BASE = "tiny-llama"


def _h(app: dict, tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {app['keys'][tenant]}"}


def _error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    for w in words:
        assert w.lower() in err["message"].lower(), err["message"]
    return err


@pytest.fixture(scope="module")
def beta_served(secure_app, served_adapter) -> str:
    """An adapter of tenant beta with a served version (the package's, tests/e2e/secure/conftest.py), its
    queue drained of what the drills' prober sent, so its queue length only changes when someone adds to it."""
    deadline, info = time.time() + 120, {}
    while time.time() < deadline:
        info = httpx.get(f"{secure_app['url']}/v1/adapters/{served_adapter}", headers=_h(secure_app, "beta")).json()
        if info["queued"] == 0:
            return served_adapter
        time.sleep(1)
    pytest.fail(f"beta's adapter still has queued feedback after 120 s: {info}")


def test_requests_without_a_known_key_get_401_and_health_stays_open(secure_app):
    url = secure_app["url"]
    for r in (
        httpx.post(f"{url}/v1/completions", json={"model": BASE, "prompt": "hi", "max_tokens": 2}),
        httpx.get(f"{url}/v1/adapters", headers={"Authorization": "Bearer sk-coserve-not-a-key"}),
        httpx.post(f"{url}/v1/feedback", json={"adapter": "x", "prompt": "p", "completion": "c"}),
        httpx.get(f"{url}/v1/models", headers={"Authorization": "Basic abc"}),
    ):
        err = _error(r, 401, "api key")
        assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(f"{url}/health").status_code == 200
    ok = httpx.post(
        f"{url}/v1/completions", headers=_h(secure_app, "acme"), json={"model": BASE, "prompt": "hi", "max_tokens": 2}
    )
    assert ok.status_code == 200, ok.text


def test_status_needs_the_admin_key_and_a_tenant_reads_only_its_own_metrics(secure_app):
    url = secure_app["url"]
    _error(httpx.get(url + "/v1/status", headers=_h(secure_app, "acme")), 403, "admin")
    assert httpx.get(url + "/v1/status", headers=_h(secure_app, "admin")).status_code == 200
    own = httpx.get(url + "/metrics", headers=_h(secure_app, "acme"))
    assert own.status_code == 200
    # Only the per-tenant series, and only acme's: no node, adapter or engine facts, no other tenant's label.
    names = {line.split("{")[0].split(" ")[0] for line in own.text.splitlines() if line and not line.startswith("#")}
    assert all(n.startswith("coserve_tenant_") for n in names), names
    assert all('tenant="acme"' in line for line in own.text.splitlines() if line and not line.startswith("#"))
    assert "coserve_node_ready" in httpx.get(url + "/metrics", headers=_h(secure_app, "admin")).text


def test_a_tenant_cannot_see_change_train_or_call_another_tenants_adapter(secure_app, beta_served):
    url, acme, beta = secure_app["url"], _h(secure_app, "acme"), _h(secure_app, "beta")
    name, model = beta_served, f"{BASE}:{beta_served}"
    # Its owner uses it.
    r = httpx.post(f"{url}/v1/completions", headers=beta, json={"model": model, "prompt": "q1", "max_tokens": 2})
    assert r.status_code == 200, r.text
    # Another tenant gets exactly what a missing adapter gets.
    missing = httpx.post(
        f"{url}/v1/completions", headers=acme, json={"model": f"{BASE}:no-such", "prompt": "q", "max_tokens": 2}
    )
    other = httpx.post(f"{url}/v1/completions", headers=acme, json={"model": model, "prompt": "q", "max_tokens": 2})
    assert (other.status_code, missing.status_code) == (404, 404)
    assert other.json()["error"]["message"] == missing.json()["error"]["message"].replace("no-such", name)
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        headers=acme,
        json={"model": model, "messages": [{"role": "user", "content": "q"}], "max_tokens": 2},
    )
    assert chat.status_code == 404
    before = httpx.get(f"{url}/v1/adapters/{name}", headers=beta).json()
    for r in (
        httpx.get(f"{url}/v1/adapters/{name}", headers=acme),
        httpx.patch(f"{url}/v1/adapters/{name}", headers=acme, json={"mode": "sync", "learning_rate": 1.0}),
        httpx.post(f"{url}/v1/adapters/{name}/rollback", headers=acme, json={"version": 1}),
        httpx.post(f"{url}/v1/adapters/{name}/promote", headers=acme, json={"version": 1}),
        httpx.post(f"{url}/v1/feedback", headers=acme, json={"adapter": name, "prompt": "p", "completion": "poison"}),
    ):
        _error(r, 404, name)
    after = httpx.get(f"{url}/v1/adapters/{name}", headers=beta).json()
    assert (after["learning_rate"], after["queued"]) == (before["learning_rate"], before["queued"])
    assert name not in {a["name"] for a in httpx.get(f"{url}/v1/adapters", headers=acme).json()["data"]}
    assert model not in {m["id"] for m in httpx.get(f"{url}/v1/models", headers=acme).json()["data"]}
    # The admin sees and may use everything, naming a tenant's adapter by its key; a tenant may not create for
    # another tenant.
    assert httpx.get(f"{url}/v1/adapters/beta/{name}", headers=_h(secure_app, "admin")).status_code == 200
    _error(httpx.post(f"{url}/v1/adapters", headers=acme, json={"name": "sneaky", "tenant": "beta"}), 400, "tenant")


def test_a_tenant_creates_and_lists_only_its_own_adapters(secure_app):
    url, acme = secure_app["url"], _h(secure_app, "acme")
    r = httpx.post(f"{url}/v1/adapters", headers=acme, json={"name": "acme-own", "mode": "off"})
    assert r.status_code == 201 and r.json()["tenant"] == "acme", r.text
    listed = httpx.get(f"{url}/v1/adapters", headers=acme).json()["data"]
    assert {a["tenant"] for a in listed} == {"acme"} and "acme-own" in {a["name"] for a in listed}
    fb = httpx.post(f"{url}/v1/feedback", headers=acme, json={"adapter": "acme-own", "prompt": "p", "completion": "c"})
    assert fb.status_code == 202, fb.text
    _error(httpx.get(f"{url}/v1/adapters/acme-own", headers=_h(secure_app, "beta")), 404)


def test_a_tenant_beyond_its_adapter_allowance_gets_403(secure_app):
    """limits.adapters_per_tenant is 3 here: the fourth adapter of a tenant is a 403 permission_error (waiting
    would not help, so not a 429), whoever creates it; other tenants keep their own allowance."""
    url, quota, admin = secure_app["url"], _h(secure_app, "quota"), _h(secure_app, "admin")
    for i in range(3):
        r = httpx.post(f"{url}/v1/adapters", headers=quota, json={"name": f"quota-{i}", "mode": "off"})
        assert r.status_code == 201, r.text
    r = httpx.post(f"{url}/v1/adapters", headers=quota, json={"name": "quota-3", "mode": "off"})
    _error(r, 403, "limits.adapters_per_tenant", "quota")
    assert r.json()["error"]["type"] == "permission_error"
    _error(
        httpx.post(f"{url}/v1/adapters", headers=admin, json={"name": "quota-4", "tenant": "quota", "mode": "off"}),
        403,
        "limits.adapters_per_tenant",
    )
    assert len(httpx.get(f"{url}/v1/adapters", headers=quota).json()["data"]) == 3
    r = httpx.post(f"{url}/v1/adapters", headers=admin, json={"name": "conc-own", "tenant": "conc", "mode": "off"})
    assert r.status_code == 201, r.text


def test_only_an_admin_key_may_create_a_full_unit(secure_app):
    """A full unit retrains the model every tenant is served: a tenant's key gets 403; the admin's passes that
    check and meets the next one (this app's nodes have one bundle, a pipeline needs two)."""
    url = secure_app["url"]
    body = {"name": "whole", "method": "full_sft"}
    _error(httpx.post(f"{url}/v1/adapters", headers=_h(secure_app, "acme"), json=body), 403, "admin")
    _error(httpx.post(f"{url}/v1/adapters", headers=_h(secure_app, "admin"), json=body), 400, "cluster.stages")


def _cache(secure_app) -> tuple[int, int]:
    node = httpx.get(f"{secure_app['url']}/v1/status", headers=_h(secure_app, "admin")).json()["nodes"][0]
    return node["prefix_cache"]["queried_tokens"], node["prefix_cache"]["hit_tokens"]


def _send_and_count(secure_app, tenant: str, prompt: str, **extra) -> int:
    """Send ``prompt`` as ``tenant``; the prompt tokens the engine found in its prefix cache for it."""
    queried, hits = _cache(secure_app)
    r = httpx.post(
        f"{secure_app['url']}/v1/completions",
        headers=_h(secure_app, tenant),
        json={"model": BASE, "prompt": prompt, "max_tokens": 1, **extra},
    )
    assert r.status_code == 200, r.text
    deadline = time.time() + 10
    while time.time() < deadline:  # the replica reports every trace_flush_seconds
        q, h = _cache(secure_app)
        if q >= queried + len(prompt) - 8:
            return h - hits
        time.sleep(0.1)
    pytest.fail("the engine's prefix-cache counters did not move")


def test_a_tenants_prefix_is_cached_for_it_and_never_for_another_tenant(secure_app):
    prompt = "".join(f"tenant isolation line {i}. " for i in range(20))  # ~500 tokens (byte-level tokenizer)
    assert _send_and_count(secure_app, "acme", prompt) == 0
    assert _send_and_count(secure_app, "acme", prompt) >= 256  # acme's own prefix: a hit
    assert _send_and_count(secure_app, "beta", prompt) == 0  # the same text from beta: no hit
    assert _send_and_count(secure_app, "beta", prompt) >= 256
    # A salt the client picks is replaced by the server's: it can neither dodge nor aim at a tenant's cache.
    assert _send_and_count(secure_app, "acme", prompt, cache_salt="beta-guess") >= 256


@pytest.mark.parametrize(
    "body, words",
    [
        ({"n": 9}, "max_n"),
        ({"max_tokens": 33}, "max_tokens"),
        ({"logprobs": 21}, "max_logprobs"),
        ({"n": 3, "prompt": ["a", "b", "c"]}, "max_n"),
    ],
)
def test_completion_caps_answer_400(secure_app, body, words):
    r = httpx.post(
        f"{secure_app['url']}/v1/completions",
        headers=_h(secure_app, "acme"),
        json={"model": BASE, "prompt": "hi", "max_tokens": 2, **body},
    )
    _error(r, 400, words)


def test_chat_caps_answer_400(secure_app):
    url, acme = secure_app["url"], _h(secure_app, "acme")
    msg = [{"role": "user", "content": "hi"}]
    _error(
        httpx.post(
            f"{url}/v1/chat/completions",
            headers=acme,
            json={"model": BASE, "messages": msg, "max_completion_tokens": 100},
        ),
        400,
        "max_tokens",
    )
    _error(
        httpx.post(
            f"{url}/v1/chat/completions",
            headers=acme,
            json={"model": BASE, "messages": msg, "logprobs": True, "top_logprobs": -1},
        ),
        400,
        "logprobs",
    )


WRITE_ROUTES = [
    ("post", "/v1/adapters"),
    ("patch", "/v1/adapters/acme/acme-own"),
    ("post", "/v1/adapters/acme/acme-own/rollback"),
    ("post", "/v1/adapters/acme/acme-own/promote"),
    ("post", "/v1/feedback"),
    ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
]


@pytest.mark.parametrize("method, path", WRITE_ROUTES)
def test_hostile_bodies_get_4xx_on_every_write_route(secure_app, method, path):
    url, admin = secure_app["url"], {**_h(secure_app, "admin"), "Content-Type": "application/json"}
    deep = b"[" * 100_000 + b"]" * 100_000
    _error(httpx.request(method, url + path, headers=admin, content=deep), 400)
    _error(httpx.request(method, url + path, headers=admin, content=b"x" * (1 * 2**20 + 1)), 413, "max_body_bytes")
    big = 1180591620717411303424
    r = httpx.request(
        method,
        url + path,
        headers=admin,
        json={
            "version": big,
            "name": "big",
            "periodic": {"every_samples": big},
            "model": BASE,
            "prompt": "x",
            "max_tokens": big,
            "adapter": "acme/acme-own",
            "completion": "c",
        },
    )
    assert 400 <= r.status_code < 500, r.text
    assert httpx.get(f"{url}/health").status_code == 200


def test_feedback_batch_and_item_caps(secure_app):
    url, acme = secure_app["url"], _h(secure_app, "acme")
    item = {"adapter": "acme-own", "prompt": "p", "completion": "c"}
    _error(httpx.post(f"{url}/v1/feedback", headers=acme, json=[item] * 17), 400, "16")
    _error(httpx.post(f"{url}/v1/feedback", headers=acme, json={**item, "completion": "x" * 1100}), 400, "1024")


def test_rate_limit_answers_429_with_retry_after_for_that_key_only(secure_app):
    url, key = secure_app["url"], _h(secure_app, "flood")
    answers: list[httpx.Response] = []

    def burst() -> None:  # three at a time: under the key's concurrency cap, over its rate (20/s, burst 40)
        with httpx.Client(headers=key, timeout=30) as c:
            for _ in range(40):
                answers.append(c.post(f"{url}/tokenize", json={"model": BASE, "prompt": "count me"}))

    threads = [threading.Thread(target=burst) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = [r.status_code for r in answers]
    limited = [r for r in answers if r.status_code == 429]
    assert limited and set(codes) <= {200, 429}, codes
    assert {r.json()["error"]["code"] for r in limited} == {"rate_limit_exceeded"}
    assert all(int(r.headers["retry-after"]) >= 1 for r in limited)
    assert codes.count(200) >= 40  # the burst went through
    assert httpx.get(f"{url}/v1/adapters", headers=_h(secure_app, "acme")).status_code == 200  # other keys unaffected


def test_concurrency_limit_answers_429_beyond_four_in_flight(secure_app):
    url, key = secure_app["url"], _h(secure_app, "conc")
    codes: list[int] = []
    start = threading.Barrier(8)

    def one() -> None:
        start.wait()
        body = {"model": BASE, "prompt": "x" * 600, "max_tokens": 32, "ignore_eos": True}
        codes.append(httpx.post(f"{url}/v1/completions", headers=key, json=body, timeout=120).status_code)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(set(codes)) == [200, 429] and codes.count(200) >= 4, codes


# ---- issue 29 item 1: tenants see only themselves ----------------------------------------------------------------


def test_tokenize_and_detokenize_treat_another_tenants_adapter_as_missing(secure_app, beta_served):
    """acme's /tokenize and /detokenize with beta's adapter answer exactly what they answer for a missing one
    (they answered 200 before, telling acme the name exists); beta, and the admin by its key, tokenize with it."""
    url, acme = secure_app["url"], _h(secure_app, "acme")
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [72, 105]})):
        other = httpx.post(url + path, headers=acme, json={"model": f"{BASE}:{beta_served}", **body})
        missing = httpx.post(url + path, headers=acme, json={"model": f"{BASE}:no-such", **body})
        keyed = httpx.post(url + path, headers=acme, json={"model": f"{BASE}:beta/{beta_served}", **body})
        assert (other.status_code, missing.status_code, keyed.status_code) == (404, 404, 404), other.text
        assert other.json()["error"]["message"] == missing.json()["error"]["message"].replace("no-such", beta_served)
        assert set(other.json()["error"]) >= {"message", "type", "param", "code"}
        own = httpx.post(url + path, headers=_h(secure_app, "beta"), json={"model": f"{BASE}:{beta_served}", **body})
        assert own.status_code == 200, own.text
        admin = httpx.post(
            url + path, headers=_h(secure_app, "admin"), json={"model": f"{BASE}:beta/{beta_served}", **body}
        )
        assert admin.status_code == 200, admin.text


def test_two_tenants_each_own_support_and_the_admin_names_them_by_key(secure_app, beta_served):
    """A name another tenant took is no conflict (a 409 told acme the name exists); each calls its own by the
    bare name, answers name it as the tenant does, and the admin names tenant/name."""
    url, acme, beta, admin = (
        secure_app["url"],
        _h(secure_app, "acme"),
        _h(secure_app, "beta"),
        _h(secure_app, "admin"),
    )
    for tenant in (beta, acme):
        r = httpx.post(f"{url}/v1/adapters", headers=tenant, json={"name": "support", "mode": "off"})
        assert r.status_code == 201, r.text
        assert (r.json()["name"], r.json()["model"]) == ("support", f"{BASE}:support")
    assert httpx.get(f"{url}/v1/adapters/support", headers=acme).json()["tenant"] == "acme"
    assert httpx.get(f"{url}/v1/adapters/support", headers=beta).json()["tenant"] == "beta"
    for tenant in ("acme", "beta"):
        r = httpx.get(f"{url}/v1/adapters/{tenant}/support", headers=admin)
        assert r.status_code == 200 and r.json()["tenant"] == tenant, r.text
        assert r.json()["model"] == f"{BASE}:{tenant}/support"
    _error(httpx.get(f"{url}/v1/adapters/support", headers=admin), 404)  # the admin has none of its own
    # The served adapter: its tenant calls it by the bare name and the answer names it so; the admin by its key.
    r = httpx.post(
        f"{url}/v1/completions", headers=beta, json={"model": f"{BASE}:{beta_served}", "prompt": "q1", "max_tokens": 2}
    )
    assert r.status_code == 200 and r.json()["model"] == f"{BASE}:{beta_served}", r.text
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers=beta,
        json={"model": f"{BASE}:{beta_served}", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2},
    )
    assert r.status_code == 200 and r.json()["model"] == f"{BASE}:{beta_served}", r.text
    r = httpx.post(
        f"{url}/v1/completions",
        headers=admin,
        json={"model": f"{BASE}:beta/{beta_served}", "prompt": "q1", "max_tokens": 2},
    )
    assert r.status_code == 200 and r.json()["model"] == f"{BASE}:beta/{beta_served}", r.text
    ids = {m["id"] for m in httpx.get(f"{url}/v1/models", headers=admin).json()["data"]}
    assert f"{BASE}:beta/{beta_served}" in ids


def test_no_server_path_reaches_a_tenant(secure_app, beta_served):
    """/v1/models showed the base model's directory as its root, and adapter versions showed their path."""
    url, beta = secure_app["url"], _h(secure_app, "beta")
    data_dir = str(secure_app["data_dir"])
    models = httpx.get(f"{url}/v1/models", headers=beta)
    assert models.status_code == 200 and data_dir not in models.text, models.text
    assert {m["root"] for m in models.json()["data"]} <= {m["id"] for m in models.json()["data"]}
    for r in (
        httpx.get(f"{url}/v1/adapters/{beta_served}", headers=beta),
        httpx.get(f"{url}/v1/adapters", headers=beta),
    ):
        assert r.status_code == 200 and data_dir not in r.text and '"path"' not in r.text, r.text
    # The operator still reads where a version lives.
    info = httpx.get(f"{url}/v1/adapters/beta/{beta_served}", headers=_h(secure_app, "admin")).json()
    assert info["versions"] and all(v["path"] for v in info["versions"]), info


# ---- issue 29 item 3: strict types and caps -------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"lora": {"r": "256"}}, "lora.r"),
        ({"lora": {"r": 256}}, "lora.r"),  # this app's engine.max_lora_rank: 8
        ({"lora": {"r": 8.0}}, "lora.r"),
        ({"learning_rate": "0.01"}, "learning_rate"),
        ({"epochs": "2"}, "epochs"),
        ({"periodic": {"every_samples": "5"}}, "periodic.every_samples"),
        ({"gate": {"enabled": "false"}}, "gate.enabled"),
    ],
)
def test_a_string_or_float_where_an_integer_is_meant_is_400_naming_the_field(secure_app, body, param):
    url, acme = secure_app["url"], _h(secure_app, "acme")
    err = _error(httpx.post(f"{url}/v1/adapters", headers=acme, json={"name": "strict", "mode": "off", **body}), 400)
    assert err["param"] == param, err
    _error(httpx.get(f"{url}/v1/adapters/strict", headers=acme), 404)  # nothing was stored


def test_a_patch_with_a_string_where_a_number_is_meant_is_400(secure_app):
    url, acme = secure_app["url"], _h(secure_app, "acme")
    before = httpx.get(f"{url}/v1/adapters/acme-own", headers=acme).json()
    for change in ({"learning_rate": "0.01"}, {"epochs": "2"}):
        _error(httpx.patch(f"{url}/v1/adapters/acme-own", headers=acme, json=change), 400)
    after = httpx.get(f"{url}/v1/adapters/acme-own", headers=acme).json()
    assert (after["learning_rate"], after["epochs"]) == (before["learning_rate"], before["epochs"])


def test_a_chat_without_max_tokens_stops_at_the_limit_or_the_context(secure_app):
    """Without max_tokens a chat ran to the context's end (2,021 tokens on a 2,048 context) whatever
    limits.max_tokens said; now it stops at limits.max_tokens (32 here), or earlier where the prompt leaves less
    room. A max_tokens over the limit stays a 400 (test_chat_caps_answer_400)."""
    url, acme = secure_app["url"], _h(secure_app, "acme")
    limit, context = secure_app["config"]["limits"]["max_tokens"], secure_app["config"]["model"]["max_model_len"]

    def chat(content: str) -> dict:
        r = httpx.post(
            f"{url}/v1/chat/completions",
            headers=acme,
            timeout=120,
            json={"model": BASE, "messages": [{"role": "user", "content": content}], "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        return r.json()

    short = chat("hi")
    assert short["usage"]["completion_tokens"] == limit and short["choices"][0]["finish_reason"] == "length", short

    # A prompt that leaves 10 tokens of context (sized with /tokenize: the tiny model's tokenizer is byte-level).
    def prompt_tokens(content: str) -> int:
        r = httpx.post(
            f"{url}/tokenize",
            headers=acme,
            json={"model": BASE, "messages": [{"role": "user", "content": content}], "add_generation_prompt": True},
        )
        assert r.status_code == 200, r.text
        return r.json()["count"]

    content = "x" * (context - 10 - (prompt_tokens("x") - 1))
    assert prompt_tokens(content) == context - 10
    near_end = chat(content)
    assert near_end["usage"]["completion_tokens"] == 10, near_end["usage"]
    assert near_end["usage"]["prompt_tokens"] + near_end["usage"]["completion_tokens"] == context
