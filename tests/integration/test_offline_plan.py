"""Offline jobs, planning side: the job spec, the workloads it names, and `python -m app.offline plan`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from actors.offline.job import JobSpec, build_workload, chunk_text, load_job, render_prompt

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "configs" / "jobs"


def _job(**over) -> JobSpec:
    base = {
        "name": "t",
        "input": "prompts.jsonl",
        "app": {"kind": "ensemble"},
        "models": [{"name": "a"}, {"name": "b"}],
    }
    return JobSpec.model_validate({**base, **over})


def test_ensemble_gives_every_model_every_prompt():
    job, base = load_job(JOBS / "ensemble.yaml")
    work = build_workload(job, base)
    assert {n: len(r.ids) for n, r in work.nodes.items()} == {"small": 12, "medium": 12, "large": 12}
    assert work.nodes["small"].texts == work.nodes["large"].texts and work.edges == []


def test_routing_splits_prompts_by_the_routing_file():
    job, base = load_job(JOBS / "routing.yaml")
    work = build_workload(job, base)
    assert {n: len(r.ids) for n, r in work.nodes.items()} == {"small": 7, "medium": 4, "large": 1}
    assert work.nodes["large"].ids == ["p11"]


def test_chain_summary_chains_chunks_and_feeds_the_last_summary_to_the_evaluator():
    job, base = load_job(JOBS / "chain_summary.yaml")
    work = build_workload(job, base)
    summ, ev = work.nodes["summarizer"], work.nodes["evaluator"]
    docs = [json.loads(line) for line in (JOBS / "docs.jsonl").read_text().splitlines()]
    per_doc = [len(chunk_text(d["text"], 600)) for d in docs]
    assert len(summ.ids) == sum(per_doc) and ev.ids == [d["id"] for d in docs]
    loop, feed = work.edges
    assert (loop.src, loop.dst, feed.src, feed.dst) == ("summarizer",) * 3 + ("evaluator",)
    # Chunk k of a document reads chunk k-1's summary; each document's first chunk reads none.
    assert loop.request_map[0] == -1 and loop.request_map[per_doc[0]] == -1
    assert loop.request_map[1 : per_doc[0]] == tuple(range(per_doc[0] - 1))
    assert feed.request_map == (per_doc[0] - 1, sum(per_doc) - 1)
    assert summ.ids[0] == f"{docs[0]['id']}#0"


def test_explicit_edges_with_a_self_loop(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"id": i, "prompt": f"q{i}"}) + "\n" for i in range(3)))
    job = _job(app={"kind": "edges", "edges": [["a", "b"], ["b", "b"]]})
    work = build_workload(job, tmp_path)
    ab, bb = work.edges
    assert ab.request_map is None and bb.request_map == (-1, 0, 1)


def test_chunks_cut_at_word_breaks_and_keep_every_character():
    text = "word " * 100
    parts = chunk_text(text, 42)
    assert "".join(parts) == text and all(p.endswith(" ") for p in parts[:-1]) and max(map(len, parts)) <= 42
    assert render_prompt("S: {upstream}\nP: {prompt}", "chunk", "sum") == "S: sum\nP: chunk"


@pytest.mark.parametrize(
    "over, words",
    [
        ({"app": {"kind": "routing"}}, "routing_file"),
        ({"app": {"kind": "edges", "edges": [["a", "zz"]]}}, "unknown model"),
        ({"app": {"kind": "chain_summary", "summarizer": "a"}}, "evaluator"),
        ({"models": [{"name": "a"}, {"name": "a"}]}, "unique"),
        ({"models": [{"name": "Bad Name"}]}, "name"),
    ],
)
def test_bad_jobs_are_refused_with_the_reason(over, words):
    with pytest.raises(ValueError, match=words):
        _job(**over)


def test_plan_cli_prints_stages_that_cover_every_model(tmp_path, capsys):
    from app.offline import main

    assert (
        main(["plan", str(JOBS / "routing.yaml"), "--data-dir", str(tmp_path), "--json", str(tmp_path / "p.json")]) == 0
    )
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["planner"].startswith("search") and f"{plan['planner']} plan" in capsys.readouterr().out
    ran = {p["model"] for st in plan["stages"] for p in st["plans"]}
    assert ran == {"small", "medium", "large"} and plan["predicted_s"] > 0
    ends = [st["start_s"] + st["duration_s"] for st in plan["stages"]]
    assert ends == sorted(ends) and ends[-1] == pytest.approx(plan["predicted_s"])

    assert main(["plan", str(JOBS / "chain_summary.yaml"), "--data-dir", str(tmp_path), "--planner", "max"]) == 0
    out = capsys.readouterr().out
    assert "max plan" in out and "summarizer" in out and "evaluator" in out


def test_the_job_names_its_planner_and_the_cli_overrides_it(tmp_path, capsys):
    from app.offline import main

    spec = yaml.safe_load((JOBS / "chain_summary.yaml").read_text())
    spec.update(input=str(JOBS / "docs.jsonl"), planner="greedy")
    # The engine starts measured on this project's machines (the planner's choice depends on them).
    for m, load_s in zip(spec["models"], (20.0, 16.5)):
        m["load_s"] = load_s
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump(spec))
    plans = {}
    for name, extra in (("job", []), ("cli", ["--planner", "search"])):
        assert (
            main(["plan", str(path), "--data-dir", str(tmp_path), "--json", str(tmp_path / f"{name}.json"), *extra])
            == 0
        )
        plans[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert plans["job"]["planner"] == "greedy" and plans["cli"]["planner"].startswith("search")
    # On the chain, greedy runs the summarizer on both devices, then loads the evaluator; the search runs the
    # evaluator beside the summarizer from the start (its load hidden), and is predicted faster.
    assert [len(st["plans"]) for st in plans["job"]["stages"]] == [1, 1]
    assert {p["model"] for p in plans["cli"]["stages"][0]["plans"]} == {"summarizer", "evaluator"}
    assert plans["cli"]["predicted_s"] < 0.8 * plans["job"]["predicted_s"]
    with pytest.raises(ValueError, match="planner 'fastest'"):
        JobSpec.model_validate({**spec, "planner": "fastest"})


def test_plan_cli_reports_a_bad_job_without_a_traceback(tmp_path, capsys):
    from app.offline import main

    bad = tmp_path / "job.yaml"
    bad.write_text(
        yaml.safe_dump({"name": "x", "input": "missing.jsonl", "app": {"kind": "ensemble"}, "models": [{"name": "a"}]})
    )
    assert main(["plan", str(bad), "--data-dir", str(tmp_path)]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
