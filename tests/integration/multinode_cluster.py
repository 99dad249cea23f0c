"""Run the app on a two-node Ray cluster made on this machine (``python -m tests.integration.multinode_cluster WORK``).

The head node holds the feedback store; the worker node, the only one with the ``replica_host``
resource, holds the model server replica and its trainer rank. Each node's processes see their
own data directory (``COSERVE_DATA_DIR``, inherited from the raylet), so any path one node hands
another is a path that does not exist there. Prints one JSON line (the app's URL and where
things are) when the app is ready, then serves until stdin closes. Used by test_multinode.py,
in a process of its own so it does not touch the test session's Ray.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def main(work: Path) -> None:
    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    head_dir, worker_dir = work / "head-data", work / "worker-data"
    # Raylets inherit this process's environment when they start, and their workers inherit theirs.
    os.environ["COSERVE_DATA_DIR"] = str(head_dir)
    # No dashboard: nothing here reads Ray's state API.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    os.environ["COSERVE_DATA_DIR"] = str(worker_dir)
    worker = cluster.add_node(num_cpus=2, resources={"replica_host": 1})
    os.environ["COSERVE_DATA_DIR"] = str(head_dir)
    ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    from app.main import build_app

    port = free_port()
    # One Python proxy on the head: two nodes on one machine cannot both listen on the same port.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    config = {
        "name": "coserve-mn",
        "data_dir": "/nonexistent/shared-dir",  # every process resolves COSERVE_DATA_DIR of its own node
        "cluster": {"nodes": 1, "stages": 1, "bundle": {"CPU": 1, "replica_host": 1}},
        "model": {"embedded": "tiny-llama", "max_model_len": 512},
        "engine": {"max_num_seqs": 8, "kv_cache_memory_bytes": 64 * 2**20},
        "planner": {"placement": "round_robin"},
    }
    serve.run(build_app(config), name="coserve", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 400
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/v1/status", timeout=10).json().get("ready_nodes") == 1:
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    print(
        json.dumps(
            {
                "url": url,
                "head_node": cluster.head_node.node_id,
                "worker_node": worker.node_id,
                "head_dir": str(head_dir),
                "worker_dir": str(worker_dir),
            }
        ),
        flush=True,
    )
    sys.stdin.read()  # until the test closes it
    # The cluster goes as a whole: Serve's graceful stop of the replica (about 8 s) would only precede it.
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
