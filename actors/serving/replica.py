"""ModelReplica: one vLLM engine with LoRA on one node, and that node's dealings with the planner.

The model server deployment (``deployments/server.py``) holds one in its own process and serves
HTTP with vLLM's own FastAPI app on top of :attr:`ModelReplica.state`, so a streamed token goes
from the engine to the client without crossing another process. The profiler runs one as a
plain Ray actor (``app/profile.py``).

Besides the engine it keeps, for the planner:
- an :class:`ExecutionTrace` per request (arrival, first token, finish, token counts) and the
  engine's per-iteration facts (requests in flight, iterations, KV cache in use), in
  :attr:`ModelReplica.requests` (``actors/serving/request_traces.py``: the engine's own ``generate``
  and a vLLM stat logger record them);
- the adapter versions this node must serve, which it loads and unloads as the planner's
  :class:`AdapterAssignment` changes (a long poll, so a published version is served at once);
- which full model version the engine computes with, swapped in place without a restart by
  :meth:`ModelReplica.load_full_version` (``actors/serving/engine_weights.py``).

Traces and facts go to the planner in one :class:`NodeReport` per ``trace_flush_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.learning.lora.targets import module_shapes
from actors.learning.messages import FullVersion
from actors.learning.versions.fit import misfit, write_zero_lora
from actors.serving import cpu_affinity, cpu_executor, engine_iterations, engine_process
from actors.serving.engine_weights import (
    FINGERPRINT_METHOD,
    LOAD_METHOD,
    FullVersionLoad,
    combine_fingerprints,
    read_meta,
    version_of,
)
from actors.serving.messages import AdapterAssignment, AdapterLoadFailed, FullSynced, NodeRegistration, NodeReport
from actors.serving.request_traces import RequestTraces, engine_stats_logger, traced_engine_class

logger = logging.getLogger(__name__)

ASSIGNMENT_POLL_S = 30.0  # the planner answers an adapter long poll at least this often
HEARTBEAT_S = 5.0  # an idle replica still reports this often, so a restarted planner finds it
ENGINE_METRICS_S = 5.0  # vLLM's own Prometheus series go to the planner at most this often (for /metrics)
RETRY_S = 1.0
AFFINITY_EVERY_S = 60.0  # actors started after the replica are moved off the engine's cores within this


class ModelReplica:
    """One engine on one node. In-process: ``ModelReplica(...)``; as an actor: ``ray.remote(ModelReplica)``."""

    def __init__(
        self,
        node_id: int,
        vllm_flags: list[str],
        served_name: str,
        omp_threads: int | None = None,
        adapter_files: Any = None,
        keep_off_engine_cores: bool = False,
        quiet_engine_core: bool = False,
    ) -> None:
        self.node_id = node_id
        self._keep_off_engine_cores = keep_off_engine_cores
        if quiet_engine_core:
            # Read by this app's vLLM plugin in the engine-core process, which inherits this environment
            # (actors/serving/engine_process.py); one set already (0: a benchmark's comparison) wins.
            os.environ.setdefault(engine_process.QUIET_VAR, "1")
        self.files = adapter_files  # AdapterFiles: published versions as local directories (None: paths as given)
        self.served_name = served_name
        self._flags = vllm_flags
        self.started_at = time.time()
        self.engine: Any = None
        self.state: Any = None  # vLLM's app state (its OpenAI serving objects), shared with the HTTP app
        self.args: Any = None  # vLLM's parsed CLI namespace
        self.supported_tasks: tuple[str, ...] = ()
        self.max_model_len = 0
        self.requests = RequestTraces(node_id)  # the engine's requests: traces, those in flight, per-step facts
        self._reported = (0, 0, True)  # (received, finished, idle) as the last report said
        self._metrics_sent = float("-inf")  # when vLLM's series last went to the planner
        self._adapters: dict[str, dict[str, Any]] = {}  # "base:adapter" -> {version, lora_id, path}
        self._next_lora_id = 1
        self._load_failed: dict[str, tuple[tuple[int, str], str]] = {}  # model id -> ((version, path), error)
        self._assignment_epoch = -1
        self._full: dict[str, Any] | None = (
            None  # the full version loaded last: {version, path}; None: the start weights
        )
        self._weights_lock = asyncio.Lock()  # one full-weight sync at a time
        self._full_unit: str | None = None  # the training unit whose assigned version the engine computes with
        self._full_sync_s: float | None = None  # the last assigned sync's whole call
        self._fingerprint: str | None = None  # of the live weights after the last full sync
        self._tasks: list[asyncio.Task] = []
        if omp_threads:
            # Read by vLLM's CPU worker when the engine process starts; one engine must not
            # claim every core when several replicas share a host.
            os.environ.setdefault("OMP_NUM_THREADS", str(omp_threads))

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        """Build the engine and vLLM's serving objects (idempotent); returns :meth:`info`."""
        if self.engine is not None:
            return self.info()
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        args = make_arg_parser(FlexibleArgumentParser()).parse_args(self._flags)
        # Per-iteration figures for /metrics (actors/serving/engine_iterations.py), not one log line per step.
        args.enable_logging_iteration_details = True
        engine_iterations.install_log_filter()
        engine_args = AsyncEngineArgs.from_cli_args(args)
        in_process = cpu_executor.in_process_worker(engine_args)
        vllm_config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        with cpu_executor.worker_binding(vllm_config) if in_process else contextlib.nullcontext():
            engine = traced_engine_class().from_vllm_config(
                vllm_config,
                stat_loggers=[engine_stats_logger(self.requests)],
                enable_log_requests=engine_args.enable_log_requests,
                disable_log_stats=engine_args.disable_log_stats,
            )
        await self._warm_up(engine, str(Path(args.model).resolve()), bool(getattr(args, "enable_lora", False)))
        self.requests.max_model_len = engine.model_config.max_model_len
        engine.requests = self.requests  # from now on every request is recorded
        state = State()
        self.supported_tasks = tuple(await engine.get_supported_tasks())
        await init_app_state(engine, state, args, self.supported_tasks)
        self.args, self.state, self.engine = args, state, engine
        self.max_model_len = engine.model_config.max_model_len
        return self.info()

    async def _warm_up(self, engine: Any, model_dir: str, lora: bool) -> None:
        """Run the paths a first request would otherwise pay for under load, before traffic (not traced: this
        runs before the engine records requests). Measured on the tiny model with two streaming clients, each first
        use stalled every stream of the replica for about 2 s, once per engine:
        - the first request asking for ``logprobs``: vLLM compiles the sampler's logprob gather (torch
          dynamo; py-spy on the worker process: ``Sampler.gather_logprobs`` -> ``_compile``);
        - the base's module shapes (actors/learning/lora/targets.py), which created adapters and served versions are
          checked against: the first build imports the model's code and holds the GIL;
        - the engine's first LoRA, with one zero rank-1 adapter."""
        import tempfile

        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        params = SamplingParams(max_tokens=1, logprobs=1)
        async for _ in engine.generate("warm up", params, "warmup-logprobs"):
            pass
        if not lora:
            return
        shapes = await asyncio.to_thread(module_shapes, model_dir)
        with tempfile.TemporaryDirectory(prefix="lora-warmup-") as tmp:
            await asyncio.to_thread(write_zero_lora, tmp, shapes)
            zero = LoRARequest(lora_name="warmup", lora_int_id=self._next_lora_id, lora_path=tmp)
            self._next_lora_id += 1
            try:
                await engine.add_lora(zero)
                async for _ in engine.generate("warm up", params, "warmup-lora", lora_request=zero):
                    pass
                await engine.remove_lora(zero.lora_int_id)
            except Exception:  # a model without a q_proj, say: the first real version pays instead
                logger.warning("LoRA warm-up skipped", exc_info=True)

    def info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "ready": self.engine is not None,
            "model": self.served_name,
            "max_model_len": self.max_model_len,
            "in_flight": len(self.requests.live),
            "received": self.requests.received,
            "busy_seconds": self.requests.busy_seconds(),
            "adapters": {name: a["version"] for name, a in self._adapters.items()},
            "full_version": None if self._full is None else self._full["version"],
            "pid": os.getpid(),
        }

    async def check_health(self) -> None:
        """Raises if the engine is not running (Serve then replaces this replica)."""
        if self.engine is None:
            raise RuntimeError("engine not started")
        await self.engine.check_health()

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # ---- the planner -----------------------------------------------------------------------

    async def join(self, planner: Callable[[], Any], registration: NodeRegistration, flush_s: float) -> None:
        """Register with the planner, serve the adapters it assigns this node, then keep reporting.

        ``planner()`` returns the planner's current actor handle; it is called again after a
        failed call, so a planner that Serve recreated is found again.
        """
        assignment = await _retry(lambda: planner().register_node.remote(registration), "register with the planner")
        loaded = await self.apply_adapters(assignment)
        # Always, even with nothing new: the planner forgets a node's adapters when a new replica registers for it, and
        # routers send `base:adapter` only to nodes it knows serve it (else a replacement waits for the next publish).
        await planner().adapters_loaded.remote(
            self.node_id, assignment.epoch, loaded, self.full_synced(), self.load_failures()
        )
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._report_forever(planner, registration, flush_s)),
            loop.create_task(self._follow_assignments(planner)),
        ]
        if self._keep_off_engine_cores:
            self._tasks.append(loop.create_task(self._keep_others_off_engine_cores()))

    async def _keep_others_off_engine_cores(self) -> None:
        """Now and every AFFINITY_EVERY_S (actors start later too): this host's other Ray processes stay off the
        cores the engine's worker is bound to (actors/serving/cpu_affinity.py)."""
        first = True
        while True:
            try:
                done = await asyncio.to_thread(cpu_affinity.keep_off_engine_cores)
                if first:
                    logger.info("node %d: other processes kept off the engine's cores: %s", self.node_id, done)
                    first = False
            except Exception:  # a convenience for speed; never a reason to stop serving
                logger.warning("could not set CPU affinity", exc_info=True)
            await asyncio.sleep(AFFINITY_EVERY_S)

    async def _report_forever(self, planner: Callable[[], Any], registration: NodeRegistration, flush_s: float) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(flush_s)
            # Facts go out while requests are in flight and once more when the last one ends, so
            # the planner's view of an idle node is not a stale busy one.
            r = self.requests
            unchanged = not r.traces and not r.live and self._reported == (r.received, r.finished, True)
            if unchanged and time.monotonic() - last < HEARTBEAT_S:
                continue
            last = time.monotonic()
            report = self.take_report()
            try:
                known = await planner().report.remote(report)
                if not known:  # a new planner that has not seen this replica yet
                    await planner().register_node.remote(registration)
            except Exception:  # the planner restarting must not take the replica down
                logger.warning("could not report to the planner", exc_info=True)
                await asyncio.sleep(RETRY_S)

    async def _follow_assignments(self, planner: Callable[[], Any]) -> None:
        while True:
            try:
                assignment = await planner().adapter_assignment.remote(
                    self.node_id, self._assignment_epoch, ASSIGNMENT_POLL_S
                )
                if assignment.epoch != self._assignment_epoch:
                    loaded = await self.apply_adapters(assignment)
                    await planner().adapters_loaded.remote(
                        self.node_id, assignment.epoch, loaded, self.full_synced(), self.load_failures()
                    )
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("adapter assignment failed; asking again", exc_info=True)
                await asyncio.sleep(RETRY_S)

    def take_report(self) -> NodeReport:
        """Traces since the last report, counters and the engine's facts."""
        r = self.requests
        traces = r.take_traces()
        self._reported = (r.received, r.finished, not r.live)
        metrics = None
        if time.monotonic() - self._metrics_sent >= ENGINE_METRICS_S or not r.live:
            self._metrics_sent = time.monotonic()
            metrics = engine_metrics_text()
        return NodeReport(
            node_id=self.node_id,
            traces=tuple(traces),
            received=r.received,
            finished=r.finished,
            in_flight=len(r.live),
            busy_seconds=r.busy_seconds(),
            engine=r.facts(),
            at=time.time(),
            prefix_cache_queries=getattr(r.stats, "prefix_cache_queries", 0),
            prefix_cache_hits=getattr(r.stats, "prefix_cache_hits", 0),
            engine_metrics=metrics,
            tenant_tokens=() if self.engine.admission is None else self.engine.admission.take_served(),
        )

    # ---- profiling -------------------------------------------------------------------------

    async def measure(
        self, batch: int, prompt_tokens: int, max_tokens: int, repeats: int = 3, seed: int = 0
    ) -> list[float]:
        """Wall seconds for ``batch`` concurrent requests of fixed size, straight on the engine.

        Prompts are random byte-range token ids, fresh per repeat, so the prefix cache never hits;
        ``ignore_eos`` makes every request run exactly ``max_tokens`` iterations (app/profile.py).
        """
        import random
        import uuid

        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rng = random.Random(seed)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)

        async def one(ids: list[int]) -> None:
            async for _ in self.engine.generate(
                TokensPrompt(prompt_token_ids=ids), params, request_id=uuid.uuid4().hex
            ):
                pass

        times = []
        for _ in range(repeats):
            prompts = [[rng.randrange(3, 256) for _ in range(prompt_tokens)] for _ in range(batch)]
            t0 = time.perf_counter()
            await asyncio.gather(*(one(p) for p in prompts))
            times.append(time.perf_counter() - t0)
        return times

    # ---- adapters --------------------------------------------------------------------------

    async def apply_adapters(self, assignment: AdapterAssignment) -> dict[str, int]:
        """Serve exactly the assigned versions: load what differs, unload what is no longer assigned.

        Returns the loaded versions by adapter name. The assignment is the planner's truth, so an
        older version is loaded too (a rollback); the planner decides when that is allowed.
        """
        try:
            await self.apply_full(assignment.full)
        except Exception:  # the old weights still serve (the worker checks a checkpoint before it changes any)
            logger.exception("node %d could not sync full version %s", self.node_id, assignment.full)
        wanted = {f"{self.served_name}:{name}": (name, v) for name, v in assignment.adapters.items()}
        for model_id, (name, v) in wanted.items():
            current = self._adapters.get(model_id)
            if current is None or current["version"] != v.version or current["path"] != v.path:
                if self._load_failed.get(model_id, (None, None))[0] == (v.version, v.path):
                    continue  # this version failed here before: its adapter is paused, not retried each epoch
                try:
                    await self.load_adapter(name, v.version, v.path)
                    self._load_failed.pop(model_id, None)
                except Exception as exc:
                    logger.exception("node %d could not load %s v%d from %s", self.node_id, model_id, v.version, v.path)
                    self._load_failed[model_id] = ((v.version, v.path), f"{type(exc).__name__}: {str(exc)[:500]}")
        for model_id in [m for m in self._adapters if m not in wanted]:
            await self.unload_adapter(model_id.split(":", 1)[1])
        self._assignment_epoch = assignment.epoch
        return {m.split(":", 1)[1]: a["version"] for m, a in self._adapters.items()}

    def load_failures(self) -> dict[str, AdapterLoadFailed]:
        """Adapter -> the assigned version this node could not load, and why (the planner pauses the adapter)."""
        return {
            m.split(":", 1)[1]: AdapterLoadFailed(version, message)
            for m, ((version, _), message) in self._load_failed.items()
        }

    def served_version(self, model_id: str) -> int | None:
        """The version of ``base:adapter`` this node serves now (None: not loaded); stored completions pin it."""
        loaded = self._adapters.get(model_id)
        return None if loaded is None else loaded["version"]

    async def load_adapter(self, adapter: str, version: int, path: str) -> dict[str, Any]:
        """Serve ``path`` as version ``version`` of ``base:adapter``; later requests use it.

        Every version gets its own LoRA int id and path, so vLLM's prefix cache (keyed by LoRA
        name and path) never serves blocks computed by an older version (vLLM #42125).
        """
        from vllm.lora.request import LoRARequest

        model_id = f"{self.served_name}:{adapter}"
        # The published location may be on another node or behind a URI: vLLM loads a local copy.
        local = path if self.files is None else await asyncio.to_thread(self.files.local_path, adapter, version, path)
        # vLLM loads a LoRA of the wrong shapes silently and serves it: check the version fits the base first.
        base = getattr(self.args, "model", None)  # the served model's directory, from the engine's flags
        why = None if base is None else await asyncio.to_thread(misfit, local, base)
        if why is not None:
            raise ValueError(why)
        lora = LoRARequest(lora_name=model_id, lora_int_id=self._next_lora_id, lora_path=local)
        self._next_lora_id += 1
        await self.engine.add_lora(lora)  # loads now, so the first request pays nothing
        models = self.state.openai_serving_models
        old = models.lora_requests.get(model_id)
        models.lora_requests[model_id] = lora
        self._adapters[model_id] = {"version": version, "lora_id": lora.lora_int_id, "path": path}
        if old is not None:
            await self.engine.remove_lora(old.lora_int_id)
        return {"model": model_id, "version": version, "loaded": True}

    async def unload_adapter(self, adapter: str) -> bool:
        model_id = f"{self.served_name}:{adapter}"
        lora = self.state.openai_serving_models.lora_requests.pop(model_id, None)
        self._adapters.pop(model_id, None)
        if lora is None:
            return False
        await self.engine.remove_lora(lora.lora_int_id)
        return True

    # ---- full model versions ---------------------------------------------------------------

    async def apply_full(self, full: FullVersion | None) -> None:
        """Compute with the assigned full version (None: the model the engine started with) if it is not live yet."""
        current = None if self._full is None else (self._full["version"], self._full["path"])
        wanted = None if full is None else (full.version, full.path)
        if wanted == current:
            return
        if full is None:
            load = await self.load_full_version(str(self.engine.model_config.model), 0)
            self._full = None  # version 0: the starting weights again
        else:
            load = await self.load_full_version(full.path, full.version)
        self._full_unit = None if full is None else full.unit
        self._full_sync_s = load.total_s
        logger.info(
            "node %d: full sync to %s took %.3f s (engine load %.3f s)",
            self.node_id,
            "the starting model" if full is None else f"{full.unit} v{full.version}",
            load.total_s,
            load.load_s,
        )

    def full_synced(self) -> FullSynced:
        """The full version the engine computes with now and what its last assigned sync cost, for the planner."""
        version = None if self._full is None else self._full["version"]
        return FullSynced(self._full_unit, version, self._full_sync_s, self._fingerprint, time.time())

    async def load_full_version(self, path: str, version: int) -> FullVersionLoad:
        """Compute with the full checkpoint published at ``path`` from now on, without restarting the engine.

        ``path`` is a version directory (``<root>/<unit>/v<N>`` with ``model.safetensors`` and
        ``meta.json``); a rollback is this same call with an earlier version's directory (or the
        model directory the engine started from). The published location becomes a local
        directory first, as adapter versions do (``AdapterFiles.local_path``: the store's node
        reads it in place, another node fetches a copy once; that module's completeness check
        knows only adapter files so far, so another node refuses a full version, loudly), then:

        1. ``pause_generation(mode="keep", clear_cache=True)``, vLLM's own step before a weight
           update: the scheduler stops between two steps, keeping every request (new ones queue),
           and resets the prefix cache with ``reset_running_requests``: the running requests are
           preempted and every cached block is forgotten, so no KV computed with the old weights
           is used again (a plain ``reset_prefix_cache()`` fails while any request holds blocks,
           which under load is always). Nothing steps until the resume, so resetting before the
           load is as good as after it.
        2. the worker extension loads the checkpoint into the running model (every worker, in
           place: the engine's KV cache, compiled graphs and LoRA slots stay allocated).
        3. ``resume_generation()``, also when the load failed: the old weights then still serve,
           since the worker checks the checkpoint's names and shapes before it changes anything.

        A request in flight is not broken: it resumes from its prompt and the tokens already
        streamed, recomputed with the new weights (its first tokens came from the old version,
        the rest from the new; the client sees one unbroken stream).
        New requests and in-flight streams stall for steps 1-3 plus the recompute of the
        preempted requests (``bench/weight_sync.py`` measures both).
        """
        async with self._weights_lock:
            t0 = time.perf_counter()
            local = path
            # The directory the engine started from is on every node already (a rollback to it).
            if self.files is not None and os.path.realpath(path) != os.path.realpath(self.engine.model_config.model):
                unit, _ = version_of(path)
                local = await asyncio.to_thread(self.files.local_path, unit, version, path)
            meta = await asyncio.to_thread(read_meta, local)
            previous = None if self._full is None else self._full["version"]
            await self.engine.pause_generation(mode="keep", clear_cache=True)
            try:
                loads = await self.engine.collective_rpc(LOAD_METHOD, args=(local,))
            finally:
                await self.engine.resume_generation()
            total = time.perf_counter() - t0
            self._full = {"version": int(version), "path": path}
            fingerprint = await self.weights_fingerprint()
            self._fingerprint = fingerprint
            logger.info("node %d serves full version %d from %s (%.2f s)", self.node_id, version, local, total)
            return FullVersionLoad(
                node_id=self.node_id,
                version=int(version),
                path=path,
                local_path=str(local),
                previous_version=previous,
                tensors=sum(r["tensors"] for r in loads),
                bytes=sum(r["bytes"] for r in loads),
                load_s=max(r["seconds"] for r in loads),
                total_s=total,
                fingerprint=fingerprint,
                meta=meta,
            )

    async def weights_fingerprint(self) -> str:
        """A short digest of the weights the engine computes with now (equal digests: equal weights)."""
        return combine_fingerprints(await self.engine.collective_rpc(FINGERPRINT_METHOD))


async def _retry(call: Callable[[], Any], what: str, attempts: int = 120) -> Any:
    """``await call()``, again after a pause while it fails (the planner may be starting or restarting)."""
    for attempt in range(attempts):
        try:
            return await call()
        except Exception as exc:
            if attempt == attempts - 1:
                raise
            if attempt % 10 == 0:
                logger.warning("%s failed (%s: %s); retrying", what, type(exc).__name__, exc)
            await asyncio.sleep(RETRY_S)
    raise AssertionError("unreachable")


def engine_metrics_text() -> str:
    """The ``vllm:`` series of this process's Prometheus registry: what vLLM's ``PrometheusStatLogger`` (which
    ``AsyncLLM`` adds by default) keeps of this node's engine (TTFT, inter-token and end-to-end latency, queue
    time, running and waiting requests, KV-cache usage, prefix-cache hits), the app's per-stage request
    histograms (actors/serving/request_stages.py) and per-iteration ones (actors/serving/engine_iterations.py), as exposition
    text."""
    from prometheus_client import REGISTRY, generate_latest

    keep = []
    for line in generate_latest(REGISTRY).decode().splitlines():
        name = line.split(" ", 3)[2] if line.startswith("# ") and line.count(" ") >= 2 else line
        if name.startswith(("vllm:", "coserve_request_stage_seconds", "coserve_engine_iteration_", "coserve_tenant_")):
            keep.append(line)
    return "\n".join(keep) + "\n" if keep else ""
