"""Profile the offline engine of each model of a job (SamuLLM §4.1: per-iteration latency, Eq. 5, per model).

``python -m app.offline profile JOB.yaml`` starts each distinct model of the job once in an
:class:`actors.offline.engine.OfflineEngine` with the job's engine settings (the engine the runtime
uses: no LoRA, graphs compiled unless the job says eager), times batches of random-token prompts run
to one output token (a prefill iteration) and to 1 + k tokens (k decode iterations), fits Eq. 5's
constants (:func:`planners.cost_fitting.fit_iteration_latency`) and writes ``<model dir>-<device>.json``.
Planning reads a model's own profile before it scales the reference one
(:func:`actors.offline.plan.cost_models`): the per-iteration constant of a 2-layer model is not a
6-layer model's, and the serving engine's profile (LoRA on) is not the offline engine's.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from actors.offline.job import JobSpec, model_facts
from planners.cost_fitting import fit_iteration_latency
from planners.costs import CostModel

# (batch, prompt tokens): one prefill iteration each, within the engine's smallest token budget (2,048).
GRID = ((1, 32), (1, 128), (1, 512), (4, 32), (4, 128), (4, 512), (16, 32), (16, 128))
DECODE_TOKENS = 32
REFERENCE_NAME = "the reference profile (profiles/tiny-llama-cpu.json)"


def profile_dir(data_dir: Path) -> Path:
    """Where ``profile`` writes by default and planning looks first: ``<data_dir>/offline/profiles``."""
    return Path(data_dir).expanduser() / "offline" / "profiles"


def measure_rows(engine: Any, get: Callable[[Any], Any], repeats: int = 3) -> list[dict[str, float]]:
    """Eq. 5 rows from one started engine actor: a prefill row and a decode row per :data:`GRID` point.

    A probe's time also holds what one request costs outside the engine's iterations (the hand-off to
    the stepping thread and back). It cancels in a decode row (two probes' difference); for the
    prefill rows it is measured as a one-token request's time less one decode iteration and taken
    off, since the runtime streams requests and never waits on it per iteration.
    """
    get(engine.measure.remote(2, 16, 4, 1, seed=999))  # warm-up: the first iterations allocate and compile

    def med(b, n, k, seed):
        return statistics.median(get(engine.measure.remote(b, n, k, repeats, seed=seed)))

    one = med(1, 1, 1, 997)
    iteration = max(med(1, 1, 1 + DECODE_TOKENS, 998) - one, 0.0) / DECODE_TOKENS
    overhead = max(one - iteration, 0.0)
    rows = []
    for i, (batch, length) in enumerate(GRID):
        short = med(batch, length, 1, 2 * i)
        long = med(batch, length, 1 + DECODE_TOKENS, 2 * i + 1)
        rows.append(
            {
                "prefill_tokens": batch * length,
                "decode_seqs": 0,
                "context_tokens": 0,
                "seconds": max(short - overhead, iteration),
            }
        )
        rows.append(
            {
                "prefill_tokens": 0,
                "decode_seqs": batch,
                "context_tokens": batch * (length + DECODE_TOKENS / 2),
                "seconds": max(long - short, 0.0) / DECODE_TOKENS,
            }
        )
    return rows


def profile_job(
    job: JobSpec, data_dir: Path, reference: CostModel, out_dir: Path | None = None, log: Callable[[str], None] = print
) -> list[Path]:
    """Profile every distinct model directory of ``job`` (Ray must be up); returns the profiles written."""
    import ray

    from actors.offline.engine import OfflineEngine

    out_dir = out_dir or profile_dir(data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // job.devices.count)
    written, seen = [], set()
    for m in job.models:
        d = m.local_dir(data_dir)
        if d.name in seen:
            continue
        seen.add(d.name)
        facts = model_facts(d)
        max_len = min(job.max_model_len, facts.max_position_embeddings)
        res = dict(job.devices.bundle)
        engine = (
            ray.remote(OfflineEngine)
            .options(
                num_cpus=res.pop("CPU", 0.0),
                num_gpus=res.pop("GPU", 0.0),
                resources=res or None,
                max_concurrency=4,
            )
            .remote(
                m,
                str(data_dir),
                max_model_len=max_len,
                max_num_seqs=job.max_num_seqs,
                kv_cache_bytes=128 * 2**20,
                seed=m.seed,
                omp_threads=threads,
                enforce_eager=job.enforce_eager,
            )
        )
        try:
            info = ray.get(engine.start.remote())
            rows = measure_rows(engine, ray.get)
        finally:
            ray.kill(engine, no_restart=True)
        it = fit_iteration_latency(rows)
        device = info.get("device", "cpu")
        meta = {
            "model": d.name,
            "device": device,
            "hardware": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "fitted_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "source": "app.offline profile",
            "engine": f"offline vllm max_num_seqs={job.max_num_seqs} eager={job.enforce_eager}",
            "rows": {"iteration": rows},
            "engine_start_s": round(info["load_s"], 2),
            "other_terms": f"forward, backward, memory and the eCDF from {REFERENCE_NAME}",
        }
        path = out_dir / f"{d.name}-{device}.json"
        path.write_text(json.dumps(replace(reference, iteration=it, metadata=meta).to_dict(), indent=1))
        written.append(path)
        log(
            f"  {m.name} ({d.name}): {it.base * 1e3:.2f} ms per iteration + {it.per_prefill_token * 1e6:.1f} µs per "
            f"prompt token + {it.per_decode_seq * 1e6:.1f} µs per decoding sequence (R² {it.fit.r2 if it.fit else 0:.3f}); "
            f"written to {path}"
        )
    return written
