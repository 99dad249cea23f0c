"""Typed messages between the pipeline trainer and its stage actors, and its public settings and results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Method = Literal["full_sft", "full_dpo"]


@dataclass(frozen=True)
class TrainingSample:
    """One training example: ``completion`` for full_sft, ``chosen`` and ``rejected`` for full_dpo.

    ``messages`` (chat turns) is rendered with the model's chat template, as actors.learning.lora.steps does
    for adapters; otherwise ``prompt`` is used as raw text.
    """

    prompt: str = ""
    completion: str | None = None
    chosen: str | None = None
    rejected: str | None = None
    messages: list[dict[str, str]] | None = None


@dataclass(frozen=True)
class PipelineSettings:
    """How one node trains its full model over its placement group's bundles.

    ``stage_resources``: each stage actor's share of its bundle (bundle 0 also holds the replica).
    ``micro_batch``: samples (DPO: pairs) per micro-batch; ``accumulation``: micro-batches per
    optimizer step (DeepSpeed's ``gradient_accumulation_steps``).
    """

    model_dir: str
    versions_root: str
    stage_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 0.5})
    partition_method: Literal["uniform", "parameters", "compute"] = "parameters"
    micro_batch: int = 2
    accumulation: int = 2
    learning_rate: float = 1e-4
    beta: float = 0.1
    max_length: int = 512
    max_grad_norm: float = 1.0
    seed: int = 0
    threads: int = 1  # torch intra-op threads per stage actor
    schedule: Literal["planner", "deepspeed"] = "planner"
    """``planner``: the stage scheduler picks every op on every stage (``stage_order``, a registry
    name of planners/pipeline); ``deepspeed``: DeepSpeed's engine runs each batch (``train_batch``)."""
    stage_order: str = "lemix"
    stage_order_params: dict[str, Any] = field(default_factory=dict)
    max_in_flight: int | None = None
    """Under the stage scheduler: micro-batches admitted and not yet through their backward (None: the
    stage count, as 1F1B)."""
    chunks: int = 1
    """Under the stage scheduler (``ScheduledPipeline``): ops a stage's layers run as, so an inference
    pass can run between two parts of a training pass on the same stage (1: one op per stage)."""

    @classmethod
    def from_config(cls, cfg: Any, *, versions_root: str | None = None, **overrides: Any) -> PipelineSettings:
        """From an AppConfig: its model, ``training.resources_per_worker``, micro_batch, accumulation, max_length."""
        from actors.models.default_model import model_dir

        t = cfg.training
        values: dict[str, Any] = dict(
            model_dir=model_dir(cfg),
            versions_root=versions_root or str(cfg.data_path / "full_versions"),
            stage_resources=dict(t.resources_per_worker),
            micro_batch=t.micro_batch,
            accumulation=t.accumulation,
            max_length=t.max_length,
            stage_order=cfg.planner.stage_order,
            stage_order_params=dict(cfg.planner.stage_order_params),
        )
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True)
class StageSetup:
    """What a stage needs to join the pipeline: the rendezvous, the world (= stages) and where its weights are."""

    host: str
    port: int
    stages: int
    model_dir: str
    partition_method: str
    micro_batch: int
    accumulation: int
    learning_rate: float
    beta: float
    max_grad_norm: float
    seed: int
    threads: int
    chunks: int = 1
    schedule: Literal["deepspeed", "planner"] = "deepspeed"
    """``deepspeed``: DeepSpeed's engine runs whole batches (``train_batch``); ``planner``: the stage runs
    single ops the stage scheduler picks (``forward_op`` / ``backward_op`` / ``step_op``)."""


@dataclass(frozen=True)
class StageInfo:
    """What a stage reports once it joined: where it runs and which layers it holds ([start, stop))."""

    rank: int
    stage_id: int
    layer_start: int
    layer_stop: int
    bounds: list[int]
    params: int
    placement_group_id: str | None
    node_id: str
    actor_id: str


@dataclass(frozen=True)
class TokenBatch:
    """One micro-batch: ``ids`` [B, T] for the first stage; ``targets``, ``mask`` and for DPO ``ref`` [B] for the last."""

    ids: Any
    targets: Any
    mask: Any
    ref: Any | None = None


@dataclass(frozen=True)
class PublishedVersion:
    """A full-model version written to ``path`` (``<root>/<unit>/v<N>``)."""

    unit: str
    version: int
    path: str
    parent: str | None
    method: Method
    steps: int
    losses: list[float]
    reward_margin: float | None = None  # full_dpo: mean β-scaled margin of the trained pairs after training

    @property
    def loss(self) -> float | None:
        return self.losses[-1] if self.losses else None
