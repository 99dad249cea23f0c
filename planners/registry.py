"""One registry of named policies per decision kind, so ours and every baseline share one code path.

A policy module registers its classes with ``@register(kind, name)``; callers build one with
``create(kind, name, **params)`` from a config value and never import a policy class directly.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, TypeVar

# Modules whose import registers the policies of each kind; imported on first use.
_MODULES: dict[str, tuple[str, ...]] = {
    "placement": ("planners.placement",),
    "iteration": ("planners.coserving.policies",),
    "stages": ("planners.offline.search",),
    "retraining": ("planners.retraining",),
    "stage_order": ("planners.pipeline.orders",),
}
_POLICIES: dict[str, dict[str, Callable[..., Any]]] = {kind: {} for kind in _MODULES}

T = TypeVar("T")


def register(kind: str, name: str) -> Callable[[T], T]:
    """Class decorator: make ``cls`` available as policy ``name`` of ``kind``."""
    if kind not in _POLICIES:
        raise ValueError(f"unknown policy kind {kind!r}; kinds: {sorted(_POLICIES)}")

    def wrap(cls: T) -> T:
        existing = _POLICIES[kind].get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"{kind} policy {name!r} registered twice")
        _POLICIES[kind][name] = cls  # type: ignore[assignment]
        return cls

    return wrap


def _load(kind: str) -> dict[str, Callable[..., Any]]:
    if kind not in _POLICIES:
        raise ValueError(f"unknown policy kind {kind!r}; kinds: {sorted(_POLICIES)}")
    for module in _MODULES[kind]:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a real import error inside the module
                raise
    return _POLICIES[kind]


def names(kind: str) -> list[str]:
    """Registered policy names of ``kind``, sorted."""
    return sorted(_load(kind))


def accepts(kind: str, name: str, param: str) -> bool:
    """Whether policy ``name`` of ``kind`` takes the keyword ``param`` (e.g. ``cost_model``)."""
    import inspect

    policies = _load(kind)
    if name not in policies:
        raise ValueError(f"unknown {kind} policy {name!r}; choose one of {sorted(policies)}")
    return param in inspect.signature(policies[name]).parameters


def create(kind: str, name: str, **params: Any) -> Any:
    """Build the policy ``name`` of ``kind`` with ``params`` (from config)."""
    policies = _load(kind)
    if name not in policies:
        raise ValueError(f"unknown {kind} policy {name!r}; choose one of {sorted(policies)}")
    return policies[name](**params)
