"""The ``mixed`` job kind (SamuLLM §5.4): several sub-applications, each with its models and input, as one graph."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from actors.offline.job import JobSpec, ModelFacts, build_workload, job_graph, load_job
from planners import registry
from planners.costs import CostModel, IterationLatency, OutputLengthCDF, default_cost_model
from planners.offline import DeviceSet

JOBS = Path(__file__).resolve().parents[2] / "configs" / "jobs"


def _mixed(**over) -> JobSpec:
    spec = yaml.safe_load((JOBS / "mixed.yaml").read_text())
    spec["app"].update(over.pop("app", {}))
    spec.update(over)
    return JobSpec.model_validate(spec)


def test_mixed_is_its_parts_side_by_side():
    job, base = load_job(JOBS / "mixed.yaml")
    work = build_workload(job, base)
    chain = build_workload(*load_job(JOBS / "chain_summary.yaml"))
    ens = build_workload(*load_job(JOBS / "ensemble.yaml"))
    assert list(work.nodes) == [m.name for m in job.models]
    for name in ("summarizer", "evaluator"):
        assert work.nodes[name] == chain.nodes[name]
    for name in ("small", "medium", "large"):
        assert work.nodes[name] == ens.nodes[name]
    assert work.edges == chain.edges  # the ensemble part adds no edges


def test_max_inputs_of_the_job_applies_to_every_part_unless_a_part_sets_its_own(tmp_path):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i, "prompt": f"q{i}"}) + "\n" for i in range(9)))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": "w " * 50}) + "\n" for i in range(4)))
    job = JobSpec.model_validate(
        {
            "name": "m",
            "max_inputs": 3,
            "models": [{"name": n} for n in ("s", "e", "x")],
            "app": {
                "kind": "mixed",
                "parts": [
                    {
                        "models": ["s", "e"],
                        "input": "d.jsonl",
                        "app": {"kind": "chain_summary", "summarizer": "s", "evaluator": "e", "chunk_chars": 40},
                    },
                    {"models": ["x"], "input": "p.jsonl", "app": {"kind": "ensemble"}, "max_inputs": 5},
                ],
            },
        }
    )
    work = build_workload(job, tmp_path)
    assert len(work.nodes["e"].ids) == 3 and len(work.nodes["x"].ids) == 5
    assert [(e.src, e.dst) for e in work.edges] == [("s", "s"), ("s", "e")]


@pytest.mark.parametrize(
    "change, words",
    [
        ({"app": {"parts": []}}, "needs app.parts"),
        (
            {
                "app": {
                    "parts": [
                        {
                            "models": ["summarizer", "evaluator", "small"],
                            "input": "docs.jsonl",
                            "app": {"kind": "chain_summary", "summarizer": "summarizer", "evaluator": "evaluator"},
                        },
                        {"models": ["small", "medium", "large"], "input": "prompts.jsonl", "app": {"kind": "ensemble"}},
                    ]
                }
            },
            "already in part 0",
        ),
        (
            {
                "app": {
                    "parts": [
                        {
                            "models": ["small", "medium", "large", "summarizer", "evaluator", "nope"],
                            "input": "prompts.jsonl",
                            "app": {"kind": "ensemble"},
                        }
                    ]
                }
            },
            "unknown model 'nope'",
        ),
        (
            {"app": {"parts": [{"models": ["small"], "input": "prompts.jsonl", "app": {"kind": "ensemble"}}]}},
            "in no part",
        ),
        (
            {
                "app": {
                    "parts": [
                        {
                            "models": ["summarizer", "evaluator", "small", "medium", "large"],
                            "input": "x.jsonl",
                            "app": {"kind": "mixed"},
                        }
                    ]
                }
            },
            "cannot itself be mixed",
        ),
        (
            {
                "app": {
                    "parts": [
                        {
                            "models": ["summarizer", "evaluator"],
                            "input": "docs.jsonl",
                            "app": {"kind": "chain_summary", "summarizer": "summarizer", "evaluator": "small"},
                        },
                        {"models": ["small", "medium", "large"], "input": "prompts.jsonl", "app": {"kind": "ensemble"}},
                    ]
                }
            },
            "evaluator must name one of",
        ),
        ({"app": {"kind": "ensemble"}}, "for app.kind mixed only"),
    ],
)
def test_bad_mixed_jobs_are_refused_with_the_reason(change, words):
    with pytest.raises(ValueError, match=words):
        _mixed(**change)


def test_other_kinds_still_need_an_input():
    with pytest.raises(ValueError, match="needs an input"):
        JobSpec.model_validate({"name": "t", "app": {"kind": "ensemble"}, "models": [{"name": "a"}]})


def test_the_mixed_graph_plans_as_one_job():
    job, base = load_job(JOBS / "mixed.yaml")
    work = build_workload(job, base)
    facts = {m.name: ModelFacts(1e7 * (i + 1), 8192.0, 2048) for i, m in enumerate(job.models)}
    graph = job_graph(job, work, facts, {m.name: len for m in job.models}, {m.name: 1.0 for m in job.models})
    base_cost = default_cost_model()
    cost = CostModel(
        base_cost.forward,
        base_cost.backward,
        IterationLatency(0.01, 1e-4, 0.0, 0.0),
        base_cost.memory,
        OutputLengthCDF.from_samples([8, 16, 32]),
    )
    plan = registry.create("stages", "greedy").plan(graph, DeviceSet(2, 2 * 2**30), {m.name: cost for m in job.models})
    order = [m for st in plan.stages for m in st.finishes]
    assert sorted(order) == sorted(work.nodes) and order.index("summarizer") < order.index("evaluator")
