"""Offline multi-LLM jobs: SamuLLM's greedy stage planner against the Max and Min heuristics, simulated and real.

    python bench/offline.py sim [--quick]   # an 8-device node, the four workloads at two sizes each (~1 min of CPU)
    python bench/offline.py real [--quick]  # for real: tiny models, vLLM engines in Ray actors (~22 min; quick ~10)
    python bench/offline.py all [--quick]

Simulated (SamuLLM §5): each workload is planned by every planner variant from output lengths
*sampled* from a ShareGPT eCDF (§4.1), then executed in the simulator against *true* lengths the
planner never saw, re-adjusting at every model finish as the runtime does (§4.3,
``planners.offline.replay_plan``). End-to-end time = that execution + the search's CPU seconds (§5
"Metric"; CPU, not wall, time because other sessions share this machine). The node is SamuLLM's: 8 devices of 80 GB, all linked. Costs: the embedded model's
fitted profile (``profiles/tiny-llama-cpu.json``) stands for a 7B model in fp16 on one device; a
bigger model's per-token terms scale by its weight bytes over the 7B's, the rule
``actors.offline.plan.cost_models`` applies, anchored at 7B instead of at the 14 MB embedded model (at that
anchor a 13B model would cost 0.2 s per prompt token). Load times: 10 s + weights / (tp × 2 GB/s),
11 to 45 s as in SamuLLM §5.1.

Real: the example jobs of ``configs/jobs`` with bigger inputs from ``shared/data`` (ShareGPT prompts,
QMSum meetings), run by ``app.offline.run_job`` on this machine (2 devices = 2 CPU cores), one run
per planner; reports end-to-end time (search included), engine load time, and the cost model's
error. The load-time table is measured first (each model size started once, two at a time), as
SamuLLM §4.1 profiles it in advance. Needs ``../shared/data``.

Why one module of about 540 lines: one script's measurement, simulation and plots of one experiment.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from actors.offline.job import chunk_text  # noqa: E402
from bench.common import rows_table  # noqa: E402
from app.serve_env import init_ray  # noqa: E402
from planners.costs import CostModel  # noqa: E402
from planners.registry import create  # noqa: E402
from planners.offline import (  # noqa: E402
    DeviceSet,
    Edge,
    EngineLimits,
    JobGraph,
    ModelSpec,
    Stage,
    chain_maps,
    output_cdf_from_pairs,
    replay_plan,
)

# ../shared/data beside the repository; COSERVE_SHARED_DATA points elsewhere (e.g. from a git worktree).
SHARED = Path(os.environ.get("COSERVE_SHARED_DATA") or ROOT.parent / "shared" / "data")
SHAREGPT = SHARED / "prompts" / "sharegpt_sample.jsonl"
QMSUM = SHARED / "longdocs" / "qmsum_meetings_sample.jsonl"
PROFILE = ROOT / "profiles" / "tiny-llama-cpu.json"
IMG = ROOT / "docs" / "img"

# (planner, preemption, known output lengths): SamuLLM's method, its baselines, the §5.5 ablations, and
# `best` (greedy's plan or a heuristic's, whichever its cost model predicts faster).
VARIANTS = [("greedy", True, False), ("greedy", False, False), ("greedy", True, True),
            ("max", True, False), ("min", True, False), ("min", False, False), ("best", True, False)]


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
ENSEMBLE = (SimModel("vicuna-13b", 13.0, _L13), SimModel("oasst-pythia-12b", 12.0, 2 * 36 * 5120 * 2),
            SimModel("alpaca-13b", 13.0, _L13), SimModel("baize-13b", 13.0, _L13), SimModel("koala-13b", 13.0, _L13),
            SimModel("dolly-12b", 12.0, 2 * 36 * 5120 * 2), SimModel("mpt-7b", 6.7, 2 * 32 * 4096 * 2),
            SimModel("chatglm3-6b", 6.2, 2 * 28 * 2 * 128 * 2), SimModel("stablelm-7b", 7.9, 2 * 16 * 6144 * 2))
# ROUTERBENCH's open models and SamuLLM Table 1's request counts. Mixtral is costed by all its weights
# (46.7 B), which overstates its compute: only about 13 B are active per token.
ROUTING = ((SimModel("llama-2-70b", 69.0, 2 * 80 * 1024 * 2), 408),
           (SimModel("mixtral-8x7b", 46.7, 2 * 32 * 1024 * 2), 1267), (SimModel("wizardlm-13b", 13.0, _L13), 2068),
           (SimModel("codellama-34b", 33.7, 2 * 48 * 1024 * 2), 456),
           (SimModel("mistral-7b", 7.2, 2 * 32 * 1024 * 2), 2657))
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
    return SimData(pairs, np.array([min(tokens(r["prompt_chars"]), 1024) for r in held]),
                   np.array([tokens(r["response_chars"]) for r in held]), np.array(summaries),
                   [m["transcript"] for m in meetings])


def sim_spec(m: SimModel, prompts: Sequence[int], max_out: int, truth_pool: np.ndarray, seed: int) -> ModelSpec:
    """A node whose true output lengths are drawn from ``truth_pool``, never from the planner's eCDF half."""
    truth = np.minimum(np.random.default_rng(seed).choice(truth_pool, size=len(prompts)), max_out)
    return ModelSpec(m.name, m.weight_bytes, tuple(int(p) for p in prompts), max_out, m.kv_bytes_per_token,
                     max_seq_len=4096, output_tokens=tuple(int(x) for x in truth), load_time_s=m.load_times(),
                     engine=EngineLimits(max_num_seqs=256, max_batched_tokens=8192))


def ensemble_graph(d: SimData, n: int, max_out: int, seed: int = 0) -> tuple[list[ModelSpec], list[Edge]]:
    prompts = np.random.default_rng(seed).choice(d.prompts, size=n)
    return [sim_spec(m, prompts, max_out, d.responses, seed + 1 + i) for i, m in enumerate(ENSEMBLE)], []


def routing_graph(d: SimData, scale: float, max_out: int, seed: int = 1) -> tuple[list[ModelSpec], list[Edge]]:
    rng = np.random.default_rng(seed)
    return [sim_spec(m, rng.choice(d.prompts, size=max(1, round(k * scale))), max_out, d.responses, seed + 10 + i)
            for i, (m, k) in enumerate(ROUTING)], []


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
    SimCase("ensemble-1k", "9 models × 1,000 prompts, ≤ 256 out", lambda d: ensemble_graph(d, 1000, 256)),
    SimCase("ensemble-4k", "9 models × 4,000 prompts, ≤ 512 out", lambda d: ensemble_graph(d, 4000, 512)),
    SimCase("routing", "5 models, Table 1 split (6,856 prompts), ≤ 4,096 out", lambda d: routing_graph(d, 1.0, 4096)),
    SimCase("routing-1/4", "Table 1 split at 1/4 (1,714 prompts)", lambda d: routing_graph(d, 0.25, 4096)),
    SimCase("chain-24", "24 meetings, 2k-token chunks, ≤ 900 out", lambda d: chain_graph(d, 24, 900)),
    SimCase("chain-96", "96 meetings (24 × 4)", lambda d: chain_graph(d, 96, 900)),
    SimCase("mixed-24", "chain-24 + ensemble of 1,000", lambda d: mixed_graph(d, 24, 1000)),
    SimCase("mixed-96", "chain-96 + ensemble of 1,000", lambda d: mixed_graph(d, 96, 1000)),
]
QUICK_SIM = ("ensemble-1k", "routing-1/4", "chain-24", "mixed-24")


def sim_costs(job: JobGraph, pairs: list[tuple[int, int]]) -> dict[str, CostModel]:
    """The fitted profile per model: per-token terms × weight / 7B's; the eCDF from ShareGPT at the model's limit."""
    ref = CostModel.from_dict(json.loads(PROFILE.read_text()))
    it = ref.iteration
    out = {}
    for m in job.models:
        k = m.weight_bytes / REFERENCE_BYTES
        scaled = replace(it, per_prefill_token=it.per_prefill_token * k, per_decode_seq=it.per_decode_seq * k,
                         per_context_token=it.per_context_token * k)
        out[m.name] = replace(ref, iteration=scaled, output_lengths=output_cdf_from_pairs(pairs, m.max_output_tokens))
    return out


def simulate_case(case: SimCase, d: SimData) -> tuple[list[dict[str, Any]], dict[str, tuple[Stage, ...]]]:
    """Every variant of one workload: plan (sampled or true lengths), replay against the truth, time both."""
    models, edges = case.build(d)
    job = JobGraph(tuple(models), tuple(edges))
    costs = sim_costs(job, d.pairs)
    rows, timelines = [], {}
    for planner, pre, known in VARIANTS:
        cpu = time.process_time()  # CPU, not wall, seconds: other sessions share this machine's 2 cores
        plan = create("stages", planner, preemption=pre, known_output_lengths=known).plan(job, SIM_DEVICES, costs)
        search_s = time.process_time() - cpu
        rep = replay_plan(plan, job, SIM_DEVICES, costs)
        name = variant_name(planner, pre, known)
        timelines[name] = rep.stages
        rows.append({"workload": case.name, "variant": name, "plan": plan.planner, "search_s": search_s,
                     "predicted_s": plan.predicted_s, "actual_s": rep.actual_s,
                     "e2e_s": rep.actual_s + search_s,
                     "error": (plan.predicted_s - rep.actual_s) / rep.actual_s, "stages": len(rep.stages),
                     "loads": sum(len(s.loads) for s in rep.stages), "fallbacks": rep.fallbacks})
    ours = rows[0]["e2e_s"]
    for r in rows:
        r["vs_greedy"] = r["e2e_s"] / ours
    return rows, timelines


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload: greedy's (and best's) speedup over the better heuristic, from preemption, and knowing the lengths."""
    out = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        e = {r["variant"]: r["e2e_s"] for r in rows if r["workload"] == w}
        kept = next((r["plan"] for r in rows if r["workload"] == w and r["variant"] == "best"), "")
        best = min(("max", "min"), key=e.__getitem__)
        out.append({"workload": w, "greedy s": e["greedy"], "max s": e["max"], "min s": e["min"],
                    "better heuristic": best, "speedup": e[best] / e["greedy"],
                    "preemption gain": e["greedy, no preemption"] / e["greedy"],
                    "known lengths gain": e["greedy"] / e["greedy, known lengths"],
                    "best keeps": kept.partition(":")[2],
                    "best speedup": e[best] / e["best"] if "best" in e else float("nan")})
    keys = ("speedup", "preemption gain", "known lengths gain", "best speedup")
    out.append({"workload": "geomean", "greedy s": "", "max s": "", "min s": "", "better heuristic": "",
                "best keeps": "", **{k: geomean([r[k] for r in out]) for k in keys}})
    return out


def run_sim(quick: bool, plot: bool) -> list[dict[str, Any]]:
    d = load_sim_data()
    cases = [c for c in SIM_CASES if not quick or c.name in QUICK_SIM]
    print(f"# simulated: {SIM_DEVICES.count} devices × {SIM_DEVICES.memory_bytes / 1e9:.0f} GB; profile "
          f"{PROFILE.name} as a 7B model, scaled by weight; eCDF from {len(d.pairs)} ShareGPT pairs, true lengths "
          f"from the other {len(d.responses)} (summaries: {len(d.summaries)} QMSum answers)\n")
    for c in cases:
        print(f"- {c.name}: {c.about}")
    rows, timelines = [], {}
    for c in cases:
        t0 = time.perf_counter()
        got, timelines[c.name] = simulate_case(c, d)
        rows += got
        print(f"  ({c.name} simulated in {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    print("\n## every variant (times in simulated seconds; search_s: CPU seconds of the search on this machine; "
          "error = (predicted − actual) / actual)\n")
    print(rows_table(rows, ["workload", "variant", "plan", "search_s", "predicted_s", "actual_s", "e2e_s", "error",
                          "stages", "loads", "fallbacks", "vs_greedy"]))
    print("\n## greedy against the heuristics (end-to-end; gains are ratios of end-to-end times)\n")
    print(rows_table(summarize(rows), ["workload", "greedy s", "max s", "min s", "better heuristic", "speedup",
                                     "preemption gain", "known lengths gain", "best keeps", "best speedup"]))
    if plot:
        plot_sim(rows, timelines, [c.name for c in cases])
    return rows


# ---- figures ---------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sim(rows: list[dict[str, Any]], timelines: dict[str, dict[str, tuple[Stage, ...]]],
             workloads: list[str]) -> None:
    plt = _plt()
    shown = [v for v in (variant_name(*x) for x in VARIANTS) if v != "greedy"]
    fig, ax = plt.subplots(figsize=(11, 3.6))
    width = 0.8 / len(shown)
    for i, v in enumerate(shown):
        ys = [next(r["vs_greedy"] for r in rows if r["workload"] == w and r["variant"] == v) for w in workloads]
        ax.bar(np.arange(len(workloads)) + (i - (len(shown) - 1) / 2) * width, ys, width, label=v)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("end-to-end time / greedy's")
    ax.legend(fontsize=8, ncol=3)
    ax.set_title("Simulated 8-device node: each variant's end-to-end time relative to SamuLLM's greedy planner")
    _save(fig, IMG / "offline_sim.png")
    name = next((w for w in ("mixed-96", "mixed-24") if w in timelines), None)
    if name:
        picks = ["greedy", "max", "min", "greedy, no preemption"]
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
                ax.broken_barh([(s.start_s, s.duration_s)], (dev - 0.4, 0.8), facecolors=color[p.model],
                               edgecolors="white", linewidth=0.3)
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


# ---- real runs: tiny models, vLLM engines in Ray actors ------------------------------------------------


REAL_PLANNERS = ("greedy", "max", "min")
REAL_TOKENS = 64  # output limit of every model: the tiny random models mostly run to it
# Table 1's split folded onto three sizes: 7B 39 %, 13B + Mixtral 48 %, 34B + 70B 13 %.
ROUTE_SHARES = {"small": 0.39, "medium": 0.48, "large": 0.13}


@dataclass(frozen=True)
class RealCase:
    name: str
    example: str  # configs/jobs/<example>.yaml: models, templates, graph
    prompts: int = 0  # ShareGPT prompts for an ensemble or routing part
    meetings: int = 0  # QMSum meetings for a chain part, each cut to 1/doc_scale of its length
    doc_scale: int = 40


REAL_CASES = [RealCase("ensemble", "ensemble", prompts=96), RealCase("routing", "routing", prompts=192),
              RealCase("chain", "chain_summary", meetings=8), RealCase("mixed", "mixed", prompts=64, meetings=8)]
QUICK_REAL = ("routing", "mixed")


def write_real_inputs(case: RealCase, folder: Path) -> dict[str, Path]:
    """ShareGPT prompts (≤ 500 bytes: the byte-level tokenizer makes a byte a token), a routing file by
    ROUTE_SHARES, and QMSum meetings shortened to keep QMSum's skew of lengths at a size this CPU runs."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = [r for r in map(json.loads, SHAREGPT.open()) if 0 < len(r["prompt"].encode()) <= 500][: case.prompts]
    prompts = [{"id": r["id"], "prompt": r["prompt"]} for r in rows]
    models = list(ROUTE_SHARES)
    routes = [{"id": r["id"], "model": str(rng.choice(models, p=list(ROUTE_SHARES.values())))} for r in prompts]
    meetings = [json.loads(line) for line in QMSUM.open()][: case.meetings]
    docs = [{"id": m["doc_id"], "text": m["transcript"][: len(m["transcript"]) // case.doc_scale]} for m in meetings]
    out = {}
    for name, data in (("prompts", prompts), ("routes", routes), ("docs", docs)):
        out[name] = folder / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(x) + "\n" for x in data))
    return out


def size_key(model: dict[str, Any]) -> str:
    """An embedded model's size, the key of the load-time table (the summarizer is medium's size)."""
    e = model.get("embedded") or {}
    return f"h{e.get('hidden_size', 256)}-l{e.get('layers', 4)}"


def real_job(case: RealCase, folder: Path, loads: dict[str, float]) -> Path:
    """The example job with the inputs above, output limit REAL_TOKENS and the measured load times
    (``loads``: per size_key, and ``default`` for the rest)."""
    import yaml

    spec = yaml.safe_load((ROOT / "configs" / "jobs" / f"{case.example}.yaml").read_text())
    files = write_real_inputs(case, folder)

    def point(part: dict[str, Any]) -> None:
        kind = part["app"]["kind"]
        part["input"] = str(files["docs" if kind == "chain_summary" else "prompts"])
        if kind == "routing":
            part["app"]["routing_file"] = str(files["routes"])

    for part in spec["app"]["parts"] if spec["app"]["kind"] == "mixed" else [spec]:
        point(part)
    for m in spec["models"]:
        m["max_output_tokens"] = REAL_TOKENS
        m["load_s"] = loads.get(size_key(m), loads["default"])
    spec.update(output_dir=str(folder / "out"), engine_load_s=loads["default"])
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def start_ray() -> None:
    # Ray starts workers at nice 15; on a shared host the engines would then time other sessions' work.
    os.environ.setdefault("RAY_worker_niceness", "0")
    init_ray(address="local")  # a Ray of our own, even when another one runs on this machine


def measure_load_table(folder: Path, data_dir: Path) -> dict[str, float]:
    """SamuLLM §4.1's load-time table, measured: start each of the three model sizes of the examples
    (one request, one token), two at a time as in the runs; the median start time per size."""
    import yaml

    from app.offline import run_job
    from actors.offline.job import load_job

    path = real_job(RealCase("load-table", "ensemble", prompts=2), folder, {"default": 30.0})
    size = {m["name"]: size_key(m) for m in yaml.safe_load(path.read_text())["models"]}
    job, base = load_job(path)
    job = job.model_copy(update={"models": [m.model_copy(update={"max_output_tokens": 1}) for m in job.models]})
    summary = run_job(job, base, "min", True, data_dir, folder / "out", progress=False)  # loads 2 at a time, as runs do
    starts = [(size[r["model"]], r["load_s"]) for r in summary["replicas"] if r["load_s"] is not None]
    table = {k: float(np.median([s for kk, s in starts if kk == k])) for k in dict.fromkeys(k for k, _ in starts)}
    table["default"] = float(np.median([s for _, s in starts]))
    print("load-time table (s): " + ", ".join(f"{k} {v:.1f}" for k, v in table.items())
          + f" from {len(starts)} engine starts")
    return table


def run_real_case(case: RealCase, planner: str, folder: Path, data_dir: Path, loads: dict[str, float]
                  ) -> dict[str, Any]:
    from app.offline import run_job
    from actors.offline.job import load_job

    job, base = load_job(real_job(case, folder, loads))
    load_before = os.getloadavg()[0]
    s = run_job(job, base, planner, True, data_dir, folder / "out", progress=False)
    loads = [r["load_s"] for r in s["replicas"] if r["load_s"] is not None]
    return {"workload": case.name, "planner": planner, "requests": sum(m["requests"] for m in s["models"].values()),
            "search_s": s["search_time_s"], "predicted_s": s["predicted_s"], "actual_s": s["actual_s"],
            "e2e_s": s["actual_s"] + s["search_time_s"], "error": (s["predicted_s"] - s["actual_s"]) / s["actual_s"],
            "engine starts": len(loads), "mean load s": float(np.mean(loads)) if loads else 0.0,
            "load share": sum(loads) / (job.devices.count * s["actual_s"]),
            "stages": len(s["stages"]), "loadavg": f"{load_before:.1f}/{os.getloadavg()[0]:.1f}",
            "gantt": folder / "out" / "gantt.png"}


def run_real(quick: bool, data_dir: Path, load_s: float | None, plot: bool, work_dir: Path | None = None,
             workloads: Sequence[str] | None = None, planners: Sequence[str] = REAL_PLANNERS) -> list[dict[str, Any]]:
    start_ray()
    cases = [c for c in REAL_CASES if (not quick or c.name in QUICK_REAL) and (not workloads or c.name in workloads)]
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="offline-bench-") as tmp:
        root = work_dir or Path(tmp)
        loads = {"default": load_s} if load_s else measure_load_table(root / "load-table", data_dir)
        rows = []
        for case in cases:
            for planner in planners:
                row = run_real_case(case, planner, root / f"{case.name}-{planner}", data_dir, loads)
                rows.append(row)
                print(f"  {case.name} {planner}: {row['e2e_s']:.1f} s (predicted {row['predicted_s']:.1f} s)",
                      file=sys.stderr)
                if plot and case.name == "mixed":
                    IMG.mkdir(parents=True, exist_ok=True)
                    (IMG / f"offline_real_mixed_{planner}.png").write_bytes(row["gantt"].read_bytes())
    print(f"\n# real: {len(cases)} workloads × {len(planners)} planners on this machine "
          f"({os.cpu_count()} cores = 2 devices), output limit {REAL_TOKENS}, load-time table "
          f"{', '.join(f'{k} {v:.1f} s' for k, v in loads.items())}; "
          f"{time.time() - t_start:.0f} s in all\n")
    print(rows_table(rows, ["workload", "planner", "requests", "search_s", "predicted_s", "actual_s", "e2e_s", "error",
                          "engine starts", "mean load s", "load share", "stages", "loadavg"]))
    summary = []
    nan = float("nan")
    for w in dict.fromkeys(r["workload"] for r in rows):
        e = {r["planner"]: r["e2e_s"] for r in rows if r["workload"] == w}
        heuristics = [h for h in ("max", "min") if h in e]
        better = min(heuristics, key=e.__getitem__) if heuristics else ""
        summary.append({"workload": w, **{f"{n} s": e.get(n, nan) for n in ("greedy", "max", "min", "best")},
                        "better heuristic": better,
                        "speedup": e[better] / e["greedy"] if better and "greedy" in e else nan,
                        "best speedup": e[better] / e["best"] if better and "best" in e else nan})
    errors = [abs(r["error"]) for r in rows]
    keys = ("speedup", "best speedup")
    summary.append({"workload": "geomean", "greedy s": "", "max s": "", "min s": "", "best s": "",
                    "better heuristic": "", **{k: geomean([r[k] for r in summary if r[k] == r[k]]) for k in keys}})
    print("\n## greedy (and best) against the heuristics (real, end-to-end)\n")
    print(rows_table(summary, ["workload", "greedy s", "max s", "min s", "best s", "better heuristic", *keys]))
    print(f"\ncost-model error |predicted − actual| / actual: mean {np.mean(errors):.1%}, "
          f"median {np.median(errors):.1%}, max {max(errors):.1%}")
    return rows

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["sim", "real", "all"])
    p.add_argument("--quick", action="store_true", help="fewer workloads (and smaller real runs)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--data-dir", default=str(Path("~/.cache/coserve").expanduser()), help="embedded models")
    p.add_argument("--load-s", type=float, help="engine load time to plan with (default: measure it first)")
    p.add_argument("--work-dir", help="keep each real run's job, outputs, plan and summary here (default: a temp dir)")
    p.add_argument("--workloads", help="real runs: only these workloads (comma-separated: ensemble,routing,chain,mixed)")
    p.add_argument("--planners", default=",".join(REAL_PLANNERS), help="real runs: these planners, in order")
    a = p.parse_args(argv)
    if not SHARED.is_dir():
        print(f"error: {SHARED} not found (the benchmark reads ShareGPT and QMSum from it)", file=sys.stderr)
        return 2
    if a.part in ("sim", "all"):
        run_sim(a.quick, not a.no_plot)
    if a.part in ("real", "all"):
        run_real(a.quick, Path(a.data_dir).expanduser(), a.load_s, not a.no_plot,
                 Path(a.work_dir).expanduser().resolve() if a.work_dir else None,
                 a.workloads.split(",") if a.workloads else None, tuple(x for x in a.planners.split(",") if x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
