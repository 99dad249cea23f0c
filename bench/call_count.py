""".remote calls per feedback item: how many actor calls one SFT item costs the app from its POST to its version served.

    .venv/bin/python bench/call_count.py                 # tiny model, one node, 10 items 2 s apart

Starts the test-sized app (one node, gate on with nothing held out and a retention margin of 100, so
every version is scored but none is rejected: on the tiny model the default margin pauses the adapter
after a few versions; mode ``hybrid``), creates an
SFT adapter, sends one warm-up item and waits until a version trained on it is served (not
counted), then sends ``--items`` items ``--gap-s`` apart and counts the actor calls of that
window with Ray's state API (``summarize_tasks``, finished tasks by ``Class.method``). Nothing
polls the app during the window, so every call counted is the app's own, idle waits included;
the replica's periodic ``Planner.report`` and Serve's own controller, proxy and health checks are
left out. Afterwards it checks that every item was trained into a served version (else the count
would be of a trainer that fell behind). Prints calls per item by actor and method, and the total.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import bench_config, free_port, start_app, stop_app, wait_ready  # noqa: E402

# Calls that are not the item's: the replica's periodic load report, Serve's control plane, the poll.
NOT_THE_ITEMS = (
    r"^Planner\.report$",
    r"ServeController\.",
    "ProxyActor",
    "HAProxy",
    "__ray_ready__",
    "check_health",
    "record_routing_stats",
    "get_num_ongoing_requests",
)


def finished_calls() -> Counter[str]:
    """Finished tasks so far, by name (``Class.method``)."""
    from ray.util.state import summarize_tasks

    summary = summarize_tasks(raise_on_missing_output=False)["cluster"]["summary"]
    return Counter({name: s["state_counts"].get("FINISHED", 0) for name, s in summary.items()})


def served(c: httpx.Client, url: str, adapter: str, timeout: float = 120) -> None:
    """Until the adapter's queue is empty and a version is current (its items trained and served)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = c.get(f"{url}/v1/adapters/{adapter}").json()
        if info.get("queued", 1) == 0 and info.get("current_version") is not None:
            return
        time.sleep(0.5)
    raise SystemExit(f"{adapter}: not served within {timeout} s: {info}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=10)
    ap.add_argument("--gap-s", type=float, default=2.0)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as data_dir:
        config = bench_config("calls", data_dir, nodes=1)
        start_app(config, port, dashboard_port=free_port())  # the state API counts the calls
        try:
            wait_ready(url)
            with httpx.Client(timeout=60) as c:
                name = "counted"
                r = c.post(
                    f"{url}/v1/adapters",
                    json={
                        "name": name,
                        "method": "sft",
                        "mode": "hybrid",
                        "gate": {"held_out_share": 0, "retention_margin": 100.0},
                    },
                )
                r.raise_for_status()
                c.post(f"{url}/v1/feedback", json={"adapter": name, "prompt": "warm up", "completion": "ok"})
                served(c, url, name)
                time.sleep(3.0)  # the warm-up version's scoring and loads settle
                before = finished_calls()
                for i in range(args.items):
                    r = c.post(
                        f"{url}/v1/feedback",
                        json={
                            "adapter": name,
                            "prompt": f"Item {i}: say a colour.",
                            "completion": f"Colour {i} is blue.",
                        },
                    )
                    r.raise_for_status()
                    time.sleep(args.gap_s)
                time.sleep(3.0)
                after = finished_calls()
                served(c, url, name, timeout=5)
        finally:
            stop_app()
    delta = {k: (after[k] - before.get(k, 0)) / args.items for k in after if after[k] > before.get(k, 0)}
    counted = {k: v for k, v in delta.items() if not any(re.search(n, k) for n in NOT_THE_ITEMS)}
    left_out = {k: v for k, v in delta.items() if k not in counted}
    print(f"| calls per item ({args.items} items, {args.gap_s:g} s apart) | per item |")
    print("| --- | --- |")
    for k in sorted(counted, key=lambda k: (k.split(".")[0], -counted[k])):
        print(f"| `{k}` | {counted[k]:.1f} |")
    print(f"| **total** | **{sum(counted.values()):.1f}** |")
    print("\nleft out (not the item's): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(left_out.items())))


if __name__ == "__main__":
    main()
