"""Fault drills: kill each actor of a live app in turn under load and measure the outage and what survived.

    python bench/faults.py                      # starts its own app (embedded model), Locust load, all drills
    python bench/faults.py --model tiny-llama --drills planner,store --locust-users 4

For each target (the model replica, a trainer rank's actor, the planner, the feedback store, and
the whole app), while Locust sends the Azure-trace load (inference plus feedback) and a prober sends
one completion, one health check and one feedback item every ``--probe-period`` seconds:

- failed: probe requests that did not get a 2xx from the kill on;
- recovery_s: seconds from the kill to the last failed probe (0: none failed);
- acked / lost: feedback ids answered 202 before the drill ended, and how many of them the store
  no longer has afterwards (goal 0);
- half_written: adapter version directories without their adapter files (goal 0);
- served / newest: the version the replica serves after recovery, and the adapter's current one.

The drills themselves (the prober, the kills, what survived) are ``tests/drills.py``: the tests
(``tests/e2e/secure/test_fault_drills.py``) run the same drills, without Locust, on the test app.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import restart_app, start_app, stop_app  # noqa: E402
from tests.drills import (
    DrillResult,
    Prober,
    drill,
    kill_named,
    kill_planner,
    kill_rank,
    kill_replica,  # noqa: E402
    served_versions,
    wait_healthy,
)


def _table(results: list[DrillResult]) -> str:
    rows = [
        "| target | probes | failed | recovery (s) | acked feedback | lost | half-written versions | "
        "served / newest version | failed probes by route |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in results:
        rows.append(
            f"| {r.target} | {r.sent} | {r.failed} | {r.recovery_s} | {r.acked} | {r.lost} | {r.half_written} "
            f"| v{r.served} / v{r.newest} | {', '.join(f'{k}: {v}' for k, v in sorted(r.statuses.items())) or '-'} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", choices=["smollm2-135m-instruct", "tiny-llama"])
    p.add_argument("--drills", default="replica,rank,planner,store,app")
    p.add_argument("--locust-users", type=int, default=4)
    p.add_argument("--trace-speedup", type=float, default=1.0)
    p.add_argument("--feedback-fraction", type=float, default=0.3)
    p.add_argument("--probe-period", type=float, default=0.5)
    p.add_argument(
        "--stall-s",
        type=float,
        default=30.0,
        help="a probe answered after this long counts as failed (under Locust's load a completion waits its turn)",
    )
    p.add_argument("--port", type=int, default=8017)
    p.add_argument("--data-dir", default="/tmp/coserve-faults")
    p.add_argument("--json", default="", help="also write the results here")
    a = p.parse_args()

    from deployments.keys import add_key

    data = Path(a.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    (data / "keys.yaml").unlink(missing_ok=True)
    admin = add_key(data / "keys.yaml", "admin")
    headers = {"Authorization": f"Bearer {admin}"}
    cfg = {
        "name": "faults",
        "data_dir": str(data),
        "model": {"embedded": a.model, "max_model_len": 2048},
        "auth": {"keys_file": "keys.yaml", "keys_env": None},
        "limits": {"requests_per_second": None, "max_concurrent": None},
    }
    url = f"http://127.0.0.1:{a.port}"

    t0 = time.time()
    start_app(cfg, a.port, app_name="faults")
    print(f"app ready in {wait_healthy(url, headers) + (time.time() - t0):.0f} s", flush=True)
    model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
    adapter = "drill"
    httpx.post(
        f"{url}/v1/adapters",
        headers=headers,
        json={"name": adapter, "method": "sft", "mode": "sync", "gate": {"enabled": False}},
    )
    locust = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(ROOT / "load_tests/locustfile.py"),
            "--headless",
            "--host",
            url,
            "-u",
            str(a.locust_users),
            "--run-time",
            "3600s",
            "--csv",
            str(data / "locust"),
            "--only-summary",
            "--trace-speedup",
            str(a.trace_speedup),
            "--api-key",
            admin,
            "--feedback-fraction",
            str(a.feedback_fraction),
            "--feedback-adapter",
            adapter,
            "--max-output-tokens",
            "64",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    kills: dict[str, Callable[[], None]] = {
        "replica": lambda: kill_replica("faults"),
        "rank": lambda: kill_rank("faults-trainer"),
        "planner": lambda: kill_planner("faults"),
        "store": lambda: kill_named("faults-store"),
        "app": lambda: restart_app(cfg, "faults"),
    }
    results = []
    try:
        served_versions(url, headers, model, adapter, timeout_s=300)  # the first version, before any drill
        with Prober(url, model, adapter, headers, a.probe_period, a.stall_s) as prober:
            for target in a.drills.split(","):
                r = drill(
                    target,
                    kills[target],
                    prober,
                    url=url,
                    headers=headers,
                    model=model,
                    adapter=adapter,
                    store_name="faults-store",
                    adapters_root=data / "adapters",
                )
                results.append(r)
                print(json.dumps(asdict(r)), flush=True)
    finally:
        os.killpg(locust.pid, signal.SIGINT)
        locust.wait(timeout=60)
    stats = data / "locust_stats.csv"
    if stats.is_file():
        print("\nLocust over the whole run:\n" + stats.read_text())
    print(_table(results))
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    stop_app()
    import ray

    ray.shutdown()


if __name__ == "__main__":
    main()
