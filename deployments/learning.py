"""HTTP routes for learning: adapters (create, list, show, roll back) and feedback.

Bodies go to the feedback store's own validation (app/feedback_store.py) through the one actor
that owns it; its errors carry their HTTP status, and a 2xx on feedback means the whole batch
is durably stored.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deployments.http import BadRequest, api, error, json_body


def _store_error(exc: BaseException) -> Response | None:
    """The HTTP answer for a feedback-store error (raised inside the actor), else None."""
    from app.feedback_store import StoreError

    cause = exc if isinstance(exc, StoreError) else getattr(exc, "cause", None)
    if isinstance(cause, StoreError):
        return error(cause.status, str(cause), err_type=getattr(cause, "code", None))
    return None


class LearningRoutes:
    """Mixed into the ingress deployment; needs ``self.planner``, ``self.cfg`` and ``self._feedback``."""

    async def _store(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._feedback is None:
            self._feedback = await self.planner.feedback_queue.remote()
        return await getattr(self._feedback, method).remote(*args, **kwargs)

    async def _served_name(self) -> str:
        return (await self.planner.models.remote())["base"]

    def _adapter_json(self, info: Any, base: str) -> dict[str, Any]:
        out = info.model_dump()
        out["model"] = f"{base}:{info.name}"
        return out

    @api.post("/v1/adapters")
    async def create_adapter(self, request: Request) -> Response:
        body = await json_body(request)
        if not isinstance(body, dict):
            raise BadRequest("Request body must be a JSON object.")
        rank = (body.get("lora") or {}).get("r") if isinstance(body.get("lora"), dict) else None
        if isinstance(rank, int) and rank > self.cfg.engine.max_lora_rank:
            raise BadRequest(f"lora.r={rank} exceeds the engine's max_lora_rank={self.cfg.engine.max_lora_rank}", "lora.r")
        try:
            info = await self._store("create_adapter", body)
        except Exception as exc:
            if (resp := _store_error(exc)) is not None:
                return resp
            raise
        return JSONResponse(self._adapter_json(info, await self._served_name()), status_code=201)

    @api.get("/v1/adapters")
    async def list_adapters(self) -> JSONResponse:
        base = await self._served_name()
        return JSONResponse({"object": "list", "data": [self._adapter_json(i, base) for i in await self._store("list_adapters")]})

    @api.get("/v1/adapters/{name}")
    async def show_adapter(self, name: str) -> Response:
        try:
            info = await self._store("get_adapter", name)
        except Exception as exc:
            if (resp := _store_error(exc)) is not None:
                return resp
            raise
        return JSONResponse(self._adapter_json(info, await self._served_name()))

    @api.post("/v1/adapters/{name}/rollback")
    async def rollback_adapter(self, name: str, request: Request) -> Response:
        body = await json_body(request)
        version = body.get("version") if isinstance(body, dict) else None
        if not isinstance(version, int) or isinstance(version, bool):
            raise BadRequest("`version` (an integer) is required.", "version")
        try:
            info = await self._store("rollback", name, version)
            target = await self._store("get_version", name, version)
        except Exception as exc:
            if (resp := _store_error(exc)) is not None:
                return resp
            raise
        await self.planner.load_adapter.remote(name, version, target.path, None, True)
        return JSONResponse(self._adapter_json(info, await self._served_name()))

    @api.get("/metrics")
    async def metrics(self) -> Response:
        from app.metrics import CONTENT_TYPE_LATEST, render

        status = await self.planner.status.remote()
        adapters = [a.model_dump() for a in await self._store("list_adapters")]
        return Response(render(status, adapters), media_type=CONTENT_TYPE_LATEST)

    @api.post("/v1/feedback")
    async def feedback(self, request: Request) -> Response:
        body = await json_body(request)
        # One item, a list of items, or {"items": [...]}.
        if isinstance(body, dict) and "items" in body:
            if set(body) != {"items"}:
                raise BadRequest(f"unexpected keys beside `items`: {sorted(set(body) - {'items'})}")
            items = body["items"]
        else:
            items = body
        if not isinstance(items, (list, dict)):
            raise BadRequest("Body must be an item, a list of items, or {\"items\": [...]}.", "items")
        try:
            ids = await self._store("add_feedback", items)
        except Exception as exc:
            if (resp := _store_error(exc)) is not None:
                return resp
            raise
        return JSONResponse({"ids": ids, "accepted": len(ids)}, status_code=202)
