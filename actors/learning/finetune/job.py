"""The fine-tuning job file (YAML): a strict pydantic model, so a misspelt or unknown key is an error naming it.

    base: tiny-llama                 # an embedded model the app accepts (tiny-llama, smollm2-135m-instruct) or a model dir
    adapter: {name: support, method: sft, lora: {r: 8, alpha: 16, target_modules: [q_proj, v_proj]}}
    data: {path: train.jsonl, loader: ray_data}
    epochs: 3
    batch_size: 4                    # items per worker per optimizer step
    learning_rate: 5e-4
    workers: 2
    resources_per_worker: {CPU: 0.5}
    placement: shared                # or separate: only nodes that run no serving replica
    storage_path: /tmp/finetune      # Ray Train's checkpoints (a shared path or URI on a multi-node cluster)
    max_failures: 1
    output: {dir: out/support}       # or {app_url: http://host:8000, key_env: COSERVE_KEY, create: true, gate: true}

Relative paths are read from the job file's directory, so the same file works from any working
directory and under ``ray job submit --working-dir``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from actors.learning.store.models import ADAPTER_NAME_RE, LoraSettings, Mode, pydantic_error
from settings import DEFAULT_DATA_DIR

EMBEDDED_MODELS = ("tiny-llama", "smollm2-135m-instruct")  # settings.ModelConfig.embedded
RESOURCE_NAME_RE = r"^[A-Za-z0-9_.:/-]{1,64}$"


class JobFileError(ValueError):
    """The job file is unreadable or invalid; the message lists every problem with its key path."""


class _JobPart(BaseModel):
    # strict: a YAML string "8" is not a number; extra="forbid": a misspelt key is an error, not a default.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class FinetuneAdapter(_JobPart):
    """The adapter to train: the body of the app's ``POST /v1/adapters`` when the job creates it there."""

    name: str = Field(pattern=ADAPTER_NAME_RE.pattern)
    method: Literal["sft", "dpo"] = "sft"
    beta: float = Field(0.1, gt=0, description="DPO temperature β.")
    lora: LoraSettings = Field(default_factory=LoraSettings)


class FinetuneData(_JobPart):
    """Where the items are: a JSONL file of ``/v1/feedback`` items (``adapter`` may be left out)."""

    path: str = Field(min_length=1)
    loader: Literal["ray_data", "file"] = Field(
        "ray_data",
        description="ray_data: ray.data.read_json, one shard per worker (ray.train.get_dataset_shard); "
        "file: every worker reads the file and takes every world_size-th item.",
    )
    max_length: int = Field(512, ge=8, le=32768, description="Tokens per prompt + answer (longer ones are cut).")
    shuffle: bool = Field(True, description="A new order each epoch (the same on a resume: seeded by the epoch).")


class FinetuneOutput(_JobPart):
    """Where the trained adapter goes: a PEFT directory, or a new version of an adapter of a running app."""

    dir: str | None = Field(
        None, min_length=1, description="Write adapter_config.json + adapter_model.safetensors here."
    )
    app_url: str | None = Field(None, pattern=r"^https?://\S+$", description="Publish into this app as a new version.")
    key: str | None = Field(None, min_length=1, description="The API key (Authorization: Bearer); prefer key_env.")
    key_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="The environment variable that holds the API key."
    )
    gate: bool = Field(
        True,
        description="false: ask the app to serve the version without its quality gate "
        "(?gate=false, an admin key's privilege).",
    )
    create: bool = Field(False, description="Create the adapter first (POST /v1/adapters); one that exists is kept.")
    mode: Mode = Field(
        "off", description="The created adapter's training mode in the app; off: only uploads change it."
    )

    @model_validator(mode="after")
    def _one_target(self) -> FinetuneOutput:
        if (self.dir is None) == (self.app_url is None):
            raise ValueError("give either dir (a PEFT directory) or app_url (publish into a running app), not both")
        if self.dir is not None and (self.key or self.key_env or self.create):
            raise ValueError("key, key_env and create apply to app_url only")
        if self.key is not None and self.key_env is not None:
            raise ValueError("give key or key_env, not both")
        return self

    def api_key(self) -> str | None:
        """The key to send, from ``key`` or the environment variable ``key_env`` names (an unset one is an error)."""
        if self.key_env is None:
            return self.key
        value = os.environ.get(self.key_env)
        if not value:
            raise JobFileError(f"output.key_env: the environment variable {self.key_env} is not set")
        return value


class FinetuneJob(_JobPart):
    """One fine-tuning run: what to train, on what data, with how many Ray Train workers, and where it goes."""

    base: str = Field(min_length=1, description="tiny-llama, smollm2-135m-instruct, or a model directory.")
    data_dir: str = Field(
        DEFAULT_DATA_DIR,
        description="Where embedded models are built or fetched (COSERVE_DATA_DIR wins, as in the app).",
    )
    adapter: FinetuneAdapter
    data: FinetuneData
    epochs: int = Field(1, ge=1, le=1000)
    batch_size: int = Field(4, ge=1, le=4096, description="Items per worker per optimizer step.")
    learning_rate: float = Field(5e-4, gt=0, le=1)
    max_grad_norm: float | None = Field(1.0, gt=0)
    seed: int = Field(0, ge=0)
    workers: int = Field(1, ge=1, le=1024)
    resources_per_worker: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0}, description="Ray resources per worker; fractions allowed (CPU: 0.5)."
    )
    placement: Literal["shared", "separate"] = Field(
        "shared", description="separate: only nodes that run no serving replica (LEMIX's SEPARATE baseline)."
    )
    serving_deployment: str = Field(
        "ModelServer", min_length=1, description="The Serve deployment whose replicas count as serving (placement)."
    )
    storage_path: str = Field(min_length=1, description="Ray Train's run directory root (checkpoints).")
    run_name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,128}$",
        description="Default finetune-<adapter>; a rerun with the same name resumes it.",
    )
    max_failures: int = Field(1, ge=-1, description="Worker-group restarts from the last checkpoint (-1: no limit).")
    output: FinetuneOutput

    @model_validator(mode="after")
    def _resources(self) -> FinetuneJob:
        bad = [k for k in self.resources_per_worker if not re.fullmatch(RESOURCE_NAME_RE, k)]
        if bad:
            raise ValueError(f"resources_per_worker: not resource names: {bad}")
        if any(v < 0 for v in self.resources_per_worker.values()):
            raise ValueError("resources_per_worker: amounts must be >= 0")
        return self

    @property
    def name(self) -> str:
        return self.run_name or f"finetune-{self.adapter.name}"

    def resolved(self, base_dir: Path) -> FinetuneJob:
        """This job with its relative paths made absolute against ``base_dir`` (the job file's directory)."""

        def absolute(p: str) -> str:
            return p if "://" in p or Path(p).expanduser().is_absolute() else str((base_dir / p).resolve())

        out = self.output
        if out.dir is not None:
            out = out.model_copy(update={"dir": absolute(out.dir)})
        base = self.base if self.base in EMBEDDED_MODELS else absolute(self.base)
        return self.model_copy(
            update={
                "base": base,
                "data": self.data.model_copy(update={"path": absolute(self.data.path)}),
                "storage_path": str(Path(absolute(self.storage_path)).expanduser())
                if "://" not in self.storage_path
                else self.storage_path,
                "output": out,
            }
        )


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``5e-4`` as a string; this loader reads it as the float every YAML 1.2 reader does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
        r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.inf|\.Inf|\.INF|\.nan|\.NaN|\.NAN)$"
    ),
    list("-+0123456789."),
)


def parse_job(raw: Any, where: str = "job") -> FinetuneJob:
    """Validate a loaded job document; :class:`JobFileError` lists every problem by its key path."""
    if not isinstance(raw, dict):
        raise JobFileError(f"{where}: expected a mapping of job keys, got {type(raw).__name__}")
    try:
        return FinetuneJob.model_validate(raw)
    except ValidationError as exc:
        problems = [f"{where}: {pydantic_error('', e).lstrip('.')}" for e in exc.errors()]
        raise JobFileError("invalid fine-tuning job:\n  " + "\n  ".join(problems)) from None


def load_job(path: str | Path) -> FinetuneJob:
    """Read, validate and resolve the job file at ``path`` (relative paths against its directory)."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except (OSError, yaml.YAMLError) as exc:
        raise JobFileError(f"{path}: {exc}") from None
    return parse_job(raw, path.name).resolved(path.resolve().parent)
