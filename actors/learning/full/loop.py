"""FullUnitLoop: trains the deployment's full unit (full_sft / full_dpo) from its feedback on node 0's pipeline
stages and publishes each version.

It runs as a thread of the Trainer actor (actors/learning/trainer.py), beside the LoRA ranks. Each round:
the store's full unit (at most one, actors/learning/store/sqlite.py) and its queue go to the unit's
retraining policy (planners/retraining.py, as for adapters: ``sync`` trains as soon as feedback is
queued, ``periodic`` in windows, ``off`` never); a ``run`` takes up to ``micro_batch × accumulation``
items, the :class:`~actors.learning.full.trainer.PipelineTrainer` trains ``steps_per_version`` steps on
them with stage i in bundle i of node 0's replica placement group and writes ``<unit>/v<N>``
atomically; then the store publishes the version and consumes exactly those items in one
transaction (never before the files are complete), and the planner makes every node's engine
compute with it (``Planner.load_full``, confirmed by the replicas, which measure the sync).

The stage actors stay up between versions (they hold the weights the next version starts from);
a version trained from weights that are no longer current (a rollback came in) is refused by the
store (``VersionConflict``) and its items stay queued; the next round resumes the stages from the
current version (or the starting model). Any failure drops the stages; the next round starts new
ones in the group of whatever replica serves node 0 then.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from actors.learning.full.messages import PipelineSettings, TrainingSample
from actors.learning.messages import FullVersion
from actors.learning.store.models import VersionConflict
from actors.learning.store.records import FeedbackItem
from actors.learning.store.unit_kind import unit_kind
from planners.retraining import RetrainingPolicy, RetrainingView, make_policy
from settings import AppConfig

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 30.0  # an idle loop wakes at least this often (new feedback wakes it at once)
RETRY_S = 5.0
SYNC_TIMEOUT_S = 180.0


@dataclass
class FullProgress:
    """What the loop has done for the full unit, as ``/v1/status`` shows it under ``training.full``."""

    unit: str | None = None
    state: str = "idle"  # idle | training | syncing | failed
    version: int | None = None
    versions_published: int = 0
    samples_trained: int = 0
    last_loss: float | None = None
    train_s: float | None = None  # the pipeline's train call (stages started on the first), seconds
    publish_to_served_s: float | None = None  # from the store's publish to every ready node confirming the sync
    nodes_synced: list[int] = field(default_factory=list)
    placement_group_id: str | None = None
    stages: list[dict[str, Any]] = field(default_factory=list)  # each stage actor's bundle, layers and id
    dropped: int = 0  # versions the store refused (a rollback moved the current version meanwhile)


def to_sample(item: FeedbackItem) -> TrainingSample:
    return TrainingSample(
        prompt=item.prompt or "",
        completion=item.completion,
        chosen=item.chosen,
        rejected=item.rejected,
        messages=None if item.messages is None else list(item.messages),
    )


class FullUnitLoop:
    """The full unit's trainer; ``run()`` blocks until ``stop`` is set (the Trainer runs it in a thread)."""

    def __init__(
        self, cfg: AppConfig, planner: Any, store: Any, stop: threading.Event, error: Callable[[str, str], None]
    ) -> None:
        self.cfg = cfg
        self.planner = planner
        self.store = store
        self.stop = stop
        self.error = error
        self.pipeline: Any = None
        self.group_id: str | None = None
        self.policy: tuple[tuple[str, str, str], RetrainingPolicy] | None = None
        self.last_run: float | None = None
        self.progress = FullProgress()
        self._lock = threading.Lock()

    def status(self) -> dict[str, Any]:
        with self._lock:
            return asdict(self.progress)

    def run(self) -> None:
        seen = 0
        while not self.stop.is_set():
            try:
                wait = self.round()
                if wait > 0:  # new feedback or a changed unit ends the wait at once
                    seen = ray.get(self.store.wait_for_change.remote(seen, wait), timeout=wait + 30)
            except Exception as exc:  # the store restarting, a stage dying: start again from the store's state
                logger.exception("full unit training failed")
                self.error("full", f"{type(exc).__name__}: {exc}")
                self.progress.state = "failed"
                self.shutdown()
                self.stop.wait(RETRY_S)
        self.shutdown()

    def shutdown(self) -> None:
        if self.pipeline is not None:
            self.pipeline.shutdown()
        self.pipeline, self.group_id = None, None

    # ---- one round ----------------------------------------------------------------------------

    def round(self) -> float:
        """Train and publish one version if the unit's policy says so; the seconds to wait before the next round."""
        units = [a for a in ray.get(self.store.list_adapters.remote()) if not unit_kind(a.method).trained_by_lora_ranks]
        if not units:
            return IDLE_WAIT_S
        unit = units[0]
        self.progress.unit = unit.name
        if unit.paused_reason is not None or unit.queued == 0:
            return IDLE_WAIT_S
        t = self.cfg.training
        now = time.time()
        per_version = t.micro_batch * t.accumulation
        view = RetrainingView(
            now=now,
            node_id=0,
            queued=unit.queued,
            oldest_queued_age_s=None if unit.oldest_queued_at is None else now - unit.oldest_queued_at,
            last_run_at=self.last_run,
            samples_wanted=min(unit.queued, per_version),
            tokens_wanted=0,
        )
        decision = self._policy(unit).decide(view)
        if decision.action == "wait":
            return min(decision.wait_s, IDLE_WAIT_S)
        items: list[FeedbackItem] = ray.get(self.store.take.remote(unit.name, decision.samples))
        if not items:
            return IDLE_WAIT_S
        self.last_run = now
        self._train_and_publish(unit, items)
        return 0.0

    def _policy(self, unit: Any) -> RetrainingPolicy:
        key = (unit.name, unit.mode, repr(unit.periodic))
        if self.policy is None or self.policy[0] != key:
            periodic = unit.periodic.model_dump() if unit.mode == "periodic" else None
            self.policy = (key, make_policy(unit.mode, self.cfg.training.retraining_params, periodic))
        return self.policy[1]

    def _pipeline(self, unit: Any) -> Any:
        """The stage actors in node 0's replica group, started afresh when that group or the unit's settings changed."""
        from actors.learning.full.trainer import PipelineTrainer
        from compat import placement_group

        locations = ray.get(self.planner.node_locations.remote(), timeout=30)
        group = locations[0].placement_group_id if locations and locations[0].state == "ready" else None
        if group is None:
            raise RuntimeError(f"node 0 has no ready replica placement group yet: {locations}")
        settings = PipelineSettings.from_config(
            self.cfg,
            stage_resources=dict(self.cfg.training.stage_resources),
            learning_rate=unit.learning_rate,
            beta=unit.beta,
        )
        if self.pipeline is not None and (self.group_id != group or self.pipeline.settings != settings):
            self.shutdown()
        if self.pipeline is None:
            pg = placement_group(group)
            if len(pg.bundle_specs) < 2:
                raise RuntimeError("a full unit trains on cluster.stages >= 2 bundles of node 0's placement group")
            self.pipeline, self.group_id = PipelineTrainer(settings, pg), group
        return self.pipeline

    def _train_and_publish(self, unit: Any, items: list[FeedbackItem]) -> None:
        pipeline = self._pipeline(unit)
        current = ray.get(self.store.current_version.remote(unit.name))
        start_from = current.path if current is not None else pipeline.settings.model_dir
        # The stages hold the weights of the last version they trained; start from the served one.
        resume = None if os.path.realpath(pipeline.weights_from) == os.path.realpath(start_from) else start_from
        reserved = ray.get(self.store.reserve_version.remote(unit.name))
        self.progress.state = "training"
        t0 = time.perf_counter()
        trained = pipeline.train(
            [to_sample(it) for it in items],
            unit.method,
            unit=unit.name,
            version=reserved.version,
            steps=self.cfg.training.steps_per_version,
            resume_from=resume,
        )
        train_s = time.perf_counter() - t0
        with self._lock:
            p = self.progress
            p.placement_group_id = self.group_id
            p.stages = [
                {
                    "stage": i.stage_id,
                    "actor_id": i.actor_id,
                    "bundle": i.stage_id,
                    "layers": [i.layer_start, i.layer_stop],
                }
                for i in pipeline.info
            ]
            p.train_s, p.last_loss = round(train_s, 3), trained.loss
        try:
            # The version's files are complete (written atomically); only now are its items consumed.
            ray.get(
                self.store.publish_version.remote(
                    unit.name,
                    reserved.version,
                    trained.path,
                    [it.id for it in items],
                    len(items),
                    trained.loss,
                    gated=False,
                )
            )
        except VersionConflict as exc:
            self.progress.dropped += 1
            self.progress.state = "idle"
            self.error("full publish", str(exc))
            return
        self.progress.state = "syncing"
        t1 = time.perf_counter()
        nodes = ray.get(
            self.planner.load_full.remote(FullVersion(unit.name, reserved.version, trained.path)),
            timeout=SYNC_TIMEOUT_S,
        )
        served_s = time.perf_counter() - t1
        with self._lock:
            p = self.progress
            p.version, p.versions_published = reserved.version, p.versions_published + 1
            p.samples_trained += len(items)
            p.publish_to_served_s, p.nodes_synced, p.state = round(served_s, 3), list(nodes), "idle"
        logger.info(
            "full unit %s v%d: %d items, %d steps in %.2f s (loss %.4f), served by nodes %s %.3f s after publishing",
            unit.name,
            reserved.version,
            len(items),
            trained.steps,
            train_s,
            trained.loss or 0.0,
            nodes,
            served_s,
        )
