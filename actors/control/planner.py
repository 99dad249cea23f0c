"""Planner: the central actor that knows every node's facts and answers training grants; its Ray interface.

The app runs it as a deployment-scoped actor of the model server deployment (Serve creates it,
recreates it if it dies, and removes it with the app): ``deployments/server.py``. It holds facts
and asks ``planners/`` for every decision. Each of its jobs is one plain object of this room, which
it composes and calls on its event loop:

- :class:`NodeRegistry` (``nodes.py``): each model server replica registers as the replica of one
  logical node (its Serve rank) and then reports execution traces, counters and engine facts
  (:class:`NodeReport`); the replicas' actors are watched, so a node whose replica died is not
  offered to routers or trainers until Serve's replacement registers.
- :class:`StatusBoard` (``status.py``): the routing snapshot the placement routers poll
  (:meth:`routing_snapshot`), which place each request themselves (``deployments/routing.py``): no
  request waits on this actor; and what the HTTP layer reads (models, metrics, ``/v1/status``).
- :class:`TrainingGrants` (``grants.py``): each node's engine facts feed that node's iteration
  scheduler (``planners/coserving/``) and memory guard (``planners/memory.py``, LEMIX Alg. 2);
  :meth:`grant` answers a trainer with the token windows it may run now on its node (FlexLLM §6.2,
  MACE §4), :meth:`report_passes` with CheckEnd's verdicts (MACE Alg. 1). Training placement: the
  planner's own instance of the placement policy, kept current with where inference runs (the
  replicas' reports), places new feedback of ``per_node`` scope (LEMIX Eq. 1–3), gives the grant
  verdict of Eq. 4, and holds every granted step in Q_train^n here and in the routers until the
  trainer reports back.
- :class:`VersionAssignments` (``versions.py``): the planner follows the feedback store's served
  versions (a long poll on the store's served-change number; the store is the one record of what is
  served) and hands each node's to its replica as an :class:`AdapterAssignment` (another long poll);
  :meth:`load_adapter` waits until the follow has seen a write's served-change number, then returns when
  the nodes confirm.
- :class:`Policies` (``policies.py``): the placement policy, its training instance and the SLOs in
  force, switched live by :meth:`set_policies`. Under ``placement: separate`` only its training
  nodes take trainer ranks (:meth:`node_locations`).

The planner itself starts the feedback store and the trainer; the per-node co-serving grant state and
decisions are in ``actors/control/node_coserving.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.control.grants import TrainingGrants
from actors.control.messages import AdapterLoaded, ServedModels
from actors.control.node_coserving import NodeCoServing
from actors.control.nodes import NodeRecord, NodeRegistry
from actors.control.policies import Policies, checked_slos
from actors.control.status import StatusBoard
from actors.control.versions import VersionAssignments
from actors.learning.messages import FullVersion, Grant, GrantRequest, NodeLocation, PassReport, PassVerdict, WindowsRan
from actors.learning.store.models import split_adapter_key
from actors.serving.engine_args import served_model_name
from actors.serving.fair_admission import LOCAL_TENANT, tenant_ledger
from actors.serving.messages import AdapterAssignment, AdapterLoadFailed, FullSynced, NodeRegistration, NodeReport
from planners.types import ExecutionTrace, NewFeedback, RoutingSnapshot
from settings import AppConfig, PlannerConfig

logger = logging.getLogger(__name__)

NAMESPACE = "coserve"  # the feedback store's and the trainer's named actors


class Planner:
    """Create with ``ray.remote(Planner)``: the app makes it a deployment actor of the model server."""

    def __init__(self, config: AppConfig) -> None:
        from actors.control.cost_profile import load_profile
        from actors.models.default_model import model_path

        self.cfg = config
        model_dir = model_path(config)  # named, not built: the planner needs no weights
        served_name = served_model_name(config, model_dir)
        self.cost_model, cost_model_note = load_profile(config, served_name)
        logger.info(cost_model_note)
        slo = checked_slos(config, config.planner, self.cost_model)
        self.registry = NodeRegistry(
            [
                NodeRecord(node_id=i, coserving=NodeCoServing(config, self.cost_model, slo.tbt_s))
                for i in range(config.cluster.nodes)
            ]
        )
        self.in_force = Policies(config, self.cost_model, self.registry.nodes, slo)
        self.grants = TrainingGrants(config, self.cost_model, self.registry, self.in_force)
        self.versions = VersionAssignments(config, self.registry.nodes, served_name)
        self.board = StatusBoard(config, self.registry, self.in_force, served_name, str(model_dir), cost_model_note)
        self.tenants = tenant_ledger(config)  # each tenant's inference and training service, across nodes
        self._started = False
        self.store = None
        self.trainer = None

    def policies(self) -> PlannerConfig:
        """The ``planner:`` section in force, as :meth:`set_policies` last set it."""
        return self.cfg.planner

    async def set_policies(self, planner: PlannerConfig) -> None:
        """Switch to the policies of ``planner`` (a ``planner:`` config section) live.

        bench/coserve.py compares the co-serving policies on one deployment this way, and tests tighten
        the memory guard or change the placement. Every policy is built first, so a bad setting fails
        here and changes nothing. A changed co-serving policy or memory guard starts afresh on every
        node (grant and pass logs included); routers build a changed placement policy at their next
        snapshot, and when the nodes that train change (``separate``) the trainer regroups.
        """
        if self.in_force.switch(planner) and self.trainer is not None:
            await self.trainer.regroup.remote()

    def placement_kwargs(self) -> dict[str, Any]:
        """The current placement policy's keyword arguments, cost model included (for routers)."""
        return self.in_force.placement_kwargs()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the feedback store, the trainer and the replica watcher (idempotent)."""
        if self._started:
            return
        self._started = True
        self.versions.start()
        self.registry.start()
        await self._start_store()
        asyncio.get_running_loop().create_task(self.registry.watch_replicas())
        asyncio.get_running_loop().create_task(self.versions.follow_store(self.store))
        if self.cfg.training.enabled:
            self._start_trainer()

    async def _start_store(self) -> None:
        """The feedback store: found if it runs (a restarted planner, a redeploy), else started.

        It is detached, so it outlives this planner: the ingress keeps accepting feedback while Serve
        recreates a planner that died. A store started with other settings (another data_dir or
        limits) is replaced; one left behind by a deleted app stays until the next deploy or Ray stops.
        """
        from actors.learning.store.actor import FeedbackStore, settings_key

        def find_or_start() -> Any:
            return (
                ray.remote(FeedbackStore)
                .options(
                    name=self.cfg.store_actor_name,
                    namespace=NAMESPACE,
                    get_if_exists=True,
                    lifetime="detached",
                    num_cpus=0,
                    max_restarts=-1,
                    max_concurrency=1000,
                    # Reads and idempotent writes are resent to a restarted store; create_adapter and the keyless
                    # add_feedback opt out per method, and feedback is keyed (actors/learning/store/actor.py's docstring).
                    max_task_retries=3,
                    # Pinned: a restart reopens the same SQLite file on the same disk, never an empty one elsewhere.
                    scheduling_strategy=NodeAffinitySchedulingStrategy(
                        store_node(self.cfg.storage.store_node), soft=False
                    ),
                )
                .remote(self.cfg)
            )

        wanted = settings_key(self.cfg)
        self.store = find_or_start()
        for _ in range(100):
            try:
                if await self.store.settings_key.remote() == wanted:
                    break
                logger.warning("feedback store %s runs with other settings: replacing it", self.cfg.store_actor_name)
                ray.kill(self.store, no_restart=True)
            except RayActorError:
                pass  # the replaced one is going away; its name is freed in a moment
            await asyncio.sleep(0.2)
            self.store = find_or_start()
        else:
            raise RuntimeError(f"could not start the feedback store {self.cfg.store_actor_name}")
        # After a restart of the app, every adapter serves its current published version again.
        self.versions.restore(await self.store.served_versions.remote(-1, 0.0))

    def _start_trainer(self) -> None:
        from actors.learning.trainer import Trainer

        self.trainer = (
            ray.remote(Trainer)
            .options(
                name=self.cfg.trainer_actor_name,
                namespace=NAMESPACE,
                get_if_exists=True,
                num_cpus=0,
                max_restarts=-1,
                max_concurrency=100,
            )
            .remote(self.cfg, NAMESPACE, ray.get_runtime_context().current_actor)
        )
        self.trainer.run.remote()

    # ---- nodes: registration and reports (NodeRegistry) ---------------------------------------

    async def register_node(self, reg: NodeRegistration) -> AdapterAssignment:
        """A model server replica serves node ``reg.node_id`` from now on; returns the adapters it must serve."""
        await self.start()
        self.registry.register(reg)
        return self.versions.current(reg.node_id)

    async def report(self, report: NodeReport) -> bool:
        """Execution facts from a replica; False if this planner has no registration for it (register again)."""
        if not await self.registry.record(report):
            return False
        self.tenants.charge_served(report.tenant_tokens)
        # Where inference runs, for the training placement's node state (Alg. 1's Q_inference^n).
        self.in_force.training.inference_report(
            report.node_id, report.traces, None if report.engine is None else report.engine.requests
        )
        return True

    # ---- what routers and the HTTP layer read (StatusBoard) ----------------------------------

    async def routing_snapshot(self, after: int = 0, version: int = -1, wait_s: float = 0.0) -> RoutingSnapshot:
        """Node facts, the placement policy, the traces newer than sequence number ``after``, and the
        training steps placed now. A long poll: with ``wait_s``, it answers once there is a trace after ``after``
        or the snapshot's ``version`` differs from the caller's, and after ``wait_s`` at the latest. Busy replicas
        report every ``trace_flush_seconds``, so routers hear of each report as before; an idle app's routers ask
        about once per replica heartbeat instead of every flush (docs/benchmarks.md, "An idle app's cost")."""
        deadline = time.monotonic() + wait_s
        while True:
            snapshot = self.board.routing_snapshot(after)
            if snapshot.traces or snapshot.version != version or time.monotonic() >= deadline:
                return snapshot
            await asyncio.sleep(min(self.cfg.planner.trace_flush_seconds, max(0.0, deadline - time.monotonic())))

    def known_models(self) -> set[str]:
        return self.board.known_models()

    async def models(self) -> ServedModels:
        return self.board.models()

    async def engine_metrics(self) -> dict[int, str]:
        """Each ready node's vLLM Prometheus series as its replica last sent them (for ``/metrics``)."""
        return self.board.engine_metrics()

    async def node_replicas(self) -> dict[int, str | None]:
        """Each node's replica as its Serve actor name (namespace ``serve``), None while it starts."""
        return self.board.node_replicas()

    async def status(self) -> dict[str, Any]:
        status = await self.board.status(self.store, self.trainer)
        return {**status, "tenants": learning_budgets(self.tenants.summary(), status.get("training") or {})}

    async def node_locations(self) -> list[NodeLocation]:
        """The physical Ray node of each logical node's replica (for co-locating its trainer rank), and
        whether the node trains (every node, except those ``placement: separate`` keeps for inference)."""
        return self.board.node_locations()

    async def feedback_store(self) -> Any:
        await self.start()
        return self.store

    async def recent_traces(self) -> list[ExecutionTrace]:
        return self.registry.recent_traces()

    # ---- training grants (TrainingGrants) -------------------------------------------------------

    async def feedback_nodes(self, items: list[NewFeedback]) -> list[int | None]:
        """per_node scope: the node whose copy trains on each new feedback item, in item order (LEMIX Eq. 1–3)."""
        await self.start()
        return await self.grants.feedback_nodes(items, self.store)

    def adapter_changed(self, adapter: str) -> None:
        """The adapter's training settings changed: build its retraining policy afresh at the next grant."""
        self.grants.adapter_changed(adapter)

    async def grant(self, request: GrantRequest) -> Grant:
        """Which token windows may the trainer on ``request.node_id`` run now for its unfinished samples?
        (:meth:`TrainingGrants.grant` says how it is decided, and why a refused request waits here.)"""
        await self.start()
        return await self.grants.grant(request, self.store)

    async def windows_ran(self, run: WindowsRan) -> None:
        """The trainer ran its last grant's windows: measured against the prediction (``TrainingGrants.windows_ran``)."""
        self.grants.windows_ran(run)

    async def report_passes(
        self, node_id: int, adapter: str, mode: str, reports: list[PassReport]
    ) -> list[PassVerdict]:
        """CheckEnd for the passes a trainer finished in a micro-step (MACE Alg. 1 lines 17–21, §4.2)."""
        # The adapter's tenant pays for its training from the same share as for its inference.
        self.tenants.charge_training(split_adapter_key(adapter)[0] or LOCAL_TENANT, sum(r.tokens for r in reports))
        return self.grants.report_passes(node_id, adapter, mode, reports)

    # ---- adapter and full-model versions (VersionAssignments) ---------------------------------

    async def adapter_assignment(self, node_id: int, known_epoch: int, wait_s: float) -> AdapterAssignment:
        """The adapters ``node_id`` must serve, once they differ from ``known_epoch`` or ``wait_s`` passed."""
        await self.start()
        return await self.versions.wait_assignment(node_id, known_epoch, wait_s)

    async def adapters_loaded(
        self,
        node_id: int,
        epoch: int,
        loaded: dict[str, int],
        full: FullSynced | None = None,
        failed: dict[str, AdapterLoadFailed] | None = None,
    ) -> None:
        """A replica serves ``loaded`` (adapter -> version) and computes with ``full`` as of assignment ``epoch``;
        ``failed``: versions it could not load. Their adapters pause (in the store, with the error), once per
        version; the other adapters are served and trained as before."""
        await self.versions.loaded(node_id, epoch, loaded, full, failed, self.store)

    async def load_adapter(
        self, adapter: str, node_ids: list[int] | None = None, served_change: int | None = None
    ) -> AdapterLoaded:
        """The adapter's served version changed in the store (a publish, a gate verdict, a rollback or a
        promote): returns when the ready nodes among ``node_ids`` (default: all) serve what the store says.
        ``served_change``: the store's served-change number the write answered; the planner waits until it
        has followed it, reading nothing (:meth:`VersionAssignments.load_adapter`)."""
        await self.start()
        return await self.versions.load_adapter(adapter, node_ids, self.store, served_change)

    async def load_full(self, full: FullVersion | None) -> list[int]:
        """Every node computes with ``full`` from now on (None: the model the engines started with, a rollback
        to version 0); returns the ready nodes that confirmed the sync."""
        await self.start()
        return await self.versions.load_full(full)


def store_node(setting: str) -> str:
    """The Ray node id the feedback store is pinned to: ``head`` (the node with Ray's head marker) or a node id."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if setting == "head":
        for n in alive:
            if "node:__internal_head__" in n.get("Resources", {}):
                return n["NodeID"]
        raise RuntimeError("storage.store_node is head, but no live head node was found")
    if not any(n["NodeID"] == setting for n in alive):
        raise RuntimeError(
            f"storage.store_node {setting!r} is not a live Ray node id; live: {[n['NodeID'] for n in alive]}"
        )
    return setting


def find_planner(app_name: str, deployment: str = "ModelServer") -> Any:
    """The planner actor of Serve app ``app_name`` (from outside the model server's replicas).

    Replicas of the model server deployment reach it with ``serve.get_deployment_actor``; other
    processes (the placement router, tests, benchmarks) look it up by the name Serve gives a
    deployment-scoped actor, ``SERVE_DEPLOYMENT_ACTOR::<app>::<deployment>::<code version>::planner``
    in namespace ``serve`` (``compat.serve_deployment_actor_prefix``). During a
    redeploy two versions can exist; the one that answers is returned. Raises ``LookupError``.
    """
    from compat import serve_deployment_actor_prefix

    prefix = f"{serve_deployment_actor_prefix()}{app_name}::{deployment}::"
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == "serve" and a["name"].startswith(prefix) and a["name"].endswith("::planner")
    ]
    for name in names:
        try:
            handle = ray.get_actor(name, namespace="serve")
            ray.get(handle.__ray_ready__.remote(), timeout=30)
            return handle
        except Exception as exc:  # a planner from a replaced app, dying or dead: try the next name
            logger.info("planner %s is not live: %s", name, exc)
            continue
    raise LookupError(f"no live planner for Serve app {app_name!r} (deployment {deployment!r}); found {names}")


def learning_budgets(tenants: dict[str, dict[str, Any]], training: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each tenant's ledger (served and training tokens) with the trainer seconds its adapters took beside it."""
    out = {
        t: {**row, "served_tokens": row.get("prompt_tokens", 0) + row.get("output_tokens", 0), "trainer_seconds": 0.0}
        for t, row in tenants.items()
    }
    for adapter, progress in (training.get("adapters") or {}).items():
        tenant = split_adapter_key(adapter)[0] or LOCAL_TENANT
        row = out.setdefault(tenant, {"served_tokens": 0, "training_tokens": 0, "trainer_seconds": 0.0})
        row["trainer_seconds"] = round(row["trainer_seconds"] + float(progress.get("train_s") or 0.0), 3)
    return out
