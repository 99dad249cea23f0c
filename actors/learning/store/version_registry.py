"""VersionRegistry: the feedback store's methods that reserve, publish, judge, serve and prune versions (the
``versions`` and ``node_heads`` tables)."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

from actors.learning.store.connection import StoreConnection, version_from_row
from actors.learning.store.models import GateOverrides, InvalidRequest, VersionConflict
from actors.learning.store.records import (
    AdapterInfo,
    ServedAdapter,
    ServedVersion,
    VersionInfo,
    VersionScores,
    VersionVerdict,
)
from actors.learning.store.schema import RESERVATION_PINS_S, VERSION_COLUMNS
from actors.learning.store.unit_kind import unit_kind


def _score_values(s: VersionScores) -> tuple[float | int | None, ...]:
    """A version's scores in the order both UPDATEs of the versions table name their columns (score ... score_s)."""
    return (
        s.score,
        s.win_rate,
        s.clpd,
        s.token_logprob,
        s.eval_items,
        s.retention,
        s.retention_base,
        s.retention_prompts,
        s.score_s,
    )


class VersionRegistry(StoreConnection):
    """Versions: every number handed out, its state, and each line's current one (synced, or a node's)."""

    def reserve_version(self, adapter: str, node: int | None = None) -> VersionInfo:
        """Hand out the next version number (never reused), unpublished, with ``parent`` = the current version.

        The trainer writes ``<root>/<adapter>/v<version>/`` under this number, then calls publish_version.
        ``node`` (per_node scope): a version of that node's copy; numbers stay unique across nodes.
        """
        with self._tx() as db:
            current = self._current(db, adapter, node)
            last = db.execute("SELECT MAX(version) FROM versions WHERE adapter = ?", (adapter,)).fetchone()[0]
            version = (last or 0) + 1
            db.execute(
                "INSERT INTO versions (adapter, version, parent, created_at, node) VALUES (?,?,?,?,?)",
                (adapter, version, current, time.time(), node),
            )
            return self._version(db, adapter, version)

    def publish_version(
        self,
        adapter: str,
        version: int,
        path: str | Path,
        item_ids: Iterable[int],
        samples_trained: int,
        loss: float | None,
        *,
        check_parent: bool = True,
        gated: bool | None = None,
        note: str | None = None,
    ) -> VersionInfo:
        """Publish a reserved version and count its pass over ``item_ids``: one transaction.

        With the adapter's quality gate on (``gated`` None: its settings decide) the version becomes a
        ``candidate``: complete and durable, its pass over its items counted, but not served until
        :meth:`decide_version` passes it. With the gate off it is ``served`` and current at once.
        Each of ``item_ids`` counts one pass; it is consumed by the version that makes its passes reach
        the adapter's ``epochs`` (1: this one), and stays queued until then. Items already consumed by
        another version keep their first consumer. With ``check_parent``,
        raises :class:`VersionConflict` (and changes nothing) if the current version moved since
        the reservation (e.g. a rollback): the trainer should reload the current version and retrain.
        ``note``: where the version came from (an upload), written before the reason its state has.
        """
        ids = sorted(set(item_ids))
        with self._tx() as db:
            v = self._version(db, adapter, version)
            current = self._current(db, adapter, v.node)
            if v.published:
                raise VersionConflict(f"{adapter} v{version} is already published")
            if check_parent and v.parent != current:
                raise VersionConflict(
                    f"{adapter} v{version} was trained from v{v.parent}, but the current "
                    f"version is now v{current}; reload it and train again"
                )
            foreign = [
                i
                for i in ids
                if (r := db.execute("SELECT adapter FROM feedback WHERE id = ?", (i,)).fetchone()) is None
                or r[0] != adapter
            ]
            if foreign:
                raise InvalidRequest(f"item_ids: {foreign[:10]} are not feedback of adapter {adapter!r}")
            if gated is None:
                gated = self._gate_overrides(db, adapter).over(self.gate_defaults).enabled
            now = time.time()
            reason = "waiting for the quality gate" if gated else "served at once: the quality gate is off"
            db.execute(
                "UPDATE versions SET published = 1, published_at = ?, path = ?, samples_trained = ?, "
                "loss = ?, state = ?, reason = ?, decided_at = ? WHERE adapter = ? AND version = ?",
                (
                    now,
                    str(path),
                    samples_trained,
                    loss,
                    "candidate" if gated else "served",
                    f"{note}; {reason}" if note else reason,
                    None if gated else now,
                    adapter,
                    version,
                ),
            )
            # One more pass each; consumed (no longer queued) once the adapter's epochs are done.
            epochs = db.execute("SELECT epochs FROM adapters WHERE name = ?", (adapter,)).fetchone()[0]
            db.executemany(
                "UPDATE feedback SET passes = passes + 1, consumed_by_version = CASE WHEN passes + 1 >= ? "
                "THEN ? END WHERE id = ? AND consumed_by_version IS NULL",
                [(epochs, version, i) for i in ids],
            )
            if not gated:
                self._set_current(db, adapter, version, v.node)
            return self._version(db, adapter, version)

    def abandon_reservation(self, adapter: str, version: int) -> bool:
        """A reserved version that will never be published (its upload's files could not be written): marked
        deleted, so it pins no parent and is never listed; its number stays taken. Whether it was unpublished."""
        with self._tx() as db:
            return (
                db.execute(
                    "UPDATE versions SET deleted_at = ? WHERE adapter = ? AND version = ? AND published = 0 "
                    "AND deleted_at IS NULL",
                    (time.time(), adapter, version),
                ).rowcount
                > 0
            )

    def decide_version(self, adapter: str, version: int, verdict: VersionVerdict) -> VersionInfo:
        """The quality gate's verdict on a candidate, in one transaction: ``served`` (made current) or ``rejected``.

        ``verdict.scores`` are stored beside it (a None win rate, CLPD or token log-prob keeps a stored
        value). ``verdict.counts`` False: a version held back for want of held-out evidence (``gate.thin_evidence`` wait), not
        a rejection of its quality: it does not count toward ``pause_after_rejections``.

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
            passed, reason, s = verdict.passed, verdict.reason, verdict.scores
            superseded = v.parent != current
            if superseded:
                passed, reason = (
                    False,
                    (
                        f"superseded: trained from {_name(v.parent)}, but {_name(current)} is served "
                        f"now (a rollback or promotion); {reason}"
                    ),
                )
            now = time.time()
            db.execute(
                "UPDATE versions SET state = ?, reason = ?, decided_at = ?, baseline_version = ?, baseline_score = ?, "
                "score = ?, win_rate = COALESCE(?, win_rate), clpd = COALESCE(?, clpd), "
                "token_logprob = COALESCE(?, token_logprob), eval_items = ?, retention = ?, retention_base = ?, "
                "retention_prompts = ?, score_s = ? WHERE adapter = ? AND version = ?",
                (
                    "served" if passed else "rejected",
                    reason,
                    now,
                    verdict.baseline_version,
                    verdict.baseline_score,
                    *_score_values(s),
                    adapter,
                    version,
                ),
            )
            if passed:
                self._set_current(db, adapter, version, v.node)
                db.execute(
                    "UPDATE adapters SET rejections_in_row = 0, promotions_total = promotions_total + 1 WHERE name = ?",
                    (adapter,),
                )
            elif not superseded and verdict.counts:
                db.execute(
                    "UPDATE adapters SET rejections_in_row = rejections_in_row + 1, "
                    "rejections_total = rejections_total + 1 WHERE name = ?",
                    (adapter,),
                )
                gate, paused, in_row, _, _ = self._gate_row(db, adapter)
                limit = gate.over(self.gate_defaults).pause_after_rejections
                if limit and in_row >= limit and paused is None:
                    why = (
                        f"training paused: {in_row} versions in a row rejected by the quality gate (the last, "
                        f'v{version}: {reason}); send PATCH {{"paused": false}} or promote a version to resume'
                    )
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
                db.execute(
                    "UPDATE versions SET state = 'served', reason = ?, decided_at = ? WHERE adapter = ? "
                    "AND version = ?",
                    (why, time.time(), adapter, version),
                )
                db.execute("UPDATE adapters SET promotions_total = promotions_total + 1 WHERE name = ?", (adapter,))
            self._set_current(db, adapter, version, v.node)
            db.execute("UPDATE adapters SET paused_reason = NULL, rejections_in_row = 0 WHERE name = ?", (adapter,))
            return self._adapter_info(db, adapter)

    def _roll_back_newer(self, db: sqlite3.Connection, adapter: str, version: int, node: int | None) -> None:
        """Served versions newer than ``version`` on its line (its node's, or the synced one) are rolled back."""
        db.execute(
            "UPDATE versions SET state = 'rolled_back', reason = ?, decided_at = ? WHERE adapter = ? "
            "AND node IS ? AND version > ? AND state = 'served'",
            (f"rolled back to v{version}", time.time(), adapter, node, version),
        )

    def candidates(self, node: int | None = None) -> list[VersionInfo]:
        """Versions waiting for the quality gate, of every adapter, on one line (``node``; None: synced)."""
        with self._tx(write=False) as db:
            rows = db.execute(
                f"SELECT {VERSION_COLUMNS} FROM versions WHERE state = 'candidate' AND node IS ? "
                "ORDER BY adapter, version",
                (node,),
            ).fetchall()
        return [version_from_row(row) for row in rows]

    def record_scores(self, adapter: str, version: int, scores: VersionScores) -> VersionInfo:
        """Store scores measured for a version outside the gate (the gate off); None keeps a value."""
        s = scores
        with self._tx() as db:
            self._version(db, adapter, version)
            db.execute(
                "UPDATE versions SET score = COALESCE(?, score), win_rate = COALESCE(?, win_rate), "
                "clpd = COALESCE(?, clpd), token_logprob = COALESCE(?, token_logprob), "
                "eval_items = COALESCE(?, eval_items), retention = COALESCE(?, retention), "
                "retention_base = COALESCE(?, retention_base), "
                "retention_prompts = COALESCE(?, retention_prompts), score_s = COALESCE(?, score_s) "
                "WHERE adapter = ? AND version = ?",
                (*_score_values(s), adapter, version),
            )
            return self._version(db, adapter, version)

    def record_eval(self, adapter: str, version: int, win_rate: float, clpd: float) -> VersionInfo:
        """Store the alignment metrics (MACE §3.1) measured for a version."""
        return self.record_scores(adapter, version, VersionScores(win_rate=float(win_rate), clpd=float(clpd)))

    def rollback(self, adapter: str, version: int) -> AdapterInfo:
        """Point ``current_version`` at an earlier published version; nothing is deleted or re-queued.

        A full unit's ``version`` 0 is the starting model (``current_version`` becomes null).

        A per_node version rolls back its own node's copy only.
        """
        with self._tx() as db:
            row = self._adapter_row(db, adapter)  # 404 names the adapter, not the version
            if version == 0:
                # A full unit's version 0 is the model the deployment started with: serve it again.
                if unit_kind(row[1]).lowest_rollback_version > 0:
                    raise InvalidRequest(
                        "version: 0 (the starting model) is a full unit's; an adapter rolls back to v1 or later"
                    )
                self._roll_back_newer(db, adapter, 0, None)
                db.execute("UPDATE adapters SET current_version = NULL WHERE name = ?", (adapter,))
                return self._adapter_info(db, adapter)
            v = self._version(db, adapter, version)
            current = self._current(db, adapter, v.node)
            if not v.published:
                raise VersionConflict(f"{adapter} v{version} was never published")
            if v.state not in ("served", "rolled_back"):
                raise VersionConflict(
                    f"{adapter} v{version} is {v.state} and was never served; rollback goes back "
                    f"to a version that was served (POST /v1/adapters/{adapter}/promote serves any)"
                )
            if current is not None and version > current:
                raise VersionConflict(
                    f"{adapter} v{version} is newer than the current v{current}; "
                    f"rollback only goes back; POST /v1/adapters/{adapter}/promote "
                    f'{{"version": {version}}} serves it again'
                )
            self._roll_back_newer(db, adapter, version, v.node)
            if version != current:
                db.execute(
                    "UPDATE versions SET state = 'served', reason = ?, decided_at = ? WHERE adapter = ? "
                    "AND version = ?",
                    (f"served again by a rollback from {_name(current)}", time.time(), adapter, version),
                )
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
                "ON v.adapter = a.name AND v.version = a.current_version"
            ).fetchall()
            heads = db.execute(
                "SELECT h.adapter, h.node, h.version, v.path FROM node_heads h JOIN versions v "
                "ON v.adapter = h.adapter AND v.version = h.version WHERE v.path IS NOT NULL"
            ).fetchall()
        nodes: dict[str, dict[int, ServedVersion]] = {}
        for adapter, node, version, path in heads:
            nodes.setdefault(adapter, {})[node] = ServedVersion(version, path)
        return {
            name: ServedAdapter(
                method, ServedVersion(version, path) if version is not None and path else None, nodes.get(name, {})
            )
            for name, method, version, path in current
        }

    def get_version(self, adapter: str, version: int) -> VersionInfo:
        """One version (published or only reserved); :class:`UnknownVersion` (404)."""
        with self._tx(write=False) as db:
            self._adapter_row(db, adapter)
            return self._version(db, adapter, version)

    # -- retention -----------------------------------------------------------------------------

    def prune_versions(self, adapter: str, keep: int | None = None) -> list[int]:
        """Delete the versions of ``adapter`` that nothing needs any more; the deleted numbers, in one transaction.

        ``keep`` (default ``keep_versions``; None: keep all) newest published versions stay, and so does any
        version still needed whatever its age: the adapter's current one, each node's current one (per_node),
        a candidate, and the parent of a reservation whose training has not published yet (it may still
        publish, or the trainer reload from it; a reservation older than a day is taken for a crashed one). A deleted
        row stays, marked ``deleted_at``, so its number
        is never handed out again and the items it consumed still name it; it is no longer listed, and
        rollback, promote and get_version answer 404 for it. Its files are the caller's to remove
        (:meth:`deleted_version_paths`, then :meth:`forget_version_paths`): the FeedbackStore actor does both.
        """
        keep = self.keep_versions if keep is None else keep
        if keep is None:
            return []
        with self._tx() as db:
            current = self._current(db, adapter)
            live = [
                r[0]
                for r in db.execute(
                    "SELECT version FROM versions WHERE adapter = ? AND published = 1 "
                    "AND deleted_at IS NULL ORDER BY version DESC",
                    (adapter,),
                )
            ]
            needed = set(live[:keep]) | {current}
            needed |= {r[0] for r in db.execute("SELECT version FROM node_heads WHERE adapter = ?", (adapter,))}
            needed |= {
                r[0]
                for r in db.execute(
                    "SELECT version FROM versions WHERE adapter = ? AND state = 'candidate'", (adapter,)
                )
            }
            # A reservation older than a day is a crashed trainer's, not a training in progress: it pins nothing.
            needed |= {
                r[0]
                for r in db.execute(
                    "SELECT parent FROM versions WHERE adapter = ? AND published = 0 "
                    "AND deleted_at IS NULL AND parent IS NOT NULL AND created_at > ?",
                    (adapter, time.time() - RESERVATION_PINS_S),
                )
            }
            doomed = sorted(v for v in live if v not in needed)
            db.executemany(
                "UPDATE versions SET deleted_at = ? WHERE adapter = ? AND version = ?",
                [(time.time(), adapter, v) for v in doomed],
            )
            return doomed

    def deleted_version_paths(self, adapter: str) -> dict[int, str]:
        """version -> location of the deleted versions of ``adapter`` whose files are not known to be gone."""
        with self._tx(write=False) as db:
            return dict(
                db.execute(
                    "SELECT version, path FROM versions WHERE adapter = ? AND deleted_at IS NOT NULL "
                    "AND path IS NOT NULL ORDER BY version",
                    (adapter,),
                ).fetchall()
            )

    def forget_version_paths(self, adapter: str, versions: Iterable[int]) -> None:
        """The files of these deleted versions are gone: their rows stop naming a location."""
        with self._tx() as db:
            db.executemany(
                "UPDATE versions SET path = NULL WHERE adapter = ? AND version = ? AND deleted_at IS NOT NULL",
                [(adapter, int(v)) for v in versions],
            )


def _name(version: int | None) -> str:
    """A version in messages: ``v3``, or the base model before the first."""
    return "the base model" if version is None else f"v{version}"


def _overrides_json(gate: GateOverrides) -> str | None:
    own = gate.model_dump(exclude_none=True)
    return json.dumps(own) if own else None
