"""Offline multi-LLM jobs, for real on this machine: planners side by side, and the shipped jobs' stages against their predictions.

    python bench/offline_real.py shipped [--shipped-planners search,greedy,max,min]   # configs/jobs/*.yaml (~2 min a planner)
    python bench/offline_real.py real [--quick]               # bigger inputs, 4 planners (~25 min; quick ~12)

``shipped`` runs every example job of ``configs/jobs`` as it is (2 devices = the 2 CPU cores; the
job's own planner, or each of ``--shipped-planners``) with ``app.offline.run_job`` and prints, per
stage and per model, the (first) planner's prediction against what happened (SamuLLM §4.1's cost
model against the §4.3 runtime), with each engine's start time against the load time the planner
assumed; with several planners, also their end-to-end times side by side. Engine starts are
recorded in ``--data-dir``'s load-time table, so a second pass plans with the first one's; within a pass,
every planner of a job plans from the table as it was before the job's first run.

``real``: the example jobs with bigger inputs from ``shared/data`` (ShareGPT prompts, QMSum
meetings), one run per planner; end-to-end time (search included), engine load time, the cost
model's error. The load-time table is measured first (each model size started once, two at a time),
as SamuLLM §4.1 profiles it in advance. Needs ``../shared/data`` (or ``COSERVE_SHARED_DATA``).

Start engines, so run it under the heavy-work lock: ``flock /work/heavy.lock python bench/offline_real.py ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from app.serve_env import init_ray  # noqa: E402
from bench.common import rows_table  # noqa: E402
from bench.offline import IMG, QMSUM, SHARED, SHAREGPT, geomean  # noqa: E402

JOBS = ROOT / "configs" / "jobs"


def start_ray() -> None:
    # Ray starts workers at nice 15; on a shared host the engines would then time other sessions' work.
    os.environ.setdefault("RAY_worker_niceness", "0")
    init_ray(address="local")  # a Ray of our own, even when another one runs on this machine


# ---- the shipped jobs: each stage against its prediction ---------------------------------------------------


def stage_rows(job_name: str, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per planned stage: the models, predicted and actual start and duration, and the error."""
    rows = []
    for s in summary["stages"]:
        act = s["actual_s"]
        rows.append(
            {
                "job": job_name,
                "stage": s["index"],
                "models": ", ".join(s["models"]),
                "predicted start s": s["predicted_start_s"],
                "predicted s": s["predicted_s"],
                "actual start s": s["actual_start_s"],
                "actual s": act,
                "error": "" if act is None else f"{(act - s['predicted_s']) / max(s['predicted_s'], 1e-9):+.0%}",
            }
        )
    return rows


def model_rows(job_name: str, plan: dict[str, Any], summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model: predicted and actual finish (from the job's start), the start time the plan assumed
    against each of its replicas' (asked for to ready; and the engine build alone), and the seconds it then
    ran (first replica ready to its last output)."""
    predicted = {m: st["start_s"] + st["duration_s"] for st in plan["stages"] for m in st["finishes"]}
    rows = []
    for m, info in summary["models"].items():
        reps = [r for r in summary["replicas"] if r["model"] == m]
        ready = [r["ready_s"] for r in reps if r["ready_s"] is not None]
        act = info["finished_s"]
        rows.append(
            {
                "job": job_name,
                "model": m,
                "predicted finish s": round(predicted.get(m, float("nan")), 2),
                "actual finish s": act,
                "error": "" if act is None else f"{(act - predicted[m]) / predicted[m]:+.0%}",
                "start planned s": " ".join(f"{r['planned_load_s']:.1f}" for r in reps),
                "start to ready s": " ".join(
                    f"{r['ready_s'] - r['start_s']:.1f}" for r in reps if r["ready_s"] is not None
                ),
                "engine build s": " ".join(f"{r['load_s']:.1f}" for r in reps if r["load_s"] is not None),
                "ran after first ready s": "" if act is None or not ready else round(act - min(ready), 2),
            }
        )
    return rows


def run_shipped(data_dir: Path, planners: Sequence[str], work_dir: Path | None) -> None:
    """Each shipped job with each of ``planners`` (an empty name: the job's own), one after another in one Ray;
    stages and models are reported for the first planner, end-to-end times for all of them."""
    from actors.offline.job import load_job
    from app.offline import run_job

    start_ray()
    stages, models, totals = [], [], []
    with tempfile.TemporaryDirectory(prefix="offline-shipped-") as tmp:
        root = work_dir or Path(tmp)
        table = data_dir / "offline" / "load_times.jsonl"
        for path in sorted(JOBS.glob("*.yaml")):
            job, base = load_job(path)
            name = path.stem
            # Every planner of a job plans from the same measured starts: a run's own starts are recorded
            # as it goes, so without this each later planner would plan with more (and other) information.
            before = table.read_text() if table.is_file() else None
            for i, planner in enumerate(planners):
                if before is not None:
                    table.write_text(before)
                elif table.is_file():
                    table.unlink()
                out = root / f"{name}-{planner or 'own'}"
                load_before = os.getloadavg()[0]
                s = run_job(job, base, planner or job.planner, job.preemption, data_dir, out, progress=False)
                if i == 0:
                    stages += stage_rows(name, s)
                    models += model_rows(name, json.loads((out / "plan.json").read_text()), s)
                totals.append(
                    {
                        "job": name,
                        "planner": s["planner"],
                        "search s": s["search_time_s"],
                        "predicted s": s["predicted_s"],
                        "actual s": s["actual_s"],
                        "e2e s": s["actual_s"] + s["search_time_s"],
                        "error": f"{s['estimation_error']:+.0%}",
                        "engine starts": len(s["replicas"]),
                        "loadavg": f"{load_before:.1f}/{os.getloadavg()[0]:.1f}",
                    }
                )
    print(f"\n# shipped jobs on this machine ({os.cpu_count()} cores = 2 devices), each as configs/jobs has it\n")
    print(rows_table(totals, list(totals[0])))
    if len(planners) > 1:
        print("\n## the first planner against the better heuristic (real, end-to-end)\n")
        rows = []
        for name in dict.fromkeys(t["job"] for t in totals):
            e = {t["planner"].split(":")[0]: t["e2e s"] for t in totals if t["job"] == name}
            ours = next(t["e2e s"] for t in totals if t["job"] == name)
            heur = {h: e[h] for h in ("max", "min") if h in e}
            better = min(heur, key=heur.__getitem__) if heur else ""
            rows.append(
                {
                    "job": name,
                    **{f"{p} s": e.get(p, float("nan")) for p in ("search", "greedy", "max", "min")},
                    "better heuristic": better,
                    "speedup": heur[better] / ours if better else float("nan"),
                }
            )
        print(rows_table(rows, list(rows[0])))
    print(
        "\n## per stage (actual: from the runtime reaching the stage to reaching the next; error = actual vs predicted)\n"
    )
    print(rows_table(stages, list(stages[0])))
    print("\n## per model (engine starts: each replica from being asked for to ready, against what the plan assumed)\n")
    print(rows_table(models, list(models[0])))


REAL_PLANNERS = ("search", "greedy", "max", "min")
REAL_TOKENS = 64  # output limit of every model: the tiny random models mostly run to it
# Table 1's split folded onto three sizes: 7B 39 %, 13B + Mixtral 48 %, 34B + 70B 13 %.
ROUTE_SHARES = {"small": 0.39, "medium": 0.48, "large": 0.13}


@dataclass(frozen=True)
class RealCase:
    name: str
    example: str  # configs/jobs/<example>.yaml: models, templates, graph
    prompts: int = 0  # ShareGPT prompts for an ensemble or routing part
    meetings: int = 0  # QMSum meetings for a chain part, each cut to 1/doc_scale of its length
    doc_scale: int = 40


REAL_CASES = [
    RealCase("ensemble", "ensemble", prompts=96),
    RealCase("routing", "routing", prompts=192),
    RealCase("chain", "chain_summary", meetings=8),
    RealCase("mixed", "mixed", prompts=64, meetings=8),
]
QUICK_REAL = ("routing", "mixed")


def write_real_inputs(case: RealCase, folder: Path) -> dict[str, Path]:
    """ShareGPT prompts (≤ 500 bytes: the byte-level tokenizer makes a byte a token), a routing file by
    ROUTE_SHARES, and QMSum meetings shortened to keep QMSum's skew of lengths at a size this CPU runs."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = [r for r in map(json.loads, SHAREGPT.open()) if 0 < len(r["prompt"].encode()) <= 500][: case.prompts]
    prompts = [{"id": r["id"], "prompt": r["prompt"]} for r in rows]
    models = list(ROUTE_SHARES)
    routes = [{"id": r["id"], "model": str(rng.choice(models, p=list(ROUTE_SHARES.values())))} for r in prompts]
    meetings = [json.loads(line) for line in QMSUM.open()][: case.meetings]
    docs = [{"id": m["doc_id"], "text": m["transcript"][: len(m["transcript"]) // case.doc_scale]} for m in meetings]
    out = {}
    for name, data in (("prompts", prompts), ("routes", routes), ("docs", docs)):
        out[name] = folder / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(x) + "\n" for x in data))
    return out


def size_key(model: dict[str, Any]) -> str:
    """An embedded model's size, the key of the load-time table (the summarizer is medium's size)."""
    e = model.get("embedded") or {}
    return f"h{e.get('hidden_size', 256)}-l{e.get('layers', 4)}"


def real_job(case: RealCase, folder: Path, loads: dict[str, float]) -> Path:
    """The example job with the inputs above, output limit REAL_TOKENS and the measured load times
    (``loads``: per size_key, and ``default`` for the rest)."""
    import yaml

    spec = yaml.safe_load((ROOT / "configs" / "jobs" / f"{case.example}.yaml").read_text())
    files = write_real_inputs(case, folder)

    def point(part: dict[str, Any]) -> None:
        kind = part["app"]["kind"]
        part["input"] = str(files["docs" if kind == "chain_summary" else "prompts"])
        if kind == "routing":
            part["app"]["routing_file"] = str(files["routes"])

    for part in spec["app"]["parts"] if spec["app"]["kind"] == "mixed" else [spec]:
        point(part)
    for m in spec["models"]:
        m["max_output_tokens"] = REAL_TOKENS
        m["load_s"] = loads.get(size_key(m), loads["default"])
    spec.update(output_dir=str(folder / "out"), engine_load_s=loads["default"])
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def measure_load_table(folder: Path, data_dir: Path) -> dict[str, float]:
    """SamuLLM §4.1's load-time table, measured: start each of the three model sizes of the examples
    (one request, one token), two at a time as in the runs; the median start time per size."""
    import yaml

    from actors.offline.job import load_job
    from app.offline import run_job

    path = real_job(RealCase("load-table", "ensemble", prompts=2), folder, {"default": 30.0})
    size = {m["name"]: size_key(m) for m in yaml.safe_load(path.read_text())["models"]}
    job, base = load_job(path)
    job = job.model_copy(update={"models": [m.model_copy(update={"max_output_tokens": 1}) for m in job.models]})
    summary = run_job(job, base, "min", True, data_dir, folder / "out", progress=False)  # loads 2 at a time, as runs do
    starts = [(size[r["model"]], r["load_s"]) for r in summary["replicas"] if r["load_s"] is not None]
    table = {k: float(np.median([s for kk, s in starts if kk == k])) for k in dict.fromkeys(k for k, _ in starts)}
    table["default"] = float(np.median([s for _, s in starts]))
    print(
        "load-time table (s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in table.items())
        + f" from {len(starts)} engine starts"
    )
    return table


def run_real_case(
    case: RealCase, planner: str, folder: Path, data_dir: Path, loads: dict[str, float]
) -> dict[str, Any]:
    from actors.offline.job import load_job
    from app.offline import run_job

    job, base = load_job(real_job(case, folder, loads))
    load_before = os.getloadavg()[0]
    s = run_job(job, base, planner, True, data_dir, folder / "out", progress=False)
    loads = [r["load_s"] for r in s["replicas"] if r["load_s"] is not None]
    return {
        "workload": case.name,
        "planner": planner,
        "requests": sum(m["requests"] for m in s["models"].values()),
        "search_s": s["search_time_s"],
        "predicted_s": s["predicted_s"],
        "actual_s": s["actual_s"],
        "e2e_s": s["actual_s"] + s["search_time_s"],
        "error": (s["predicted_s"] - s["actual_s"]) / s["actual_s"],
        "engine starts": len(loads),
        "mean load s": float(np.mean(loads)) if loads else 0.0,
        "load share": sum(loads) / (job.devices.count * s["actual_s"]),
        "stages": len(s["stages"]),
        "loadavg": f"{load_before:.1f}/{os.getloadavg()[0]:.1f}",
        "gantt": folder / "out" / "gantt.png",
    }


def run_real(
    quick: bool,
    data_dir: Path,
    load_s: float | None,
    plot: bool,
    work_dir: Path | None = None,
    workloads: Sequence[str] | None = None,
    planners: Sequence[str] = REAL_PLANNERS,
) -> list[dict[str, Any]]:
    start_ray()
    cases = [c for c in REAL_CASES if (not quick or c.name in QUICK_REAL) and (not workloads or c.name in workloads)]
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="offline-bench-") as tmp:
        root = work_dir or Path(tmp)
        loads = {"default": load_s} if load_s else measure_load_table(root / "load-table", data_dir)
        rows = []
        for case in cases:
            for planner in planners:
                row = run_real_case(case, planner, root / f"{case.name}-{planner}", data_dir, loads)
                rows.append(row)
                print(
                    f"  {case.name} {planner}: {row['e2e_s']:.1f} s (predicted {row['predicted_s']:.1f} s)",
                    file=sys.stderr,
                )
                if plot and case.name == "mixed":
                    IMG.mkdir(parents=True, exist_ok=True)
                    (IMG / f"offline_real_mixed_{planner}.png").write_bytes(row["gantt"].read_bytes())
    print(
        f"\n# real: {len(cases)} workloads × {len(planners)} planners on this machine "
        f"({os.cpu_count()} cores = 2 devices), output limit {REAL_TOKENS}, load-time table "
        f"{', '.join(f'{k} {v:.1f} s' for k, v in loads.items())}; "
        f"{time.time() - t_start:.0f} s in all\n"
    )
    print(
        rows_table(
            rows,
            [
                "workload",
                "planner",
                "requests",
                "search_s",
                "predicted_s",
                "actual_s",
                "e2e_s",
                "error",
                "engine starts",
                "mean load s",
                "load share",
                "stages",
                "loadavg",
            ],
        )
    )
    summary = []
    nan = float("nan")
    for w in dict.fromkeys(r["workload"] for r in rows):
        e = {r["planner"]: r["e2e_s"] for r in rows if r["workload"] == w}
        heuristics = [h for h in ("max", "min") if h in e]
        better = min(heuristics, key=e.__getitem__) if heuristics else ""
        summary.append(
            {
                "workload": w,
                **{f"{n} s": e.get(n, nan) for n in ("search", "greedy", "max", "min")},
                "better heuristic": better,
                **{f"{n} speedup": e[better] / e[n] if better and n in e else nan for n in ("search", "greedy")},
            }
        )
    errors = [abs(r["error"]) for r in rows]
    keys = ("search speedup", "greedy speedup")
    summary.append(
        {
            "workload": "geomean",
            "search s": "",
            "greedy s": "",
            "max s": "",
            "min s": "",
            "better heuristic": "",
            **{k: geomean([r[k] for r in summary if r[k] == r[k]]) for k in keys},
        }
    )
    print("\n## search and greedy against the heuristics (real, end-to-end)\n")
    print(rows_table(summary, ["workload", "search s", "greedy s", "max s", "min s", "better heuristic", *keys]))
    print(
        f"\ncost-model error |predicted − actual| / actual: mean {np.mean(errors):.1%}, "
        f"median {np.median(errors):.1%}, max {max(errors):.1%}"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["shipped", "real"])
    p.add_argument("--quick", action="store_true", help="real: routing and mixed only")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--data-dir", default=str(Path("~/.cache/coserve").expanduser()), help="embedded models")
    p.add_argument("--load-s", type=float, help="real: engine load time to plan with (default: measure it first)")
    p.add_argument("--work-dir", help="keep each run's job, outputs, plan and summary here (default: a temp dir)")
    p.add_argument("--workloads", help="real: only these workloads (comma-separated: ensemble,routing,chain,mixed)")
    p.add_argument("--planners", default=",".join(REAL_PLANNERS), help="real: these planners, in order")
    p.add_argument(
        "--shipped-planners",
        default="",
        help="shipped: comma-separated planners to run each job with (default: the job's own only)",
    )
    a = p.parse_args(argv)
    work = Path(a.work_dir).expanduser().resolve() if a.work_dir else None
    if a.part == "shipped":
        run_shipped(Path(a.data_dir).expanduser(), a.shipped_planners.split(","), work)
        return 0
    if not SHARED.is_dir():
        print(
            f"error: {SHARED} not found (the benchmark reads ShareGPT and QMSum from it; COSERVE_SHARED_DATA "
            "points elsewhere)",
            file=sys.stderr,
        )
        return 2
    run_real(
        a.quick,
        Path(a.data_dir).expanduser(),
        a.load_s,
        not a.no_plot,
        work,
        a.workloads.split(",") if a.workloads else None,
        tuple(x for x in a.planners.split(",") if x),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
