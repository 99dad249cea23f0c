"""How often a request waits inside vLLM on the live app: the measurement behind dropping admission by priority.

    .venv/bin/python bench/engine_queue.py                        # 0.5, 2 and 4 req/s, 40 s each, then a burst
    .venv/bin/python bench/engine_queue.py --rates 2 --duration 60 --alpha 0

MACE §4.1 orders waiting prefills by priority before they run. In this app vLLM starts every
request as it arrives, so an order could only matter while requests wait in vLLM's own queue,
i.e. after an engine step that could not start them (``max_num_seqs`` running, no token budget or
KV blocks left). The replica counts those steps (``steps_with_waiting``) and the longest queue
(``waiting_peak``) and the planner shows them under ``/v1/status``'s ``nodes[i].engine``.

Starts the one-node app of ``bench/coserve.py`` (tiny-llama, ``max_num_seqs`` 16, the trainer
beside the engine under ``planner.iteration: hybrid``), replays the Azure conversation trace with
that benchmark's workload (its ``read_trace`` and ``stream_one``: prompts ≤ ``--max-prompt``,
outputs ≤ ``--max-output`` tokens, ``ignore_eos``, streamed) at each of ``--rates``, with α of the
arrivals also posting ``--pairs-per-task`` DPO pairs to an adapter in mode ``hybrid``, and ends
with a burst of 3 × ``max_num_seqs`` requests at once. Per phase: requests, TTFT p50/p99, engine
steps, steps that left a request waiting and their share, and the longest queue so far (cumulative
since the engine started: the phases run from light to heavy). Prints one markdown table;
``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import free_port, percentile, start_app, stop_app, wait_ready  # noqa: E402
from bench.coserve import SHARED, Arrival, read_trace, stream_one  # noqa: E402

MAX_NUM_SEQS = 16


def engine_counters(url: str, timeout: float = 60.0) -> dict[str, int]:
    """Node 0's engine counters once nothing is in flight and two reports a second apart agree."""
    deadline, last = time.time() + timeout, None
    while True:
        node = httpx.get(f"{url}/v1/status", timeout=30).json()["nodes"][0]
        e = node.get("engine") or {}
        now = {k: int(e.get(k, 0)) for k in ("iterations", "steps_with_waiting", "waiting_peak")}
        if (node["in_flight"] == 0 and now == last) or time.time() > deadline:
            return now
        last = now
        time.sleep(1.0)


def replay(
    url: str, arrivals: list[Arrival], adapter: str | None, pairs: list[dict[str, str]], pairs_per_task: int
) -> list[Any]:
    """Stream every arrival at its time; post feedback for the ones marked, as ``bench/coserve.py`` does."""
    t_start = time.time()
    pair_iter = iter(pairs)

    def feeder() -> None:
        with httpx.Client(timeout=60) as c:
            for a in arrivals:
                if a.feedback and adapter is not None:
                    time.sleep(max(0.0, t_start + a.at - time.time()))
                    c.post(
                        f"{url}/v1/feedback",
                        json={"items": [{"adapter": adapter, **next(pair_iter)} for _ in range(pairs_per_task)]},
                    )

    fthread = threading.Thread(target=feeder, daemon=True)
    fthread.start()
    with (
        httpx.Client(timeout=300, limits=httpx.Limits(max_connections=256)) as c,
        ThreadPoolExecutor(max_workers=128) as pool,
    ):
        futures = []
        for k, a in enumerate(arrivals):
            time.sleep(max(0.0, t_start + a.at - time.time()))
            futures.append(pool.submit(stream_one, c, url, a, k))
        results = [f.result() for f in futures]
    fthread.join(timeout=60)
    return results


def row(phase: str, results: list[Any], before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    steps = after["iterations"] - before["iterations"]
    waiting = after["steps_with_waiting"] - before["steps_with_waiting"]
    return {
        "phase": phase,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "ttft_p50": percentile([r.ttft for r in ok], 50),
        "ttft_p99": percentile([r.ttft for r in ok], 99),
        "steps": steps,
        "steps_with_waiting": waiting,
        "share": waiting / max(1, steps),
        "waiting_peak_so_far": after["waiting_peak"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| phase | requests (failed) | TTFT p50 / p99 (s) | engine steps | steps that left a request waiting "
        "| longest queue so far |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['phase']} | {r['requests']} ({r['failed']}) | {r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} "
            f"| {r['steps']} | {r['steps_with_waiting']} ({r['share']:.1%}) | {r['waiting_peak_so_far']} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="0.5,2,4", help="inference requests/s of each trace phase, run in this order")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per phase")
    p.add_argument("--alpha", type=float, default=0.5, help="share of arrivals that also post a fine-tuning task")
    p.add_argument("--pairs-per-task", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--slo-tbt", type=float, default=0.1, help="training.slo_tbt_s")
    p.add_argument("--trace", default=str(SHARED / "traces" / "azure_conv_sample.csv"))
    p.add_argument("--pairs", default=str(SHARED / "preferences" / "hh_rlhf_train_sample.jsonl"))
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()

    from actors.learning.lora.alignment import read_preference_jsonl

    pairs = read_preference_jsonl(args.pairs, limit=3000, max_text_bytes=400) * 4 if args.alpha > 0 else []
    os.environ.setdefault("RAY_worker_niceness", "0")  # as bench/coserve.py: the app is the service under test
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = {
        "name": "bench-engine-queue",
        "data_dir": tempfile.mkdtemp(prefix="bench-engine-queue-"),
        "cluster": {"nodes": 1, "stages": 1, "bundle": {"CPU": 1}},
        "model": {"embedded": "tiny-llama", "max_model_len": 1024},
        "engine": {"max_num_seqs": MAX_NUM_SEQS, "kv_cache_memory_bytes": 128 * 2**20},
        "planner": {"placement": "round_robin", "iteration": "hybrid"},
        "training": {
            "enabled": args.alpha > 0,
            "scope": "synced",
            "steps_per_version": 1,
            "micro_batch": 4,
            "max_length": 512,
            "slo_tbt_s": args.slo_tbt,
        },
    }
    start_app(config, port)
    rows: list[dict[str, Any]] = []
    try:
        wait_ready(url, trainer=args.alpha > 0)
        adapter = None
        if args.alpha > 0:
            adapter = f"queue-{time.strftime('%H%M%S')}"
            httpx.post(
                f"{url}/v1/adapters",
                timeout=30,
                json={
                    "name": adapter,
                    "method": "dpo",
                    "beta": 0.1,
                    "learning_rate": 1e-3,
                    "mode": "hybrid",
                    "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
                },
            ).raise_for_status()
        offset = 0
        for rate in [float(x) for x in args.rates.split(",") if x]:
            arrivals = [
                a
                for a in read_trace(
                    Path(args.trace), int(rate * args.duration) + 2, rate, args.max_prompt, args.max_output, args.alpha
                )
                if a.at < args.duration
            ]
            before = engine_counters(url)
            results = replay(url, arrivals, adapter, pairs[offset:], args.pairs_per_task)
            offset += args.pairs_per_task * sum(a.feedback for a in arrivals)
            rows.append(row(f"trace, {rate:g} req/s", results, before, engine_counters(url)))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        burst = [Arrival(0.0, 32, args.max_output, False) for _ in range(3 * MAX_NUM_SEQS)]
        before = engine_counters(url)
        with (
            httpx.Client(timeout=300, limits=httpx.Limits(max_connections=256)) as c,
            ThreadPoolExecutor(max_workers=len(burst)) as pool,
        ):
            results = list(pool.map(lambda k: stream_one(c, url, burst[k], 100_000 + k), range(len(burst))))
        rows.append(row(f"burst of {len(burst)} at once", results, before, engine_counters(url)))
    finally:
        stop_app()
    print(
        f"requests waiting inside vLLM (one node: tiny-llama, max_num_seqs {MAX_NUM_SEQS}, "
        f"{'DPO training beside it (hybrid), α = ' + str(args.alpha) if args.alpha > 0 else 'no training'}; "
        f"Azure conv trace, prompts ≤ {args.max_prompt}, outputs ≤ {args.max_output} tokens, "
        f"{args.duration:.0f} s per rate)\n"
    )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
