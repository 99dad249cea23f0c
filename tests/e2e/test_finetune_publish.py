"""A fine-tuning job publishes its adapter into the running app as a new version (``output.app_url``).

It creates the adapter with ``POST /v1/adapters``, uploads the PEFT directory as a tar archive to
``POST /v1/adapters/{name}/versions``, and the app then serves that version. Skipped while the app
has no upload route (the route is another part of issue 31). ``placement: separate`` runs here on a
one-node cluster whose node serves: the job must say that no separate node exists.
"""

from __future__ import annotations

import json

import httpx
import pytest

from actors.learning.finetune.job import parse_job

NAME = "finetuned"


def _upload_route_missing(app_url: str) -> bool:
    r = httpx.post(
        f"{app_url}/v1/adapters/no-such-adapter/versions",
        content=b"",
        headers={"Content-Type": "application/x-tar"},
        timeout=30,
    )
    return r.status_code == 405  # /v1/adapters/{name:path} answers GET and PATCH only: no POST route there


def test_a_job_publishes_a_new_version_into_the_app(app_url, ray_cluster, data_dir, tmp_path):
    if _upload_route_missing(app_url):
        pytest.skip("the app has no POST /v1/adapters/{name}/versions yet (it answers 405)")
    from actors.learning.finetune.run import run_finetune

    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Question {i}?", "completion": "zebra zebra"}) + "\n" for i in range(4))
    )
    job = parse_job(
        {
            "base": "tiny-llama",
            "data_dir": str(data_dir),
            "adapter": {
                "name": NAME,
                "method": "sft",
                "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            },
            "data": {"path": str(data), "loader": "file", "max_length": 64},
            "epochs": 1,
            "batch_size": 2,
            "learning_rate": 5e-3,
            "workers": 1,
            "resources_per_worker": {"CPU": 0.5},
            "placement": "separate",
            "storage_path": str(tmp_path / "runs"),
            "max_failures": 0,
            "output": {"app_url": app_url, "create": True, "gate": False},
        }
    )
    lines: list[str] = []
    run = run_finetune(job, log=lines.append)

    assert any("NO SEPARATE NODE EXISTS" in line for line in lines), lines
    record = run.output
    assert isinstance(record, dict) and isinstance(record.get("version"), int), record
    info = httpx.get(f"{app_url}/v1/adapters/{NAME}", timeout=30).json()
    assert record["version"] in [v["version"] for v in info["versions"]], info
    assert info["current_version"] == record["version"], info  # gate=false: served at once
    r = httpx.post(
        f"{app_url}/v1/completions",
        json={"model": info["model"], "prompt": "Question 1?", "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
