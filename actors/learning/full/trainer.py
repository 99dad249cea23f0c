"""PipelineTrainer: creates a node's stage actors in its placement group's bundles and trains and publishes full-model versions.

Usage (the caller holds the node's placement group, e.g. the replica's; stage i goes to bundle i)::

    trainer = PipelineTrainer(PipelineSettings.from_config(cfg), placement_group)
    v = trainer.train(samples, "full_sft", unit="base", version=1, steps=4)
    v2 = trainer.train(pairs, "full_dpo", unit="base", version=2, steps=2)
    trainer.train(samples, "full_sft", unit="base", version=3, steps=4, resume_from=v.path)  # rollback to v1
    trainer.shutdown()

Like actors/learning/trainer.py this places its workers itself (``PlacementGroupSchedulingStrategy``) rather
than through Ray Train, whose ``TorchTrainer`` always reserves a placement group of its own.
The trainer is a plain object in the caller's process: it tokenizes, builds fixed micro-batches,
calls every stage at once (each call is a collective over the pipeline), and publishes.

DPO's reference is not a third model copy: before training on a set of pairs, one no-grad pipeline
pass (``eval_batch``) with the weights the version starts from gives the reference sequence
log-probs of every chosen and rejected answer, which then ride with the labels of each
micro-batch to the last stage. This costs one forward pass per pair per ``train`` call and no
memory, against a frozen copy of every stage's slice that would be run every step; it is exact
because the reference is fixed for the whole call (the starting weights).

Faults: a stage actor that dies fails the call (its collectives cannot finish); the caller shuts
the trainer down and starts a new one, resuming from the last published version (``resume_from``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray

from actors.learning.full.layout import LlamaDims, check_bounds, layer_names
from actors.learning.full.messages import (
    Method,
    PipelineSettings,
    PublishedVersion,
    StageInfo,
    StageSetup,
    TokenBatch,
    TrainingSample,
)
from actors.learning.versions.layout import is_complete_full_version, write_full_version

PLACE_TIMEOUT_S = 300.0
# Files copied from the starting model next to the weights, so a version is a complete HF model directory.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
MODES = {"full_sft": "sft", "full_dpo": "dpo"}


class PipelineTrainer:
    """One node's full-model pipeline: S stage actors, S = the placement group's bundle count."""

    def __init__(self, settings: PipelineSettings, placement_group: Any) -> None:
        self.settings = settings
        self.pg = placement_group
        self.stages: list[Any] = []
        self.info: list[StageInfo] = []
        self.weights_from = settings.model_dir  # the version (or base model) the stages hold now
        self.node: Any = None  # the ScheduledPipeline driving the stages (schedule "planner")
        self._tokenizer: Any = None
        self._tasks = 0

    # -------------------------------------------------------------------- stage actors

    def start(self) -> list[StageInfo]:
        """Create stage i in bundle i, join them into one process group and load the starting weights."""
        if self.stages:
            return self.info
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from actors.learning.full.stage import PipelineStage

        if self.settings.schedule == "planner":
            from actors.learning.full.scheduled import ScheduledPipeline

            self.node = ScheduledPipeline(self.settings, self.pg)
            self.info = self.node.start()
            self.stages = self.node.actors
            self._check_partition()
            return self.info
        ray.get(self.pg.ready(), timeout=PLACE_TIMEOUT_S)
        n = len(self.pg.bundle_specs)
        res = dict(self.settings.stage_resources)
        cpus, gpus = res.pop("CPU", 0.0), res.pop("GPU", 0.0)
        cls = ray.remote(PipelineStage)
        self.stages = [
            cls.options(
                num_cpus=cpus,
                num_gpus=gpus,
                resources=res or None,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(i)
            for i in range(n)
        ]
        host, port = ray.get(self.stages[0].address.remote(), timeout=PLACE_TIMEOUT_S)
        s = self.settings
        setup = StageSetup(
            host=host,
            port=port,
            stages=n,
            model_dir=self.weights_from,
            partition_method=s.partition_method,
            micro_batch=s.micro_batch,
            accumulation=s.accumulation,
            learning_rate=s.learning_rate,
            beta=s.beta,
            max_grad_norm=s.max_grad_norm,
            seed=s.seed,
            threads=s.threads,
        )
        self.info = ray.get([st.setup.remote(setup) for st in self.stages])
        self._check_partition()
        return self.info

    def _check_partition(self) -> None:
        config = json.loads((Path(self.weights_from) / "config.json").read_text())
        check_bounds(self.info[0].bounds, len(layer_names(LlamaDims.from_config(config))), len(self.info))
        if any(i.bounds != self.info[0].bounds for i in self.info):
            raise RuntimeError(f"stages disagree on the partition: {[i.bounds for i in self.info]}")

    def shutdown(self) -> None:
        if self.node is not None:
            self.node.shutdown()
        for st in self.stages:
            ray.kill(st)
        self.stages, self.info, self.node = [], [], None

    # -------------------------------------------------------------------- training

    def train(
        self,
        samples: Sequence[TrainingSample],
        method: Method,
        *,
        unit: str,
        version: int,
        steps: int,
        resume_from: str | Path | None = None,
    ) -> PublishedVersion:
        """Run ``steps`` optimizer steps of ``method`` over ``samples`` (cycled) and publish ``<unit>/v<version>``.

        ``resume_from``: a published version directory (or an HF model directory) to start from
        instead of the current weights, with fresh optimizer moments (rollback). The new version's
        ``parent`` is the directory its starting weights came from.
        """
        if method not in MODES:
            raise ValueError(f"unknown method {method!r}; choose one of {sorted(MODES)}")
        if not samples or steps < 1:
            raise ValueError("train needs samples and at least one step")
        self.start()
        if resume_from is not None:
            if not is_complete_full_version(resume_from) and not (Path(resume_from) / "config.json").exists():
                raise FileNotFoundError(f"{resume_from}: not a model directory")
            ray.get([st.load.remote(str(resume_from)) for st in self.stages])
            self.weights_from = str(resume_from)
        parent = self.weights_from
        s = self.settings
        per_step = s.micro_batch * s.accumulation
        ref = self.reference_logps(samples) if method == "full_dpo" else None
        losses = []
        for k in range(steps):
            idx = [(k * per_step + j) % len(samples) for j in range(per_step)]
            batches = [
                self._micro_batch(samples, idx[m : m + s.micro_batch], method, ref)
                for m in range(0, per_step, s.micro_batch)
            ]
            if self.node is None:
                losses.append(self._train_batch_on_all(batches, MODES[method]))
            else:
                losses.append(self._scheduled_step(batches))
        margin = self.reward_margin(samples, ref) if ref is not None else None
        meta = {
            "version": int(version),
            "parent": parent,
            "method": method,
            "steps": steps,
            "loss": losses[-1],
            "losses": losses,
            "reward_margin": margin,
            "created_at": time.time(),
            "stages": [asdict(i) for i in self.info],
        }
        path = self.publish(unit, version, meta)
        self.weights_from = str(path)
        return PublishedVersion(
            unit=unit,
            version=int(version),
            path=str(path),
            parent=parent,
            method=method,
            steps=steps,
            losses=losses,
            reward_margin=margin,
        )

    def reference_logps(self, samples: Sequence[TrainingSample]) -> tuple[list[float], list[float]]:
        """(chosen, rejected) sequence log-probs of every pair under the current weights (no grad)."""
        mb = self.settings.micro_batch
        batches = [
            self._micro_batch(samples, list(range(i, min(i + mb, len(samples)))), "full_dpo", None)
            for i in range(0, len(samples), mb)
        ]
        if self.node is None:
            rows = self._logps_on_all(batches)
        else:
            ids = [self._task_id("score") for _ in batches]
            for task_id, b in zip(ids, batches):
                self.node.submit_scoring(task_id, b)
            self.node.run()
            rows = [x for task_id in ids for x in self.node.scores.pop(task_id)]
        chosen, rejected, at = [], [], 0
        for b in batches:
            n = b.ids.shape[0] // 2
            chosen += rows[at : at + n]
            rejected += rows[at + n : at + 2 * n]
            at += 2 * n
        return chosen, rejected

    def reward_margin(self, samples: Sequence[TrainingSample], ref: tuple[list[float], list[float]]) -> float:
        """Mean β·((log π − log π_ref)(chosen) − (log π − log π_ref)(rejected)) over the pairs, with the current weights."""
        pc, pr = self.reference_logps(samples)
        rc, rr = ref
        b = self.settings.beta
        return sum(b * ((pc[i] - rc[i]) - (pr[i] - rr[i])) for i in range(len(pc))) / len(pc)

    def publish(self, unit: str, version: int, meta: dict) -> Path:
        """Gather every stage's HF-named slice and write the version atomically."""
        tensors: dict[str, Any] = {}
        for part in ray.get([st.state_slice.remote() for st in self.stages]):
            overlap = set(tensors) & set(part)
            if overlap:
                raise RuntimeError(f"two stages claim {sorted(overlap)[:3]}")
            tensors.update(part)
        src = Path(self.settings.model_dir)
        files = {name: (src / name).read_bytes() for name in MODEL_FILES if (src / name).is_file()}
        return write_full_version(self.settings.versions_root, unit, version, tensors, meta, files)

    def _scheduled_step(self, batches: list[TokenBatch]) -> float:
        """One optimizer step through the stage scheduler: its micro-batches, op by op; their mean loss."""
        node = self.node
        before = len(node.losses)
        steps = node.scheduler.steps
        for b in batches:
            node.submit_training(self._task_id("mb"), b)
        node.run()
        if node.scheduler.steps != steps + 1:
            raise RuntimeError(f"the stages ran {node.scheduler.steps - steps} optimizer steps for one mini-batch")
        mine = node.losses[before:]
        # The trainer keeps no history: a long-lived unit would otherwise grow these without bound.
        node.losses.clear()
        node.trained.clear()
        node.timeline.clear()
        return sum(mine) / len(mine)

    def _task_id(self, kind: str) -> str:
        self._tasks += 1
        return f"{kind}-{self._tasks}"

    # -------------------------------------------------------------------- helpers

    def _data_for(self, batches: list[TokenBatch]) -> list[Any]:
        """Each stage's copy of ``batches`` (one object in Ray's store): only the first and the last stage need it."""
        data, last = ray.put(batches), len(self.stages) - 1
        return [data if i in (0, last) else None for i in range(len(self.stages))]

    def _train_batch_on_all(self, batches: list[TokenBatch], mode: str) -> float:
        """One optimizer step over ``batches`` on every stage at once (no scheduler); its loss, as stage 0 has it."""
        return ray.get([st.train_batch.remote(data, mode) for st, data in zip(self.stages, self._data_for(batches))])[0]

    def _logps_on_all(self, batches: list[TokenBatch]) -> list[float]:
        """Sequence log-probs of every row of ``batches`` (no grad), from the stage that computes them (the last)."""
        rows = ray.get([st.logps.remote(data, len(batches)) for st, data in zip(self.stages, self._data_for(batches))])
        return next(r for r in rows if r is not None)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.settings.model_dir)
        return self._tokenizer

    def _micro_batch(
        self,
        samples: Sequence[TrainingSample],
        idx: list[int],
        method: Method,
        ref: tuple[list[float], list[float]] | None,
    ) -> TokenBatch:
        """Tokenize (as the LoRA trainer does: actors.learning.lora.steps.encode) and shift into next-token targets."""
        import torch

        from actors.learning.lora.steps import encode, prompted_text

        fields = ["completion"] if method == "full_sft" else ["chosen", "rejected"]
        texts = [prompted_text(self.tokenizer, samples[i], f) for f in fields for i in idx]
        enc = encode(
            self.tokenizer,
            [t.prompt for t in texts],
            [t.answer for t in texts],
            max_length=self.settings.max_length,
            templated=[t.templated for t in texts],
        )
        ids = enc.input_ids
        targets = torch.zeros_like(ids)
        mask = torch.zeros(ids.shape, dtype=torch.float32)
        targets[:, :-1] = ids[:, 1:]
        mask[:, :-1] = enc.completion_mask[:, 1:].float()
        ref_t = None
        if ref is not None:
            ref_t = torch.tensor([ref[0][i] for i in idx] + [ref[1][i] for i in idx], dtype=torch.float32)
        return TokenBatch(ids=ids, targets=targets, mask=mask, ref=ref_t)
