"""Runs a fine-tuning job on Ray Train v2: a ``TorchTrainer`` over the job's workers, then the adapter to its output.

Ray Train v2 (on by default in Ray 2.60; ``RAY_TRAIN_V2_ENABLED=1`` is set here all the same, before
``ray.train`` is imported) runs a controller actor that owns the worker group: it reserves one
placement group for ``ScalingConfig(num_workers, resources_per_worker, label_selector)``, sets up
the gloo process group (``TorchTrainer``), restarts the whole group from the latest checkpoint when
a worker dies (``FailureConfig(max_failures)``), and keeps the checkpoints under
``RunConfig(storage_path)/<run name>``. A rerun with the same storage path and run name resumes there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.learning.finetune.data import read_items
from actors.learning.finetune.job import EMBEDDED_MODELS, FinetuneJob, JobFileError
from actors.learning.finetune.placement import SeparateDecision, away_from_serving, separate_decision
from actors.learning.finetune.publish import publish, write_peft_dir
from actors.learning.finetune.worker import STATE_FILE, train_loop


@dataclass
class FinetuneRun:
    """What a run did: the final checkpoint and its state, every epoch's report, and where the adapter went."""

    checkpoint_dir: str
    state: dict[str, Any]
    reports: list[dict[str, Any]] = field(default_factory=list)  # rank 0's metrics of each kept checkpoint, in order
    output: str | dict[str, Any] | None = None  # the PEFT directory written, or the app's version record
    placement: str = "shared"
    items: int = 0


def resolve_base(job: FinetuneJob) -> str:
    """The model directory of ``job.base``, as the app resolves its model (an embedded one is built or fetched)."""
    from actors.models.default_model import model_dir
    from settings import AppConfig

    model = {"embedded": job.base} if job.base in EMBEDDED_MODELS else {"path": job.base}
    path = model_dir(AppConfig(data_dir=job.data_dir, model=model))
    if not (Path(path) / "config.json").is_file():
        raise JobFileError(
            f"base: {job.base!r} is neither {' nor '.join(EMBEDDED_MODELS)} nor a model directory "
            f"(no config.json in {path})"
        )
    return path


def check_targets(job: FinetuneJob, model_dir: str) -> None:
    """Refuse LoRA target modules the base model does not have, before any worker loads it."""
    from actors.learning.lora.targets import lora_targetable_modules, short_names, unknown_targets
    from actors.learning.store.models import ALL_LINEAR

    targets = job.adapter.lora.target_modules
    if targets == ALL_LINEAR:
        return
    modules = lora_targetable_modules(model_dir)
    unknown = unknown_targets(targets, modules)
    if unknown:
        raise JobFileError(
            f"adapter.lora.target_modules: {unknown} name no module of {job.base}; LoRA can target "
            f"{', '.join(short_names(modules))}"
        )


def run_finetune(job: FinetuneJob, *, crash_once: str | None = None, log: Any = print) -> FinetuneRun:
    """Train ``job`` on the Ray cluster this process is connected to, then write or publish the adapter.

    ``crash_once``: the test-only ``"<epoch>:<marker file>"`` of ``worker.CRASH_ONCE_ENV``.
    """
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    import ray
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    from compat import ray_train_v2_enabled

    if not ray_train_v2_enabled():
        raise RuntimeError("Ray Train v2 is off in this process (RAY_TRAIN_V2_ENABLED=0); this job needs v2")
    items = read_items(job.data.path, job.adapter.name, job.adapter.method)  # every line checked before any worker
    model_dir = resolve_base(job)
    check_targets(job, model_dir)
    log(
        f"[finetune] {job.name}: {job.adapter.method} LoRA r={job.adapter.lora.r} on {job.base} ({model_dir}); "
        f"{len(items)} items from {job.data.path} ({job.data.loader}); {job.epochs} epoch(s), {job.workers} worker(s) "
        f"x {job.resources_per_worker}, batch {job.batch_size}/worker"
    )

    callbacks, placement = [], "shared"
    if job.placement == "separate":
        decision: SeparateDecision = separate_decision(job.serving_deployment)
        log(f"[finetune] {decision.message}")
        placement = decision.message
        # The label selector comes from a controller callback, not ScalingConfig.label_selector: the controller
        # reads the cluster again before each worker group (a restart may find serving moved).
        callbacks.append(away_from_serving(job.serving_deployment))
    crash = None
    if crash_once:
        epoch, _, marker = crash_once.partition(":")
        crash = {"epoch": int(epoch), "marker": marker}
        log(f"[finetune] test crash armed: the last rank exits once during epoch {epoch} (marker {marker})")

    scaling = ray.train.ScalingConfig(
        num_workers=job.workers, resources_per_worker=dict(job.resources_per_worker), use_gpu=False
    )
    run_config = ray.train.RunConfig(
        name=job.name,
        storage_path=job.storage_path,
        failure_config=ray.train.FailureConfig(max_failures=job.max_failures),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=None),
        callbacks=callbacks or None,
    )
    datasets = None
    if job.data.loader == "ray_data":
        ray.data.DataContext.get_current().enable_progress_bars = False  # a few rows: bars would bury the epochs' lines
        datasets = {"train": ray.data.read_json(job.data.path)}
    threads = max(1, int(job.resources_per_worker.get("CPU", 1.0)))
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"job": job.model_dump(), "model_dir": model_dir, "crash_once": crash, "threads": threads},
        scaling_config=scaling,
        run_config=run_config,
        datasets=datasets,
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"the run {job.name} under {job.storage_path} reported no checkpoint")
    reports = [dict(m) for _, m in result.best_checkpoints]
    with result.checkpoint.as_directory() as ckpt:
        state = json.loads((Path(ckpt) / STATE_FILE).read_text())
        summary = {"run": job.name, "storage": result.path, "checkpoint": result.checkpoint.path, **state}
        if job.output.dir is not None:
            output: str | dict[str, Any] = str(write_peft_dir(ckpt, job.output.dir, summary))
            log(f"[finetune] adapter written to {output} (adapter_config.json + adapter_model.safetensors)")
        else:
            output = publish(job, ckpt)
            log(
                f"[finetune] published to {job.output.app_url}: {job.adapter.name} version {output.get('version')} "
                f"({output.get('state')})"
            )
    return FinetuneRun(
        checkpoint_dir=result.checkpoint.path,
        state=state,
        reports=reports,
        output=output,
        placement=placement,
        items=len(items),
    )
