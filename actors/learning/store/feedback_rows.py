"""FeedbackRows: the feedback store's methods that store, count and hand out feedback items (the ``feedback`` and
``idempotency_keys`` tables)."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from actors.learning.store.connection import StoreConnection
from actors.learning.store.feedback_items import (
    LabelItem,
    PreferenceItem,
    SFTItem,
    idempotency_key_problem,
    is_held_out,
    validate_feedback,
)
from actors.learning.store.models import (
    KIND_FOR_METHOD,
    KIND_NAMES,
    METHOD_TAKES,
    IdempotencyKeyReused,
    InvalidRequest,
    TrainingQuotaExceeded,
    UnknownAdapter,
    UnknownItem,
)
from actors.learning.store.records import FeedbackItem, FeedbackReceipt
from actors.learning.store.schema import IDEMPOTENCY_TTL_S, ITEM_COLUMNS
from actors.learning.store.unit_kind import unit_kind


class FeedbackRows(StoreConnection):
    """The feedback queue: items stored once per batch, handed out oldest first, consumed by publish."""

    def add_feedback(
        self, items: Sequence[Mapping[str, Any]] | Mapping[str, Any], nodes: Sequence[int | None] | None = None
    ) -> list[int]:
        """Validate and store a batch all-or-nothing in one transaction; return the new ids in item order.

        ``nodes`` (per_node scope): the node that trains on each item, in item order; default: any.

        Raises :class:`InvalidRequest` (400: malformed item, wrong kind for the adapter's method,
        too large, empty batch) or :class:`UnknownAdapter` (404). Nothing is stored on any error.
        When this returns, the batch is durable (WAL, synchronous=FULL).
        """
        return self.submit_feedback(items, nodes).ids

    def submit_feedback(
        self,
        items: Sequence[Mapping[str, Any]] | Mapping[str, Any],
        nodes: Sequence[int | None] | None = None,
        *,
        idempotency_key: str | None = None,
        tenant: str | None = None,
        key_ttl_s: float = IDEMPOTENCY_TTL_S,
        refs: Sequence[Any] | None = None,
        tokens: Sequence[int] | None = None,
        tokens_per_day: int | None = None,
    ) -> FeedbackReceipt:
        """:meth:`add_feedback` that stores each ``idempotency_key`` once per ``tenant`` (None: local mode).

        The key and the ids it got are written in the same transaction as the items. The same key
        again within ``key_ttl_s`` (24 h) stores nothing and gives the first ids (``replayed``); with
        other items (compared after validation, so ``[item]`` and ``{"items": [item]}`` are the same)
        it raises :class:`IdempotencyKeyReused` (422). A request that failed stored no key, so its
        retry runs afresh. Expired keys are deleted here, with each keyed batch. ``nodes`` are not
        part of the comparison: a retry may be placed elsewhere, and the first placement stands.

        ``refs``: per item, the stored completion it was given on (``CompletionRows.resolve_feedback_refs``), whose
        answering version the row keeps. ``tokens``: per item, its training tokens, kept with the ``tenant``;
        with ``tokens_per_day``, a batch that would take the tenant's tokens since the UTC day began past it raises
        :class:`TrainingQuotaExceeded` (429) and stores nothing (counted in the insert's transaction).
        """
        parsed = validate_feedback(items, self.max_item_bytes, self.max_batch_items)
        if nodes is None:
            nodes = [None] * len(parsed)
        if len(nodes) != len(parsed):
            raise InvalidRequest(f"nodes: {len(nodes)} given for {len(parsed)} items")
        refs = list(refs) if refs else [None] * len(parsed)
        counts = list(tokens) if tokens else [None] * len(parsed)
        if len(refs) != len(parsed) or len(counts) != len(parsed):
            raise InvalidRequest(f"refs/tokens: not one per item of {len(parsed)}")
        if idempotency_key is not None and (problem := idempotency_key_problem(idempotency_key)):
            raise InvalidRequest(problem)
        scope = tenant or ""  # '' is no tenant name (TENANT_NAME_RE), so local mode has a scope of its own
        fingerprint = _fingerprint(parsed)
        now = time.time()
        with self._tx() as db:
            if idempotency_key is not None:
                db.execute("DELETE FROM idempotency_keys WHERE expires_at < ?", (now,))
                row = db.execute(
                    "SELECT fingerprint, ids FROM idempotency_keys WHERE tenant = ? AND key = ?",
                    (scope, idempotency_key),
                ).fetchone()
                if row is not None:
                    if row[0] != fingerprint:
                        raise IdempotencyKeyReused(
                            f"Idempotency-Key {idempotency_key!r} was used in the last {key_ttl_s / 3600:g} h for "
                            "other feedback items; a retry must send the same items, a new request a new key"
                        )
                    return FeedbackReceipt(json.loads(row[1]), replayed=True)
            if tokens_per_day is not None:
                self._check_quota(db, tenant, sum(c or 0 for c in counts), tokens_per_day, now)
            ids = self._insert_feedback(db, parsed, nodes, now, refs=refs, tokens=counts, tenant=tenant)
            if idempotency_key is not None:
                db.execute(
                    "INSERT INTO idempotency_keys (tenant, key, fingerprint, ids, created_at, expires_at) "
                    "VALUES (?,?,?,?,?,?)",
                    (scope, idempotency_key, fingerprint, json.dumps(ids), now, now + key_ttl_s),
                )
            return FeedbackReceipt(ids)

    def _check_quota(self, db: sqlite3.Connection, tenant: str | None, wanted: int, per_day: int, now: float) -> None:
        day = now - now % 86400.0  # the UTC day
        used = db.execute(
            "SELECT COALESCE(SUM(tokens), 0) FROM feedback WHERE tenant IS ? AND created_at >= ?", (tenant, day)
        ).fetchone()[0]
        if used + wanted > per_day:
            who = f"tenant {tenant!r}" if tenant else "this deployment"
            raise TrainingQuotaExceeded(
                f"{who} sent {used} training tokens of feedback today; these {wanted} would pass "
                f"limits.training_tokens_per_day={per_day}. Nothing was stored; the allowance starts again at "
                "00:00 UTC",
                retry_after_s=max(1, int(day + 86400.0 - now) + 1),
            )

    def training_tokens(self, since: float = 0.0) -> dict[str, int]:
        """Training tokens of the feedback each tenant sent since ``since`` ('' local mode)."""
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT COALESCE(tenant, ''), COALESCE(SUM(tokens), 0) FROM feedback "
                "WHERE created_at >= ? GROUP BY COALESCE(tenant, '')",
                (since,),
            ).fetchall()
        return dict(rows)

    def _insert_feedback(
        self,
        db: sqlite3.Connection,
        parsed: Sequence[SFTItem | PreferenceItem | LabelItem],
        nodes: Sequence[int | None],
        now: float,
        *,
        refs: Sequence[Any] = (),
        tokens: Sequence[int | None] = (),
        tenant: str | None = None,
    ) -> list[int]:
        refs = list(refs) or [None] * len(parsed)
        tokens = list(tokens) or [None] * len(parsed)
        self._check_adapters(db, parsed)
        # The held-out slice is assigned here, once, by each item's number within its adapter.
        names = {it.adapter for it in parsed}
        seen = {a: db.execute("SELECT COUNT(*) FROM feedback WHERE adapter = ?", (a,)).fetchone()[0] for a in names}
        # A full unit has no quality gate to score a held-out slice with: every item trains.
        share = {
            a: unit_kind(self._adapter_row(db, a)[1]).held_out_share(
                self._gate_overrides(db, a).over(self.gate_defaults).held_out_share
            )
            for a in names
        }
        ids = []
        for item, node, ref, count in zip(parsed, nodes, refs, tokens):
            cur = db.execute(
                "INSERT INTO feedback (adapter, kind, prompt, completion, chosen, rejected, created_at, node, "
                "messages, label, completion_id, answered_version, tenant, tokens) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    item.adapter,
                    item.kind,
                    item.prompt or "",
                    getattr(item, "completion", None),
                    getattr(item, "chosen", None),
                    getattr(item, "rejected", None),
                    now,
                    node,
                    item.messages_json(),
                    None if item.kind != "label" else int(item.label),
                    None if ref is None else ref.completion_id,
                    None if ref is None else ref.answered_version,
                    tenant,
                    count,
                ),
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
        unknown = [
            f"items[{i}].adapter: no adapter named {it.adapter!r}"
            for i, it in enumerate(parsed)
            if methods[it.adapter] is None
        ]
        if unknown:
            raise UnknownAdapter("; ".join(unknown[:10]))
        wrong = [
            f"items[{i}]: adapter {it.adapter!r} trains with {methods[it.adapter]} and takes "
            f"{METHOD_TAKES[methods[it.adapter]]}, not {KIND_NAMES[it.kind]}"
            for i, it in enumerate(parsed)
            if KIND_FOR_METHOD[methods[it.adapter]] != it.kind
        ]
        if wrong:
            raise InvalidRequest(wrong)

    def take(
        self, adapter: str, limit: int, exclude_ids: Iterable[int] = (), node: int | None = None
    ) -> list[FeedbackItem]:
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
                f"SELECT {ITEM_COLUMNS} FROM feedback WHERE adapter = ? AND held_out = 0 AND consumed_by_version IS NULL "
                "AND (? IS NULL OR node = ?) ORDER BY passes, id LIMIT ?",
                (adapter, node, node, limit + len(exclude)),
            ).fetchall()
        return [FeedbackItem.from_row(row) for row in rows if row[0] not in exclude][:limit]

    def queued(self, adapter: str) -> int:
        """Number of items of ``adapter`` that no published version has trained on (held-out ones excluded)."""
        with self._tx(write=False) as db:
            self._adapter_row(db, adapter)
            return db.execute(
                "SELECT COUNT(*) FROM feedback WHERE adapter = ? AND held_out = 0 AND consumed_by_version IS NULL",
                (adapter,),
            ).fetchone()[0]

    def queue_summary(self, node: int | None = None) -> dict[str, tuple[int, float]]:
        """adapter -> (unconsumed items, created_at of the oldest), for adapters with a non-empty queue.

        ``node`` (per_node scope): count only the items routed to that node.
        """
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT adapter, COUNT(*), MIN(created_at) FROM feedback "
                "WHERE held_out = 0 AND consumed_by_version IS NULL AND (? IS NULL OR node = ?) "
                "GROUP BY adapter",
                (node, node),
            ).fetchall()
        return {a: (n, t) for a, n, t in rows}

    def queued_by_node(self) -> dict[str, dict[int, int]]:
        """adapter -> {node: unconsumed items routed to it}, for routing new feedback (per_node scope)."""
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT adapter, node, COUNT(*) FROM feedback WHERE held_out = 0 AND "
                "consumed_by_version IS NULL AND node IS NOT NULL GROUP BY adapter, node"
            ).fetchall()
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
            rows = db.execute(
                f"SELECT {ITEM_COLUMNS} FROM feedback WHERE adapter = ? AND held_out = 1 "
                "AND consumed_by_version IS NULL ORDER BY id LIMIT ?",
                (adapter, max(0, limit)),
            ).fetchall()
        return [FeedbackItem.from_row(row) for row in rows]

    def existing_feedback_ids(self, ids: Iterable[int]) -> list[int]:
        """Which of ``ids`` the store holds (a fault drill's check that nothing acknowledged was lost)."""
        wanted = sorted({int(i) for i in ids})
        found: list[int] = []
        with self._tx(write=False) as db:
            for start in range(0, len(wanted), 500):
                chunk = wanted[start : start + 500]
                found += [
                    r[0]
                    for r in db.execute(f"SELECT id FROM feedback WHERE id IN ({','.join('?' * len(chunk))})", chunk)
                ]
        return found

    def feedback_item(self, item_id: int) -> tuple[FeedbackItem, int | None]:
        """One item and the version that consumed it (None while queued); :class:`UnknownItem` (404)."""
        with self._tx(write=False) as db:
            row = db.execute(
                f"SELECT {ITEM_COLUMNS}, consumed_by_version FROM feedback WHERE id = ?", (item_id,)
            ).fetchone()
        if row is None:
            raise UnknownItem(f"no feedback item {item_id}")
        return FeedbackItem.from_row(row[:-1]), row[-1]


def _fingerprint(parsed: Sequence[SFTItem | PreferenceItem]) -> str:
    """What an idempotency key is compared on: the validated items, in order, as canonical JSON."""
    canon = json.dumps(
        [{"kind": it.kind, **it.model_dump(mode="json")} for it in parsed],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()
