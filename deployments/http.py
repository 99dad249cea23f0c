"""OpenAI-shaped errors for the app's own routes, and the handlers that make every error take that shape."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 409: "ConflictError",
                413: "PayloadTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error(status: int, message: str, param: str | None = None, err_type: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error body with the given HTTP status."""
    body = {"error": {"message": message, "type": err_type or _ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class BadRequest(Exception):
    """Raised by body parsing; becomes a 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


async def json_body(request: Request) -> Any:
    """The request's JSON body, or BadRequest with the parser's reason."""
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"Request body is not valid JSON: {exc}") from None


async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
    return error(400, str(exc), exc.param)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and methods (Starlette's own 404/405) get the OpenAI shape too.
    return error(exc.status_code, str(exc.detail))


def install_error_handlers(app: FastAPI) -> None:
    """Route-level 4xx of the app's own routes in the OpenAI shape; vLLM's handlers cover its routes."""
    app.add_exception_handler(BadRequest, _bad_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
