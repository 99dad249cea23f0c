"""LEMIX's experiment in small: one node, two pipeline stages, serving and full-model training at once.

One placement group of two bundles (a node with ``cluster.stages: 2``) holds the embedded SmolLM2-135M
as two stage actors (``actors/learning/full/scheduled.py``); for each order policy (``planners/pipeline``:
``lemix``, ``separate``, ``round_robin`` = MIX-RR, ``least_utilized`` = MIX-LUF) a fresh node runs the
same workload for ``--duration`` seconds:

- inference: the Azure conversation trace (``../shared/data/traces/azure_conv_sample.csv``), its
  arrivals rescaled to ``--rate`` requests/s, prompt lengths its ContextTokens × ``--prompt-scale``
  (capped at ``--max-prompt``; token ids synthetic: the content does not change the cost), each
  answered with ``--new-tokens`` greedy tokens (LEMIX Table I: an inference task is forward-only,
  so the default is the first token);
- training: full-model SFT on HH-RLHF pairs (``preferences/hh_rlhf_train_sample.jsonl``, prompt
  then the chosen answer, the loss on the answer), their real token lengths (capped at
  ``--max-train``), ``--micro-batch`` pairs per micro-batch, ``--accumulation`` micro-batches per
  optimizer step; the queue is kept full, so throughput measures what each policy lets train.

Before the runs: the per-stage cost model is fitted on the stages (``ScheduledPipeline.profile``)
and a median request's response time is measured on the idle node; τ_R (the SLO) is
``--slo-factor`` × that, the same for every policy (LEMIX §VI-A's "5× inference latency").

Per policy: training throughput (samples and tokens per second), SLO attainment (the share of
requests that arrived in the window whose first token came within τ_R; one still waiting at the
end misses), response time p50/p99, the devices' idle share (1 − busy op time / (2 × window)),
optimizer steps, and the ratios to SEPARATE. Prints a markdown table; saves the stage timeline of
each policy (``--gantt``: the first ``--gantt-window`` seconds, both stages, inference and training
ops coloured) and the raw numbers (``--json``).

    .venv/bin/python bench/pipeline.py --duration 60 --gantt docs/img/pipeline_gantt.png
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import percentile  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data"
ORDERS = ("lemix", "separate", "round_robin", "least_utilized")
LABELS = {"lemix": "LEMIX", "separate": "SEPARATE", "round_robin": "MIX-RR", "least_utilized": "MIX-LUF"}


def azure_requests(path: Path, rate: float, scale: float, cap: int, limit: int) -> list[tuple[float, int]]:
    """(offset seconds, prompt tokens) of the trace's first ``limit`` requests, arrivals rescaled to ``rate``/s."""
    rows = []
    with path.open() as f:
        for r in csv.DictReader(f):
            ts = datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp()
            rows.append((ts, int(r["ContextTokens"])))
            if len(rows) >= limit:
                break
    t0 = rows[0][0]
    span = rows[-1][0] - t0
    stretch = (len(rows) - 1) / rate / span if span > 0 else 1.0
    return [((ts - t0) * stretch, max(4, min(cap, round(n * scale)))) for ts, n in rows]


def hh_batches(path: Path, tokenizer: Any, micro_batch: int, cap: int, count: int, seed: int) -> list[Any]:
    """Micro-batches of HH-RLHF prompt + chosen answer, loss on the answer, right-padded to the longest row."""
    import torch

    from actors.learning.full.messages import TokenBatch

    pairs = [json.loads(line) for line in path.open()]
    random.Random(seed).shuffle(pairs)
    rows = []
    for p in pairs:
        prompt = tokenizer(p["prompt"], add_special_tokens=False).input_ids
        answer = tokenizer(" " + p["chosen"].strip(), add_special_tokens=False).input_ids
        ids = (prompt + answer)[-cap:] if len(prompt) + len(answer) > cap else prompt + answer
        start = max(len(ids) - len(answer), 1)
        rows.append((ids, start))
        if len(rows) >= micro_batch * count:
            break
    batches = []
    for i in range(0, len(rows), micro_batch):
        group = rows[i : i + micro_batch]
        length = max(len(ids) for ids, _ in group)
        ids_t = torch.full((len(group), length), tokenizer.eos_token_id or 0, dtype=torch.long)
        targets = torch.zeros_like(ids_t)
        mask = torch.zeros(ids_t.shape)
        for j, (ids, start) in enumerate(group):
            ids_t[j, : len(ids)] = torch.tensor(ids)
            targets[j, : len(ids) - 1] = torch.tensor(ids[1:])
            mask[j, start - 1 : len(ids) - 1] = 1.0
        batches.append(TokenBatch(ids_t, targets, mask))
    return batches


def run_order(
    order: str,
    args: argparse.Namespace,
    pg: Any,
    settings: Any,
    requests: list[tuple[float, int]],
    batches: list[Any],
    slo_s: float | None,
) -> dict[str, Any]:
    """One policy on a fresh node: profile, (measure τ_R if not given), then the timed window."""
    from actors.learning.full.scheduled import ScheduledPipeline

    params: dict[str, Any] = {}
    if order == "lemix":
        params = {"response_slo_s": slo_s, "max_defer_s": args.max_defer}
    elif order == "separate":
        params = {"sync_every": args.sync_every}
    node = ScheduledPipeline(
        settings, pg, order=order, order_params=params, stage_memory_bytes=args.stage_memory_mb * 2**20
    )
    rng = random.Random(args.seed)
    try:
        node.start()
        node.profile()
        # Warm-up and, on the first node, the isolated response time of a median request.
        median = int(statistics.median(n for _, n in requests))
        alone = []
        for k in range(3):
            node.submit_inference(f"warm{k}", [rng.randrange(3, 30000) for _ in range(median)], args.new_tokens)
            node.run()
            r = node.results[f"warm{k}"]
            alone.append(r.first_token_at - r.arrival)
        node.scheduler.stream = type(node.scheduler.stream)()  # the warm-up is not the trace's stream
        isolated = min(alone)
        if slo_s is None:
            slo_s = args.slo_factor * isolated
            if order == "lemix":
                node.order.response_slo_s = slo_s
        node.timeline.clear()
        start = time.time() + 0.2
        end = start + args.duration
        pending = [(start + off, n) for off, n in requests if off < args.duration]
        sent: list[str] = []
        fed = {"train": 0}

        def feed(now: float) -> None:
            while pending and pending[0][0] <= now:
                at, n = pending.pop(0)
                rid = f"req{len(sent)}"
                node.submit_inference(rid, [rng.randrange(3, 30000) for _ in range(n)], args.new_tokens, arrival=at)
                sent.append(rid)
            while len(node.scheduler.training_queue) < args.accumulation:
                b = batches[fed["train"] % len(batches)]
                node.submit_training(f"mb{fed['train']}", b, arrival=now)
                fed["train"] += 1

        node.run(until=end, feed=feed)
        spans = [d for d in node.timeline if d.end > start]
        busy = sum(min(d.end, end) - max(d.start, start) for d in spans if d.start < end)
        responses = []
        for rid in sent:
            r = node.results[rid]
            responses.append(
                r.first_token_at - r.arrival
                if r.first_token_at is not None and r.first_token_at <= end
                else float("inf")
            )
        trained = [
            d
            for d in node.timeline
            if d.op.kind == "training" and d.op.phase == "backward" and d.op.position == 0 and start <= d.end <= end
        ]
        samples = sum(d.op.batch for d in trained)
        tokens = sum(d.op.batch * d.op.tokens for d in trained)
        finite = [x for x in responses if x != float("inf")]
        return {
            "order": order,
            "label": LABELS.get(order, order),
            "isolated_s": isolated,
            "slo_s": slo_s,
            "requests": len(sent),
            "slo_attainment": sum(x <= slo_s for x in responses) / max(len(responses), 1),
            "response_p50_s": percentile(finite, 50) if finite else None,
            "response_p99_s": percentile(finite, 99) if finite else None,
            "unanswered": len(responses) - len(finite),
            "samples_per_s": samples / args.duration,
            "train_tokens_per_s": tokens / args.duration,
            "steps": node.scheduler.steps,
            "idle_share": 1.0 - busy / (node.devices * args.duration),
            "inference_busy_s": sum(
                min(d.end, end) - max(d.start, start) for d in spans if d.op.kind == "inference" and d.start < end
            ),
            "spans": [
                (d.op.device, d.op.kind, d.op.phase, d.start - start, d.end - start) for d in spans if d.start < end
            ],
        }
    finally:
        node.shutdown()


def gantt(results: list[dict[str, Any]], window: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        ("inference", "forward"): "#d62728",
        ("training", "forward"): "#1f77b4",
        ("training", "backward"): "#17becf",
        ("training", "step"): "#7f7f7f",
        ("training", "sync"): "#ff7f0e",
    }
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.5 * len(results) + 0.8), sharex=True)
    for ax, res in zip(axes if len(results) > 1 else [axes], results):
        for device in (0, 1):
            for kind_phase, colour in colours.items():
                bars = [
                    (s, e - s) for d, k, p, s, e in res["spans"] if d == device and (k, p) == kind_phase and s < window
                ]
                if bars:
                    ax.broken_barh(bars, (1 - device - 0.4, 0.8), facecolors=colour)
        ax.set_yticks([1, 0], ["stage 0", "stage 1"] if res["order"] != "separate" else ["serve", "train"])
        ax.set_ylabel(res["label"], rotation=0, ha="right", va="center")
        ax.set_xlim(0, window)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(
        handles,
        ["inference", "train forward", "train backward", "optimizer step", "weight sync"],
        loc="upper center",
        ncol=5,
        frameon=False,
    )
    axes_list = axes if len(results) > 1 else [axes]
    axes_list[-1].set_xlabel("seconds")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--model-dir", default=None, help="an HF Llama directory (default: the embedded SmolLM2-135M)")
    ap.add_argument("--orders", default=",".join(ORDERS))
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=1.0, help="inference requests per second")
    ap.add_argument("--prompt-scale", type=float, default=0.125)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=1)
    ap.add_argument("--max-train", type=int, default=160)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--accumulation", type=int, default=4)
    ap.add_argument("--slo-factor", type=float, default=5.0)
    ap.add_argument("--max-defer", type=float, default=5.0)
    ap.add_argument("--sync-every", type=int, default=1)
    ap.add_argument("--max-in-flight", type=int, default=4, help="micro-batches in flight (shared pipelines)")
    ap.add_argument(
        "--stage-memory-mb",
        type=float,
        default=1024.0,
        help="LEMIX's memory guard (Alg. 2): activation memory a stage may hold",
    )
    ap.add_argument("--chunks", type=int, default=4, help="ops per stage (a stage's layers in this many chunks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gantt", type=Path, default=None)
    ap.add_argument("--gantt-window", type=float, default=20.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    trace = args.data / "traces" / "azure_conv_sample.csv"
    pairs = args.data / "preferences" / "hh_rlhf_train_sample.jsonl"
    if not trace.exists() or not pairs.exists():
        sys.exit(f"needs {trace} and {pairs} (see ../shared/data/README.md)")

    import ray
    from ray.util.placement_group import placement_group
    from transformers import AutoTokenizer

    from actors.learning.full.messages import PipelineSettings
    from actors.models import smollm2
    from settings import DEFAULT_DATA_DIR

    model_dir = args.model_dir or str(
        smollm2.ensure(Path(os.environ.get("COSERVE_DATA_DIR") or DEFAULT_DATA_DIR).expanduser())
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = azure_requests(
        trace, args.rate, args.prompt_scale, args.max_prompt, limit=int(args.duration * args.rate * 1.5) + 10
    )
    batches = hh_batches(pairs, tokenizer, args.micro_batch, args.max_train, count=400, seed=args.seed)
    lengths = [b.ids.shape[1] for b in batches]
    print(
        f"inference: {len(requests)} requests, prompt tokens p50 {percentile([n for _, n in requests], 50):.0f} "
        f"p90 {percentile([n for _, n in requests], 90):.0f}; training: micro-batch length p10 {percentile(lengths, 10):.0f} "
        f"p50 {percentile(lengths, 50):.0f} p90 {percentile(lengths, 90):.0f}",
        flush=True,
    )

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=120)
    settings = PipelineSettings(
        model_dir=model_dir,
        versions_root="/tmp/pipeline-bench-versions",
        stage_resources={"CPU": 0.9},
        partition_method="compute",
        micro_batch=args.micro_batch,
        accumulation=args.accumulation,
        learning_rate=1e-5,
        max_length=args.max_train,
        threads=1,
        chunks=args.chunks,
        max_in_flight=args.max_in_flight,
    )
    results, slo_s = [], None
    for order in args.orders.split(","):
        res = run_order(order, args, pg, settings, requests, batches, slo_s)
        slo_s = res["slo_s"]
        results.append(res)
        print(
            f"{res['label']}: {res['samples_per_s']:.3f} samples/s, SLO {res['slo_attainment']:.1%}, "
            f"idle {res['idle_share']:.1%}",
            flush=True,
        )

    base = next((r for r in results if r["order"] == "separate"), None)
    print(
        f"\nτ_R = {slo_s:.3f} s ({args.slo_factor}x a median request alone, {results[0]['isolated_s']:.3f} s); "
        f"{args.duration:.0f} s per policy, {args.rate} req/s\n"
    )
    print(
        "| policy | train samples/s | train tokens/s | vs SEPARATE | SLO attainment | vs SEPARATE | "
        "response p50 (s) | p99 (s) | idle share | steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        t_ratio = r["samples_per_s"] / base["samples_per_s"] if base and base["samples_per_s"] else float("nan")
        s_ratio = r["slo_attainment"] / base["slo_attainment"] if base and base["slo_attainment"] else float("nan")
        p50 = "-" if r["response_p50_s"] is None else f"{r['response_p50_s']:.3f}"
        p99 = "-" if r["response_p99_s"] is None else f"{r['response_p99_s']:.3f}"
        print(
            f"| {r['label']} | {r['samples_per_s']:.3f} | {r['train_tokens_per_s']:.0f} | {t_ratio:.2f}x | "
            f"{r['slo_attainment']:.1%} | {s_ratio:.2f}x | {p50} | {p99} | {r['idle_share']:.1%} | {r['steps']} |"
        )
    lemix = next((r for r in results if r["order"] == "lemix"), None)
    if lemix and base and base["samples_per_s"]:
        ratio = lemix["samples_per_s"] / base["samples_per_s"]
        ok = ratio >= 1.5 and lemix["slo_attainment"] >= base["slo_attainment"]
        print(
            f"\ngoal (LEMIX >= 1.5x SEPARATE's training throughput at >= its SLO attainment): "
            f"{'met' if ok else 'not met'} ({ratio:.2f}x, {lemix['slo_attainment']:.1%} vs "
            f"{base['slo_attainment']:.1%})"
        )
    if args.gantt:
        gantt(results, args.gantt_window, args.gantt)
        print(f"\ntimeline: {args.gantt}")
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "spans"} for r in results], indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()
