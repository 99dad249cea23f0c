"""FeedbackStore: the one actor that owns the durable feedback store (SQLite, actors/learning/store/sqlite.py).

SQLite's WAL does not work over network file systems, so exactly one process per app owns the
file; the ingress and the trainer reach it through this actor. Methods mirror ``FeedbackDatabase``
and run in a thread so a slow fsync never blocks the actor's event loop.

The actor is pinned to one node (``storage.store_node``, the head by default) and resolves its
data directory there, so a restart reopens the same database. With ``storage.adapters_uri`` unset
it also keeps the published adapter versions, in ``data_dir/adapters`` on that node: trainer ranks
on other nodes send a version's files here (``write_version``) and replicas on other nodes fetch
them (``read_version``), through Ray's object store (actors/learning/versions/files.py).

Retries: the planner creates this actor with ``max_task_retries``, so Ray sends a call that was in
flight when the actor died again to the restarted actor. That is safe for reads and for writes
that give the same result twice (PATCH, rollback, promote, pause). Feedback goes through
:meth:`FeedbackStore.submit_feedback`, whose idempotency key makes a resent batch store once; the
keyless :meth:`FeedbackStore.add_feedback` and :meth:`FeedbackStore.create_adapter` (a resent
create would answer 409 for the caller's own adapter) opt out of Ray's retries, so their callers
see the actor's death and decide.

Retention (``training.keep_versions``): after each publish and each gate verdict the actor deletes
the adapter's versions nothing needs any more (:meth:`FeedbackStore.prune_versions`), their rows
first (then they answer 404) and their files after, and keeps the optimizer state only where
training may resume from. A crash between the two leaves files that the next prune removes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ParamSpec, TypeVar

import ray

from actors.learning.store.completion_rows import FeedbackRef, StoredCompletion
from actors.learning.store.feedback_items import RawItems
from actors.learning.store.models import AdapterSpec, GateSettings
from actors.learning.store.records import (
    AdapterInfo,
    FeedbackItem,
    FeedbackReceipt,
    ServedState,
    UploadMeta,
    VersionInfo,
    VersionScores,
    VersionVerdict,
    VersionWritten,
)
from actors.learning.store.sqlite import IDEMPOTENCY_TTL_S, FeedbackDatabase
from actors.learning.versions.layout import (
    CACHE_DIRNAME,
    OPTIMIZER_FILE,
    cache_root_for,
    is_uri,
    read_version_files,
    remove_version,
    remove_version_file,
    version_dir,
    write_version_files,
)
from settings import AppConfig

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


def settings_key(config: AppConfig) -> str:
    """What a running store must have been started with to serve ``config``'s app (see Planner._start_feedback).

    The settings as the config declares them, not paths resolved in the caller's process: each node
    may resolve ``data_dir`` to a directory of its own (``COSERVE_DATA_DIR``), so the planner's node
    and the store's node see different paths for the same setting.
    """
    return json.dumps(
        {
            "data_dir": config.data_dir,
            "storage": config.storage.model_dump(),
            "gate": config.training.gate.model_dump(),
            "limits": [
                config.limits.feedback_max_items,
                config.limits.feedback_max_item_bytes,
                config.limits.adapters_per_tenant,
            ],
            "keep_versions": config.training.keep_versions,
        },
        sort_keys=True,
    )


class FeedbackStore:
    """Create with ``ray.remote(FeedbackStore).options(name=cfg.store_actor_name, ...)``.

    Every method is the database's method of the same name (:class:`FeedbackDatabase`) with its own types, run
    in a thread by :meth:`_read` or :meth:`_write`; a write also raises the change numbers the long polls wait on.
    """

    def __init__(self, config: AppConfig) -> None:
        # Resolved here, on the store's node: the path names this node's disk, not the planner's.
        self.data_dir = config.data_path
        self.adapters_root = config.adapters_path
        self.adapters_uri = config.storage.adapters_uri  # where versions are written, when set (an upload's too)
        self.db = FeedbackDatabase(
            self.data_dir,
            gate_defaults=config.training.gate.model_dump(),
            max_item_bytes=config.limits.feedback_max_item_bytes,
            max_batch_items=config.limits.feedback_max_items,
            max_adapters_per_tenant=config.limits.adapters_per_tenant,
            keep_versions=config.training.keep_versions,
        )
        self.cache_root = self.data_dir / CACHE_DIRNAME  # this node's copies of versions kept at a URI
        self._settings = settings_key(config)
        self._changes = 0  # raised by every write that can give the trainer work (see wait_for_change)
        # Raised by every write that can change what is served (see served_versions). It starts at the clock
        # (µs), so it never goes back across a restart of this actor and a follower's old number is stale.
        self._served_change = time.time_ns() // 1000
        self._changed: asyncio.Condition | None = None

    async def _in_thread(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``call(*args, **kwargs)`` (a database method) in a thread, so a slow fsync never blocks the event loop."""
        return await asyncio.to_thread(call, *args, **kwargs)

    async def _write(self, call: Callable[[], T], *, serves: bool = False, work: bool = True) -> T:
        """Run a write (``call``, a database method bound to its arguments) and wake the long polls: ``work``, it can
        give the trainer work (new feedback, a changed adapter); ``serves``, it can change what is served (a
        publish, a verdict, a rollback, a promotion)."""
        try:
            return await asyncio.to_thread(call)
        finally:
            self._changes += int(work)
            self._served_change += int(serves)
            async with self._condition():
                self._condition().notify_all()

    async def _write_version(self, call: Callable[[], VersionInfo]) -> VersionWritten:
        """A write that can change what is served and answers a version, with the served-change number it raised
        (a caller that waits for the planner to serve it waits for that number: ``Planner.load_adapter``)."""
        info = await self._write(call, serves=True)
        return VersionWritten(info, self._served_change)

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()  # made on the actor's event loop
        return self._changed

    def settings_key(self) -> str:
        return self._settings

    def location(self) -> tuple[str, str, str]:
        """(Ray node id, data directory, adapters root) of this actor: where the database and versions live."""
        return ray.get_runtime_context().get_node_id(), str(self.data_dir), str(self.adapters_root)

    async def write_version(self, adapter: str, version: int, files: dict[str, bytes]) -> str:
        """Write a version a rank on another node saved, atomically, under this node's adapters root; its path."""
        return str(await asyncio.to_thread(write_version_files, self.adapters_root, adapter, version, files))

    async def read_version(self, path: str) -> dict[str, bytes]:
        """The files of a version kept on this node (for a replica or rank on another node)."""
        return await asyncio.to_thread(read_version_files, self.adapters_root, path)

    async def wait_for_change(self, seen: int, timeout_s: float) -> int:
        """Block until a write newer than ``seen`` (new feedback, a changed adapter) or ``timeout_s``;
        returns the newest change number. An idle trainer waits here instead of polling the queue."""
        cond = self._condition()
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self._changes > seen), timeout=timeout_s)
            except TimeoutError:
                pass
        return self._changes

    async def served_versions(self, seen: int, timeout_s: float) -> ServedState:
        """Every adapter's served versions once the served-change number differs from ``seen`` (or after
        ``timeout_s``): the long poll the planner follows, so what the replicas serve is read from here,
        never pushed as a copy."""
        cond = self._condition()
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self._served_change != seen), timeout=timeout_s)
            except TimeoutError:
                pass
            change = self._served_change
        return ServedState(change, await self._in_thread(self.db.served))

    # ---- adapters (actors/learning/store/adapter_registry.py) -------------------------------------

    @ray.method(max_task_retries=0)  # not idempotent: see the module docstring
    async def create_adapter(self, spec: AdapterSpec) -> AdapterInfo:
        return await self._write(lambda: self.db.create_adapter(spec))

    async def update_adapter(self, name: str, changes: Mapping[str, Any]) -> AdapterInfo:
        """``changes``: the PATCH body as the client sent it; the database validates it (400 for a bad field)."""
        return await self._write(lambda: self.db.update_adapter(name, changes))

    async def pause_adapter(self, name: str, reason: str) -> AdapterInfo:
        return await self._write(lambda: self.db.pause_adapter(name, reason))

    async def get_adapter(self, name: str) -> AdapterInfo:
        return await self._in_thread(self.db.get_adapter, name)

    async def adapter_tenant(self, name: str) -> str | None:
        return await self._in_thread(self.db.adapter_tenant, name)

    async def list_adapters(self) -> list[AdapterInfo]:
        return await self._in_thread(self.db.list_adapters)

    async def gate_settings(self, adapter: str) -> GateSettings:
        return await self._in_thread(self.db.gate_settings, adapter)

    # ---- the feedback queue (actors/learning/store/feedback_rows.py) ------------------------------

    @ray.method(max_task_retries=0)  # no idempotency key: a resent call could store the batch twice
    async def add_feedback(self, items: RawItems, nodes: list[int | None] | None = None) -> list[int]:
        """``items``: feedback as the client sent it; the database validates it (400 for a bad item)."""
        return await self._write(lambda: self.db.add_feedback(items, nodes))

    async def submit_feedback(
        self,
        items: RawItems,
        nodes: list[int | None] | None = None,
        *,
        idempotency_key: str | None = None,
        tenant: str | None = None,
        key_ttl_s: float = IDEMPOTENCY_TTL_S,
        refs: list[FeedbackRef | None] | None = None,
        tokens: list[int] | None = None,
        tokens_per_day: int | None = None,
    ) -> FeedbackReceipt:
        """``FeedbackDatabase.submit_feedback``: with a key, a call Ray (or the caller) sends again stores once."""
        return await self._write(
            lambda: self.db.submit_feedback(
                items,
                nodes,
                idempotency_key=idempotency_key,
                tenant=tenant,
                key_ttl_s=key_ttl_s,
                refs=refs,
                tokens=tokens,
                tokens_per_day=tokens_per_day,
            )
        )

    async def training_tokens(self, since: float = 0.0) -> dict[str, int]:
        return await self._in_thread(self.db.training_tokens, since)

    async def take(
        self, adapter: str, limit: int, exclude_ids: Iterable[int] = (), node: int | None = None
    ) -> list[FeedbackItem]:
        return await self._in_thread(self.db.take, adapter, limit, list(exclude_ids), node)

    async def queue_summary(self, node: int | None = None) -> dict[str, tuple[int, float]]:
        return await self._in_thread(self.db.queue_summary, node)

    async def queued_by_node(self) -> dict[str, dict[int, int]]:
        return await self._in_thread(self.db.queued_by_node)

    async def existing_feedback_ids(self, ids: list[int]) -> list[int]:
        return await self._in_thread(self.db.existing_feedback_ids, ids)

    async def feedback_item(self, item_id: int) -> tuple[FeedbackItem, int | None]:
        return await self._in_thread(self.db.feedback_item, item_id)

    async def held_out_items(self, adapter: str, limit: int) -> list[FeedbackItem]:
        return await self._in_thread(self.db.held_out_items, adapter, limit)

    # ---- stored completions (actors/learning/store/completion_rows.py) ----------------------------

    async def store_completion(self, record: StoredCompletion, keep_days: float | None = None) -> None:
        await self._in_thread(self.db.store_completion, record, keep_days)  # wakes nobody: no training, nothing served

    async def get_completion(
        self, completion_id: str, tenant: str | None, keep_days: float | None = None
    ) -> StoredCompletion:
        return await self._in_thread(self.db.get_completion, completion_id, tenant, keep_days)

    @ray.method(max_task_retries=0)  # a resent delete would answer 404 for the caller's own deletion
    async def delete_completion(self, completion_id: str, tenant: str | None) -> None:
        await self._in_thread(self.db.delete_completion, completion_id, tenant)

    async def resolve_feedback_refs(
        self, items: list[Any], tenant: str | None, keep_days: float | None = None
    ) -> tuple[list[Any], list[FeedbackRef | None]]:
        """``items``: feedback as the client sent it, those given by ``completion_id`` replaced by what they name."""
        return await self._in_thread(self.db.resolve_feedback_refs, items, tenant, keep_days)

    # ---- versions (actors/learning/store/version_registry.py) -------------------------------------

    async def reserve_version(self, adapter: str, node: int | None = None) -> VersionInfo:
        return await self._in_thread(self.db.reserve_version, adapter, node)

    async def publish_version(
        self,
        adapter: str,
        version: int,
        path: str,
        item_ids: Iterable[int],
        samples_trained: int,
        loss: float | None,
        *,
        gated: bool | None = None,
    ) -> VersionWritten:
        """Publish a reserved version in one transaction (``FeedbackDatabase.publish_version``), then retention."""
        ids = list(item_ids)
        written = await self._write_version(
            lambda: self.db.publish_version(adapter, version, path, ids, samples_trained, loss, gated=gated)
        )
        await self._prune_quietly(adapter)
        return written

    @ray.method(max_task_retries=0)  # not idempotent: a resent upload would publish a second version
    async def add_version(
        self,
        adapter: str,
        files: dict[str, bytes],
        meta: UploadMeta,
        *,
        gated: bool | None = None,
        note: str | None = None,
    ) -> VersionInfo:
        """An uploaded adapter version, already checked, reserved, written and published as a trained one
        (actors/learning/store/uploads.py). Wakes the trainer (``work``): its gate judges a candidate."""
        from actors.learning.store.uploads import add_uploaded_version

        added = await self._write(
            lambda: add_uploaded_version(
                self.db, self.adapters_root, self.adapters_uri, adapter, files, meta, gated=gated, note=note
            ),
            serves=True,
        )
        await self._prune_quietly(adapter)
        return added

    async def rollback(self, adapter: str, version: int) -> AdapterInfo:
        return await self._write(lambda: self.db.rollback(adapter, version), serves=True)

    async def promote(self, adapter: str, version: int) -> AdapterInfo:
        return await self._write(lambda: self.db.promote(adapter, version), serves=True)

    async def decide_version(self, adapter: str, version: int, verdict: VersionVerdict) -> VersionWritten:
        """The gate's verdict in one transaction (``FeedbackDatabase.decide_version``), then retention. Wakes the
        trainer too: a decision lets it go on with that adapter (or stop it, when it pauses)."""
        decided = await self._write_version(lambda: self.db.decide_version(adapter, version, verdict))
        await self._prune_quietly(adapter)
        return decided

    async def record_scores(self, adapter: str, version: int, scores: VersionScores) -> VersionInfo:
        """Scores measured for a version served without the gate; None keeps a stored value."""
        return await self._in_thread(self.db.record_scores, adapter, version, scores)

    async def record_eval(self, adapter: str, version: int, win_rate: float, clpd: float) -> VersionInfo:
        return await self._in_thread(self.db.record_eval, adapter, version, win_rate, clpd)

    async def candidates(self, node: int | None = None) -> list[VersionInfo]:
        return await self._in_thread(self.db.candidates, node)

    async def current_version(self, adapter: str, node: int | None = None) -> VersionInfo | None:
        return await self._in_thread(self.db.current_version, adapter, node)

    async def get_version(self, adapter: str, version: int) -> VersionInfo:
        return await self._in_thread(self.db.get_version, adapter, version)

    async def prune_versions(self, adapter: str) -> list[int]:
        """Apply ``training.keep_versions`` to ``adapter``: those deleted now (``FeedbackDatabase.prune_versions``).

        Their files go after the rows are marked (so a crash leaves files, never a listed version without
        them), with any left by an earlier crash, and this node's cached copies of URI-kept versions. The
        optimizer state stays only in the versions training may resume from: the newest, the current ones
        and the candidates; the other kept versions are served or rolled back to, which needs no optimizer.
        """
        deleted = await self._in_thread(self.db.prune_versions, adapter)
        leftovers = await self._in_thread(self.db.deleted_version_paths, adapter)
        if leftovers:
            gone = await asyncio.to_thread(self._remove_files, adapter, leftovers)
            await self._in_thread(self.db.forget_version_paths, adapter, gone)
        info = await self._in_thread(self.db.get_adapter, adapter)
        resume = {
            info.current_version,
            *info.node_versions.values(),
            *(v.version for v in info.versions if v.state == "candidate"),
        }
        if info.versions:
            resume.add(info.versions[-1].version)
        stale = [v.path for v in info.versions if v.version not in resume and v.path]
        await asyncio.to_thread(self._drop_optimizer_state, stale)
        return deleted

    async def _prune_quietly(self, adapter: str) -> None:
        """Retention after a publish or a verdict: it never fails the write that triggered it."""
        try:
            deleted = await self.prune_versions(adapter)
            if deleted:
                logger.info("adapter %s: deleted versions %s (training.keep_versions)", adapter, deleted)
        except Exception:
            logger.exception("adapter %s: pruning old versions failed; the next publish tries again", adapter)

    def _remove_files(self, adapter: str, locations: dict[int, str]) -> list[int]:
        """Remove deleted versions' files (and this node's cached copy of URI-kept ones); the versions done."""
        done = []
        for version, location in locations.items():
            try:
                remove_version(self.adapters_root, location)
                if is_uri(location):
                    cached = version_dir(cache_root_for(self.cache_root, location), adapter, version)
                    if cached.exists():
                        remove_version(cached.parents[1], str(cached))
                done.append(version)
            except Exception:
                logger.exception(
                    "adapter %s v%d: removing %s failed; tried again at the next prune", adapter, version, location
                )
        return done

    def _drop_optimizer_state(self, locations: list[str]) -> None:
        for location in locations:
            try:
                remove_version_file(self.adapters_root, location, OPTIMIZER_FILE)
            except Exception:
                logger.exception("removing the optimizer state of %s failed", location)
