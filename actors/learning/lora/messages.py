"""What the LoRA driver and its ranks send each other: one typed message per phase of a step (as vLLM v1's engine-core messages)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actors.learning.messages import GrantedWindow, MemoryUse, PassVerdict
from actors.learning.store.models import LoraSettings


@dataclass(frozen=True)
class TrainingSpec:
    """An adapter's training settings as a trainer rank uses them (from the feedback store)."""

    name: str
    method: str
    """``sft`` or ``dpo``."""
    beta: float
    mode: str
    learning_rate: float
    lora: LoraSettings
    """The LoRA settings (r, alpha, dropout, target_modules)."""
    paused: bool
    tenant: str | None = None
    """The tenant that owns the adapter (None: made without keys): training turns rotate across tenants."""
    warmup_steps: int = 0
    """Optimizer steps of linear learning-rate warm-up (the adapter's own step count, across versions)."""


@dataclass(frozen=True)
class StepPlan:
    """The driver's decision for one micro-step, sent to every rank of a lane: train ``items`` on ``adapter``,
    starting from its version ``target``; each rank takes its contiguous share of ``items``."""

    adapter: str
    spec: TrainingSpec
    target: tuple[int | None, str | None]
    """The adapter's current version and where its files are (None, None: a fresh LoRA)."""
    items: tuple[Any, ...]
    """The micro-step's feedback items (``actors.learning.store.records.FeedbackItem``)."""
    last_of_queue: bool = False
    """No more items wait: apply the gradients and publish after this step."""
    requeued: dict[int, PassVerdict] = field(default_factory=dict)
    """Items CheckEnd sent back: their t_arr and last loss go into the grants' priorities (MACE §4.1)."""

    def arrival(self, item: Any) -> float:
        """t_arr of the item's pass in this micro-step (MACE §4.1): when CheckEnd requeued it, else its acceptance."""
        again = self.requeued.get(item.id)
        return item.created_at if again is None else again.arrival

    def last_loss(self, item: Any) -> float:
        """L_DPO of MACE §4.1's γ·L_DPO priority term: the item's loss in its previous pass (0 before its first)."""
        again = self.requeued.get(item.id)
        return 0.0 if again is None else again.loss

    def passes_before(self, item: Any) -> int:
        """How many passes over the item CheckEnd has seen (0 before its first)."""
        again = self.requeued.get(item.id)
        return 0 if again is None else again.passes


@dataclass(frozen=True)
class StepBegun:
    """A rank's answer to a :class:`StepPlan`: the tokens of one pass over each of its items, or the adapter's fault."""

    lengths: dict[int, int]
    """Item id -> the work of one pass in tokens, 2·L (forward, then backward), for the rank's share."""
    optimizer_bytes: float = 0.0
    """Bytes of optimizer state on the device that offloading would free (0 on a CPU)."""
    fault: str | None = None
    """The adapter's version could not be loaded or its items not encoded: the driver pauses the adapter."""
    forward_lengths: dict[int, int] = field(default_factory=dict)
    """Item id -> L, the item's stream tokens (DPO: chosen + rejected): the forward part of ``lengths``."""


@dataclass(frozen=True)
class RoundPlan:
    """Token windows the planner granted on the rank's node, to run now in order (FlexLLM §6.1)."""

    windows: tuple[GrantedWindow, ...]
    offload_optimizer: bool = False
    """LEMIX Alg. 2 lines 9–11: move the optimizer state to host memory before running the windows."""


@dataclass(frozen=True)
class ItemLoss:
    """One item's finished pass: its own loss and its weight in the micro-step's mean (SFT: its loss tokens)."""

    loss: float
    weight: float


@dataclass(frozen=True)
class RoundDone:
    """What a rank's windows did: how far each item is, the items they finished, and what they cost."""

    done: dict[int, int]
    """Item id -> tokens of this pass run so far."""
    finished: dict[int, ItemLoss]
    windows: int
    """Windows run (a stale one is skipped)."""
    ran_s: float
    memory: MemoryUse | None
    optimizer_bytes: float = 0.0
    fault: str | None = None
    ran_at: float = 0.0
    """Wall time the first window started."""
    forward_s: float = 0.0
    """Of ``ran_s``, the seconds in forward windows; the rest went to backward work."""


@dataclass(frozen=True)
class VersionMeta:
    """What a published version's ``meta.json`` says of how it was trained."""

    parent: int | None
    samples_trained: int
    loss: float
    items: int
    scope: str
    world_size: int
    node: int | None


@dataclass(frozen=True)
class SaveVersion:
    """Rank 0: write the adapter's weights as ``version`` and make them readable from every node."""

    adapter: str
    version: int
    meta: VersionMeta


@dataclass(frozen=True)
class ScoreRequest:
    """Score one version (``path`` None: the base model) on held-out items; the rank answers each item's own score."""

    adapter: str
    version: int | None
    path: str | None
    lora: LoraSettings
    method: str
    items: tuple[Any, ...]
    answer_field: str
    """SFT: which field of an item is the completion scored ("completion", or "chosen" of an eval-file pair)."""


@dataclass(frozen=True)
class RetentionSetRequest:
    """Rank 0: the retention set of a prompt file, with the base model's greedy answers and its scores of them
    (built and cached beside the model on first use: actors/learning/lora/retention.py)."""

    file: str
    name: str
    """How reasons call the set ("the shipped set", or the adapter's file as it named it)."""


@dataclass(frozen=True)
class RetentionScoreRequest:
    """Rank 0: score one version (``path`` None: the base model) on a retention set's answers; each item's
    (log-likelihood sum, tokens)."""

    adapter: str
    version: int | None
    path: str | None
    lora: LoraSettings
    items: tuple[Any, ...]
    """``actors.learning.lora.retention.RetentionItem``s."""


# ---- what the ranks and drivers tell the Trainer supervisor (for /v1/status and the metrics) ----------


@dataclass(frozen=True)
class RankStarted:
    """A trainer rank tells the Trainer where it runs: its node's placement group (bundle 0) and its device."""

    rank: int
    node_id: int  # the logical node whose replica shares its bundle
    pid: int
    ray_node_id: str
    placement_group_id: str | None
    device: str  # cpu | cuda
    dtype: str  # the base weights' dtype


@dataclass(frozen=True)
class StepDone:
    """A micro-step finished: ``samples`` items, their mean loss, the tokens run as ``windows`` grants."""

    samples: int
    loss: float
    tokens: int
    seconds: float
    """Time spent running windows."""
    grant_s: float
    """Time spent asking for grants and waiting on them."""
    windows: int
    shrunk: bool
    """Some sample ran as more than one window (the grant was smaller than the sample)."""
    optimizer_step: bool
    requeued: int
    """Items CheckEnd sent back for another pass."""


@dataclass(frozen=True)
class GrantWaited:
    """A micro-step waited ``seconds`` in total for grants."""

    seconds: float


@dataclass(frozen=True)
class WorkDropped:
    """Unpublished training was dropped because the adapter's current version moved (a rollback)."""


@dataclass(frozen=True)
class StepAbandoned:
    """A micro-step was dropped mid-way (stop, or the adapter's mode became ``off``); its items stay queued."""


@dataclass(frozen=True)
class VersionPublished:
    """A version was written and recorded; ``candidate``: it waits for the quality gate before it is served."""

    version: int
    at: float
    seconds: float
    breakdown: dict[str, float]
    """Seconds per publish phase: reserve_s, save_s, publish_s and (served at once) load_s."""
    freshness_s: tuple[float, ...] = ()
    """Per item it holds: seconds from the item's acceptance to the version being loaded."""
    candidate: bool = False


@dataclass(frozen=True)
class VersionScored:
    """Held-out scores of a version served without the gate."""

    version: int
    seconds: float
    win_rate: float | None = None
    clpd: float | None = None
    token_logprob: float | None = None


@dataclass(frozen=True)
class GateDecided:
    """The quality gate's verdict on a candidate version (``served`` or ``rejected``)."""

    version: int
    state: str
    reason: str | None
    score: float | None
    baseline_score: float | None
    baseline_version: int | None
    seconds: float
    at: float
    freshness_s: tuple[float, ...] = ()
    win_rate: float | None = None
    clpd: float | None = None
    token_logprob: float | None = None
    retention: float | None = None
    """The candidate's retention score (mean log-likelihood per token of the base's answers); None: not scored."""
    retention_base: float | None = None
    retention_s: float | None = None
    """Seconds the retention scoring of this version took (the base's scores are cached)."""


TrainerEvent = StepDone | GrantWaited | WorkDropped | StepAbandoned | VersionPublished | VersionScored | GateDecided
