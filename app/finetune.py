"""Fine-tune a LoRA adapter from a dataset on Ray Train: ``python -m app.finetune JOB.yaml``.

The same command runs under ``ray job submit --working-dir . -- python -m app.finetune JOB.yaml``
(it joins the job's cluster through ``RAY_ADDRESS``); alone, it starts a local Ray. The job file is
``actors/learning/finetune/job.py``; the run (Ray Train v2's ``TorchTrainer``, checkpoints each
epoch, restarts from the last one) is ``actors/learning/finetune/run.py``. Batch fine-tuning uses Ray
Train while co-serving training uses plain actors: ``TorchTrainer`` always reserves a placement
group of its own, so it cannot share a serving replica's bundle (``actors/learning/finetune/__init__.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")  # before anything imports ray.train

from actors.learning.finetune.data import DataFileError  # noqa: E402
from actors.learning.finetune.job import JobFileError, load_job  # noqa: E402
from actors.learning.finetune.publish import PublishError  # noqa: E402
from actors.learning.finetune.worker import CRASH_ONCE_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.finetune", description=__doc__.split("\n\n")[0])
    p.add_argument("job", help="the job file (YAML)")
    p.add_argument("--address", default=None, help="a Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--check", action="store_true", help="validate the job and its data, then stop")
    args = p.parse_args(argv)
    try:
        job = load_job(args.job)
        if args.check:
            from actors.learning.finetune.data import read_items

            n = len(read_items(job.data.path, job.adapter.name, job.adapter.method))
            print(f"{args.job}: valid; {n} items")
            return 0
    except (JobFileError, DataFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import ray

    from actors.learning.finetune.run import run_finetune

    if not ray.is_initialized():
        if args.address or os.environ.get("RAY_ADDRESS"):
            ray.init(address=args.address)  # under `ray job submit`: the job's runtime env has the working dir
        else:
            # A local Ray of its own; logical CPUs enough for the workers' fractions on a small host.
            need = job.workers * job.resources_per_worker.get("CPU", 1.0)
            ray.init(
                address="local",
                num_cpus=max(4, int(need + 2)),
                include_dashboard=False,
                runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_TRAIN_V2_ENABLED": "1"}},
            )
    try:
        run = run_finetune(job, crash_once=os.environ.get(CRASH_ONCE_ENV))
    except (JobFileError, DataFileError, PublishError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for r in run.reports:
        print(
            f"[finetune] checkpoint epoch {r['epoch']}: loss {r['loss']:.4f} (worker group started after epoch "
            f"{r['resumed_from']})"
        )
    print(
        json.dumps(
            {
                "checkpoint": run.checkpoint_dir,
                "epoch": run.state["epoch"],
                "loss": run.state["loss"],
                "output": run.output,
            },
            default=str,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
