"""Where a trainer rank's threads run on a CPU host: apart from the cores vLLM's CPU engines are bound to, on them, or anywhere.

vLLM binds the OpenMP threads that run the model to cores (``VLLM_CPU_OMP_THREADS_BIND=auto``: on a 2-core
host, core 0; in its worker process, or in the engine-core process with ``engine.cpu_executor`` uni), and
``actors/serving/cpu_affinity.py`` keeps the app's other Ray processes off those cores. A trainer rank places
itself (:func:`place_trainer`, called before each micro-step, since engines start and restart): ``apart`` keeps
its threads off the engine's cores (with the app's other processes), ``shared`` puts them on those cores,
``any`` leaves the choice to the kernel; ``training.cpu_priority`` sets their priority (``low``: nice 19,
``idle``: SCHED_IDLE), so on a shared core the processes that serve get it first. Which hurts the engine least
was measured (docs/benchmarks.md, issue 38), and ``training.cpu_placement`` defaults to it. The ``/proc``
reading lives here, in the room both the trainer and the replica may import.
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_PLACEMENTS = ("apart", "shared", "any")
CPU_PRIORITIES = ("normal", "low", "idle")
LOW_NICE = 19


def argv_of(pid: int) -> list[str]:
    """A process's command line (its title, for Ray's and vLLM's processes)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def comm_of(pid: int) -> str:
    """A process's short name."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def user_pids() -> list[int]:
    """This user's processes."""
    uid = os.getuid()
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def _title(pid: int) -> str:
    return (argv_of(pid) or [""])[0] or comm_of(pid)


def engine_cores(pids: list[int] | None = None) -> set[int]:
    """The cores this host's vLLM CPU engines (among ``pids``; default: this user's processes) run their model on:
    a worker process's (vLLM's multiprocess executor), or an engine-core process's own where it is bound to fewer
    than every core (the model runs in it: ``actors/serving/cpu_executor.py``; unbound, it only schedules)."""
    every = set(range(os.cpu_count() or 1))
    cores: set[int] = set()
    for pid in user_pids() if pids is None else pids:
        title = _title(pid)
        worker, engine_core = title.startswith("VLLM::Worker"), title.startswith("VLLM::EngineCor")
        if not (worker or engine_core):
            continue
        try:
            bound = os.sched_getaffinity(pid)
        except OSError:
            continue
        if worker or bound != every:
            cores |= bound
    return cores


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")]
    except OSError:
        return [0]


def set_priority(priority: str) -> str:
    """Set every thread of this process to ``priority`` (Linux keeps niceness and policy per thread; threads
    started later inherit their creator's): ``normal`` leaves the priority the process started with (Ray's
    workers', as the replica's), ``low`` is nice 19 (on a shared core the others get about 98% of it while
    they want it), ``idle`` SCHED_IDLE (only what nothing else wants)."""
    if priority not in CPU_PRIORITIES:
        raise ValueError(f"unknown CPU priority {priority!r}; expected one of {CPU_PRIORITIES}")
    if priority == "normal":
        return priority
    for tid in _threads():
        try:
            if priority == "idle":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, tid, LOW_NICE)
        except OSError:  # exited meanwhile
            continue
    return priority


def place_trainer(placement: str, pids: list[int] | None = None, priority: str = "normal") -> dict[str, object]:
    """Set this process's threads to the cores ``placement`` names (see the module docstring) and to ``priority``;
    returns what was done. The cores stay as they are when no engine worker runs on this host, or ``apart``
    would leave no core."""
    if placement not in CPU_PLACEMENTS:
        raise ValueError(f"unknown CPU placement {placement!r}; expected one of {CPU_PLACEMENTS}")
    set_priority(priority)
    every = set(range(os.cpu_count() or 1))
    engine = engine_cores(pids)
    cores = {"apart": every - engine, "shared": engine, "any": every}[placement]
    if not engine or not cores:
        return {
            "placement": placement,
            "priority": priority,
            "engine_cores": sorted(engine),
            "cores": None,
            "reason": "no vLLM CPU worker on this host" if not engine else "the engine workers hold every core",
        }
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # exited meanwhile
            continue
    return {"placement": placement, "priority": priority, "engine_cores": sorted(engine), "cores": sorted(cores)}
