"""What a replica's engine runs in vLLM's own processes: a vLLM general plugin (entry point ``vllm.general_plugins``).

vLLM runs every general plugin in each of its processes as it starts (the engine core: ``EngineCore.__init__``,
before its executor; the workers). This one acts only in the engine-core process of one of this app's replicas,
which sets :data:`QUIET_VAR` in its environment before it builds its engine (the engine core inherits it); in
any other vLLM (the benchmarks' plain vLLM, Ray Serve LLM) it does nothing.

There (``engine.cpu_executor`` mp: with uni the engine core computes the step itself and waits for no worker), the
engine core waits for its worker's step output in short sleeps (:data:`POLL_S`) instead of spinning
(``compat.engine_core_waits_without_spinning``). On a CPU host the worker computes each step for milliseconds
(about 10 on the tiny model, 70 on SmolLM2) while vLLM's engine core calls ``sched_yield`` in a loop, on the
core the front end, HAProxy and the clients share. Measured on the tiny model, a burst of 100 requests: the
engine core used 1.5 CPU-s spinning and 0.55 with this wait; the burst ran at 27.4-27.6 against 28.9-31.2 req/s,
TTFT p50 1.6-1.8 against 1.2-1.4 s (docs/benchmarks.md, issue 39). A sleep of 0.2 ms adds at most that to a step.
(vLLM's own idle path, a wait for the worker's notification,
lost the notification on every step here: each step then took vLLM's 5-s recheck.)
"""

from __future__ import annotations

import logging
import multiprocessing
import os

QUIET_VAR = "COSERVE_ENGINE_CORE_QUIET"
POLL_S = 0.0002  # how long the engine core sleeps between two looks at its worker's output

logger = logging.getLogger(__name__)


def configure() -> None:
    """The plugin: in a replica's engine-core process that asked for it, the quiet wait; elsewhere nothing."""
    if os.environ.get(QUIET_VAR) != "1" or not multiprocessing.current_process().name.startswith("EngineCore"):
        return
    import compat

    if compat.engine_core_waits_without_spinning(POLL_S):
        logger.info(
            "engine core: waits for its workers' steps in %.1f-ms sleeps, not spinning "
            "(actors/serving/engine_process.py)",
            POLL_S * 1000,
        )
