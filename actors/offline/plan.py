"""Make an offline job ready to run: its models built, prompts counted, cost models chosen, stages planned.

Planning builds the job's models when they are embedded ones, counts every request's prompt
tokens with its model's own tokenizer, takes per-model cost models (a fitted profile when there
is one, else the embedded model's shipped profile scaled by weight size), an output-length eCDF
(``output_lengths_file``, else the profile's), and runs the registry's stage planner
(``planners/offline/``). The CLI is ``app/offline.py``; running the plan is ``offline_runner.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from actors.offline.job import (
    JobModel,
    JobSpec,
    ModelFacts,
    Workload,
    build_workload,
    job_graph,
    model_facts,
    read_jsonl,
    remaining_workload,
    weight_scale,
)
from actors.offline.load_times import LoadTimes
from actors.offline.profile import profile_dir
from planners.costs import CostModel
from planners.offline import DeviceSet, JobGraph, Plan, output_cdf_from_pairs
from planners.registry import create

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_PROFILE = ROOT / "profiles" / "tiny-llama-cpu.json"
DEFAULT_DATA_DIR = Path("~/.cache/coserve").expanduser()


def model_dir(m: JobModel, data_dir: Path) -> Path:
    """The model's directory on this host; an embedded model is built on first use."""
    return m.local_dir(data_dir)


def token_counter(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return lambda text: len(tok(text)["input_ids"])


def cost_models(
    job: JobSpec,
    dirs: dict[str, Path],
    facts: dict[str, ModelFacts],
    base_dir: Path,
    counters: dict[str, Any],
    data_dir: Path,
) -> tuple[dict[str, CostModel], list[str]]:
    """Per model: its own fitted profile (``python -m app.offline profile``: in the data dir's
    ``offline/profiles``, else shipped in ``profiles/``), else the embedded model's profile scaled by weight
    bytes (a first guess); with the job's eCDF when it names one."""
    from actors.models.default_model import ensure

    reference = CostModel.from_dict(json.loads(REFERENCE_PROFILE.read_text()))
    ref_facts = model_facts(ensure(data_dir))  # the model that profile was fitted on
    pairs_rows = read_jsonl(base_dir / job.output_lengths_file) if job.output_lengths_file else None
    costs, notes = {}, []
    for m in job.models:
        name = f"{dirs[m.name].name}-cpu.json"
        own = next((p for p in (profile_dir(data_dir) / name, ROOT / "profiles" / name) if p.is_file()), None)
        if own is not None:
            cm = CostModel.from_dict(json.loads(own.read_text()))
            notes.append(f"  {m.name}: fitted profile {own}")
        else:
            k = weight_scale(facts[m.name], ref_facts)
            it = reference.iteration
            cm = replace(
                reference,
                iteration=replace(
                    it,
                    per_prefill_token=it.per_prefill_token * k,
                    per_decode_seq=it.per_decode_seq * k,
                    per_context_token=it.per_context_token * k,
                ),
            )
            notes.append(
                f"  {m.name}: {facts[m.name].weight_bytes / 2**20:.1f} MiB of weights: "
                f"{REFERENCE_PROFILE.name} ×{k:.2f} per token"
            )
        if pairs_rows:
            count = counters[m.name]
            pairs = [(count(r["prompt"]), count(r["response"])) for r in pairs_rows]
            cm = replace(cm, output_lengths=output_cdf_from_pairs(pairs, m.max_output_tokens))
        costs[m.name] = cm
    return costs, ["cost models:"] + notes


def load_times(job: JobSpec, dirs: dict[str, Path], data_dir: Path) -> tuple[dict[str, float], list[str]]:
    """Per model, the engine start time to plan with (SamuLLM §4.1's load-time table): its own ``load_s``;
    else the job's ``engine_load_s`` when the job sets it; else the median of this host's measured starts
    of its directory (:class:`LoadTimes`, written by the runner); else the default ``engine_load_s``."""
    table = LoadTimes(data_dir)
    explicit = "engine_load_s" in job.model_fields_set
    out, notes = {}, []
    for m in job.models:
        measured = None if m.load_s or explicit else table.median(dirs[m.name].name)
        if m.load_s:
            out[m.name], why = m.load_s, "its load_s"
        elif measured is not None:
            out[m.name], why = measured[0], f"median of {measured[1]} measured start(s)"
        else:
            out[m.name], why = job.engine_load_s, "the job's engine_load_s" if explicit else "default engine_load_s"
        notes.append(f"  {m.name}: {out[m.name]:.1f} s ({why})")
    return out, ["engine start times:"] + notes


@dataclass
class PreparedJob:
    """A job made ready to run: its model directories, the whole workload, what is left of it, and the plan."""

    job: JobSpec
    base_dir: Path
    dirs: dict[str, Path]
    facts: dict[str, ModelFacts]
    work: Workload
    todo: Workload
    keep: dict[str, list[int]]
    """Per model still to run: the indices of its remaining requests in ``work``."""
    graph: JobGraph | None
    devices: DeviceSet
    plan: Plan | None
    notes: list[str]
    data_dir: Path = DEFAULT_DATA_DIR
    """Where embedded models are built; an engine on another node resolves its own (COSERVE_DATA_DIR there)."""


def prepare_job(
    job: JobSpec,
    base_dir: Path,
    planner: str = "search",
    preemption: bool = True,
    data_dir: Path = DEFAULT_DATA_DIR,
    done: dict[str, set[str]] | None = None,
) -> PreparedJob:
    """Build the planner's view of the requests of ``job`` not in ``done`` (resume) and plan them;
    ``plan`` is None when nothing is left."""
    dirs = {m.name: model_dir(m, data_dir) for m in job.models}
    facts = {n: model_facts(d) for n, d in dirs.items()}
    work = build_workload(job, base_dir)
    todo, keep = remaining_workload(work, done or {})
    d = job.devices
    devices = DeviceSet(d.count, d.memory_gb * 2**30, None if d.links is None else tuple(map(tuple, d.links)))
    notes = ["requests: " + ", ".join(f"{n} {len(r.ids)}" for n, r in work.nodes.items())]
    skipped = {n: len(r.ids) - len(keep.get(n, ())) for n, r in work.nodes.items()}
    if any(skipped.values()):
        notes.append("already done (resume): " + ", ".join(f"{n} {k}" for n, k in skipped.items()))
    if not todo.nodes:
        return PreparedJob(job, base_dir, dirs, facts, work, todo, keep, None, devices, None, notes, data_dir)
    sub = job.model_copy(update={"models": [m for m in job.models if m.name in todo.nodes]})
    counters = {n: token_counter(dirs[n]) for n in todo.nodes}
    loads, load_notes = load_times(sub, dirs, data_dir)
    graph = job_graph(sub, todo, facts, counters, loads)
    costs, cost_notes = cost_models(sub, dirs, facts, base_dir, counters, data_dir)
    plan = create("stages", planner, preemption=preemption).plan(graph, devices, costs)
    return PreparedJob(
        job, base_dir, dirs, facts, work, todo, keep, graph, devices, plan, notes + load_notes + cost_notes, data_dir
    )


def plan_job(
    job: JobSpec, base_dir: Path, planner: str = "search", preemption: bool = True, data_dir: Path = DEFAULT_DATA_DIR
) -> tuple[Plan, list[str]]:
    """Build the planner's view of ``job`` and plan it; also return notes on where the estimates came from."""
    prep = prepare_job(job, base_dir, planner, preemption, data_dir)
    return prep.plan, prep.notes
