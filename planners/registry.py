"""One registry of named policies per decision kind, so ours and every baseline share one code path.

A policy module registers its classes with ``@register(kind, name)``; callers build one with
``create(kind, name, **params)`` from a config value and never import a policy class directly.

Names are per kind (``separate`` is a placement and an iteration policy), so what errors, logs and
listings show is the qualified name ``kind.name`` (``placement.separate``), unique across kinds. A
config field names its kind already, so its value stays the short name; ``create`` takes either.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

# Modules whose import registers the policies of each kind; imported on first use.
_MODULES: dict[str, tuple[str, ...]] = {
    "placement": ("planners.placement",),
    "iteration": ("planners.coserving.policies",),
    "stages": ("planners.offline.search",),
    "retraining": ("planners.retraining",),
    "stage_order": ("planners.pipeline.orders",),
    "admission": ("planners.fairness",),
}
_POLICIES: dict[str, dict[str, Callable[..., Any]]] = {kind: {} for kind in _MODULES}

T = TypeVar("T")


def qualified(kind: str, name: str) -> str:
    """The name of policy ``name`` of ``kind`` across kinds: ``kind.name``, e.g. ``placement.separate``."""
    return f"{kind}.{name}"


def register(kind: str, name: str) -> Callable[[T], T]:
    """Class decorator: make ``cls`` available as policy ``name`` of ``kind``; it learns its ``qualified_name``."""
    if kind not in _POLICIES:
        raise ValueError(f"unknown policy kind {kind!r}; kinds: {sorted(_POLICIES)}")
    if "." in name:
        raise ValueError(f"policy name {name!r}: a short name, without '.' (the registry qualifies it by its kind)")

    def wrap(cls: T) -> T:
        existing = _POLICIES[kind].get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"policy {qualified(kind, name)!r} registered twice")
        _POLICIES[kind][name] = cls  # type: ignore[assignment]
        cls.qualified_name = qualified(kind, name)  # type: ignore[attr-defined]  # what its logs and status show
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
    """Registered policy names of ``kind``, sorted: the short names, a config field's values."""
    return sorted(_load(kind))


def qualified_names(kind: str | None = None) -> list[str]:
    """The qualified names (``kind.name``) of the policies of ``kind`` (None: of every kind), sorted."""
    kinds = sorted(_POLICIES) if kind is None else [kind]
    return sorted(qualified(k, n) for k in kinds for n in _load(k))


def policy_class(kind: str, name: str) -> Callable[..., Any]:
    """The policy class ``name`` of ``kind``: its short name or its qualified name ``kind.name``."""
    policies = _load(kind)
    short = name[len(kind) + 1 :] if name.startswith(f"{kind}.") else name
    if short not in policies:
        raise ValueError(
            f"unknown policy {qualified(kind, short)!r}; choose one of "
            f"{', '.join(qualified(kind, n) for n in sorted(policies))}"
        )
    return policies[short]


@functools.cache
def accepts(kind: str, name: str, param: str) -> bool:
    """Whether policy ``name`` of ``kind`` takes the keyword ``param`` (e.g. ``cost_model``). Cached: a class's
    signature does not change, and the planner asks at every routing snapshot it builds."""
    import inspect

    return param in inspect.signature(policy_class(kind, name)).parameters


def create(kind: str, name: str, **params: Any) -> Any:
    """Build the policy ``name`` (short, as config gives it, or ``kind.name``) of ``kind`` with ``params``."""
    return policy_class(kind, name)(**params)
