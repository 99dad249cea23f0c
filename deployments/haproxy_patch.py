"""The one patch of Ray's private code: the front door's bounds in the haproxy.cfg Ray Serve renders.

Checked against Ray 2.60.0 (``ray/serve/_private/haproxy.py``, ``haproxy_templates.py``,
``ingress_request_router.lua.tmpl``); any other version is refused with an exception when Serve
starts, before HAProxy runs.

Why a patch. Ray's HAProxy manager renders ``haproxy.cfg`` from the Jinja template
``HAPROXY_CONFIG_TEMPLATE`` on every start and reload. Its knobs (environment variables) set the
global ``maxconn``, ``timeout client`` and ``tune.bufsize``; ``deployments/front_door.py`` sets them.
The template has no way to set the rest, and Ray 2.60 has no template path or rendering hook:

- ``timeout http-request`` (``HAProxyConfig.timeout_http_request_s`` has no variable), buffering
  the body, a per-source connection cap and a body limit in the HTTP frontend;
- the stats page (``bind *:``), the Prometheus exporter (``bind :``) and the admin socket
  (``mode 666 level admin``) are written into the template as they are;
- a stamp of when the placement router answered, for the replica's request stages.

So :func:`edit_template` rewrites Ray's template text, each edit replacing one exact piece of it
(an error if that piece is not there exactly once): the frontend's rules are inserted after its
``bind``, the stats and exporter bind to 127.0.0.1 and the socket is ``mode 600``. The Lua action
that asks the placement router is edited the same way (:func:`edit_lua`), to forward the client's
``Authorization`` header and a marker, so the router checks the key before it reads the body.

How it reaches HAProxy. Ray's ``RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH`` runs :func:`install`
in the Serve controller as it starts. It checks the version and the edits, then has the controller
create each node's HAProxy manager from :class:`HAProxyManager` below (Ray's class, made here):
Ray imports this module in the manager's process, and the manager applies the edits there before
its first render. Everything else about the config (backends, health checks, retries, the router
call) stays Ray's.
"""

from __future__ import annotations

import logging

import ray

import compat
from actors.serving.request_stages import ROUTED_HEADER
from deployments.front_door import ROUTER_MARKER_HEADER, FrontDoor, FrontDoorError

logger = logging.getLogger("ray.serve")

RAY_VERSION = compat.CHECKED_VERSIONS["ray"]

# (what Ray 2.60's template has exactly once, what it becomes); "{rules}" is the frontend's rules.
_CONFIG_EDITS = (
    (
        "stats socket {{ config.socket_path }} mode 666 level admin expose-fd listeners",
        "stats socket {{ config.socket_path }} mode 600 level admin expose-fd listeners",
    ),
    (
        "frontend prometheus\n    bind :{{ config.metrics_port }}\n",
        "frontend prometheus\n    bind 127.0.0.1:{{ config.metrics_port }}\n",
    ),
    ("listen stats\n  bind *:{{ config.stats_port }}\n", "listen stats\n  bind 127.0.0.1:{{ config.stats_port }}\n"),
    (
        "frontend http_frontend\n    bind {{ config.frontend_host }}:{{ config.frontend_port }}\n",
        "frontend http_frontend\n    bind {{ config.frontend_host }}:{{ config.frontend_port }}\n"
        "{% raw %}{rules}{% endraw %}",
    ),
    # The placement router answered: stamp it for the replica's request stages (deployments/front_door.py).
    (
        "backend {{ backend.name or 'unknown' }}-via-ingress-request-router\n    log global\n",
        "backend {{ backend.name or 'unknown' }}-via-ingress-request-router\n    log global\n"
        f"    http-request set-header {ROUTED_HEADER} %[date(0,us)]\n",
    ),
)
_LUA_EDITS = (
    (
        "local function call_router(router, body, truncated_length, session_id, request_id)\n",
        "local function call_router(router, body, truncated_length, session_id, request_id, authorization)\n",
    ),
    (
        '    -- Connection: close so sock:receive("*a") terminates on EOF.\n',
        "    -- coserve (deployments/haproxy_patch.py): the client's key, checked by the router before the body.\n"
        f'    local authorization_header = "{ROUTER_MARKER_HEADER}: 1\\r\\n"\n'
        '    if authorization and authorization ~= "" then\n'
        '        authorization_header = authorization_header .. "Authorization: " .. authorization .. "\\r\\n"\n'
        "    end\n\n"
        '    -- Connection: close so sock:receive("*a") terminates on EOF.\n',
    ),
    (
        '        .. request_id_header\n        .. "\\r\\n"\n',
        '        .. request_id_header\n        .. authorization_header\n        .. "\\r\\n"\n',
    ),
    (
        "    local hdrs = txn.http:req_get_headers()\n",
        "    local hdrs = txn.http:req_get_headers()\n"
        '    local authorization_entry = hdrs and hdrs["authorization"]\n'
        "    local authorization = authorization_entry and authorization_entry[0]\n",
    ),
    (
        "        response = call_router(router, body, truncated, session_id, request_id)\n",
        "        response = call_router(router, body, truncated, session_id, request_id, authorization)\n",
    ),
)


class PatchError(RuntimeError):
    """This Ray is not the one the patch was checked against, or its template changed."""


def _edit(text: str, edits: tuple[tuple[str, str], ...], what: str, **fill: str) -> str:
    for old, new in edits:
        count = text.count(old)
        if count != 1:
            raise PatchError(
                f"{what}: expected this once, found it {count} times (Ray {ray.__version__}, patch "
                f"checked against {RAY_VERSION}): {old!r}"
            )
        text = text.replace(old, new.replace("{rules}", fill["rules"]) if "{rules}" in new else new)
    return text


def edit_template(template: str, door: FrontDoor) -> str:
    """Ray's ``HAPROXY_CONFIG_TEMPLATE`` with the front door's rules and loopback-only stats, exporter and socket."""
    return _edit(template, _CONFIG_EDITS, "HAProxy config template", rules=door.frontend_rules())


def edit_lua(template: str) -> str:
    """Ray's ingress-request-router Lua template, forwarding the client's Authorization header to the router."""
    return _edit(template, _LUA_EDITS, "ingress request router Lua template")


def check_version() -> None:
    if ray.__version__ != RAY_VERSION:
        raise PatchError(
            f"deployments/haproxy_patch.py edits Ray {RAY_VERSION}'s HAProxy templates; this is Ray "
            f"{ray.__version__}. Check the edits against its ray/serve/_private/haproxy*.py and "
            "ingress_request_router.lua.tmpl, then update RAY_VERSION."
        )


check_version()  # before anything below reads Ray's private modules (through compat/)

_RAY_TEMPLATE = compat.haproxy_config_template()
_RAY_LOAD_LUA = compat.haproxy_lua_loader()


def _check_ray_knobs(door: FrontDoor) -> None:
    """Ray read its own knobs of the front door (maxconn, timeout client, buffers) from the same environment."""
    read = compat.haproxy_knobs()
    want = {
        "maxconn": door.maxconn,
        "timeout client": door.client_idle_timeout_s,
        "tune.bufsize": door.bufsize,
        "tune.bufsize (router)": door.bufsize,
    }
    if read != want:
        raise PatchError(f"Ray's HAProxy settings in this process are {read}, the front door's {want}")


def apply(door: FrontDoor) -> None:
    """Render this process's HAProxy configs with the front door (idempotent: edits Ray's originals)."""
    check_version()
    _check_ray_knobs(door)
    compat.set_haproxy_config_template(edit_template(_RAY_TEMPLATE, door))
    compat.set_haproxy_lua_template(edit_lua(_RAY_LOAD_LUA().template))


@ray.remote(num_cpus=0)
class HAProxyManager(compat.ray_haproxy_manager_class()):  # type: ignore[misc]
    """Ray's HAProxy manager, created from this module so that its process renders with the front door."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        door = FrontDoor.from_environment()
        apply(door)
        logger.info("front door: %s (deployments/haproxy_patch.py)", door)
        super().__init__(*args, **kwargs)


def install() -> None:
    """``RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH``: run by the Serve controller as it starts. Raises
    (and Serve does not start) on another Ray version, a template that changed, or missing settings."""
    check_version()
    try:
        door = FrontDoor.from_environment()
    except FrontDoorError as exc:
        raise PatchError(str(exc)) from None
    _check_ray_knobs(door)
    edit_template(_RAY_TEMPLATE, door)
    edit_lua(_RAY_LOAD_LUA().template)
    current = compat.serve_controller_haproxy_manager()
    if current is not compat.ray_haproxy_manager() and current is not HAProxyManager:
        raise PatchError(f"the Serve controller creates {current!r}, not Ray's HAProxyManager")
    compat.set_serve_controller_haproxy_manager(HAProxyManager)
    logger.info("front door: the Serve controller creates HAProxy managers from %s (%s)", __name__, door)
