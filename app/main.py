"""The Serve application: ``serve run app.main:app`` or ``serve run configs/default.yaml``.

``build_app(args)`` is the application builder Serve calls with the ``args`` of a Serve config
file; ``app`` is the same application with every setting at its default (the embedded model).
"""

from __future__ import annotations

from typing import Any

from ray import serve

from app.config import AppConfig
from deployments.openai import build


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Validate ``args`` against the config schema and build the application."""
    return build(AppConfig.model_validate(args or {}).model_dump())


app = build_app()
