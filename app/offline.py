"""The offline-job CLI: plan and run multi-LLM batch jobs stage by stage (SamuLLM §3–§4.3).

    python -m app.offline plan configs/jobs/ensemble.yaml [--planner search|greedy|max|min] [--no-preemption] [--json PATH]
    python -m app.offline run configs/jobs/ensemble.yaml [--planner ...] [--no-preemption] [--data-dir DIR]
    python -m app.offline profile configs/jobs/ensemble.yaml [--out-dir DIR]   # each model's own Eq. 5 constants

Planning is ``actors/offline/plan.py`` (the job spec: ``actors/offline/job.py``); running executes
the plan with one :class:`actors.offline.engine.OfflineEngine` Ray actor per model replica
(``actors/offline/runner.py``). This module is the driver: it starts or joins Ray, prints, and
writes the run's plan.json, summary.json and gantt.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from actors.offline.job import JobSpec, load_job
from actors.offline.plan import DEFAULT_DATA_DIR, plan_job, prepare_job
from actors.offline.runner import JobRunner, OutputFile
from planners.offline import Plan
from planners.registry import names

ROOT = Path(__file__).resolve().parents[1]


def gantt(summary: dict[str, Any], n_devices: int, path: Path) -> None:
    """Devices × time, one bar per model replica: hatched while its engine loads, solid while it runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["replicas"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(models)}
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * n_devices))
    end = summary["actual_s"]
    for r in rows:
        t_end = r["end_s"] if r["end_s"] is not None else end
        ready = r["ready_s"] if r["ready_s"] is not None else t_end
        for d in r["devices"]:
            ax.broken_barh(
                [(r["start_s"], ready - r["start_s"])],
                (d - 0.4, 0.8),
                facecolors=colors[r["model"]],
                alpha=0.35,
                hatch="//",
            )
            ax.broken_barh([(ready, t_end - ready)], (d - 0.4, 0.8), facecolors=colors[r["model"]])
            ax.text(r["start_s"] + 0.5, d, r["model"], va="center", fontsize=8)
    for s in summary["stages"]:
        if s["actual_start_s"] is not None:
            ax.axvline(s["actual_start_s"], color="grey", lw=0.8, ls=":")
    ax.set_yticks(range(n_devices), [f"device {d}" for d in range(n_devices)])
    ax.set_xlabel("seconds (hatched: engine load)")
    ax.set_title(
        f"{summary['job']}: {summary['planner']} plan, predicted {summary['predicted_s']:.0f} s, "
        f"actual {summary['actual_s']:.0f} s"
    )
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_job(
    job: JobSpec,
    base_dir: Path,
    planner: str = "search",
    preemption: bool = True,
    data_dir: Path = DEFAULT_DATA_DIR,
    output_dir: Path | None = None,
    progress: bool = True,
) -> dict[str, Any] | None:
    """Plan what is left of ``job`` (outputs already in ``output_dir`` are skipped) and run it on Ray;
    returns the summary (also written, with plan.json and gantt.png), or None when nothing was left."""
    import ray

    out = output_dir or (base_dir / job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = {m.name: set(OutputFile(out / f"{m.name}.jsonl").records) for m in job.models}
    prep = prepare_job(job, base_dir, planner, preemption, data_dir, done)
    print("\n".join(prep.notes))
    if prep.plan is None:
        print(f"nothing left to run: every output is in {out}")
        return None
    print(format_plan(prep.plan))
    (out / "plan.json").write_text(json.dumps(prep.plan.to_dict(), indent=1))
    if not ray.is_initialized():
        # Under `ray job submit` this joins the job's cluster; alone it starts a local one with logical
        # CPUs enough for every device slot (a small host may have fewer cores than slots: logical CPUs).
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            ray.init(
                num_cpus=max(8, job.devices.count),
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
            )
    runner = JobRunner(prep, out, progress)
    summary = runner.run()
    summary["skipped"] = {m: len(v) for m, v in done.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    gantt(summary, job.devices.count, out / "gantt.png")
    print(
        f"done in {summary['actual_s']:.1f} s (predicted {summary['predicted_s']:.1f} s, error "
        f"{summary['estimation_error']:+.0%}); outputs in {out}"
    )
    return summary


def profile(job: JobSpec, data_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Fit and write each model's offline-engine profile (:func:`actors.offline.profile.profile_job`) in a local Ray."""
    import ray

    from actors.offline.plan import REFERENCE_PROFILE
    from actors.offline.profile import profile_job
    from planners.costs import CostModel

    reference = CostModel.from_dict(json.loads(REFERENCE_PROFILE.read_text()))
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=max(8, job.devices.count),
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )
    try:
        print(f"profiling the offline engine of {len(job.models)} model(s):")
        return profile_job(job, data_dir, reference, out_dir)
    finally:
        if started:
            ray.shutdown()


def format_plan(plan: Plan) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{plan.planner} plan{'' if plan.preemption else ', no preemption'}: "
        f"{plan.predicted_s:.1f} s predicted, search {plan.search_time_s * 1000:.0f} ms"
    )
    for col in ("stage", "start s", "duration s", "models (dp × tp on devices)", "finishes"):
        table.add_column(col)
    for i, st in enumerate(plan.stages):
        runs = ", ".join(f"{p.model} {p.dp}×{p.tp} {list(p.devices)}" for p in st.plans)
        table.add_row(str(i), f"{st.start_s:.1f}", f"{st.duration_s:.1f}", runs, ", ".join(st.finishes))
    console = Console(record=True, width=120)
    with console.capture() as cap:
        console.print(table)
    return cap.get()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.offline", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="print the planned execution stages without running")
    rn = sub.add_parser("run", help="run the job stage by stage on Ray (resumes: finished requests are skipped)")
    pr = sub.add_parser("profile", help="fit each model's per-iteration latency on the offline engine (SamuLLM §4.1)")
    pr.add_argument("job")
    pr.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="where embedded models are built")
    pr.add_argument(
        "--out-dir",
        help="write the profiles here (default: <data-dir>/offline/profiles, where "
        "planning looks first; profiles/ is where shipped ones live)",
    )
    for q in (pl, rn):  # profile takes only the job and the directories
        q.add_argument("job")
        q.add_argument(
            "--planner",
            choices=names("stages"),
            help="override the job's planner: search (ours, the default), greedy (SamuLLM Alg. 1), max, min",
        )
        q.add_argument("--no-preemption", action="store_true", help="override the job's preemption: off")
        q.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="where embedded models are built")
    pl.add_argument("--json", metavar="PATH", help="also write the plan as JSON (the run's plan.json) here")
    rn.add_argument("--output-dir", help="override the job's output_dir (e.g. an absolute path under ray job submit)")
    rn.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    data_dir = Path(args.data_dir).expanduser()
    try:
        job, base = load_job(args.job)
        if args.command == "profile":
            profile(job, data_dir, Path(args.out_dir).expanduser() if args.out_dir else None)
            return 0
        planner = args.planner or job.planner
        preemption = job.preemption and not args.no_preemption
        if args.command == "run":
            out = Path(args.output_dir).expanduser().resolve() if args.output_dir else None
            run_job(job, base, planner, preemption, data_dir, out, not args.no_progress)
            return 0
        plan, notes = plan_job(job, base, planner, preemption, data_dir)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(notes))
    print(format_plan(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
