"""vLLM's model worker inside the engine-core process on a CPU host, its OpenMP threads bound as vLLM binds a worker.

On one GPU vLLM runs the model in the engine-core process (its ``UniProcExecutor``). On CPU its platform turns
``--distributed-executor-backend uni`` into ``mp``, one worker process more per replica, because OpenMP reads
its binding (``OMP_PLACES``, ``OMP_PROC_BIND``, ``OMP_NUM_THREADS``) from the environment once, as its library
loads, and vLLM sets that environment only as it spawns a worker. The engine-core process is spawned by the
replica as well, so the same environment, from vLLM's own ``OMPProcessManager`` for rank 0, set around that spawn
binds it the same way. A replica then starts without the worker's spawn and import (measured on the tiny model:
29.7 -> 23.6 s to ready, 8.0 -> 6.0 s to remove; docs/benchmarks.md) and holds one interpreter less.

``engine.cpu_executor`` chooses (``uni`` by default, ``mp`` for vLLM's own CPU arrangement).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def in_process_worker(engine_args: Any) -> bool:
    """Whether ``engine_args`` (vLLM's ``AsyncEngineArgs``) ask for the worker in the engine-core process on CPU;
    if so, points them at vLLM's in-process executor class, which the CPU platform leaves as it is."""
    if engine_args.distributed_executor_backend != "uni":
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False  # vLLM honours "uni" on an accelerator
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    engine_args.distributed_executor_backend = UniProcExecutor
    return True


@contextlib.contextmanager
def worker_binding(vllm_config: Any) -> Iterator[None]:
    """The OpenMP environment vLLM gives its rank-0 CPU worker, set while the engine-core process is spawned
    (restored after: this process's own OpenMP was set up when it loaded)."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    with OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0):
        yield
