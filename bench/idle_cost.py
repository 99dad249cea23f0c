"""What an idle app costs: CPU seconds per process over a window with no request, trainer running, nothing queued.

    setsid .venv/bin/python bench/idle_cost.py                  # the test-sized app, two nodes, 60 s
    setsid .venv/bin/python bench/idle_cost.py --nodes 1 --window-s 30

Starts the test-sized app in this process (``bench.common.start_app``: Ray, Serve, the tiny model, the trainer), waits
until every node serves and the trainer runs, lets it settle, then reads ``/proc`` for every process of this session
before and after the window (run it under ``setsid`` so that the session holds the app alone) and prints the CPU
seconds each kind of process took, its share of one core, and the total. An idle app's cost is what it takes from
the engines' share of a small host, and what it adds to every test that runs beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (  # noqa: E402
    bench_config,
    cpu_by_process,
    cpu_snapshot,
    cpu_table,
    free_port,
    session_pids,
    start_app,
    wait_ready,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--settle-s", type=float, default=20.0, help="wait this long after ready before measuring")
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--label", default="ours", help="the system column of the table (e.g. the commit)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="idle-cost-") as data:
        port = free_port()
        start_app(bench_config("coserve-idle", data, args.nodes), port, dashboard_port=free_port())
        wait_ready(f"http://127.0.0.1:{port}")
        time.sleep(args.settle_s)
        sid = os.getsid(0)
        before = cpu_snapshot(session_pids(sid))
        t0 = time.monotonic()
        time.sleep(args.window_s)
        window = time.monotonic() - t0
        after = cpu_snapshot(session_pids(sid))
    cpu = cpu_by_process(before, after)
    print(
        f"idle app, {args.nodes} node(s), {window:.0f} s window: {sum(cpu.values()):.2f} CPU-s, "
        f"{sum(cpu.values()) / window * 100:.1f}% of one core"
    )
    print(cpu_table({args.label: {"cpu_seconds": cpu, "cpu_window_s": window}}, min_share=0.02))


if __name__ == "__main__":
    main()
