"""Planner: the central actor that knows every node's facts and answers training grants.

The app runs it as a deployment-scoped actor of the model server deployment (Serve creates it,
recreates it if it dies, and removes it with the app): ``deployments/server.py``. It holds facts
and asks ``planners/`` for every decision:

- Each model server replica registers as the replica of one logical node (its Serve rank) and
  then reports execution traces, counters and engine facts (:class:`NodeReport`). The planner
  publishes them with the placement policy's name to the placement routers
  (:meth:`routing_snapshot`), which place each request themselves (``deployments/routing.py``):
  no request waits on this actor.
- Adapter versions: the planner follows the feedback store's served versions (a long poll on the
  store's served-change number; the store is the one record of what is served) and hands each
  node's to its replica as an :class:`AdapterAssignment` (another long poll); :meth:`load_adapter`
  reads the store at once and returns when the nodes confirm.
- Training: each node's engine facts feed that node's iteration scheduler
  (``planners/coserving/``) and memory guard (``planners/memory.py``); :meth:`grant` answers a
  trainer with the token windows it may run now on its node.
- Training placement: its own instance of the placement policy, kept current with where inference
  runs (the replicas' reports), places training work (``planners/placement/training.py``): new
  feedback of ``per_node`` scope (LEMIX Eq. 1–3), the grant verdict of Eq. 4 for adapters the
  iteration policy does not grant, and every granted step, which enters Q_train^n here and in the
  routers (:class:`TrainingPlacement` in the snapshot) until the trainer reports back. Under
  ``placement: separate`` only its training nodes take trainer ranks (:meth:`node_locations`).
- It starts the feedback store and the trainer, and watches the replicas' actors, so a node
  whose replica died is not offered to routers or trainers until Serve's replacement registers.

Why one module of about 650 lines: every public method here is the planner's Ray interface, and
they share one state (the nodes, the published versions and their epoch, the training placement);
the per-node co-serving grant state and decisions are in ``actors/control/node_coserving.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from settings import AppConfig, PlannerConfig
from actors.serving.engine_args import served_model_name
from actors.learning.store.models import FULL_METHODS, ServedState
from planners import registry
from actors.control.node_coserving import NodeCoServing
from planners.coserving import EngineFacts, FineTuneSample, whole_windows
from planners.coserving.priorities import as_priority_weights
from planners.coserving.slo import SloCheck, check_slos
from planners.memory import MemoryGuard
from planners.placement import Separate, TrainingPlacer
from actors.control.messages import AdapterLoaded, ServedModels
from actors.learning.messages import (FullVersion, Grant, GrantRequest, GrantedWindow, NodeLocation, PassReport,
                                      PassVerdict)
from actors.serving.messages import (AdapterAssignment, AdapterLoadFailed, AdapterVersion, FullSynced, NodeRegistration,
                                     NodeReport)
from planners.types import ExecutionTrace, NewFeedback, NodeView, RoutingSnapshot

logger = logging.getLogger(__name__)

NAMESPACE = "coserve"  # the feedback store's and the trainer's named actors
HEALTH_PERIOD_S = 2.0
HEALTH_TIMEOUT_S = 30.0
CONFIRM_TIMEOUT_S = 120.0  # how long load_adapter waits for the nodes to serve a version
FOLLOW_WAIT_S = 30.0  # the long poll on the store's served versions returns at least this often
GRANT_HOLD_S = 1.0  # a refused grant waits here for the node's next reports this long before the trainer asks again
TRACES_KEPT = 4096  # traces held for routers that poll late


@dataclass
class _Node:
    node_id: int
    state: str = "starting"  # starting | ready
    error: str | None = None
    actor_name: str | None = None
    pid: int | None = None
    ray_node_id: str | None = None
    placement_group_id: str | None = None
    registered_at: float | None = None
    started_at: float = field(default_factory=time.time)
    received_before: int = 0  # requests earlier replicas of this node received
    finished_before: int = 0
    received: int = 0  # this replica's counters, as last reported
    finished: int = 0
    in_flight: int = 0
    busy_seconds: float = 0.0
    reported_at: float = 0.0
    prefix_cache: tuple[int, int] = (0, 0)  # (queried, hit) prompt tokens of this replica's engine
    engine_metrics: str = ""  # vLLM's Prometheus series of the replica's engine, as it last sent them
    adapters: dict[str, int] = field(default_factory=dict)  # "base:adapter" -> version, as the node confirmed
    full: FullSynced | None = None  # the full-model version the node's engine computes with, as it confirmed
    confirmed_epoch: int = -1
    facts: EngineFacts | None = None  # the replica's latest engine report
    coserving: NodeCoServing | None = None  # its grants: scheduler, memory guard, window-cost refit, logs

    @property
    def placed(self) -> int:
        return self.received_before + self.received

    @property
    def finished_total(self) -> int:
        return self.finished_before + self.finished


def _rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


class Planner:
    """Create with ``ray.remote(Planner)``: the app makes it a deployment actor of the model server."""

    def __init__(self, config: AppConfig) -> None:
        from actors.models.default_model import model_path
        from actors.control.cost_profile import load_profile

        self.cfg = config
        self.model_dir = model_path(config)  # named, not built: the planner needs no weights
        self.served_name = served_model_name(config, self.model_dir)
        self.max_model_len = config.model.max_model_len
        self.cost_model, self.cost_model_note = load_profile(config, self.served_name)
        logger.info(self.cost_model_note)
        self.placement = config.planner.placement
        self.placement_params = dict(config.planner.placement_params)
        self.slo = self._check_slos(config.planner)
        self.nodes = [_Node(node_id=i, coserving=NodeCoServing(config, self.cost_model, self.slo.tbt_s))
                      for i in range(config.cluster.nodes)]
        self._reported: asyncio.Condition | None = None  # a node reported: refused grants look again
        self.training = self._training_placer(self.placement, self.placement_params)
        self.traces_seen = 0
        self._traces: deque[tuple[int, ExecutionTrace]] = deque(maxlen=TRACES_KEPT)
        self._published: dict[int, dict[str, AdapterVersion]] = {n.node_id: {} for n in self.nodes}
        self._full: FullVersion | None = None  # the full unit's version every node computes with (None: the start)
        self._epoch = 0
        self._followed = -1  # the store's served-change number the assignments follow (actors/learning/store/actor.py)
        self._changed: asyncio.Condition | None = None  # created on the actor's event loop
        self._started = False
        self.feedback = None
        self.trainer = None
        self._retraining: dict[tuple[str, str], Any] = {}  # (adapter, mode) -> policy from the registry
        self._last_run: dict[str, float] = {}
        self._pause_reported: dict[str, int] = {}  # adapter -> the version a node failed to load, already paused

    def _check_slos(self, planner: PlannerConfig) -> SloCheck:
        """The SLOs the nodes' co-serving runs under, checked against the profile; problems are logged
        here, at start-up, and shown in ``/v1/status`` (``slo``)."""
        t, params = self.cfg.training, planner.iteration_params
        check = check_slos(self.cost_model.with_stages(self.cfg.cluster.stages), t.slo_tbt_s, t.slo_ttft_s,
                           int(params.get("min_window_tokens", 16)), t.max_length,
                           as_priority_weights(params.get("weights")))
        for problem in check.problems:
            logger.warning("SLO: %s", problem)
        return check

    def _placement_kwargs(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        params = dict(params)
        for key, value in (("cost_model", self.cost_model.with_stages(self.cfg.cluster.stages)),
                           ("stages", self.cfg.cluster.stages)):
            if key not in params and registry.accepts("placement", name, key):
                params[key] = value
        return params

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
        placer = self._training_placer(planner.placement, dict(planner.placement_params))
        if planner.iteration is not None:
            registry.create("iteration", planner.iteration, **planner.iteration_params)
        MemoryGuard(self.cost_model.with_stages(self.cfg.cluster.stages), **planner.memory_params)
        old = self.cfg.planner
        coserving_changed = ((planner.iteration, planner.iteration_params, planner.memory_params)
                             != (old.iteration, old.iteration_params, old.memory_params))
        before = self.training.training_nodes()
        self.cfg.planner = planner
        self.placement, self.placement_params, self.training = planner.placement, dict(planner.placement_params), placer
        if coserving_changed:
            self.slo = self._check_slos(planner)
            for node in self.nodes:
                node.coserving.slo_tbt_s = self.slo.tbt_s
                node.coserving.reset()
        if placer.training_nodes() != before and self.trainer is not None:
            await self.trainer.regroup.remote()

    def _training_placer(self, name: str, params: dict[str, Any]) -> TrainingPlacer:
        """This planner's own instance of placement policy ``name``, for training decisions.

        Eq. 4's τ_R on the grant path is ``training.slo_ttft_s`` unless the params set ``response_slo_s``: the
        routers' instances keep the policy's own default (only training ever meets Eq. 4).
        """
        kwargs = self._placement_kwargs(name, params)
        if "response_slo_s" not in kwargs and registry.accepts("placement", name, "response_slo_s"):
            kwargs["response_slo_s"] = self.cfg.training.slo_ttft_s
        policy = registry.create("placement", name, **kwargs)
        t = self.cfg.training
        if isinstance(policy, Separate):
            problem = policy.problem(len(self.nodes), t.enabled, t.scope == "per_node")
            if problem:
                raise ValueError(problem)
        placer = TrainingPlacer(policy, [n.node_id for n in self.nodes])
        n_train = len(placer.training_nodes())
        if t.enabled and -(-(t.workers or n_train) // n_train) > self.cfg.ranks_per_node:
            # The bundles were sized at deploy time for cfg.ranks_per_node ranks a node.
            raise ValueError(f"{t.workers} trainer ranks on {n_train} training node(s) would not fit the bundles, "
                             f"sized for {self.cfg.ranks_per_node} rank(s) a node")
        return placer

    def placement_kwargs(self) -> dict[str, Any]:
        """The current placement policy's keyword arguments, cost model included (for routers)."""
        return self._placement_kwargs(self.placement, self.placement_params)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the feedback store, the trainer and the replica watcher (idempotent)."""
        if self._started:
            return
        self._started = True
        self._changed = asyncio.Condition()
        self._reported = asyncio.Condition()
        self._store_sync = asyncio.Lock()  # one read of the store's served versions and its apply at a time
        await self._start_feedback()
        asyncio.get_running_loop().create_task(self._watch_replicas())
        asyncio.get_running_loop().create_task(self._follow_store())
        if self.cfg.training.enabled:
            self._start_trainer()

    async def _start_feedback(self) -> None:
        """The feedback store: found if it runs (a restarted planner, a redeploy), else started.

        It is detached, so it outlives this planner: the ingress keeps accepting feedback while Serve
        recreates a planner that died. A store started with other settings (another data_dir or
        limits) is replaced; one left behind by a deleted app stays until the next deploy or Ray stops.
        """
        from actors.learning.store.actor import FeedbackQueue, settings_key

        def find_or_start() -> Any:
            return ray.remote(FeedbackQueue).options(
                name=self.cfg.feedback_actor_name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
                num_cpus=0, max_restarts=-1, max_concurrency=1000,
                # Reads and idempotent writes are resent to a restarted store; create_adapter and the keyless
                # add_feedback opt out per method, and feedback is keyed (actors/learning/store/actor.py's docstring).
                max_task_retries=3,
                # Pinned: a restart reopens the same SQLite file on the same disk, never an empty one elsewhere.
                scheduling_strategy=NodeAffinitySchedulingStrategy(store_node(self.cfg.storage.store_node),
                                                                   soft=False),
            ).remote(self.cfg)

        wanted = settings_key(self.cfg)
        self.feedback = find_or_start()
        for _ in range(100):
            try:
                if await self.feedback.settings_key.remote() == wanted:
                    break
                logger.warning("feedback store %s runs with other settings: replacing it", self.cfg.feedback_actor_name)
                ray.kill(self.feedback, no_restart=True)
            except RayActorError:
                pass  # the replaced one is going away; its name is freed in a moment
            await asyncio.sleep(0.2)
            self.feedback = find_or_start()
        else:
            raise RuntimeError(f"could not start the feedback store {self.cfg.feedback_actor_name}")
        # After a restart of the app, every adapter serves its current published version again.
        state = await self.feedback.served_versions.remote(-1, 0.0)
        for name, served in state.adapters.items():
            if served.method in FULL_METHODS and served.current is not None:
                # The full unit: its current version is the model every node computes with.
                self._full = FullVersion(name, served.current.version, served.current.path)
        self._apply(self._served_change(state))
        self._followed = state.change

    def _start_trainer(self) -> None:
        from actors.learning.trainer import Trainer

        self.trainer = ray.remote(Trainer).options(
            name=self.cfg.trainer_actor_name, namespace=NAMESPACE, get_if_exists=True,
            num_cpus=0, max_restarts=-1, max_concurrency=100,
        ).remote(self.cfg, NAMESPACE, ray.get_runtime_context().current_actor)
        self.trainer.run.remote()

    async def register_node(self, reg: NodeRegistration) -> AdapterAssignment:
        """A model server replica serves node ``reg.node_id`` from now on; returns the adapters it must serve."""
        await self.start()
        node = self.nodes[reg.node_id]
        if node.actor_name != reg.actor_name:
            # A new replica of the node: its counters start at zero, and it holds no adapter yet.
            node.received_before, node.finished_before = node.placed, node.finished_total
            node.received = node.finished = node.in_flight = 0
            node.adapters, node.confirmed_epoch, node.facts, node.full = {}, -1, None, None
        node.actor_name, node.pid, node.ray_node_id = reg.actor_name, reg.pid, reg.ray_node_id
        node.placement_group_id, node.registered_at = reg.placement_group_id, time.time()
        node.state, node.error = "ready", None
        logger.info("node %d: replica %s (pid %d) registered after %.1fs", node.node_id, reg.actor_name, reg.pid,
                    time.time() - node.started_at)
        return AdapterAssignment(self._epoch, dict(self._published[node.node_id]), self._full)

    async def _watch_replicas(self) -> None:
        """A node whose replica actor died goes back to ``starting`` until Serve's replacement registers."""
        from ray.exceptions import RayActorError

        handles: dict[str, Any] = {}
        while True:
            await asyncio.sleep(HEALTH_PERIOD_S)
            for node in self.nodes:
                if node.state != "ready" or node.actor_name is None:
                    continue
                try:
                    handle = handles.get(node.actor_name) or ray.get_actor(node.actor_name, namespace="serve")
                    handles[node.actor_name] = handle
                    await asyncio.wait_for(handle.__ray_ready__.remote(), timeout=HEALTH_TIMEOUT_S)
                except (RayActorError, ValueError) as exc:  # ValueError: no actor of that name any more
                    handles.pop(node.actor_name, None)
                    self._lost(node, f"replica {node.actor_name} died: {type(exc).__name__}")
                except asyncio.TimeoutError:
                    logger.warning("node %d: replica %s did not answer within %.0fs", node.node_id,
                                   node.actor_name, HEALTH_TIMEOUT_S)

    def _lost(self, node: _Node, why: str) -> None:
        logger.error("node %d: %s; waiting for Serve to replace it", node.node_id, why)
        node.state, node.error, node.started_at = "starting", why, time.time()
        node.actor_name = None
        node.received_before, node.finished_before = node.placed, node.placed  # its in-flight requests are lost
        node.received = node.finished = node.in_flight = 0
        node.adapters, node.confirmed_epoch, node.facts = {}, -1, None

    async def report(self, report: NodeReport) -> bool:
        """Execution facts from a replica; False if this planner has no registration for it (register again)."""
        node = self.nodes[report.node_id]
        if node.state != "ready":
            return False
        node.received, node.finished, node.in_flight = report.received, report.finished, report.in_flight
        node.busy_seconds, node.reported_at = report.busy_seconds, report.at
        node.prefix_cache = (report.prefix_cache_queries, report.prefix_cache_hits)
        if report.engine_metrics is not None:
            node.engine_metrics = report.engine_metrics
        if report.engine is not None:
            node.facts = report.engine
            if self._reported is not None:
                async with self._reported:
                    self._reported.notify_all()
        for t in report.traces:
            self.traces_seen += 1
            self._traces.append((self.traces_seen, t))
        # Where inference runs, for the training placement's node state (Alg. 1's Q_inference^n).
        self.training.inference_report(report.node_id, report.traces,
                                       None if report.engine is None else report.engine.requests)
        return True

    # ---- what routers and the HTTP layer read ----------------------------------------------

    async def routing_snapshot(self, after: int = 0) -> RoutingSnapshot:
        """Node facts, the placement policy, the traces newer than sequence number ``after``, and the
        training steps placed now."""
        traces = tuple(t for seq, t in self._traces if seq > after) if after < self.traces_seen else ()
        return RoutingSnapshot(
            seq=self.traces_seen, base_model=self.served_name, placement=self.placement,
            placement_params=self.placement_kwargs(), nodes=self._views(),
            reported_at=tuple(n.reported_at for n in self.nodes), traces=traces, training=self.training.placed())

    def _views(self) -> tuple[NodeView, ...]:
        return tuple(NodeView(node_id=n.node_id, ready=n.state == "ready", in_flight=n.in_flight,
                              busy_seconds=n.busy_seconds, adapters=frozenset(n.adapters)) for n in self.nodes)

    def known_models(self) -> set[str]:
        models = {self.served_name}
        for n in self.nodes:
            models.update(n.adapters)
        return models

    async def models(self) -> ServedModels:
        return ServedModels(self.served_name, str(self.model_dir), self.max_model_len,
                            tuple(sorted(m for m in self.known_models() if m != self.served_name)))

    async def engine_metrics(self) -> dict[int, str]:
        """Each ready node's vLLM Prometheus series as its replica last sent them (for ``/metrics``)."""
        return {n.node_id: n.engine_metrics for n in self.nodes if n.state == "ready" and n.engine_metrics}

    async def node_replicas(self) -> dict[int, str | None]:
        """Each node's replica as its Serve actor name (namespace ``serve``), None while it starts."""
        return {n.node_id: n.actor_name for n in self.nodes}

    async def status(self) -> dict[str, Any]:
        now = time.time()
        return {
            "model": self.served_name,
            "placement": self.placement,
            # The planner's own placement of training work: feedback choices, granted steps (LEMIX Eq. 1–4).
            "training_placement": self.training.status(),
            "cost_model": self.cost_model_note,
            "nodes": [
                {
                    "node_id": n.node_id,
                    "state": n.state,
                    "error": n.error,
                    "ray_node_id": n.ray_node_id,  # the host of its replica (and of its trainer rank)
                    "placement_group_id": n.placement_group_id,
                    "stages": self.cfg.cluster.stages,
                    "placed": n.placed,
                    "finished": n.finished_total,
                    "in_flight": n.in_flight,
                    "busy_seconds": round(n.busy_seconds, 3),
                    "prefix_cache": {"queried_tokens": n.prefix_cache[0], "hit_tokens": n.prefix_cache[1]},
                    "adapters": dict(n.adapters),
                    # The full-model version the engine computes with (version null: the model it started
                    # with) and the seconds its last sync took (pause, load, resume).
                    "full_version": None if n.full is None else {
                        "unit": n.full.unit, "version": n.full.version, "sync_s": _rounded(n.full.sync_s),
                        "fingerprint": n.full.fingerprint, "at": n.full.at},
                    "pid": n.pid,
                    "engine": None if n.facts is None else {
                        "requests": len(n.facts.requests), "iterations": n.facts.iterations,
                        "kv_cache_usage": round(n.facts.kv_cache_usage, 4),
                        # How often requests queued inside vLLM (steps that left one waiting; the most left).
                        "steps_with_waiting": n.facts.steps_with_waiting, "waiting_peak": n.facts.waiting_peak},
                    # Training placed here: steps in Q_train, Eq. 4 verdicts, feedback items, the planned queues.
                    "training_placement": self.training.node_status(n.node_id, now),
                    **n.coserving.status(),  # training_grants, memory_guard, window_cost
                }
                for n in self.nodes
            ],
            "iteration": self.cfg.planner.iteration,
            # The SLOs in force (derived from the profile unless configured) and what the profile says of them.
            "slo": self.slo.as_json(),
            # Per adapter with queued feedback: how long its oldest item has waited, and why.
            "training_waits": await self._training_waits(now),
            "ready_nodes": sum(n.state == "ready" for n in self.nodes),
            "traces_seen": self.traces_seen,
            "training": await self._trainer_status(),
        }

    async def _training_waits(self, now: float) -> dict[str, dict[str, Any]]:
        """Adapter -> its queued items, the age of the oldest, and why it waits (the last grant answer, or its state)."""
        if self.feedback is None:
            return {}
        try:
            summary = await asyncio.wait_for(self.feedback.queue_summary.remote(), timeout=5)
            adapters = {a.name: a for a in await asyncio.wait_for(self.feedback.list_adapters.remote(), timeout=5)}
        except Exception as exc:  # the store restarting: the rest of the status still answers
            logger.warning("training waits: %s", exc)
            return {}
        last: dict[str, dict[str, Any]] = {}
        for n in self.nodes:
            for answer in n.coserving.grant_log:
                if answer["adapter"] in summary and answer["at"] >= last.get(answer["adapter"], {}).get("at", 0.0):
                    last[answer["adapter"]] = answer
        waits = {}
        for name, (queued, oldest) in summary.items():
            info, answer = adapters.get(name), last.get(name)
            if info is not None and info.paused_reason is not None:
                why = f"paused: {info.paused_reason}"
            elif info is not None and info.mode == "off":
                why = "mode off"
            elif answer is not None and now - answer["at"] < 5.0:
                why = (f"training ({answer['reason']})" if answer["tokens"]
                       else f"grant refused: {answer['reason']} (budget {answer['budget']} tokens)")
            else:
                why = "waiting for its turn: the trainer is on another adapter, publishing, or the gate judges this one"
            waits[name] = {"queued": queued, "oldest_wait_s": None if oldest is None else round(now - oldest, 3),
                           "why": why}
        return waits

    async def _trainer_status(self) -> dict[str, Any]:
        if self.trainer is None:
            return {"state": "disabled" if not self.cfg.training.enabled else "unavailable"}
        try:
            return await asyncio.wait_for(self.trainer.status.remote(), timeout=5)
        except Exception as exc:
            return {"state": "unreachable", "error": f"{type(exc).__name__}: {exc}"}

    async def node_locations(self) -> list[NodeLocation]:
        """The physical Ray node of each logical node's replica (for co-locating its trainer rank), and
        whether the node trains (every node, except those ``placement: separate`` keeps for inference)."""
        trains = set(self.training.training_nodes())
        return [NodeLocation(n.node_id, n.ray_node_id, n.state, n.placement_group_id, n.node_id in trains)
                for n in self.nodes]

    async def feedback_queue(self) -> Any:
        await self.start()
        return self.feedback

    async def recent_traces(self) -> list[ExecutionTrace]:
        return [t for _, t in list(self._traces)[-256:]]

    # ---- training grants -------------------------------------------------------------------

    async def feedback_nodes(self, items: list[NewFeedback]) -> list[int | None]:
        """per_node scope: the node whose copy trains on each new feedback item, in item order.

        Each item is a training task placed by the training placement: LEMIX's best Eq. 3 score
        (Eq. 1–3), the shortest queue for the other policies (``planners/placement/training.py``).
        """
        await self.start()
        queued = {} if self.training.has_eq4 else await self.feedback.queued_by_node.remote()
        return self.training.place_feedback(items, self._views(), queued, time.time())

    def adapter_changed(self, adapter: str) -> None:
        """The adapter's training settings changed: build its retraining policy afresh at the next grant."""
        for key in [k for k in self._retraining if k[0] == adapter]:
            del self._retraining[key]

    async def grant(self, request: GrantRequest) -> Grant:
        """Which token windows may the trainer on ``request.node_id`` run now for its unfinished samples?

        The trainer owns its samples' progress and sends it with each request (``SampleProgress``:
        tokens, done, t_arr, last loss, MACE §4.1's γ·L_DPO term); ``ran_s`` is how long the windows of
        its previous grant took. Adapters in mode ``hybrid`` are granted by the node's iteration
        scheduler (``planner.iteration``, FlexLLM §6.2 budget and MACE §4.1–4.2 by default) within the
        memory guard's check (LEMIX Alg. 2, ``NodeCoServing.check_memory``); the other modes, and ``hybrid`` with
        ``planner.iteration: null``, by the adapter's retraining policy (``planners/retraining.py``),
        whose whole samples become whole windows.

        A refused request waits here, not in the trainer: the answer can change only when the node
        reports new engine facts (every ``planner.trace_flush_seconds`` while it serves) or time moves
        the samples' aging on, so the request is decided again at each of the node's reports, and at
        least every ``planner.grant_recheck_s``, for up to GRANT_HOLD_S. Then an empty grant (wait 0)
        goes back, and the trainer checks for a stop or a changed adapter before it asks again.
        """
        await self.start()
        deadline = time.time() + GRANT_HOLD_S
        grant = await self._grant_now(request)
        again = GrantRequest(request.node_id, request.adapter, request.mode, request.samples, 0.0, None,
                             request.optimizer_bytes)  # what ran is counted once
        while not grant.windows:
            left = deadline - time.time()
            if left <= 0:
                return Grant((), 0.0, grant.reason)
            async with self._reported:
                try:
                    await asyncio.wait_for(self._reported.wait(),
                                           timeout=min(left, max(grant.wait_s, self.cfg.planner.grant_recheck_s)))
                except asyncio.TimeoutError:
                    pass
            grant = await self._grant_now(again)
        return grant

    async def _grant_now(self, request: GrantRequest) -> Grant:
        """One decision on ``request`` with the node's facts as they are now (see :meth:`grant`)."""
        node_id, adapter, mode = request.node_id, request.adapter, request.mode
        node = self.nodes[node_id]
        now = time.time()
        self.training.done(node_id, now)  # it asks again: what it was granted before has run
        queue = [FineTuneSample(str(x.sample_id), x.tokens, x.arrival, x.last_loss, x.done) for x in request.samples]
        offload, wait_s = False, self.cfg.planner.grant_recheck_s
        co = node.coserving
        if mode == "hybrid" and self.cfg.planner.iteration is not None:
            windows, reason, budget = co.iteration_windows(queue, node.facts, now, request.ran_s)
            windows, reason, offload, wait_s = co.check_memory(request, windows, reason, node.facts,
                                                               self.cost_model.memory.weight_bytes, now)
            co.granted(windows)
        else:
            windows, reason, budget = await self._retraining_windows(node, adapter, mode, queue, now)
        co.record_answer(adapter, mode, windows, reason, budget, node.facts, now)
        if not windows:
            return Grant((), wait_s, reason)
        self._training_granted(node_id, adapter, windows, now)
        self._last_run[adapter] = now
        return Grant(tuple(GrantedWindow(int(w.sample_id), w.start, w.end) for w in windows), 0.0, reason, offload)

    async def report_passes(self, node_id: int, adapter: str, mode: str,
                            reports: list[PassReport]) -> list[PassVerdict]:
        """CheckEnd for the passes a trainer finished in a micro-step (MACE Alg. 1 lines 17–21, §4.2).

        Each report carries the item's loss in that pass (MACE §4.1's L_DPO; an SFT item's mean
        token NLL). For adapters the node's iteration scheduler grants (mode ``hybrid``), its
        ``report_pass`` decides: ``requeued`` while the loss stays above ``loss_threshold`` and fewer
        than ``max_passes`` passes ran (``planner.iteration_params``; no threshold: one pass), with
        t_arr = now for the next pass, or ``retired``. The other modes are MACE's baselines, which
        train each item once: always ``retired``.
        """
        node = self.nodes[node_id]
        now = time.time()
        # The micro-step's passes are over: its steps leave Q_train. Synced, the leader reports for every
        # rank (the step's collective waited for all their shares); per_node, each rank for its own node.
        self.training.done(node_id if self.cfg.training.scope == "per_node" else None, now)
        scheduled = mode == "hybrid" and self.cfg.planner.iteration is not None
        return node.coserving.check_end(adapter, reports, scheduled, now)

    def _training_granted(self, node_id: int, adapter: str, windows: Any, now: float) -> None:
        """A granted step becomes a training task on its node (C = its samples, ℓ = its longest window):
        it enters Q_train^n of this planner's placement and, through the snapshot, the routers'."""
        step = self.training.step_task(node_id, adapter, len({w.sample_id for w in windows}),
                                       max(w.tokens for w in windows), now)
        self.training.granted(step, node_id, now)

    async def _retraining_windows(self, node: _Node, adapter: str, mode: str, queue: list[FineTuneSample],
                                  now: float) -> tuple[Any, str, int]:
        from planners.retraining import RetrainingView, make_policy

        policy = self._retraining.get((adapter, mode))
        if policy is None:
            # An adapter's own periodic settings win over the shared retraining params.
            own = (await self.feedback.get_adapter.remote(adapter)).periodic.model_dump() if mode == "periodic" else None
            policy = make_policy(mode, self.cfg.training.retraining_params, own)
            self._retraining[(adapter, mode)] = policy
        queued, oldest = (await self.feedback.queue_summary.remote()).get(adapter, (0, None))
        wanted = len(queue)
        tokens = sum(s.remaining for s in queue)
        # LEMIX Eq. 4, the placement's verdict: the wanted step (C samples of ℓ tokens) on this node now,
        # against the next inference request its stream predicts. Only the hybrid policy heeds it.
        step = self.training.step_task(node.node_id, adapter, wanted, max(1, tokens // max(1, wanted)), now)
        deprioritized = mode == "hybrid" and wanted > 0 and self.training.deprioritized(
            step, node.node_id, self._views(), now)
        view = RetrainingView(
            now=now, node_id=node.node_id, queued=queued,
            oldest_queued_age_s=None if oldest is None else now - oldest,
            last_run_at=self._last_run.get(adapter), samples_wanted=wanted, tokens_wanted=tokens,
            deprioritized=deprioritized)
        decision = policy.decide(view)
        if decision.action != "run":
            return (), decision.reason or mode, 0
        return whole_windows(queue, decision.samples), decision.reason or mode, decision.tokens

    # ---- adapters --------------------------------------------------------------------------

    async def adapter_assignment(self, node_id: int, known_epoch: int, wait_s: float) -> AdapterAssignment:
        """The adapters ``node_id`` must serve, once they differ from ``known_epoch`` or ``wait_s`` passed."""
        await self.start()
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._epoch != known_epoch), timeout=wait_s)
            except asyncio.TimeoutError:
                pass
        return AdapterAssignment(self._epoch, dict(self._published[node_id]), self._full)

    async def adapters_loaded(self, node_id: int, epoch: int, loaded: dict[str, int],
                              full: FullSynced | None = None,
                              failed: dict[str, AdapterLoadFailed] | None = None) -> None:
        """A replica serves ``loaded`` (adapter -> version) and computes with ``full`` as of assignment ``epoch``;
        ``failed``: versions it could not load. Their adapters pause (in the store, with the error), once per
        version; the other adapters are served and trained as before."""
        node = self.nodes[node_id]
        for name, why in (failed or {}).items():
            if self._pause_reported.get(name) == why.version:
                continue
            self._pause_reported[name] = why.version
            reason = f"node {node_id} could not serve version {why.version}: {why.message}"[:1000]
            logger.warning("adapter %s paused: %s", name, reason)
            try:
                await self.feedback.pause_adapter.remote(name, reason)
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
        await self.start()
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
                await asyncio.wait_for(self._changed.wait_for(
                    lambda: all(n.confirmed_epoch >= epoch or n.state != "ready" for n in targets)),
                    timeout=CONFIRM_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.error("adapter change %d not confirmed within %.0fs by nodes %s", epoch, CONFIRM_TIMEOUT_S,
                             [n.node_id for n in targets if n.confirmed_epoch < epoch])
        return sorted(n.node_id for n in targets if n.confirmed_epoch >= epoch)

    # ---- what is served: the store says, the planner follows ------------------------------------------------

    async def _follow_store(self) -> None:
        """Follow the store's served versions (a long poll on its served-change number) and hand every change to
        the replicas: the feedback store is the one record of what is served, and nobody pushes a copy."""
        while True:
            try:
                state = await self.feedback.served_versions.remote(self._followed, FOLLOW_WAIT_S)
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

    def _served_change(self, state: ServedState, adapters: set[str] | None = None,
                       nodes: list[int] | None = None) -> dict[int, dict[str, AdapterVersion | None]]:
        """What differs between the nodes' assignments and the store's ``state`` (node -> adapter -> version,
        None: no longer served), for ``adapters`` (default: all LoRA adapters) on ``nodes`` (default: all)."""
        per_node = self.cfg.training.scope == "per_node"
        names = {n for n, a in state.adapters.items() if a.method not in FULL_METHODS}
        change: dict[int, dict[str, AdapterVersion | None]] = {}
        for nid in (nodes if nodes is not None else [n.node_id for n in self.nodes]):
            published = self._published[nid]
            for name in (names | set(published)) if adapters is None else adapters:
                served = state.adapters.get(name)
                want = None if served is None else (served.nodes.get(nid) if per_node else served.current)
                want = None if want is None else AdapterVersion(want.version, want.path)
                if published.get(name) != want:
                    change.setdefault(nid, {})[name] = want
        return change

    async def load_adapter(self, adapter: str, node_ids: list[int] | None = None) -> AdapterLoaded:
        """The adapter's served version changed in the store (a publish, a gate verdict, a rollback or a
        promote): serve what the store says now on the given nodes (default: all); returns when the ready
        ones serve it.

        The store's long poll (:meth:`_follow_store`) brings every change anyway; this call only reads the
        store at once and waits for the nodes, for a caller that wants to know when its change is served.
        Under one lock with the follow, so reads that land in any order leave the nodes serving the store's
        latest state: a trainer's late publish cannot undo a rollback that committed after it.
        """
        await self.start()
        scope = sorted(set(node_ids) if node_ids is not None else {n.node_id for n in self.nodes})
        async with self._store_sync:
            state = await self.feedback.served_versions.remote(-1, 0.0)
            change = self._served_change(state, {adapter}, scope)
            # The follow may have applied the change already: either way, wait for the epoch that holds it.
            epoch = self._apply(change) if change else self._epoch
        nodes = await self._confirm(epoch, {nid: {} for nid in scope})
        served = {self._published[nid].get(adapter) for nid in scope}
        return AdapterLoaded(f"{self.served_name}:{adapter}", max((v.version for v in served if v), default=None),
                             tuple(nodes))

    async def load_full(self, full: FullVersion | None) -> list[int]:
        """Every node computes with ``full`` from now on (None: the model the engines started with, a rollback
        to version 0); returns the ready nodes that confirmed the sync."""
        await self.start()
        self._full = full
        return await self._publish({n.node_id: {} for n in self.nodes})


def store_node(setting: str) -> str:
    """The Ray node id the feedback store is pinned to: ``head`` (the node with Ray's head marker) or a node id."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if setting == "head":
        for n in alive:
            if "node:__internal_head__" in n.get("Resources", {}):
                return n["NodeID"]
        raise RuntimeError("storage.store_node is head, but no live head node was found")
    if not any(n["NodeID"] == setting for n in alive):
        raise RuntimeError(f"storage.store_node {setting!r} is not a live Ray node id; "
                           f"live: {[n['NodeID'] for n in alive]}")
    return setting


def find_planner(app_name: str, deployment: str = "ModelServer") -> Any:
    """The planner actor of Serve app ``app_name`` (from outside the model server's replicas).

    Replicas of the model server deployment reach it with ``serve.get_deployment_actor``; other
    processes (the placement router, tests, benchmarks) look it up by the name Serve gives a
    deployment-scoped actor, ``SERVE_DEPLOYMENT_ACTOR::<app>::<deployment>::<code version>::planner``
    in namespace ``serve`` (``ray.serve._private.utils.get_deployment_actor_name``). During a
    redeploy two versions can exist; the one that answers is returned. Raises ``LookupError``.
    """
    from ray.serve._private.constants import SERVE_DEPLOYMENT_ACTOR_PREFIX

    prefix = f"{SERVE_DEPLOYMENT_ACTOR_PREFIX}{app_name}::{deployment}::"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == "serve" and a["name"].startswith(prefix) and a["name"].endswith("::planner")]
    for name in names:
        try:
            handle = ray.get_actor(name, namespace="serve")
            ray.get(handle.__ray_ready__.remote(), timeout=30)
            return handle
        except Exception:
            continue
    raise LookupError(f"no live planner for Serve app {app_name!r} (deployment {deployment!r}); found {names}")
