"""Pieces the live benchmarks share: start the app in-process, wait for it, and drive a steady inference load."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app import serve_env  # noqa: E402

serve_env.apply()  # before anything imports Ray Serve: its processes read these settings at import

BASE = "tiny-llama"


def served_base(url: str) -> str:
    """The base model's name as the app at ``url`` serves it (``tiny-llama`` for the test config,
    ``smollm2-135m-instruct`` for ``make serve``'s): requests against ``--url`` must name it."""
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``xs``; NaN when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_config(name: str, data_dir: str, nodes: int, **training: Any) -> dict[str, Any]:
    """The test-sized app config the live benchmarks start: ``nodes`` nodes, synced training, k = 1."""
    return {"name": name, "data_dir": data_dir,
            "cluster": {"nodes": nodes, "stages": 1, "bundle": {"CPU": 1}},
            "model": {"embedded": "tiny-llama", "max_model_len": 1024},
            "engine": {"max_num_seqs": 16, "kv_cache_memory_bytes": 128 * 2**20},
            "training": {"enabled": True, "scope": "synced", "steps_per_version": 1, "micro_batch": 4, **training}}


def real_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` serving the real default model from the usual cache (converted there once)."""
    import os

    from actors.models import smollm2
    from settings import DEFAULT_DATA_DIR

    model_dir = smollm2.ensure(Path(os.environ.get("COSERVE_DATA_DIR") or DEFAULT_DATA_DIR).expanduser())
    return {**config, "model": {"path": str(model_dir), "served_name": smollm2.NAME, "max_model_len": 2048}}


def hh_as_chat(pair: dict[str, str], context_bytes: int | None = None, answer_bytes: int | None = None
               ) -> dict[str, Any]:
    """An HH-RLHF pair (prompt text of ``\n\nHuman:`` / ``\n\nAssistant:`` turns) as chat ``messages``.

    ``context_bytes``: keep only the latest turns that fit (the last human turn always, cut to its
    head if it alone is longer); ``answer_bytes``: cut chosen and rejected to their heads.
    """
    import re

    def head(text: str, n: int | None) -> str:
        return text if n is None else text.encode()[:n].decode("utf-8", errors="ignore")

    parts = re.split(r"\n\n(Human|Assistant): ?", "\n\n" + pair["prompt"].lstrip("\n"))
    turns = [{"role": "user" if who == "Human" else "assistant", "content": text.strip()}
             for who, text in zip(parts[1::2], parts[2::2])]
    while turns and not turns[-1]["content"]:  # the prompt ends with an empty "Assistant:" turn
        turns.pop()
    if not turns or turns[-1]["role"] != "user" or any(not t["content"] for t in turns):
        raise ValueError("not an HH-RLHF dialogue ending with a human turn")
    if context_bytes is not None:
        kept, used = [], 0
        for t in reversed(turns):
            used += len(t["content"].encode())
            if kept and used > context_bytes:
                break
            kept.append(t)
        turns = kept[::-1]
        while turns[0]["role"] != "user":  # a chat starts with the user
            turns.pop(0)
        turns[-1] = {**turns[-1], "content": head(turns[-1]["content"], context_bytes)}
    return {"messages": turns, "chosen": head(pair["chosen"], answer_bytes),
            "rejected": head(pair["rejected"], answer_bytes)}


def start_app(config: dict[str, Any], port: int, dashboard_port: int | None = None) -> None:
    """Start Ray and the Serve app of ``config`` in this process, listening on 127.0.0.1:``port``
    (with Ray's dashboard and state API on ``dashboard_port`` when given)."""
    from ray import serve

    from app.main import build_app

    serve_env.init_ray(dashboard_port=dashboard_port)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name="coserve", route_prefix="/")


def stop_app() -> None:
    from ray import serve

    serve.shutdown()


def wait_ready(url: str, timeout: float = 900, trainer: bool = True) -> None:
    """Block until every node serves (and, with ``trainer``, the trainer's workers run); exit on timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            st = httpx.get(f"{url}/v1/status", timeout=10).json()
            training = st.get("training") or {}
            if st["ready_nodes"] == len(st["nodes"]) and (
                    not trainer or (training.get("state") == "running" and training.get("workers"))):
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(2)
    raise SystemExit(f"app at {url} not ready within {timeout}s")


class Load:
    """Closed-loop inference clients on the base model; records latency and, when streaming, TTFT."""

    def __init__(self, url: str, clients: int, max_tokens: int, *, stream: bool = False, model: str = BASE) -> None:
        self.url, self.clients, self.max_tokens, self.stream, self.model = url, clients, max_tokens, stream, model
        # (finish, latency, ttft, ok, largest gap between two streamed pieces: the worst time between tokens)
        self.samples: list[tuple[float, float, float | None, bool, float | None]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _request(self, c: httpx.Client, i: int, t0: float) -> tuple[bool, float | None, float | None]:
        body = {"model": self.model, "prompt": f"Client {i} asks about the weather at {t0:.3f}.",
                "max_tokens": self.max_tokens, "temperature": 0.8}
        if not self.stream:
            return c.post(f"{self.url}/v1/completions", json=body).status_code == 200, None, None
        ttft = last = gap = None
        with c.stream("POST", f"{self.url}/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return False, None, None
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    now = time.time()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        gap = max(gap or 0.0, now - last)
                    last = now
        return ttft is not None, ttft, gap

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as c:
            while not self._stop.is_set():
                t0 = time.time()
                try:
                    ok, ttft, gap = self._request(c, i, t0)
                except httpx.HTTPError:
                    ok, ttft, gap = False, None, None
                self.samples.append((time.time(), time.time() - t0, ttft, ok, gap))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=130)

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """Request rate, errors, latency and TTFT percentiles of requests that finished in [t0, t1]."""
        done = [s for s in self.samples if t0 <= s[0] <= t1]
        lat = [s[1] for s in done if s[3]]
        ttft = [s[2] for s in done if s[3] and s[2] is not None]
        gaps = [s[4] for s in done if s[3] and s[4] is not None]
        return {"requests": len(lat), "errors": sum(1 for s in done if not s[3]),
                "rate": len(lat) / max(1e-9, t1 - t0),
                "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99),
                "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
                "max_tbt_p50_s": pct(gaps, 50), "max_tbt_p99_s": pct(gaps, 99)}
