"""Planner: the named Ray actor that owns the nodes (placement groups), their replicas and policies.

It holds resources and facts (which replica runs where, what each has served, which adapters it
holds) and asks ``planners/`` for every decision: ``place(task)`` builds plain ``NodeView``s and
calls the configured placement policy from the registry. Replicas report execution traces back
in batches, which feed the policy's calibration (LEMIX Alg. 2, lines 13-17), and their engine
facts (requests in flight, iterations, KV cache in use), which feed each node's iteration
scheduler (``planners/iteration.py``) and memory guard (``planners/memory.py``): ``grant()``
answers a trainer with the token windows it may run now on its node.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.replica import ModelReplica
from app.config import AppConfig
from app.engine_args import engine_flags, served_model_name
from planners import registry
from planners.iteration import EngineFacts, FineTuneSample, whole_windows
from planners.memory import MemoryGuard
from planners.types import ExecutionTrace, NodeView, Task

logger = logging.getLogger(__name__)

HEALTH_PERIOD_S = 2.0
RESTART_WAIT_S = 120.0  # how long a restarting replica actor may stay unavailable
FAILED_RETRY_S = 30.0  # back-off before a node that failed to start is tried again


@dataclass
class _Node:
    node_id: int
    pg: Any
    replica: Any = None
    state: str = "starting"  # starting | ready | failed
    error: str | None = None
    placed: int = 0
    finished: int = 0
    busy_seconds: float = 0.0
    adapters: dict[str, int] = field(default_factory=dict)  # "base:adapter" -> version
    started_at: float = field(default_factory=time.time)
    ttfts: deque = field(default_factory=lambda: deque(maxlen=64))  # recent TTFTs (s), newest last
    facts: EngineFacts | None = None  # the replica's latest engine report
    scheduler: Any = None  # the node's iteration scheduler (planner.iteration), built on first grant
    guard: MemoryGuard | None = None
    grants: dict[str, Any] = field(default_factory=lambda: {
        "asked": 0, "granted": 0, "refused": 0, "windows": 0, "tokens": 0, "last_budget": None, "last_reason": None})
    grant_log: deque = field(default_factory=lambda: deque(maxlen=64))  # recent answers, newest last

    @property
    def in_flight(self) -> int:
        return max(0, self.placed - self.finished)


class Planner:
    """Create with ``ray.remote(Planner).options(name=cfg.planner_actor_name, ...)``."""

    def __init__(self, config: dict[str, Any], model_dir: str, namespace: str) -> None:
        self.cfg = AppConfig.model_validate(config)
        self.namespace = namespace
        self.model_dir = model_dir
        self.served_name = served_model_name(self.cfg, model_dir)
        self.max_model_len = self.cfg.model.max_model_len
        from app.profile import load_profile

        self.cost_model, self.cost_model_note = load_profile(self.cfg, self.served_name)
        logger.info(self.cost_model_note)
        self.placement = self.cfg.planner.placement
        self.policy = self._make_placement(self.placement, self.cfg.planner.placement_params)
        self.nodes: list[_Node] = []
        self.traces_seen = 0
        self._recent: list[ExecutionTrace] = []
        self._published: dict[int, dict[str, tuple[int, str]]] = {}  # node -> adapter -> (version, path)
        self._started = False
        self.feedback = None
        self.trainer = None
        self._retraining: dict[tuple[str, str], Any] = {}  # (adapter, mode) -> policy from the registry
        self._last_run: dict[str, float] = {}

    def _make_placement(self, name: str, params: dict[str, Any]) -> Any:
        params = dict(params)
        for key, value in (("cost_model", self.cost_model.with_stages(self.cfg.cluster.stages)),
                           ("stages", self.cfg.cluster.stages)):
            if key not in params and registry.accepts("placement", name, key):
                params[key] = value
        return registry.create("placement", name, **params)

    async def set_iteration(self, name: str | None, params: dict[str, Any] | None = None) -> str | None:
        """Switch the node-level co-serving policy live (bench/coserve.py compares them on one deployment)."""
        self.cfg.planner = self.cfg.planner.model_copy(update={"iteration": name, "iteration_params": params or {}})
        if name is not None:
            registry.create("iteration", name, **(params or {}))  # fail here, not at the next grant
        for node in self.nodes:
            node.scheduler = node.guard = None
            node.grant_log.clear()
        return name

    async def set_placement(self, name: str, params: dict[str, Any] | None = None) -> str:
        """Switch the placement policy live (e.g. to compare policies on the same deployment)."""
        self.policy = self._make_placement(name, params or {})
        self.placement = name
        return name

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        """Reserve one placement group per node and start a replica in each (idempotent)."""
        if self._started:
            return await self.status()
        self._started = True
        c = self.cfg.cluster
        for i in range(c.nodes):
            pg = placement_group([dict(c.bundle) for _ in range(c.stages)], strategy=c.strategy,
                                 name=f"{self.cfg.name}-node{i}")
            self.nodes.append(_Node(node_id=i, pg=pg))
        await self._start_feedback()
        for node in self.nodes:
            asyncio.get_running_loop().create_task(self._bring_up(node))
        asyncio.get_running_loop().create_task(self._watch_health())
        if self.cfg.training.enabled:
            self._start_trainer()
        return await self.status()

    async def _start_feedback(self) -> None:
        from actors.feedback import FeedbackQueue

        self.feedback = ray.remote(FeedbackQueue).options(
            name=self.cfg.feedback_actor_name, namespace=self.namespace, get_if_exists=True,
            num_cpus=0, max_restarts=-1, max_task_retries=3, max_concurrency=1000,
        ).remote(str(self.cfg.data_path))
        # After a restart of the app, every adapter serves its current published version again.
        for info in await self.feedback.list_adapters.remote():
            paths = {v.version: v.path for v in info.versions if v.path}
            for node in self.nodes:
                # per_node: each node its own copy's version; synced: the adapter's current version.
                version = info.node_versions.get(node.node_id) if info.node_versions else info.current_version
                if version in paths:
                    self._published.setdefault(node.node_id, {})[info.name] = (version, paths[version])

    def _start_trainer(self) -> None:
        try:
            from actors.trainer import Trainer
        except ImportError as exc:  # only while the trainer module is absent from a checkout
            logger.error("training enabled but the trainer is unavailable: %s", exc)
            return
        self.trainer = ray.remote(Trainer).options(
            name=self.cfg.trainer_actor_name, namespace=self.namespace, get_if_exists=True,
            num_cpus=0, max_restarts=-1, max_concurrency=100,
        ).remote(self.cfg.model_dump(), self.model_dir, self.namespace)
        self.trainer.run.remote()

    def _replica_options(self, node: _Node) -> dict[str, Any]:
        res = dict(self.cfg.cluster.replica_resources or self.cfg.cluster.bundle)
        opts: dict[str, Any] = {
            "num_cpus": res.pop("CPU", 0.0),
            "num_gpus": res.pop("GPU", 0.0),
            "resources": res or None,
            "max_restarts": 3,
            "max_concurrency": 10_000,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=node.pg, placement_group_bundle_index=0
            ),
        }
        return opts

    async def _bring_up(self, node: _Node) -> None:
        try:
            await node.pg.ready()
            if node.replica is None:
                opts = self._replica_options(node)
                node.replica = ray.remote(ModelReplica).options(**opts).remote(
                    node.node_id,
                    engine_flags(self.cfg, self.model_dir, self.served_name),
                    self.served_name,
                    planner_name=self.cfg.planner_actor_name,
                    namespace=self.namespace,
                    trace_flush_seconds=self.cfg.planner.trace_flush_seconds,
                    omp_threads=self.cfg.engine.omp_threads,
                    stream_batching_s=self.cfg.ingress.stream_batching_ms / 1000,
                )
            info = await self._start_replica(node)
            node.adapters = dict(info.get("adapters", {}))
            await self._restore_adapters(node)
            node.state, node.error = "ready", None
            logger.info("node %d ready after %.1fs", node.node_id, time.time() - node.started_at)
        except Exception as exc:  # surfaced through status() and /health, retried by the watcher
            node.state, node.error = "failed", f"{type(exc).__name__}: {exc}"
            node.started_at = time.time()
            logger.error("node %d failed to start: %s", node.node_id, node.error)

    async def _start_replica(self, node: _Node) -> dict[str, Any]:
        """``replica.start()``, waiting out a replica actor that Ray is still restarting."""
        from ray.exceptions import ActorUnavailableError

        deadline = time.time() + RESTART_WAIT_S
        while True:
            try:
                return await node.replica.start.remote()
            except ActorUnavailableError:
                if time.time() > deadline:
                    raise
                await asyncio.sleep(1.0)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_PERIOD_S)
            for node in self.nodes:
                if node.state == "failed" and time.time() - node.started_at > FAILED_RETRY_S:
                    # A node that failed to start is tried again, not given up on.
                    node.state, node.started_at = "starting", time.time()
                    asyncio.get_running_loop().create_task(self._bring_up(node))
                if node.state != "ready" or node.replica is None:
                    continue
                try:
                    healthy = await asyncio.wait_for(node.replica.check_health.remote(), timeout=30)
                except Exception as exc:
                    healthy, why = False, f"{type(exc).__name__}: {exc}"
                else:
                    why = "engine not started (actor restarted)"
                if not healthy:
                    self._restart(node, why)

    def _restart(self, node: _Node, why: str) -> None:
        # Ray restarts a dead replica actor (max_restarts); its engine must be built again.
        if node.state == "starting":
            return
        logger.error("node %d unhealthy (%s); restarting its engine", node.node_id, why)
        node.state, node.error, node.started_at = "starting", why, time.time()
        node.adapters = {}
        node.finished = node.placed  # requests in flight there are lost; do not count them as load
        asyncio.get_running_loop().create_task(self._bring_up(node))

    async def report_failure(self, node_id: int, why: str) -> None:
        """The ingress could not reach ``node_id``'s replica: stop placing there, bring it back."""
        self._restart(self.nodes[node_id], why)

    async def shutdown(self) -> None:
        for node in self.nodes:
            if node.replica is not None:
                try:
                    await node.replica.shutdown.remote()
                except Exception:
                    pass
                ray.kill(node.replica)
            remove_placement_group(node.pg)
        self.nodes = []

    # ---- decisions -------------------------------------------------------------------------

    def _views(self, model: str) -> list[NodeView]:
        needs_adapter = model != self.served_name
        return [
            NodeView(
                node_id=n.node_id,
                ready=n.state == "ready" and (not needs_adapter or model in n.adapters),
                in_flight=n.in_flight,
                busy_seconds=n.busy_seconds,
                adapters=frozenset(n.adapters),
            )
            for n in self.nodes
        ]

    def known_models(self) -> set[str]:
        models = {self.served_name}
        for n in self.nodes:
            models.update(n.adapters)
        return models

    async def place(self, task: Task) -> dict[str, Any]:
        """Choose a node for ``task``: {"node_id"} or {"error": 404|503, "message"}."""
        if task.model not in self.known_models():
            return {"error": 404, "message": f"The model `{task.model}` does not exist."}
        node_id = self.policy.choose(task, self._views(task.model), time.time())
        if node_id is None:
            starting = sum(n.state == "starting" for n in self.nodes)
            why = f"{starting} replica(s) still starting" if starting else "no healthy replica"
            return {"error": 503, "message": f"No replica is ready to serve `{task.model}`: {why}."}
        self.nodes[node_id].placed += 1
        return {"node_id": node_id}

    async def report(self, node_id: int, traces: list[ExecutionTrace], finished: int, busy_seconds: float,
                     facts: EngineFacts | None = None) -> None:
        """Execution facts from a replica: finished requests and their traces, and its engine's state."""
        node = self.nodes[node_id]
        node.finished += finished
        node.busy_seconds = busy_seconds
        if facts is not None:
            node.facts = facts
        for t in traces:
            self.policy.observe(t)
            if t.ok and t.ttft is not None:
                node.ttfts.append(t.ttft)
        self.traces_seen += len(traces)
        self._recent = (self._recent + traces)[-256:]

    # ---- facts for the ingress -------------------------------------------------------------

    async def replicas(self) -> dict[int, Any]:
        return {n.node_id: n.replica for n in self.nodes if n.replica is not None}

    async def models(self) -> dict[str, Any]:
        return {
            "base": self.served_name,
            "max_model_len": self.max_model_len,
            "root": self.model_dir,
            "adapters": sorted(m for m in self.known_models() if m != self.served_name),
        }

    async def status(self) -> dict[str, Any]:
        return {
            "model": self.served_name,
            "placement": self.placement,
            "cost_model": self.cost_model_note,
            "nodes": [
                {
                    "node_id": n.node_id,
                    "state": n.state,
                    "error": n.error,
                    "stages": self.cfg.cluster.stages,
                    "placed": n.placed,
                    "finished": n.finished,
                    "in_flight": n.in_flight,
                    "busy_seconds": round(n.busy_seconds, 3),
                    "adapters": dict(n.adapters),
                    "engine": None if n.facts is None else {
                        "requests": len(n.facts.requests), "iterations": n.facts.iterations,
                        "kv_cache_usage": round(n.facts.kv_cache_usage, 4)},
                    "training_grants": dict(n.grants, recent=list(n.grant_log)),
                }
                for n in self.nodes
            ],
            "iteration": self.cfg.planner.iteration,
            "ready_nodes": sum(n.state == "ready" for n in self.nodes),
            "traces_seen": self.traces_seen,
            "training": await self._trainer_status(),
        }

    async def _trainer_status(self) -> dict[str, Any]:
        if self.trainer is None:
            return {"state": "disabled" if not self.cfg.training.enabled else "unavailable"}
        try:
            return await asyncio.wait_for(self.trainer.status.remote(), timeout=5)
        except Exception as exc:
            return {"state": "unreachable", "error": f"{type(exc).__name__}: {exc}"}

    async def node_locations(self) -> list[dict[str, Any]]:
        """The physical Ray node holding each logical node's placement group (for co-location)."""
        from ray.util import placement_group_table

        out = []
        for n in self.nodes:
            bundles = placement_group_table(n.pg).get("bundles_to_node_id", {}) or {}
            out.append({"node_id": n.node_id, "ray_node_id": bundles.get(0), "state": n.state})
        return out

    async def feedback_queue(self) -> Any:
        return self.feedback

    # ---- training grants -------------------------------------------------------------------

    async def feedback_nodes(self, adapters: list[str | None]) -> list[int | None]:
        """per_node scope: the node whose copy trains on each new feedback item, in item order."""
        from planners.retraining import route_feedback

        ready = [n.node_id for n in self.nodes if n.state == "ready"] or [n.node_id for n in self.nodes]
        queued = await self.feedback.queued_by_node.remote()
        positions: dict[str | None, list[int]] = {}
        for i, adapter in enumerate(adapters):
            positions.setdefault(adapter, []).append(i)
        out: list[int | None] = [None] * len(adapters)
        for adapter, idx in positions.items():
            for i, node in zip(idx, route_feedback(queued.get(adapter, {}) if adapter else {}, ready, len(idx))):
                out[i] = node
        return out

    def adapter_changed(self, adapter: str) -> None:
        """The adapter's training settings changed: build its retraining policy afresh at the next grant."""
        for key in [k for k in self._retraining if k[0] == adapter]:
            del self._retraining[key]

    async def grant(self, node_id: int, adapter: str, mode: str, samples: list[dict[str, Any]],
                    ran_s: float = 0.0) -> dict[str, Any]:
        """Which token windows may the trainer on ``node_id`` run now for ``adapter``'s ``samples``?

        ``samples`` are the trainer's unfinished samples of its micro-step on this node, as
        ``{id, tokens, done, arrival, dpo_loss}`` (it owns their progress); ``ran_s`` the seconds it
        took to run the windows of its previous grant on this node (0: none ran). Adapters in mode
        ``hybrid`` are granted by the node's iteration scheduler (``planner.iteration``, FlexLLM
        §6.2 budget and MACE §4.1–4.2 by default) within the memory guard's headroom (LEMIX Alg. 2);
        the other modes, and ``hybrid`` with ``planner.iteration: null``, by the adapter's retraining
        policy (``planners/retraining.py``), whose whole samples become whole windows. Answer:
        ``{"windows": [[id, start, end], ...], "wait_s", "reason"}``; no windows means wait.
        """
        node = self.nodes[node_id]
        now = time.time()
        queue = [FineTuneSample(str(x["id"]), int(x["tokens"]), float(x["arrival"]), float(x.get("dpo_loss") or 0.0),
                                int(x.get("done", 0))) for x in samples]
        if mode == "hybrid" and self.cfg.planner.iteration is not None:
            windows, reason, budget = self._iteration_windows(node, queue, now, ran_s)
        else:
            windows, reason, budget = await self._retraining_windows(node, adapter, mode, queue, now)
        g = node.grants
        g["asked"] += 1
        g["last_reason"], g["last_budget"] = reason, budget
        reqs = node.facts.requests if node.facts else ()
        node.grant_log.append({"at": round(now, 3), "adapter": adapter, "mode": mode, "budget": budget,
                               "tokens": sum(w.tokens for w in windows),
                               "decoding": sum(r.output_tokens > 0 for r in reqs),
                               "prefilling": sum(r.output_tokens == 0 for r in reqs), "reason": reason})
        if not windows:
            g["refused"] += 1
            return {"windows": [], "wait_s": self.cfg.planner.grant_recheck_s, "reason": reason}
        self._last_run[adapter] = now
        g["granted"] += 1
        g["windows"] += len(windows)
        g["tokens"] += sum(w.tokens for w in windows)
        return {"windows": [[int(w.sample_id), w.start, w.end] for w in windows], "wait_s": 0.0, "reason": reason}

    def _iteration_windows(self, node: _Node, queue: list[FineTuneSample], now: float,
                           ran_s: float = 0.0) -> tuple[Any, str, int]:
        if node.scheduler is None:
            cm = self.cost_model.with_stages(self.cfg.cluster.stages)
            e = self.cfg.engine
            # vLLM starts every request as it arrives: the plans count them all (admission_control off).
            params = {"slo_s": self.cfg.training.slo_tbt_s, "max_num_seqs": e.max_num_seqs,
                      "max_batched_tokens": e.max_num_batched_tokens or 2048, "admission_control": False,
                      **self.cfg.planner.iteration_params}
            node.scheduler = registry.create("iteration", self.cfg.planner.iteration, cost_model=cm, **params)
            node.guard = MemoryGuard(cm, **self.cfg.planner.memory_params)
        sched = node.scheduler
        if node.facts is not None:
            sched.observe(node.facts)
        sched.set_samples(queue)
        sched.observe_ft_run(ran_s, now)
        used = self.cost_model.memory.weight_bytes + (node.facts.kv_used_bytes if node.facts else 0.0)
        plan = sched.schedule(now, node.guard.headroom(used))
        return plan.windows, plan.reason, plan.ft_token_budget

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
        ttfts = sorted(node.ttfts)
        wanted = len(queue)
        tokens = sum(s.remaining for s in queue)
        per_sample = max(1, tokens // max(1, wanted))
        cm = self.cost_model
        view = RetrainingView(
            now=now, node_id=node.node_id, in_flight=node.in_flight,
            ttft_p50_s=statistics.median(ttfts) if ttfts else None,
            ttft_p99_s=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
            slo_ttft_s=self.cfg.training.slo_ttft_s,
            predicted_ttft_s=self._predicted_ttft(node),
            queued=queued, oldest_queued_age_s=None if oldest is None else now - oldest,
            last_run_at=self._last_run.get(adapter),
            samples_wanted=wanted, tokens_wanted=tokens,
            step_cost_s=cm.forward_latency(wanted, per_sample) + cm.backward_latency(wanted, per_sample),
        )
        decision = policy.decide(view)
        if decision.action != "run":
            return (), decision.reason or mode, 0
        return whole_windows(queue, decision.samples), decision.reason or mode, decision.tokens

    def _predicted_ttft(self, node: _Node) -> float:
        """Cost-model TTFT of a new request on ``node``: its prefill iteration beside the running decodes."""
        running = node.in_flight
        prompt = 256  # a typical prompt when nothing better is known; the calibrated policies refine it
        return self.cost_model.iteration_latency(prompt, running, running * prompt)

    async def recent_traces(self) -> list[ExecutionTrace]:
        return list(self._recent)

    # ---- adapters --------------------------------------------------------------------------

    async def load_adapter(self, adapter: str, version: int, path: str, node_ids: list[int] | None = None,
                           force: bool = False) -> dict[str, Any]:
        """Serve ``path`` as ``version`` of ``base:adapter`` on the given nodes (default: all ready).

        An older version replaces a newer one only with ``force`` (a rollback).
        """
        model_id = f"{self.served_name}:{adapter}"
        scope = set(node_ids) if node_ids is not None else {n.node_id for n in self.nodes}
        for nid in scope:
            published = self._published.setdefault(nid, {})
            if force or adapter not in published or published[adapter][0] < version:
                published[adapter] = (version, path)
        targets = [n for n in self.nodes if n.node_id in scope and n.state == "ready"]
        results = await asyncio.gather(*(n.replica.load_adapter.remote(adapter, version, path, force) for n in targets))
        for node, res in zip(targets, results):
            node.adapters[model_id] = res["version"]
        return {"model": model_id, "version": version, "nodes": sorted(n.node_id for n in targets)}

    async def unload_adapter(self, adapter: str) -> dict[str, Any]:
        model_id = f"{self.served_name}:{adapter}"
        for published in self._published.values():
            published.pop(adapter, None)
        targets = [n for n in self.nodes if model_id in n.adapters]
        await asyncio.gather(*(n.replica.unload_adapter.remote(adapter) for n in targets if n.state == "ready"))
        for n in targets:
            n.adapters.pop(model_id, None)
        return {"model": model_id, "nodes": sorted(n.node_id for n in targets)}

    async def _restore_adapters(self, node: _Node) -> None:
        # A restarted replica comes back empty; give it every version published to its node.
        for adapter, (version, path) in self._published.get(node.node_id, {}).items():
            res = await node.replica.load_adapter.remote(adapter, version, path, True)
            node.adapters[res["model"]] = res["version"]
