"""Other Ray processes are moved off the cores a vLLM CPU worker is bound to; the trainer ranks and the engine are not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from actors.learning.lora import cpu_placement
from actors.serving import cpu_affinity

pytest.importorskip("setproctitle", reason="setproctitle (Ray's dependency) titles the stand-in processes")


def _titled(title: str, cores: set[int]) -> subprocess.Popen:
    code = (
        "import setproctitle, sys, time; setproctitle.setproctitle(sys.argv[1]); "
        "open(sys.argv[2], 'w').close(); time.sleep(60)"
    )
    flag = f"/tmp/coserve-affinity-{os.getpid()}-{abs(hash(title))}"
    proc = subprocess.Popen([sys.executable, "-c", code, title, flag])
    deadline = time.time() + 20
    while not os.path.exists(flag) and time.time() < deadline:
        time.sleep(0.05)
    os.unlink(flag)
    os.sched_setaffinity(proc.pid, cores)
    return proc


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores: one for the engine, one for the rest")
def test_ray_processes_leave_the_engines_core_and_trainer_ranks_stay():
    every = set(range(os.cpu_count()))
    engine_core = {0}
    procs = {name: _titled(name, every) for name in ("ray::Planner", "ray::TrainRank.watch")}
    procs["VLLM::Worker"] = _titled("VLLM::Worker", engine_core)
    try:
        # Only these processes: the suite's own apps may run engines on other cores of this host meanwhile.
        done = cpu_affinity.keep_off_engine_cores([p.pid for p in procs.values()])
        assert done["engine_cores"] == [0] and done["other_cores"] == sorted(every - engine_core), done
        assert os.sched_getaffinity(procs["ray::Planner"].pid) == every - engine_core
        assert os.sched_getaffinity(procs["ray::TrainRank.watch"].pid) == every  # trains in granted windows
        assert os.sched_getaffinity(procs["VLLM::Worker"].pid) == engine_core
        # Workers that hold every core between them leave nothing to move to: nothing changes.
        os.sched_setaffinity(procs["ray::Planner"].pid, every)
        os.sched_setaffinity(procs["VLLM::Worker"].pid, every)
        assert cpu_affinity.keep_off_engine_cores([p.pid for p in procs.values()])["moved"] == 0
        assert os.sched_getaffinity(procs["ray::Planner"].pid) == every
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores: one for the engine, one for the rest")
def test_a_trainer_rank_puts_its_threads_apart_from_the_engine_or_on_its_cores():
    every = set(range(os.cpu_count()))
    worker = _titled("VLLM::Worker", {0})
    before = os.sched_getaffinity(0)
    threads = [int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")]
    try:
        done = cpu_placement.place_trainer("apart", [worker.pid])
        assert done["cores"] == sorted(every - {0}) and os.sched_getaffinity(0) == every - {0}
        assert cpu_placement.place_trainer("shared", [worker.pid])["cores"] == [0]
        assert os.sched_getaffinity(0) == {0}
        assert cpu_placement.place_trainer("any", [worker.pid])["cores"] == sorted(every)
        assert cpu_placement.place_trainer("apart", [])["cores"] is None  # no engine on this host: unchanged
        with pytest.raises(ValueError, match="unknown CPU placement"):
            cpu_placement.place_trainer("nowhere", [worker.pid])
    finally:
        for tid in threads:
            try:
                os.sched_setaffinity(tid, before)
            except OSError:
                pass
        worker.kill()
        worker.wait()


def test_a_trainer_rank_lowers_its_priority_in_every_thread():
    """In a process of its own (a thread's nice cannot go back down unprivileged): every thread, not just the main one."""
    code = (
        "import os, sys, threading, time; sys.path.insert(0, sys.argv[1]);"
        "from actors.learning.lora import cpu_placement as c;"
        "t = threading.Thread(target=time.sleep, args=(2,)); t.start();"
        "c.set_priority('low'); nices = {os.getpriority(os.PRIO_PROCESS, int(x)) for x in os.listdir('/proc/self/task')};"
        "c.set_priority('idle'); idle = {os.sched_getscheduler(int(x)) for x in os.listdir('/proc/self/task')};"
        "print(sorted(nices), sorted(idle) == [os.SCHED_IDLE])"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[19] True", (out.stdout, out.stderr)
    with pytest.raises(ValueError, match="unknown CPU priority"):
        cpu_placement.set_priority("urgent")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores: one for the engine, one for the rest")
def test_an_engine_core_counts_as_the_engine_only_where_it_is_bound():
    """With ``engine.cpu_executor`` uni the model runs in the engine-core process, bound as a worker would be;
    with ``mp`` that process only schedules, on every core, and its worker is the engine."""
    every = set(range(os.cpu_count()))
    core = _titled("VLLM::EngineCore", every)
    try:
        assert cpu_placement.engine_cores([core.pid]) == set()  # unbound: a scheduler beside its workers
        os.sched_setaffinity(core.pid, {1})
        assert cpu_placement.engine_cores([core.pid]) == {1}
        done = cpu_affinity.keep_off_engine_cores([core.pid])
        assert done["engine_cores"] == [1] and os.sched_getaffinity(core.pid) == {1}  # the engine is left alone
    finally:
        core.kill()
        core.wait()
