"""ModelServer: the Serve deployment that holds a node's vLLM engine and answers the app's HTTP itself.

One replica per logical node (``cluster.nodes``), each in its own placement group of
``cluster.stages`` bundles (Serve reserves it; the replica takes bundle 0). The replica is the
app's HTTP ingress: its ASGI app is vLLM's own OpenAI server app (``vllm.entrypoints`` ``build_app``,
the one ``vllm serve`` runs) on this replica's engine, plus the app's routes (models, health,
status, learning). With HAProxy in front (``app/serve_env.py``), a request reaches the replica
straight from HAProxy and its streamed tokens go back the same way: one Python process in the
token path, as in ``vllm serve`` and Ray Serve LLM's direct streaming.

A request's path through a replica, in order (each a plain call; a debugger steps through it):

1. ASGI middleware, outermost first (:meth:`ModelServer.__serve_build_asgi_app__`): :class:`StageStamps`
   (arrival), ``RequestGuard`` (key, rate limits, body cap: ``deployments/guard.py``),
   ``CoalesceEventStreams`` (``deployments/streams.py``), then vLLM's own middleware;
2. the route: for completions, chat, tokenize and detokenize the app's checks (the server's ``_checked``
   route runs ``_check_generation`` or ``_check_owner``), then vLLM's own route function, which calls its
   serving class (``OpenAIServingCompletion.create_completion``, ...);
3. the engine: ``TracedEngine.generate`` (``actors/serving/request_traces.py``) records the request under
   the id vLLM built from its ``X-Request-Id``, then vLLM's ``AsyncLLM.generate``.

The planner is this deployment's deployment-scoped actor: Serve creates it before the replicas,
recreates it if it dies, and removes it with the app. Each replica registers with it as the
replica of node ``rank`` and reports traces and engine facts; the placement router
(``deployments/routing.py``) places requests on nodes from what the planner publishes.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

import ray
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import DeploymentActorConfig, RequestRouterConfig

import compat
from actors.control.planner import NAMESPACE
from actors.learning.versions.files import AdapterFiles
from actors.serving import request_stages
from actors.serving.engine_args import engine_flags, served_model_name
from actors.serving.fair_admission import FairAdmission
from actors.serving.messages import NodeRegistration
from actors.serving.replica import ModelReplica
from deployments.guard import PRINCIPAL, RequestGuard
from deployments.http import ServiceUnavailable, install_error_handlers
from deployments.learning import LearningRoutes
from deployments.openapi import install_openapi
from deployments.request_rules import (
    UNKNOWN,
    default_max_tokens,
    default_output_tokens,
    engine_model_for,
    public_model,
    shown_name,
)
from deployments.stored_completions import CompletionRecorder
from deployments.streams import CoalesceEventStreams
from settings import AppConfig

logger = logging.getLogger(__name__)

PLANNER = "planner"  # the deployment-scoped actor's name
# vLLM's routes the app exposes. The others of its OpenAI server (Responses with their stored
# responses, Anthropic messages, SageMaker invocations, batch chat, elastic EP control, ...) are
# not: each would need its own tenant checks, and some change the engine. /health, /v1/models and
# /metrics are the app's own (they span every node and show the planner's and adapters' facts).
VLLM_ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
        "/ping",
        "/version",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
    }
)
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})  # the model's rights and the caps
OWNED_ROUTES = frozenset({"/tokenize", "/detokenize"})  # the model's rights alone (no output, so no caps)


class StageStamps:
    """Pure ASGI, outermost: an inference request's arrival at the replica, and the body bytes sent
    (actors/serving/request_stages.py); the layers between stamp their own stages."""

    PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if scope["type"] != "http" or (path[len(root) :] if root and path.startswith(root) else path) not in self.PATHS:
            await self.app(scope, receive, send)
            return
        stamps = request_stages.begin(*request_stages.from_headers(scope.get("headers") or ()))

        async def stamped_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                last = not message.get("more_body", False)
                if message.get("body") or last:
                    stamps.wrote(last)
            await send(message)

        try:
            await self.app(scope, receive, stamped_send)
        finally:
            stamps.finish()


@serve.ingress()
class ModelServer:
    """One node's engine and the app's HTTP API (built by :func:`build`)."""

    async def __init__(self, config: AppConfig) -> None:
        from actors.models.default_model import model_dir as resolve_model_dir
        from deployments.keys import KeyRing

        self.cfg = config
        self.node_id = serve.get_replica_context().rank.rank
        self.keys = KeyRing.load(config.auth.keys_file, config.auth.keys_env, config.data_path)
        _check_bind(config, self.keys.enabled)
        model_dir = resolve_model_dir(config)
        self.served_name = served_model_name(config, model_dir)
        self._planner_handle: Any = None
        self.replica = ModelReplica(
            self.node_id,
            engine_flags(config, model_dir, self.served_name),
            self.served_name,
            config.engine.omp_threads,
            adapter_files=AdapterFiles(config, NAMESPACE),
            keep_off_engine_cores=(config.engine.device == "cpu" and config.engine.keep_others_off_engine_cores),
            quiet_engine_core=(config.engine.device == "cpu" and config.engine.cpu_executor == "mp"),
        )
        self.learning = LearningRoutes(config, self._ask_planner)
        self.completions = CompletionRecorder(
            config, self.learning.call_store, self.replica.served_version, self.served_name, lambda: model_dir
        )
        await self.replica.start()
        log = request_stages.request_log()
        if log is not None:  # a benchmark's request log: the event loop's stalls go in too
            log.watch_loop()
        self.replica.engine.admission = FairAdmission.from_config(config, self.replica.engine)  # engine.admission
        self._prepare_checks()
        ctx = ray.get_runtime_context()
        pg = ray.util.get_current_placement_group()
        registration = NodeRegistration(
            node_id=self.node_id,
            actor_name=ctx.get_actor_name(),
            pid=os.getpid(),
            ray_node_id=ctx.get_node_id(),
            placement_group_id=None if pg is None else pg.id.hex(),
            started_at=time.time(),
        )
        # Ready for Serve (and so for HAProxy) only once the planner knows this node and the node
        # serves every adapter version published to it.
        await self.replica.join(self._planner, registration, config.planner.trace_flush_seconds)
        logger.info("node %d serving %s", self.node_id, self.served_name)

    def _planner(self, fresh: bool = False) -> Any:
        if fresh or self._planner_handle is None:
            self._planner_handle = serve.get_deployment_actor(PLANNER)
        return self._planner_handle

    async def _ask_planner(self, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """``call(planner)``, e.g. ``lambda p: p.status.remote()``; a planner that Serve recreated is looked up
        again, once. While there is none (Serve recreates it within seconds), :class:`ServiceUnavailable` (503)."""
        try:
            return await call(self._planner())
        except (RayActorError, ValueError):  # ValueError: Serve has no planner of that name right now
            pass
        try:
            return await call(self._planner(fresh=True))
        except (RayActorError, ValueError) as exc:
            logger.warning("planner unavailable: %s", exc)
            raise ServiceUnavailable("The planner is restarting; retry in a few seconds.") from None

    async def _engine_healthy(self) -> bool:
        try:
            await self.replica.check_health()
            return True
        except Exception:
            return False

    def record_replica_metadata(self) -> dict[str, Any]:
        """Published to request routers once: which logical node this replica is."""
        return {"node_id": self.node_id}

    async def check_health(self) -> None:
        await self.replica.check_health()

    def __del__(self) -> None:
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.shutdown()

    # ---- HTTP --------------------------------------------------------------------------------

    async def __serve_build_asgi_app__(self) -> Any:
        from vllm.entrypoints.launchers.app import build_app

        r = self.replica
        app = build_app(r.args, supported_tasks=r.supported_tasks, model_config=r.engine.model_config)
        # vLLM's handlers read their serving objects from the app state that init_app_state filled.
        for key in r.state:
            app.state[key] = r.state[key]
        # vLLM's engine-error handler flips ``state.server.should_exit`` on the uvicorn server it runs
        # itself; here Serve runs the server and replaces an unhealthy replica through check_health.
        app.state.server = SimpleNamespace()
        # vLLM's build_app builds the middleware stack eagerly; Starlette rebuilds it on the first
        # request once cleared, with the handlers and middleware added below (Ray Serve LLM does the same).
        app.middleware_stack = None
        app.router.routes[:] = [rt for rt in app.router.routes if getattr(rt, "path", None) in VLLM_ROUTES]
        for route in list(app.router.routes):
            if route.path in GENERATION_ROUTES | OWNED_ROUTES:
                check = self._check_generation if route.path in GENERATION_ROUTES else self._check_owner
                app.router.routes.remove(route)  # the same route, with the app's checks before vLLM's function
                store = self.completions if route.path in GENERATION_ROUTES else None
                app.add_api_route(
                    route.path,
                    self._checked(route.endpoint, check, store),
                    methods=list(route.methods),
                    dependencies=route.dependencies,
                    responses=route.responses,
                )
        install_error_handlers(app)
        self._install_routes(app)
        self.learning.install(app)
        self.completions.install(app)  # GET and DELETE /v1/chat/completions/{id}
        install_openapi(app, guarded=self.keys.enabled, max_lora_rank=self.cfg.engine.max_lora_rank)
        if self.cfg.ingress.stream_batching_ms > 0:
            app.add_middleware(CoalesceEventStreams, interval_s=self.cfg.ingress.stream_batching_ms / 1000)
        # Nothing runs for a request without a key, over its limits, or with a body over the cap.
        app.add_middleware(RequestGuard, keys=self.keys, limits=self.cfg.limits)
        app.add_middleware(StageStamps)  # outermost: the request's arrival at the replica
        return app

    def _install_routes(self, app: FastAPI) -> None:
        call = self._ask_planner

        async def list_models() -> JSONResponse:
            info = await call(lambda p: p.models.remote())
            created = int(time.time())
            principal = PRINCIPAL.get()
            # The base model's directory is a server path: the admin's card only (a tenant's names the model).
            cards = [
                {
                    "id": info.base,
                    "object": "model",
                    "created": created,
                    "owned_by": "coserve",
                    "root": info.root if principal.admin else info.base,
                    "parent": None,
                    "max_model_len": info.max_model_len,
                }
            ]
            for model in info.adapters:
                key = model.split(":", 1)[1]
                owner = await self.learning.owner(key)
                # An adapter the store does not know was loaded by an operator: admins (and local mode) see it.
                if principal.admin if owner is UNKNOWN else principal.may_use(owner):
                    shown = f"{info.base}:{shown_name(principal, key)}"  # a tenant's own by their bare names
                    cards.append(
                        {
                            "id": shown,
                            "object": "model",
                            "created": created,
                            "owned_by": owner if isinstance(owner, str) else "coserve",
                            "root": shown,
                            "parent": info.base,
                            "max_model_len": info.max_model_len,
                        }
                    )
            return JSONResponse({"object": "list", "data": cards})

        async def health() -> JSONResponse:
            # From what this replica holds, never a call to the planner or the trainer per request: a load
            # balancer's probes must cost the engine nothing, and must not fail while the planner restarts.
            # The node answering is the one HAProxy sent the probe to; it serves iff its engine is healthy.
            if await self._engine_healthy():
                return JSONResponse({"status": "ok", "node": self.node_id})
            return JSONResponse({"status": "unavailable", "node": self.node_id}, status_code=503)

        async def status() -> JSONResponse:
            return JSONResponse(await call(lambda p: p.status.remote()))

        app.add_api_route("/v1/models", list_models, methods=["GET"])
        app.add_api_route("/health", health, methods=["GET"])
        app.add_api_route("/v1/status", status, methods=["GET"])

    def _prepare_checks(self) -> None:
        """What the checks of :meth:`_checked` need from the engine, and the tenant's names in answers.

        Adapter names are scoped by tenant (deployments/learning.py): the engine serves tenant acme's
        ``support`` as the LoRA ``base:acme/support``, which acme calls ``base:support``. The request's
        ``model`` becomes the engine's name in the checks, and the names vLLM writes into answers go back
        to the tenant's here (``OpenAIServingModels.model_name``; vLLM has no hook for it)."""
        state, limits = self.replica.state, self.cfg.limits
        models = state.openai_serving_models
        self._aliases = ", ".join(m.name for m in models.base_model_paths)
        # The output length of a request that names none, per serving class: limits.max_tokens, or less where the
        # model's generation config says less (vLLM's default then), never past the context; vLLM then takes the
        # least of that and the room the prompt leaves (get_max_tokens).
        self._default_caps: dict[str, int] = {}
        for kind in ("openai_serving_completion", "openai_serving_chat"):
            serving = getattr(state, kind, None)
            defaults = (getattr(serving, "default_sampling_params", None) or {}) if serving is not None else {}
            self._default_caps[kind] = default_output_tokens(
                kind == "openai_serving_chat", limits.max_tokens, self.replica.max_model_len, defaults.get("max_tokens")
            )
        base, engine_name = self.served_name, models.model_name
        models.model_name = lambda lora_request=None: public_model(PRINCIPAL.get(), base, engine_name(lora_request))

    @staticmethod
    def _checked(
        vllm_route: Callable[..., Awaitable[Any]],
        check: Callable[[Any], Awaitable[Any]],
        store: CompletionRecorder | None = None,
    ) -> Any:
        """vLLM's route function ``vllm_route``, after ``check(request)``: its refusal (a vLLM ``ErrorResponse``)
        is the answer, as vLLM answers its own; None lets the request (as ``check`` left it) through. With
        ``store``, a request to be stored (deployments/stored_completions.py) is pinned here and its answer kept."""

        @functools.wraps(vllm_route)  # FastAPI reads vLLM's signature: the same body model and validation
        async def route(request: Any, raw_request: Any) -> Any:
            asked = getattr(request, "model", None)
            refused = await check(request)
            if refused is not None:
                return JSONResponse(content=refused.model_dump(), status_code=refused.error.code)
            admitted = None if store is None else await store.admit(request, asked)
            response = await vllm_route(request, raw_request)
            return response if admitted is None else await admitted.record(response)

        return route

    async def _engine_model(self, model: str) -> str | None:
        models = self.replica.state.openai_serving_models
        return await engine_model_for(
            PRINCIPAL.get(), model, self.served_name, self.learning.owner, models.lora_requests
        )

    def _not_found(self, request: Any) -> Any:
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        # Word for word what vLLM answers for a model it does not have, with the name the client sent.
        return create_error_response(
            f"The model `{request.model}` does not exist. Valid aliases: {self._aliases}.",
            err_type="NotFoundError",
            status_code=HTTPStatus.NOT_FOUND,
            param="model",
        )

    async def _check_owner(self, request: Any) -> Any:
        """Tokenize and detokenize: the tenant may use the model it names, which becomes the engine's name."""
        if request.model:
            model = await self._engine_model(request.model)
            if model is None:
                return self._not_found(request)
            request.model = model
        return None

    async def _check_generation(self, request: Any) -> Any:
        """Completions and chat: the tenant's rights on the model, the request caps (``limits``, and
        ``limits.max_tokens`` as the default output length) and the tenant's prefix-cache salt."""
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        if not request.model:
            return create_error_response("`model` is required and must be a string.", param="model")
        model = await self._engine_model(request.model)
        if model is None:
            return self._not_found(request)
        request.model = model
        chat = "max_completion_tokens" in type(request).model_fields
        default_max_tokens(request, self._default_caps["openai_serving_chat" if chat else "openai_serving_completion"])
        why = refusal(request, self.cfg.limits)
        if why is not None:
            return create_error_response(why)
        if self.cfg.engine.enable_lora and (
            getattr(request, "prompt_logprobs", None) is not None
            or (getattr(request, "echo", False) and getattr(request, "logprobs", None) is not None)
        ):
            # vLLM #16668: prompt logprobs in a LoRA-enabled CPU engine crash the engine for everyone.
            return create_error_response(
                "Prompt logprobs (`prompt_logprobs`, or `echo` with `logprobs`) are not supported while "
                "LoRA is enabled (vLLM #16668).",
                param="prompt_logprobs",
            )
        # Never the client's: a chosen salt could probe another tenant's cached prefixes.
        request.cache_salt = PRINCIPAL.get().cache_salt
        request_stages.mark("checked")
        return None


def refusal(request: Any, limits: Any) -> str | None:
    """Why ``request`` is over a cap of ``limits`` (the message of a 400), or None."""
    n = getattr(request, "n", 1) or 1
    prompt = getattr(request, "prompt", None)
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    if n * prompts > limits.max_n:
        return f"n={n} choices for {prompts} prompt(s) exceeds limits.max_n={limits.max_n} per request."
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of > limits.max_best_of:
        return f"best_of={best_of} exceeds limits.max_best_of={limits.max_best_of}."
    for field in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, field, None)
        if value is not None and value > limits.max_tokens:
            return f"{field}={value} exceeds limits.max_tokens={limits.max_tokens}."
    for field in ("logprobs", "top_logprobs"):
        value = getattr(request, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= limits.max_logprobs:
            return f"{field}={value} is outside 0..limits.max_logprobs={limits.max_logprobs}."
    return None


def _check_bind(cfg: AppConfig, keys_enabled: bool) -> None:
    """Refuse to start (the deploy fails with the reason) where :func:`deployments.keys.bind_refusal` says so."""
    from deployments.keys import bind_refusal

    host = compat.serve_http_host() or "127.0.0.1"
    refusal = bind_refusal(host, keys_enabled, cfg.auth.allow_unauthenticated_bind)
    if refusal is not None:
        raise RuntimeError(refusal)
    if keys_enabled:
        logger.info("API keys configured: serving on %s", host)
    else:
        logger.warning(
            "No API keys configured (auth.keys_file / $%s): every client on %s has every right; add keys "
            'before binding another address (README "Security")',
            cfg.auth.keys_env,
            host,
        )


def replica_actor_options(cfg: AppConfig) -> dict[str, Any]:
    """The model server replica's share of bundle 0 of its node's placement group."""
    res = cfg.replica_share
    options: dict[str, Any] = {"num_cpus": res.pop("CPU", 0.0), "num_gpus": res.pop("GPU", 0.0)}
    if res:
        options["resources"] = res
    return options


def haproxy_enabled() -> bool:
    """Whether this process's Ray Serve runs HAProxy with direct ingress (``app/serve_env.py`` turns it on;
    read here as Serve reads it)."""
    return compat.haproxy_enabled()


def build(cfg: AppConfig) -> serve.Application:
    """The Serve application for ``cfg``: the model servers, their planner, and (several nodes) the router."""
    from actors.control.planner import Planner
    from deployments.routing import NodeRequestRouter, PlacementRouter

    haproxy = haproxy_enabled()
    routed = cfg.cluster.nodes > 1
    options: dict[str, Any] = dict(
        num_replicas=cfg.cluster.nodes,
        placement_group_bundles=[dict(cfg.cluster.bundle) for _ in range(cfg.cluster.stages)],
        placement_group_strategy=cfg.cluster.strategy,
        ray_actor_options=replica_actor_options(cfg),
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        health_check_period_s=cfg.cluster.health_check_period_s,
        logging_config={"enable_access_log": cfg.ingress.access_log},
        deployment_actors=[
            DeploymentActorConfig(
                name=PLANNER,
                actor_class=ray.remote(Planner),
                init_kwargs={"config": cfg},
                actor_options={"num_cpus": 0, "max_concurrency": 10_000},
            )
        ],
    )
    if routed:
        # Under HAProxy the router deployment consults this request router; without HAProxy Serve's
        # Python proxy does (it then sees no Task, and Serve's own pick applies).
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=NodeRequestRouter, request_router_kwargs={"poll_s": cfg.planner.trace_flush_seconds}
        )
    server = serve.deployment(ModelServer, name="ModelServer").options(**options).bind(cfg)
    if not haproxy:
        logger.warning(
            "HAProxy is off (%s not set): requests take Serve's Python proxy, one hop more per token; "
            "start the app with `make serve` or the Serve config's env vars",
            "RAY_SERVE_ENABLE_HA_PROXY",
        )
        return server
    if not routed:
        return server
    router = (
        serve.deployment(PlacementRouter)
        .options(
            ray_actor_options={"num_cpus": 0},
            max_ongoing_requests=10_000,
            logging_config={"enable_access_log": cfg.ingress.access_log},
        )
        .bind(server, cfg)
    )
    # Internal and unstable in Ray 2.60 (Ray Serve LLM's direct streaming uses it the same way).
    return compat.with_ingress_request_router(server, router)
