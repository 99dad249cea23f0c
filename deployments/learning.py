"""HTTP routes for learning: adapters (create, list, show, change, roll back, promote), feedback and ``/metrics``.

A version's files (upload one, download one) are deployments/adapter_files.py's, installed with these.

Bodies go to the feedback store's own validation (actors/learning/store/sqlite.py) through the one actor
that owns it; each kind of its errors maps to one HTTP status here, and a 2xx on feedback means the whole batch
is durably stored.

Tenancy: every adapter belongs to the tenant whose key created it (or the one an admin named).
A tenant's key sees, changes, trains and calls only its own adapters; another tenant's adapter
answers 404, exactly as one that does not exist. Names are scoped by tenant: the store keys a
tenant's adapter ``tenant/name`` (``adapter_key``), so two tenants may each own ``support`` and a
name another tenant took is no conflict (a 409 would tell that it exists). A tenant names its own
adapters by their bare names, in routes, bodies and ``model`` (``base:support``); the admin key (and
local mode) names keys (``acme/support``; the bare name of an adapter without a tenant or the
admin's own); a create names the tenant in ``tenant``, as before. The owner of a key never changes, so each model
server keeps the owners it has looked up.
No server path reaches a tenant: versions are shown to it without their ``path``, and the data and
model directories are cut out of the reasons it reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError
from ray.exceptions import RayActorError, RayTaskError

from actors.learning.lora.targets import lora_targetable_modules, short_names, unknown_targets
from actors.learning.store.feedback_items import idempotency_key_problem
from actors.learning.store.models import (
    ADAPTER_KEY_RE,
    ALL_LINEAR,
    KIND_FOR_METHOD,
    AdapterExists,
    AdapterQuotaExceeded,
    AdapterSpec,
    Conflict,
    IdempotencyKeyReused,
    InvalidRequest,
    StoreError,
    TrainingQuotaExceeded,
    UnknownAdapter,
    UnknownItem,
    UnknownVersion,
    adapter_key,
    pydantic_error,
    pydantic_param,
)
from actors.learning.store.records import AdapterInfo
from actors.learning.store.schema import IDEMPOTENCY_TTL_S
from actors.learning.store.unit_kind import unit_kind
from actors.models.default_model import model_path
from actors.serving.engine_args import served_model_name
from deployments.adapter_files import AdapterFileRoutes
from deployments.guard import PRINCIPAL
from deployments.http import BadRequest, ServiceUnavailable, error, internal_error, json_body
from deployments.request_rules import UNKNOWN, adapter_key_for, as_seen_by, shown_name
from planners.types import NewFeedback
from settings import AppConfig

logger = logging.getLogger("ray.serve")

# How long a route waits for the planner to act on a change the store has already committed (load a
# rolled-back version, note a PATCH). Past it, or with the planner away, the route answers the
# committed state anyway: a restarted planner reloads every adapter's current version from the store.
PLANNER_AFTER_COMMIT_TIMEOUT_S = 60.0
# A feedback request without an Idempotency-Key gets a key of its own, so the resends within that one
# request (Ray's task retries of the store call, the re-lookup after a store restart) store it once.
# Those happen within seconds; only a client's own key must outlive a client's retries (24 h).
REQUEST_KEY_TTL_S = 600.0

# The store's refusals as HTTP answers: (status, OpenAI error type).
STORE_ERRORS: dict[type[StoreError], tuple[int, str]] = {
    InvalidRequest: (400, "invalid_request_error"),
    UnknownAdapter: (404, "not_found_error"),
    UnknownVersion: (404, "not_found_error"),
    UnknownItem: (404, "not_found_error"),
    Conflict: (409, "conflict_error"),
    IdempotencyKeyReused: (422, "idempotency_error"),
    # A count limit: 403, not 429, whose Retry-After would say that waiting helps; not 409 either, which
    # says the request clashes with one resource (its name) rather than with the tenant's allowance.
    AdapterQuotaExceeded: (403, "permission_error"),
    # A daily allowance: waiting (until the UTC day ends) does help, so 429 with Retry-After.
    TrainingQuotaExceeded: (429, "rate_limit_error"),
}


def store_error_status(exc: StoreError) -> tuple[int, str]:
    """The HTTP status and error type of a store error (its nearest mapped class; 500 if none)."""
    for kind in type(exc).__mro__:
        if kind in STORE_ERRORS:
            return STORE_ERRORS[kind]
    return 500, "internal_error"


async def _store_error(_: Request, exc: StoreError) -> JSONResponse:
    """A feedback-store error raised inside its actor: Ray re-raises it as a subclass of the original
    whose ``str`` is the remote traceback, so the message comes from the original (``cause``)."""
    cause = getattr(exc, "cause", exc)
    if not isinstance(cause, StoreError):
        cause = exc
    status, err_type = store_error_status(cause)
    answer = error(status, as_seen_by(PRINCIPAL.get(), str(cause)), getattr(cause, "param", None), err_type=err_type)
    if isinstance(cause, TrainingQuotaExceeded):
        answer.headers["Retry-After"] = str(cause.retry_after_s)
    return answer


async def _ray_task_error(request: Request, exc: RayTaskError) -> JSONResponse:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, StoreError):
        return await _store_error(request, cause)
    return internal_error(request, exc)


class RetentionView(BaseModel):
    """How the served version keeps the base model's answers to the gate's retention set (issue 37)."""

    version: int = Field(description="The served version these numbers are of.")
    score: float = Field(description="Its mean log-likelihood per token of the base model's answers.")
    base: float = Field(description="The base model's own score of them.")
    lost: float = Field(description="base - score: what the version lost (the gate rejects more than margin).")
    margin: float = Field(description="gate.retention_margin in effect.")
    prompts: int | None = Field(description="Prompts of the retention set.")


class AdapterView(AdapterInfo):
    """An adapter as ``/v1/adapters`` answers it: its name as the caller names it, and the model requests name."""

    model: str = Field(description="What a request's `model` names to be served by this unit's current version.")
    retention: RetentionView | None = Field(
        None, description="The served version's retention check; null before a scored version is served."
    )


class LearningRoutes:
    """The learning API of one model server; ``ask_planner(lambda planner: planner.<method>.remote(...))`` calls the planner actor."""

    def __init__(self, cfg: AppConfig, ask_planner: Callable[..., Awaitable[Any]]) -> None:
        self.cfg = cfg
        self.ask_planner = ask_planner
        # The base model's id, as the planner and the replicas derive it, without asking the planner.
        self.base = served_model_name(cfg, model_path(cfg))
        self.planner_timeout_s = PLANNER_AFTER_COMMIT_TIMEOUT_S
        self._store = None
        self._owners: dict[str, str | None] = {}  # adapter key -> tenant (None: made without keys)
        # Server paths a tenant must not read in a reason (a version that failed to load names its files).
        roots = {str(cfg.data_path), str(model_path(cfg)), cfg.storage.adapters_uri or ""}
        self._server_paths = sorted((r.rstrip("/") for r in roots if len(r.rstrip("/")) > 1), key=len, reverse=True)
        self._counter: Any = None  # the model's tokenizer, loaded with the first per_node feedback

    def _sizes(self, items: list[Any]) -> list[NewFeedback]:
        """Each item's adapter and tokens, for the planner to place it as a training task (LEMIX Eq. 1–3)."""
        if self._counter is None:
            from actors.models.default_model import model_dir
            from deployments.prompt_tokens import PromptCounter

            self._counter = PromptCounter(model_dir(self.cfg))
        return [
            NewFeedback(
                it.get("adapter") if isinstance(it, dict) and isinstance(it.get("adapter"), str) else None,
                self._counter.feedback_tokens(it, self.cfg.training.max_length),
            )
            for it in items
        ]

    def install(self, app: FastAPI) -> None:
        app.add_exception_handler(StoreError, _store_error)
        app.add_exception_handler(RayTaskError, _ray_task_error)
        r = APIRouter()
        r.add_api_route("/v1/adapters", self.create_adapter, methods=["POST"], status_code=201)
        r.add_api_route("/v1/adapters", self.list_adapters, methods=["GET"])
        # {name:path}: the admin names a tenant's adapter by its key, "acme/support" (OpenAPI shows {name}).
        r.add_api_route("/v1/adapters/{name:path}/rollback", self.rollback_adapter, methods=["POST"])
        r.add_api_route("/v1/adapters/{name:path}/promote", self.promote_adapter, methods=["POST"])
        # Upload and download of a version's files (deployments/adapter_files.py), before GET {name:path}.
        self.files = AdapterFileRoutes(self)
        self.files.install(r)
        r.add_api_route("/v1/adapters/{name:path}", self.show_adapter, methods=["GET"])
        r.add_api_route("/v1/adapters/{name:path}", self.update_adapter, methods=["PATCH"])
        r.add_api_route("/v1/feedback", self.feedback, methods=["POST"], status_code=202)
        r.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.include_router(r)

    async def call_store(self, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """``call(store)`` on the feedback store's actor, looked up again once if it was restarted."""
        for attempt in range(2):
            if self._store is None:
                self._store = await self._find_store()
            try:
                return await call(self._store)
            except RayActorError:
                # The store is restarting (Ray restarts it on the same node with the same database).
                self._store = None
                if attempt == 1:
                    raise ServiceUnavailable("The feedback store is restarting; retry in a few seconds.") from None
        raise AssertionError("unreachable")

    async def call_store_once(self, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """``call(store)`` on the feedback store's actor once, never resent (a resent write could apply twice):
        a store that died meanwhile forgets the handle and raises ``RayActorError`` for the caller to answer."""
        if self._store is None:
            self._store = await self._find_store()
        try:
            return await call(self._store)
        except RayActorError:
            self._store = None
            raise

    async def _find_store(self) -> Any:
        """The feedback store's actor, by its name, so that storing needs no planner (it may be restarting);
        the planner, which starts the store, only while there is none of that name yet."""
        import ray

        from actors.control.planner import NAMESPACE

        try:
            return await asyncio.to_thread(ray.get_actor, self.cfg.store_actor_name, namespace=NAMESPACE)
        except ValueError:
            return await self.ask_planner(lambda p: p.feedback_store.remote())

    async def owner(self, adapter: str) -> str | None | object:
        """The tenant that owns the adapter keyed ``adapter`` (None: made without keys), or :data:`UNKNOWN`."""
        if adapter in self._owners:
            return self._owners[adapter]
        if not ADAPTER_KEY_RE.match(adapter):
            return UNKNOWN
        try:
            owner = await self.call_store(lambda store: store.adapter_tenant.remote(adapter))
        except (UnknownAdapter, RayTaskError) as exc:
            # Ray re-raises the store's error as a RayTaskError that carries it as ``cause``.
            if not isinstance(getattr(exc, "cause", exc), UnknownAdapter):
                raise
            return UNKNOWN
        self._owners[adapter] = owner
        return owner

    async def resolve(self, name: str) -> str:
        """The store's key of the adapter the request names ``name`` (:func:`adapter_key_for`); 404 (as if
        absent) unless the request's principal may use it."""
        principal = PRINCIPAL.get()
        key = adapter_key_for(principal, name)
        owner = UNKNOWN if key is None else await self.owner(key)
        if owner is UNKNOWN and principal.admin:
            return key  # the store's own answer (404, or 400 for a malformed name)
        if owner is UNKNOWN or not principal.may_use(owner):
            raise UnknownAdapter(f"no adapter named {name!r}")
        return key

    async def tell_planner(self, what: str, call: Callable[[Any], Awaitable[Any]]) -> bool:
        """``ask_planner(call)`` after the store committed a change: best effort. A planner that is away
        (restarting, dead, or not answering within ``planner_timeout_s``) must not turn a stored change
        into an error; the replicas catch up when it is back. Whether the planner confirmed."""
        try:
            await asyncio.wait_for(self.ask_planner(call), self.planner_timeout_s)
            return True
        except (TimeoutError, ServiceUnavailable, RayActorError) as exc:
            logger.warning(
                "%s is stored, but the planner did not take it (%s: %s); the replicas catch up when it is back",
                what,
                type(exc).__name__,
                exc,
            )
            return False

    def _adapter_view(self, info: AdapterInfo) -> AdapterView:
        """An adapter as the request's principal sees it: a tenant by its bare name, an admin with its paths."""
        principal = PRINCIPAL.get()
        name = shown_name(principal, info.name)
        shown = (lambda text: text) if principal.admin else self.without_paths
        versions = [v.model_copy(update={"adapter": name, "reason": shown(v.reason)}) for v in info.versions]
        served = next((v for v in info.versions if v.version == info.current_version), None)
        retention = (
            None
            if served is None or served.retention is None or served.retention_base is None
            else RetentionView(
                version=served.version,
                score=served.retention,
                base=served.retention_base,
                lost=served.retention_base - served.retention,
                margin=info.gate.retention_margin,
                prompts=served.retention_prompts,
            )
        )
        return AdapterView(
            **{**dict(info), "name": name, "versions": versions, "paused_reason": shown(info.paused_reason)},
            model=unit_kind(info.method).model_name(self.base, name),
            retention=retention,
        )

    def _adapter_json(self, info: AdapterInfo) -> dict[str, Any]:
        """The JSON of :meth:`_adapter_view`; a tenant's has no server path (no version's ``path``)."""
        admin = PRINCIPAL.get().admin
        return self._adapter_view(info).model_dump(exclude=None if admin else {"versions": {"__all__": {"path"}}})

    def without_paths(self, text: str | None) -> str | None:
        """``text`` with the server's data, model and adapter locations cut to ``<server path>``."""
        if text:
            for root in self._server_paths:
                text = text.replace(root, "<server path>")
        return text

    async def create_adapter(self, request: Request) -> Response:
        body = await json_body(request)
        if not isinstance(body, dict):
            raise BadRequest("Request body must be a JSON object.")
        principal = PRINCIPAL.get()
        method = body.get("method")
        # [] or {} or an unknown method: the spec's 400 below.
        kind = unit_kind(method) if isinstance(method, str) and method in KIND_FOR_METHOD else None
        if kind is not None and kind.admin_only and not principal.admin:
            # A full unit retrains the model every tenant is served: the operator's decision, not a tenant's.
            return error(
                403,
                f"a {kind.methods_named} unit changes the model every tenant is served; "
                "only an admin key may create one",
                "method",
            )
        if kind is not None and self.cfg.cluster.stages < kind.min_stages:
            raise BadRequest(
                f"method {method!r} trains the model on a pipeline of cluster.stages >= {kind.min_stages} "
                f"bundles; this deployment has cluster.stages={self.cfg.cluster.stages}",
                "method",
            )
        if "tenant" in body:
            if not principal.admin and body["tenant"] != principal.tenant:
                raise BadRequest("`tenant`: only an admin key may create adapters for another tenant.", "tenant")
        elif principal.tenant is not None:
            body = {**body, "tenant": principal.tenant}
        try:
            spec = AdapterSpec.model_validate(body)
        except ValidationError as exc:
            errors = exc.errors()
            raise InvalidRequest(
                [pydantic_error("adapter", e) for e in errors], param=pydantic_param(errors[0])
            ) from None
        if unit_kind(spec.method).uses_lora_settings:
            await self._check_lora(spec)
        info = await self._create(spec, adapter_key(spec.tenant, spec.name))
        return JSONResponse(self._adapter_json(info), status_code=201)

    async def _check_lora(self, spec: AdapterSpec) -> None:
        """400 for LoRA settings the engine cannot serve: a rank over ``engine.max_lora_rank``, or a target
        module the served model does not have (checked as peft matches names: actors/learning/lora/targets.py)."""
        limit, lora = self.cfg.engine.max_lora_rank, spec.lora
        if lora.r > limit:
            raise BadRequest(f"lora.r={lora.r} exceeds the engine's max_lora_rank={limit}", "lora.r")
        if lora.target_modules == ALL_LINEAR:
            return
        modules = await self._lora_modules()
        unknown = [] if modules is None else unknown_targets(lora.target_modules, modules)
        if unknown:
            raise BadRequest(
                f"lora.target_modules: {unknown} name no module of {self.base}; LoRA can target "
                f"{', '.join(short_names(modules))} (a module's name or its last parts, as peft "
                f'matches them), or "{ALL_LINEAR}"',
                "lora.target_modules",
            )

    async def _lora_modules(self) -> frozenset[str] | None:
        """The served model's LoRA-targetable module names (built once per process, off the event loop);
        None if its module tree cannot be built here (then the trainer is the one to refuse a bad name)."""
        from actors.models.default_model import model_dir

        try:
            return await asyncio.to_thread(lambda: lora_targetable_modules(model_dir(self.cfg)))
        except Exception as exc:  # an architecture transformers cannot build from its config alone
            logger.warning(
                "cannot list the modules of %s, so lora.target_modules is not checked: %s: %s",
                self.base,
                type(exc).__name__,
                exc,
            )
            return None

    async def _create(self, spec: AdapterSpec, key: str) -> AdapterInfo:
        """Create in the store. The store's actor takes no task retries for a create (a resent one would
        answer 409 for the caller's own adapter), so a store that died meanwhile reaches ``call_store``, which
        sends it once more; if that answers "exists" with this very spec, made a moment ago, it is this
        request's adapter, committed before the store died, and the answer is 201."""
        calls = 0

        def create(store: Any) -> Any:
            nonlocal calls
            calls += 1
            return store.create_adapter.remote(spec)

        try:
            return await self.call_store(create)
        except (AdapterExists, RayTaskError) as exc:
            if calls < 2 or not isinstance(getattr(exc, "cause", exc), AdapterExists):
                raise
            info = await self.call_store(lambda store: store.get_adapter.remote(key))
            # The stored gate is the effective one; the stored name is the key (its tenant's and name's).
            fields = set(AdapterSpec.model_fields) - {"gate", "name"}
            if info.model_dump(include=fields) != spec.model_dump(include=fields) or time.time() - info.created_at > 60:
                raise
            return info

    async def list_adapters(self) -> JSONResponse:
        principal = PRINCIPAL.get()
        adapters = [
            a for a in await self.call_store(lambda store: store.list_adapters.remote()) if principal.may_use(a.tenant)
        ]
        return JSONResponse({"object": "list", "data": [self._adapter_json(i) for i in adapters]})

    async def show_adapter(self, name: str) -> Response:
        key = await self.resolve(name)
        info = await self.call_store(lambda store: store.get_adapter.remote(key))
        return JSONResponse(self._adapter_json(info))

    async def update_adapter(self, name: str, request: Request) -> Response:
        """Change how the adapter trains from now on (mode, learning_rate, beta, periodic, gate, paused); 400 else."""
        key = await self.resolve(name)
        body = await json_body(request)
        if not isinstance(body, dict):
            raise BadRequest("Request body must be a JSON object.")
        info = await self.call_store(lambda store: store.update_adapter.remote(key, body))
        await self.tell_planner(f"PATCH of adapter {key!r}", lambda p: p.adapter_changed.remote(key))
        return JSONResponse(self._adapter_json(info))

    async def rollback_adapter(self, name: str, request: Request) -> Response:
        """Serve an earlier version that was served before; 409 for a rejected or candidate one (promote it).
        A full unit also takes ``version`` 0: the model the deployment started with."""
        return await self._serve_version(name, request, "rollback")

    async def promote_adapter(self, name: str, request: Request) -> Response:
        """Serve any published version now (e.g. one the quality gate rejected); resumes a paused adapter."""
        return await self._serve_version(name, request, "promote")

    async def _serve_version(self, name: str, request: Request, how: str) -> Response:
        name = await self.resolve(name)  # the store's key from here on
        body = await json_body(request)
        version = body.get("version") if isinstance(body, dict) else None
        lowest = 0 if how == "rollback" else 1  # the store answers 400 for version 0 of an adapter
        if not isinstance(version, int) or isinstance(version, bool) or not lowest <= version < 2**63:
            raise BadRequest("`version` (a positive integer) is required.", "version")
        if isinstance(body, dict) and set(body) != {"version"}:
            raise BadRequest(f"unexpected keys beside `version`: {sorted(set(body) - {'version'})}")
        info = await self.call_store(
            lambda store: (store.rollback if how == "rollback" else store.promote).remote(name, version)
        )
        # From here on the change is committed: the answer is the stored state, whatever the planner does.
        # The target's path and node come with the answer (versions are immutable once published).
        target = next((v for v in info.versions if v.version == version), None)
        what = f"{how} of {name!r} to v{version}"
        update = unit_kind(info.method).planner_update(name, version, target)
        if update is not None:
            await self.tell_planner(what, update)
        return JSONResponse(self._adapter_json(info))

    async def metrics(self) -> Response:
        from deployments.metrics import CONTENT_TYPE_LATEST, render, render_tenant

        engines = await self.ask_planner(lambda p: p.engine_metrics.remote())
        principal = PRINCIPAL.get()
        status = await self.ask_planner(lambda p: p.status.remote())
        if not principal.admin:  # a tenant's key: its own series, nobody else's
            return Response(
                render_tenant(engines, principal.tenant or "", status.get("tenants")), media_type=CONTENT_TYPE_LATEST
            )
        adapters = [a.model_dump() for a in await self.call_store(lambda store: store.list_adapters.remote())]
        return Response(render(status, adapters, engines), media_type=CONTENT_TYPE_LATEST)

    async def feedback(self, request: Request) -> Response:
        """Store a batch of feedback items; 202 ``{"ids", "accepted"}`` once every item is durable.

        ``Idempotency-Key`` (header, optional, 1-255 printable ASCII characters, else 400): the same key
        from the same tenant within 24 h stores nothing and answers the first request's 202 and ids
        again (with ``Idempotent-Replayed: true``); the same key with other items answers 422. A client
        or a proxy that resends a request whose answer it lost (HAProxy resends a POST to another
        replica when the first died before answering) therefore stores it once.
        """
        key = request.headers.get("idempotency-key")
        if key is not None and (problem := idempotency_key_problem(key)):
            raise BadRequest(problem, "Idempotency-Key")
        body = await json_body(request)
        # One item, a list of items, or {"items": [...]}.
        if isinstance(body, dict) and "items" in body:
            if set(body) != {"items"}:
                raise BadRequest(f"unexpected keys beside `items`: {sorted(set(body) - {'items'})}")
            items = body["items"]
        else:
            items = body
        if not isinstance(items, (list, dict)):
            raise BadRequest('Body must be an item, a list of items, or {"items": [...]}.', "items")
        listed = items if isinstance(items, list) else [items]
        if len(listed) > self.cfg.limits.feedback_max_items:
            raise BadRequest(
                f"{len(listed)} items, at most limits.feedback_max_items="
                f"{self.cfg.limits.feedback_max_items} per request.",
                "items",
            )
        keys = {}  # feedback only to the tenant's own adapters (others do not exist), under the store's keys
        for name in {it.get("adapter") for it in listed if isinstance(it, dict) and isinstance(it.get("adapter"), str)}:
            keys[name] = await self.resolve(name)
        if any(key != name for name, key in keys.items()):
            listed = [
                {**it, "adapter": keys[it["adapter"]]}
                if isinstance(it, dict) and isinstance(it.get("adapter"), str)
                else it
                for it in listed
            ]
            items = listed if isinstance(items, list) else listed[0]
        tenant, ttl = PRINCIPAL.get().tenant, None
        refs = None
        if any(isinstance(it, dict) and "completion_id" in it for it in listed):
            # Feedback by id: each such item becomes the item it stands for, on the stored prompt (the tenant's own
            # completions only; another tenant's id is a 404 as a missing one).
            days = self.cfg.limits.store_completions_days
            listed, refs = await self.call_store(lambda store: store.resolve_feedback_refs.remote(listed, tenant, days))
            items = listed if isinstance(items, list) else listed[0]
        per_day = self.cfg.limits.training_tokens_per_day
        sizes = None
        if per_day is not None or self.cfg.training.scope_rules.routes_feedback:
            # Each item's training tokens, as the trainer cuts them (tokenizing is CPU work: off the event loop).
            sizes = await asyncio.to_thread(self._sizes, listed)
        nodes = None
        if self.cfg.training.scope_rules.routes_feedback:  # per_node: each node's copy trains on the items placed on it
            nodes = await self.ask_planner(lambda p: p.feedback_nodes.remote(sizes))
        if key is None:
            key, ttl = f"request-{uuid.uuid4().hex}", REQUEST_KEY_TTL_S
        tokens = None if sizes is None else [s.tokens for s in sizes]
        receipt = await self.call_store(
            lambda store: store.submit_feedback.remote(
                items,
                nodes,
                idempotency_key=key,
                tenant=tenant,
                key_ttl_s=IDEMPOTENCY_TTL_S if ttl is None else ttl,
                refs=refs,
                tokens=tokens,
                tokens_per_day=per_day,
            )
        )
        # Only a client's own key is a replay the client asked for; a request key replays Ray's resend.
        replayed = {"Idempotent-Replayed": "true"} if receipt.replayed and ttl is None else None
        return JSONResponse({"ids": receipt.ids, "accepted": len(receipt.ids)}, status_code=202, headers=replayed)
