"""An offline job submitted with Ray's job API to the session cluster's head node, as `ray job submit` does."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_offline_run import check_outputs, small_job

ROOT = Path(__file__).resolve().parents[2]
# What the job's working-dir upload leaves out (Ray's upload limit; .gitignore'd paths are left out too).
EXCLUDES = ["/.venv/", "/.git/", "/data/", "/out/", "/configs/jobs/out/", "/reports/", "__pycache__/"]


@pytest.fixture(scope="module")
def dashboard(ray_cluster) -> str:
    """The job API's address: the session cluster's dashboard (tests/conftest.py starts it), the head a
    `ray job submit --address` names. A head of the test's own cost a second Ray's start and stop."""
    url = ray_cluster.init(ignore_reinit_error=True).dashboard_url
    assert url, "the session's Ray runs without a dashboard"
    return url if url.startswith("http") else f"http://{url}"


def test_ray_job_submit_runs_the_routing_job(dashboard, data_dir, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    # A device per model: the job's three engines start at once (tests/integration/test_offline_run.py runs this
    # job on fewer devices than models).
    path = small_job(tmp_path, "routing", max_inputs=12, tokens=8, devices={"count": 3, "memory_gb": 2})
    client = JobSubmissionClient(dashboard)
    deadline = time.time() + 90
    while True:  # the head's job agent comes up a little after its dashboard answers
        try:
            job_id = client.submit_job(
                entrypoint=f"{sys.executable} -m app.offline run {path} --no-progress --data-dir {data_dir}",
                runtime_env={"working_dir": str(ROOT), "excludes": EXCLUDES},
            )
            break
        except RuntimeError as exc:
            assert "No available agent" in str(exc) and time.time() < deadline, exc
            time.sleep(1)
    deadline = time.time() + 240
    try:
        while (status := client.get_job_status(job_id)) not in {
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.STOPPED,
        }:
            assert time.time() < deadline, client.get_job_logs(job_id)[-3000:]
            time.sleep(0.5)
    finally:  # a job left running would hold the session cluster's CPUs for the tests after this one
        if not client.get_job_status(job_id).is_terminal():
            client.stop_job(job_id)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    got = check_outputs(path)
    assert {m: len(v) for m, v in got.items()} == {"small": 7, "medium": 4, "large": 1}
    # The job names no planner: the default, our search (or the baseline plan it kept, "search:<name>").
    assert "done in" in logs and json.loads((tmp_path / "out" / "summary.json").read_text())["planner"].startswith(
        "search"
    )
