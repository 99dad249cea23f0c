"""Durable feedback queue and adapter/version registry on one SQLite file (WAL), the source of truth for learning.

Tables (schema version 1, see ``docs/learning.md``):

- ``adapters``: one row per tenant adapter, keyed by ``name``, the adapter's key (schema 9): ``tenant/name``
  for a tenant's adapter, so two tenants may each own ``support`` (models.adapter_key); method (sft | dpo), β, learning rate, LoRA settings,
  retraining mode and its periodic settings, and ``current_version``, the version served now
  (moved forward by :meth:`FeedbackDatabase.publish_version`, backward by :meth:`FeedbackDatabase.rollback`).
- ``versions``: every version number ever handed out. :meth:`FeedbackDatabase.reserve_version` inserts
  an unpublished row (so a crashed trainer never reuses a number or a directory name);
  :meth:`FeedbackDatabase.publish_version` flips it to published and, in the same transaction,
  marks the feedback it trained on as consumed. Rows are never removed: :meth:`FeedbackDatabase.prune_versions`
  marks the versions ``training.keep_versions`` no longer keeps as deleted (schema 8), so a number is never reused.
- ``feedback``: SFT samples and preference pairs; ``consumed_by_version`` stays NULL until a
  published version trained on the item (at-least-once training, never lost); with an adapter's
  ``epochs`` > 1, until that many published versions did (``passes`` counts them). ``held_out`` marks
  the adapter's held-out slice (chosen when the item is stored, :func:`is_held_out`): never trained on.
- ``idempotency_keys`` (schema 7): each ``Idempotency-Key`` of ``POST /v1/feedback`` per tenant, with the
  ids its batch got, written in the batch's own transaction (:meth:`FeedbackDatabase.submit_feedback`):
  a retried request stores nothing twice and gets the first answer; pruned after 24 h.

The quality gate (schema 3): with an adapter's gate on, a published version is a ``candidate`` that
is not served; :meth:`FeedbackDatabase.decide_version` makes it ``served`` (current) or ``rejected``
after the trainer scored it on the held-out slice against the served version, and pauses the
adapter after ``pause_after_rejections`` rejections in a row. :meth:`FeedbackDatabase.promote` serves
any published version; a rollback leaves the versions it went back past ``rolled_back``.

Durability: WAL journal with ``synchronous=FULL``. The HTTP layer answers 2xx only after
:meth:`FeedbackDatabase.add_feedback` returns, and that must mean "persisted" even across a power
loss, not only across a process crash (which is all ``NORMAL`` guarantees in WAL mode: it skips
the fsync at commit). The cost is one WAL fsync per batch, since a batch is one transaction.

Concurrency: all methods are synchronous and short (one transaction each, a few ms plus one
fsync for writes). One connection per store object, serialised by a lock, so an asyncio actor
may call them directly or through ``asyncio.to_thread``. Several processes on one host may open
the same file (writers take ``BEGIN IMMEDIATE`` and wait up to ``busy_timeout_s``); WAL does not
work on network file systems, so in a multi-node cluster exactly one actor should own the store.

Why one class over several modules: :class:`FeedbackDatabase` is one transaction boundary. Its
invariants span the three tables (an item is consumed exactly when a published version trained
on it; a version number is never reused; the current version moves only by publish, decide,
promote or rollback), and each method is one transaction that keeps them. So the class stays one
object with one connection and one lock; only its source is split by table, each part a base
class of it: ``schema.py`` (tables and migrations' column list), ``connection.py`` (the connection,
transactions, migrations and the row reads every part shares), ``adapter_registry.py`` (adapters),
``feedback_rows.py`` (the queue and idempotency keys), ``completion_rows.py`` (stored completions and
feedback by completion id) and ``version_registry.py`` (versions and
retention). What it accepts is in ``models.py`` and ``feedback_items.py``, what it returns in ``records.py``.
"""

from __future__ import annotations

from actors.learning.store.adapter_registry import AdapterRegistry
from actors.learning.store.completion_rows import CompletionRows
from actors.learning.store.feedback_rows import FeedbackRows
from actors.learning.store.schema import DB_FILENAME, IDEMPOTENCY_TTL_S, RESERVATION_PINS_S, SCHEMA_VERSION, UPDATABLE
from actors.learning.store.version_registry import VersionRegistry

__all__ = ["DB_FILENAME", "FeedbackDatabase", "IDEMPOTENCY_TTL_S", "RESERVATION_PINS_S", "SCHEMA_VERSION", "UPDATABLE"]


class FeedbackDatabase(AdapterRegistry, FeedbackRows, CompletionRows, VersionRegistry):
    """The feedback queue and adapter registry in ``<data_dir>/feedback.sqlite3``; every method is synchronous.

    Its constructor is :class:`~actors.learning.store.connection.StoreConnection`'s: it opens and migrates the file.
    """
