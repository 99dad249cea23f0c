"""The guard fails closed: no principal is a refusal, local mode only when the app really has no keys,
and a request without a known key is answered before its body is read."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from deployments.guard import PRINCIPAL, RequestGuard, Unauthenticated, bearer_token
from deployments.http import install_error_handlers
from deployments.keys import LOCAL, KeyRing, digest
from settings import LimitsConfig

KEY = "sk-coserve-test-key-of-acme-0123456789"


def _app(keys: KeyRing | None) -> FastAPI:
    """A route that answers with the principal it sees; behind the guard unless ``keys`` is None."""
    app = FastAPI()
    install_error_handlers(app)

    async def whoami() -> JSONResponse:
        p = PRINCIPAL.get()
        return JSONResponse({"tenant": p.tenant, "admin": p.admin, "key_id": p.key_id})

    app.add_api_route("/v1/whoami", whoami, methods=["GET", "POST"])
    app.add_api_route("/health", whoami, methods=["GET"])
    if keys is not None:
        app.add_middleware(RequestGuard, keys=keys, limits=LimitsConfig(requests_per_second=None, max_concurrent=None))
    return app


def test_reading_the_principal_where_none_was_set_raises():
    with pytest.raises(Unauthenticated):
        contextvars.Context().run(PRINCIPAL.get)


def test_a_route_reached_without_the_guard_is_refused_401_in_the_openai_shape():
    with TestClient(_app(None)) as client:
        r = client.get("/v1/whoami")
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == 401 and err["type"] == "AuthenticationError" and "principal" in err["message"]
    assert r.headers["www-authenticate"].startswith("Bearer")


def test_local_mode_is_what_the_guard_sets_when_there_are_no_keys():
    with TestClient(_app(KeyRing({}))) as client:
        r = client.get("/v1/whoami")
    assert r.status_code == 200
    assert r.json() == {"tenant": LOCAL.tenant, "admin": True, "key_id": LOCAL.key_id}


def test_with_keys_a_request_is_its_key_s_tenant_and_public_paths_are_anonymous():
    keys = KeyRing({digest(KEY): "acme"})
    with TestClient(_app(keys)) as client:
        assert client.get("/v1/whoami", headers={"Authorization": f"Bearer {KEY}"}).json()["tenant"] == "acme"
        anonymous = client.get("/health").json()
        assert anonymous["admin"] is False and anonymous["tenant"] is None and anonymous["key_id"] == "anonymous"
        for headers in (
            {},
            {"Authorization": "Bearer sk-coserve-unknown-key-0000000000"},
            {"Authorization": f"Basic {KEY}"},
        ):
            r = client.get("/v1/whoami", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_a_request_without_a_known_key_is_answered_before_its_body_is_read():
    keys = KeyRing({digest(KEY): "acme"})
    reached: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    guard = RequestGuard(app, keys, LimitsConfig())
    received, sent = [], []

    async def receive() -> dict[str, Any]:
        received.append(1)
        return {"type": "http.request", "body": b"x" * 1024, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "root_path": "",
        "headers": [(b"content-length", b"8000000")],
    }
    asyncio.run(guard(scope, receive, send))
    assert sent[0]["status"] == 401 and not received and not reached


def test_bearer_token_and_the_key_it_names():
    keys = KeyRing({digest(KEY): "acme"})
    assert bearer_token(f"Bearer {KEY}") == KEY and bearer_token(f"bearer  {KEY} ") == KEY
    assert bearer_token(None) is None and bearer_token(KEY) is None and bearer_token(f"Basic {KEY}") is None
    assert keys.identify(bearer_token(f"Bearer {KEY}")).tenant == "acme"
    assert keys.identify(bearer_token(None)) is None
    assert keys.identify(bearer_token("Bearer sk-coserve-nope-000000000000")) is None
    assert KeyRing({}).identify(bearer_token(f"Bearer {KEY}")) is None
