"""What the feedback store hands out: versions, adapters with their state, what is served, queued items, receipts,
and the typed verdicts and scores a trainer hands in about a version."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from actors.learning.store.models import ADAPTER_KEY_RE, AdapterSpec, Kind, VersionState
from settings import GateSettings


class VersionInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    adapter: str
    version: int
    parent: int | None = Field(description="The current version when this one was reserved (its starting weights).")
    path: str | None
    created_at: float
    published: bool
    published_at: float | None
    samples_trained: int | None
    loss: float | None
    win_rate: float | None = Field(description="dpo: held-out win rate (MACE §3.1) of this version.")
    clpd: float | None = Field(description="dpo: held-out CLPD, mean log π(chosen) - log π(rejected).")
    node: int | None = Field(None, description="per_node scope: the node whose copy this version is; None: synced.")
    state: VersionState | None = Field(
        None,
        description="candidate (waiting for the quality gate), served (passed it, or promoted; the one "
        "served now is current_version), rejected (kept, never served unless promoted), "
        "rolled_back (was served until a rollback or promotion went back past it); None: reserved.",
    )
    reason: str | None = Field(None, description="Why the version is in its state, e.g. the gate's comparison.")
    score: float | None = Field(None, description="The gated score: win_rate (dpo) or token_logprob (sft).")
    baseline_version: int | None = Field(
        None, description="The version the gate compared with (None with a baseline_score: the base model)."
    )
    baseline_score: float | None = Field(None, description="That version's score on the same held-out items.")
    token_logprob: float | None = Field(None, description="sft: mean log-likelihood per held-out completion token.")
    eval_items: int | None = Field(None, description="Held-out items (or eval_file pairs) the scores are over.")
    decided_at: float | None = Field(None, description="When the gate (or a promotion) decided the state.")
    retention: float | None = Field(
        None,
        description="How well this version keeps the base model's answers to the retention set: mean "
        "log-likelihood per answer token (higher is better; the gate rejects a loss of more than "
        "gate.retention_margin against retention_base).",
    )
    retention_base: float | None = Field(None, description="The base model's own score of those answers.")
    retention_prompts: int | None = Field(None, description="Prompts of the retention set the scores are over.")
    score_s: float | None = Field(
        None,
        description="Seconds the gate spent scoring this version (held-out slice "
        "and retention set; the base's scores are cached).",
    )


class AdapterInfo(AdapterSpec):
    """An adapter with its state, the shape of ``GET /v1/adapters/{name}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        pattern=ADAPTER_KEY_RE.pattern,
        description="The store's key (adapter_key): tenant/name for a tenant's adapter. The HTTP layer "
        "shows a tenant its own adapters by their bare names.",
    )

    created_at: float
    current_version: int | None
    versions: list[VersionInfo] = Field(description="Published versions in every state, oldest first.")
    queued: int = Field(description="Feedback items no published version has trained on yet (held-out ones excluded).")
    oldest_queued_at: float | None
    last_published_at: float | None
    node_versions: dict[int, int] = Field(
        default_factory=dict, description="per_node scope: the version each node serves; empty when synced."
    )
    gate: GateSettings = Field(
        default_factory=GateSettings,
        description="The quality-gate settings in effect: the adapter's own over training.gate.",
    )
    held_out: int = Field(0, description="Feedback items kept out of training as the adapter's held-out slice.")
    rejections_in_row: int = Field(0, description="Versions the gate rejected since the last one it served.")
    paused_reason: str | None = Field(
        None, description="Why training is paused (too many rejections in a row, or a PATCH); None: not paused."
    )
    promotions: int = Field(0, description="Versions served by the gate or a promotion, since creation.")
    rejections: int = Field(0, description="Versions the gate rejected, since creation.")
    trained_on_policy: int = Field(
        0, description="Trained items whose answer came from the version the training started from (on-policy)."
    )
    trained_off_policy: int = Field(
        0, description="Trained items whose answer came from another version (older, or the base): off-policy."
    )
    on_policy_share: float | None = Field(
        None, description="trained_on_policy over both; null until an item whose answering version is known trained."
    )


@dataclass(frozen=True, slots=True)
class ServedVersion:
    """A version a node must serve, and where its files are."""

    version: int
    path: str


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """What the store says an adapter serves: its current version (synced) and each node's (per_node)."""

    method: str
    current: ServedVersion | None
    nodes: dict[int, ServedVersion]


@dataclass(frozen=True, slots=True)
class ServedState:
    """Every adapter's served versions as of the store's served-change number ``change`` (the planner follows it)."""

    change: int
    adapters: dict[str, ServedAdapter]


@dataclass(frozen=True, slots=True)
class VersionWritten:
    """A version as a write left it, and the store's served-change number after that write: the planner serves
    the write once it has followed that number (``Planner.load_adapter``)."""

    info: VersionInfo
    served_change: int


@dataclass(frozen=True, slots=True)
class VersionScores:
    """What the gate (or a scoring of a version served without it) measured; None: not measured."""

    score: float | None = None
    win_rate: float | None = None
    clpd: float | None = None
    token_logprob: float | None = None
    eval_items: int | None = None
    retention: float | None = None
    retention_base: float | None = None
    retention_prompts: int | None = None
    score_s: float | None = None


@dataclass(frozen=True, slots=True)
class VersionVerdict:
    """The quality gate's verdict on a candidate: served (``passed``) or rejected, why, and against what.

    ``counts`` False: held back for want of evidence, not a rejection of its quality (no count toward a pause)."""

    passed: bool
    reason: str
    scores: VersionScores = VersionScores()
    baseline_version: int | None = None
    baseline_score: float | None = None
    counts: bool = True


@dataclass(frozen=True, slots=True)
class UploadMeta:
    """What an uploaded version's ``meta.json`` says of where it came from (``POST /v1/adapters/{name}/versions``)."""

    source: str
    base_model_name_or_path: str | None
    r: int | None
    lora_alpha: float | None
    modules: list[str]
    uploaded_by: str | None
    uploaded: bool = True


@dataclass(frozen=True, slots=True)
class FeedbackReceipt:
    """What storing a feedback batch gave: the ids in item order, and whether they are the stored answer
    of an earlier request with the same idempotency key (then nothing new was stored)."""

    ids: list[int]
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class FeedbackItem:
    """A stored feedback row as the trainer sees it."""

    id: int
    adapter: str
    kind: Kind
    prompt: str | None  # None when the context is chat messages
    completion: str | None
    chosen: str | None
    rejected: str | None
    created_at: float
    messages: tuple[dict[str, str], ...] | None = None
    label: bool | None = None  # kind 'label': True a thumbs-up (desirable), False a thumbs-down

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> FeedbackItem:
        """From the columns of ``ITEM_COLUMNS`` (a chat item stores '' as its prompt and its turns as JSON)."""
        (id_, adapter, kind, prompt, completion, chosen, rejected, created_at, messages, label) = row
        turns = None if messages is None else tuple(json.loads(messages))
        return cls(
            id_,
            adapter,
            kind,
            prompt if turns is None else None,
            completion,
            chosen,
            rejected,
            created_at,
            turns,
            None if label is None else bool(label),
        )
