"""The planner's version assignments: which adapter versions, and which full-model version, each node must serve.

The feedback store is the one record of what is served (``actors/learning/store/actor.py``): the assignments
follow its served versions (a long poll on its served-change number) and nobody pushes a copy. Each change raises
the assignment epoch; each node's replica long-polls its :class:`AdapterAssignment` and confirms the epoch it
serves, with the versions it could not load (their adapters pause in the store). Under ``training.scope:
per_node`` each node serves its own copy's version. ``load_adapter`` waits until the follow has seen a write's
served-change number (or reads the store at once, given none) and ``load_full`` sets the state; both return when the
ready nodes confirm. Plain Python on the planner actor's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from actors.control.messages import AdapterLoaded
from actors.control.nodes import NodeRecord
from actors.learning.messages import FullVersion
from actors.learning.store.records import ServedState
from actors.learning.store.unit_kind import unit_kind
from actors.serving.messages import AdapterAssignment, AdapterLoadFailed, AdapterVersion, FullSynced
from settings import AppConfig

logger = logging.getLogger(__name__)

CONFIRM_TIMEOUT_S = 120.0  # how long load_adapter waits for the nodes to serve a version
FOLLOW_WAIT_S = 30.0  # the long poll on the store's served versions returns at least this often


class VersionAssignments:
    """Each node's published adapter versions, the full-model version, their epoch and the nodes' confirmations."""

    def __init__(self, cfg: AppConfig, nodes: list[NodeRecord], served_name: str) -> None:
        self.cfg = cfg
        self.nodes = nodes  # the registry's: confirmations are recorded on them
        self.served_name = served_name
        self._published: dict[int, dict[str, AdapterVersion]] = {n.node_id: {} for n in self.nodes}
        self._full: FullVersion | None = None  # the full unit's version every node computes with (None: the start)
        self._epoch = 0
        self._followed = -1  # the store's served-change number the assignments follow (actors/learning/store/actor.py)
        self._changed: asyncio.Condition | None = None  # created on the actor's event loop
        self._store_sync: asyncio.Lock | None = None
        self._pause_reported: dict[str, int] = {}  # adapter -> the version a node failed to load, already paused

    def start(self) -> None:
        """Created on the actor's event loop (the planner's ``start``)."""
        self._changed = asyncio.Condition()
        self._store_sync = asyncio.Lock()  # one read of the store's served versions and its apply at a time

    def current(self, node_id: int) -> AdapterAssignment:
        """What ``node_id`` must serve now."""
        return AdapterAssignment(self._epoch, dict(self._published[node_id]), self._full)

    def restore(self, state: ServedState) -> None:
        """After a restart of the app, every adapter serves its current published version again."""
        for name, served in state.adapters.items():
            if unit_kind(served.method).replaces_base_model and served.current is not None:
                # The full unit: its current version is the model every node computes with.
                self._full = FullVersion(name, served.current.version, served.current.path)
        self._apply(self._served_change(state))
        self._followed = state.change

    async def wait_assignment(self, node_id: int, known_epoch: int, wait_s: float) -> AdapterAssignment:
        """The adapters ``node_id`` must serve, once they differ from ``known_epoch`` or ``wait_s`` passed."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._epoch != known_epoch), timeout=wait_s)
            except TimeoutError:
                pass
        return self.current(node_id)

    async def loaded(
        self,
        node_id: int,
        epoch: int,
        loaded: dict[str, int],
        full: FullSynced | None,
        failed: dict[str, AdapterLoadFailed] | None,
        store: Any,
    ) -> None:
        """A replica serves ``loaded`` (adapter -> version) and computes with ``full`` as of assignment ``epoch``;
        ``failed``: versions it could not load. Their adapters pause (in the store ``store``, with the error),
        once per version; the other adapters are served and trained as before."""
        node = self.nodes[node_id]
        for name, why in (failed or {}).items():
            if self._pause_reported.get(name) == why.version:
                continue
            self._pause_reported[name] = why.version
            reason = f"node {node_id} could not serve version {why.version}: {why.message}"[:1000]
            logger.warning("adapter %s paused: %s", name, reason)
            try:
                await store.pause_adapter.remote(name, reason)
            except Exception as exc:  # the store away: the node reports it again with its next confirmation
                self._pause_reported.pop(name, None)
                logger.warning("could not pause %s: %s", name, exc)
        node.adapters = {f"{self.served_name}:{name}": v for name, v in loaded.items()}
        if full is not None:
            node.full = full
        node.confirmed_epoch = max(node.confirmed_epoch, epoch)
        async with self._changed:
            self._changed.notify_all()

    async def _publish(self, change: dict[int, dict[str, AdapterVersion | None]]) -> list[int]:
        """Apply ``change`` (node -> adapter -> version, None = remove) and wait until the ready nodes
        serve it; returns the nodes that confirmed."""
        return await self._confirm(self._apply(change), change)

    def _apply(self, change: dict[int, dict[str, AdapterVersion | None]]) -> int:
        """Record ``change`` in the nodes' assignments; the new epoch."""
        for nid, adapters in change.items():
            for name, v in adapters.items():
                if v is None:
                    self._published[nid].pop(name, None)
                else:
                    self._published[nid][name] = v
        self._epoch += 1
        return self._epoch

    async def _confirm(self, epoch: int, change: dict[int, Any]) -> list[int]:
        """Wake the nodes' long polls and wait until the ready ones in ``change`` confirm ``epoch``."""
        targets = [n for n in self.nodes if n.node_id in change and n.state == "ready"]
        async with self._changed:
            self._changed.notify_all()
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(
                        lambda: all(n.confirmed_epoch >= epoch or n.state != "ready" for n in targets)
                    ),
                    timeout=CONFIRM_TIMEOUT_S,
                )
            except TimeoutError:
                logger.error(
                    "adapter change %d not confirmed within %.0fs by nodes %s",
                    epoch,
                    CONFIRM_TIMEOUT_S,
                    [n.node_id for n in targets if n.confirmed_epoch < epoch],
                )
        return sorted(n.node_id for n in targets if n.confirmed_epoch >= epoch)

    # ---- what is served: the store says, the planner follows ------------------------------------------------

    async def follow_store(self, store: Any) -> None:
        """Follow the store's served versions (a long poll on its served-change number) and hand every change to
        the replicas: the feedback store is the one record of what is served, and nobody pushes a copy."""
        while True:
            try:
                state = await store.served_versions.remote(self._followed, FOLLOW_WAIT_S)
            except Exception as exc:  # the store restarting: look again in a moment
                logger.warning("following the store's served versions: %s", exc)
                await asyncio.sleep(1.0)
                continue
            if state.change != self._followed:
                async with self._store_sync:
                    change = self._served_change(state)
                    if change:
                        self._apply(change)
                    self._followed = max(self._followed, state.change)
                async with self._changed:
                    self._changed.notify_all()

    def _served_change(
        self, state: ServedState, adapters: set[str] | None = None, nodes: list[int] | None = None
    ) -> dict[int, dict[str, AdapterVersion | None]]:
        """What differs between the nodes' assignments and the store's ``state`` (node -> adapter -> version,
        None: no longer served), for ``adapters`` (default: all LoRA adapters) on ``nodes`` (default: all)."""
        names = {n for n, a in state.adapters.items() if not unit_kind(a.method).replaces_base_model}
        change: dict[int, dict[str, AdapterVersion | None]] = {}
        for nid in nodes if nodes is not None else [n.node_id for n in self.nodes]:
            published = self._published[nid]
            for name in (names | set(published)) if adapters is None else adapters:
                served = state.adapters.get(name)
                want = (
                    None if served is None else self.cfg.training.scope_rules.served(served.current, served.nodes, nid)
                )
                want = None if want is None else AdapterVersion(want.version, want.path)
                if published.get(name) != want:
                    change.setdefault(nid, {})[name] = want
        return change

    async def load_adapter(
        self, adapter: str, node_ids: list[int] | None, store: Any, served_change: int | None = None
    ) -> AdapterLoaded:
        """Return when the ready nodes among ``node_ids`` (default: all) serve what the store says of ``adapter``.

        With ``served_change`` (the store's served-change number its write answered: a publish or a gate
        verdict), nothing is read: the store's long poll (:meth:`follow_store`) brings the change anyway, so
        this waits until the follow has applied that number, then for the nodes. Without it (a rollback or a
        promotion through the API), it reads the store at once, under one lock with the follow, so reads that
        land in any order leave the nodes serving the store's latest state: a late publish cannot undo a
        rollback that committed after it.
        """
        scope = sorted(set(node_ids) if node_ids is not None else {n.node_id for n in self.nodes})
        if served_change is not None:
            async with self._changed:
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: self._followed >= served_change), timeout=CONFIRM_TIMEOUT_S
                    )
                except TimeoutError:
                    logger.error(
                        "the store's served change %d not followed within %.0fs", served_change, CONFIRM_TIMEOUT_S
                    )
            epoch = self._epoch  # the follow applied the change in this epoch or before
        else:
            async with self._store_sync:
                state = await store.served_versions.remote(-1, 0.0)
                change = self._served_change(state, {adapter}, scope)
                # The follow may have applied the change already: either way, wait for the epoch that holds it.
                epoch = self._apply(change) if change else self._epoch
        nodes = await self._confirm(epoch, {nid: {} for nid in scope})
        served = {self._published[nid].get(adapter) for nid in scope}
        return AdapterLoaded(
            f"{self.served_name}:{adapter}", max((v.version for v in served if v), default=None), tuple(nodes)
        )

    async def load_full(self, full: FullVersion | None) -> list[int]:
        """Every node computes with ``full`` from now on (None: the model the engines started with, a rollback
        to version 0); returns the ready nodes that confirmed the sync."""
        self._full = full
        return await self._publish({n.node_id: {} for n in self.nodes})
