"""What the feedback store accepts and returns: adapter specs, feedback items, version records, errors, validation.

Plain pydantic models and functions, no SQLite: the HTTP layer (``deployments/learning.py``,
``deployments/openapi.py``) validates and documents requests with them, and
``actors/learning/store/sqlite.py`` stores and returns them.

Why one module of about 600 lines: these are the store's whole wire vocabulary (specs, items, versions,
errors) that the HTTP layer and the store must read alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from settings import ADMIN_TENANT, MAX_COUNT, GateSettings

# Feedback as a client sent it (one item or a list; each a JSON object), before validate_feedback checks it.
RawItems: TypeAlias = Sequence[Mapping[str, Any]] | Mapping[str, Any]

ADAPTER_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
TENANT_NAME_RE = ADAPTER_NAME_RE  # deployments/keys.py's TENANT_RE: the same shape
# The store's key of an adapter: ``tenant/name`` for a tenant's adapter, the bare name for one without a
# tenant (local mode) or the admin's (adapter_key). Neither part may hold a '/', so a key splits one way.
ADAPTER_KEY_RE = re.compile(r"^(?:[a-z0-9][a-z0-9_-]{0,63}/)?[a-z0-9][a-z0-9_-]{0,63}$")
DEFAULT_MAX_ITEM_BYTES = 32 * 1024
DEFAULT_MAX_BATCH_ITEMS = 1024
MAX_IDEMPOTENCY_KEY_CHARS = 255  # as Stripe's: room for a UUID or a client's own request id, not for a payload

Method = Literal["sft", "dpo", "kto", "full_sft", "full_dpo"]
Mode = Literal["hybrid", "sync", "periodic", "off"]
Kind = Literal["sft", "preference", "label"]
VersionState = Literal["candidate", "served", "rejected", "rolled_back"]
# Which feedback kind each training method consumes. A DPO adapter takes only preference pairs:
# an SFT sample has no rejected answer to contrast, and one loss per adapter keeps the queue,
# the grant budget and the reported loss of a version meaningful. An SFT adapter takes only SFT samples.
# A full unit (full_sft, full_dpo) trains every weight of the served model itself, through the same feedback.
# A KTO adapter (Ethayarajh et al. 2024) takes unpaired labels: one answer marked desirable (up) or not (down).
KIND_FOR_METHOD: dict[str, str] = {"sft": "sft", "dpo": "preference", "kto": "label", "full_sft": "sft",
                                   "full_dpo": "preference"}
METHOD_TAKES = {"dpo": "preference pairs (prompt, chosen, rejected)", "sft": "SFT samples (prompt, completion)",
                "kto": "labels (prompt, completion, label up/down; or completion_id and rating)",
                "full_dpo": "preference pairs (prompt, chosen, rejected)", "full_sft": "SFT samples (prompt, completion)"}
KIND_NAMES = {"sft": "an SFT sample", "preference": "a preference pair", "label": "a label (rating)"}
RATINGS = {"up": True, "down": False}


def adapter_key(tenant: str | None, name: str) -> str:
    """The store's key of adapter ``name`` owned by ``tenant``: ``tenant/name``, so that two tenants may each own
    ``support``; the bare name for an adapter without a tenant (made without API keys) or the admin's own."""
    return name if tenant is None or tenant == ADMIN_TENANT else f"{tenant}/{name}"


def split_adapter_key(key: str) -> tuple[str | None, str]:
    """(the tenant the key scopes the name to, or None; the name): the inverse of :func:`adapter_key`."""
    tenant, sep, name = key.partition("/")
    return (tenant, name) if sep else (None, key)


# ----------------------------------------------------------------------------------------------
# Errors: each carries the HTTP status and the OpenAI-style error type the ingress should use.


class StoreError(Exception):
    """A refusal of the store's: the HTTP layer (deployments/learning.py) answers each kind with its status."""

    param: str | None = None  # the request field at fault, the OpenAI error's ``param``


class InvalidRequest(StoreError):
    """Malformed input. ``errors`` lists every problem found, e.g. ``items[3].chosen: Field required``."""

    def __init__(self, errors: str | list[str], param: str | None = None):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        if param is not None:
            self.param = param
        shown = self.errors[:10]
        more = f"; ... and {len(self.errors) - len(shown)} more" if len(self.errors) > len(shown) else ""
        super().__init__("; ".join(shown) + more)


class UnknownAdapter(StoreError):
    """No adapter of that name."""


class UnknownVersion(StoreError):
    """The adapter has no version of that number."""


class Conflict(StoreError):
    """The request is well-formed but clashes with the stored state."""


class AdapterExists(Conflict):
    pass


class FullUnitExists(Conflict):
    """A second full_sft/full_dpo unit: there is one served model, so at most one full unit trains it."""


class VersionConflict(Conflict):
    pass


class UnknownItem(StoreError):
    """No feedback item of that id."""


class AdapterQuotaExceeded(StoreError):
    """The owning tenant has ``limits.adapters_per_tenant`` adapters already (HTTP 403: waiting does not help)."""


class TrainingQuotaExceeded(StoreError):
    """The tenant's feedback today would pass ``limits.training_tokens_per_day`` (HTTP 429, Retry-After: the
    seconds until the next UTC day, when the allowance starts again)."""

    param = "items"

    def __init__(self, message: str, retry_after_s: int):
        self.retry_after_s = retry_after_s
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray as itself, with its Retry-After
        return (type(self), (str(self), self.retry_after_s))


class IdempotencyKeyReused(StoreError):
    """An ``Idempotency-Key`` sent again within its lifetime with other feedback items (HTTP 422)."""

    param = "Idempotency-Key"


# ----------------------------------------------------------------------------------------------
# Validated inputs.


class _Strict(BaseModel):
    # No inf/NaN: they would be stored, then fail to encode as JSON in every later answer. strict: no coercion,
    # so a JSON string "8" or "0.1" (or a float 8.0 for an integer, 1 or "true" for a boolean) is a client error
    # naming its field, never a number or a flag (an integer is still taken where a float is meant).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output head


class LoraSettings(_Strict):
    r: int = Field(8, ge=1, le=256,
                   description="LoRA rank, an integer (must not exceed the engine's max_lora_rank).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / r.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "v_proj"],
        description="Default \"all-linear\" for an sft adapter (measured), [\"q_proj\", \"v_proj\"] otherwise. Module names of the served model, matched as peft does (a module whose name is this or ends "
                    "with '.' and this), or \"all-linear\" (peft's: every linear layer but the output head).")
    dropout: float = Field(0.0, ge=0, lt=1)

    @field_validator("target_modules", mode="before")
    @classmethod
    def _list_or_all_linear(cls, v: Any) -> Any:
        if not isinstance(v, list) and v != ALL_LINEAR:
            raise ValueError(f"expected a list of module names, or \"{ALL_LINEAR}\"")
        return v

    @field_validator("target_modules")
    @classmethod
    def _module_names(cls, v: list[str] | str) -> list[str] | str:
        if v == [ALL_LINEAR]:
            return ALL_LINEAR  # peft takes the shorthand only as a string; a list would name a module "all-linear"
        if isinstance(v, str):
            return v
        if not v:
            raise ValueError("name at least one module, or \"all-linear\"")
        bad = [m for m in v if not re.fullmatch(r"[A-Za-z0-9_.]{1,128}", m)]
        if bad:
            raise ValueError(f"not module names: {bad}")
        return v


class PeriodicSettings(_Strict):
    every_seconds: float | None = Field(60.0, gt=0, description="Train every T seconds (Ekya-like).")
    every_samples: int | None = Field(None, gt=0, le=MAX_COUNT, description="... or as soon as K samples are queued.")


class GateOverrides(_Strict):
    """An adapter's own gate settings; a field left null follows the app's default (``training.gate``)."""

    enabled: bool | None = None
    margin: float | None = Field(None, ge=0)
    held_out_share: float | None = Field(None, ge=0, le=0.5)
    pause_after_rejections: int | None = Field(None, ge=0, le=MAX_COUNT)
    max_eval_items: int | None = Field(None, gt=0, le=MAX_COUNT)
    retention: bool | None = None
    retention_file: str | None = Field(
        None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_./-]*$",
        description="The adapter's must-not-break prompts: a JSONL file under the app's data_dir (a relative path, "
                    "no '..'), one {\"prompt\"} or {\"messages\"} per line.")
    retention_margin: float | None = Field(None, ge=0)
    thin_evidence: Literal["serve", "wait"] | None = None

    @field_validator("retention_file")
    @classmethod
    def _inside_data_dir(cls, v: str | None) -> str | None:
        # A tenant names a file of the server's: only under data_dir, so no other file can be read.
        if v is not None and ".." in v.split("/"):
            raise ValueError("a path relative to the app's data_dir, without '..'")
        return v

    def over(self, defaults: GateSettings) -> GateSettings:
        """The effective settings: these overrides on top of ``defaults``."""
        return defaults.model_copy(update=self.model_dump(exclude_none=True))


# Per-method training defaults, chosen by measurement (docs/benchmarks.md, "Learning quality: the sweep and the
# defaults (issue 37)"). For sft on the default model, 5e-4 on q_proj,v_proj never taught an opening phrase to
# unseen prompts within 64 items; 2e-3 on every linear layer shows it on all of them after 32 items, and a warm-up
# of 4 optimizer steps still does while a few items (the first steps) move the model half as far. dpo at the field
# defaults below (5e-4, q_proj,v_proj) showed no gain from 256 HH-RLHF pairs; no other setting was measured, so it
# keeps them. A field the client sets is never overridden.
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    "sft": {"learning_rate": 2e-3, "target_modules": "all-linear", "warmup_steps": 4},
}


class AdapterSpec(_Strict):
    """What ``POST /v1/adapters`` takes."""

    @model_validator(mode="before")
    @classmethod
    def _method_defaults(cls, data: Any) -> Any:
        # Before validation, so a stored or PATCHed spec (which carries every field) keeps its values.
        if not isinstance(data, Mapping):
            return data
        defaults = METHOD_DEFAULTS.get(data.get("method", "sft") if isinstance(data.get("method", "sft"), str)
                                       else "", {})
        if not defaults:
            return data
        out = dict(data)
        for field in ("learning_rate", "warmup_steps"):
            if field in defaults and field not in out:
                out[field] = defaults[field]
        if "target_modules" in defaults:
            lora = out.get("lora")
            if lora is None and "lora" not in out:
                out["lora"] = {"target_modules": defaults["target_modules"]}
            elif isinstance(lora, Mapping) and "target_modules" not in lora:
                out["lora"] = {**lora, "target_modules": defaults["target_modules"]}
        return out

    name: str = Field(pattern=ADAPTER_NAME_RE.pattern)
    tenant: str | None = Field(None, pattern=TENANT_NAME_RE.pattern,
                               description="The tenant that owns the adapter: the creating key's (an admin may name "
                                           "another); null when the app runs without keys.")
    method: Method = "sft"
    beta: float = Field(0.1, gt=0, description="DPO temperature β (stored, unused by SFT).")
    learning_rate: float = Field(5e-4, gt=0, le=1, description="Peak learning rate; default 2e-3 for sft (measured), "
                                                               "5e-4 for the other methods.")
    lora: LoraSettings = Field(default_factory=LoraSettings)
    mode: Mode = "hybrid"
    periodic: PeriodicSettings = Field(default_factory=PeriodicSettings)
    gate: GateOverrides = Field(default_factory=GateOverrides,
                                description="This adapter's quality-gate settings; unset fields follow training.gate.")
    warmup_steps: int = Field(
        0, ge=0, le=10_000, description="Optimizer steps over which the learning rate rises linearly to "
                                        "learning_rate (the adapter's own count, kept across versions; 0: none). "
                                        "Default 4 for sft (measured), 0 for the other methods.")
    epochs: int = Field(
        1, ge=1, le=100, description="Passes over each feedback item, each in a different version: an item stays "
                                     "queued until this many published versions trained on it (new items go first).")
    store_completions: bool = Field(
        False, description="Store every chat or completion request to this adapter, as \"store\": true does, so "
                           "that feedback can name its completion_id.")

    @model_validator(mode="after")
    def _periodic_has_trigger(self) -> AdapterSpec:
        if self.mode == "periodic" and self.periodic.every_seconds is None and self.periodic.every_samples is None:
            raise ValueError("mode 'periodic' needs periodic.every_seconds or periodic.every_samples")
        return self


def _text(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be blank")
    return v


class ChatTurn(_Strict):
    """One message of a conversation, as in OpenAI's chat and fine-tuning formats."""

    role: Literal["system", "user", "assistant"]
    content: str = Field(min_length=1)


class _Prompted(_Strict):
    """An item's context: a raw ``prompt`` text, or chat ``messages`` that the trainer renders with
    the served model's chat template, so that what is trained is what is served."""

    adapter: str = Field(min_length=1)
    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatTurn] | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _one_context(self) -> _Prompted:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt (raw text) or messages (a chat), not both or neither")
        if self.messages is not None and self.messages[-1].role == "assistant":
            raise ValueError("messages must end with a user (or system) turn; the answer goes in "
                             "completion, or chosen and rejected")
        return self

    @field_validator("prompt")
    @classmethod
    def _nonblank_prompt(cls, v: str | None) -> str | None:
        return v if v is None else _text(v)

    def context_texts(self) -> tuple[str, ...]:
        return (self.prompt,) if self.prompt is not None else tuple(m.content for m in self.messages or ())

    def messages_json(self) -> str | None:
        return None if self.messages is None else json.dumps([m.model_dump() for m in self.messages])


class SFTItem(_Prompted):
    """One supervised sample: train the adapter to answer the context with ``completion``."""

    completion: str = Field(min_length=1)

    _nonblank = field_validator("completion")(_text)

    @property
    def kind(self) -> Kind:
        return "sft"

    def texts(self) -> tuple[str, ...]:
        return (*self.context_texts(), self.completion)


class LabelItem(_Prompted):
    """One unpaired label (KTO): ``completion`` answered the context well (``label`` true: a thumbs-up) or not."""

    completion: str = Field(min_length=1)
    label: bool

    _nonblank = field_validator("completion")(_text)

    @property
    def kind(self) -> Kind:
        return "label"

    def texts(self) -> tuple[str, ...]:
        return (*self.context_texts(), self.completion)


class PreferenceItem(_Prompted):
    """One preference pair: ``chosen`` is the better answer to the context than ``rejected``."""

    chosen: str = Field(min_length=1)
    rejected: str = Field(min_length=1)

    _nonblank = field_validator("chosen", "rejected")(_text)

    @property
    def kind(self) -> Kind:
        return "preference"

    def texts(self) -> tuple[str, ...]:
        return (*self.context_texts(), self.chosen, self.rejected)


# ----------------------------------------------------------------------------------------------
# Records handed out.


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
        None, description="candidate (waiting for the quality gate), served (passed it, or promoted; the one "
                          "served now is current_version), rejected (kept, never served unless promoted), "
                          "rolled_back (was served until a rollback or promotion went back past it); None: reserved.")
    reason: str | None = Field(None, description="Why the version is in its state, e.g. the gate's comparison.")
    score: float | None = Field(None, description="The gated score: win_rate (dpo) or token_logprob (sft).")
    baseline_version: int | None = Field(
        None, description="The version the gate compared with (None with a baseline_score: the base model).")
    baseline_score: float | None = Field(None, description="That version's score on the same held-out items.")
    token_logprob: float | None = Field(None, description="sft: mean log-likelihood per held-out completion token.")
    eval_items: int | None = Field(None, description="Held-out items (or eval_file pairs) the scores are over.")
    decided_at: float | None = Field(None, description="When the gate (or a promotion) decided the state.")
    retention: float | None = Field(
        None, description="How well this version keeps the base model's answers to the retention set: mean "
                          "log-likelihood per answer token (higher is better; the gate rejects a loss of more than "
                          "gate.retention_margin against retention_base).")
    retention_base: float | None = Field(None, description="The base model's own score of those answers.")
    retention_prompts: int | None = Field(None, description="Prompts of the retention set the scores are over.")
    score_s: float | None = Field(None, description="Seconds the gate spent scoring this version (held-out slice "
                                                    "and retention set; the base's scores are cached).")


class AdapterInfo(AdapterSpec):
    """An adapter with its state, the shape of ``GET /v1/adapters/{name}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=ADAPTER_KEY_RE.pattern,
                      description="The store's key (adapter_key): tenant/name for a tenant's adapter. The HTTP layer "
                                  "shows a tenant its own adapters by their bare names.")

    created_at: float
    current_version: int | None
    versions: list[VersionInfo] = Field(description="Published versions in every state, oldest first.")
    queued: int = Field(description="Feedback items no published version has trained on yet (held-out ones excluded).")
    oldest_queued_at: float | None
    last_published_at: float | None
    node_versions: dict[int, int] = Field(
        default_factory=dict, description="per_node scope: the version each node serves; empty when synced.")
    gate: GateSettings = Field(default_factory=GateSettings,
                               description="The quality-gate settings in effect: the adapter's own over training.gate.")
    held_out: int = Field(0, description="Feedback items kept out of training as the adapter's held-out slice.")
    rejections_in_row: int = Field(0, description="Versions the gate rejected since the last one it served.")
    paused_reason: str | None = Field(
        None, description="Why training is paused (too many rejections in a row, or a PATCH); None: not paused.")
    promotions: int = Field(0, description="Versions served by the gate or a promotion, since creation.")
    rejections: int = Field(0, description="Versions the gate rejected, since creation.")
    trained_on_policy: int = Field(
        0, description="Trained items whose answer came from the version the training started from (on-policy).")
    trained_off_policy: int = Field(
        0, description="Trained items whose answer came from another version (older, or the base): off-policy.")
    on_policy_share: float | None = Field(
        None, description="trained_on_policy over both; null until an item whose answering version is known trained.")


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
        return cls(id_, adapter, kind, prompt if turns is None else None, completion, chosen, rejected,
                   created_at, turns, None if label is None else bool(label))


# ----------------------------------------------------------------------------------------------
# Validation of feedback batches (pure: no database).


def idempotency_key_problem(key: str) -> str | None:
    """Why ``key`` cannot be an ``Idempotency-Key`` (None: it can): 1 to 255 printable ASCII characters."""
    if not isinstance(key, str) or not key:
        return "Idempotency-Key: must not be empty"
    if len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        return f"Idempotency-Key: {len(key)} characters, at most {MAX_IDEMPOTENCY_KEY_CHARS}"
    if not all(" " <= c <= "~" for c in key):
        return "Idempotency-Key: only printable ASCII characters"
    return None


def validate_feedback(
    items: Sequence[Mapping[str, Any]] | Mapping[str, Any], max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES,
    max_items: int = DEFAULT_MAX_BATCH_ITEMS,
) -> list[SFTItem | PreferenceItem | LabelItem]:
    """Validate every item of a batch; raise :class:`InvalidRequest` listing each bad item by index."""
    if isinstance(items, Mapping):
        items = [items]
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise InvalidRequest("items: expected a list of feedback items")
    if not items:
        raise InvalidRequest("items: the list is empty")
    if len(items) > max_items:
        raise InvalidRequest(f"items: {len(items)} items, at most {max_items} per request")
    parsed, errors = [], []
    for i, raw in enumerate(items):
        try:
            parsed.append(_parse_item(raw, f"items[{i}]", max_item_bytes))
        except InvalidRequest as e:
            errors.extend(e.errors)
    if errors:
        raise InvalidRequest(errors)
    return parsed


def _parse_item(raw: Any, where: str, max_bytes: int) -> SFTItem | PreferenceItem | LabelItem:
    if isinstance(raw, BaseModel):
        raw = raw.model_dump()
    if not isinstance(raw, Mapping):
        raise InvalidRequest(f"{where}: expected an object, got {type(raw).__name__}")
    raw = _split_final_answer(raw)
    if "label" in raw:
        return _sized(_validated(LabelItem, raw, where), where, max_bytes)
    is_sft = "completion" in raw
    is_pref = "chosen" in raw or "rejected" in raw
    if is_sft and is_pref:
        raise InvalidRequest(f"{where}: give either completion (SFT sample) or chosen and rejected "
                             "(preference pair), not both")
    if not (is_sft or is_pref):
        raise InvalidRequest(f"{where}: needs completion (SFT sample) or chosen and rejected (preference pair)")
    return _sized(_validated(SFTItem if is_sft else PreferenceItem, raw, where), where, max_bytes)


def _validated(model: type[_Prompted], raw: Mapping[str, Any], where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise InvalidRequest([pydantic_error(where, err) for err in e.errors()]) from None


def _sized(item: Any, where: str, max_bytes: int) -> Any:
    """``item``, unless its text is over ``max_bytes`` or not valid Unicode (:class:`InvalidRequest`)."""
    size = 0
    for name, text in zip(_text_fields(item), item.texts()):
        try:
            size += len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidRequest(f"{where}.{name}: not valid Unicode text (lone surrogate)") from None
    if size > max_bytes:
        raise InvalidRequest(f"{where}: {size} bytes of text, more than the limit of {max_bytes}")
    return item


def _text_fields(item: SFTItem | PreferenceItem) -> tuple[str, ...]:
    """The names of ``item.texts()``, in order, for error messages."""
    context = ("prompt",) if item.messages is None else tuple(f"messages[{i}].content"
                                                               for i in range(len(item.messages)))
    return (*context, "completion") if item.kind in ("sft", "label") else (*context, "chosen", "rejected")


def _split_final_answer(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """OpenAI's fine-tuning shape (``messages`` ending with the assistant's answer, no ``completion``)
    becomes ``messages`` + ``completion``."""
    msgs = raw.get("messages")
    if ("completion" in raw or "chosen" in raw or "rejected" in raw or not isinstance(msgs, list) or len(msgs) < 2
            or not isinstance(msgs[-1], Mapping) or msgs[-1].get("role") != "assistant"):
        return raw
    return {**raw, "messages": msgs[:-1], "completion": msgs[-1].get("content")}


def pydantic_param(err: Mapping[str, Any]) -> str | None:
    """The dotted field an error is about (``lora.r``), the OpenAI error's ``param``; None for the whole body."""
    parts = [str(p) for p in err.get("loc", ()) if not isinstance(p, int)]
    # A union's branch names (e.g. 'list[str]', "literal['all-linear']") are not fields.
    parts = [p for p in parts if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p)]
    return ".".join(parts) or None


def pydantic_error(where: str, err: Mapping[str, Any]) -> str:
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.get("loc", ()))
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        msg = "field required"
    elif err.get("type") == "extra_forbidden":
        msg = "unknown field"
    return f"{where}{loc}: {msg}"


# ----------------------------------------------------------------------------------------------
# The held-out slice.

_GOLDEN = (5 ** 0.5 - 1) / 2


def is_held_out(n: int, share: float) -> bool:
    """Whether an adapter's ``n``-th feedback item (1-based) belongs to its held-out slice.

    The fractional parts of n·φ (a Weyl sequence) spread evenly over [0, 1) in every prefix, so any
    run of items holds out close to ``share`` of them, with no period that a client's batches could
    line up with; with a share up to 0.2 the first four items are always trained. It depends only on
    n, so the assignment is the same after a restart (and it is stored with the item anyway).
    """
    return share > 0 and (n * _GOLDEN) % 1.0 < share
