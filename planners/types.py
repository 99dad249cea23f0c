"""Plain data exchanged between the model servers, the planner actor, the routers, the simulator and every policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from planners.coserving import EngineFacts

TaskKind = Literal["inference", "training"]


@dataclass(frozen=True)
class Task:
    """One unit of work to place on a node: an inference request or a training step."""

    task_id: str
    kind: TaskKind
    model: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    batch_size: int = 1
    """Samples per micro-batch C of a training task (LEMIX §IV-A); 1 for an inference request."""


@dataclass(frozen=True)
class NodeView:
    """What a placement policy may know about one node at decision time."""

    node_id: int
    ready: bool
    in_flight: int = 0
    busy_seconds: float = 0.0
    adapters: frozenset[str] = field(default_factory=frozenset)
    node_type: str = "default"
    """Hardware class, to pick a per-type cost model (LEMIX's η^n); "default" when homogeneous."""


@dataclass(frozen=True)
class ExecutionTrace:
    """Timestamps and sizes of one finished request, reported back by a replica."""

    task_id: str
    node_id: int
    arrival: float
    start: float
    first_token: float | None
    finish: float
    prompt_tokens: int
    output_tokens: int
    ok: bool = True

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


# ---- messages between the model servers, the planner actor and the placement router ----------


@dataclass(frozen=True)
class NodeRegistration:
    """A model server announcing itself to the planner as the replica of logical node ``node_id``.

    ``node_id`` is the Serve replica's rank, which Serve hands to the replacement of a replica that
    died, so a node keeps its id (and its adapters, feedback and trainer rank) across restarts.
    """

    node_id: int
    actor_name: str
    """The Serve replica's Ray actor name (namespace ``serve``): the planner watches it for death."""
    pid: int
    ray_node_id: str
    placement_group_id: str | None
    started_at: float


@dataclass(frozen=True)
class NodeReport:
    """What a model server tells the planner every ``planner.trace_flush_seconds`` while it has work.

    Counters run from the replica's start; the planner adds them to what earlier replicas of the
    node served.
    """

    node_id: int
    traces: tuple[ExecutionTrace, ...]
    received: int
    """Requests the replica's engine began since the replica started."""
    finished: int
    in_flight: int
    busy_seconds: float
    engine: EngineFacts | None = None
    at: float = 0.0
    prefix_cache_queries: int = 0
    """Prompt tokens the engine looked up in its prefix cache since the replica started (vLLM's PrefixCacheStats)."""
    prefix_cache_hits: int = 0
    """Of those, the tokens it found cached: with per-tenant cache salts, only the same tenant's prefixes."""
    engine_metrics: str | None = None
    """vLLM's own Prometheus series of the node's engine (its ``PrometheusStatLogger``), as exposition text,
    every few seconds; None: unchanged since the last one sent."""


@dataclass(frozen=True)
class NodeLocation:
    """Where a logical node's replica runs: its Ray node and placement group (its trainer rank goes there too)."""

    node_id: int
    ray_node_id: str | None
    state: str
    """``starting`` until the replica registered, then ``ready``."""
    placement_group_id: str | None
    trains: bool = True
    """Whether the node takes a trainer rank: every node, except under ``placement: separate``, whose
    split (LEMIX §VI-A) sets the last N_train nodes aside for training and keeps ranks off the others."""


@dataclass(frozen=True)
class ServedModels:
    """What the app serves: the base model and every ``base:adapter`` some node serves (for ``/v1/models``)."""

    base: str
    root: str
    """The base model's directory (the ``root`` of its model card)."""
    max_model_len: int
    adapters: tuple[str, ...]


@dataclass(frozen=True)
class AdapterLoaded:
    """The answer to loading (or unloading) an adapter version: the nodes that serve the change now."""

    model: str
    version: int | None
    nodes: tuple[int, ...]


@dataclass(frozen=True)
class AdapterVersion:
    """One published adapter version: its number and the directory its weights are in."""

    version: int
    path: str


@dataclass(frozen=True)
class FullVersion:
    """A full-model version of training unit ``unit`` (methods full_sft, full_dpo), published at ``path``."""

    unit: str
    version: int
    path: str


@dataclass(frozen=True)
class FullSynced:
    """What a node's engine computes with after an assignment: ``version`` of ``unit`` (None: the weights it
    started with) and what the last sync into it cost."""

    unit: str | None
    version: int | None
    sync_s: float | None
    """The replica's whole ``load_full_version`` call (pause, load, resume); None: no sync was needed."""
    fingerprint: str | None
    at: float


@dataclass(frozen=True)
class AdapterLoadFailed:
    """A node could not serve ``version`` of an adapter (its files do not fit the served base, say): why."""

    version: int
    message: str


@dataclass(frozen=True)
class AdapterAssignment:
    """The adapter versions one node must serve, as of ``epoch`` (raised by every change)."""

    epoch: int
    adapters: dict[str, AdapterVersion] = field(default_factory=dict)
    full: FullVersion | None = None
    """The full-model version the node's engine must compute with; None: the model it started with."""


@dataclass(frozen=True)
class TrainingPlacement:
    """A training step the planner granted on ``node_id``, as placement sees it: a training :class:`Task`
    (C = ``batch_size`` samples, ℓ = ``prompt_tokens`` per sample) committed there with its planned
    backward intervals (Q_train^n of LEMIX Alg. 1) until the step is done."""

    task: Task
    node_id: int


@dataclass(frozen=True)
class RoutingSnapshot:
    """What the planner publishes to placement routers: node facts and traces since ``after``.

    Routers poll it every ``planner.trace_flush_seconds``; no request waits on the planner.
    ``nodes[i].busy_seconds`` and ``in_flight`` are as of ``reported_at[i]``.
    """

    seq: int
    """Sequence number of the newest trace the planner holds (ask again with ``after=seq``)."""
    base_model: str
    placement: str
    placement_params: dict[str, Any]
    nodes: tuple[NodeView, ...]
    reported_at: tuple[float, ...]
    traces: tuple[ExecutionTrace, ...] = ()
    training: tuple[TrainingPlacement, ...] = ()
    """The training steps placed now (granted, not yet done): a router commits each in its own policy,
    so its inference forwards are planned past their backwards (LEMIX Alg. 1 lines 7–14), and forgets
    each once it is gone from here."""


@dataclass(frozen=True)
class NewFeedback:
    """A feedback item about to be stored, as the planner places it (``training.scope: per_node``)."""

    adapter: str | None
    """None: the item names no adapter (the store rejects it; it needs no node)."""
    tokens: int
    """ℓ of its training task: the tokens of one pass over it (DPO: chosen and rejected sequences)."""


# ---- messages between the trainer and the planner actor -----------------------------------------

PassOutcome = Literal["requeued", "retired"]


@dataclass(frozen=True)
class PassReport:
    """The trainer's report of one finished training pass over a feedback item (MACE Alg. 1 lines 17–21).

    ``loss`` is the item's own loss in that pass: the DPO loss −log σ(β·(Δ⁺ − Δ⁻)) for a
    preference pair, the mean token NLL of its completion for an SFT sample. It is MACE §4.1's
    L_DPO, the γ·L_DPO term of the item's next priority and the value CheckEnd compares with the
    threshold.
    """

    sample_id: int
    """The feedback item's id."""
    tokens: int
    """L, the tokens of one pass over the item (DPO: chosen + rejected)."""
    loss: float
    arrival: float
    """t_arr of this pass: the item's acceptance time, or when CheckEnd last requeued it."""
    passes_before: int = 0
    """Passes over the item finished before this one (0 on its first)."""


@dataclass(frozen=True)
class PassVerdict:
    """The planner's CheckEnd answer to a :class:`PassReport`: train the item again, or it is done.

    ``requeued``: its loss is still above the threshold and it has run fewer than the allowed
    passes; the next pass starts afresh with t_arr = ``arrival`` and ``loss`` in its priority.
    ``retired``: the item is trained; the version that holds its last pass marks it consumed.
    """

    sample_id: int
    outcome: PassOutcome
    passes: int
    """Passes finished so far, this one included."""
    loss: float
    arrival: float


# ---- grants: the trainer asks, the planner answers (LEMIX Alg. 2, FlexLLM §6.2, MACE §4.1) -------------


@dataclass(frozen=True)
class SampleProgress:
    """One unfinished sample of a trainer's micro-step, as the trainer reports it when it asks for a grant."""

    sample_id: int
    tokens: int
    """L, the tokens of one pass over the sample (DPO: chosen + rejected)."""
    done: int
    """Tokens of this pass already run (its windows so far)."""
    arrival: float
    """t_arr: the item's acceptance time, or when CheckEnd last requeued it."""
    last_loss: float = 0.0
    """The item's loss in its previous pass (MACE §4.1's γ·L_DPO term); 0 before its first."""


@dataclass(frozen=True)
class MemoryUse:
    """What the windows of a trainer's previous grant really added to its device memory (LEMIX Alg. 2, lines 13–17).

    On a GPU: ``torch.cuda.max_memory_allocated`` during the windows less the allocation before
    them. On a CPU, which has no allocator peak: the process's resident set after the windows less
    before them (a lower bound of the peak).
    """

    batch_size: int
    tokens: int
    """The longest window's tokens."""
    added_bytes: float


@dataclass(frozen=True)
class GrantRequest:
    """Which token windows may the trainer on ``node_id`` run now for ``adapter``'s ``samples``?"""

    node_id: int
    adapter: str
    mode: str
    """The adapter's training mode (``hybrid``, ``periodic``, ...): who decides the grant."""
    samples: tuple[SampleProgress, ...]
    ran_s: float = 0.0
    """Seconds the windows of the previous grant on this node took to run (0: none ran)."""
    memory: MemoryUse | None = None
    """Measured memory of the previous grant's windows (None: none ran), to calibrate the memory guard."""
    optimizer_bytes: float = 0.0
    """Bytes of optimizer state on the device that offloading would free (0 on a CPU, or already offloaded)."""


@dataclass(frozen=True)
class GrantedWindow:
    """Run tokens [start, end) of the sample's current pass."""

    sample_id: int
    start: int
    end: int


@dataclass(frozen=True)
class Grant:
    """The planner's answer to a :class:`GrantRequest`: windows to run now, in order, or none and how long to wait."""

    windows: tuple[GrantedWindow, ...]
    wait_s: float
    reason: str
    offload_optimizer: bool = False
    """LEMIX Alg. 2's offload: move the optimizer state to host memory before running the windows."""
