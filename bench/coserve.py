"""Co-serving benchmark: each node-level iteration policy on the live app under trace-replayed inference and feedback.

    .venv/bin/python bench/coserve.py                                   # 6 policies + separate@0.5 × 2 loads × 2 α, ~40 min
    .venv/bin/python bench/coserve.py --policies hybrid,separate --alphas 0.5 --duration 30
    .venv/bin/python bench/coserve.py --contention --policies hybrid,fcfs,separate --loads heavy --alphas 0.5

``--contention``: the engine and the trainer share one core, as they share a GPU's compute. Every
process of the app is pinned (``os.sched_setaffinity``, each thread) to the other cores, except
vLLM's engine core process and the trainer ranks, which get the last core to themselves; a
thread re-applies the pinning every 2 s (a restarted rank is a new process). Without it the
engine and the trainer run on separate cores and only contend for memory bandwidth (ρ ≈ 0.3).
``--profile FILE`` serves the app with that cost-model profile (e.g. one whose ρ was measured under
the same pinning: ``taskset -c 1 python -m app.profile --only-interference --out FILE``).

One app (one node: one vLLM engine and one Ray Train worker sharing the machine, training scope
synced) is started once; for every (load, α) the policies run one after another on it, switched
live (``Planner.set_policies``), each with a fresh DPO adapter in mode ``hybrid`` (so the node's
iteration policy grants its windows) that is switched ``off`` when its window ends. Inference:
the Azure conversation trace (``../shared/data/traces/azure_conv_sample.csv``), arrivals rescaled
to ``--light-rate`` / ``--heavy-rate`` requests per second, prompt and output lengths from its
token columns capped to ``--max-prompt`` / ``--max-output`` (``ignore_eos``: outputs have exactly
that length), streamed. Training: each trace arrival is also a fine-tuning task with probability α
(LEMIX §V's training rate): ``--pairs-per-task`` HH-RLHF preference pairs (texts cut to 400
bytes) posted as feedback at that instant, one micro-batch of work as in LEMIX's training tasks.
With the defaults the offered fine-tuning work exceeds what the node can train (except in the
light load at α = 0.1), so the fine-tuning throughput measures what each policy lets run, not
what was offered.

Per run: SLO attainment (a request attains when its TTFT ≤ 5× the isolated prefill latency,
measured first on the idle app, and its mean time between tokens ≤ ``training.slo_tbt_s``);
TTFT and TBT p50/p99; inference output tokens/s; fine-tuning tokens/s (tokens the planner granted
and the trainer ran, from ``/v1/status``); the machine's CPU busy fraction (``/proc/stat``: on a
CPU host the "devices" are the cores); and each policy's fine-tuning throughput and attainment as
ratios to ``separate``'s in the same (load, α). Prints one markdown table and the goal lines,
and saves a plot (fine-tuning tokens/s and SLO attainment per policy).

Why one module of about 510 lines: one experiment's runs, table, goals and plot.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import BASE, free_port, percentile, start_app, stop_app, wait_ready  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
POLICIES = ("hybrid", "fcfs", "temporal", "ft_first", "periodic", "separate")
# `separate` (φ = 0.25) is the ratios' base; `separate@0.5` is the even split, for its sensitivity to φ.
DEFAULT_RUNS = POLICIES + ("separate@0.5",)
# Baseline settings sized for windows of tens of seconds (FlexLLM's temporal n = 64; Ekya-like periods).
POLICY_PARAMS: dict[str, dict[str, Any]] = {
    "periodic": {"every_seconds": 10.0},
    "temporal": {"n": 64},
    "separate": {"train_fraction": 0.25},
}
WORDS = "the plan ship small steps measure each one roll back regressions data model serve train".split()


# ---- workload ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    at: float
    prompt_tokens: int
    output_tokens: int
    feedback: bool


def read_trace(path: Path, count: int, rate: float, max_prompt: int, max_output: int, alpha: float) -> list[Arrival]:
    """The first ``count`` arrivals of the trace, time-scaled to ``rate`` req/s, lengths capped, α-marked."""
    rows = []
    with path.open() as f:
        for row in csv.DictReader(f):
            rows.append(
                (
                    datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp(),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                )
            )
            if len(rows) == count:
                break
    t0, t1 = rows[0][0], rows[-1][0]
    scale = (len(rows) - 1) / max(t1 - t0, 1e-9) / rate  # trace seconds -> replay seconds
    # Exactly a share α of the arrivals are training tasks, evenly spread (a short run of a random
    # choice could hold none at α = 0.1).
    return [
        Arrival(
            (t - t0) * scale,
            max(1, min(p, max_prompt)),
            max(1, min(o, max_output)),
            int((k + 1) * alpha) > int(k * alpha),
        )
        for k, (t, p, o) in enumerate(rows)
    ]


def prompt_text(tokens: int, k: int) -> str:
    """About ``tokens`` tokens of text for the byte-level tokenizer (1 byte, 1 token), distinct per request."""
    rng = random.Random(k)
    out = f"{k}:"
    while len(out) < tokens:
        out += " " + rng.choice(WORDS)
    return out[:tokens]


# ---- one run ------------------------------------------------------------------------------------


@dataclass
class Result:
    ok: bool
    ttft: float | None = None
    tbt: float | None = None
    tokens: int = 0
    finish: float = 0.0


@dataclass
class Run:
    load: str
    alpha: float
    policy: str
    results: list[Result] = field(default_factory=list)
    ft_tokens: int = 0
    seconds: float = 0.0
    busy: float = 0.0
    fed: int = 0
    versions: int = 0
    feed_errors: list[str] = field(default_factory=list)
    window_error: float | None = None  # median |modelled − measured| / measured window time, recent grants
    window_factor: float | None = None  # the live refit's factor on the profile's t_ft at the run's end
    grants: dict[str, int] = field(default_factory=dict)  # grant counters during the run


def stream_one(c: httpx.Client, url: str, a: Arrival, k: int) -> Result:
    body = {
        "model": BASE,
        "prompt": prompt_text(a.prompt_tokens, k),
        "max_tokens": a.output_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": True,
    }
    t0 = time.time()
    first = last = None
    try:
        with c.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Result(False, finish=time.time())
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    now = time.time()
                    first = first or now
                    last = now
    except httpx.HTTPError:
        return Result(False, finish=time.time())
    if first is None:
        return Result(False, finish=time.time())
    tbt = (last - first) / (a.output_tokens - 1) if a.output_tokens > 1 else 0.0
    return Result(True, first - t0, tbt, a.output_tokens, time.time())


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    parts = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0.0)
    return sum(parts) - idle, sum(parts)


def granted_tokens(url: str) -> int:
    st = httpx.get(f"{url}/v1/status", timeout=30).json()
    return sum((n.get("training_grants") or {}).get("tokens", 0) for n in st["nodes"])


def grant_counts(url: str) -> dict[str, int]:
    """Node 0's grant counters: asked, granted, refused, and the memory guard's non-run decisions."""
    g = httpx.get(f"{url}/v1/status", timeout=30).json()["nodes"][0].get("training_grants") or {}
    return {
        "asked": g.get("asked", 0),
        "granted": g.get("granted", 0),
        "refused": g.get("refused", 0),
        **{f"memory_{k}": v for k, v in (g.get("memory") or {}).items()},
    }


def window_cost(url: str) -> tuple[float | None, float | None]:
    """(median |relative error| of the modelled window time over the recent grants, the refit factor) of node 0."""
    node = httpx.get(f"{url}/v1/status", timeout=30).json()["nodes"][0]
    w = node.get("window_cost") or {}
    return w.get("median_abs_error"), w.get("forward_factor")


class CorePinning:
    """Pins the engine core and the trainer ranks to ``core``, every other process of this run elsewhere.

    Only this process and its descendants (Ray, Serve, HAProxy, the engine) are pinned; each thread
    separately, because ``sched_setaffinity`` applies to one thread. Threads started later inherit
    their creator's mask, and ``run`` re-applies it for processes started since.
    """

    SHARED = ("VLLM::", "ray::TrainRank")  # the engine core and, where the executor has them, its workers

    def __init__(self, core: int) -> None:
        cores = set(range(os.cpu_count() or 1))
        if core not in cores or len(cores) < 2:
            raise SystemExit(f"--contention needs at least 2 cores and core {core} among them")
        self.shared, self.others = {core}, cores - {core}
        self.pinned: dict[int, str] = {}
        self._stop = threading.Event()

    @staticmethod
    def _descendants(root: int) -> list[int]:
        parent: dict[int, int] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        out, frontier = [root], [root]
        while frontier:
            frontier = [p for p, pp in parent.items() if pp in frontier]
            out += frontier
        return out

    def apply(self) -> None:
        for pid in self._descendants(os.getpid()):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                mask = self.shared if any(cmd.startswith(s) for s in self.SHARED) else self.others
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.sched_setaffinity(int(tid), mask)
                if mask is self.shared:
                    self.pinned[pid] = cmd.split(" ", 1)[0]
            except (OSError, ValueError):
                pass  # the process or thread is gone

    def run(self) -> None:
        while not self._stop.wait(2.0):
            self.apply()

    def start(self) -> None:
        self.apply()
        names = sorted(set(self.pinned.values()))
        if not any(n.startswith("VLLM::EngineCore") for n in names) or not any(
            n.startswith("ray::TrainRank") for n in names
        ):
            raise SystemExit(
                f"--contention: found {names or 'nothing'} to pin; need the engine core and a trainer rank"
            )
        print(
            f"contention: {names} share core {sorted(self.shared)}; the rest of the app runs on {sorted(self.others)}",
            file=sys.stderr,
            flush=True,
        )
        threading.Thread(target=self.run, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()


def run_one(
    url: str,
    planner: Any,
    policy: str,
    load: str,
    alpha: float,
    arrivals: list[Arrival],
    pairs: list[dict[str, str]],
    args: argparse.Namespace,
    tag: str,
) -> Run:
    import ray

    run = Run(load, alpha, policy)
    name, _, fraction = policy.partition("@")  # separate@φ: the static split at another fraction
    params = dict(POLICY_PARAMS.get(name, {}), **({"train_fraction": float(fraction)} if fraction else {}))
    if name == "hybrid":
        params["ttft_slo_s"] = args.ttft_slo  # the run's own TTFT SLO bounds a grant on an idle engine
    current = ray.get(planner.policies.remote())
    ray.get(planner.set_policies.remote(current.model_copy(update={"iteration": name, "iteration_params": params})))
    label = policy.replace("_", "-").replace("@", "-").replace(".", "")
    adapter = f"co-{label}-{load}-{int(alpha * 100)}-{tag}"
    httpx.post(
        f"{url}/v1/adapters",
        timeout=30,
        json={
            "name": adapter,
            "method": "dpo",
            "beta": 0.1,
            "learning_rate": 1e-3,
            "mode": "hybrid",
            "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
        },
    ).raise_for_status()
    todo = [a for a in arrivals if a.at < args.duration]
    pair_iter = iter(pairs)
    tokens0, (busy0, total0), grants0 = granted_tokens(url), cpu_times(), grant_counts(url)
    t_start = time.time()

    def feeder() -> None:
        with httpx.Client(timeout=60) as c:
            for a in todo:
                if not a.feedback:
                    continue
                time.sleep(max(0.0, t_start + a.at - time.time()))
                items = [{"adapter": adapter, **next(pair_iter)} for _ in range(args.pairs_per_task)]
                r = c.post(f"{url}/v1/feedback", json={"items": items})
                if r.status_code == 202:
                    run.fed += len(items)
                else:
                    run.feed_errors.append(f"{r.status_code} {r.text[:120]}")

    fthread = threading.Thread(target=feeder, daemon=True)
    fthread.start()
    with (
        httpx.Client(timeout=300, limits=httpx.Limits(max_connections=256)) as c,
        ThreadPoolExecutor(max_workers=128) as pool,
    ):
        futures = []
        for k, a in enumerate(todo):
            time.sleep(max(0.0, t_start + a.at - time.time()))
            futures.append(pool.submit(stream_one, c, url, a, k))
        run.results = [f.result() for f in futures]
    t_end = time.time()
    fthread.join(timeout=60)
    run.seconds = t_end - t_start
    run.ft_tokens = granted_tokens(url) - tokens0
    busy1, total1 = cpu_times()
    run.busy = (busy1 - busy0) / max(total1 - total0, 1e-9)
    run.window_error, run.window_factor = window_cost(url)
    run.grants = {k: v - grants0.get(k, 0) for k, v in grant_counts(url).items()}
    httpx.patch(f"{url}/v1/adapters/{adapter}", json={"mode": "off"}, timeout=30).raise_for_status()
    run.versions = len(httpx.get(f"{url}/v1/adapters/{adapter}", timeout=30).json()["versions"])
    time.sleep(args.cooldown)  # the trainer drops the adapter's step in flight before the next run
    return run


# ---- measurements and the table -----------------------------------------------------------------


def isolated_ttft(url: str, prompt_tokens: int, repeats: int = 7) -> float:
    """Median TTFT of one request alone on the idle app: the prefill latency the SLO is set from."""
    with httpx.Client(timeout=120) as c:
        ttfts = [stream_one(c, url, Arrival(0.0, prompt_tokens, 4, False), 10_000 + i).ttft for i in range(repeats)]
    return statistics.median(t for t in ttfts if t is not None)


def summarize(run: Run, ttft_slo: float, tbt_slo: float) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    attained = sum(1 for r in ok if r.ttft <= ttft_slo and r.tbt <= tbt_slo)
    ttft, tbt = [r.ttft for r in ok], [r.tbt for r in ok]
    return {
        "load": run.load,
        "alpha": run.alpha,
        "policy": run.policy,
        "requests": len(run.results),
        "failed": len(run.results) - len(ok),
        "slo": attained / max(1, len(run.results)),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tbt_p50": percentile(tbt, 50),
        "tbt_p99": percentile(tbt, 99),
        "inf_tps": sum(r.tokens for r in ok) / run.seconds,
        "ft_tps": run.ft_tokens / run.seconds,
        "busy": run.busy,
        "fed": run.fed,
        "versions": run.versions,
        "window_error": run.window_error,
        "window_factor": run.window_factor,
        "grants": run.grants,
    }


def table(rows: list[dict[str, Any]]) -> str:
    base = {(r["load"], r["alpha"]): r for r in rows if r["policy"] == "separate"}
    out = [
        "| load | α | policy | SLO attained | TTFT p50 / p99 (s) | TBT p50 / p99 (ms) | inference tok/s "
        "| fine-tune tok/s | CPU busy | fine-tune × separate | SLO × separate | pairs fed | versions "
        "| window model error (refit ×) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get((r["load"], r["alpha"]))
        ft_ratio = f"{r['ft_tps'] / b['ft_tps']:.2f}" if b and b["ft_tps"] > 0 else "—"
        slo_ratio = f"{r['slo'] / b['slo']:.2f}" if b and b["slo"] > 0 else "—"
        out.append(
            f"| {r['load']} | {r['alpha']} | {r['policy']} | {r['slo']:.1%} | {r['ttft_p50']:.3f} / "
            f"{r['ttft_p99']:.3f} | {r['tbt_p50'] * 1e3:.1f} / {r['tbt_p99'] * 1e3:.1f} | {r['inf_tps']:.0f} "
            f"| {r['ft_tps']:.0f} | {r['busy']:.0%} | {ft_ratio} | {slo_ratio} | {r['fed']} | {r['versions']} "
            f"| {_window(r)} |"
        )
    return "\n".join(out)


def _window(r: dict[str, Any]) -> str:
    if r.get("window_error") is None:
        return "—"
    return f"{r['window_error']:.0%} (×{r['window_factor']:.2f})"


def goals(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    by = {(r["load"], r["alpha"], r["policy"]): r for r in rows}
    for load, alpha in sorted({(r["load"], r["alpha"]) for r in rows}):
        h, s, f = (by.get((load, alpha, p)) for p in ("hybrid", "separate", "fcfs"))
        if h and s:
            ratio = h["ft_tps"] / s["ft_tps"] if s["ft_tps"] else float("inf")
            met = ratio >= 2 and h["slo"] >= s["slo"]
            lines.append(
                f"- {load} load, α {alpha}: hybrid fine-tunes {ratio:.2f}× separate (goal ≥ 2×) at SLO "
                f"{h['slo']:.1%} vs {s['slo']:.1%} (goal: not lower): {'met' if met else 'MISSED'}"
            )
        if h and f:
            met = h["slo"] >= 0.95 and f["slo"] < 0.5
            lines.append(
                f"- {load} load, α {alpha}: SLO hybrid {h['slo']:.1%} (goal ≥ 95%) where fcfs "
                f"{f['slo']:.1%} (< 50%): {'met' if met else 'not shown'}"
            )
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Per (load, α): fine-tuning tokens/s (bars) over SLO attainment (bars), one colour per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["load"], r["alpha"]) for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    colours = {p: plt.cm.tab10(i % 10) for i, p in enumerate(policies)}
    fig, axes = plt.subplots(2, len(groups), figsize=(3.6 * len(groups), 5.6), squeeze=False, sharex=True)
    for col, (load, alpha) in enumerate(groups):
        by = {r["policy"]: r for r in rows if (r["load"], r["alpha"]) == (load, alpha)}
        names = [p for p in policies if p in by]
        x = range(len(names))
        axes[0][col].bar(x, [by[p]["ft_tps"] for p in names], color=[colours[p] for p in names])
        axes[0][col].set(title=f"{load} load, α = {alpha}", ylabel="fine-tuning tokens/s" if col == 0 else None)
        axes[1][col].bar(x, [by[p]["slo"] * 100 for p in names], color=[colours[p] for p in names])
        axes[1][col].set(
            ylim=(min(90.0, min(by[p]["slo"] * 100 for p in names) - 2), 100.5),
            ylabel="SLO attained (%)" if col == 0 else None,
        )
        axes[1][col].set_xticks(list(x), names, rotation=60, ha="right", fontsize=8)
        for ax in (axes[0][col], axes[1][col]):
            ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# ---- main ---------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_RUNS),
        help="iteration policies in run order; separate@φ runs separate with train_fraction φ",
    )
    p.add_argument("--alphas", default="0.1,0.5")
    p.add_argument("--loads", default="light,heavy")
    p.add_argument("--light-rate", type=float, default=0.5, help="inference requests/s of the light load")
    p.add_argument("--heavy-rate", type=float, default=2.0, help="inference requests/s of the heavy load")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    p.add_argument("--cooldown", type=float, default=5.0)
    p.add_argument("--pairs-per-task", type=int, default=8, help="preference pairs per fine-tuning task")
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--slo-tbt", type=float, default=0.1, help="training.slo_tbt_s: the TBT SLO and window bound")
    p.add_argument("--trace", default=str(SHARED / "traces" / "azure_conv_sample.csv"))
    p.add_argument("--pairs", default=str(SHARED / "preferences" / "hh_rlhf_train_sample.jsonl"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "coserve.png"))
    p.add_argument("--json", help="write the raw rows here")
    p.add_argument(
        "--contention",
        action="store_true",
        help="pin the engine core and the trainer ranks to one core, the rest of the app elsewhere",
    )
    p.add_argument("--shared-core", type=int, default=None, help="the core of --contention (default: the last)")
    p.add_argument("--profile", default=None, help="serve with this cost-model profile (JSON from app.profile)")
    args = p.parse_args()

    from actors.learning.lora.alignment import read_preference_jsonl

    for f in (args.trace, args.pairs):
        if not Path(f).is_file():
            raise SystemExit(f"{f} not found (the trace and the pairs live in ../shared/data)")
    policies = [x for x in args.policies.split(",") if x]
    unknown = {x for x in policies if x.partition("@")[0] not in POLICIES}
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {POLICIES}")
    rates = {"light": args.light_rate, "heavy": args.heavy_rate}
    loads = [x for x in args.loads.split(",") if x]
    alphas = [float(x) for x in args.alphas.split(",") if x]
    pairs = read_preference_jsonl(args.pairs, limit=3000, max_text_bytes=400)
    pairs = pairs * 4  # a long benchmark may feed more pairs than the sample holds; repeats train again
    # Ray starts workers at nice 15; the app is the service under test here (as `make serve` runs it).
    os.environ.setdefault("RAY_worker_niceness", "0")

    data_dir = tempfile.mkdtemp(prefix="bench-coserve-")
    if args.profile:  # the data dir's profiles come before the shipped ones (app.profile.profile_paths)
        (Path(data_dir) / "profiles").mkdir()
        (Path(data_dir) / "profiles" / f"{BASE}-cpu.json").write_text(Path(args.profile).read_text())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = {
        "name": "bench-coserve",
        "data_dir": data_dir,
        "cluster": {"nodes": 1, "stages": 1, "bundle": {"CPU": 1}},
        "model": {"embedded": "tiny-llama", "max_model_len": 1024},
        "engine": {"max_num_seqs": 16, "kv_cache_memory_bytes": 128 * 2**20},
        # On a CPU host the device memory is the host's RAM: the profile's peak (the profiler's own
        # training peak, 0.4 GB) is no capacity, and this benchmark is about compute, so the memory
        # guard gets 4 GiB (tests/integration/test_memory_guard.py squeezes it instead).
        "planner": {"placement": "round_robin", "iteration": "hybrid", "memory_params": {"peak_bytes": 4 * 2**30}},
        "training": {
            "enabled": True,
            "scope": "synced",
            "steps_per_version": 1,
            "micro_batch": 4,
            "max_length": 512,
            "slo_tbt_s": args.slo_tbt,
        },
    }
    start_app(config, port)
    rows: list[dict[str, Any]] = []
    pinning = None
    try:
        wait_ready(url)
        if args.contention:
            pinning = CorePinning((os.cpu_count() or 1) - 1 if args.shared_core is None else args.shared_core)
            pinning.start()
        from app.main import planner_of

        planner = planner_of("coserve")
        median_prompt = int(
            statistics.median(
                a.prompt_tokens for a in read_trace(Path(args.trace), 1000, 1.0, args.max_prompt, args.max_output, 0.0)
            )
        )
        ttft_slo = 5 * isolated_ttft(url, median_prompt)
        args.ttft_slo = ttft_slo
        print(
            f"isolated prefill ({median_prompt} tokens): TTFT SLO = {ttft_slo:.3f} s; TBT SLO = {args.slo_tbt} s",
            file=sys.stderr,
            flush=True,
        )
        tag = time.strftime("%H%M%S")
        offset = 0
        for load in loads:
            for alpha in alphas:
                count = int(rates[load] * args.duration) + 2
                arrivals = read_trace(Path(args.trace), count, rates[load], args.max_prompt, args.max_output, alpha)
                for policy in policies:
                    run = run_one(url, planner, policy, load, alpha, arrivals, pairs[offset:], args, tag)
                    offset += run.fed
                    row = summarize(run, ttft_slo, args.slo_tbt)
                    rows.append(row)
                    print(
                        json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        if pinning is not None:
            pinning.stop()
        stop_app()
    where = (
        "the engine and the trainer share one core (--contention)"
        if args.contention
        else "the engine and the trainer on separate cores"
    )
    print(
        f"co-serving on one node (1 engine + 1 trainer worker, 2 cores; {where}): Azure conv trace, prompts ≤ "
        f"{args.max_prompt}, outputs ≤ {args.max_output} tokens, {args.duration:.0f} s per run; light "
        f"{args.light_rate} req/s, heavy {args.heavy_rate} req/s; a fine-tuning task ({args.pairs_per_task} DPO pairs) "
        f"with probability α per arrival; "
        f"SLO: TTFT ≤ {ttft_slo:.3f} s (5× isolated prefill) and TBT ≤ {args.slo_tbt * 1e3:.0f} ms\n"
    )
    print(table(rows))
    print()
    print("\n".join(goals(rows)))
    plot(rows, Path(args.plot))
    print(f"\nplot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
