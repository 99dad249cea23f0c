"""The app's OpenAPI schema: vLLM's operations plus the app's, with their request bodies and every error they answer.

FastAPI derives a schema from route signatures; the app's routes read their bodies themselves
(the feedback store validates them), so their bodies are declared here from the store's own
pydantic models (strict: a string or a float where an integer is meant is a 400, as the schema's types say;
``lora.r`` at most the engine's ``max_lora_rank``), and the answers that come from outside a route (the guard's 401/403/413/429,
a restarting planner's 503, the 500 with a request id) are added to every operation. A fuzzer
(schemathesis, ``tests/e2e/test_fuzz.py``) holds the app to this document.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from actors.learning.store.feedback_items import LabelItem, PreferenceItem, SFTItem
from actors.learning.store.models import MAX_IDEMPOTENCY_KEY_CHARS, AdapterSpec, GateOverrides, Mode, PeriodicSettings
from deployments.guard import PUBLIC_PATHS

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class AppError(BaseModel):
    """Every error the app and vLLM answer: OpenAI's shape."""

    error: ErrorDetail


class AdapterChange(BaseModel):
    """What ``PATCH /v1/adapters/{name}`` takes (at least one field)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mode: Mode | None = None
    learning_rate: float | None = Field(None, gt=0, le=1)
    beta: float | None = Field(None, gt=0)
    periodic: PeriodicSettings | None = None
    gate: GateOverrides | None = None
    paused: bool | None = None
    epochs: int | None = Field(None, ge=1, le=100)


class VersionChoice(BaseModel):
    """What rollback and promote take."""

    model_config = ConfigDict(extra="forbid", strict=True)
    version: int = Field(ge=1, lt=2**63)


class VersionSource(BaseModel):
    """What ``POST /v1/adapters/{name}/versions`` takes as JSON: where the adapter is (admin only)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    source: str = Field(
        min_length=1, description="file://, s3:// or gs:// URI of a PEFT directory or a .tar/.zip of one."
    )
    gate: bool | None = Field(None, description="false: serve at once, unjudged (admin only).")


class CompletionFeedback(BaseModel):
    """Feedback on a stored completion by its id: exactly one of ``rating``, ``correction``, ``preferred_over``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    completion_id: str = Field(min_length=1, description="The id a chat or completion response carried (stored).")
    adapter: str | None = Field(None, description="The adapter to train; default the one that answered.")
    rating: Literal["up", "down"] | None = Field(None, description="A label of the answer (a kto adapter).")
    correction: str | None = Field(None, min_length=1, description="The right answer to the stored prompt (sft).")
    preferred_over: str | None = Field(
        None, min_length=1, description="Another stored completion of the same prompt whose answer is worse (dpo)."
    )


class FeedbackBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[SFTItem | PreferenceItem | LabelItem | CompletionFeedback] = Field(min_length=1)


_ITEM_REFS = [{"$ref": REF.format(model=m)} for m in ("SFTItem", "PreferenceItem", "LabelItem", "CompletionFeedback")]
FEEDBACK_BODY: dict[str, Any] = {
    "anyOf": [
        *_ITEM_REFS,
        {"type": "array", "minItems": 1, "items": {"anyOf": _ITEM_REFS}},
        {"$ref": REF.format(model="FeedbackBatch")},
    ]
}

# (path, method) -> (request body schema, the route's own answers besides 2xx)
APP_OPERATIONS: dict[tuple[str, str], tuple[dict[str, Any] | None, tuple[int, ...]]] = {
    ("/v1/adapters", "post"): ({"$ref": REF.format(model="AdapterSpec")}, (400, 403, 409)),
    ("/v1/adapters", "get"): (None, ()),
    ("/v1/adapters/{name}", "get"): (None, (404,)),
    ("/v1/adapters/{name}", "patch"): ({"$ref": REF.format(model="AdapterChange")}, (400, 404)),
    ("/v1/adapters/{name}/rollback", "post"): ({"$ref": REF.format(model="VersionChoice")}, (400, 404, 409)),
    ("/v1/adapters/{name}/promote", "post"): ({"$ref": REF.format(model="VersionChoice")}, (400, 404, 409)),
    ("/v1/feedback", "post"): (FEEDBACK_BODY, (400, 404, 422, 429)),
    ("/v1/chat/completions/{completion_id}", "get"): (None, (404,)),
    ("/v1/chat/completions/{completion_id}", "delete"): (None, (404,)),
}
# Upload and download of a version's files (deployments/adapter_files.py): bodies of several types, a query, a tar.
UPLOAD = ("/v1/adapters/{name}/versions", "post")
DOWNLOAD = ("/v1/adapters/{name}/versions/{version}/files", "get")
APP_OPERATIONS[UPLOAD] = (None, (400, 403, 404, 409, 413))
APP_OPERATIONS[DOWNLOAD] = (None, (400, 404))
_BINARY = {"type": "string", "format": "binary"}
UPLOAD_BODY: dict[str, Any] = {
    "required": True,
    "description": "A PEFT LoRA adapter: a tar or zip of adapter_config.json + adapter_model.safetensors (at the "
    "top level or in one folder), at most limits.max_adapter_bytes; or JSON naming a PEFT directory "
    "or such an archive by URI (admin only).",
    "content": {
        "application/x-tar": {"schema": _BINARY},
        "application/zip": {"schema": _BINARY},
        "application/json": {"schema": {"$ref": REF.format(model="VersionSource")}},
    },
}
UPLOAD_QUERY = {
    "name": "gate",
    "in": "query",
    "required": False,
    "schema": {"type": "boolean"},
    "description": "false: serve the version at once, unjudged (admin only); true: judge it even with the "
    "adapter's gate off. Default: the adapter's gate.",
}
VERSION_PARAM = {
    "name": "version",
    "in": "path",
    "required": True,
    "schema": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
}
# (path, method) -> header parameters the route reads itself
APP_HEADERS: dict[tuple[str, str], list[dict[str, Any]]] = {
    ("/v1/feedback", "post"): [
        {
            "name": "Idempotency-Key",
            "in": "header",
            "required": False,
            "description": "Stores the batch once: the same key from the same tenant within 24 h answers the first "
            "request's 202 and ids again and stores nothing; with other items, 422.",
            "schema": {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY_CHARS, "pattern": "^[ -~]+$"},
        }
    ],
}
_DOC_MODELS: tuple[type[BaseModel], ...] = (
    AppError,
    AdapterSpec,
    AdapterChange,
    VersionChoice,
    FeedbackBatch,
    SFTItem,
    PreferenceItem,
    LabelItem,
    CompletionFeedback,
    VersionSource,
)
_STATUS_TEXT = {
    400: "Bad request",
    401: "Missing or unknown API key",
    403: "Not allowed: needs an admin key, or over a count limit (limits.adapters_per_tenant)",
    404: "Not found (or another tenant's)",
    409: "Conflict",
    413: "Body larger than limits.max_body_bytes (an adapter upload: limits.max_adapter_bytes)",
    422: "Idempotency-Key sent again with other feedback items",
    429: "Over the key's rate or concurrency limit (feedback: limits.training_tokens_per_day)",
    500: "Internal error (the log has the detail)",
    503: "A part of the service is restarting",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "string"}}}


def _error_response(status: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": _STATUS_TEXT[status],
        "content": {"application/json": {"schema": {"$ref": REF.format(model="AppError")}}},
    }
    if status in (429, 503):
        out["headers"] = _RETRY_AFTER
    return out


def _components(max_lora_rank: int | None = None) -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in _DOC_MODELS:
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    if max_lora_rank is not None:  # the engine's limit, which create_adapter enforces, not the model's 256
        rank = schemas["LoraSettings"]["properties"]["r"]
        rank["maximum"] = min(rank["maximum"], max_lora_rank)
    return schemas


def _files_operation(path: str, method: str, op: dict[str, Any]) -> None:
    """The upload's bodies, query and 201, and the download's tar and integer version, which FastAPI cannot see."""
    if (path, method) == UPLOAD:
        op["requestBody"] = UPLOAD_BODY
        op["parameters"] = [*op.get("parameters", []), UPLOAD_QUERY]
        op.setdefault("responses", {})["201"] = {
            "description": "The new version, as the adapter routes show versions (a tenant's without `path`).",
            "content": {"application/json": {"schema": {"type": "object"}}},
        }
        op["responses"].pop("200", None)
    elif (path, method) == DOWNLOAD:
        op["parameters"] = [VERSION_PARAM if p.get("name") == "version" else p for p in op.get("parameters", [])]
        op.setdefault("responses", {})["200"] = {
            "description": "The version's PEFT directory as a tar: adapter_config.json + adapter_model.safetensors.",
            "content": {"application/x-tar": {"schema": _BINARY}},
        }


def install_openapi(app: FastAPI, guarded: bool, max_lora_rank: int | None = None) -> None:
    """Make ``app.openapi()`` describe what the app accepts and answers (built once, on first request).
    ``guarded``: API keys are configured, so every non-public operation may answer 401 and 403.
    ``max_lora_rank``: the engine's (``engine.max_lora_rank``), the largest ``lora.r`` a create takes."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(
            title="coserve",
            version="1",
            description="OpenAI-compatible serving that learns from feedback (README).",
            routes=app.routes,
        )
        doc.setdefault("components", {}).setdefault("schemas", {}).update(_components(max_lora_rank))
        if guarded:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                body, answers = APP_OPERATIONS.get((path, method), (None, ()))
                if body is not None:
                    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
                if (path, method) in APP_HEADERS:
                    op["parameters"] = [*op.get("parameters", []), *APP_HEADERS[(path, method)]]
                _files_operation(path, method, op)
                responses = op.setdefault("responses", {})
                statuses = {500, *answers}
                if path not in PUBLIC_PATHS:
                    statuses |= {413, 429, 503} | ({401, 403} if guarded else set())
                    if method in ("post", "put", "patch"):
                        statuses.add(400)
                    if guarded:
                        op["security"] = [{"bearer": []}]
                if path == "/health":
                    statuses.add(503)
                if path == "/metrics":
                    responses["200"] = {
                        "description": "Prometheus text exposition",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                for status in sorted(statuses):
                    responses.setdefault(str(status), _error_response(status))
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
