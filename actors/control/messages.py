"""What the planner answers the HTTP layer: the models the app serves, and which nodes serve a loaded adapter version."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServedModels:
    """What the app serves: the base model and every ``base:adapter`` some node serves (for ``/v1/models``)."""

    base: str
    root: str
    """The base model's directory (the ``root`` of its model card)."""
    max_model_len: int
    adapters: tuple[str, ...]


@dataclass(frozen=True)
class AdapterLoaded:
    """The answer to loading (or unloading) an adapter version: the nodes that serve the change now."""

    model: str
    version: int | None
    nodes: tuple[int, ...]
