"""The learning routes as the model server runs them, behind the real request guard over a real feedback store:
one builder for the unit tests of the routes, their tenants and the schema fuzzer, with stand-ins for the store's
actor handle and the planner (the Ray actors they talk to)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from ray.exceptions import RayActorError

from actors.learning.store.sqlite import FeedbackDatabase
from deployments.guard import RequestGuard
from deployments.http import ServiceUnavailable, install_error_handlers
from deployments.keys import KeyRing
from deployments.learning import LearningRoutes
from settings import AppConfig, LimitsConfig

# The tiny Llama's LoRA-targetable modules, without building it (tests/integration does).
TINY_LORA_PARTS = ("self_attn.q_proj", "self_attn.v_proj")


def tiny_shapes(
    layers: int = 4, hidden: int = 256, intermediate: int = 768, vocab: int = 259
) -> dict[str, tuple[int, int]]:
    """The embedded tiny Llama's module -> (in, out) features (actors.models.default_model.DEFAULT_SPEC), as
    actors.learning.lora.targets.module_shapes builds them, without torch."""
    shapes: dict[str, tuple[int, int]] = {"model.embed_tokens": (vocab, hidden), "lm_head": (hidden, vocab)}
    for i in range(layers):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"model.layers.{i}.self_attn.{part}"] = (hidden, hidden)
        shapes[f"model.layers.{i}.mlp.gate_proj"] = shapes[f"model.layers.{i}.mlp.up_proj"] = (hidden, intermediate)
        shapes[f"model.layers.{i}.mlp.down_proj"] = (intermediate, hidden)
    return shapes


class _Method:
    def __init__(self, actor: FakeStoreActor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.actor.call(self.name, *args, **kwargs)


class FakeStoreActor:
    """Stands in for the FeedbackStore actor handle: ``q.<method>.remote(...)`` runs the real store's method
    in a thread; a name in ``die_after`` makes its next call commit and then fail as if the actor died before
    replying, one in ``die_before`` makes it fail before it runs."""

    def __init__(self, store: FeedbackDatabase) -> None:
        self.store = store
        self.adapters_root = store.path.parent / "adapters"  # as the actor's data_dir/adapters
        self.die_after: set[str] = set()
        self.die_before: set[str] = set()

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if name in self.die_before:
            self.die_before.discard(name)
            raise RayActorError()
        result = await asyncio.to_thread(self._method(name), *args, **kwargs)
        if name in self.die_after:
            self.die_after.discard(name)
            raise RayActorError()
        return result

    def _method(self, name: str) -> Callable[..., Any]:
        """The store's method, or what the actor adds to it: an upload's version, a version's files."""
        if name == "add_version":
            from actors.learning.store.uploads import add_uploaded_version

            return functools.partial(add_uploaded_version, self.store, self.adapters_root, None)
        if name == "read_version":
            from actors.learning.versions.layout import read_version_files

            return functools.partial(read_version_files, self.adapters_root)
        return getattr(self.store, name)


class Planner:
    """How the planner answers: ``mode`` away (ServiceUnavailable, as ModelServer._ask_planner raises it), dead
    (RayActorError), hangs (never answers), or ok."""

    def __init__(self) -> None:
        self.mode, self.calls = "away", 0

    async def __call__(self, call: Callable[[Any], Any]) -> Any:
        self.calls += 1
        if self.mode == "away":
            raise ServiceUnavailable("The planner is restarting; retry in a few seconds.")
        if self.mode == "dead":
            raise RayActorError()
        if self.mode == "hangs":
            await asyncio.sleep(3600)
        return None


def guarded_learning_app(
    cfg: AppConfig,
    store: FeedbackDatabase,
    *,
    planner: Planner | None = None,
    keys: KeyRing | None = None,
    limits: LimitsConfig | None = None,
    planner_timeout_s: float = 0.2,
    lora_parts: Sequence[str] = TINY_LORA_PARTS,
    openapi: bool = False,
) -> tuple[FastAPI, FakeStoreActor, Planner]:
    """(the app, the store's stand-in actor, the planner): the routes installed over ``store``, behind the guard
    with ``keys`` (default: none, local mode, which the guard sets explicitly; without the guard the routes refuse
    every request, having no principal) and ``limits`` (default: ``cfg.limits``); ``openapi``: the app's own
    document, unguarded, as the fuzzer reads it."""
    actor, planner = FakeStoreActor(store), planner or Planner()
    routes = LearningRoutes(cfg, planner)
    routes.planner_timeout_s = planner_timeout_s

    async def find_store() -> Any:
        return actor

    async def lora_modules() -> frozenset[str]:
        return frozenset(f"model.layers.0.{part}" for part in lora_parts)

    routes._find_store = find_store  # type: ignore[method-assign]
    routes._lora_modules = lora_modules  # type: ignore[method-assign]
    app = FastAPI()
    install_error_handlers(app)
    routes.install(app)
    shapes = tiny_shapes()
    routes.files.shapes = lambda: shapes  # type: ignore[method-assign]
    if openapi:
        from deployments.openapi import install_openapi

        install_openapi(app, guarded=False, max_lora_rank=cfg.engine.max_lora_rank)
    app.add_middleware(RequestGuard, keys=keys or KeyRing({}), limits=limits or cfg.limits)
    return app, actor, planner
