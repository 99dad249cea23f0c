"""RequestGuard: the ASGI middleware in front of every route: API key, route rights, body size, rate and concurrency.

It runs before vLLM's and the app's routes in the model server's own ASGI app, so nothing reaches
a handler unauthenticated, with an oversized body, or over its key's limits. What it decides is
answered here in the OpenAI error shape (401, 403, 413, 429); what it learns (the principal) goes
down to the handlers in :data:`PRINCIPAL`, where the inference wrappers (``deployments/server.py``)
and the learning routes check adapter ownership, cap ``n``/``max_tokens`` and set the tenant's
prefix-cache salt.

It fails closed: :data:`PRINCIPAL` has no default. The guard sets it for every request it lets
through, to :data:`~deployments.keys.LOCAL` only when the app really has no keys (local mode is a state
the guard sets, never what a missing principal means); code that reads it where the guard did not
run (a route outside the guarded app, a task that lost the request's context) raises
:class:`Unauthenticated`, which the app answers 401 in the OpenAI shape (``deployments/http.py``).

Limits are per model server replica: with ``cluster.nodes`` N and requests spread over the nodes,
a key gets up to N times ``limits.requests_per_second`` in all.
"""

from __future__ import annotations

import contextvars
import json
import re
import time
from typing import Any

from actors.serving import fair_admission, request_stages
from deployments.keys import LOCAL, KeyRing, Principal
from planners.registry import create
from settings import EngineConfig, LimitsConfig


class Unauthenticated(Exception):
    """A principal was read where none was set for the request: refused (401), never taken as local mode."""


class PrincipalVar:
    """The request's principal, set by :class:`RequestGuard`; reading it unset raises :class:`Unauthenticated`."""

    def __init__(self) -> None:
        self._var: contextvars.ContextVar[Principal] = contextvars.ContextVar("coserve_principal")

    def get(self) -> Principal:
        try:
            return self._var.get()
        except LookupError:
            raise Unauthenticated("No principal was established for this request; it is refused.") from None

    def set(self, principal: Principal) -> contextvars.Token[Principal]:
        return self._var.set(principal)

    def reset(self, token: contextvars.Token[Principal]) -> None:
        self._var.reset(token)


PRINCIPAL = PrincipalVar()

# Answered without a key: liveness for load balancers, and the API's own description.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
# Whole-service views: every tenant's adapters and every node's facts. (/metrics answers a tenant's key with its
# own series only: deployments/learning.py.)
ADMIN_PATHS = frozenset({"/v1/status"})
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
# The one route whose body may exceed limits.max_body_bytes: an adapter upload, up to limits.max_adapter_bytes.
UPLOAD_PATH_RE = re.compile(r"^/v1/adapters/.+/versions$")


def body_cap(limits: LimitsConfig, method: str, path: str) -> tuple[int, str]:
    """The largest body a request may send, and the setting that says so (for the 413's message)."""
    if method == "POST" and UPLOAD_PATH_RE.match(path) and limits.max_adapter_bytes > limits.max_body_bytes:
        return limits.max_adapter_bytes, "limits.max_adapter_bytes"
    return limits.max_body_bytes, "limits.max_body_bytes"


class TokenBucket:
    """``rate`` requests per second on average with bursts of up to ``burst``."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.updated = float(burst), time.monotonic()

    def take(self, now: float) -> float:
        """Spend one token: 0.0 if there was one, else the seconds until there will be."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


def error_body(
    status: int, message: str, err_type: str, code: str | int | None = None, param: str | None = None
) -> bytes:
    """An OpenAI-shaped error body (also the front door's own answers, ``deployments/front_door.py``)."""
    return json.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": status if code is None else code}}
    ).encode()


async def send_error(
    send: Any,
    status: int,
    message: str,
    err_type: str,
    code: str | int | None = None,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """A complete OpenAI-shaped JSON error response on a raw ASGI ``send``."""
    body = error_body(status, message, err_type, code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """Pure ASGI middleware (no extra task per request, so context variables reach the handlers)."""

    def __init__(self, app: Any, keys: KeyRing, limits: LimitsConfig) -> None:
        self.app, self.keys, self.limits = app, keys, limits
        # An app's config has ``auto`` derived from its engine already (settings.AppConfig); limits alone, from the
        # engine's defaults.
        engine = EngineConfig()
        held = create("admission", engine.admission, **engine.admission_params).holds
        self.max_concurrent = limits.in_flight_cap(engine.max_num_seqs, held)
        self._buckets: dict[str, TokenBucket] = {}  # one per key that has been used: bounded by the key ring
        self._in_flight: dict[str, int] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"  # the app's own path under a Serve route prefix
        if path in PUBLIC_PATHS:
            PRINCIPAL.set(LOCAL if not self.keys.enabled else Principal(None, False, "anonymous"))
            await self.app(scope, receive, send)
            return
        if self.keys.enabled:
            principal = self.keys.identify(_bearer(scope))
            if principal is None:
                await send_error(
                    send,
                    401,
                    "Missing or unknown API key: send `Authorization: Bearer <key>`.",
                    "invalid_request_error",
                    "invalid_api_key",
                    headers=((b"www-authenticate", b'Bearer realm="coserve"'),),
                )
                return
        else:
            principal = LOCAL  # local mode: the app was started with no keys at all
        if path in ADMIN_PATHS and not principal.admin:
            await send_error(send, 403, f"{path} needs an admin key.", "permission_error", "forbidden")
            return
        if self.keys.enabled and not await self._admit(principal, send):
            return
        try:
            if scope["method"] in _WITH_BODY:
                body = await self._read_body(scope, receive, send, *body_cap(self.limits, scope["method"], path))
                if body is None:
                    return
                receive = _replay(body, receive)
            PRINCIPAL.set(principal)
            # The fair admission in front of the engine queues the request as its tenant's (None: local mode).
            fair_admission.TENANT.set(principal.tenant if self.keys.enabled else None)
            request_stages.mark("guard")
            await self.app(scope, receive, send)
        finally:
            if self.keys.enabled and self.max_concurrent is not None:
                self._in_flight[principal.key_id] -= 1

    async def _admit(self, principal: Principal, send: Any) -> bool:
        """Rate and concurrency caps of the key; answers 429 itself when over either."""
        lim, key = self.limits, principal.key_id
        if lim.requests_per_second is not None:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = TokenBucket(lim.requests_per_second, lim.burst)
            wait = bucket.take(time.monotonic())
            if wait > 0:
                await send_error(
                    send,
                    429,
                    f"Rate limit of {lim.requests_per_second:g} requests/s for this key "
                    f"reached; retry in {wait:.2f} s.",
                    "rate_limit_error",
                    "rate_limit_exceeded",
                    headers=((b"retry-after", str(max(1, round(wait + 0.5))).encode()),),
                )
                return False
        cap = self.max_concurrent
        if cap is not None:
            if self._in_flight.get(key, 0) >= cap:
                await send_error(
                    send,
                    429,
                    f"This key already has {cap} requests in flight (limits.max_concurrent).",
                    "rate_limit_error",
                    "too_many_concurrent_requests",
                    headers=((b"retry-after", b"1"),),
                )
                return False
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
        return True

    async def _read_body(
        self, scope: dict[str, Any], receive: Any, send: Any, cap: int, setting: str = "limits.max_body_bytes"
    ) -> bytes | None:
        """The whole body, or None after answering 413 (never more than ``cap`` is held in memory)."""
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > cap:
                    await self._too_large(send, cap, setting)
                    return None
                break
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                await self._too_large(send, cap, setting)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send: Any, cap: int, setting: str) -> None:
        await send_error(
            send, 413, f"Request body larger than {setting}={cap}.", "invalid_request_error", "request_too_large"
        )


def _bearer(scope: dict[str, Any]) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return bearer_token(value.decode("latin-1"))
    return None


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value, else None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands the buffered body over once, then the client's own messages
    (so handlers still see a disconnect while they stream)."""
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
