"""Keeps this host's other Ray processes off the cores vLLM's CPU engine workers are bound to; places the trainer ranks.

vLLM's CPU worker binds its OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND=auto``: on a
2-core host the worker takes core 0 and leaves core 1 "reserved" for everything else), but nothing
tells Ray: Ray's daemons, Serve's actors, HAProxy and this app's control actors keep both cores in
their affinity, and the kernel runs them on the engine's core whenever the other is busy. Measured
on the tiny model, one app, four alternating saturation runs (docs/benchmarks.md, issue 28): with
those processes kept on the reserved core, 36.68 and 34.39 req/s against 30.56 and 30.40 without.

:func:`keep_off_engine_cores` runs once in each replica after its engine has started. It reads the
cores the host's engines run their model on (each ``VLLM::Worker``'s, or a bound ``VLLM::EngineCore``'s with
``engine.cpu_executor`` uni: ``actors/serving/cpu_executor.py``) and sets every other Ray process (and each of its
threads) of this user to the remaining cores. It leaves alone the engine processes themselves, the
trainer ranks, which place themselves (``actors/learning/lora/cpu_placement.py``, ``training.cpu_placement``), and the
raylet, whose children inherit its affinity; it does nothing when the workers hold every core.

The cores the engine workers hold are read from ``/proc`` by the learning room's
``actors/learning/lora/cpu_placement.py``, which also places the trainer ranks.
"""

from __future__ import annotations

import logging
import os

from actors.learning.lora.cpu_placement import argv_of, engine_cores, user_pids

logger = logging.getLogger(__name__)

# Ray's processes: actors and workers by their title, daemons by their program (matched on the program, never on
# arguments: the raylet's command line names the others). The raylet is left alone: it forks every new worker
# process, which inherits its affinity, and a trainer rank or a restarted replica's engine must start with
# every core (vLLM binds its worker from what it sees).
PROGRAMS = frozenset({"gcs_server", "haproxy"})
SCRIPTS = (
    "dashboard/dashboard.py",
    "dashboard/agent.py",
    "log_monitor.py",
    "autoscaler/_private/monitor.py",
    "runtime_env/agent/main.py",
)
LEFT_ALONE = ("ray::TrainRank", "ray::IDLE")


def _is_ray_process(argv: list[str]) -> bool:
    if not argv or not argv[0]:
        return False
    if argv[0].startswith("ray::"):
        return not argv[0].startswith(LEFT_ALONE)
    if os.path.basename(argv[0]) in PROGRAMS:
        return True
    return "python" in os.path.basename(argv[0]) and any(a.endswith(SCRIPTS) for a in argv[1:3])


def keep_off_engine_cores(pids: list[int] | None = None) -> dict[str, object]:
    """Set every other Ray process of this host (all its threads) to the cores the engine workers leave;
    returns what was done, for the replica's log. ``pids``: the processes to look at (default: this user's)."""
    pids = user_pids() if pids is None else pids
    every = set(range(os.cpu_count() or 1))
    engine = engine_cores(pids)
    others = every - engine
    if not engine or not others:
        return {
            "engine_cores": sorted(engine),
            "moved": 0,
            "reason": "the engine workers hold every core" if engine else "no vLLM CPU worker on this host",
        }
    moved = 0
    for pid in pids:
        if not _is_ray_process(argv_of(pid)):
            continue
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in threads:
            try:
                os.sched_setaffinity(tid, others)
            except OSError:  # exited meanwhile, or not ours to change
                continue
        moved += 1
    return {"engine_cores": sorted(engine), "other_cores": sorted(others), "moved": moved}
