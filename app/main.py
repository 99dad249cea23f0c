"""The Serve application: ``serve run configs/default.yaml`` (what ``make serve`` runs) or ``serve run app.main:app``.

``build_app(args)`` is the application builder Serve calls with the ``args`` of a Serve config
file; ``app`` is the same application with every setting at its default (the embedded model).
Run either with the settings of ``app/serve_env.py`` (``make serve`` and the Serve config set them),
so HAProxy forwards requests straight to the model servers.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from actors.config import AppConfig
from deployments.server import build


def build_app(args: dict[str, Any] | AppConfig | None = None) -> serve.Application:
    """Validate ``args`` against the config schema and build the application."""
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    return build(cfg)


def planner_of(app_name: str) -> Any:
    """The planner actor of a running app (for tools, tests and benchmarks; raises LookupError)."""
    from actors.planner import find_planner

    return find_planner(app_name)


app = build_app()
