"""OfflineEngine: a Ray actor holding one vLLM engine for one model replica of an offline job's stage (SamuLLM §3).

The actor only generates: the runner (``actors/offline/runner.py``) decides which requests it gets and when
(stage plans, §4.2–4.3), and fills their prompts from upstream outputs. Requests are submitted in
batches and join vLLM's continuous batching as they arrive; finished ones are collected with
:meth:`OfflineEngine.poll`, so the driver can persist each output and release downstream requests
the moment it exists (a chain's next chunk, an evaluator's input) instead of waiting for a batch.

The engine runs in the actor's own process (vLLM's offline ``LLMEngine``, single-process executor,
no engine-core subprocess), stepped by one background thread: on this CPU that starts an engine in
about 12 s instead of about 35 s, and a stage plan reloads engines often (§4.3).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from actors.offline.job import JobModel


class OfflineEngine:
    """One vLLM engine (LoRA off). Create with ``ray.remote(OfflineEngine).options(num_cpus=..., max_concurrency=4)``
    so that :meth:`poll` and :meth:`submit` run while the engine steps."""

    def __init__(
        self,
        model: JobModel,
        data_dir: str,
        *,
        max_model_len: int,
        max_num_seqs: int,
        kv_cache_bytes: int,
        seed: int = 0,
        omp_threads: int | None = None,
        dtype: str = "auto",
        enforce_eager: bool = False,
    ) -> None:
        # Resolved (an embedded model built) on this actor's host, in this node's data dir.
        self.model_dir = str(model.local_dir(Path(os.environ.get("COSERVE_DATA_DIR") or data_dir).expanduser()))
        self._args = {
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "kv_cache_memory_bytes": kv_cache_bytes,
            "seed": seed,
            "dtype": dtype,
            "enforce_eager": enforce_eager,
        }
        if omp_threads:
            # Read by vLLM's CPU worker when it starts: replicas sharing a host must not each
            # claim every core (vLLM CPU sets its thread count from OMP_NUM_THREADS).
            os.environ["OMP_NUM_THREADS"] = str(omp_threads)
        # The engine core in this process, not a spawned one (see the module docstring).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self._engine: Any = None
        self._cv = threading.Condition()
        self._queue: list[tuple[str, str | dict[str, Any], dict[str, Any], float]] = []
        self._done: list[dict[str, Any]] = []
        self._running: dict[str, tuple[str, float]] = {}  # engine request id -> (our id, submitted at)
        self._stop = False
        self._failed: str | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> dict[str, Any]:
        """Build the engine; returns its load time, process id and dtype once it can generate."""
        t0 = time.time()
        from vllm import LLM

        from actors.serving.engine_args import resolve_dtype

        a = dict(self._args)
        a["dtype"] = resolve_dtype(a["dtype"], "cpu" if _on_cpu() else "gpu", self.model_dir)
        llm = LLM(
            model=self.model_dir,
            enable_lora=False,
            enable_prefix_caching=True,
            distributed_executor_backend="uni",
            disable_log_stats=True,
            **a,
        )
        self._engine = llm.llm_engine
        self._thread = threading.Thread(target=self._loop, name="offline-engine", daemon=True)
        self._thread.start()
        return {
            "load_s": time.time() - t0,
            "pid": os.getpid(),
            "dtype": a["dtype"],
            "device": "cpu" if _on_cpu() else "gpu",
        }

    def submit(self, requests: list[tuple[str, str | dict[str, Any], dict[str, Any]]]) -> int:
        """Queue ``(request id, prompt, sampling params as a dict)``; returns how many are queued or running.
        A prompt is text, or ``{"prompt_token_ids": [...]}`` (vLLM's tokens prompt)."""
        now = time.time()
        with self._cv:
            if self._failed is not None:  # answered at once: the driver fails the job with the reason
                self._done.extend(
                    {"id": rid, "error": self._failed, "start": now, "end": now} for rid, _, _ in requests
                )
                self._cv.notify_all()
                return 0
            self._queue.extend((rid, prompt, params, now) for rid, prompt, params in requests)
            self._cv.notify_all()
            return len(self._queue) + len(self._running)

    def poll(self, timeout_s: float = 1.0) -> list[dict[str, Any]]:
        """Outputs finished since the last poll; waits up to ``timeout_s`` for the first one."""
        with self._cv:
            if not self._done and (self._queue or self._running):
                self._cv.wait(timeout_s)
            done, self._done = self._done, []
            return done

    def _loop(self) -> None:
        try:
            self._step_forever()
        except Exception as exc:  # the engine broke: fail every request now rather than leave the driver waiting
            why = f"engine failed: {type(exc).__name__}: {exc}"
            with self._cv:
                self._failed = why
                lost = [(rid, at) for rid, _, _, at in self._queue] + list(self._running.values())
                self._queue, self._running = [], {}
            for rid, at in lost:
                self._finish({"id": rid, "error": why, "start": at, "end": time.time()})

    def _step_forever(self) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        while True:
            with self._cv:
                while not self._stop and not self._queue and not self._running:
                    self._cv.wait()
                if self._stop:
                    return
                new, self._queue = self._queue, []
            for rid, prompt, params, at in new:
                try:
                    sp = SamplingParams(**params, output_kind=RequestOutputKind.FINAL_ONLY)
                    internal = self._engine.add_request(rid, prompt, sp)
                    self._running[internal] = (rid, at)
                except Exception as exc:  # reported, not raised: the driver decides (bad prompt, too long)
                    self._finish({"id": rid, "error": f"{type(exc).__name__}: {exc}", "start": at, "end": time.time()})
            if not self._running:
                continue
            for out in self._engine.step():
                if not out.finished:
                    continue
                rid, at = self._running.pop(out.request_id, (out.request_id, time.time()))
                c = out.outputs[0]
                self._finish(
                    {
                        "id": rid,
                        "output": c.text,
                        "output_tokens": len(c.token_ids),
                        "prompt_tokens": len(out.prompt_token_ids or ()),
                        "finish_reason": c.finish_reason,
                        "start": at,
                        "end": time.time(),
                    }
                )

    def _finish(self, rec: dict[str, Any]) -> None:
        with self._cv:
            self._done.append(rec)
            self._cv.notify_all()

    def measure(self, batch: int, length: int, max_tokens: int, repeats: int = 2, seed: int = 0) -> list[float]:
        """Seconds to run ``batch`` requests of ``length`` prompt tokens to exactly ``max_tokens`` output tokens,
        once per repeat (the profiler's probe, SamuLLM §4.1). Prompts are random token ids, new every
        time, so the prefix cache never shortens a prefill. Call it on an idle engine."""
        import random

        rng = random.Random(seed)
        vocab = self._engine.model_config.get_vocab_size()
        params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
        out = []
        for k in range(repeats):
            ids = [f"probe-{seed}-{k}-{i}" for i in range(batch)]
            reqs = [(rid, {"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]}, params) for rid in ids]
            t0 = time.perf_counter()
            self.submit(reqs)
            with self._cv:
                while not all(any(d["id"] == rid for d in self._done) for rid in ids):
                    self._cv.wait(1.0)
                done = [d for d in self._done if d["id"] in set(ids)]
                self._done = [d for d in self._done if d["id"] not in set(ids)]
            out.append(time.perf_counter() - t0)
            failed = [d["error"] for d in done if "error" in d]
            if failed:
                raise RuntimeError(failed[0])
        return out

    def in_flight(self) -> int:
        with self._cv:
            return len(self._queue) + len(self._running)

    def shutdown(self) -> None:
        """Stop stepping; the engine's memory goes with the actor process (the driver kills it next)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    except Exception:
        return True
