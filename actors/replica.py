"""ModelReplica: a Ray actor that holds one vLLM engine with LoRA and serves OpenAI requests.

The replica runs vLLM's own OpenAI serving classes (the ones ``vllm serve`` uses) on its engine,
so sampling parameters, chat templates, logprobs, stop strings and error messages behave
exactly as in vLLM. It yields ready-made response pieces (SSE lines or one JSON body) so the
ingress forwards them without re-encoding each token. It reports an execution trace per request
(arrival, start, first token, finish, token counts) to the planner, batched on a timer so the
planner sees one call per flush rather than one per request.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from dataclasses import asdict
from typing import Any, AsyncIterator

from actors.streams import coalesce
from planners.iteration import EngineFacts, LiveRequest
from planners.types import ExecutionTrace

logger = logging.getLogger(__name__)

# First item of every response stream: {"status": int, "stream": bool}; then str SSE pieces
# (stream) or exactly one JSON-able dict (non-stream / error).
Header = dict[str, Any]

# The planner's task id of the request being served; vLLM's serving classes call
# engine.generate with their own request ids, so the trace takes the task id from here.
_TASK_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("task_id", default=None)


class ModelReplica:
    """One engine on one node. Create with ``ray.remote(ModelReplica).options(...)``."""

    def __init__(
        self,
        node_id: int,
        vllm_flags: list[str],
        served_name: str,
        planner_name: str | None = None,
        namespace: str | None = None,
        trace_flush_seconds: float = 0.25,
        omp_threads: int | None = None,
        stream_batching_s: float = 0.0,
    ) -> None:
        self.node_id = node_id
        self.served_name = served_name
        self._flags = vllm_flags
        self._planner_name = planner_name
        self._namespace = namespace
        self._flush_s = trace_flush_seconds
        self._stream_batching_s = stream_batching_s
        self._traces: list[ExecutionTrace] = []
        self._live: dict[str, list[Any]] = {}  # request id -> [prompt tokens, output tokens, arrival, max tokens]
        self._stats: Any = None  # the engine's per-iteration stats (see _engine_stats_logger)
        self._facts_reported = True
        self._in_flight = 0
        self._busy_since: float | None = None
        self._busy_total = 0.0
        self._served = 0
        self._reported_served = 0
        self._adapters: dict[str, dict[str, Any]] = {}  # "base:adapter" -> {version, lora_id, path}
        self._next_lora_id = 1
        self._engine = None
        self._state = None
        self._ready = False
        if omp_threads:
            # Read by vLLM's CPU worker when the engine process starts; one engine must not
            # claim every core when several replicas share a host.
            os.environ.setdefault("OMP_NUM_THREADS", str(omp_threads))

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        """Build the engine and vLLM's serving objects; returns the replica's info when ready."""
        if self._ready:
            return self.info()
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.engine.async_llm import AsyncLLM

        args = make_arg_parser(FlexibleArgumentParser()).parse_args(self._flags)
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(args),
                                                 stat_loggers=[_engine_stats_logger(self)])
        self._trace_engine_outputs(self._engine)
        state = State()
        await init_app_state(self._engine, state, args, await self._engine.get_supported_tasks())
        self._state = state
        self._max_model_len = self._engine.model_config.max_model_len
        if self._planner_name:
            asyncio.get_running_loop().create_task(self._flush_traces_forever())
        self._ready = True
        return self.info()

    def info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "ready": self._ready,
            "model": self.served_name,
            "max_model_len": getattr(self, "_max_model_len", None),
            "in_flight": self._in_flight,
            "served": self._served,
            "busy_seconds": self._busy_seconds(),
            "adapters": {name: a["version"] for name, a in self._adapters.items()},
            "pid": os.getpid(),
        }

    async def check_health(self) -> bool:
        if not self._ready:
            return False
        await self._engine.check_health()
        return True

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        self._ready = False

    # ---- requests --------------------------------------------------------------------------

    async def completions(self, body: dict[str, Any], request_id: str | None = None) -> AsyncIterator[Any]:
        """OpenAI ``/v1/completions``; see ``Header`` for the shape of what is yielded."""
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        async for item in self._serve(CompletionRequest, "create_completion", "openai_serving_completion", body, request_id):
            yield item

    async def chat(self, body: dict[str, Any], request_id: str | None = None) -> AsyncIterator[Any]:
        """OpenAI ``/v1/chat/completions``."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        async for item in self._serve(ChatCompletionRequest, "create_chat_completion", "openai_serving_chat", body, request_id):
            yield item

    async def _serve(self, request_cls: type, method: str, handler: str, body: dict[str, Any],
                     task_id: str | None) -> AsyncIterator[Any]:
        if not self._ready:
            yield {"status": 503, "stream": False}
            yield _error_body("replica is still starting", "ServiceUnavailableError", 503)
            return
        self._begin()
        _TASK_ID.set(task_id)
        try:
            async for item in self._serve_ready(request_cls, method, handler, body):
                yield item
        finally:
            self._end()

    async def _serve_ready(self, request_cls: type, method: str, handler: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        from pydantic import ValidationError
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        try:
            request = request_cls.model_validate(body)
            result = await getattr(getattr(self._state, handler), method)(request, None)
        except ValidationError as exc:
            err = create_error_response(_validation_message(exc))
            yield {"status": err.error.code, "stream": False}
            yield err.model_dump()
            return
        except Exception as exc:  # vLLM raises its validation errors; map them as `vllm serve` does
            err = create_error_response(exc)
            if err.error.code >= 500:
                logger.exception("request failed on node %s", self.node_id)
            yield {"status": err.error.code, "stream": False}
            yield err.model_dump()
            return
        if isinstance(result, ErrorResponse):
            yield {"status": result.error.code, "stream": False}
            yield result.model_dump()
        elif hasattr(result, "model_dump"):
            yield {"status": 200, "stream": False}
            yield result.model_dump(exclude_none=False)
        else:
            yield {"status": 200, "stream": True}
            async for piece in coalesce(result, self._stream_batching_s):
                yield piece

    # ---- profiling -------------------------------------------------------------------------

    async def measure(self, batch: int, prompt_tokens: int, max_tokens: int, repeats: int = 3, seed: int = 0) -> list[float]:
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
            async for _ in self._engine.generate(TokensPrompt(prompt_token_ids=ids), params, request_id=uuid.uuid4().hex):
                pass

        times = []
        for _ in range(repeats):
            prompts = [[rng.randrange(3, 256) for _ in range(prompt_tokens)] for _ in range(batch)]
            t0 = time.perf_counter()
            await asyncio.gather(*(one(p) for p in prompts))
            times.append(time.perf_counter() - t0)
        return times

    # ---- adapters --------------------------------------------------------------------------

    async def load_adapter(self, adapter: str, version: int, path: str, force: bool = False) -> dict[str, Any]:
        """Serve ``path`` as version ``version`` of ``base:adapter``; later requests use it.

        An older version never replaces a newer one unless ``force`` (a rollback).

        Every version gets its own LoRA int id and path, so vLLM's prefix cache (keyed by LoRA
        name and path) never serves blocks computed by an older version (vLLM #42125).
        """
        from vllm.lora.request import LoRARequest

        model_id = f"{self.served_name}:{adapter}"
        current = self._adapters.get(model_id)
        if current is not None and (current["version"] == version or (current["version"] > version and not force)):
            return {"model": model_id, "version": current["version"], "loaded": False}
        lora = LoRARequest(lora_name=model_id, lora_int_id=self._next_lora_id, lora_path=path)
        self._next_lora_id += 1
        await self._engine.add_lora(lora)  # loads now, so the first request pays nothing
        models = self._state.openai_serving_models
        old = models.lora_requests.get(model_id)
        models.lora_requests[model_id] = lora
        self._adapters[model_id] = {"version": version, "lora_id": lora.lora_int_id, "path": path}
        if old is not None:
            await self._engine.remove_lora(old.lora_int_id)
        return {"model": model_id, "version": version, "loaded": True}

    async def unload_adapter(self, adapter: str) -> bool:
        model_id = f"{self.served_name}:{adapter}"
        lora = self._state.openai_serving_models.lora_requests.pop(model_id, None)
        self._adapters.pop(model_id, None)
        if lora is None:
            return False
        await self._engine.remove_lora(lora.lora_int_id)
        return True

    # ---- execution traces ------------------------------------------------------------------

    def _trace_engine_outputs(self, engine: Any) -> None:
        """Wrap ``engine.generate`` so every request leaves an ExecutionTrace.

        vLLM's serving classes call ``engine.generate`` themselves; wrapping that one method on
        this instance is the narrowest place that sees every request's outputs.
        """
        generate = engine.generate
        replica = self

        async def traced_generate(*args: Any, **kwargs: Any):
            arrival = time.time()
            first = None
            out_tokens = 0
            prompt_tokens = 0
            ok = False
            request_id = _TASK_ID.get() or kwargs.get("request_id") or (args[2] if len(args) > 2 else "")
            engine_id = kwargs.get("request_id") or (args[2] if len(args) > 2 else request_id)
            params = kwargs.get("sampling_params") or (args[1] if len(args) > 1 else None)
            # DELTA outputs carry new tokens only; CUMULATIVE and FINAL_ONLY carry all so far.
            cumulative = getattr(getattr(params, "output_kind", None), "name", "") != "DELTA"
            prompt = kwargs.get("prompt") or (args[0] if args else None)
            if isinstance(prompt, dict):
                prompt_tokens = len(prompt.get("prompt_token_ids") or ())
            max_tokens = getattr(params, "max_tokens", None) or max(1, replica._max_model_len - prompt_tokens)
            live = replica._live[str(engine_id)] = [prompt_tokens, 0, arrival, max_tokens]
            replica._facts_reported = False
            try:
                async for out in generate(*args, **kwargs):
                    n = sum(len(c.token_ids) for c in out.outputs)
                    if n and first is None:
                        first = time.time()
                    out_tokens = n if cumulative else out_tokens + n
                    prompt_tokens = len(out.prompt_token_ids or ())
                    live[0], live[1] = prompt_tokens, out_tokens
                    yield out
                ok = True
            finally:
                replica._live.pop(str(engine_id), None)
                now = time.time()
                replica._traces.append(
                    ExecutionTrace(
                        task_id=str(request_id), node_id=replica.node_id, arrival=arrival,
                        start=arrival, first_token=first, finish=now,
                        prompt_tokens=prompt_tokens, output_tokens=out_tokens, ok=ok,
                    )
                )

        engine.generate = traced_generate

    def _begin(self) -> None:
        if self._in_flight == 0:
            self._busy_since = time.monotonic()
        self._in_flight += 1

    def _end(self) -> None:
        self._in_flight -= 1
        self._served += 1
        if self._in_flight == 0 and self._busy_since is not None:
            self._busy_total += time.monotonic() - self._busy_since
            self._busy_since = None

    def _busy_seconds(self) -> float:
        live = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_total + live

    def facts(self) -> EngineFacts:
        """The engine as the node's iteration scheduler needs it: requests in flight, iterations, KV in use."""
        st = self._stats
        return EngineFacts(
            at=time.time(),
            requests=tuple(LiveRequest(rid, p, o, a, m) for rid, (p, o, a, m) in self._live.items()),
            iterations=0 if st is None else st.iterations,
            kv_cache_usage=0.0 if st is None else st.kv_cache_usage,
            kv_cache_bytes=0.0 if st is None else st.kv_cache_bytes,
        )

    def drain_traces(self) -> list[dict[str, Any]]:
        """Take the traces not yet reported (for tools and tests without a planner)."""
        traces, self._traces = self._traces, []
        return [asdict(t) for t in traces]

    async def _flush_traces_forever(self) -> None:
        import ray

        planner = None
        while True:
            await asyncio.sleep(self._flush_s)
            # Facts go out while requests are in flight and once more when the last one ends, so the
            # planner's view of an idle node is not a stale busy one.
            if not self._traces and self._served == self._reported_served and not self._live and self._facts_reported:
                continue
            try:
                if planner is None:
                    planner = ray.get_actor(self._planner_name, namespace=self._namespace)
                traces, self._traces = self._traces, []
                finished = self._served - self._reported_served
                self._reported_served = self._served
                self._facts_reported = not self._live
                await planner.report.remote(self.node_id, traces, finished, self._busy_seconds(), self.facts())
            except Exception:  # the planner restarting must not take the replica down
                logger.warning("could not report traces to the planner", exc_info=True)
                planner = None


def _engine_stats_logger(replica: ModelReplica) -> Any:
    """A vLLM stat-logger factory that keeps the engine's per-iteration facts on ``replica``.

    vLLM calls ``record`` once per engine step with the scheduler's state (running and waiting
    requests, KV cache usage): the only place outside the engine core that sees every iteration.
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    class EngineStats(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.iterations = 0
            self.kv_cache_usage = 0.0
            cache = vllm_config.cache_config
            self.kv_cache_bytes = float(getattr(cache, "kv_cache_memory_bytes", None) or 0.0)
            replica._stats = self

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            if iteration_stats is not None:
                self.iterations += 1

        def log_engine_initialized(self) -> None:
            pass

    return EngineStats


def _validation_message(exc: Exception) -> str:
    errors = getattr(exc, "errors", lambda: [])()
    if not errors:
        return str(exc)
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts)


def _error_body(message: str, err_type: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "code": code, "param": None}}
