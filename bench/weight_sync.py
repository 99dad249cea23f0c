"""Full-weight sync into serving (issue 15): how long a published full version takes to be served, and the stall it costs.

    /work/main/.venv/bin/python bench/weight_sync.py                    # tiny test model and SmolLM2-135M
    /work/main/.venv/bin/python bench/weight_sync.py --models tiny --rounds 2

For each model it starts one real replica in this process (``ModelReplica``: vLLM's AsyncLLM
with the app's own engine flags, and vLLM's OpenAI app on 127.0.0.1 through uvicorn, as a model
server replica serves), runs ``--clients`` closed-loop streamed completions against it, and:

- baseline: the same stream for ``--window`` seconds with no sync;
- sync: after a warm-up, publishes a perturbed full version (``model.safetensors`` of the
  model's own weights plus noise, and ``meta.json``, written as ``<root>/<unit>/v<N>/``) and calls
  ``ModelReplica.load_full_version`` while the stream runs.

Measured: the sync call with an idle engine and under the stream (and the load inside the
engine); the time from the publish call to the end of the first short greedy probe (sent back to
back beside the stream) whose tokens are the new version's (what the new weights answer once
idle, which differs from the old); and the stall: the largest gap between two streamed tokens of
any request over the sync's window, and the TTFT of the requests waiting for their first token
in it, against the same figures over a window without a sync. Every sync is checked with the
weights fingerprint.
The model's files are written once beforehand: the writer's cost is not part of the sync.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import percentile  # noqa: E402
from tests.replica_server import ReplicaServer, engine_flags_for, greedy, write_full_version  # noqa: E402

# ---- the measurement -----------------------------------------------------------------------------


class Stream:
    """Closed-loop streamed completions; keeps each request's start and token arrival times."""

    def __init__(self, url: str, model: str, clients: int, max_tokens: int) -> None:
        self.url, self.model, self.clients, self.max_tokens = url, model, clients, max_tokens
        self.requests: list[dict[str, Any]] = []  # {start, tokens: [t...], ok}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        import httpx

        n = 0
        with httpx.Client(timeout=120) as c:
            while not self._stop.is_set():
                n += 1
                rec: dict[str, Any] = {"start": time.time(), "tokens": [], "ok": False}
                self.requests.append(rec)  # now, so a request still running when figures are taken counts
                body = {
                    "model": self.model,
                    "prompt": f"Client {i} request {n}: tell me about the sea.",
                    "max_tokens": self.max_tokens,
                    "temperature": 0.8,
                    "ignore_eos": True,
                    "stream": True,
                }
                try:
                    with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        rec["status"] = r.status_code
                        for line in r.iter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                if "error" in line:
                                    break
                                rec["tokens"].append(time.time())
                            elif line == "data: [DONE]":
                                rec["ok"] = r.status_code == 200
                except Exception as exc:  # counted as a failed request
                    rec["error"] = repr(exc)
                rec["end"] = time.time()

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=130)


def stall_figures(requests: list[dict[str, Any]], t0: float, t1: float) -> dict[str, float]:
    """The streamed requests active in [t0, t1]: the largest gap between two of a request's tokens (its start
    counts as the first "token") that overlaps the window, the gaps' median, and the TTFT of the requests
    that were waiting for their first token at some point in the window; errors among them."""
    active = [r for r in requests if r["start"] <= t1 and r.get("end", t1) >= t0]
    gaps = []
    for r in active:
        times = [r["start"], *r["tokens"]]
        gaps += [b - a for a, b in zip(times, times[1:]) if b >= t0 and a <= t1]
    waiting = [r for r in active if r["tokens"] and r["tokens"][0] >= t0]
    ttft = [r["tokens"][0] - r["start"] for r in waiting]
    return {
        "requests": len(active),
        "errors": sum(1 for r in active if not r["ok"]),
        "max_gap_s": max(gaps, default=float("nan")),
        "gap_p50_s": percentile(gaps, 50),
        "gap_p99_s": percentile(gaps, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_max_s": max(ttft, default=float("nan")),
    }


def first_new_response(url: str, model: str, new_text: str, since: float, deadline: float) -> float | None:
    """Seconds from ``since`` to the end of the first greedy probe answered with ``new_text`` (probes back to back).

    The probe is short (``PROBE_TOKENS``) because greedy tokens can flip with the batch a request
    shares on bf16 kernels: the first few tokens are what an idle engine answers, a long tail is not.
    """
    while time.time() < deadline:
        if greedy(url, model) == new_text:
            return time.time() - since
    return None


def measure(
    model: str, data_dir: Path, work: Path, clients: int, max_tokens: int, window: float, rounds: int
) -> dict[str, Any]:
    flags, served, model_dir = engine_flags_for(model, data_dir)
    unit = served
    root = work / model / "full"
    # The tiny random model's logits are nearly flat: only a large change flips its greedy tokens.
    scale = 0.5 if model == "tiny" else 0.05
    versions = {v: write_full_version(model_dir, root, unit, v, scale=scale, seed=v) for v in (1, 2)}
    versions[0] = model_dir  # the start weights: loading them back is the rollback
    server = ReplicaServer(flags, served).start()
    r = server.replica
    out: dict[str, Any] = {"model": served, "params_bytes": (model_dir / "model.safetensors").stat().st_size}
    try:
        # Idle: the text each weight set answers, its fingerprint, and the sync's cost with nothing running.
        texts = {0: greedy(server.url, served)}
        fingerprints = {0: server.call(r.weights_fingerprint)}
        idle = []
        for v in (1, 2):
            for attempt in range(5):  # another seed until the probe tells this version from the others
                load = server.call(lambda v=v: r.load_full_version(str(versions[v]), v))
                idle.append({"call_s": load.total_s, "engine_load_s": load.load_s})
                texts[v], fingerprints[v] = greedy(server.url, served), server.call(r.weights_fingerprint)
                if texts[v] not in [t for k, t in texts.items() if k != v]:
                    break
                write_full_version(model_dir, root, unit, v, scale=scale, seed=v + 10 * (attempt + 1))
            else:
                raise SystemExit(f"{model}: perturbation too small, greedy probes coincide: {texts}")
        for v in (0, 1, 2, 0):
            load = server.call(lambda v=v: r.load_full_version(str(versions[v]), v))
            idle.append({"call_s": load.total_s, "engine_load_s": load.load_s})
            if greedy(server.url, served) != texts[v] or server.call(r.weights_fingerprint) != fingerprints[v]:
                raise SystemExit(f"{model}: loading v{v} again did not give the same weights")

        stream = Stream(server.url, served, clients, max_tokens)
        stream.start()
        time.sleep(window / 2)  # warm: every client has a request in flight
        b0 = time.time()
        time.sleep(window)
        b1 = time.time()
        syncs, current = [], 0
        for _ in range(rounds):
            target = 1 if current != 1 else 2
            time.sleep(window / 2)
            load_avg = os.getloadavg()[0]
            t0 = time.time()
            fut = asyncio.run_coroutine_threadsafe(r.load_full_version(str(versions[target]), target), server._loop)
            served_after = first_new_response(server.url, served, texts[target], t0, t0 + 30)
            load = fut.result(300)
            live = server.call(r.weights_fingerprint)
            syncs.append(
                {
                    "t0": t0,
                    "t1": t0 + load.total_s,
                    "call_s": load.total_s,
                    "engine_load_s": load.load_s,
                    "publish_to_served_s": served_after,
                    "load_avg_1m": load_avg,
                    "fingerprint_ok": live == fingerprints[target] != fingerprints[current],
                }
            )
            current = target
            time.sleep(window / 2)
        stream.stop()  # every request finished: the figures below see all their tokens
        out["baseline"] = stall_figures(stream.requests, b0, b1)
        for s in syncs:
            s.update(stall_figures(stream.requests, s["t0"], s["t1"]))
        out.update(
            idle=idle,
            syncs=syncs,
            load_bytes=load.bytes,
            tensors=load.tensors,
            all_requests=len(stream.requests),
            all_errors=sum(1 for q in stream.requests if not q["ok"]),
        )
    finally:
        server.stop()
    return out


def table(results: list[dict[str, Any]]) -> str:
    def f(x: Any) -> str:
        return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))

    rows = [
        "| model | run | sync call s | engine load s | publish → new weights answer s | "
        "token gap p50 / max s | TTFT p50 / max s (waiting in window) | requests (errors) | fingerprint | load 1m |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for res in results:
        name = f"{res['model']} ({res['params_bytes'] / 2**20:.0f} MiB, {res['tensors']} tensors)"
        b = res["baseline"]
        idle = sorted(res["idle"], key=lambda x: x["call_s"])
        mid = idle[len(idle) // 2]
        rows.append(
            f"| {name} | idle engine, median of {len(idle)} syncs | {f(mid['call_s'])} | "
            f"{f(mid['engine_load_s'])} | - | - | - | - | - | - |"
        )
        rows.append(
            f"| {name} | no sync ({res['window']:.0f} s of the same stream, {res['clients']} clients) "
            f"| - | - | - | {f(b['gap_p50_s'])} / {f(b['max_gap_s'])} | {f(b['ttft_p50_s'])} / "
            f"{f(b['ttft_max_s'])} | {b['requests']} ({b['errors']}) | - | - |"
        )
        for i, s in enumerate(res["syncs"], 1):
            rows.append(
                f"| {name} | sync {i} | {f(s['call_s'])} | {f(s['engine_load_s'])} | "
                f"{f(s['publish_to_served_s'])} | {f(s['gap_p50_s'])} / {f(s['max_gap_s'])} | "
                f"{f(s['ttft_p50_s'])} / {f(s['ttft_max_s'])} | {s['requests']} ({s['errors']}) | "
                f"{'new version' if s['fingerprint_ok'] else 'WRONG'} | {s['load_avg_1m']:.1f} |"
            )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,smollm2", help="comma list of tiny, smollm2")
    p.add_argument("--clients", type=int, default=4, help="concurrent streamed requests")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--window", type=float, default=6.0, help="seconds of stream measured per phase")
    p.add_argument("--rounds", type=int, default=3, help="syncs per model")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args()
    data_dir = Path(os.environ.get("COSERVE_DATA_DIR") or "~/.cache/coserve").expanduser()
    results = []
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as work:
        for model in a.models.split(","):
            res = measure(model.strip(), data_dir, Path(work), a.clients, a.max_tokens, a.window, a.rounds)
            res["clients"], res["window"] = a.clients, a.window
            results.append(res)
            print(json.dumps(res, indent=1), flush=True)
    print()
    print(table(results))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
