"""Offline jobs, running side (SamuLLM §4.3): each example workload end to end on real vLLM engines in Ray actors,
and resume after a killed run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from actors.offline.job import load_job
from actors.offline.runner import OutputFile
from app.offline import run_job

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "configs" / "jobs"


def small_job(tmp_path: Path, example: str, max_inputs: int, tokens: int, **over) -> Path:
    """A reduced copy of ``configs/jobs/<example>.yaml``: few inputs, short outputs, eager engines, outputs in tmp."""
    spec = yaml.safe_load((JOBS / f"{example}.yaml").read_text())
    spec["input"] = str(JOBS / spec["input"])
    if spec["app"].get("routing_file"):
        spec["app"]["routing_file"] = str(JOBS / spec["app"]["routing_file"])
    for m in spec["models"]:
        m["max_output_tokens"] = tokens
    spec.update(max_inputs=max_inputs, enforce_eager=True, output_dir=str(tmp_path / "out"), **over)
    path = tmp_path / f"{example}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().split("\n") if s]


def check_outputs(job_path: Path) -> dict[str, list[dict]]:
    """One line per request of every model node, each with a non-empty output; summary and chart written."""
    from actors.offline.job import build_workload

    job, base = load_job(job_path)
    work = build_workload(job, base)
    out = Path(job.output_dir)
    got = {}
    for m, n in work.nodes.items():
        recs = lines(out / f"{m}.jsonl")
        assert sorted(r["id"] for r in recs) == sorted(n.ids), m
        assert all(r["output"] and r["output_tokens"] >= 1 and r["prompt"] for r in recs), m
        got[m] = recs
    summary = json.loads((out / "summary.json").read_text())
    for key in ("predicted_s", "actual_s", "estimation_error", "search_time_s", "stages", "replicas"):
        assert key in summary
    assert summary["actual_s"] > 0 and summary["stages"][0]["actual_s"] is not None
    assert json.loads((out / "plan.json").read_text())["stages"]
    assert (out / "gantt.png").stat().st_size > 1000
    return got


def test_ensemble_runs_every_model_on_every_prompt(ray_cluster, data_dir, tmp_path):
    # A device per model: the three engines start at once (about 10 s each here), not in two waves. The chain test
    # below and tests/e2e/test_offline_job.py's routing job run more models than devices.
    path = small_job(tmp_path, "ensemble", max_inputs=4, tokens=8, devices={"count": 3, "memory_gb": 2})
    job, base = load_job(path)
    summary = run_job(job, base, "greedy", True, data_dir, progress=False)
    got = check_outputs(path)
    assert set(got) == {"small", "medium", "large"} and all(len(v) == 4 for v in got.values())
    assert {r["model"] for r in summary["replicas"]} == {"small", "medium", "large"}
    # Rerunning a finished job runs nothing.
    assert run_job(job, base, "greedy", True, data_dir, progress=False) is None


def test_chain_summary_resumes_after_a_kill_and_keeps_the_chain_order(ray_cluster, data_dir, tmp_path):
    import ray

    path = small_job(
        tmp_path,
        "chain_summary",
        max_inputs=2,
        tokens=12,
        app={
            "kind": "chain_summary",
            "summarizer": "summarizer",
            "evaluator": "evaluator",
            "chunk_chars": 300,
            "max_chunks": 6,
        },
    )
    out = tmp_path / "out"
    summ, ev = out / "summarizer.jsonl", out / "evaluator.jsonl"
    # The first run joins this session's cluster, so killing it ends its actors with it.
    env = {
        **os.environ,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.offline", "run", str(path), "--no-progress", "--data-dir", str(data_dir)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 150
        while not (summ.exists() and summ.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.time() < deadline, "no outputs written in time"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    # The command names no planner and the job none: the default, our search (or the baseline plan it kept,
    # "search:<name>"), printed as the plan's title before the run began.
    printed = proc.stdout.read().decode()
    assert re.search(r"\bsearch(:\w+)? plan", printed), printed[-3000:]
    before = len(summ.read_text().splitlines()) + (len(ev.read_text().splitlines()) if ev.exists() else 0)
    assert before < 12 + 2  # killed midway: the evaluator needs every chain finished
    with summ.open("a") as f:
        f.write('{"id": "half-writ')  # what a crash in the middle of a write would leave
    assert "half-writ" not in "".join(OutputFile(summ).records)  # dropped on open, file cut back

    job, base = load_job(path)
    summary = run_job(job, base, "search", True, data_dir, progress=False)
    assert summary["skipped"]["summarizer"] >= 2
    # The search's plan runs the evaluator beside the summarizer (greedy's would load it after): the evaluator's
    # engine started with the summarizer's, on the other device, and was fed the final summaries as they came.
    assert set(summary["stages"][0]["models"]) == {"summarizer 1x1", "evaluator 1x1"}
    rep = {r["model"]: r for r in summary["replicas"]}
    assert len(summary["replicas"]) == 2 and rep["evaluator"]["devices"] != rep["summarizer"]["devices"]
    assert rep["evaluator"]["start_s"] < rep["summarizer"]["ready_s"]
    got = check_outputs(path)  # every id once: nothing redone twice, nothing lost
    by_id = {r["id"]: r for r in got["summarizer"]}
    chains = {}
    for rid in by_id:
        doc, k = rid.rsplit("#", 1)
        chains.setdefault(doc, []).append(int(k))
    for doc, ks in chains.items():
        assert sorted(ks) == list(range(len(ks))) and len(ks) == 6
        for k in range(1, len(ks)):  # chunk k read chunk k-1's summary
            assert by_id[f"{doc}#{k - 1}"]["output"] in by_id[f"{doc}#{k}"]["prompt"]
        assert by_id[f"{doc}#{len(ks) - 1}"]["output"] in next(r for r in got["evaluator"] if r["id"] == doc)["prompt"]
