"""The offline-job CLI: ``python -m app.offline plan JOB.yaml`` prints the planned execution stages (SamuLLM).

    python -m app.offline plan configs/jobs/ensemble.yaml [--planner greedy|max|min] [--no-preemption] [--json PATH]

Planning builds the job's models when they are embedded ones, counts every request's prompt
tokens with its model's own tokenizer, takes per-model cost models (a fitted profile when there
is one, else the embedded model's shipped profile scaled by weight size), an output-length eCDF
(``output_lengths_file``, else the profile's), and runs the registry's stage planner
(``planners/stages.py``). Running a plan (``run``) is not built yet.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.offline_job import (
    JobModel,
    JobSpec,
    ModelFacts,
    build_workload,
    job_graph,
    load_job,
    model_facts,
    read_jsonl,
    weight_scale,
)
from planners.costs import CostModel
from planners.registry import create, names
from planners.stages import DeviceSet, Plan, output_cdf_from_pairs

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_PROFILE = ROOT / "profiles" / "tiny-llama-cpu.json"
DEFAULT_DATA_DIR = Path("~/.cache/coserve").expanduser()
ENGINE_LOAD_S = 30.0  # a vLLM CPU engine's start on this machine (25-55 s measured by bench/serving.py)


def model_dir(m: JobModel, data_dir: Path) -> Path:
    """The model's directory; an embedded model is built on first use."""
    if m.path:
        return Path(m.path).expanduser()
    from app.default_model import TinyLlamaSpec, ensure

    e = m.embedded
    return ensure(data_dir, TinyLlamaSpec(hidden_size=e.hidden_size, num_layers=e.layers,
                                          num_heads=e.hidden_size // 64, intermediate_size=3 * e.hidden_size,
                                          seed=e.seed))


def token_counter(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return lambda text: len(tok(text)["input_ids"])


def cost_models(job: JobSpec, dirs: dict[str, Path], facts: dict[str, ModelFacts], base_dir: Path,
                counters: dict[str, Any], data_dir: Path) -> tuple[dict[str, CostModel], list[str]]:
    """Per model: its own fitted profile if one is shipped, else the embedded model's profile scaled by
    weight bytes (a first guess: `python -m app.profile` fits a model's own); with the job's eCDF."""
    from app.default_model import ensure

    reference = CostModel.from_dict(json.loads(REFERENCE_PROFILE.read_text()))
    ref_facts = model_facts(ensure(data_dir))  # the model that profile was fitted on
    pairs_rows = read_jsonl(base_dir / job.output_lengths_file) if job.output_lengths_file else None
    costs, notes = {}, []
    for m in job.models:
        own = ROOT / "profiles" / f"{dirs[m.name].name}-cpu.json"
        if own.is_file():
            cm = CostModel.from_dict(json.loads(own.read_text()))
            notes.append(f"  {m.name}: fitted profile {own.name}")
        else:
            k = weight_scale(facts[m.name], ref_facts)
            it = reference.iteration
            cm = replace(reference, iteration=replace(it, per_prefill_token=it.per_prefill_token * k,
                                                      per_decode_seq=it.per_decode_seq * k,
                                                      per_context_token=it.per_context_token * k))
            notes.append(f"  {m.name}: {facts[m.name].weight_bytes / 2**20:.1f} MiB of weights: "
                         f"{REFERENCE_PROFILE.name} ×{k:.2f} per token")
        if pairs_rows:
            count = counters[m.name]
            pairs = [(count(r["prompt"]), count(r["response"])) for r in pairs_rows]
            cm = replace(cm, output_lengths=output_cdf_from_pairs(pairs, m.max_output_tokens))
        costs[m.name] = cm
    return costs, ["cost models:"] + notes


def plan_job(job: JobSpec, base_dir: Path, planner: str = "greedy", preemption: bool = True,
             data_dir: Path = DEFAULT_DATA_DIR) -> tuple[Plan, list[str]]:
    """Build the planner's view of ``job`` and plan it; also return notes on where the estimates came from."""
    dirs = {m.name: model_dir(m, data_dir) for m in job.models}
    facts = {n: model_facts(d) for n, d in dirs.items()}
    counters = {n: token_counter(d) for n, d in dirs.items()}
    work = build_workload(job, base_dir)
    graph = job_graph(job, work, facts, counters, {n: ENGINE_LOAD_S for n in dirs})
    costs, notes = cost_models(job, dirs, facts, base_dir, counters, data_dir)
    d = job.devices
    devices = DeviceSet(d.count, d.memory_gb * 2**30, None if d.links is None else tuple(map(tuple, d.links)))
    plan = create("stages", planner, preemption=preemption).plan(graph, devices, costs)
    notes.insert(0, "requests: " + ", ".join(f"{n} {len(r.ids)}" for n, r in work.nodes.items()))
    return plan, notes


def format_plan(plan: Plan) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{plan.planner} plan{'' if plan.preemption else ', no preemption'}: "
                        f"{plan.predicted_s:.1f} s predicted, search {plan.search_time_s * 1000:.0f} ms")
    for col in ("stage", "start s", "duration s", "models (dp × tp on devices)", "finishes"):
        table.add_column(col)
    for i, st in enumerate(plan.stages):
        runs = ", ".join(f"{p.model} {p.dp}×{p.tp} {list(p.devices)}" for p in st.plans)
        table.add_row(str(i), f"{st.start_s:.1f}", f"{st.duration_s:.1f}", runs, ", ".join(st.finishes))
    console = Console(record=True, width=120)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.offline", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="print the planned execution stages without running")
    pl.add_argument("job")
    pl.add_argument("--planner", default="greedy", choices=names("stages"))
    pl.add_argument("--no-preemption", action="store_true")
    pl.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="where embedded models are built")
    pl.add_argument("--json", metavar="PATH", help="also write the plan as JSON (the run's plan.json) here")
    args = p.parse_args(argv)
    try:
        job, base = load_job(args.job)
        plan, notes = plan_job(job, base, args.planner, not args.no_preemption, Path(args.data_dir).expanduser())
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(notes))
    print(format_plan(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
