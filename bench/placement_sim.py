"""Discrete-event simulation of cluster placement: the planners/ policies against a cost-model ground truth.

LEMIX §VI setup on a small scale: N nodes × S pipeline stages, Poisson arrivals with a training
share α, and a replay of the Azure LLM conversation trace (Patel et al., ISCA 2024). The ground
truth is the shared cost model (planners/costs.py) with multiplicative log-normal noise; the
policies are built through planners.registry exactly as the Planner actor builds them.

Node model (ground truth, not the planner's model):
- each stage is a non-preemptive server taking ready work items first-come first-served;
- a training task is S forward items (stage 1..S) then S backward items (stage S..1);
- inference runs in a vLLM-like engine with S virtual engines (one micro-batch per stage): a
  dispatched prompt joins the next iteration of an idle virtual engine (or the next one to start),
  each iteration is S items of iteration_latency/S, and every member gets one token per iteration.

Policies: ``lemix`` (defaults), ``lemix_ratio`` (the same with Eq. 3 as printed, score="ratio"),
``round_robin``, ``least_utilized``, ``separate`` (α = the run's training share).

Run: ``python bench/placement_sim.py`` (about a minute on 2 cores); ``--quick`` for a smoke run.

Why one module of about 500 lines: one simulation's workload, runs and table.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import rows_table  # noqa: E402
from planners import registry  # noqa: E402
from planners.costs import CostModel, default_cost_model  # noqa: E402
from planners.types import ExecutionTrace, NodeView, Task  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
TRACE = DATA / "traces" / "azure_conv_sample.csv"
PREFS = DATA / "preferences" / "hh_rlhf_train_sample.jsonl"
POLICIES = ("lemix", "lemix_ratio", "round_robin", "least_utilized", "separate")
MAX_PROMPT = 1024  # the embedded model's context is 2,048: keep prompt + output inside it
MAX_OUTPUT = 512
MAX_TRAIN_LEN = 512  # SFT sequences truncated, as a LoRA trainer on this model would
TRAIN_BATCH = 2
NOISE_SIGMA = 0.1
MAX_DRAIN = 600.0  # seconds after the last arrival before a run is cut off
WINDOW = 8  # deferred training tasks re-examined per dispatch
SLO_FACTOR = 5.0


# --- workload ----------------------------------------------------------------------------------


@dataclass
class Workload:
    inference: list[tuple[int, int]]  # (prompt tokens, output tokens) pool
    training: list[tuple[int, int]]  # (prompt tokens, response tokens) pool
    trace_arrivals: list[tuple[float, int, int]] | None
    source: str


def load_workload(rng: np.random.Generator, cost: CostModel) -> Workload:
    trace = None
    if TRACE.exists():
        rows = list(csv.DictReader(TRACE.open()))
        t0 = _ts(rows[0]["TIMESTAMP"])
        trace = [(_ts(r["TIMESTAMP"]) - t0, int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in rows]
        inf = [(min(max(p, 1), MAX_PROMPT), min(max(g, 1), MAX_OUTPUT)) for _, p, g in trace]
        src = f"Azure conv trace ({len(rows)} requests)"
    else:
        prompts = np.clip(rng.lognormal(math.log(1000), 0.8, 4000).astype(int), 1, MAX_PROMPT)
        outs = cost.output_lengths.sample(4000, rng, MAX_OUTPUT)
        inf = list(zip(prompts.tolist(), outs.tolist()))
        src = "synthetic lengths (shared/data absent)"
    if PREFS.exists():
        tr = []
        for line in PREFS.open():
            d = json.loads(line)
            p, c = len(d["prompt"].encode()), len(d["chosen"].encode())  # byte-level tokenizer: 1 token/byte
            p = min(p, MAX_TRAIN_LEN - 1)
            tr.append((p, max(1, min(c, MAX_TRAIN_LEN - p))))
        src += " + HH-RLHF pairs for training lengths"
    else:
        ls = np.clip(rng.lognormal(math.log(400), 0.6, 3000).astype(int), 32, MAX_TRAIN_LEN)
        tr = [(int(x) // 2, int(x) - int(x) // 2) for x in ls]
    return Workload(inf, tr, trace, src)


def _ts(s: str) -> float:
    hms = s.split(" ")[1]
    h, m, sec = hms.split(":")
    return int(h) * 3600 + int(m) * 60 + float(sec)


@dataclass
class Job:
    task: Task
    out_tokens: int = 0
    node: int = -1
    start: float | None = None
    first_token: float | None = None
    finish: float | None = None
    got: int = 0
    ctx: int = 0


def poisson_jobs(w: Workload, rate: float, alpha: float, n: int, rng: np.random.Generator) -> list[Job]:
    t, jobs = 0.0, []
    for i in range(n):
        t += rng.exponential(1.0 / rate)
        jobs.append(_job(w, i, t, rng.random() < alpha, rng))
    return jobs


def replay_jobs(w: Workload, alpha: float, n: int, rng: np.random.Generator) -> list[Job]:
    """The first ``n`` trace arrivals; each becomes a training task with probability alpha, so the
    arrival process stays the trace's (bursts included) while the training share varies."""
    assert w.trace_arrivals is not None
    jobs = []
    for i, (t, p, g) in enumerate(w.trace_arrivals[:n]):
        if rng.random() < alpha:
            tp, tc = w.training[int(rng.integers(len(w.training)))]
            jobs.append(Job(Task(f"t{i}", "training", "m", tp, tc, t, batch_size=TRAIN_BATCH)))
        else:
            jobs.append(
                Job(
                    Task(f"i{i}", "inference", "m", min(max(p, 1), MAX_PROMPT), MAX_OUTPUT, t),
                    min(max(g, 1), MAX_OUTPUT),
                )
            )
    return jobs


def _job(w: Workload, i: int, t: float, training: bool, rng: np.random.Generator) -> Job:
    if training:
        p, c = w.training[int(rng.integers(len(w.training)))]
        return Job(Task(f"t{i}", "training", "m", p, c, t, batch_size=TRAIN_BATCH))
    p, g = w.inference[int(rng.integers(len(w.inference)))]
    return Job(Task(f"i{i}", "inference", "m", p, MAX_OUTPUT, t), g)


# --- the simulated cluster ---------------------------------------------------------------------


@dataclass
class Item:
    kind: str  # "fwd" | "bwd" | "iter"
    stage: int
    duration: float
    job: Job | None = None
    group: int = -1
    prefills: list[Job] = field(default_factory=list)
    start: float = 0.0


class Node:
    def __init__(self, nid: int, stages: int) -> None:
        self.nid = nid
        self.queues: list[list[tuple[float, int, Item]]] = [[] for _ in range(stages)]
        self.busy: list[bool] = [False] * stages
        self.busy_time = 0.0
        self.groups: list[list[Job]] = [[] for _ in range(stages)]
        self.in_flight: list[bool] = [False] * stages
        self.pending: list[Job] = []
        self.unfinished = 0
        self.active_since: float | None = None
        self.active_time = 0.0
        self.tasks = 0


class Cluster:
    def __init__(self, policy: Any, cost: CostModel, n_nodes: int, stages: int, rng: np.random.Generator) -> None:
        self.policy, self.cost, self.S, self.rng = policy, cost, stages, rng
        self.nodes = [Node(i, stages) for i in range(n_nodes)]
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.waiting: list[Job] = []
        self.retry_at: float | None = None
        self.done: list[Job] = []

    # events
    def push(self, t: float, kind: str, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def noisy(self, x: float) -> float:
        return x * float(self.rng.lognormal(0.0, NOISE_SIGMA))

    def views(self) -> list[NodeView]:
        return [NodeView(n.nid, True, n.unfinished, n.busy_time / self.S) for n in self.nodes]

    def run(self, jobs: list[Job]) -> None:
        for j in jobs:
            self.push(j.task.arrival, "arrive", j)
        horizon = max(j.task.arrival for j in jobs) + MAX_DRAIN
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if t > horizon:
                break  # a policy that never places what is waiting must not hang the benchmark
            self.now = t
            if kind == "done":
                self.item_done(*payload)
            elif kind == "arrive":
                self.waiting.append(payload)
                self.dispatch()
            elif kind == "retry":
                self.retry_at = None
                self.dispatch()

    # placement
    def dispatch(self) -> None:
        if not self.waiting:
            return
        views = self.views()
        # Look at every waiting inference task but only the oldest deferred training tasks: an
        # overloaded run would otherwise re-plan thousands of deferred tasks on every event.
        window, rest, n_train = [], [], 0
        for j in self.waiting:
            if j.task.kind == "training":
                n_train += 1
                if n_train > WINDOW:
                    rest.append(j)
                    continue
            window.append(j)
        queue = [j.task for j in window]
        order = self.policy.prioritize(queue, views, self.now) if hasattr(self.policy, "prioritize") else queue
        by_id = {j.task.task_id: j for j in window}
        left = []
        for task in order:
            job = by_id[task.task_id]
            nid = self.policy.choose(task, views, self.now)
            if nid is None:
                left.append(job)
                continue
            self.start_job(job, self.nodes[nid])
            views = self.views()
        left.sort(key=lambda j: j.task.arrival)
        self.waiting = left + rest
        if left and self.retry_at is None:
            self.retry_at = self.now + 0.05
            self.push(self.retry_at, "retry", None)

    def start_job(self, job: Job, node: Node) -> None:
        job.node = node.nid
        node.tasks += 1
        if node.unfinished == 0:
            node.active_since = self.now
        node.unfinished += 1
        if job.task.kind == "training":
            ell = job.task.prompt_tokens + job.task.max_tokens
            d = self.noisy(self.cost.forward_latency(job.task.batch_size, ell))
            self.enqueue(node, Item("fwd", 0, d, job))
        else:
            node.pending.append(job)
            for g in range(self.S):
                if not node.in_flight[g]:
                    self.launch(node, g)
                    break

    def launch(self, node: Node, g: int) -> None:
        members, pre = node.groups[g], node.pending
        if not members and not pre:
            node.in_flight[g] = False
            return
        node.pending = []
        ctx = sum(j.ctx for j in members)
        total = self.cost.iteration_latency(sum(j.task.prompt_tokens for j in pre), len(members), ctx)
        node.in_flight[g] = True
        self.enqueue(node, Item("iter", 0, self.noisy(total) / self.S, group=g, prefills=pre))

    def enqueue(self, node: Node, item: Item) -> None:
        s = item.stage
        self.seq += 1
        heapq.heappush(node.queues[s], (self.now, self.seq, item))
        if not node.busy[s]:
            self.start_next(node, s)

    def start_next(self, node: Node, s: int) -> None:
        if not node.queues[s]:
            node.busy[s] = False
            return
        _, _, item = heapq.heappop(node.queues[s])
        node.busy[s] = True
        item.start = self.now
        if item.job is not None and item.job.start is None:
            item.job.start = self.now
        for j in item.prefills:
            if j.start is None:
                j.start = self.now
        self.push(self.now + item.duration, "done", (node, item))

    def item_done(self, node: Node, item: Item) -> None:
        s = item.stage
        node.busy_time += item.duration
        self.start_next(node, s)
        S = self.S
        if item.kind == "fwd":
            if s + 1 < S:
                item.stage = s + 1
                self.enqueue(node, item)
            else:
                t = item.job.task
                d = self.noisy(self.cost.backward_latency(t.batch_size, t.prompt_tokens + t.max_tokens))
                self.enqueue(node, Item("bwd", S - 1, d, item.job))
        elif item.kind == "bwd":
            if s > 0:
                item.stage = s - 1
                self.enqueue(node, item)
            else:
                self.finish(node, item.job)
        else:
            if s + 1 < S:
                item.stage = s + 1
                self.enqueue(node, item)
                return
            members = node.groups[item.group]
            still = []
            for j in members:
                j.got += 1
                j.ctx += 1
                if j.got >= j.out_tokens:
                    self.finish(node, j)
                else:
                    still.append(j)
            for j in item.prefills:
                j.first_token = self.now
                j.got = 1
                j.ctx = j.task.prompt_tokens + 1
                if j.got >= j.out_tokens:
                    self.finish(node, j)
                else:
                    still.append(j)
            node.groups[item.group] = still
            self.launch(node, item.group)

    def finish(self, node: Node, job: Job) -> None:
        job.finish = self.now
        self.done.append(job)
        node.unfinished -= 1
        if node.unfinished == 0 and node.active_since is not None:
            node.active_time += self.now - node.active_since
            node.active_since = None
        t = job.task
        self.policy.observe(
            ExecutionTrace(
                t.task_id,
                node.nid,
                t.arrival,
                job.start or t.arrival,
                job.first_token,
                self.now,
                t.prompt_tokens,
                job.got if t.kind == "inference" else 0,
            )
        )
        if self.waiting:
            self.dispatch()


# --- metrics -----------------------------------------------------------------------------------


def metrics(cl: Cluster, jobs: list[Job]) -> dict[str, float]:
    first = min(j.task.arrival for j in jobs)
    last = max((j.finish for j in jobs if j.finish is not None), default=cl.now)
    span = last - first
    inf = [j for j in jobs if j.task.kind == "inference"]
    ok = sum(
        1
        for j in inf
        if j.first_token is not None
        and j.first_token - j.task.arrival <= SLO_FACTOR * cl.cost.prefill_latency(j.task.prompt_tokens)
    )
    e2e = sum(n.active_time for n in cl.nodes)
    ttft = [j.first_token - j.task.arrival for j in inf if j.first_token is not None]
    lat = [j.finish - j.task.arrival for j in inf if j.finish is not None]
    return {
        "throughput": len(cl.done) / span,
        "slo": ok / len(inf) if inf else float("nan"),
        "active": e2e / span,
        "used": sum(1 for n in cl.nodes if n.tasks > 0),
        "e2e": e2e,
        "ttft_p50_ms": 1e3 * float(np.median(ttft)) if ttft else float("nan"),
        "latency_s": float(np.mean(lat)) if lat else float("nan"),
        "span": span,
        "unfinished": sum(1 for j in jobs if j.finish is None),
    }


def make_policy(name: str, cost: CostModel, stages: int, alpha: float) -> Any:
    if name == "separate":
        return registry.create("placement", "separate", alpha=alpha)
    if name == "round_robin":
        return registry.create("placement", "round_robin")
    if name.startswith("lemix"):
        extra = {"score": "ratio"} if name == "lemix_ratio" else {}
        return registry.create("placement", "lemix", cost_model=cost, stages=stages, **extra)
    return registry.create("placement", name, cost_model=cost, stages=stages)


def simulate(
    name: str, jobs_fn: Any, cost: CostModel, nodes: int, stages: int, alpha: float, seed: int
) -> dict[str, float]:
    jobs = jobs_fn(np.random.default_rng(seed))
    cl = Cluster(make_policy(name, cost, stages, alpha), cost, nodes, stages, np.random.default_rng(seed + 1))
    cl.run(jobs)
    return metrics(cl, jobs)


# --- main --------------------------------------------------------------------------------------


def _table(title: str, rows: list[dict[str, Any]], keys: list[str]) -> str:
    return f"\n{title}\n\n" + rows_table(rows, keys, "{:.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of Poisson arrivals per run")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, 8.0, 16.0])
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--replay", type=int, default=300, help="trace requests to replay (0: skip)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "placement_sim.png"))
    ap.add_argument("--quick", action="store_true", help="tiny run for a smoke test")
    a = ap.parse_args(argv)
    if a.quick:
        a.duration, a.rates, a.alphas, a.replay = 5.0, [2.0, 8.0], [0.5], 60
    cost = default_cost_model().with_stages(a.stages)
    wl = load_workload(np.random.default_rng(a.seed), cost)
    print(
        f"# placement simulation: {a.nodes} nodes x {a.stages} stages, {a.duration:g} s of arrivals per Poisson run, "
        f"noise sigma {NOISE_SIGMA}, SLO TTFT <= {SLO_FACTOR:g}x isolated prefill; workload: {wl.source}"
    )
    t_start = time.perf_counter()
    rows = []
    for alpha in a.alphas:
        for rate in a.rates:
            for name in a.policies:
                n = max(20, round(rate * a.duration))
                jf = lambda rng, rate=rate, alpha=alpha, n=n: poisson_jobs(wl, rate, alpha, n, rng)  # noqa: E731
                m = simulate(name, jf, cost, a.nodes, a.stages, alpha, a.seed)
                rows.append({"alpha": alpha, "rate": rate, "policy": name, **m})
    keys = ["alpha", "rate", "policy", "throughput", "slo", "active", "e2e", "ttft_p50_ms", "latency_s"]
    print(
        _table(
            "## Poisson arrivals (rate: tasks/s; throughput: completed tasks/s over first arrival to last "
            "finish; slo: share of requests with TTFT <= 5x isolated prefill; active: mean nodes with "
            "unfinished work; e2e: node-seconds with unfinished work; latency_s: mean request latency)",
            rows,
            keys,
        )
    )
    replay_rows = []
    if a.replay:
        if wl.trace_arrivals is None:
            print(f"\n(skipping the trace replay: {TRACE} not found)")
        else:
            for alpha in a.alphas:
                for name in a.policies:
                    jf = lambda rng, alpha=alpha: replay_jobs(wl, alpha, a.replay, rng)  # noqa: E731
                    m = simulate(name, jf, cost, a.nodes, a.stages, alpha, a.seed)
                    replay_rows.append({"alpha": alpha, "policy": name, **m})
            print(
                _table(
                    f"## Azure conv trace replay (first {a.replay} arrivals; each is a training task with "
                    f"probability alpha)",
                    replay_rows,
                    ["alpha", "policy", "throughput", "slo", "active", "e2e", "ttft_p50_ms", "latency_s"],
                )
            )
    print(f"\n(simulated in {time.perf_counter() - t_start:.1f} s)")
    if a.plot:
        _plot(rows, replay_rows, a, Path(a.plot))
    return 0


def _plot(rows: list[dict[str, Any]], replay_rows: list[dict[str, Any]], a: argparse.Namespace, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not importable: no plot written)")
        return
    metrics_ = [("slo", "SLO attainment"), ("active", "mean active nodes"), ("throughput", "throughput (tasks/s)")]
    fig, axes = plt.subplots(
        len(metrics_), len(a.alphas), figsize=(4 * len(a.alphas), 3 * len(metrics_)), squeeze=False
    )
    for c, alpha in enumerate(a.alphas):
        for r, (key, label) in enumerate(metrics_):
            ax = axes[r][c]
            for name in a.policies:
                pts = [(x["rate"], x[key]) for x in rows if x["alpha"] == alpha and x["policy"] == name]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("arrival rate (tasks/s)")
            ax.set_ylabel(label)
            if r == 0:
                ax.set_title(f"training share alpha = {alpha:g}")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"(plot written to {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})")
    if replay_rows:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
        for name in a.policies:
            pts = [x for x in replay_rows if x["policy"] == name]
            axes[0].plot([p["alpha"] for p in pts], [p["slo"] for p in pts], marker="o", label=name)
            axes[1].plot([p["alpha"] for p in pts], [p["e2e"] for p in pts], marker="o", label=name)
        axes[0].set_ylabel("SLO attainment")
        axes[1].set_ylabel("E2E node-seconds active")
        for ax in axes:
            ax.set_xlabel("training share alpha")
        axes[0].legend(fontsize=8)
        fig.suptitle("Azure conv trace replay")
        fig.tight_layout()
        p2 = path.with_name(path.stem + "_replay.png")
        fig.savefig(p2, dpi=110)
        print(f"(plot written to {p2.relative_to(ROOT) if p2.is_relative_to(ROOT) else p2})")


if __name__ == "__main__":
    raise SystemExit(main())
