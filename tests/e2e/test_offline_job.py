"""An offline job submitted with Ray's job API to a local head node started here, as `ray job submit` does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import requests

from tests.integration.test_offline_run import check_outputs, small_job
from tests.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
# What the job's working-dir upload leaves out (Ray's upload limit; .gitignore'd paths are left out too).
EXCLUDES = ["/.venv/", "/.git/", "/data/", "/out/", "/configs/jobs/out/", "/reports/", "__pycache__/"]


HEAD_TRIES = 3
STARTED = b"Ray runtime started."  # what `ray start` prints once its node registered


def _start_head(temp: str, log) -> tuple[subprocess.Popen, str]:
    """`ray start --head --block` with every port of its own; (the process, the dashboard's port)."""
    ray_cli = Path(sys.executable).with_name("ray")
    # Every port of its own: the session's other Ray instance holds the defaults (the job agent's
    # 52365 among them, and a head whose agent cannot bind it answers "No available agent").
    names = (
        "port",
        "dashboard-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
        "ray-client-server-port",
        "node-manager-port",
        "object-manager-port",
    )
    ports = [f"--{name}={port}" for name, port in zip(names, free_ports(len(names)))]
    head = subprocess.Popen(
        [
            str(ray_cli),
            "start",
            "--head",
            "--block",
            "--num-cpus=8",
            *ports,
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        # `ray start` turns token authentication on by default; this test's client
        # talks to a loopback-only head it started itself.
        env={**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"},
    )
    return head, ports[1].split("=")[1]


def _stop(head: subprocess.Popen) -> None:
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(60)
    except subprocess.TimeoutExpired:
        head.kill()


@pytest.fixture
def head_node():
    """`ray start --head --block` in its own temp dir, once it says it started and its job API answers; stopped
    through that process (not `ray stop`, which would stop every Ray instance on this machine). `ray start` gives its
    raylet 30 s to register with the GCS (ray/_private/node.py) and exits when it misses that, though its dashboard
    answered meanwhile: at idle priority, beside the apps lane's busiest minute (tests/lanes.py), it did. A head that
    exits while starting is started again, as ``app.serve_env.init_ray`` does for the suite's own clusters."""
    from ray.job_submission import JobSubmissionClient

    temp = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")  # short: Ray's socket paths have a length limit
    log_path = Path(temp) / "head.log"
    log = open(log_path, "ab")
    head = client = None
    try:
        for attempt in range(1, HEAD_TRIES + 1):
            begin = log_path.stat().st_size
            head, dash = _start_head(temp, log)
            deadline = time.time() + 120
            while head.poll() is None and time.time() < deadline:
                if STARTED in log_path.read_bytes()[begin:]:
                    try:
                        client = JobSubmissionClient(f"http://127.0.0.1:{dash}")
                        break
                    except Exception:  # noqa: BLE001, S110 - the dashboard not answering yet: ask again
                        pass
                time.sleep(1)
            if client is not None:
                break
            exited = head.poll() is not None
            _stop(head)
            assert exited and attempt < HEAD_TRIES, log_path.read_text(errors="replace")[-3000:]
        yield client, head, log_path
    finally:
        if head is not None:
            _stop(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_runs_the_routing_job_with_the_min_heuristic_and_no_preemption(head_node, data_dir, tmp_path):
    """The routing job as a user submits it, with the command line's planner and preemption overrides: the min
    heuristic without preemption stages three models on two devices. (The job's default planner, search, is
    checked where tests/integration/test_offline_run.py runs a job through the same command without overrides.)"""
    from ray.job_submission import JobStatus

    client, head, head_log = head_node
    path = small_job(tmp_path, "routing", max_inputs=12, tokens=8)
    deadline = time.time() + 90
    # One submission id for every try: a try whose answer the head dropped may have been accepted.
    job_id = f"routing-{uuid.uuid4().hex[:8]}"
    while True:
        try:
            client.submit_job(
                entrypoint=f"{sys.executable} -m app.offline run {path} --planner min --no-preemption --no-progress "
                f"--data-dir {data_dir}",
                runtime_env={"working_dir": str(ROOT), "excludes": EXCLUDES},
                submission_id=job_id,
            )
            break
        except RuntimeError as exc:  # the head's job agent comes up a little after its dashboard answers
            if "already exists" in str(exc):
                break
            assert "No available agent" in str(exc) and time.time() < deadline, exc
        except requests.ConnectionError as exc:  # a head starting beside a busy suite may drop a request
            assert head.poll() is None and time.time() < deadline, f"{exc}\n{head_log.read_text()[-3000:]}"
        time.sleep(1)
    # Two waves of engines on two devices, at idle priority beside the apps lane (tests/lanes.py): generous.
    deadline, status = time.time() + 420, None
    while status not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.time() < deadline, client.get_job_logs(job_id)[-3000:]
        time.sleep(1)
        try:
            status = client.get_job_status(job_id)
        except requests.ConnectionError:
            continue
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    got = check_outputs(path)
    assert {m: len(v) for m, v in got.items()} == {"small": 7, "medium": 4, "large": 1}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "done in" in logs and summary["planner"] == "min" and summary["preemption"] is False, summary
