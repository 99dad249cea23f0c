"""Trainer: the supervisor actor of the LoRA SFT/DPO trainer, whose ranks run inside the nodes' placement groups.

In the manner of verl's single controller and its worker group: :class:`Trainer` (a named Ray
actor, 0 CPU) holds no model. ``run()`` starts a background thread that places one
:class:`~actors.learning.lora.rank.TrainRank` per logical node that trains (every node, except under
``placement: separate``, whose inference nodes take none; or ``training.workers``) in **bundle 0 of
that node's placement group**, the bundle its model server replica runs in, each with
``training.resources_per_worker`` as its share (``{CPU: 0.5}`` on a CPU host, ``{GPU: 0.5, CPU: 2}``
beside a replica taking the other half of a GPU); joins them into one torch process group; and runs
the loop here, in a :class:`~actors.learning.lora.driver.LoraDriver` thread per queue partition
(one when synced, one per node under ``per_node``): the driver decides every step, sends the
ranks typed messages and gathers their answers, and alone talks to the store and the planner.
What the drivers report is collected here, for ``status()``.

Why not Ray Train's ``TorchTrainer``: Ray Train 2.60 always reserves a placement group of its
own for its workers (``WorkerGroup._create_placement_group``, one group for all workers) and has
no option to schedule them into an existing one; a worker that asks for a GPU share beside a
replica whose group holds the GPU can then never be placed. So the Trainer creates the rank
actors itself with ``PlacementGroupSchedulingStrategy`` into each node's group, as verl does
for its colocated roles, and forms the process group with ``torch.distributed`` directly
(docs/learning.md, "Where training runs").

Faults: a rank that dies (its replica's group was removed when Serve replaced the replica, or
the process was killed) fails the whole group; the Trainer kills the other ranks and starts a
new group after a short back-off, in the group of whatever replica serves each node then. Ray
restarts this actor (``max_restarts=-1``), which then starts training again by itself. A new
group resumes from the store's current version and its queue: an item is consumed only when a
published version trained on it, so nothing acknowledged is lost (docs/learning.md §2).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray

from actors.learning.lora.messages import (
    GateDecided,
    GrantWaited,
    RankStarted,
    StepAbandoned,
    StepDone,
    TrainerEvent,
    VersionPublished,
    VersionScored,
    WorkDropped,
)
from actors.learning.messages import NodeLocation
from settings import AppConfig

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
RESTART_BACKOFF_S = 2.0
PLACE_TIMEOUT_S = 300.0  # ranks wait this long for their share of a bundle (a replica may be starting)
JOIN_TIMEOUT_S = 300.0


@dataclass
class AdapterProgress:
    """What the trainer has done for one adapter since it started, as ``/v1/status`` shows it."""

    version: int | None = None
    versions_published: int = 0
    samples_trained: int = 0
    steps: int = 0
    optimizer_steps: int = 0
    last_loss: float | None = None
    last_step_s: float | None = None
    grants_waited: int = 0
    grant_wait_s: float = 0.0
    shrunk_steps: int = 0
    windows: int = 0
    abandoned_steps: int = 0
    requeued: int = 0
    conflicts: int = 0
    train_s: float = 0.0  # seconds the trainer ranks ran this adapter's windows (its tenant's learning budget)
    trained_tokens: int = 0  # tokens through its trained forward passes
    last_published_at: float | None = None
    freshness_s: list[float] = field(default_factory=list)
    win_rate: float | None = None
    clpd: float | None = None
    eval_s: float | None = None
    publish_s: float | None = None
    last_grant_s: float | None = None
    last_publish_breakdown: dict[str, float] | None = None
    evaluated_version: int | None = None
    token_logprob: float | None = None
    gate_passed: int = 0
    gate_rejected: int = 0
    last_gate: GateDecided | None = None
    retention: float | None = None  # the served version's retention score (issue 37), and the base's
    retention_base: float | None = None
    retention_s: float | None = None  # seconds the last version's retention scoring took


def resolve_eval_file(path: str | None) -> tuple[str | None, str | None]:
    """The held-out preference file as an absolute path, or (None, why not); relative paths: cwd, then the project root."""
    if not path:
        return None, None
    p = Path(path).expanduser()
    for candidate in [p] if p.is_absolute() else [Path.cwd() / p, ROOT / p]:
        if candidate.is_file():
            return str(candidate.resolve()), None
    return None, f"training.eval_file {path!r} not found (relative paths: cwd, then {ROOT}); evaluation off"


class Trainer:
    """Create with ``ray.remote(Trainer).options(name=cfg.trainer_actor_name, num_cpus=0, max_restarts=-1,
    max_concurrency=100)``; then ``run()`` once. The planner creates it and passes its own handle."""

    def __init__(self, config: AppConfig, namespace: str, planner: Any) -> None:
        self.cfg = config
        self.namespace = namespace
        self.planner = planner  # the planner's actor handle (it created this actor and passes itself)
        self._lock = threading.RLock()  # methods run on the actor's thread pool (max_concurrency)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.full: Any = None  # FullUnitLoop (actors/learning/full/loop.py): the full unit, with cluster.stages > 1
        self._full_thread: threading.Thread | None = None
        self._regroup = False  # the ranks were stopped to start again where the nodes that train are now
        self.state = "idle"
        self.started_at: float | None = None
        self.fits = 0  # worker groups started by fit() (Ray Train restarts inside one fit are counted by workers)
        self.worker_starts = 0
        self.workers: dict[int, dict[str, Any]] = {}
        self._ranks: list[Any] = []
        self.adapters: dict[str, dict[str, Any]] = {}
        self.errors: deque[dict[str, Any]] = deque(maxlen=20)
        self.eval_file, why = resolve_eval_file(self.cfg.training.eval_file)
        if why:
            self._error("config", why)
        self.problem: str | None = None
        t = self.cfg.training
        self.problem = t.scope_rules.workers_problem(t.workers, self.cfg.cluster.nodes)
        if ray.get_runtime_context().was_current_actor_reconstructed:
            # Ray restarted this actor after a crash; whoever called run() before will not call it again.
            self.run()

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Start training in the background (idempotent); returns the status at once."""
        with self._lock:
            if self.problem is not None:
                self.state = "failed"
                self._error("config", self.problem)
            elif self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self.state, self.started_at = "starting", time.time()
                self._thread = threading.Thread(target=self._supervise, name="ray-train-fit", daemon=True)
                self._thread.start()
            if (
                self.problem is None
                and self.cfg.cluster.stages > 1
                and (self._full_thread is None or not self._full_thread.is_alive())
            ):
                from actors.learning.full.loop import FullUnitLoop

                store = ray.get_actor(self.cfg.store_actor_name, namespace=self.namespace)
                self.full = FullUnitLoop(self.cfg, self.planner, store, self._stop, self._error)
                self._full_thread = threading.Thread(target=self.full.run, name="full-unit", daemon=True)
                self._full_thread.start()
        return self.status()

    def ranks(self) -> list[Any]:
        """The live rank actors (tests read their placement through Ray's state API)."""
        with self._lock:
            return list(self._ranks)

    def regroup(self) -> None:
        """The nodes that train changed (the planner switched to or from ``placement: separate``): stop the
        ranks, and the supervisor starts a new group on the nodes that train now, at once and without
        counting an error. Their unpublished step is dropped; its items stay queued."""
        with self._lock:
            ranks = list(self._ranks)
            self._regroup = bool(ranks)
        for a in ranks:
            ray.kill(a)

    def stop(self) -> dict[str, Any]:
        """Ask the drivers to finish (they see it within a few seconds); status at once."""
        self._stop.set()
        if self.state in ("starting", "running", "restarting"):
            self.state = "stopping"
        return self.status()

    def _supervise(self) -> None:
        while not self._stop.is_set():
            self.fits += 1
            try:
                self._fit()
                if self._stop.is_set():
                    break
                self._error("fit", "the worker loop returned without a stop request")
            except Exception as exc:  # the controller gave up (it retries worker failures itself)
                with self._lock:
                    regroup, self._regroup = self._regroup, False
                if regroup:
                    logger.info("trainer: starting the ranks again on the nodes that train now")
                    continue
                logger.exception("the trainer group failed")
                self._error("fit", f"{type(exc).__name__}: {exc}")
            self.state = "restarting"
            self._stop.wait(RESTART_BACKOFF_S)
        self.state = "stopped"

    def _fit(self) -> None:
        """Place the ranks in their nodes' groups, form the process group, and run the drivers over them until
        asked to stop or one fails (a rank died, a collective failed, the store or planner away)."""
        from ray.exceptions import GetTimeoutError

        from actors.learning.lora.driver import LoraDriver
        from actors.learning.lora.rank import TrainRank

        t = self.cfg.training
        locations = self._node_locations()
        # Only the nodes that train take ranks (placement separate keeps its inference nodes free of them).
        nodes = [loc.node_id for loc in locations if loc.trains]
        if not nodes:
            raise RuntimeError(f"no node trains: {locations}")
        workers = t.workers or len(nodes)
        node_of_rank = [nodes[r % len(nodes)] for r in range(workers)]
        groups = {loc.node_id: loc.placement_group_id for loc in locations}
        self.state = "starting"
        ranks = [
            ray.remote(TrainRank)
            .options(**rank_actor_options(t.resources_per_worker, groups.get(node)))
            .remote(r, workers, node, self.cfg, self.namespace)
            for r, node in enumerate(node_of_rank)
        ]
        with self._lock:
            self._ranks = ranks
            self.workers = {}  # a new group: its ranks report where they run afresh
        ended = threading.Event()  # a driver returned: stop the others (their ranks are killed below)
        failures: list[BaseException] = []
        threads: list[threading.Thread] = []
        try:
            try:
                ray.get([a.__ray_ready__.remote() for a in ranks], timeout=PLACE_TIMEOUT_S)
            except GetTimeoutError:
                raise RuntimeError(
                    f"trainer ranks not placed within {PLACE_TIMEOUT_S:.0f} s: each asks {dict(t.resources_per_worker)} "
                    f"in bundle 0 of its node's placement group, beside the replica's {self.cfg.replica_share} "
                    f"(bundle {dict(self.cfg.cluster.bundle)})"
                ) from None
            if t.scope_rules.joins_collective(workers):
                host, port = ray.get(ranks[0].address.remote(), timeout=60)
                ray.get([a.join.remote(host, port) for a in ranks], timeout=JOIN_TIMEOUT_S)
            for started in ray.get([a.start.remote() for a in ranks], timeout=PLACE_TIMEOUT_S):
                self._rank_started(started)
            store = ray.get_actor(self.cfg.store_actor_name, namespace=self.namespace)
            lanes = t.scope_rules.lanes(ranks, node_of_rank)
            drivers = [
                LoraDriver(
                    self.cfg,
                    lane_ranks,
                    lane_nodes,
                    line,
                    store=store,
                    planner=self.planner,
                    eval_file=self.eval_file,
                    should_stop=lambda: self._stop.is_set() or ended.is_set(),
                    report=self.record,
                    warn=self._error,
                )
                for lane_ranks, lane_nodes, line in lanes
            ]

            def drive(driver: Any) -> None:
                try:
                    driver.run()
                except BaseException as exc:  # noqa: BLE001 - handed to the supervisor, which restarts
                    failures.append(exc)
                finally:
                    ended.set()

            threads = [
                threading.Thread(target=drive, args=(d,), name=f"lora-driver-{d.line}", daemon=True) for d in drivers
            ]
            for th in threads:
                th.start()
            # A rank that dies (killed, its replica's group removed, a regroup) ends the group at once, even while
            # the drivers are idle and call no rank: each rank holds one call open until it dies.
            watches = [a.watch.remote() for a in ranks]
            while not ended.is_set():
                done, _ = ray.wait(watches, num_returns=1, timeout=1.0)
                if done:
                    try:
                        ray.get(done[0])
                        failures.append(RuntimeError("a trainer rank's watch returned"))
                    except Exception as exc:  # noqa: BLE001 - the rank died: the supervisor restarts the group
                        failures.append(exc)
                    break
        finally:
            ended.set()
            for a in ranks:
                ray.kill(a)
            for th in threads:
                th.join(timeout=60)
            with self._lock:
                self._ranks = []
        if failures and not self._stop.is_set():
            raise failures[0]

    def _node_locations(self) -> list[NodeLocation]:
        """Where each logical node's replica lives; waits (up to a minute) for the planner to place them."""
        deadline = time.time() + 60
        locations: list[NodeLocation] = []
        while not self._stop.is_set():
            try:
                locations = ray.get(self.planner.node_locations.remote(), timeout=30)
            except Exception as exc:
                self._error("node_locations", f"{type(exc).__name__}: {exc}")
            # Every node's replica registered with its group: a rank goes nowhere else.
            if locations and all(loc.state == "ready" and loc.placement_group_id for loc in locations):
                break
            if time.time() > deadline:
                self._error("placement", f"waiting for every node's replica and placement group: {locations}")
                deadline = time.time() + 60
            self._stop.wait(1.0)
        return locations

    # ---- what the drivers report ------------------------------------------------------------

    def _error(self, where: str, message: str) -> None:
        logger.warning("trainer %s: %s", where, message)
        self.errors.append({"at": time.time(), "where": where, "message": message[:2000]})

    def _rank_started(self, started: RankStarted) -> None:
        with self._lock:
            self.worker_starts += 1
            self.workers[started.rank] = {**asdict(started), "started_at": time.time()}
            if self.state in ("starting", "restarting"):
                self.state = "running"

    def record(self, adapter: str, event: TrainerEvent) -> None:
        """A driver's account of a step, a wait, a published version or a verdict."""
        with self._lock:
            self._record(self.adapters.setdefault(adapter, AdapterProgress()), event)

    @staticmethod
    def _record(a: AdapterProgress, event: TrainerEvent) -> None:
        match event:
            case StepDone():
                a.steps += 1
                a.samples_trained += event.samples
                a.last_loss, a.last_step_s, a.last_grant_s = event.loss, event.seconds, event.grant_s
                a.shrunk_steps += int(event.shrunk)
                a.windows += event.windows
                a.optimizer_steps += int(event.optimizer_step)
                a.requeued += event.requeued  # passes CheckEnd sent back for another pass
                a.train_s += event.seconds
                a.trained_tokens += event.tokens
            case GrantWaited():
                a.grants_waited += 1
                a.grant_wait_s += event.seconds
            case VersionPublished():
                if not event.candidate:  # a candidate is served only once the gate passes it
                    a.version = event.version
                a.versions_published += 1
                a.last_published_at, a.publish_s = event.at, event.seconds
                a.last_publish_breakdown = dict(event.breakdown)
                a.freshness_s = (a.freshness_s + list(event.freshness_s))[-200:]
            case WorkDropped():
                a.conflicts += 1
            case StepAbandoned():
                a.abandoned_steps += 1
            case VersionScored():
                a.win_rate, a.clpd, a.eval_s = event.win_rate, event.clpd, event.seconds
                a.token_logprob, a.evaluated_version = event.token_logprob, event.version
            case GateDecided():
                served = event.state == "served"
                a.gate_passed += served
                a.gate_rejected += not served
                a.last_gate = event
                a.eval_s = event.seconds
                a.retention_s = event.retention_s
                if served and event.retention is not None:
                    a.retention, a.retention_base = event.retention, event.retention_base
                if served:
                    a.version = event.version
                    a.freshness_s = (a.freshness_s + list(event.freshness_s))[-200:]
                    if event.score is not None:
                        a.win_rate, a.clpd = event.win_rate, event.clpd
                        a.token_logprob, a.evaluated_version = event.token_logprob, event.version
            case _:
                raise TypeError(f"not a trainer event: {event!r}")

    def status(self) -> dict[str, Any]:
        """JSON-able state for ``/v1/status``: workers, per-adapter progress, recent errors."""
        with self._lock:
            return self._status()

    def _status(self) -> dict[str, Any]:
        adapters = {}
        for name, progress in self.adapters.items():
            a = asdict(progress)
            gate = progress.last_gate  # the verdict as /v1/status has always shown it
            a["last_gate"] = (
                None
                if gate is None
                else {
                    k: getattr(gate, k)
                    for k in (
                        "version",
                        "state",
                        "reason",
                        "score",
                        "baseline_version",
                        "baseline_score",
                        "seconds",
                        "retention",
                        "retention_base",
                        "retention_s",
                    )
                }
            )
            fresh = a.pop("freshness_s")  # seconds from an item's acceptance to its version being loaded
            adapters[name] = a | {
                "freshness_p50_s": round(statistics.median(fresh), 3) if fresh else None,
                "freshness_max_s": round(max(fresh), 3) if fresh else None,
            }
        return {
            "state": self.state,
            "scope": self.cfg.training.scope,
            "started_at": self.started_at,
            "fits": self.fits,
            "worker_starts": self.worker_starts,
            "workers": [self.workers[r] for r in sorted(self.workers)],
            "adapters": adapters,
            "eval_file": self.eval_file,
            # The full unit (full_sft/full_dpo) trained on node 0's pipeline stages; None: cluster.stages is 1.
            "full": None if self.full is None else self.full.status(),
            "errors": list(self.errors),
        }


def rank_actor_options(share: dict[str, float], placement_group_id: str | None) -> dict[str, Any]:
    """Ray options of a rank: its share of bundle 0 of its node's placement group (by the group's hex id)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from compat import placement_group

    res = dict(share)
    options: dict[str, Any] = {
        "num_cpus": res.pop("CPU", 0.0),
        "num_gpus": res.pop("GPU", 0.0),
        "max_restarts": 0,
        "max_concurrency": 2,
    }
    if res:
        options["resources"] = res
    if placement_group_id:
        group = placement_group(placement_group_id)
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=0, placement_group_capture_child_tasks=False
        )
    return options
