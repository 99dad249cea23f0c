"""One model server replica in the test process: ``ModelReplica`` (vLLM's AsyncLLM with the app's own engine
flags) and vLLM's OpenAI app on 127.0.0.1 through uvicorn, as a model server replica serves; the flags a
replica of the app would use; a perturbed full version of a model's weights; a greedy probe.

``tests/integration/test_weight_sync.py`` syncs full versions into it; ``bench/weight_sync.py`` measures the
sync's stall with it. Here, with the tests, so no test imports the benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from tests.ports import free_port

PROBE = "Here are five random words:"
PROBE_TOKENS = 6


class ReplicaServer:
    """A ModelReplica and vLLM's OpenAI app on 127.0.0.1, run on an event loop in a background thread.

    The engine's output handler and the HTTP server share that loop, as in a model server
    replica; callers on other threads reach the replica through :meth:`call`.
    """

    def __init__(self, flags: list[str], served_name: str, omp_threads: int | None = None) -> None:
        from actors.serving.replica import ModelReplica

        self.replica = ModelReplica(0, flags, served_name, omp_threads)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, timeout: float = 900) -> ReplicaServer:
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"replica did not start: {self._error!r}")
        return self

    def call(self, make: Callable[[], Coroutine[Any, Any, Any]], timeout: float = 600) -> Any:
        """Run ``make()`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(make(), self._loop).result(timeout)

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=120)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        from types import SimpleNamespace

        import uvicorn
        from vllm.entrypoints.launchers.app import build_app

        self._stop = asyncio.Event()
        r = self.replica
        await r.start()
        try:
            # As deployments/server.py does: vLLM's own app over the replica's serving objects.
            app = build_app(r.args, supported_tasks=r.supported_tasks, model_config=r.engine.model_config)
            app.state._state.update(r.state._state)
            app.state.server = SimpleNamespace()
            server = uvicorn.Server(
                uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
            )
            serving = asyncio.ensure_future(server.serve())
            while not server.started:
                if serving.done():
                    serving.result()
                await asyncio.sleep(0.05)
            self._ready.set()
            await self._stop.wait()
            server.should_exit = True
            await serving
        finally:
            r.shutdown()


def engine_flags_for(model: str, data_dir: Path) -> tuple[list[str], str, Path]:
    """(vLLM flags, served name, model dir) a replica of the app would use for ``model`` (tiny or smollm2)."""
    from actors.models.default_model import model_dir
    from actors.serving.engine_args import engine_flags, served_model_name
    from settings import load

    if model == "tiny":
        cfg = load(
            {
                "data_dir": str(data_dir),
                "model": {"embedded": "tiny-llama", "max_model_len": 1024},
                "engine": {"max_num_seqs": 16, "kv_cache_memory_bytes": 128 * 2**20},
            }
        )
    else:
        cfg = load(
            {
                "model": {"embedded": "smollm2-135m-instruct", "max_model_len": 2048},
                "engine": {"max_num_seqs": 32, "kv_cache_memory_bytes": 256 * 2**20},
            }
        )
    directory = model_dir(cfg)
    return (
        engine_flags(cfg, directory, served_model_name(cfg, directory)),
        served_model_name(cfg, directory),
        Path(directory),
    )


def write_full_version(model_dir: Path, root: Path, unit: str, version: int, scale: float, seed: int) -> Path:
    """``<root>/<unit>/v<version>/``: the model's own weights, each plus Gaussian noise of ``scale`` x its std."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    state = load_file(str(model_dir / "model.safetensors"))
    perturbed = {}
    for name, t in state.items():
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * (scale * float(t.float().std()) + 1e-8)
        perturbed[name] = (t.float() + noise).to(t.dtype).contiguous()
    target = root / unit / f"v{version}"
    target.mkdir(parents=True, exist_ok=True)
    save_file(perturbed, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "meta.json").write_text(
        json.dumps(
            {
                "unit": unit,
                "version": version,
                "kind": "full",
                "note": f"base weights + N(0, ({scale} std)^2), seed {seed}",
            }
        )
    )
    return target


def greedy(url: str, model: str, max_tokens: int = PROBE_TOKENS) -> str:
    """The greedy answer to the probe prompt, as its token ids (the tiny model's text is often only special tokens)."""
    import httpx

    r = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={
            "model": model,
            "prompt": PROBE,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return " ".join(map(str, choice["token_ids"])) + " | " + choice["text"]
