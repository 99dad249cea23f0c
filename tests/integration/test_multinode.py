"""The app on a two-node Ray cluster with the replica on the non-head node and no shared data directory.

Serves, trains and publishes an adapter version that the remote replica then serves. The nodes
have different data directories (see multinode_cluster.py), so a path handed from one node to
another, or a store that lands elsewhere, fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
START_S = 300


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    work = tmp_path_factory.mktemp("multinode")
    # Serve's HAProxy settings of the test session stay out: this cluster uses one Python proxy.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.multinode_cluster", str(work)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"the two-node cluster did not start (exit code {proc.wait(timeout=60)})")
        yield json.loads(line)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def _get(url: str) -> dict:
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_remote_replica_serves_a_version_trained_beside_it(two_nodes):
    url, worker = two_nodes["url"], two_nodes["worker_node"]
    head_dir, worker_dir = Path(two_nodes["head_dir"]), Path(two_nodes["worker_dir"])
    status = _get(f"{url}/v1/status")
    assert status["ready_nodes"] == 1
    node = status["nodes"][0]
    assert node["ray_node_id"] == worker  # the replica is on the non-head node

    base = _get(f"{url}/v1/models")["data"][0]["id"]
    r = httpx.post(
        f"{url}/v1/completions", timeout=60, json={"model": base, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    )
    assert r.status_code == 200, r.text

    r = httpx.post(
        f"{url}/v1/adapters",
        timeout=30,
        json={
            "name": "remote",
            "method": "sft",
            "learning_rate": 5e-3,
            "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
            "gate": {"enabled": False, "held_out_share": 0.0},
        },
    )
    assert r.status_code == 201, r.text
    items = [{"adapter": "remote", "prompt": f"q{i}:", "completion": " the answer is blue"} for i in range(8)]
    r = httpx.post(f"{url}/v1/feedback", timeout=60, json={"items": items})
    assert r.status_code == 202, r.text

    deadline, info, training = time.time() + START_S, {}, {}
    while time.time() < deadline:
        info = _get(f"{url}/v1/adapters/remote")
        node = _get(f"{url}/v1/status")["nodes"][0]
        if (
            info["queued"] == 0
            and info["current_version"]
            and node["adapters"].get(f"{base}:remote") == info["current_version"]
        ):
            break
        time.sleep(1)
    else:
        pytest.fail(f"no version served on the remote node within {START_S}s: {info} {_get(f'{url}/v1/status')}")
    version = info["current_version"]
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": f"{base}:remote", "prompt": "q1:", "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text

    # The trainer rank ran on the replica's node, in its placement group.
    training = _get(f"{url}/v1/status")["training"]
    (rank,) = training["workers"]
    assert rank["ray_node_id"] == worker and rank["placement_group_id"] == node["placement_group_id"]
    # The store and the published version live on the head node's disk ...
    assert (head_dir / "feedback.sqlite3").is_file() and not (worker_dir / "feedback.sqlite3").exists()
    published = {v["version"]: v for v in info["versions"]}[version]
    assert Path(published["path"]).is_relative_to(head_dir / "adapters")
    assert (Path(published["path"]) / "adapter_model.safetensors").is_file()
    # ... and the worker node has its own model build and its own copy of the version it loaded.
    assert (worker_dir / "models").is_dir()
    copies = list((worker_dir / "adapter-cache").glob(f"*/remote/v{version}/adapter_model.safetensors"))
    assert copies, sorted(str(p) for p in worker_dir.rglob("*"))[:50]
