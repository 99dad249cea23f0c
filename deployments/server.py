"""ModelServer: the Serve deployment that holds a node's vLLM engine and answers the app's HTTP itself.

One replica per logical node (``cluster.nodes``), each in its own placement group of
``cluster.stages`` bundles (Serve reserves it; the replica takes bundle 0). The replica is the
app's HTTP ingress: its ASGI app is vLLM's own OpenAI server app (``vllm.entrypoints`` ``build_app``,
the one ``vllm serve`` runs) on this replica's engine, plus the app's routes (models, health,
status, learning). With HAProxy in front (``app/serve_env.py``), a request reaches the replica
straight from HAProxy and its streamed tokens go back the same way: one Python process in the
token path, as in ``vllm serve`` and Ray Serve LLM's direct streaming.

The planner is this deployment's deployment-scoped actor: Serve creates it before the replicas,
recreates it if it dies, and removes it with the app. Each replica registers with it as the
replica of node ``rank`` and reports traces and engine facts; the placement router
(``deployments/routing.py``) places requests on nodes from what the planner publishes.
"""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace
from typing import Any

import ray
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import DeploymentActorConfig, RequestRouterConfig

from actors.adapter_files import AdapterFiles
from actors.planner import NAMESPACE
from actors.replica import TASK_ID, ModelReplica
from app.config import AppConfig
from app.engine_args import engine_flags, served_model_name
from deployments.http import install_error_handlers
from deployments.learning import LearningRoutes
from deployments.streams import CoalesceEventStreams
from planners.types import NodeRegistration

logger = logging.getLogger(__name__)

PLANNER = "planner"  # the deployment-scoped actor's name
# vLLM's routes that the app answers its own way: models and health span every node, and /metrics
# shows the planner's and the adapters' facts.
OVERRIDDEN_ROUTES = {"/health", "/v1/models", "/metrics"}


class TaskIdMiddleware:
    """Pure ASGI: the request's ``X-Request-Id`` (HAProxy sets one when the client did not) becomes
    the trace's task id, the id the placement router planned the request under."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            for key, value in scope["headers"]:
                if key == b"x-request-id":
                    TASK_ID.set(value.decode("latin-1"))
                    break
            else:
                TASK_ID.set(None)
        await self.app(scope, receive, send)


@serve.ingress()
class ModelServer:
    """One node's engine and the app's HTTP API (built by :func:`build`)."""

    async def __init__(self, config: AppConfig) -> None:
        from app.default_model import model_dir as resolve_model_dir

        self.cfg = config
        self.node_id = serve.get_replica_context().rank.rank
        model_dir = resolve_model_dir(config)
        self.served_name = served_model_name(config, model_dir)
        self._planner_handle: Any = None
        self.replica = ModelReplica(self.node_id, engine_flags(config, model_dir, self.served_name),
                                    self.served_name, config.engine.omp_threads,
                                    adapter_files=AdapterFiles(config, NAMESPACE))
        await self.replica.start()
        self._guard_requests()
        ctx = ray.get_runtime_context()
        pg = ray.util.get_current_placement_group()
        registration = NodeRegistration(
            node_id=self.node_id, actor_name=ctx.get_actor_name(), pid=os.getpid(), ray_node_id=ctx.get_node_id(),
            placement_group_id=None if pg is None else pg.id.hex(), started_at=time.time())
        # Ready for Serve (and so for HAProxy) only once the planner knows this node and the node
        # serves every adapter version published to it.
        await self.replica.join(self._planner, registration, config.planner.trace_flush_seconds)
        logger.info("node %d serving %s", self.node_id, self.served_name)

    def _planner(self, fresh: bool = False) -> Any:
        if fresh or self._planner_handle is None:
            self._planner_handle = serve.get_deployment_actor(PLANNER)
        return self._planner_handle

    async def _ask_planner(self, method: str, *args: Any) -> Any:
        """``planner.<method>(*args)``; a planner that Serve recreated is looked up again, once."""
        try:
            return await getattr(self._planner(), method).remote(*args)
        except RayActorError:
            return await getattr(self._planner(fresh=True), method).remote(*args)

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
        app.state._state.update(r.state._state)
        # vLLM's engine-error handler flips ``state.server.should_exit`` on the uvicorn server it runs
        # itself; here Serve runs the server and replaces an unhealthy replica through check_health.
        app.state.server = SimpleNamespace()
        # vLLM's build_app builds the middleware stack eagerly; Starlette rebuilds it on the first
        # request once cleared, with the handlers and middleware added below (Ray Serve LLM does the same).
        app.middleware_stack = None
        app.router.routes[:] = [rt for rt in app.router.routes if getattr(rt, "path", None) not in OVERRIDDEN_ROUTES]
        install_error_handlers(app)
        self._install_routes(app)
        LearningRoutes(self.cfg, self._ask_planner).install(app)
        app.add_middleware(TaskIdMiddleware)
        if self.cfg.ingress.stream_batching_ms > 0:
            app.add_middleware(CoalesceEventStreams, interval_s=self.cfg.ingress.stream_batching_ms / 1000)
        return app

    def _install_routes(self, app: FastAPI) -> None:
        call = self._ask_planner

        async def list_models() -> JSONResponse:
            info = await call("models")
            created = int(time.time())
            cards = [{"id": info["base"], "object": "model", "created": created, "owned_by": "coserve",
                      "root": info["root"], "parent": None, "max_model_len": info["max_model_len"]}]
            cards += [{"id": a, "object": "model", "created": created, "owned_by": "coserve",
                       "root": a, "parent": info["base"], "max_model_len": info["max_model_len"]}
                      for a in info["adapters"]]
            return JSONResponse({"object": "list", "data": cards})

        async def health() -> JSONResponse:
            status = await call("status")
            ok = status["ready_nodes"] > 0
            return JSONResponse({"status": "ok" if ok else "unavailable", "ready_nodes": status["ready_nodes"]},
                                status_code=200 if ok else 503)

        async def status() -> JSONResponse:
            return JSONResponse(await call("status"))

        app.add_api_route("/v1/models", list_models, methods=["GET"])
        app.add_api_route("/health", health, methods=["GET"])
        app.add_api_route("/v1/status", status, methods=["GET"])

    def _guard_requests(self) -> None:
        """Checks vLLM's serving classes do not make, wrapped around them once."""
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        lora = self.cfg.engine.enable_lora

        def guarded(create: Any) -> Any:
            async def create_checked(request: Any, raw_request: Any = None) -> Any:
                if not request.model:
                    return create_error_response("`model` is required and must be a string.", param="model")
                if lora and (getattr(request, "prompt_logprobs", None) is not None
                             or (getattr(request, "echo", False) and getattr(request, "logprobs", None) is not None)):
                    # vLLM #16668: prompt logprobs in a LoRA-enabled CPU engine crash the engine for everyone.
                    return create_error_response(
                        "Prompt logprobs (`prompt_logprobs`, or `echo` with `logprobs`) are not supported while "
                        "LoRA is enabled (vLLM #16668).", param="prompt_logprobs")
                return await create(request, raw_request)
            return create_checked

        state = self.replica.state
        if getattr(state, "openai_serving_completion", None) is not None:
            serving = state.openai_serving_completion
            serving.create_completion = guarded(serving.create_completion)
        if getattr(state, "openai_serving_chat", None) is not None:
            serving = state.openai_serving_chat
            serving.create_chat_completion = guarded(serving.create_chat_completion)


def replica_actor_options(cfg: AppConfig) -> dict[str, Any]:
    """The model server replica's share of bundle 0 of its node's placement group."""
    res = cfg.replica_share
    options: dict[str, Any] = {"num_cpus": res.pop("CPU", 0.0), "num_gpus": res.pop("GPU", 0.0)}
    if res:
        options["resources"] = res
    return options


def build(cfg: AppConfig) -> serve.Application:
    """The Serve application for ``cfg``: the model servers, their planner, and (several nodes) the router."""
    from actors.planner import Planner
    from app.serve_env import haproxy_enabled
    from deployments.routing import NodeRequestRouter, PlacementRouter

    haproxy = haproxy_enabled()
    routed = cfg.cluster.nodes > 1
    options: dict[str, Any] = dict(
        num_replicas=cfg.cluster.nodes,
        placement_group_bundles=[dict(cfg.cluster.bundle) for _ in range(cfg.cluster.stages)],
        placement_group_strategy=cfg.cluster.strategy,
        ray_actor_options=replica_actor_options(cfg),
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        logging_config={"enable_access_log": cfg.ingress.access_log},
        deployment_actors=[DeploymentActorConfig(
            name=PLANNER, actor_class=ray.remote(Planner), init_kwargs={"config": cfg},
            actor_options={"num_cpus": 0, "max_concurrency": 10_000})],
    )
    if routed:
        # Under HAProxy the router deployment consults this request router; without HAProxy Serve's
        # Python proxy does (it then sees no Task, and Serve's own pick applies).
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=NodeRequestRouter,
            request_router_kwargs={"poll_s": cfg.planner.trace_flush_seconds})
    server = serve.deployment(ModelServer, name="ModelServer").options(**options).bind(cfg)
    if not haproxy:
        logger.warning("HAProxy is off (%s not set): requests take Serve's Python proxy, one hop more per token; "
                       "start the app with `make serve` or the Serve config's env vars", "RAY_SERVE_ENABLE_HA_PROXY")
        return server
    if not routed:
        return server
    router = serve.deployment(PlacementRouter).options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000,
        logging_config={"enable_access_log": cfg.ingress.access_log}).bind(server, cfg)
    # Internal and unstable in Ray 2.60 (Ray Serve LLM's direct streaming uses it the same way): the one place.
    return server._with_ingress_request_router(router)
