"""The front door's bounds: what HAProxy enforces before any request reaches the app, from the app's settings.

Ray Serve runs HAProxy and renders its config (``deployments/haproxy_patch.py`` says how these rules get into
it). This module is the app's side of it, with no Ray import (``app/serve_env.py`` reads it before
Ray starts):

- the settings, :class:`FrontDoor`: ``ingress.haproxy`` and ``limits.max_body_bytes`` of the config;
- how they travel to the process that renders HAProxy's config: environment variables, Ray's own
  knobs where Ray 2.60 has one (``RAY_SERVE_HAPROXY_MAXCONN``, ``..._TIMEOUT_CLIENT_S``, the two
  buffer sizes) and ``COSERVE_HAPROXY_*`` for the rest;
- the directives of the HTTP frontend that enforce them (:meth:`FrontDoor.frontend_rules`),
  including the two answers HAProxy gives itself, in the OpenAI error shape: 413 for a body over
  the limit and 408 for a request that did not arrive in time.

HAProxy buffers a request's whole body before it routes it (``option http-buffer-request``), in a
buffer of ``max_body_bytes`` + 64 KiB, so ``timeout http-request`` bounds the headers and the body
together, and the placement router sees the whole body of any request the app would accept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.serving.request_stages import ACCEPTED_HEADER
from deployments.guard import error_body

if TYPE_CHECKING:
    from settings import AppConfig

# HAProxy's buffer beyond the largest body: the request line, the headers and HAProxy's rewrite reserve.
BODY_HEADROOM = 64 * 1024
# Sent by HAProxy's Lua (deployments/haproxy_patch.py) with every /internal/route call: the client's
# Authorization header is forwarded, so the placement router can check the key before the body.
ROUTER_MARKER_HEADER = "x-coserve-front-door"
# Ray's hook that runs a function in the Serve controller as it starts: it installs the patch.
CALLBACK_VAR = "RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH"
CALLBACK = "deployments.haproxy_patch:install"

# Ray 2.60's own knobs (ray/serve/_private/constants.py), read by the process that renders the config.
MAXCONN_VAR = "RAY_SERVE_HAPROXY_MAXCONN"
CLIENT_TIMEOUT_VAR = "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"
BUFSIZE_VARS = ("RAY_SERVE_HAPROXY_TUNE_BUFSIZE", "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE")
# What Ray has no knob for.
REQUEST_TIMEOUT_VAR = "COSERVE_HAPROXY_REQUEST_TIMEOUT_S"
PER_SOURCE_VAR = "COSERVE_HAPROXY_MAXCONN_PER_SOURCE"  # 0: no cap
MAX_BODY_VAR = "COSERVE_HAPROXY_MAX_BODY_BYTES"
MAX_ADAPTER_VAR = "COSERVE_HAPROXY_MAX_ADAPTER_BYTES"
# The adapter upload (POST .../v1/adapters/{name}/versions, under any route prefix): bounded by max_adapter_bytes
# instead; the model server's guard (deployments/guard.py UPLOAD_PATH_RE) holds it to the same two limits.
UPLOAD_PATH_REGEX = "/v1/adapters/.+/versions$"


class FrontDoorError(RuntimeError):
    """The front door's settings are missing or inconsistent where HAProxy's config is rendered."""


@dataclass(frozen=True)
class FrontDoor:
    request_timeout_s: int
    client_idle_timeout_s: int
    maxconn: int
    maxconn_per_source: int | None
    max_body_bytes: int
    max_adapter_bytes: int

    @classmethod
    def from_config(cls, cfg: AppConfig) -> FrontDoor:
        h = cfg.ingress.haproxy
        return cls(
            h.request_timeout_s,
            h.client_idle_timeout_s,
            h.maxconn,
            h.maxconn_per_source,
            cfg.limits.max_body_bytes,
            cfg.limits.max_adapter_bytes,
        )

    @property
    def bufsize(self) -> int:
        """HAProxy's ``tune.bufsize``: the largest accepted body with its headers fits in one buffer."""
        return self.max_body_bytes + BODY_HEADROOM

    def environment(self) -> dict[str, str]:
        """The variables that carry these settings to the Serve controller and the HAProxy managers."""
        env = {
            CALLBACK_VAR: CALLBACK,
            MAXCONN_VAR: str(self.maxconn),
            CLIENT_TIMEOUT_VAR: str(self.client_idle_timeout_s),
            REQUEST_TIMEOUT_VAR: str(self.request_timeout_s),
            PER_SOURCE_VAR: str(self.maxconn_per_source or 0),
            MAX_BODY_VAR: str(self.max_body_bytes),
            MAX_ADAPTER_VAR: str(self.max_adapter_bytes),
        }
        env.update({var: str(self.bufsize) for var in BUFSIZE_VARS})
        return env

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> FrontDoor:
        """The settings as :meth:`environment` wrote them; :class:`FrontDoorError` if any is missing or
        they disagree (a buffer size or a hook set by hand to something else)."""
        env = os.environ if environ is None else environ

        def number(var: str) -> int:
            value = env.get(var)
            if value is None or not value.strip().isdigit():
                raise FrontDoorError(
                    f"${var} is {value!r}, not a whole number: start Serve through app/serve_env.py "
                    "(make serve) or with the env vars of configs/default.yaml"
                )
            return int(value)

        per_source = number(PER_SOURCE_VAR)
        door = cls(
            number(REQUEST_TIMEOUT_VAR),
            number(CLIENT_TIMEOUT_VAR),
            number(MAXCONN_VAR),
            per_source or None,
            number(MAX_BODY_VAR),
            number(MAX_ADAPTER_VAR),
        )
        expected = door.environment()
        wrong = {var: env.get(var) for var in (*BUFSIZE_VARS, CALLBACK_VAR) if env.get(var) != expected[var]}
        if wrong:
            raise FrontDoorError(
                f"front door settings disagree: {wrong}, expected { {var: expected[var] for var in wrong} }"
            )
        if (
            door.request_timeout_s < 1
            or door.client_idle_timeout_s < 1
            or door.maxconn < 1
            or door.max_body_bytes < 1
            or door.max_adapter_bytes < 1
        ):
            raise FrontDoorError(f"front door settings must be positive: {door}")
        return door

    def frontend_rules(self) -> str:
        """HAProxy directives for the HTTP frontend, one per line, indented as its section's."""
        lines = [
            "# coserve's front door (deployments/front_door.py, put here by deployments/haproxy_patch.py)",
            "option http-buffer-request",
            f"timeout http-request {self.request_timeout_s}s",
            "http-error status 408 content-type application/json string "
            + _quoted(
                error_body(
                    408,
                    f"The request did not arrive within ingress.haproxy.request_timeout_s={self.request_timeout_s} s.",
                    "invalid_request_error",
                    "request_timeout",
                )
            ),
        ]
        if self.maxconn_per_source is not None:
            lines += [
                "stick-table type ipv6 size 64k expire 60s store conn_cur",
                "tcp-request connection track-sc0 src",
                f"tcp-request connection reject if {{ sc0_conn_cur gt {self.maxconn_per_source} }}",
            ]
        # When HAProxy routes the request (its body buffered): the replica's stages start here
        # (actors/serving/request_stages.py). Set, never passed on from the client.
        lines.append(f"http-request set-header {ACCEPTED_HEADER} %[date(0,us)]")
        too_large = error_body(
            413,
            f"Request body larger than limits.max_body_bytes={self.max_body_bytes}.",
            "invalid_request_error",
            "request_too_large",
        )
        if self.max_adapter_bytes <= self.max_body_bytes:
            lines.append(
                f"http-request return status 413 content-type application/json string {_quoted(too_large)} "
                f"if {{ req.hdr_val(content-length) gt {self.max_body_bytes} }} || "
                f"{{ req.body_size gt {self.max_body_bytes} }}"
            )
            return "".join(f"    {line}\n" for line in lines)
        # An adapter upload may be larger: its body streams past the buffer (what HAProxy holds stays bounded).
        # ACLs come before the rules that use them (HAProxy reads the section in order).
        lines += [f"acl coserve_upload_path path_reg {UPLOAD_PATH_REGEX}", "acl coserve_post method POST"]
        adapter_too_large = error_body(
            413,
            f"Request body larger than limits.max_adapter_bytes={self.max_adapter_bytes}.",
            "invalid_request_error",
            "request_too_large",
        )
        lines += [
            f"http-request return status 413 content-type application/json string {_quoted(too_large)} "
            f"if !coserve_upload_path {{ req.hdr_val(content-length) gt {self.max_body_bytes} }} || "
            f"!coserve_upload_path {{ req.body_size gt {self.max_body_bytes} }} || "
            f"!coserve_post {{ req.hdr_val(content-length) gt {self.max_body_bytes} }} || "
            f"!coserve_post {{ req.body_size gt {self.max_body_bytes} }}",
            f"http-request return status 413 content-type application/json string {_quoted(adapter_too_large)} "
            f"if coserve_upload_path coserve_post {{ req.hdr_val(content-length) gt {self.max_adapter_bytes} }}",
        ]
        return "".join(f"    {line}\n" for line in lines)


def _quoted(body: bytes) -> str:
    """A JSON body as one HAProxy argument: single quotes take everything inside literally."""
    text = body.decode()
    if "'" in text or "\n" in text:
        raise ValueError(f"cannot quote {text!r} for HAProxy")
    return f"'{text}'"
