"""Offline multi-LLM jobs, simulated: our search planner against SamuLLM's greedy and the Max and Min heuristics.

    python bench/offline.py sim [--quick] [--workloads chain-24,mixed-24]   # an 8-device node (~4 min of CPU)

Simulated (SamuLLM §5): each workload is planned by every planner variant from output lengths
*sampled* from a ShareGPT eCDF (§4.1), then executed in the simulator against *true* lengths the
planner never saw, re-adjusting at every model finish as the runtime does (§4.3,
``planners.offline.replay_plan``). End-to-end time = that execution + the search's CPU seconds (§5
"Metric"; CPU, not wall, time because other sessions share this machine). The node is SamuLLM's: 8
devices of 80 GB, all linked. Costs: the embedded model's fitted profile (``profiles/tiny-llama-cpu.json``)
stands for a 7B model in fp16 on one device; a bigger model's per-token terms scale by its weight
bytes over the 7B's, the rule ``actors.offline.plan.cost_models`` applies, anchored at 7B instead of
at the 14 MB embedded model (at that anchor a 13B model would cost 0.2 s per prompt token). No
profile of a 7 to 70 B model exists here: this derivation is the stand-in, and it is stated wherever
the figures are. Load times: 10 s + weights / (tp × 2 GB/s), 11 to 45 s as in SamuLLM §5.1. Each
workload also gets the moldable bound of its true lengths (``planners.offline.moldable_bound``): what
no plan that keeps each model on one (dp, tp) can beat, so better heuristic / bound is the most any
such plan could gain.

Real runs on this machine: ``bench/offline_real.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from actors.offline.job import chunk_text  # noqa: E402
from bench.common import rows_table  # noqa: E402
from planners.costs import CostModel  # noqa: E402
from planners.offline import (  # noqa: E402
    DeviceSet,
    Edge,
    EngineLimits,
    JobGraph,
    JobSimulator,
    ModelSpec,
    Stage,
    chain_maps,
    moldable_bound,
    output_cdf_from_pairs,
    replay_plan,
)
from planners.registry import create  # noqa: E402

# ../shared/data beside the repository; COSERVE_SHARED_DATA points elsewhere (e.g. from a git worktree).
SHARED = Path(os.environ.get("COSERVE_SHARED_DATA") or ROOT.parent / "shared" / "data")
SHAREGPT = SHARED / "prompts" / "sharegpt_sample.jsonl"
QMSUM = SHARED / "longdocs" / "qmsum_meetings_sample.jsonl"
PROFILE = ROOT / "profiles" / "tiny-llama-cpu.json"
IMG = ROOT / "docs" / "img"

# (planner, preemption, known output lengths): our search, SamuLLM's method (greedy), the §5 baselines and
# the §5.5 ablations (no preemption, known output lengths).
VARIANTS = [
    ("search", True, False),
    ("search", False, False),
    ("search", True, True),
    ("greedy", True, False),
    ("greedy", False, False),
    ("greedy", True, True),
    ("max", True, False),
    ("max", True, True),
    ("min", True, False),
    ("min", False, False),
    ("min", True, True),
]


def variant_name(planner: str, preemption: bool, known: bool) -> str:
    return planner + ("" if preemption else ", no preemption") + (", known lengths" if known else "")


def geomean(xs: Sequence[float]) -> float:
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


# ---- the simulated node and its models -------------------------------------------------------------


SIM_DEVICES = DeviceSet(8, 80e9)  # SamuLLM §5: 8 × A100-80GB (links: all pairs, so tp 1/2/4/8 are placeable)
REFERENCE_BYTES = 13.5e9  # Llama-2-7B in fp16: what the embedded model's profile stands for
TOKEN_CHARS = 4  # no BPE tokenizer here: the usual ~4 characters per token of English text


@dataclass(frozen=True)
class SimModel:
    """A model of the simulated node: fp16 weights and KV bytes per token (2 · layers · kv heads · head dim · 2)."""

    name: str
    params_b: float
    kv_bytes_per_token: float

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 2e9

    def load_times(self) -> tuple[tuple[int, float], ...]:
        """§4.1's load-time table: engine start plus reading the weights, split over tp devices."""
        return tuple((tp, 10.0 + self.weight_bytes / (tp * 2e9)) for tp in (1, 2, 4, 8))


_L13 = 2 * 40 * 5120 * 2  # Llama-2-13B: 40 layers, no GQA
# LLM-Blender's models (SamuLLM §5.1; MOSS and Flan-T5 left out there too).
ENSEMBLE = (
    SimModel("vicuna-13b", 13.0, _L13),
    SimModel("oasst-pythia-12b", 12.0, 2 * 36 * 5120 * 2),
    SimModel("alpaca-13b", 13.0, _L13),
    SimModel("baize-13b", 13.0, _L13),
    SimModel("koala-13b", 13.0, _L13),
    SimModel("dolly-12b", 12.0, 2 * 36 * 5120 * 2),
    SimModel("mpt-7b", 6.7, 2 * 32 * 4096 * 2),
    SimModel("chatglm3-6b", 6.2, 2 * 28 * 2 * 128 * 2),
    SimModel("stablelm-7b", 7.9, 2 * 16 * 6144 * 2),
)
# ROUTERBENCH's open models and SamuLLM Table 1's request counts. Mixtral is costed by all its weights
# (46.7 B), which overstates its compute: only about 13 B are active per token.
ROUTING = (
    (SimModel("llama-2-70b", 69.0, 2 * 80 * 1024 * 2), 408),
    (SimModel("mixtral-8x7b", 46.7, 2 * 32 * 1024 * 2), 1267),
    (SimModel("wizardlm-13b", 13.0, _L13), 2068),
    (SimModel("codellama-34b", 33.7, 2 * 48 * 1024 * 2), 456),
    (SimModel("mistral-7b", 7.2, 2 * 32 * 1024 * 2), 2657),
)
# An ensemble of five models of different sizes (the issue's SamuLLM-shaped ensemble; §5.1's are all 6 to 13 B).
ENSEMBLE5 = (
    SimModel("mistral-7b", 7.2, 2 * 32 * 1024 * 2),
    SimModel("vicuna-13b", 13.0, _L13),
    SimModel("codellama-34b", 33.7, 2 * 48 * 1024 * 2),
    SimModel("mixtral-8x7b", 46.7, 2 * 32 * 1024 * 2),
    SimModel("llama-2-70b", 69.0, 2 * 80 * 1024 * 2),
)
# Chain summary (§5.3): vicuna-13b summarizes, Llama-2-70b-chat evaluates.
SUMMARIZER, EVALUATOR = SimModel("summarizer", 13.0, _L13), SimModel("evaluator", 69.0, 2 * 80 * 1024 * 2)
CHUNK_TOKENS = 2048  # BooookScore's chunk size (§5.3)
TEMPLATE_TOKENS = 40  # instructions around a chunk or a summary


def tokens(chars: int) -> int:
    return max(1, math.ceil(chars / TOKEN_CHARS))


@dataclass
class SimData:
    """Token lengths from shared/data: the eCDF's half of ShareGPT, a held-out half, QMSum meetings."""

    pairs: list[tuple[int, int]]
    prompts: np.ndarray
    responses: np.ndarray
    summaries: np.ndarray
    documents: list[str]


def load_sim_data() -> SimData:
    rows = [json.loads(line) for line in SHAREGPT.open()]
    half = len(rows) // 2  # rows are already shuffled (shared/data/README.md)
    pairs = [(tokens(r["prompt_chars"]), tokens(r["response_chars"])) for r in rows[:half]]
    held = rows[half:]
    meetings = [json.loads(line) for line in QMSUM.open()]
    # What a summary of a meeting (part) is really like: QMSum's human answers, general and per query.
    summaries = [tokens(len(q["answer"])) for m in meetings for q in m["specific_queries"]]
    summaries += [tokens(len(m["general_summary"])) for m in meetings]
    return SimData(
        pairs,
        np.array([min(tokens(r["prompt_chars"]), 1024) for r in held]),
        np.array([tokens(r["response_chars"]) for r in held]),
        np.array(summaries),
        [m["transcript"] for m in meetings],
    )


def sim_spec(m: SimModel, prompts: Sequence[int], max_out: int, truth_pool: np.ndarray, seed: int) -> ModelSpec:
    """A node whose true output lengths are drawn from ``truth_pool``, never from the planner's eCDF half."""
    truth = np.minimum(np.random.default_rng(seed).choice(truth_pool, size=len(prompts)), max_out)
    return ModelSpec(
        m.name,
        m.weight_bytes,
        tuple(int(p) for p in prompts),
        max_out,
        m.kv_bytes_per_token,
        max_seq_len=4096,
        output_tokens=tuple(int(x) for x in truth),
        load_time_s=m.load_times(),
        engine=EngineLimits(max_num_seqs=256, max_batched_tokens=8192),
    )


def ensemble_graph(
    d: SimData, n: int, max_out: int, seed: int = 0, models: Sequence[SimModel] = ENSEMBLE
) -> tuple[list[ModelSpec], list[Edge]]:
    prompts = np.random.default_rng(seed).choice(d.prompts, size=n)
    return [sim_spec(m, prompts, max_out, d.responses, seed + 1 + i) for i, m in enumerate(models)], []


def routing_graph(d: SimData, scale: float, max_out: int, seed: int = 1) -> tuple[list[ModelSpec], list[Edge]]:
    rng = np.random.default_rng(seed)
    return [
        sim_spec(m, rng.choice(d.prompts, size=max(1, round(k * scale))), max_out, d.responses, seed + 10 + i)
        for i, (m, k) in enumerate(ROUTING)
    ], []


def chain_graph(d: SimData, n_docs: int, max_out: int, seed: int = 2) -> tuple[list[ModelSpec], list[Edge]]:
    """``n_docs`` meetings (QMSum's 24, repeated when more are asked for) cut into 2,048-token chunks."""
    docs = [d.documents[i % len(d.documents)] for i in range(n_docs)]
    chunks = [[tokens(len(c)) for c in chunk_text(doc, CHUNK_TOKENS * TOKEN_CHARS)] for doc in docs]
    parents, last = chain_maps([len(c) for c in chunks])
    summ = sim_spec(SUMMARIZER, [c + TEMPLATE_TOKENS for cs in chunks for c in cs], max_out, d.summaries, seed)
    ev = sim_spec(EVALUATOR, [TEMPLATE_TOKENS] * n_docs, max_out, d.responses, seed + 1)
    return [summ, ev], [Edge(summ.name, summ.name, parents), Edge(summ.name, ev.name, last)]


def mixed_graph(d: SimData, n_docs: int, n_prompts: int) -> tuple[list[ModelSpec], list[Edge]]:
    """§5.4: chain summary (output limit 900) and the ensemble (256) as one application."""
    chain, edges = chain_graph(d, n_docs, 900)
    ens, _ = ensemble_graph(d, n_prompts, 256)
    return chain + ens, edges


@dataclass(frozen=True)
class SimCase:
    name: str
    about: str
    build: Callable[[SimData], tuple[list[ModelSpec], list[Edge]]]


SIM_CASES = [
    SimCase(
        "ensemble5-1k",
        "5 models of 7 to 70 B × 1,000 prompts, ≤ 256 out",
        lambda d: ensemble_graph(d, 1000, 256, models=ENSEMBLE5),
    ),
    SimCase(
        "ensemble5-4k",
        "5 models of 7 to 70 B × 4,000 prompts, ≤ 512 out",
        lambda d: ensemble_graph(d, 4000, 512, models=ENSEMBLE5),
    ),
    SimCase("ensemble-1k", "9 models × 1,000 prompts, ≤ 256 out", lambda d: ensemble_graph(d, 1000, 256)),
    SimCase("ensemble-4k", "9 models × 4,000 prompts, ≤ 512 out", lambda d: ensemble_graph(d, 4000, 512)),
    SimCase("routing", "5 models, Table 1 split (6,856 prompts), ≤ 4,096 out", lambda d: routing_graph(d, 1.0, 4096)),
    SimCase("routing-1/4", "Table 1 split at 1/4 (1,714 prompts)", lambda d: routing_graph(d, 0.25, 4096)),
    SimCase("chain-24", "24 meetings, 2k-token chunks, ≤ 900 out", lambda d: chain_graph(d, 24, 900)),
    SimCase("chain-96", "96 meetings (24 × 4)", lambda d: chain_graph(d, 96, 900)),
    SimCase("mixed-24", "chain-24 + ensemble of 1,000", lambda d: mixed_graph(d, 24, 1000)),
    SimCase("mixed-96", "chain-96 + ensemble of 1,000", lambda d: mixed_graph(d, 96, 1000)),
]
QUICK_SIM = ("ensemble5-1k", "routing-1/4", "chain-24", "mixed-24")


def sim_costs(job: JobGraph, pairs: list[tuple[int, int]]) -> dict[str, CostModel]:
    """The fitted profile per model: per-token terms × weight / 7B's; the eCDF from ShareGPT at the model's limit."""
    ref = CostModel.from_dict(json.loads(PROFILE.read_text()))
    it = ref.iteration
    out = {}
    for m in job.models:
        k = m.weight_bytes / REFERENCE_BYTES
        scaled = replace(
            it,
            per_prefill_token=it.per_prefill_token * k,
            per_decode_seq=it.per_decode_seq * k,
            per_context_token=it.per_context_token * k,
        )
        out[m.name] = replace(ref, iteration=scaled, output_lengths=output_cdf_from_pairs(pairs, m.max_output_tokens))
    return out


def simulate_case(case: SimCase, d: SimData) -> tuple[list[dict[str, Any]], dict[str, tuple[Stage, ...]], float]:
    """Every variant of one workload: plan (sampled or true lengths), replay against the truth, time both;
    and the moldable bound of the true lengths (:func:`planners.offline.moldable_bound`)."""
    models, edges = case.build(d)
    job = JobGraph(tuple(models), tuple(edges))
    costs = sim_costs(job, d.pairs)
    bound = moldable_bound(JobSimulator(job, SIM_DEVICES, costs, known_output_lengths=True)).bound_s
    rows, timelines = [], {}
    for planner, pre, known in VARIANTS:
        cpu = time.process_time()  # CPU, not wall, seconds: other sessions share this machine's 2 cores
        plan = create("stages", planner, preemption=pre, known_output_lengths=known).plan(job, SIM_DEVICES, costs)
        search_s = time.process_time() - cpu
        rep = replay_plan(plan, job, SIM_DEVICES, costs)
        name = variant_name(planner, pre, known)
        timelines[name] = rep.stages
        rows.append(
            {
                "workload": case.name,
                "variant": name,
                "plan": plan.planner,
                "search_s": search_s,
                "predicted_s": plan.predicted_s,
                "actual_s": rep.actual_s,
                "e2e_s": rep.actual_s + search_s,
                "error": (plan.predicted_s - rep.actual_s) / rep.actual_s,
                "stages": len(rep.stages),
                "loads": sum(len(s.loads) for s in rep.stages),
                "fallbacks": rep.fallbacks,
            }
        )
    ours = rows[0]["e2e_s"]
    for r in rows:
        r["vs_search"] = r["e2e_s"] / ours
    return rows, timelines, bound


def summarize(rows: list[dict[str, Any]], bounds: dict[str, float]) -> list[dict[str, Any]]:
    """Per workload: the search's and greedy's speedups over the better heuristic (end-to-end); the search's
    when every planner knows the true lengths (§5.5); preemption's gain to the search; and the most a plan
    could gain (better heuristic / bound)."""
    out = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        e = {r["variant"]: r["e2e_s"] for r in rows if r["workload"] == w}
        plan = {r["variant"]: r["plan"] for r in rows if r["workload"] == w}
        best = min(("max", "min"), key=e.__getitem__)
        out.append(
            {
                "workload": w,
                "search s": e["search"],
                "plan kept": plan["search"],
                "greedy s": e["greedy"],
                "max s": e["max"],
                "min s": e["min"],
                "better heuristic": best,
                "search speedup": e[best] / e["search"],
                "greedy speedup": e[best] / e["greedy"],
                "known lengths: search speedup": min(e["max, known lengths"], e["min, known lengths"])
                / e["search, known lengths"],
                "preemption gain": e["search, no preemption"] / e["search"],
                "bound s": bounds[w],
                "bound speedup": e[best] / bounds[w],
            }
        )
    keys = ("search speedup", "greedy speedup", "known lengths: search speedup", "preemption gain", "bound speedup")
    out.append(
        {
            "workload": "geomean",
            **{k: "" for k in ("search s", "plan kept", "greedy s", "max s", "min s", "better heuristic", "bound s")},
            **{k: geomean([r[k] for r in out]) for k in keys},
        }
    )
    return out


SUMMARY_KEYS = [
    "workload",
    "search s",
    "plan kept",
    "greedy s",
    "max s",
    "min s",
    "better heuristic",
    "search speedup",
    "greedy speedup",
    "known lengths: search speedup",
    "preemption gain",
    "bound s",
    "bound speedup",
]


def run_sim(quick: bool, plot: bool, workloads: Sequence[str] | None = None) -> list[dict[str, Any]]:
    d = load_sim_data()
    cases = [c for c in SIM_CASES if (not quick or c.name in QUICK_SIM) and (not workloads or c.name in workloads)]
    print(
        f"# simulated: {SIM_DEVICES.count} devices × {SIM_DEVICES.memory_bytes / 1e9:.0f} GB; profile "
        f"{PROFILE.name} as a 7B model, scaled by weight; eCDF from {len(d.pairs)} ShareGPT pairs, true lengths "
        f"from the other {len(d.responses)} (summaries: {len(d.summaries)} QMSum answers)\n"
    )
    for c in cases:
        print(f"- {c.name}: {c.about}")
    rows, timelines, bounds = [], {}, {}
    for c in cases:
        t0 = time.perf_counter()
        got, timelines[c.name], bounds[c.name] = simulate_case(c, d)
        rows += got
        print(f"  ({c.name} simulated in {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    print(
        "\n## every variant (times in simulated seconds; search_s: CPU seconds of the search on this machine; "
        "error = (predicted − actual) / actual)\n"
    )
    print(
        rows_table(
            rows,
            [
                "workload",
                "variant",
                "plan",
                "search_s",
                "predicted_s",
                "actual_s",
                "e2e_s",
                "error",
                "stages",
                "loads",
                "fallbacks",
                "vs_search",
            ],
        )
    )
    print(
        "\n## against the better heuristic (end-to-end; speedup = better heuristic's time / the planner's; "
        "bound: the moldable bound of the true lengths)\n"
    )
    print(rows_table(summarize(rows, bounds), SUMMARY_KEYS))
    if plot:
        plot_sim(rows, timelines, [c.name for c in cases])
    return rows


# ---- figures ---------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sim(
    rows: list[dict[str, Any]], timelines: dict[str, dict[str, tuple[Stage, ...]]], workloads: list[str]
) -> None:
    plt = _plt()
    shown = [v for v in (variant_name(*x) for x in VARIANTS) if v != "search"]
    fig, ax = plt.subplots(figsize=(11, 3.6))
    width = 0.8 / len(shown)
    for i, v in enumerate(shown):
        ys = [next(r["vs_search"] for r in rows if r["workload"] == w and r["variant"] == v) for w in workloads]
        ax.bar(np.arange(len(workloads)) + (i - (len(shown) - 1) / 2) * width, ys, width, label=v)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("end-to-end time / search's")
    ax.legend(fontsize=8, ncol=3)
    ax.set_title("Simulated 8-device node: each variant's end-to-end time relative to our search planner")
    _save(fig, IMG / "offline_sim.png")
    name = next((w for w in ("mixed-96", "mixed-24") if w in timelines), None)
    if name:
        picks = ["search", "greedy", "max", "min"]
        models = dict.fromkeys(p.model for v in picks for s in timelines[name][v] for p in s.plans)
        color = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(models)}  # one colour per model throughout
        fig, axes = plt.subplots(len(picks), 1, figsize=(11, 2.2 * len(picks)), sharex=True)
        for ax, v in zip(axes, picks):
            gantt_stages(ax, timelines[name][v], SIM_DEVICES.count, v, color)
        axes[-1].set_xlabel("simulated seconds (the plan executed against the true output lengths)")
        fig.suptitle(f"{name}: devices over time per planner (like SamuLLM Fig. 13)")
        _save(fig, IMG / "offline_sim_gantt.png")


def gantt_stages(ax: Any, stages: Sequence[Stage], n_devices: int, title: str, color: dict[str, Any]) -> None:
    """Devices × time from executed stages, a model's name where it (re)loads."""
    for s in stages:
        for p in s.plans:
            for dev in p.devices:
                ax.broken_barh(
                    [(s.start_s, s.duration_s)],
                    (dev - 0.4, 0.8),
                    facecolors=color[p.model],
                    edgecolors="white",
                    linewidth=0.3,
                )
            if p.model in s.loads and p.devices:
                ax.text(s.start_s, p.devices[0], p.model, fontsize=6, va="center")
    end = stages[-1].start_s + stages[-1].duration_s if stages else 0
    ax.set_title(f"{title}: {end:.0f} s", fontsize=9, loc="left")
    ax.set_yticks(range(n_devices))
    ax.invert_yaxis()


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"(figure written to {path.relative_to(ROOT)})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["sim"], help="sim: the simulated 8-device node (real runs: bench/offline_real.py)")
    p.add_argument("--quick", action="store_true", help="4 of the workloads")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--workloads", help="only these workloads (comma-separated, e.g. chain-24,mixed-24)")
    a = p.parse_args(argv)
    if not SHARED.is_dir():
        print(
            f"error: {SHARED} not found (the benchmark reads ShareGPT and QMSum from it; COSERVE_SHARED_DATA "
            "points elsewhere)",
            file=sys.stderr,
        )
        return 2
    run_sim(a.quick, not a.no_plot, a.workloads.split(",") if a.workloads else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
