"""Finds and reads the fitted cost model (a profile written by ``python -m app.profile``) for a model and device.

``load_profile`` is what the planner calls. It takes the profile matching the configured model and
device, and otherwise says so and falls back to ``planners.costs.default_cost_model()``.
"""

from __future__ import annotations

import json
from pathlib import Path

from planners.costs import CostModel, default_cost_model
from settings import AppConfig

SHIPPED_PROFILES = Path(__file__).resolve().parents[2] / "profiles"


def profile_name(served_name: str, device: str) -> str:
    return f"{served_name}-{device}.json"


def profile_paths(cfg: AppConfig, served_name: str) -> list[Path]:
    """Where a profile for this model and device may be: the data dir first, then the shipped ones."""
    name = profile_name(served_name, cfg.engine.device)
    return [cfg.data_path / "profiles" / name, SHIPPED_PROFILES / name]


def load_profile(cfg: AppConfig, served_name: str) -> tuple[CostModel, str]:
    """The fitted cost model for ``served_name`` on ``cfg.engine.device`` and a line saying which."""
    for path in profile_paths(cfg, served_name):
        if path.is_file():
            model = CostModel.from_dict(json.loads(path.read_text()))
            return (
                model,
                f"cost model: {path} (fitted {model.metadata.get('fitted_at', '?')} on {model.metadata.get('hardware', '?')})",
            )
    tried = ", ".join(str(p) for p in profile_paths(cfg, served_name))
    return default_cost_model(), (
        f"cost model: no profile for model {served_name!r} on {cfg.engine.device} (looked in {tried}); "
        "using the documented default (planners.costs.default_cost_model). Run `python -m app.profile` to fit one."
    )
