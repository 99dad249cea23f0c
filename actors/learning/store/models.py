"""What an adapter is made of and how the store refuses: names, adapter specs, errors (each with its HTTP status).

Plain pydantic models, no SQLite: the HTTP layer (``deployments/learning.py``, ``deployments/openapi.py``)
validates and documents requests with them, and ``actors/learning/store/sqlite.py`` stores them. A feedback item's
shapes and the validation of a batch are in ``feedback_items.py``; what the store hands out (versions, adapters,
served state, queued items) is in ``records.py``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from settings import ADMIN_TENANT, MAX_COUNT, GateSettings

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
KIND_FOR_METHOD: dict[str, str] = {
    "sft": "sft",
    "dpo": "preference",
    "kto": "label",
    "full_sft": "sft",
    "full_dpo": "preference",
}
METHOD_TAKES = {
    "dpo": "preference pairs (prompt, chosen, rejected)",
    "sft": "SFT samples (prompt, completion)",
    "kto": "labels (prompt, completion, label up/down; or completion_id and rating)",
    "full_dpo": "preference pairs (prompt, chosen, rejected)",
    "full_sft": "SFT samples (prompt, completion)",
}
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


class StrictModel(BaseModel):
    # No inf/NaN: they would be stored, then fail to encode as JSON in every later answer. strict: no coercion,
    # so a JSON string "8" or "0.1" (or a float 8.0 for an integer, 1 or "true" for a boolean) is a client error
    # naming its field, never a number or a flag (an integer is still taken where a float is meant).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output head


class LoraSettings(StrictModel):
    r: int = Field(8, ge=1, le=256, description="LoRA rank, an integer (must not exceed the engine's max_lora_rank).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / r.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "v_proj"],
        description='Default "all-linear" for an sft adapter (measured), ["q_proj", "v_proj"] otherwise. '
        "Module names of the served model, matched as peft does (a module whose name is this or ends "
        "with '.' and this), or \"all-linear\" (peft's: every linear layer but the output head).",
    )
    dropout: float = Field(0.0, ge=0, lt=1)

    @field_validator("target_modules", mode="before")
    @classmethod
    def _list_or_all_linear(cls, v: Any) -> Any:
        if not isinstance(v, list) and v != ALL_LINEAR:
            raise ValueError(f'expected a list of module names, or "{ALL_LINEAR}"')
        return v

    @field_validator("target_modules")
    @classmethod
    def _module_names(cls, v: list[str] | str) -> list[str] | str:
        if v == [ALL_LINEAR]:
            return ALL_LINEAR  # peft takes the shorthand only as a string; a list would name a module "all-linear"
        if isinstance(v, str):
            return v
        if not v:
            raise ValueError('name at least one module, or "all-linear"')
        bad = [m for m in v if not re.fullmatch(r"[A-Za-z0-9_.]{1,128}", m)]
        if bad:
            raise ValueError(f"not module names: {bad}")
        return v


class PeriodicSettings(StrictModel):
    every_seconds: float | None = Field(60.0, gt=0, description="Train every T seconds (Ekya-like).")
    every_samples: int | None = Field(None, gt=0, le=MAX_COUNT, description="... or as soon as K samples are queued.")


class GateOverrides(StrictModel):
    """An adapter's own gate settings; a field left null follows the app's default (``training.gate``)."""

    enabled: bool | None = None
    margin: float | None = Field(None, ge=0)
    held_out_share: float | None = Field(None, ge=0, le=0.5)
    pause_after_rejections: int | None = Field(None, ge=0, le=MAX_COUNT)
    max_eval_items: int | None = Field(None, gt=0, le=MAX_COUNT)
    retention: bool | None = None
    retention_file: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_./-]*$",
        description="The adapter's must-not-break prompts: a JSONL file under the app's data_dir (a relative path, "
        'no \'..\'), one {"prompt"} or {"messages"} per line.',
    )
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


class AdapterSpec(StrictModel):
    """What ``POST /v1/adapters`` takes."""

    @model_validator(mode="before")
    @classmethod
    def _method_defaults(cls, data: Any) -> Any:
        # Before validation, so a stored or PATCHed spec (which carries every field) keeps its values.
        if not isinstance(data, Mapping):
            return data
        defaults = METHOD_DEFAULTS.get(
            data.get("method", "sft") if isinstance(data.get("method", "sft"), str) else "", {}
        )
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
    tenant: str | None = Field(
        None,
        pattern=TENANT_NAME_RE.pattern,
        description="The tenant that owns the adapter: the creating key's (an admin may name "
        "another); null when the app runs without keys.",
    )
    method: Method = "sft"
    beta: float = Field(0.1, gt=0, description="DPO temperature β (stored, unused by SFT).")
    learning_rate: float = Field(
        5e-4, gt=0, le=1, description="Peak learning rate; default 2e-3 for sft (measured), 5e-4 for the other methods."
    )
    lora: LoraSettings = Field(default_factory=LoraSettings)
    mode: Mode = "hybrid"
    periodic: PeriodicSettings = Field(default_factory=PeriodicSettings)
    gate: GateOverrides = Field(
        default_factory=GateOverrides,
        description="This adapter's quality-gate settings; unset fields follow training.gate.",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        le=10_000,
        description="Optimizer steps over which the learning rate rises linearly to "
        "learning_rate (the adapter's own count, kept across versions; 0: none). "
        "Default 4 for sft (measured), 0 for the other methods.",
    )
    epochs: int = Field(
        1,
        ge=1,
        le=100,
        description="Passes over each feedback item, each in a different version: an item stays "
        "queued until this many published versions trained on it (new items go first).",
    )
    store_completions: bool = Field(
        False,
        description='Store every chat or completion request to this adapter, as "store": true does, so '
        "that feedback can name its completion_id.",
    )

    @model_validator(mode="after")
    def _periodic_has_trigger(self) -> AdapterSpec:
        if self.mode == "periodic" and self.periodic.every_seconds is None and self.periodic.every_samples is None:
            raise ValueError("mode 'periodic' needs periodic.every_seconds or periodic.every_samples")
        return self


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
