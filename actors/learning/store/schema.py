"""The feedback store's SQLite schema: its tables, the columns each later schema added, and the names queries select."""

from __future__ import annotations

SCHEMA_VERSION = 11  # 2: per-node queues and version lines (training.scope per_node); 3: the quality gate; 4: epochs;
# 5: adapters belong to tenants; 6: full-model training units (methods full_sft, full_dpo); 7: idempotency keys;
# 8: versions deleted by the retention rule (training.keep_versions); 9: a tenant's adapters keyed tenant/name;
# 10: the gate's retention scores (how well a version keeps the base model's answers) and scoring seconds;
# 11: stored completions, feedback by completion id (unpaired labels, method kto), the version that answered
# each item, and each item's tenant and training tokens (limits.training_tokens_per_day)
DB_FILENAME = "feedback.sqlite3"
RESERVATION_PINS_S = 24 * 3600.0  # how long an unpublished reservation keeps its parent from prune_versions
IDEMPOTENCY_TTL_S = 24 * 3600.0  # how long a client's Idempotency-Key answers with its first result (as Stripe's)

SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (
    name              TEXT PRIMARY KEY,
    method            TEXT NOT NULL CHECK (method IN ('sft', 'dpo', 'kto', 'full_sft', 'full_dpo')),
    beta              REAL NOT NULL,
    learning_rate     REAL NOT NULL,
    lora_r            INTEGER NOT NULL,
    lora_alpha        REAL NOT NULL,
    lora_target_modules TEXT NOT NULL,           -- JSON list of module names, or the JSON string "all-linear"
    lora_dropout      REAL NOT NULL,
    mode              TEXT NOT NULL CHECK (mode IN ('hybrid', 'sync', 'periodic', 'off')),
    periodic_every_seconds REAL,
    periodic_every_samples INTEGER,
    current_version   INTEGER,                   -- NULL until the first publish
    created_at        REAL NOT NULL,
    gate              TEXT,                      -- JSON of the adapter's own gate settings (GateOverrides)
    paused_reason     TEXT,                      -- why training is paused, NULL: it runs
    rejections_in_row INTEGER NOT NULL DEFAULT 0,  -- gate rejections since the last served version
    promotions_total  INTEGER NOT NULL DEFAULT 0,  -- versions served by the gate or a promotion (a counter)
    rejections_total  INTEGER NOT NULL DEFAULT 0,  -- versions the gate rejected (a counter)
    epochs            INTEGER NOT NULL DEFAULT 1,  -- versions that train on each item before it is consumed
    tenant            TEXT,                        -- the owning tenant, NULL: made without API keys
    warmup_steps      INTEGER NOT NULL DEFAULT 0,  -- optimizer steps of linear learning-rate warm-up
    store_completions INTEGER NOT NULL DEFAULT 0   -- 1: every request to it is a stored completion
);
CREATE TABLE IF NOT EXISTS versions (
    adapter           TEXT NOT NULL REFERENCES adapters(name),
    version           INTEGER NOT NULL CHECK (version >= 1),
    parent            INTEGER,
    path              TEXT,
    created_at        REAL NOT NULL,
    published         INTEGER NOT NULL DEFAULT 0,
    published_at      REAL,
    samples_trained   INTEGER,
    loss              REAL,
    win_rate          REAL,
    clpd              REAL,
    node              INTEGER,                   -- per_node scope: the node whose copy this is, NULL: synced
    state             TEXT CHECK (state IN ('candidate', 'served', 'rejected', 'rolled_back')),  -- NULL: reserved
    reason            TEXT,                      -- why it is in its state (the gate's comparison, a promotion)
    score             REAL,                      -- the gated score: win_rate (dpo) or token_logprob (sft)
    baseline_version  INTEGER,                   -- the version the gate compared with, NULL: the base model
    baseline_score    REAL,
    token_logprob     REAL,                      -- sft: mean log-likelihood per held-out completion token
    eval_items        INTEGER,                   -- how many held-out items the scores are over
    decided_at        REAL,
    deleted_at        REAL,                      -- set by prune_versions: its files are gone, it answers 404
    retention         REAL,                      -- mean log-likelihood per token of the base's answers to the retention set
    retention_base    REAL,                      -- the base model's own score of them (the gate compares the two)
    retention_prompts INTEGER,                   -- prompts of the retention set scored
    score_s           REAL,                      -- seconds the gate (or the served version's scoring) spent scoring it
    PRIMARY KEY (adapter, version)
);
CREATE TABLE IF NOT EXISTS node_heads (          -- per_node scope: the version each node's copy is at
    adapter           TEXT NOT NULL REFERENCES adapters(name),
    node              INTEGER NOT NULL,
    version           INTEGER NOT NULL,
    PRIMARY KEY (adapter, node)
);
CREATE TABLE IF NOT EXISTS feedback (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: oldest-first = by id
    adapter           TEXT NOT NULL REFERENCES adapters(name),
    kind              TEXT NOT NULL CHECK (kind IN ('sft', 'preference', 'label')),
    prompt            TEXT NOT NULL,
    completion        TEXT,
    chosen            TEXT,
    rejected          TEXT,
    created_at        REAL NOT NULL,
    consumed_by_version INTEGER,                 -- NULL until a published version trained on it
    node              INTEGER,                   -- per_node scope: the node that trains on it, NULL: any
    messages          TEXT,                      -- JSON chat turns (then prompt is ''), NULL: raw prompt
    held_out          INTEGER NOT NULL DEFAULT 0,  -- 1: the adapter's held-out slice, never trained on
    passes            INTEGER NOT NULL DEFAULT 0,  -- published versions that trained on it (consumed at epochs)
    label             INTEGER,                   -- kind 'label': 1 a thumbs-up (desirable), 0 a thumbs-down
    completion_id     TEXT,                      -- the stored completion the item was given on, NULL: sent in full
    answered_version  INTEGER,                   -- the adapter version that produced the answer (0: the base model)
    tenant            TEXT,                      -- the tenant that sent it, NULL: local mode
    tokens            INTEGER,                   -- its training tokens, as limits.training_tokens_per_day counts them
    CHECK ((kind = 'sft' AND completion IS NOT NULL AND chosen IS NULL AND rejected IS NULL)
        OR (kind = 'preference' AND completion IS NULL AND chosen IS NOT NULL AND rejected IS NOT NULL)
        OR (kind = 'label' AND completion IS NOT NULL AND label IN (0, 1) AND chosen IS NULL AND rejected IS NULL))
);
-- Stored completions (schema 11): a chat or completion request with "store": true, or one to an adapter created
-- with store_completions: true. Read back by GET /v1/chat/completions/{id}, by its own tenant only.
CREATE TABLE IF NOT EXISTS completions (
    id                TEXT PRIMARY KEY,          -- the id the response carried (chatcmpl-..., cmpl-...)
    tenant            TEXT NOT NULL,             -- '' without API keys
    object            TEXT NOT NULL,             -- chat.completion | text_completion
    model             TEXT NOT NULL,             -- the model as the client named it
    adapter           TEXT,                      -- the adapter's store key, NULL: the base model
    version           INTEGER,                   -- the adapter version pinned when the request was admitted (0: base)
    prompt            TEXT NOT NULL,             -- the prompt as rendered for the engine (chat template applied)
    messages          TEXT,                      -- JSON chat turns the client sent, NULL: a completion's prompt
    output            TEXT NOT NULL,
    finish_reason     TEXT,
    prompt_tokens     INTEGER,
    completion_tokens INTEGER,
    params            TEXT NOT NULL,             -- JSON of the sampling parameters
    created_at        REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS completions_age ON completions (created_at);
CREATE INDEX IF NOT EXISTS feedback_tenant_day ON feedback (tenant, created_at);
-- Idempotency-Key of POST /v1/feedback: the first answer of each key, written in the transaction that stores
-- the items, so items never exist without their key nor a key without its items.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    tenant            TEXT NOT NULL,             -- the key's scope: the caller's tenant, '' without API keys
    key               TEXT NOT NULL,
    fingerprint       TEXT NOT NULL,             -- SHA-256 of the validated items: a reuse with other items is refused
    ids               TEXT NOT NULL,             -- JSON list of the feedback ids the first request got
    created_at        REAL NOT NULL,
    expires_at        REAL NOT NULL,             -- pruned (and no longer answered) after this
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS idempotency_expiry ON idempotency_keys (expires_at);
CREATE INDEX IF NOT EXISTS feedback_queue ON feedback (adapter, consumed_by_version, id);
-- The queue and the held-out slice without scanning the other: held-out items are never consumed.
CREATE INDEX IF NOT EXISTS feedback_open ON feedback (adapter, held_out, consumed_by_version, id);
-- take(): fewest passes first (new feedback before another epoch of older items), then oldest.
CREATE INDEX IF NOT EXISTS feedback_epochs ON feedback (adapter, held_out, consumed_by_version, passes, id);
"""

OLD_METHODS_CHECKS = ("CHECK (method IN ('sft', 'dpo'))", "CHECK (method IN ('sft', 'dpo', 'full_sft', 'full_dpo'))")
NEW_METHODS_CHECK = "CHECK (method IN ('sft', 'dpo', 'kto', 'full_sft', 'full_dpo'))"
OLD_KINDS_CHECK = "CHECK (kind IN ('sft', 'preference'))"
OLD_ITEM_CHECK_END = "chosen IS NOT NULL AND rejected IS NOT NULL))"

UPDATABLE = frozenset({"mode", "learning_rate", "beta", "periodic", "gate", "paused", "epochs", "warmup_steps"})
ADAPTER_COLUMNS = (
    "name, method, beta, learning_rate, lora_r, lora_alpha, lora_target_modules, lora_dropout, "
    "mode, periodic_every_seconds, periodic_every_samples, current_version, created_at, epochs, tenant, warmup_steps, "
    "store_completions"
)
VERSION_COLUMNS = (
    "adapter, version, parent, path, created_at, published, published_at, samples_trained, "
    "loss, win_rate, clpd, node, state, reason, score, baseline_version, baseline_score, token_logprob, "
    "eval_items, decided_at, retention, retention_base, retention_prompts, score_s"
)
# Columns added after schema 1, for databases created by older code: (table, column, type).
ADDED_COLUMNS = (
    ("versions", "node", "INTEGER"),
    ("feedback", "node", "INTEGER"),
    ("feedback", "messages", "TEXT"),
    # schema 3: the quality gate
    ("adapters", "gate", "TEXT"),
    ("adapters", "paused_reason", "TEXT"),
    ("adapters", "rejections_in_row", "INTEGER NOT NULL DEFAULT 0"),
    ("adapters", "promotions_total", "INTEGER NOT NULL DEFAULT 0"),
    ("adapters", "rejections_total", "INTEGER NOT NULL DEFAULT 0"),
    ("versions", "state", "TEXT CHECK (state IN ('candidate', 'served', 'rejected', 'rolled_back'))"),
    ("versions", "reason", "TEXT"),
    ("versions", "score", "REAL"),
    ("versions", "baseline_version", "INTEGER"),
    ("versions", "baseline_score", "REAL"),
    ("versions", "token_logprob", "REAL"),
    ("versions", "eval_items", "INTEGER"),
    ("versions", "decided_at", "REAL"),
    ("feedback", "held_out", "INTEGER NOT NULL DEFAULT 0"),
    # schema 4: epochs
    ("adapters", "epochs", "INTEGER NOT NULL DEFAULT 1"),
    ("feedback", "passes", "INTEGER NOT NULL DEFAULT 0"),
    # schema 5: tenants
    ("adapters", "tenant", "TEXT"),
    # schema 8: retention
    ("versions", "deleted_at", "REAL"),
    # schema 10: the gate's retention scores
    ("versions", "retention", "REAL"),
    ("versions", "retention_base", "REAL"),
    ("versions", "retention_prompts", "INTEGER"),
    ("versions", "score_s", "REAL"),
    ("adapters", "warmup_steps", "INTEGER NOT NULL DEFAULT 0"),
    # schema 11: feedback on stored completions
    ("feedback", "label", "INTEGER"),
    ("feedback", "completion_id", "TEXT"),
    ("feedback", "answered_version", "INTEGER"),
    ("feedback", "tenant", "TEXT"),
    ("feedback", "tokens", "INTEGER"),
    ("adapters", "store_completions", "INTEGER NOT NULL DEFAULT 0"),
)
ITEM_COLUMNS = "id, adapter, kind, prompt, completion, chosen, rejected, created_at, messages, label"
COMPLETION_COLUMNS = (
    "id, tenant, object, model, adapter, version, prompt, messages, output, finish_reason, prompt_tokens, "
    "completion_tokens, params, created_at"
)
