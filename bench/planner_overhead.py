"""Microseconds per placement decision (planning + allocation) for each policy, by cluster size.

Anchor: LEMIX Table III reports 0.14 ms for execution planning plus 0.014 ms for resource
allocation (4 nodes, 50 rps, 50% training). Goal here: ≤ 0.05 ms median at N=4, S=2 and
≤ 1 ms at N=1024, S=8.

Each decision is a real ``choose`` call on a policy whose node queues are in steady state: tasks
arrive as a Poisson stream at 2 tasks/s per node (half of them training), every decision commits
its task, and tasks whose planned finish has passed are reported back through ``observe`` as the
replicas would, so queue depths stay realistic (a few backward intervals and decodes per node).

Run: ``python bench/planner_overhead.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planners import registry  # noqa: E402
from planners.costs import default_cost_model  # noqa: E402
from planners.types import ExecutionTrace, NodeView, Task  # noqa: E402

POLICIES = ("lemix", "round_robin", "least_utilized")


def _stream(n: int, nodes: int, rng: np.random.Generator) -> list[Task]:
    t, out = 0.0, []
    rate = 2.0 * nodes
    for i in range(n):
        t += rng.exponential(1.0 / rate)
        if rng.random() < 0.5:
            out.append(
                Task(f"t{i}", "training", "m", int(rng.integers(32, 256)), int(rng.integers(32, 256)), t, batch_size=2)
            )
        else:
            out.append(Task(f"i{i}", "inference", "m", int(rng.integers(16, 1024)), 256, t))
    return out


def measure(
    name: str, nodes: int, stages: int, warmup: int, n: int, seed: int = 0
) -> tuple[np.ndarray, dict[str, float]]:
    cost = default_cost_model().with_stages(stages)
    kw = {} if name == "round_robin" else {"cost_model": cost, "stages": stages}
    policy = registry.create("placement", name, **kw)
    views = [NodeView(i, True) for i in range(nodes)]
    tasks = _stream(warmup + n, nodes, np.random.default_rng(seed))
    times = np.empty(n)
    pending: list[tuple[float, int, Task, int]] = []  # (finish, seq, task, node)
    # Thread CPU time: on a shared 2-core machine wall time also counts the other tenants.
    clock = time.thread_time_ns
    for k, task in enumerate(tasks):
        now = task.arrival
        if pending:
            # Report finished tasks the way replicas would.
            while pending and pending[0][0] <= now:
                fin, _, t, nid = heapq.heappop(pending)
                policy.observe(
                    ExecutionTrace(
                        t.task_id,
                        nid,
                        t.arrival,
                        t.arrival,
                        None if t.kind == "training" else min(fin, t.arrival + 0.05),
                        fin,
                        t.prompt_tokens,
                        t.max_tokens,
                    )
                )
        t0 = clock()
        nid = policy.choose(task, views, now)
        dt = clock() - t0
        if k >= warmup:
            times[k - warmup] = dt / 1e3
        if nid is not None:
            fin = now + (0.5 if task.kind == "training" else 2.0)
            heapq.heappush(pending, (fin, k, task, nid))
    depth = {}
    if name == "lemix":
        q = policy.queues(tasks[-1].arrival).values()
        depth = {
            "train_q": float(np.mean([x["training"] for x in q])),
            "decodes": float(np.mean([x["decoding"] for x in q])),
        }
    return times, depth


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 64, 1024])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--decisions", type=int, default=2000, help="timed decisions at N=4 (fewer at larger N)")
    a = ap.parse_args(argv)
    print("# placement decision overhead (µs per choose(); steady-state queues, 2 tasks/s per node, 50% training)")
    print("| N | S | policy | median µs | p99 µs | mean train queue/node | mean decodes/node |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for nodes in a.nodes:
        for stages in a.stages:
            n = max(200, a.decisions * 4 // nodes) if nodes > 4 else a.decisions
            # Warm up long enough for every node to hold a steady queue (several arrivals per node).
            warmup = max(500, 6 * nodes)
            for name in a.policies:
                times, depth = measure(name, nodes, stages, warmup, n)
                print(
                    f"| {nodes} | {stages} | {name} | {np.median(times):.1f} | {np.percentile(times, 99):.1f} | "
                    f"{depth.get('train_q', float('nan')):.1f} | {depth.get('decodes', float('nan')):.1f} |",
                    flush=True,
                )
    print("\nAnchor (LEMIX Table III): 140 µs execution planning + 14 µs allocation; RR 15 µs.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
