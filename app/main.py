"""The Serve application: ``serve run configs/default.yaml`` (what ``make serve`` runs) or ``serve run app.main:app``.

``build_app(args)`` is the application builder Serve calls with the ``args`` of a Serve config
file; ``app`` is the same application with every setting at its default (the embedded model).
Run either with the settings of ``app/serve_env.py`` (``make serve`` and the Serve config set them),
so HAProxy forwards requests straight to the model servers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from ray import serve

from deployments.front_door import FrontDoor
from deployments.server import build, haproxy_enabled
from settings import AppConfig

logger = logging.getLogger(__name__)


def build_app(args: dict[str, Any] | AppConfig | None = None) -> serve.Application:
    """Validate ``args`` against the config schema and build the application."""
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    check_front_door(cfg)
    return build(cfg)


def check_front_door(cfg: AppConfig, environ: Mapping[str, str] | None = None) -> dict[str, tuple[str | None, str]]:
    """HAProxy took its bounds from the environment Serve started with (``app/serve_env.py``), not from
    this config: where the two differ (this process's environment is the app's), say so. Returns
    ``{variable: (set, wanted)}`` of the differences (none without HAProxy)."""
    if not haproxy_enabled():
        return {}
    env = os.environ if environ is None else environ
    differ = {k: (env.get(k), v) for k, v in FrontDoor.from_config(cfg).environment().items() if env.get(k) != v}
    if differ:
        logger.warning(
            "HAProxy (the front door) was not started with this config's ingress.haproxy and "
            "limits.max_body_bytes: %s. It takes them when Serve starts: start Serve with `python -m "
            "app.serve_env serve run FILE` (make serve) or the env vars of configs/default.yaml",
            ", ".join(f"{k}={got!r} (wants {want!r})" for k, (got, want) in differ.items()),
        )
    return differ


def planner_of(app_name: str) -> Any:
    """The planner actor of a running app (for tools, tests and benchmarks; raises LookupError)."""
    from actors.control.planner import find_planner

    return find_planner(app_name)


app = build_app()
