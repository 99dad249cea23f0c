"""OpenAI-compatible HTTP ingress: translates HTTP to planner and replica calls, nothing more.

Request validation, sampling and response encoding happen in the replica, with vLLM's own
OpenAI protocol models and serving classes; this deployment only parses JSON, asks the planner
where the request runs, and forwards the replica's response pieces unchanged (SSE lines or one
JSON body), so no per-token re-encoding happens here.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

import ray
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError

from app.config import AppConfig
from deployments.http import api, error, json_body
from deployments.learning import LearningRoutes
from planners.types import Task

logger = logging.getLogger(__name__)


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A cheap size hint for placement; the replica's tokenizer gives the exact count later."""
    prompt = body.get("prompt")
    if prompt is None:
        prompt = [m.get("content", "") for m in body.get("messages") or [] if isinstance(m, dict)]
    return max(1, len(json.dumps(prompt, ensure_ascii=False)) // 4)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class OpenAIIngress(LearningRoutes):
    def __init__(self, config: dict[str, Any]) -> None:
        from actors.planner import Planner
        from app.default_model import ensure

        self.cfg = AppConfig.model_validate(config)
        model_dir = self.cfg.model.path or str(ensure(self.cfg.data_path))
        self.namespace = "coserve"
        self.planner = ray.remote(Planner).options(
            name=self.cfg.planner_actor_name, namespace=self.namespace, get_if_exists=True,
            num_cpus=0, max_concurrency=10_000,
        ).remote(self.cfg.model_dump(), model_dir, self.namespace)
        # Idempotent: with several ingress replicas only the first call reserves the nodes.
        self._start = self.planner.start.remote()
        self._replicas: dict[int, Any] = {}
        self._feedback = None

    async def _replica(self, node_id: int) -> Any:
        if node_id not in self._replicas:
            self._replicas = await self.planner.replicas.remote()
        return self._replicas[node_id]

    # ---- OpenAI endpoints ------------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    @api.get("/v1/models")
    async def list_models(self) -> JSONResponse:
        info = await self.planner.models.remote()
        created = int(time.time())
        cards = [{"id": info["base"], "object": "model", "created": created, "owned_by": "coserve",
                  "root": info["root"], "parent": None, "max_model_len": info["max_model_len"]}]
        cards += [{"id": a, "object": "model", "created": created, "owned_by": "coserve",
                   "root": a, "parent": info["base"], "max_model_len": info["max_model_len"]}
                  for a in info["adapters"]]
        return JSONResponse({"object": "list", "data": cards})

    @api.get("/health")
    async def health(self) -> JSONResponse:
        status = await self.planner.status.remote()
        ok = status["ready_nodes"] > 0
        return JSONResponse({"status": "ok" if ok else "unavailable", "ready_nodes": status["ready_nodes"]},
                            status_code=200 if ok else 503)

    @api.get("/v1/status")
    async def status(self) -> JSONResponse:
        return JSONResponse(await self.planner.status.remote())

    # ---- the request path ------------------------------------------------------------------

    async def _generate(self, request: Request, method: str) -> Response:
        body = await json_body(request)
        if not isinstance(body, dict):
            return error(400, "Request body must be a JSON object.")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return error(400, "`model` is required and must be a string.", "model")
        if self.cfg.engine.enable_lora and (body.get("prompt_logprobs") is not None
                                            or (body.get("echo") and body.get("logprobs") is not None)):
            # vLLM #16668: prompt logprobs in a LoRA-enabled CPU engine crash the engine for everyone.
            return error(400, "Prompt logprobs (`prompt_logprobs`, or `echo` with `logprobs`) are not supported "
                              "while LoRA is enabled (vLLM #16668).", "prompt_logprobs")
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        task = Task(
            task_id=str(body.get("request_id") or uuid.uuid4().hex), kind="inference", model=model,
            prompt_tokens=estimate_prompt_tokens(body),
            max_tokens=max_tokens if isinstance(max_tokens, int) else 16, arrival=time.time(),
        )
        # One retry on another node: a replica that died since the planner last checked must
        # cost the client nothing but a little latency.
        for attempt in range(2):
            decision = await self.planner.place.remote(task)
            if "error" in decision:
                return error(decision["error"], decision["message"], "model" if decision["error"] == 404 else None)
            node_id = decision["node_id"]
            try:
                replica = await self._replica(node_id)
                stream = getattr(replica, method).options(num_returns="streaming").remote(body, task.task_id)
                header = await (await stream.__anext__())
                if header["status"] != 503 or attempt == 1:
                    break
                await self.planner.report_failure.remote(node_id, "replica answered 503 (engine not started)")
            except (RayActorError, StopAsyncIteration) as exc:
                self._replicas = {}
                await self.planner.report_failure.remote(node_id, f"{type(exc).__name__}: {exc}")
                if attempt == 1:
                    return error(503, f"The replica on node {node_id} is unavailable: {exc}")
        if header["stream"]:
            return StreamingResponse(self._forward(stream), media_type="text/event-stream")
        return JSONResponse(await (await stream.__anext__()), status_code=header["status"])

    @staticmethod
    async def _forward(stream: Any) -> AsyncIterator[str]:
        async for ref in stream:
            yield await ref


def build(config: dict[str, Any]) -> serve.Application:
    """The Serve application for ``config`` (a dict of app settings, validated here)."""
    cfg = AppConfig.model_validate(config)
    return OpenAIIngress.options(
        num_replicas=cfg.ingress.replicas, max_ongoing_requests=cfg.ingress.max_ongoing_requests
    ).bind(cfg.model_dump())
