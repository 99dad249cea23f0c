"""Durable feedback queue and adapter/version registry on one SQLite file (WAL), the source of truth for learning.

Tables (schema version 1, see ``docs/learning.md``):

- ``adapters``: one row per tenant adapter, keyed by ``name``, the adapter's key (schema 9): ``tenant/name``
  for a tenant's adapter, so two tenants may each own ``support`` (models.adapter_key); method (sft | dpo), β, learning rate, LoRA settings,
  retraining mode and its periodic settings, and ``current_version``, the version served now
  (moved forward by :meth:`FeedbackStore.publish_version`, backward by :meth:`FeedbackStore.rollback`).
- ``versions``: every version number ever handed out. :meth:`FeedbackStore.reserve_version` inserts
  an unpublished row (so a crashed trainer never reuses a number or a directory name);
  :meth:`FeedbackStore.publish_version` flips it to published and, in the same transaction,
  marks the feedback it trained on as consumed. Rows are never removed: :meth:`FeedbackStore.prune_versions`
  marks the versions ``training.keep_versions`` no longer keeps as deleted (schema 8), so a number is never reused.
- ``feedback``: SFT samples and preference pairs; ``consumed_by_version`` stays NULL until a
  published version trained on the item (at-least-once training, never lost); with an adapter's
  ``epochs`` > 1, until that many published versions did (``passes`` counts them). ``held_out`` marks
  the adapter's held-out slice (chosen when the item is stored, :func:`is_held_out`): never trained on.
- ``idempotency_keys`` (schema 7): each ``Idempotency-Key`` of ``POST /v1/feedback`` per tenant, with the
  ids its batch got, written in the batch's own transaction (:meth:`FeedbackStore.submit_feedback`):
  a retried request stores nothing twice and gets the first answer; pruned after 24 h.

The quality gate (schema 3): with an adapter's gate on, a published version is a ``candidate`` that
is not served; :meth:`FeedbackStore.decide_version` makes it ``served`` (current) or ``rejected``
after the trainer scored it on the held-out slice against the served version, and pauses the
adapter after ``pause_after_rejections`` rejections in a row. :meth:`FeedbackStore.promote` serves
any published version; a rollback leaves the versions it went back past ``rolled_back``.

Durability: WAL journal with ``synchronous=FULL``. The HTTP layer answers 2xx only after
:meth:`FeedbackStore.add_feedback` returns, and that must mean "persisted" even across a power
loss, not only across a process crash (which is all ``NORMAL`` guarantees in WAL mode: it skips
the fsync at commit). The cost is one WAL fsync per batch, since a batch is one transaction.

Concurrency: all methods are synchronous and short (one transaction each, a few ms plus one
fsync for writes). One connection per store object, serialised by a lock, so an asyncio actor
may call them directly or through ``asyncio.to_thread``. Several processes on one host may open
the same file (writers take ``BEGIN IMMEDIATE`` and wait up to ``busy_timeout_s``); WAL does not
work on network file systems, so in a multi-node cluster exactly one actor should own the store.

Why one module of about 800 lines: :class:`FeedbackStore` is one transaction boundary. Its
invariants span the three tables (an item is consumed exactly when a published version trained
on it; a version number is never reused; the current version moves only by publish, decide,
promote or rollback), and each method is one transaction that keeps them. Splitting the class
would split those invariants across files. What it accepts and returns is in
``actors/learning/store/models.py``.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from actors.learning.store.models import (
    AdapterExists,
    AdapterQuotaExceeded,
    AdapterInfo,
    AdapterSpec,
    DEFAULT_MAX_BATCH_ITEMS,
    DEFAULT_MAX_ITEM_BYTES,
    FULL_METHODS,
    FeedbackItem,
    FeedbackReceipt,
    FullUnitExists,
    GateOverrides,
    GateSettings,
    IdempotencyKeyReused,
    InvalidRequest,
    KIND_FOR_METHOD,
    KIND_NAMES,
    LoraSettings,
    METHOD_TAKES,
    PeriodicSettings,
    PreferenceItem,
    SFTItem,
    ServedAdapter,
    ServedVersion,
    StoreError,
    UnknownAdapter,
    UnknownItem,
    UnknownVersion,
    VersionConflict,
    VersionInfo,
    idempotency_key_problem,
    is_held_out,
    pydantic_error,
    pydantic_param,
    adapter_key,
    split_adapter_key,
    validate_feedback,
)

SCHEMA_VERSION = 9  # 2: per-node queues and version lines (training.scope per_node); 3: the quality gate; 4: epochs;
# 5: adapters belong to tenants; 6: full-model training units (methods full_sft, full_dpo); 7: idempotency keys;
# 8: versions deleted by the retention rule (training.keep_versions); 9: a tenant's adapters keyed tenant/name
DB_FILENAME = "feedback.sqlite3"
RESERVATION_PINS_S = 24 * 3600.0  # how long an unpublished reservation keeps its parent from prune_versions
IDEMPOTENCY_TTL_S = 24 * 3600.0  # how long a client's Idempotency-Key answers with its first result (as Stripe's)

# ----------------------------------------------------------------------------------------------
# The store.

_SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (
    name              TEXT PRIMARY KEY,
    method            TEXT NOT NULL CHECK (method IN ('sft', 'dpo', 'full_sft', 'full_dpo')),
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
    tenant            TEXT                         -- the owning tenant, NULL: made without API keys
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
    kind              TEXT NOT NULL CHECK (kind IN ('sft', 'preference')),
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
    CHECK ((kind = 'sft' AND completion IS NOT NULL AND chosen IS NULL AND rejected IS NULL)
        OR (kind = 'preference' AND completion IS NULL AND chosen IS NOT NULL AND rejected IS NOT NULL))
);
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

_OLD_METHODS = "CHECK (method IN ('sft', 'dpo'))"
_NEW_METHODS = "CHECK (method IN ('sft', 'dpo', 'full_sft', 'full_dpo'))"
UPDATABLE = frozenset({"mode", "learning_rate", "beta", "periodic", "gate", "paused", "epochs"})
_ADAPTER_COLS = ("name, method, beta, learning_rate, lora_r, lora_alpha, lora_target_modules, lora_dropout, "
                 "mode, periodic_every_seconds, periodic_every_samples, current_version, created_at, epochs, tenant")
_VERSION_COLS = ("adapter, version, parent, path, created_at, published, published_at, samples_trained, "
                 "loss, win_rate, clpd, node, state, reason, score, baseline_version, baseline_score, token_logprob, "
                 "eval_items, decided_at")
# Columns added after schema 1, for databases created by older code: (table, column, type).
_ADDED_COLUMNS = (("versions", "node", "INTEGER"), ("feedback", "node", "INTEGER"), ("feedback", "messages", "TEXT"),
                  # schema 3: the quality gate
                  ("adapters", "gate", "TEXT"), ("adapters", "paused_reason", "TEXT"),
                  ("adapters", "rejections_in_row", "INTEGER NOT NULL DEFAULT 0"),
                  ("adapters", "promotions_total", "INTEGER NOT NULL DEFAULT 0"),
                  ("adapters", "rejections_total", "INTEGER NOT NULL DEFAULT 0"),
                  ("versions", "state", "TEXT CHECK (state IN ('candidate', 'served', 'rejected', 'rolled_back'))"),
                  ("versions", "reason", "TEXT"), ("versions", "score", "REAL"),
                  ("versions", "baseline_version", "INTEGER"), ("versions", "baseline_score", "REAL"),
                  ("versions", "token_logprob", "REAL"), ("versions", "eval_items", "INTEGER"),
                  ("versions", "decided_at", "REAL"), ("feedback", "held_out", "INTEGER NOT NULL DEFAULT 0"),
                  # schema 4: epochs
                  ("adapters", "epochs", "INTEGER NOT NULL DEFAULT 1"), ("feedback", "passes", "INTEGER NOT NULL DEFAULT 0"),
                  # schema 5: tenants
                  ("adapters", "tenant", "TEXT"),
                  # schema 8: retention
                  ("versions", "deleted_at", "REAL"))
_ITEM_COLS = "id, adapter, kind, prompt, completion, chosen, rejected, created_at, messages"


class FeedbackStore:
    """The feedback queue and adapter registry in ``<data_dir>/feedback.sqlite3``; every method is synchronous."""

    def __init__(self, data_dir: str | Path, *, filename: str = DB_FILENAME,
                 max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES, max_batch_items: int = DEFAULT_MAX_BATCH_ITEMS,
                 busy_timeout_s: float = 10.0, gate_defaults: GateSettings | Mapping[str, Any] | None = None,
                 max_adapters_per_tenant: int | None = None, keep_versions: int | None = None):
        """``gate_defaults``: the app's ``training.gate``, which an adapter's own ``gate`` settings override.
        ``max_adapters_per_tenant``: ``limits.adapters_per_tenant`` (None: no cap).
        ``keep_versions``: ``training.keep_versions``, what :meth:`prune_versions` keeps (None: every version)."""
        self.max_adapters_per_tenant = max_adapters_per_tenant
        self.keep_versions = keep_versions
        self.path = Path(data_dir).expanduser() / filename
        self.gate_defaults = _validate(GateSettings, gate_defaults or {}, "training.gate")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_item_bytes = max_item_bytes
        self.max_batch_items = max_batch_items
        self._lock = threading.RLock()
        # isolation_level=None: no implicit transactions; every write is an explicit BEGIN IMMEDIATE
        # (takes the write lock up front, so two writers never deadlock upgrading a read lock).
        self._conn = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None,
                                     check_same_thread=False)
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        if self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
            raise StoreError(f"SQLite refused WAL mode for {self.path} (network file system?)")
        self._conn.execute("PRAGMA synchronous = FULL")  # see the module docstring for why not NORMAL
        self._conn.execute("PRAGMA foreign_keys = ON")
        self._migrate()

    # -- plumbing ------------------------------------------------------------------------------

    def _migrate(self) -> None:
        self._widen_methods()
        with self._tx() as db:
            found = db.execute("PRAGMA user_version").fetchone()[0]
            if found > SCHEMA_VERSION:
                raise StoreError(f"{self.path} has schema {found}, newer than this code's {SCHEMA_VERSION}")
            for table, column, kind in _ADDED_COLUMNS:
                exists = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone()
                if exists and column not in {r[1] for r in db.execute(f"PRAGMA table_info({table})")}:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            if found < 3:
                # Versions published before the gate existed were served; those newer than their line's
                # current version were left by a rollback.
                db.execute("UPDATE versions SET state = 'served' WHERE published = 1 AND state IS NULL")
                db.execute("UPDATE versions SET state = 'rolled_back' WHERE state = 'served' AND node IS NULL AND "
                           "version > (SELECT current_version FROM adapters WHERE name = versions.adapter)")
                db.execute("UPDATE versions SET state = 'rolled_back' WHERE state = 'served' AND node IS NOT NULL "
                           "AND version > (SELECT version FROM node_heads h WHERE h.adapter = versions.adapter "
                           "AND h.node = versions.node)")
            if found < 4:
                db.execute("UPDATE feedback SET passes = 1 WHERE consumed_by_version IS NOT NULL AND passes = 0")
            if found < 9:
                self._scope_names(db)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @staticmethod
    def _scope_names(db: sqlite3.Connection) -> None:
        """Schema 9: adapter names are scoped by tenant. A tenant's adapter (a ``tenant`` other than NULL and the
        admin's) made before is renamed to its key ``tenant/name`` in every table that names it, in the
        migration's transaction; its version rows keep their paths (the files stay where they are). The
        references are checked at the commit (deferred), as the rows change one table at a time."""
        rows = db.execute("SELECT name, tenant FROM adapters WHERE tenant IS NOT NULL AND instr(name, '/') = 0"
                          ).fetchall()
        renames = [(name, adapter_key(tenant, name)) for name, tenant in rows if adapter_key(tenant, name) != name]
        if not renames:
            return
        db.execute("PRAGMA defer_foreign_keys = ON")
        for table, column in (("adapters", "name"), ("versions", "adapter"), ("node_heads", "adapter"),
                              ("feedback", "adapter")):
            db.executemany(f"UPDATE {table} SET {column} = ? WHERE {column} = ?", [(new, old) for old, new in renames])

    def _widen_methods(self) -> None:
        """Schema 6: an adapters table made before full units has ``CHECK (method IN ('sft', 'dpo'))``, which
        SQLite cannot alter; rebuild it with the new check in one transaction (SQLite's documented 12-step
        table change), its rows and column order kept. Foreign keys are off meanwhile (only outside a
        transaction does the pragma take effect), so dropping the old table deletes nothing that refers to it."""
        row = self._conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'adapters'").fetchone()
        if row is None or _OLD_METHODS not in row[0]:
            return
        self._conn.execute("PRAGMA foreign_keys = OFF")
        try:
            with self._tx() as db:
                create = re.sub(r"^CREATE TABLE[^(]*\(", "CREATE TABLE adapters_widened (", row[0], count=1)
                db.execute(create.replace(_OLD_METHODS, _NEW_METHODS))
                db.execute("INSERT INTO adapters_widened SELECT * FROM adapters")
                db.execute("DROP TABLE adapters")
                db.execute("ALTER TABLE adapters_widened RENAME TO adapters")
                broken = db.execute("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise StoreError(f"{self.path}: widening the adapters table broke references: {broken[:5]}")
        finally:
            self._conn.execute("PRAGMA foreign_keys = ON")

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        """One transaction: commit on success, roll back on any exception (nothing half-written)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                # A failed COMMIT (disk full, I/O error) also lands here: never leave the
                # connection inside an open transaction, or every later BEGIN would fail.
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> FeedbackStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- adapters ------------------------------------------------------------------------------

    def create_adapter(self, spec: AdapterSpec | Mapping[str, Any]) -> AdapterInfo:
        """Register a new adapter under its key ``adapter_key(spec.tenant, spec.name)`` (what every other method
        takes as its name); :class:`AdapterExists` (409) if its tenant has one of that name already (another
        tenant's of the same name is another adapter), :class:`AdapterQuotaExceeded` (403) if its tenant owns
        ``max_adapters_per_tenant`` already."""
        spec = _validate(AdapterSpec, spec, "adapter")
        key = adapter_key(spec.tenant, spec.name)
        with self._tx() as db:
            if db.execute("SELECT 1 FROM adapters WHERE name = ?", (key,)).fetchone():
                raise AdapterExists(f"adapter {spec.name!r} already exists")
            cap = self.max_adapters_per_tenant
            # Counted in the insert's transaction: concurrent creates cannot both take the last place.
            if cap is not None and db.execute("SELECT COUNT(*) FROM adapters WHERE tenant IS ?",
                                              (spec.tenant,)).fetchone()[0] >= cap:
                owner = f"tenant {spec.tenant!r}" if spec.tenant is not None else "this deployment (no API keys)"
                raise AdapterQuotaExceeded(f"{owner} has {cap} adapters, the most limits.adapters_per_tenant allows; "
                                           "the operator can raise the limit")
            if spec.method in FULL_METHODS:
                # A full unit changes the base model every request is served with: one per deployment.
                other = db.execute("SELECT name FROM adapters WHERE method IN ('full_sft', 'full_dpo')").fetchone()
                if other:
                    raise FullUnitExists(f"full unit {other[0]!r} already trains this deployment's model; "
                                         "at most one full_sft/full_dpo unit per deployment")
            db.execute(
                f"INSERT INTO adapters ({_ADAPTER_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (key, spec.method, spec.beta, spec.learning_rate, spec.lora.r, spec.lora.alpha,
                 json.dumps(spec.lora.target_modules), spec.lora.dropout, spec.mode, spec.periodic.every_seconds,
                 spec.periodic.every_samples, None, time.time(), spec.epochs, spec.tenant),
            )
            db.execute("UPDATE adapters SET gate = ? WHERE name = ?", (_overrides_json(spec.gate), key))
            return self._adapter_info(db, key)

    def update_adapter(self, name: str, changes: Mapping[str, Any]) -> AdapterInfo:
        """Change how an adapter trains from now on: ``mode``, ``learning_rate``, ``beta``, ``periodic``,
        ``gate`` (the fields given replace the adapter's own; a null goes back to training.gate's) or
        ``paused`` (false resumes training paused by the gate and forgets its rejections in a row; true pauses).

        ``method`` and ``lora`` are fixed at creation (every version shares them), so changing them is
        an :class:`InvalidRequest`; :class:`UnknownAdapter` (404) if there is no such adapter.
        """
        if not isinstance(changes, Mapping) or not changes:
            raise InvalidRequest("body: a JSON object with at least one of " + ", ".join(sorted(UPDATABLE)))
        fixed = sorted(set(changes) - UPDATABLE)
        if fixed:
            raise InvalidRequest([f"{k}: cannot be changed after creation (updatable: {', '.join(sorted(UPDATABLE))})"
                                  for k in fixed])
        with self._tx() as db:
            info = self._adapter_info(db, name)
            current = info.model_dump(include={"method", "beta", "learning_rate", "lora", "mode", "periodic", "epochs"})
            current["name"] = split_adapter_key(name)[1]  # a spec names the adapter without its tenant
            if "periodic" in changes and isinstance(changes["periodic"], Mapping):
                changes = {**changes, "periodic": {**current["periodic"], **changes["periodic"]}}
            gate_changes, paused = changes.get("gate"), changes.get("paused")
            changes = {k: v for k, v in changes.items() if k not in ("gate", "paused")}
            spec = _validate(AdapterSpec, {**current, **changes}, "adapter")
            gate = self._gate_overrides(db, name)
            if gate_changes is not None:
                if not isinstance(gate_changes, Mapping):
                    raise InvalidRequest("gate: expected an object of gate settings")
                merged = {**gate.model_dump(exclude_none=True), **gate_changes}
                gate = _validate(GateOverrides, {k: v for k, v in merged.items() if v is not None}, "gate")
            if paused is not None and not isinstance(paused, bool):
                raise InvalidRequest("paused: expected true or false")
            db.execute("UPDATE adapters SET mode = ?, learning_rate = ?, beta = ?, periodic_every_seconds = ?, "
                       "periodic_every_samples = ?, gate = ?, epochs = ? WHERE name = ?",
                       (spec.mode, spec.learning_rate, spec.beta, spec.periodic.every_seconds,
                        spec.periodic.every_samples, _overrides_json(gate), spec.epochs, name))
            if paused is False:
                db.execute("UPDATE adapters SET paused_reason = NULL, rejections_in_row = 0 WHERE name = ?", (name,))
            elif paused is True and info.paused_reason is None:
                db.execute("UPDATE adapters SET paused_reason = ? WHERE name = ?",
                           ("paused through PATCH /v1/adapters (send {\"paused\": false} to resume)", name))
            return self._adapter_info(db, name)

    def pause_adapter(self, name: str, reason: str) -> AdapterInfo:
        """Pause one adapter's training with ``reason`` (its fault, e.g. a version that does not load);
        the others train on. A PATCH with ``{"paused": false}`` resumes it. :class:`UnknownAdapter` (404)."""
        with self._tx() as db:
            self._adapter_info(db, name)
            db.execute("UPDATE adapters SET paused_reason = ? WHERE name = ?", (reason[:2000], name))
            return self._adapter_info(db, name)

    def get_adapter(self, name: str) -> AdapterInfo:
        """The adapter with its published versions and queue state; :class:`UnknownAdapter` (404)."""
        with self._tx(write=False) as db:
            return self._adapter_info(db, name)

    def adapter_tenant(self, name: str) -> str | None:
        """The tenant that owns adapter ``name`` (None: made without keys); :class:`UnknownAdapter` (404)."""
        with self._tx(write=False) as db:
            row = db.execute("SELECT tenant FROM adapters WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise UnknownAdapter(f"no adapter named {name!r}")
        return row[0]

    def list_adapters(self) -> list[AdapterInfo]:
        """Every adapter, by name."""
        with self._tx(write=False) as db:
            names = [r[0] for r in db.execute("SELECT name FROM adapters ORDER BY name")]
            return [self._adapter_info(db, n) for n in names]

    def _adapter_row(self, db: sqlite3.Connection, name: str) -> tuple:
        row = db.execute(f"SELECT {_ADAPTER_COLS} FROM adapters WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise UnknownAdapter(f"no adapter named {name!r}")
        return row

    def _current(self, db: sqlite3.Connection, name: str, node: int | None = None) -> int | None:
        """The version served now: the adapter's (synced), or one node's copy (per_node)."""
        current = self._adapter_row(db, name)[_ADAPTER_COLS.split(", ").index("current_version")]
        if node is None:
            return current
        row = db.execute("SELECT version FROM node_heads WHERE adapter = ? AND node = ?", (name, node)).fetchone()
        return row[0] if row else None

    def _set_current(self, db: sqlite3.Connection, name: str, version: int, node: int | None) -> None:
        if node is not None:
            db.execute("INSERT OR REPLACE INTO node_heads (adapter, node, version) VALUES (?,?,?)", (name, node, version))
            # The adapter's own current_version shows the newest version any node serves.
            version = db.execute("SELECT MAX(version) FROM node_heads WHERE adapter = ?", (name,)).fetchone()[0]
        db.execute("UPDATE adapters SET current_version = ? WHERE name = ?", (version, name))

    def _adapter_info(self, db: sqlite3.Connection, name: str) -> AdapterInfo:
        (name, method, beta, lr, r, alpha, targets, dropout, mode, every_s, every_n, current,
         created, epochs, tenant) = self._adapter_row(db, name)
        versions = [_version(row) for row in db.execute(
            f"SELECT {_VERSION_COLS} FROM versions WHERE adapter = ? AND published = 1 AND deleted_at IS NULL "
            "ORDER BY version", (name,))]
        queued, oldest = db.execute(
            "SELECT COUNT(*), MIN(created_at) FROM feedback WHERE adapter = ? AND held_out = 0 "
            "AND consumed_by_version IS NULL", (name,)).fetchone()
        held_out = db.execute("SELECT COUNT(*) FROM feedback WHERE adapter = ? AND held_out = 1", (name,)).fetchone()[0]
        gate, paused, in_row, promotions, rejections = self._gate_row(db, name)
        return AdapterInfo(
            name=name, tenant=tenant, method=method, beta=beta, learning_rate=lr,
            lora=LoraSettings(r=r, alpha=alpha, target_modules=json.loads(targets), dropout=dropout),
            mode=mode, periodic=PeriodicSettings(every_seconds=every_s, every_samples=every_n),
            created_at=created, current_version=current, versions=versions, queued=queued, epochs=epochs,
            oldest_queued_at=oldest, last_published_at=max((v.published_at for v in versions), default=None),
            node_versions=dict(db.execute("SELECT node, version FROM node_heads WHERE adapter = ? ORDER BY node",
                                          (name,)).fetchall()),
            gate=gate.over(self.gate_defaults), held_out=held_out, rejections_in_row=in_row, paused_reason=paused,
            promotions=promotions, rejections=rejections,
        )

    def _gate_row(self, db: sqlite3.Connection, name: str) -> tuple[GateOverrides, str | None, int, int, int]:
        """(own gate settings, paused_reason, rejections in a row, promotions, rejections) of an adapter."""
        row = db.execute("SELECT gate, paused_reason, rejections_in_row, promotions_total, rejections_total "
                         "FROM adapters WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise UnknownAdapter(f"no adapter named {name!r}")
        return (GateOverrides.model_validate_json(row[0]) if row[0] else GateOverrides(), *row[1:])

    def _gate_overrides(self, db: sqlite3.Connection, name: str) -> GateOverrides:
        return self._gate_row(db, name)[0]

    def gate_settings(self, adapter: str) -> GateSettings:
        """The gate settings in effect for ``adapter``: its own over the app's defaults."""
        with self._tx(write=False) as db:
            return self._gate_overrides(db, adapter).over(self.gate_defaults)

    # -- feedback ------------------------------------------------------------------------------

    def add_feedback(self, items: Sequence[Mapping[str, Any]] | Mapping[str, Any],
                     nodes: Sequence[int | None] | None = None) -> list[int]:
        """Validate and store a batch all-or-nothing in one transaction; return the new ids in item order.

        ``nodes`` (per_node scope): the node that trains on each item, in item order; default: any.

        Raises :class:`InvalidRequest` (400: malformed item, wrong kind for the adapter's method,
        too large, empty batch) or :class:`UnknownAdapter` (404). Nothing is stored on any error.
        When this returns, the batch is durable (WAL, synchronous=FULL).
        """
        return self.submit_feedback(items, nodes).ids

    def submit_feedback(self, items: Sequence[Mapping[str, Any]] | Mapping[str, Any],
                        nodes: Sequence[int | None] | None = None, *, idempotency_key: str | None = None,
                        tenant: str | None = None, key_ttl_s: float = IDEMPOTENCY_TTL_S) -> FeedbackReceipt:
        """:meth:`add_feedback` that stores each ``idempotency_key`` once per ``tenant`` (None: local mode).

        The key and the ids it got are written in the same transaction as the items. The same key
        again within ``key_ttl_s`` (24 h) stores nothing and gives the first ids (``replayed``); with
        other items (compared after validation, so ``[item]`` and ``{"items": [item]}`` are the same)
        it raises :class:`IdempotencyKeyReused` (422). A request that failed stored no key, so its
        retry runs afresh. Expired keys are deleted here, with each keyed batch. ``nodes`` are not
        part of the comparison: a retry may be placed elsewhere, and the first placement stands.
        """
        parsed = validate_feedback(items, self.max_item_bytes, self.max_batch_items)
        if nodes is None:
            nodes = [None] * len(parsed)
        if len(nodes) != len(parsed):
            raise InvalidRequest(f"nodes: {len(nodes)} given for {len(parsed)} items")
        if idempotency_key is not None and (problem := idempotency_key_problem(idempotency_key)):
            raise InvalidRequest(problem)
        scope = tenant or ""  # '' is no tenant name (TENANT_NAME_RE), so local mode has a scope of its own
        fingerprint = _fingerprint(parsed)
        now = time.time()
        with self._tx() as db:
            if idempotency_key is not None:
                db.execute("DELETE FROM idempotency_keys WHERE expires_at < ?", (now,))
                row = db.execute("SELECT fingerprint, ids FROM idempotency_keys WHERE tenant = ? AND key = ?",
                                 (scope, idempotency_key)).fetchone()
                if row is not None:
                    if row[0] != fingerprint:
                        raise IdempotencyKeyReused(
                            f"Idempotency-Key {idempotency_key!r} was used in the last {key_ttl_s / 3600:g} h for "
                            "other feedback items; a retry must send the same items, a new request a new key")
                    return FeedbackReceipt(json.loads(row[1]), replayed=True)
            ids = self._insert_feedback(db, parsed, nodes, now)
            if idempotency_key is not None:
                db.execute("INSERT INTO idempotency_keys (tenant, key, fingerprint, ids, created_at, expires_at) "
                           "VALUES (?,?,?,?,?,?)", (scope, idempotency_key, fingerprint, json.dumps(ids), now,
                                                    now + key_ttl_s))
            return FeedbackReceipt(ids)

    def _insert_feedback(self, db: sqlite3.Connection, parsed: Sequence[SFTItem | PreferenceItem],
                         nodes: Sequence[int | None], now: float) -> list[int]:
        self._check_adapters(db, parsed)
        # The held-out slice is assigned here, once, by each item's number within its adapter.
        names = {it.adapter for it in parsed}
        seen = {a: db.execute("SELECT COUNT(*) FROM feedback WHERE adapter = ?", (a,)).fetchone()[0] for a in names}
        # A full unit has no quality gate to score a held-out slice with: every item trains.
        share = {a: 0.0 if self._adapter_row(db, a)[1] in FULL_METHODS
                 else self._gate_overrides(db, a).over(self.gate_defaults).held_out_share for a in names}
        ids = []
        for item, node in zip(parsed, nodes):
            cur = db.execute(
                "INSERT INTO feedback (adapter, kind, prompt, completion, chosen, rejected, created_at, node, "
                "messages) VALUES (?,?,?,?,?,?,?,?,?)",
                (item.adapter, item.kind, item.prompt or "", getattr(item, "completion", None),
                 getattr(item, "chosen", None), getattr(item, "rejected", None), now, node,
                 item.messages_json()),
            )
            ids.append(cur.lastrowid)
            seen[item.adapter] += 1
            if is_held_out(seen[item.adapter], share[item.adapter]):
                db.execute("UPDATE feedback SET held_out = 1 WHERE id = ?", (cur.lastrowid,))
        return ids

    def _check_adapters(self, db: sqlite3.Connection, parsed: Sequence[SFTItem | PreferenceItem]) -> None:
        methods: dict[str, str | None] = {}
        for name in {it.adapter for it in parsed}:
            row = db.execute("SELECT method FROM adapters WHERE name = ?", (name,)).fetchone()
            methods[name] = row[0] if row else None
        unknown = [f"items[{i}].adapter: no adapter named {it.adapter!r}"
                   for i, it in enumerate(parsed) if methods[it.adapter] is None]
        if unknown:
            raise UnknownAdapter("; ".join(unknown[:10]))
        wrong = [f"items[{i}]: adapter {it.adapter!r} trains with {methods[it.adapter]} and takes "
                 f"{METHOD_TAKES[methods[it.adapter]]}, not {KIND_NAMES[it.kind]}"
                 for i, it in enumerate(parsed) if KIND_FOR_METHOD[methods[it.adapter]] != it.kind]
        if wrong:
            raise InvalidRequest(wrong)

    def take(self, adapter: str, limit: int, exclude_ids: Iterable[int] = (),
             node: int | None = None) -> list[FeedbackItem]:
        """Up to ``limit`` unconsumed items of ``adapter``, not marking them (see publish_version).

        Fewest passes first, then oldest: with ``epochs`` > 1 new feedback trains before another
        epoch of older items, and an epoch goes round every queued item before the next starts.

        ``exclude_ids``: items the caller already holds (trained into a version not yet published).
        ``node`` (per_node scope): only the items routed to that node.
        """
        if limit <= 0:
            return []
        exclude = set(exclude_ids)
        with self._tx(write=False) as db:
            self._adapter_row(db, adapter)
            # At most len(exclude) of the oldest rows can be excluded, so one bounded query suffices.
            rows = db.execute(
                f"SELECT {_ITEM_COLS} FROM feedback WHERE adapter = ? AND held_out = 0 AND consumed_by_version IS NULL "
                "AND (? IS NULL OR node = ?) ORDER BY passes, id LIMIT ?",
                (adapter, node, node, limit + len(exclude))).fetchall()
        return [FeedbackItem.from_row(row) for row in rows if row[0] not in exclude][:limit]

    def queued(self, adapter: str) -> int:
        """Number of items of ``adapter`` that no published version has trained on (held-out ones excluded)."""
        with self._tx(write=False) as db:
            self._adapter_row(db, adapter)
            return db.execute("SELECT COUNT(*) FROM feedback WHERE adapter = ? AND held_out = 0 "
                              "AND consumed_by_version IS NULL", (adapter,)).fetchone()[0]

    def queue_summary(self, node: int | None = None) -> dict[str, tuple[int, float]]:
        """adapter -> (unconsumed items, created_at of the oldest), for adapters with a non-empty queue.

        ``node`` (per_node scope): count only the items routed to that node.
        """
        with self._tx(write=False) as db:
            rows = db.execute("SELECT adapter, COUNT(*), MIN(created_at) FROM feedback "
                              "WHERE held_out = 0 AND consumed_by_version IS NULL AND (? IS NULL OR node = ?) "
                              "GROUP BY adapter",
                              (node, node)).fetchall()
        return {a: (n, t) for a, n, t in rows}

    def queued_by_node(self) -> dict[str, dict[int, int]]:
        """adapter -> {node: unconsumed items routed to it}, for routing new feedback (per_node scope)."""
        with self._tx(write=False) as db:
            rows = db.execute("SELECT adapter, node, COUNT(*) FROM feedback WHERE held_out = 0 AND "
                              "consumed_by_version IS NULL AND node IS NOT NULL GROUP BY adapter, node").fetchall()
        out: dict[str, dict[int, int]] = {}
        for adapter, node, n in rows:
            out.setdefault(adapter, {})[node] = n
        return out

    def held_out_items(self, adapter: str, limit: int) -> list[FeedbackItem]:
        """The adapter's held-out slice: its oldest ``limit`` held-out items (never trained on).

        The oldest, not the newest: the slice stays the same once full, so the scores of successive
        versions are comparable, and a late burst of bad feedback cannot take it over.
        """
        with self._tx(write=False) as db:
            self._adapter_row(db, adapter)
            rows = db.execute(f"SELECT {_ITEM_COLS} FROM feedback WHERE adapter = ? AND held_out = 1 "
                              "AND consumed_by_version IS NULL ORDER BY id LIMIT ?",
                              (adapter, max(0, limit))).fetchall()
        return [FeedbackItem.from_row(row) for row in rows]

    def existing_feedback_ids(self, ids: Iterable[int]) -> list[int]:
        """Which of ``ids`` the store holds (a fault drill's check that nothing acknowledged was lost)."""
        wanted = sorted({int(i) for i in ids})
        found: list[int] = []
        with self._tx(write=False) as db:
            for start in range(0, len(wanted), 500):
                chunk = wanted[start:start + 500]
                found += [r[0] for r in db.execute(
                    f"SELECT id FROM feedback WHERE id IN ({','.join('?' * len(chunk))})", chunk)]
        return found

    def feedback_item(self, item_id: int) -> tuple[FeedbackItem, int | None]:
        """One item and the version that consumed it (None while queued); :class:`UnknownItem` (404)."""
        with self._tx(write=False) as db:
            row = db.execute(f"SELECT {_ITEM_COLS}, consumed_by_version FROM feedback WHERE id = ?",
                             (item_id,)).fetchone()
        if row is None:
            raise UnknownItem(f"no feedback item {item_id}")
        return FeedbackItem.from_row(row[:-1]), row[-1]

    # -- versions ------------------------------------------------------------------------------

    def reserve_version(self, adapter: str, node: int | None = None) -> VersionInfo:
        """Hand out the next version number (never reused), unpublished, with ``parent`` = the current version.

        The trainer writes ``<root>/<adapter>/v<version>/`` under this number, then calls publish_version.
        ``node`` (per_node scope): a version of that node's copy; numbers stay unique across nodes.
        """
        with self._tx() as db:
            current = self._current(db, adapter, node)
            last = db.execute("SELECT MAX(version) FROM versions WHERE adapter = ?", (adapter,)).fetchone()[0]
            version = (last or 0) + 1
            db.execute("INSERT INTO versions (adapter, version, parent, created_at, node) VALUES (?,?,?,?,?)",
                       (adapter, version, current, time.time(), node))
            return self._version(db, adapter, version)

    def publish_version(self, adapter: str, version: int, path: str | Path, item_ids: Iterable[int],
                        samples_trained: int, loss: float | None, *, check_parent: bool = True,
                        gated: bool | None = None) -> VersionInfo:
        """Publish a reserved version and count its pass over ``item_ids``: one transaction.

        With the adapter's quality gate on (``gated`` None: its settings decide) the version becomes a
        ``candidate``: complete and durable, its pass over its items counted, but not served until
        :meth:`decide_version` passes it. With the gate off it is ``served`` and current at once.
        Each of ``item_ids`` counts one pass; it is consumed by the version that makes its passes reach
        the adapter's ``epochs`` (1: this one), and stays queued until then. Items already consumed by
        another version keep their first consumer. With ``check_parent``,
        raises :class:`VersionConflict` (and changes nothing) if the current version moved since
        the reservation (e.g. a rollback): the trainer should reload the current version and retrain.
        """
        ids = sorted(set(item_ids))
        with self._tx() as db:
            v = self._version(db, adapter, version)
            current = self._current(db, adapter, v.node)
            if v.published:
                raise VersionConflict(f"{adapter} v{version} is already published")
            if check_parent and v.parent != current:
                raise VersionConflict(f"{adapter} v{version} was trained from v{v.parent}, but the current "
                                      f"version is now v{current}; reload it and train again")
            foreign = [i for i in ids if (r := db.execute("SELECT adapter FROM feedback WHERE id = ?", (i,))
                                          .fetchone()) is None or r[0] != adapter]
            if foreign:
                raise InvalidRequest(f"item_ids: {foreign[:10]} are not feedback of adapter {adapter!r}")
            if gated is None:
                gated = self._gate_overrides(db, adapter).over(self.gate_defaults).enabled
            now = time.time()
            db.execute("UPDATE versions SET published = 1, published_at = ?, path = ?, samples_trained = ?, "
                       "loss = ?, state = ?, reason = ?, decided_at = ? WHERE adapter = ? AND version = ?",
                       (now, str(path), samples_trained, loss, "candidate" if gated else "served",
                        "waiting for the quality gate" if gated else "served at once: the quality gate is off",
                        None if gated else now, adapter, version))
            # One more pass each; consumed (no longer queued) once the adapter's epochs are done.
            epochs = db.execute("SELECT epochs FROM adapters WHERE name = ?", (adapter,)).fetchone()[0]
            db.executemany("UPDATE feedback SET passes = passes + 1, consumed_by_version = CASE WHEN passes + 1 >= ? "
                           "THEN ? END WHERE id = ? AND consumed_by_version IS NULL",
                           [(epochs, version, i) for i in ids])
            if not gated:
                self._set_current(db, adapter, version, v.node)
            return self._version(db, adapter, version)

    def decide_version(self, adapter: str, version: int, *, passed: bool, reason: str, score: float | None = None,
                       baseline_version: int | None = None, baseline_score: float | None = None,
                       win_rate: float | None = None, clpd: float | None = None, token_logprob: float | None = None,
                       eval_items: int | None = None) -> VersionInfo:
        """The quality gate's verdict on a candidate, in one transaction: ``served`` (made current) or ``rejected``.

        A candidate whose parent is no longer the served version (a rollback or a promotion came in
        while it was judged) is rejected as superseded whatever it scored: serving it would undo that
        choice. A gate rejection counts toward the adapter's ``pause_after_rejections``, and at that
        many in a row the adapter pauses (``paused_reason``); a served version resets the count.
        :class:`VersionConflict` if the version is not a candidate (e.g. it was promoted meanwhile).
        """
        with self._tx() as db:
            v = self._version(db, adapter, version)
            if v.state != "candidate":
                raise VersionConflict(f"{adapter} v{version} is {v.state or 'not published'}, not a candidate")
            current = self._current(db, adapter, v.node)
            superseded = v.parent != current
            if superseded:
                passed, reason = False, (f"superseded: trained from {_name(v.parent)}, but {_name(current)} is served "
                                         f"now (a rollback or promotion); {reason}")
            now = time.time()
            db.execute("UPDATE versions SET state = ?, reason = ?, decided_at = ?, score = ?, baseline_version = ?, "
                       "baseline_score = ?, win_rate = COALESCE(?, win_rate), clpd = COALESCE(?, clpd), "
                       "token_logprob = COALESCE(?, token_logprob), eval_items = ? WHERE adapter = ? AND version = ?",
                       ("served" if passed else "rejected", reason, now, score, baseline_version, baseline_score,
                        win_rate, clpd, token_logprob, eval_items, adapter, version))
            if passed:
                self._set_current(db, adapter, version, v.node)
                db.execute("UPDATE adapters SET rejections_in_row = 0, promotions_total = promotions_total + 1 "
                           "WHERE name = ?", (adapter,))
            elif not superseded:
                db.execute("UPDATE adapters SET rejections_in_row = rejections_in_row + 1, "
                           "rejections_total = rejections_total + 1 WHERE name = ?", (adapter,))
                gate, paused, in_row, _, _ = self._gate_row(db, adapter)
                limit = gate.over(self.gate_defaults).pause_after_rejections
                if limit and in_row >= limit and paused is None:
                    why = (f"training paused: {in_row} versions in a row rejected by the quality gate (the last, "
                           f"v{version}: {reason}); send PATCH {{\"paused\": false}} or promote a version to resume")
                    db.execute("UPDATE adapters SET paused_reason = ? WHERE name = ?", (why, adapter))
            return self._version(db, adapter, version)

    def promote(self, adapter: str, version: int) -> AdapterInfo:
        """Serve a published version of any state now, e.g. one the gate rejected: one transaction.

        It becomes current (its node's, per_node); served versions newer than it on its line become
        ``rolled_back``; a paused adapter resumes, and training continues from this version.
        :class:`VersionConflict` (409) for a version that was never published.
        """
        with self._tx() as db:
            self._adapter_row(db, adapter)  # 404 names the adapter, not the version
            v = self._version(db, adapter, version)
            if not v.published:
                raise VersionConflict(f"{adapter} v{version} was never published (its training did not finish)")
            current = self._current(db, adapter, v.node)
            self._roll_back_newer(db, adapter, version, v.node)
            if v.state != "served" or version != current:
                why = f"promoted through the API (it was {v.state}, {_name(current)} was served)"
                db.execute("UPDATE versions SET state = 'served', reason = ?, decided_at = ? WHERE adapter = ? "
                           "AND version = ?", (why, time.time(), adapter, version))
                db.execute("UPDATE adapters SET promotions_total = promotions_total + 1 WHERE name = ?", (adapter,))
            self._set_current(db, adapter, version, v.node)
            db.execute("UPDATE adapters SET paused_reason = NULL, rejections_in_row = 0 WHERE name = ?", (adapter,))
            return self._adapter_info(db, adapter)

    def _roll_back_newer(self, db: sqlite3.Connection, adapter: str, version: int, node: int | None) -> None:
        """Served versions newer than ``version`` on its line (its node's, or the synced one) are rolled back."""
        db.execute("UPDATE versions SET state = 'rolled_back', reason = ?, decided_at = ? WHERE adapter = ? "
                   "AND node IS ? AND version > ? AND state = 'served'",
                   (f"rolled back to v{version}", time.time(), adapter, node, version))

    def candidates(self, node: int | None = None) -> list[VersionInfo]:
        """Versions waiting for the quality gate, of every adapter, on one line (``node``; None: synced)."""
        with self._tx(write=False) as db:
            rows = db.execute(f"SELECT {_VERSION_COLS} FROM versions WHERE state = 'candidate' AND node IS ? "
                              "ORDER BY adapter, version", (node,)).fetchall()
        return [_version(row) for row in rows]

    def record_scores(self, adapter: str, version: int, *, score: float | None = None, win_rate: float | None = None,
                      clpd: float | None = None, token_logprob: float | None = None,
                      eval_items: int | None = None) -> VersionInfo:
        """Store held-out scores measured for a version outside the gate (the gate off); None keeps a value."""
        with self._tx() as db:
            self._version(db, adapter, version)
            db.execute("UPDATE versions SET score = COALESCE(?, score), win_rate = COALESCE(?, win_rate), "
                       "clpd = COALESCE(?, clpd), token_logprob = COALESCE(?, token_logprob), "
                       "eval_items = COALESCE(?, eval_items) WHERE adapter = ? AND version = ?",
                       (score, win_rate, clpd, token_logprob, eval_items, adapter, version))
            return self._version(db, adapter, version)

    def record_eval(self, adapter: str, version: int, win_rate: float, clpd: float) -> VersionInfo:
        """Store the alignment metrics (MACE §3.1) measured for a version."""
        return self.record_scores(adapter, version, win_rate=float(win_rate), clpd=float(clpd))

    def rollback(self, adapter: str, version: int) -> AdapterInfo:
        """Point ``current_version`` at an earlier published version; nothing is deleted or re-queued.

        A full unit's ``version`` 0 is the starting model (``current_version`` becomes null).

        A per_node version rolls back its own node's copy only.
        """
        with self._tx() as db:
            row = self._adapter_row(db, adapter)  # 404 names the adapter, not the version
            if version == 0:
                # A full unit's version 0 is the model the deployment started with: serve it again.
                if row[1] not in FULL_METHODS:
                    raise InvalidRequest("version: 0 (the starting model) is a full unit's; an adapter rolls back to v1 "
                                         "or later")
                self._roll_back_newer(db, adapter, 0, None)
                db.execute("UPDATE adapters SET current_version = NULL WHERE name = ?", (adapter,))
                return self._adapter_info(db, adapter)
            v = self._version(db, adapter, version)
            current = self._current(db, adapter, v.node)
            if not v.published:
                raise VersionConflict(f"{adapter} v{version} was never published")
            if v.state not in ("served", "rolled_back"):
                raise VersionConflict(f"{adapter} v{version} is {v.state} and was never served; rollback goes back "
                                      f"to a version that was served (POST /v1/adapters/{adapter}/promote serves any)")
            if current is not None and version > current:
                raise VersionConflict(f"{adapter} v{version} is newer than the current v{current}; "
                                      f"rollback only goes back; POST /v1/adapters/{adapter}/promote "
                                      f"{{\"version\": {version}}} serves it again")
            self._roll_back_newer(db, adapter, version, v.node)
            if version != current:
                db.execute("UPDATE versions SET state = 'served', reason = ?, decided_at = ? WHERE adapter = ? "
                           "AND version = ?", (f"served again by a rollback from {_name(current)}", time.time(),
                                               adapter, version))
            self._set_current(db, adapter, version, v.node)
            return self._adapter_info(db, adapter)

    def current_version(self, adapter: str, node: int | None = None) -> VersionInfo | None:
        """The version to serve and to resume training from (``node``: that node's copy); None before the first."""
        with self._tx(write=False) as db:
            current = self._current(db, adapter, node)
            return None if current is None else self._version(db, adapter, current)

    def served(self) -> dict[str, ServedAdapter]:
        """Every adapter's served version and, in scope ``per_node``, each node's: one read, for the planner to follow."""
        with self._tx(write=False) as db:
            current = db.execute(
                "SELECT a.name, a.method, a.current_version, v.path FROM adapters a LEFT JOIN versions v "
                "ON v.adapter = a.name AND v.version = a.current_version").fetchall()
            heads = db.execute(
                "SELECT h.adapter, h.node, h.version, v.path FROM node_heads h JOIN versions v "
                "ON v.adapter = h.adapter AND v.version = h.version WHERE v.path IS NOT NULL").fetchall()
        nodes: dict[str, dict[int, ServedVersion]] = {}
        for adapter, node, version, path in heads:
            nodes.setdefault(adapter, {})[node] = ServedVersion(version, path)
        return {name: ServedAdapter(method, ServedVersion(version, path) if version is not None and path else None,
                                    nodes.get(name, {}))
                for name, method, version, path in current}

    def get_version(self, adapter: str, version: int) -> VersionInfo:
        """One version (published or only reserved); :class:`UnknownVersion` (404)."""
        with self._tx(write=False) as db:
            self._adapter_row(db, adapter)
            return self._version(db, adapter, version)

    def _version(self, db: sqlite3.Connection, adapter: str, version: int) -> VersionInfo:
        row = db.execute(f"SELECT {_VERSION_COLS}, deleted_at FROM versions WHERE adapter = ? AND version = ?",
                         (adapter, version)).fetchone()
        if row is None:
            raise UnknownVersion(f"adapter {adapter!r} has no version {version}")
        if row[-1] is not None:
            raise UnknownVersion(f"adapter {adapter!r} has no version {version} any more: it was deleted as older "
                                 "than the newest training.keep_versions, and not served")
        return _version(row[:-1])

    # -- retention -----------------------------------------------------------------------------

    def prune_versions(self, adapter: str, keep: int | None = None) -> list[int]:
        """Delete the versions of ``adapter`` that nothing needs any more; the deleted numbers, in one transaction.

        ``keep`` (default ``keep_versions``; None: keep all) newest published versions stay, and so does any
        version still needed whatever its age: the adapter's current one, each node's current one (per_node),
        a candidate, and the parent of a reservation whose training has not published yet (it may still
        publish, or the trainer reload from it; a reservation older than a day is taken for a crashed one). A deleted row stays, marked ``deleted_at``, so its number
        is never handed out again and the items it consumed still name it; it is no longer listed, and
        rollback, promote and get_version answer 404 for it. Its files are the caller's to remove
        (:meth:`deleted_version_paths`, then :meth:`forget_version_paths`): the FeedbackQueue actor does both.
        """
        keep = self.keep_versions if keep is None else keep
        if keep is None:
            return []
        with self._tx() as db:
            current = self._current(db, adapter)
            live = [r[0] for r in db.execute("SELECT version FROM versions WHERE adapter = ? AND published = 1 "
                                             "AND deleted_at IS NULL ORDER BY version DESC", (adapter,))]
            needed = set(live[:keep]) | {current}
            needed |= {r[0] for r in db.execute("SELECT version FROM node_heads WHERE adapter = ?", (adapter,))}
            needed |= {r[0] for r in db.execute("SELECT version FROM versions WHERE adapter = ? AND "
                                                "state = 'candidate'", (adapter,))}
            # A reservation older than a day is a crashed trainer's, not a training in progress: it pins nothing.
            needed |= {r[0] for r in db.execute("SELECT parent FROM versions WHERE adapter = ? AND published = 0 "
                                                "AND parent IS NOT NULL AND created_at > ?",
                                                (adapter, time.time() - RESERVATION_PINS_S))}
            doomed = sorted(v for v in live if v not in needed)
            db.executemany("UPDATE versions SET deleted_at = ? WHERE adapter = ? AND version = ?",
                           [(time.time(), adapter, v) for v in doomed])
            return doomed

    def deleted_version_paths(self, adapter: str) -> dict[int, str]:
        """version -> location of the deleted versions of ``adapter`` whose files are not known to be gone."""
        with self._tx(write=False) as db:
            return dict(db.execute("SELECT version, path FROM versions WHERE adapter = ? AND deleted_at IS NOT NULL "
                                   "AND path IS NOT NULL ORDER BY version", (adapter,)).fetchall())

    def forget_version_paths(self, adapter: str, versions: Iterable[int]) -> None:
        """The files of these deleted versions are gone: their rows stop naming a location."""
        with self._tx() as db:
            db.executemany("UPDATE versions SET path = NULL WHERE adapter = ? AND version = ? AND "
                           "deleted_at IS NOT NULL", [(adapter, int(v)) for v in versions])


def _version(row: tuple) -> VersionInfo:
    (adapter, version, parent, path, created, published, published_at, samples, loss, win, clpd, node, state, reason,
     score, baseline_version, baseline_score, token_logprob, eval_items, decided_at) = row
    return VersionInfo(adapter=adapter, version=version, parent=parent, path=path, created_at=created,
                       published=bool(published), published_at=published_at, samples_trained=samples,
                       loss=loss, win_rate=win, clpd=clpd, node=node, state=state, reason=reason, score=score,
                       baseline_version=baseline_version, baseline_score=baseline_score, token_logprob=token_logprob,
                       eval_items=eval_items, decided_at=decided_at)


def _fingerprint(parsed: Sequence[SFTItem | PreferenceItem]) -> str:
    """What an idempotency key is compared on: the validated items, in order, as canonical JSON."""
    canon = json.dumps([{"kind": it.kind, **it.model_dump(mode="json")} for it in parsed], sort_keys=True,
                       separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def _name(version: int | None) -> str:
    """A version in messages: ``v3``, or the base model before the first."""
    return "the base model" if version is None else f"v{version}"


def _overrides_json(gate: GateOverrides) -> str | None:
    own = gate.model_dump(exclude_none=True)
    return json.dumps(own) if own else None


def _validate(model: type[BaseModel], data: Any, where: str) -> Any:
    if isinstance(data, model):
        return data
    if isinstance(data, BaseModel):
        data = data.model_dump()
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        raise InvalidRequest([pydantic_error(where, err) for err in errors], param=pydantic_param(errors[0])) from None
