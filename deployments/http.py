"""OpenAI-shaped errors for the app's own routes, and the handlers that make every error take that shape."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.guard import Unauthenticated

# Serve writes its own logger to the replica log file; a 500's detail must land there.
logger = logging.getLogger("ray.serve")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    409: "ConflictError",
    413: "PayloadTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error(
    status: int,
    message: str,
    param: str | None = None,
    err_type: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-shaped error body with the given HTTP status."""
    body = {
        "error": {
            "message": message,
            "type": err_type or _ERROR_TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


class ServiceUnavailable(Exception):
    """A part of the service the route needs is restarting; becomes a 503 with Retry-After."""


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
    except RecursionError:
        raise BadRequest("Request body is nested too deeply.") from None


async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
    return error(400, str(exc), exc.param)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and methods (Starlette's own 404/405) get the OpenAI shape too.
    return error(exc.status_code, str(exc.detail))


async def _unavailable(_: Request, exc: ServiceUnavailable) -> JSONResponse:
    return error(503, str(exc), headers={"Retry-After": "2"})


async def _unauthenticated(_: Request, exc: Unauthenticated) -> JSONResponse:
    # A handler read the principal where the guard set none: refused, never served as local mode.
    return error(401, str(exc), headers={"WWW-Authenticate": 'Bearer realm="coserve"'})


async def _too_deep(_: Request, exc: RecursionError) -> JSONResponse:
    # FastAPI's own body parsing (vLLM's routes) meets a deeply nested JSON body here.
    return error(400, "Request body is nested too deeply.")


def request_id(request: Request) -> str:
    """The request's id: the client's or HAProxy's ``X-Request-Id``, else a fresh one."""
    import uuid

    return request.headers.get("x-request-id") or uuid.uuid4().hex


def internal_error(request: Request, exc: BaseException) -> JSONResponse:
    """A 500 that names the request, never the internals: the detail goes to the log under the same id."""
    rid = request_id(request)
    logger.error("request %s %s %s failed", rid, request.method, request.url.path, exc_info=exc)
    return error(
        500, f"Internal error; the server log has the detail under request id {rid}.", headers={"X-Request-Id": rid}
    )


def _raised_validating_the_request(exc: BaseException) -> bool:
    """Whether ``exc`` escaped FastAPI's validation of the request (a validator of a request model that
    raised something other than ValueError on odd input) before the route's own function ran."""
    import traceback

    names = {frame.name for frame in traceback.extract_tb(exc.__traceback__)}
    return "solve_dependencies" in names and "run_endpoint_function" not in names


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    if _raised_validating_the_request(exc):
        # The client's body broke a request model's validator (e.g. vLLM's ChatCompletionRequest on a
        # `structured_outputs` that is not an object): the request is at fault, not the server.
        logger.info("request %s: body failed validation: %s: %s", request_id(request), type(exc).__name__, exc)
        return error(400, f"Invalid request body ({type(exc).__name__} while validating it).")
    return internal_error(request, exc)


def install_error_handlers(app: FastAPI) -> None:
    """Route-level 4xx of the app's own routes in the OpenAI shape; vLLM's handlers cover its routes.
    A principal read where the guard set none (:class:`~deployments.guard.Unauthenticated`) is a 401
    on any route. An unexpected exception anywhere becomes a 500 with a request id, its detail only in the log."""
    app.add_exception_handler(BadRequest, _bad_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ServiceUnavailable, _unavailable)
    app.add_exception_handler(Unauthenticated, _unauthenticated)
    app.add_exception_handler(RecursionError, _too_deep)
    app.add_exception_handler(Exception, _internal)
