"""The Serve apps live tests start beside the session app, in one harness: each test module states how to make its
app and when it is ready; the pool starts it behind the session's HTTP port and removes it with its feedback store."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True)
class AppPlan:
    """What an app's maker returns: the app config, and anything the tests need beside it (API keys, say)."""

    config: dict[str, Any]
    extras: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # what a request sends to be let in (an app with API keys)


@dataclass(frozen=True)
class AppSpec:
    """One test module's app: its Serve name and route prefix, how to make it in a fresh data directory, and
    when it is ready (a predicate on ``GET {url}/v1/status``, or ``None``: when ``/health`` answers 200)."""

    name: str
    make: Callable[[Path], AppPlan]
    ready: Callable[[dict[str, Any]], bool] | None = None
    timeout_s: float = 300.0
    route_prefix: str | None = None  # default: /<name>

    @property
    def prefix(self) -> str:
        return self.route_prefix or f"/{self.name}"


@dataclass
class StartedApp:
    url: str
    plan: AppPlan
    data_dir: Path


class Deploy(threading.Thread):
    """``serve.run`` of one app on a thread of its own: apps start while tests run, side by side with any other
    app still starting. A failure is kept for the main thread to raise."""

    def __init__(self, app: Any, name: str, route_prefix: str) -> None:
        super().__init__(name=f"deploy-{name}", daemon=True)
        self.app, self.app_name, self.route_prefix = app, name, route_prefix
        self.failure: BaseException | None = None

    def run(self) -> None:
        from ray import serve

        try:
            serve.run(self.app, name=self.app_name, route_prefix=self.route_prefix)  # returns once its deployments run
        except BaseException as e:
            self.failure = e

    def wait(self, deadline: float) -> None:
        """Join it by ``deadline`` (epoch seconds); raise its failure, or fail the test if it still runs."""
        import pytest

        self.join(max(0.0, deadline - time.time()))
        if self.is_alive():
            pytest.fail(f"{self.app_name}: deployments not running by the deadline")
        if self.failure is not None:
            raise self.failure


@dataclass
class _Begun:
    deploy: Deploy
    plan: AppPlan
    data_dir: Path


class AppPool:
    """Starts a module's app, waits until it is ready, and removes it when the module's tests are done. ``begin``
    starts an app's deploy in the background, ahead of the module that needs it (``tests/conftest.py`` does so for
    the apps of the first modules, while the unit tests run)."""

    def __init__(self, base_url: str, make_dir: Callable[[str], Path]) -> None:
        self.base_url = base_url
        self.make_dir = make_dir
        self.started: dict[str, StartedApp] = {}
        self.begun: dict[str, _Begun] = {}

    def deploy(self, app: Any, name: str, route_prefix: str) -> Deploy:
        """Begin ``serve.run`` of a built app in the background."""
        deploy = Deploy(app, name, route_prefix)
        deploy.start()
        return deploy

    def begin(self, spec: AppSpec) -> None:
        """Make ``spec``'s app in a fresh data directory and begin deploying it; ``serve`` waits for it."""
        from app.main import build_app

        if spec.name in self.begun or spec.name in self.started:
            return
        data = self.make_dir(spec.name)
        plan = spec.make(data)
        self.begun[spec.name] = _Begun(self.deploy(build_app(plan.config), spec.name, spec.prefix), plan, data)

    def serve(self, spec: AppSpec) -> StartedApp:
        """``spec``'s app, deployed in a fresh data directory, once ready; fails the test when it is not ready within
        ``spec.timeout_s``, or its trainer reports ``failed``."""
        import pytest

        if spec.name in self.started:  # a later module sharing it (tests/tenants_app.py)
            return self.started[spec.name]
        self.begin(spec)
        begun = self.begun.pop(spec.name)
        deadline, last = time.time() + spec.timeout_s, None
        begun.deploy.wait(deadline)
        app = self.started[spec.name] = StartedApp(self.base_url + spec.prefix, begun.plan, begun.data_dir)
        while time.time() < deadline:
            try:
                if spec.ready is None:
                    if httpx.get(f"{app.url}/health", timeout=10).status_code == 200:
                        return app
                else:
                    last = httpx.get(f"{app.url}/v1/status", headers=begun.plan.headers, timeout=10).json()
                    training = last.get("training") or {}
                    if training.get("state") == "failed":
                        pytest.fail(f"{spec.name}: trainer failed: {training}")
                    if spec.ready(last):
                        return app
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.25)
        pytest.fail(f"{spec.name} app not ready within {spec.timeout_s:.0f} s: {last}")

    def remove(self, name: str) -> None:
        """Delete app ``name`` and its feedback store: detached, it outlives its app (README "When an actor dies").
        Its replicas and trainer stop while the next module runs (Serve's graceful stop of a replica takes about
        7 s here); the tests that count the cluster's actors wait for the count to settle."""
        import ray
        from ray import serve

        app = self.started.pop(name, None)
        if app is None:
            return
        serve.delete(name, _blocking=False)
        try:
            ray.kill(ray.get_actor(f"{app.plan.config['name']}-store", namespace="coserve"), no_restart=True)
        except ValueError:  # the app never made one
            pass
