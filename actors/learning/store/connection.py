"""StoreConnection: the feedback store's one SQLite connection, its transactions and migrations, and the row reads
every part of the store shares."""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ValidationError

from actors.learning.store.models import (
    DEFAULT_MAX_BATCH_ITEMS,
    DEFAULT_MAX_ITEM_BYTES,
    GateOverrides,
    GateSettings,
    InvalidRequest,
    LoraSettings,
    PeriodicSettings,
    StoreError,
    UnknownAdapter,
    UnknownVersion,
    adapter_key,
    pydantic_error,
    pydantic_param,
)
from actors.learning.store.records import AdapterInfo, VersionInfo
from actors.learning.store.schema import (
    ADAPTER_COLUMNS,
    ADDED_COLUMNS,
    DB_FILENAME,
    NEW_METHODS_CHECK,
    OLD_KINDS_CHECK,
    OLD_METHODS_CHECKS,
    SCHEMA,
    SCHEMA_VERSION,
    VERSION_COLUMNS,
)


class StoreConnection:
    """One SQLite file opened, migrated and guarded by a lock; the base of every part of :class:`FeedbackDatabase`."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        filename: str = DB_FILENAME,
        max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES,
        max_batch_items: int = DEFAULT_MAX_BATCH_ITEMS,
        busy_timeout_s: float = 10.0,
        gate_defaults: GateSettings | Mapping[str, Any] | None = None,
        max_adapters_per_tenant: int | None = None,
        keep_versions: int | None = None,
    ):
        """``gate_defaults``: the app's ``training.gate``, which an adapter's own ``gate`` settings override.
        ``max_adapters_per_tenant``: ``limits.adapters_per_tenant`` (None: no cap).
        ``keep_versions``: ``training.keep_versions``, what :meth:`prune_versions` keeps (None: every version)."""
        self.max_adapters_per_tenant = max_adapters_per_tenant
        self.keep_versions = keep_versions
        self.path = Path(data_dir).expanduser() / filename
        self.gate_defaults = validate_as(GateSettings, gate_defaults or {}, "training.gate")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_item_bytes = max_item_bytes
        self.max_batch_items = max_batch_items
        self._lock = threading.RLock()
        # isolation_level=None: no implicit transactions; every write is an explicit BEGIN IMMEDIATE
        # (takes the write lock up front, so two writers never deadlock upgrading a read lock).
        self._conn = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        if self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
            raise StoreError(f"SQLite refused WAL mode for {self.path} (network file system?)")
        self._conn.execute("PRAGMA synchronous = FULL")  # see the module docstring for why not NORMAL
        self._conn.execute("PRAGMA foreign_keys = ON")
        self._migrate()

    # -- plumbing ------------------------------------------------------------------------------

    def _migrate(self) -> None:
        self._widen_methods()
        self._widen_kinds()
        with self._tx() as db:
            found = db.execute("PRAGMA user_version").fetchone()[0]
            if found > SCHEMA_VERSION:
                raise StoreError(f"{self.path} has schema {found}, newer than this code's {SCHEMA_VERSION}")
            for table, column, kind in ADDED_COLUMNS:
                exists = db.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
                ).fetchone()
                if exists and column not in {r[1] for r in db.execute(f"PRAGMA table_info({table})")}:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            for stmt in SCHEMA.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            if found < 3:
                # Versions published before the gate existed were served; those newer than their line's
                # current version were left by a rollback.
                db.execute("UPDATE versions SET state = 'served' WHERE published = 1 AND state IS NULL")
                db.execute(
                    "UPDATE versions SET state = 'rolled_back' WHERE state = 'served' AND node IS NULL AND "
                    "version > (SELECT current_version FROM adapters WHERE name = versions.adapter)"
                )
                db.execute(
                    "UPDATE versions SET state = 'rolled_back' WHERE state = 'served' AND node IS NOT NULL "
                    "AND version > (SELECT version FROM node_heads h WHERE h.adapter = versions.adapter "
                    "AND h.node = versions.node)"
                )
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
        rows = db.execute(
            "SELECT name, tenant FROM adapters WHERE tenant IS NOT NULL AND instr(name, '/') = 0"
        ).fetchall()
        renames = [(name, adapter_key(tenant, name)) for name, tenant in rows if adapter_key(tenant, name) != name]
        if not renames:
            return
        db.execute("PRAGMA defer_foreign_keys = ON")
        for table, column in (
            ("adapters", "name"),
            ("versions", "adapter"),
            ("node_heads", "adapter"),
            ("feedback", "adapter"),
        ):
            db.executemany(f"UPDATE {table} SET {column} = ? WHERE {column} = ?", [(new, old) for old, new in renames])

    def _widen_methods(self) -> None:
        """Schema 6: an adapters table made before full units has ``CHECK (method IN ('sft', 'dpo'))``, which
        SQLite cannot alter; rebuild it with the new check in one transaction (SQLite's documented 12-step
        table change), its rows and column order kept. Foreign keys are off meanwhile (only outside a
        transaction does the pragma take effect), so dropping the old table deletes nothing that refers to it."""
        row = self._conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'adapters'").fetchone()
        old = None if row is None else next((c for c in OLD_METHODS_CHECKS if c in row[0]), None)
        if old is None:
            return
        self._conn.execute("PRAGMA foreign_keys = OFF")
        try:
            with self._tx() as db:
                create = re.sub(r"^CREATE TABLE[^(]*\(", "CREATE TABLE adapters_widened (", row[0], count=1)
                db.execute(create.replace(old, NEW_METHODS_CHECK))
                db.execute("INSERT INTO adapters_widened SELECT * FROM adapters")
                db.execute("DROP TABLE adapters")
                db.execute("ALTER TABLE adapters_widened RENAME TO adapters")
                broken = db.execute("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise StoreError(f"{self.path}: widening the adapters table broke references: {broken[:5]}")
        finally:
            self._conn.execute("PRAGMA foreign_keys = ON")

    def _widen_kinds(self) -> None:
        """Schema 11: a feedback table made before unpaired labels (kind 'label', method kto) checks
        ``kind IN ('sft', 'preference')``; rebuild it as SCHEMA declares it now, in one transaction, every row
        and id kept (and the AUTOINCREMENT counter, so an id is still never reused), the columns an older
        table lacks at their defaults. Foreign keys are off meanwhile, as in :meth:`_widen_methods`."""
        row = self._conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'feedback'").fetchone()
        if row is None or OLD_KINDS_CHECK not in row[0]:
            return
        create = next(s for s in SCHEMA.split(";") if "CREATE TABLE IF NOT EXISTS feedback (" in s)
        create = create.replace("CREATE TABLE IF NOT EXISTS feedback (", "CREATE TABLE feedback_widened (")
        self._conn.execute("PRAGMA foreign_keys = OFF")
        try:
            with self._tx() as db:
                old = [r[1] for r in db.execute("PRAGMA table_info(feedback)")]
                db.execute(create)
                new = {r[1] for r in db.execute("PRAGMA table_info(feedback_widened)")}
                cols = ", ".join(c for c in old if c in new)
                db.execute(f"INSERT INTO feedback_widened ({cols}) SELECT {cols} FROM feedback")
                seq = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'feedback'").fetchone()
                db.execute("DROP TABLE feedback")
                db.execute("ALTER TABLE feedback_widened RENAME TO feedback")
                if seq is not None:
                    db.execute("DELETE FROM sqlite_sequence WHERE name IN ('feedback', 'feedback_widened')")
                    db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('feedback', ?)", (seq[0],))
                broken = db.execute("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise StoreError(f"{self.path}: widening the feedback table broke references: {broken[:5]}")
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _adapter_row(self, db: sqlite3.Connection, name: str) -> tuple:
        row = db.execute(f"SELECT {ADAPTER_COLUMNS} FROM adapters WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise UnknownAdapter(f"no adapter named {name!r}")
        return row

    def _current(self, db: sqlite3.Connection, name: str, node: int | None = None) -> int | None:
        """The version served now: the adapter's (synced), or one node's copy (per_node)."""
        current = self._adapter_row(db, name)[ADAPTER_COLUMNS.split(", ").index("current_version")]
        if node is None:
            return current
        row = db.execute("SELECT version FROM node_heads WHERE adapter = ? AND node = ?", (name, node)).fetchone()
        return row[0] if row else None

    def _set_current(self, db: sqlite3.Connection, name: str, version: int, node: int | None) -> None:
        if node is not None:
            db.execute(
                "INSERT OR REPLACE INTO node_heads (adapter, node, version) VALUES (?,?,?)", (name, node, version)
            )
            # The adapter's own current_version shows the newest version any node serves.
            version = db.execute("SELECT MAX(version) FROM node_heads WHERE adapter = ?", (name,)).fetchone()[0]
        db.execute("UPDATE adapters SET current_version = ? WHERE name = ?", (version, name))

    def _adapter_info(self, db: sqlite3.Connection, name: str) -> AdapterInfo:
        (
            name,
            method,
            beta,
            lr,
            r,
            alpha,
            targets,
            dropout,
            mode,
            every_s,
            every_n,
            current,
            created,
            epochs,
            tenant,
            warmup_steps,
            store_completions,
        ) = self._adapter_row(db, name)
        versions = [
            version_from_row(row)
            for row in db.execute(
                f"SELECT {VERSION_COLUMNS} FROM versions WHERE adapter = ? AND published = 1 AND deleted_at IS NULL "
                "ORDER BY version",
                (name,),
            )
        ]
        queued, oldest = db.execute(
            "SELECT COUNT(*), MIN(created_at) FROM feedback WHERE adapter = ? AND held_out = 0 "
            "AND consumed_by_version IS NULL",
            (name,),
        ).fetchone()
        held_out = db.execute("SELECT COUNT(*) FROM feedback WHERE adapter = ? AND held_out = 1", (name,)).fetchone()[0]
        gate, paused, in_row, promotions, rejections = self._gate_row(db, name)
        # Staleness: of the trained items whose answering version is known, those answered by the version the
        # training started from (the consuming version's parent; 0 and NULL both the base model) are on-policy.
        on_policy, off_policy = db.execute(
            "SELECT COALESCE(SUM(f.answered_version = COALESCE(v.parent, 0)), 0), "
            "COALESCE(SUM(f.answered_version != COALESCE(v.parent, 0)), 0) FROM feedback f "
            "JOIN versions v ON v.adapter = f.adapter AND v.version = f.consumed_by_version "
            "WHERE f.adapter = ? AND f.answered_version IS NOT NULL",
            (name,),
        ).fetchone()
        return AdapterInfo(
            name=name,
            tenant=tenant,
            method=method,
            beta=beta,
            learning_rate=lr,
            lora=LoraSettings(r=r, alpha=alpha, target_modules=json.loads(targets), dropout=dropout),
            mode=mode,
            periodic=PeriodicSettings(every_seconds=every_s, every_samples=every_n),
            created_at=created,
            current_version=current,
            versions=versions,
            queued=queued,
            epochs=epochs,
            warmup_steps=warmup_steps,
            oldest_queued_at=oldest,
            last_published_at=max((v.published_at for v in versions), default=None),
            node_versions=dict(
                db.execute("SELECT node, version FROM node_heads WHERE adapter = ? ORDER BY node", (name,)).fetchall()
            ),
            gate=gate.over(self.gate_defaults),
            held_out=held_out,
            rejections_in_row=in_row,
            paused_reason=paused,
            promotions=promotions,
            rejections=rejections,
            store_completions=bool(store_completions),
            trained_on_policy=on_policy,
            trained_off_policy=off_policy,
            on_policy_share=None if on_policy + off_policy == 0 else on_policy / (on_policy + off_policy),
        )

    def _gate_row(self, db: sqlite3.Connection, name: str) -> tuple[GateOverrides, str | None, int, int, int]:
        """(own gate settings, paused_reason, rejections in a row, promotions, rejections) of an adapter."""
        row = db.execute(
            "SELECT gate, paused_reason, rejections_in_row, promotions_total, rejections_total "
            "FROM adapters WHERE name = ?",
            (name,),
        ).fetchone()
        if row is None:
            raise UnknownAdapter(f"no adapter named {name!r}")
        return (GateOverrides.model_validate_json(row[0]) if row[0] else GateOverrides(), *row[1:])

    def _gate_overrides(self, db: sqlite3.Connection, name: str) -> GateOverrides:
        return self._gate_row(db, name)[0]

    def _version(self, db: sqlite3.Connection, adapter: str, version: int) -> VersionInfo:
        row = db.execute(
            f"SELECT {VERSION_COLUMNS}, deleted_at FROM versions WHERE adapter = ? AND version = ?", (adapter, version)
        ).fetchone()
        if row is None:
            raise UnknownVersion(f"adapter {adapter!r} has no version {version}")
        if row[-1] is not None:
            raise UnknownVersion(
                f"adapter {adapter!r} has no version {version} any more: it was deleted as older "
                "than the newest training.keep_versions, and not served"
            )
        return version_from_row(row[:-1])


def version_from_row(row: tuple) -> VersionInfo:
    (
        adapter,
        version,
        parent,
        path,
        created,
        published,
        published_at,
        samples,
        loss,
        win,
        clpd,
        node,
        state,
        reason,
        score,
        baseline_version,
        baseline_score,
        token_logprob,
        eval_items,
        decided_at,
        retention,
        retention_base,
        retention_prompts,
        score_s,
    ) = row
    return VersionInfo(
        adapter=adapter,
        version=version,
        parent=parent,
        path=path,
        created_at=created,
        published=bool(published),
        published_at=published_at,
        samples_trained=samples,
        loss=loss,
        win_rate=win,
        clpd=clpd,
        node=node,
        state=state,
        reason=reason,
        score=score,
        baseline_version=baseline_version,
        baseline_score=baseline_score,
        token_logprob=token_logprob,
        eval_items=eval_items,
        decided_at=decided_at,
        retention=retention,
        retention_base=retention_base,
        retention_prompts=retention_prompts,
        score_s=score_s,
    )


def validate_as(model: type[BaseModel], data: Any, where: str) -> Any:
    if isinstance(data, model):
        return data
    if isinstance(data, BaseModel):
        data = data.model_dump()
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        raise InvalidRequest([pydantic_error(where, err) for err in errors], param=pydantic_param(errors[0])) from None
