"""LoraDriver: the single controller of the LoRA trainer (as verl's), run in the Trainer supervisor; it owns the loop.

One driver per queue partition: scope ``synced`` has one, over every rank (the ranks average
gradients, so every version is one model); scope ``per_node`` has one per node, over that node's
rank, its queue and its versions (LEMIX §V-B). The driver alone reads the feedback store and asks
the planner. Per micro-step it:

1. picks the adapter (fair turns across tenants, then adapters: ``planners/turns.py``) and takes up
   to ``micro_batch`` of its queued items from the store;
2. sends every rank one :class:`StepPlan`; each opens a windowed pass over its share of the items
   and answers the tokens of each (:class:`StepBegun`);
3. runs the step's grant rounds (``grant_rounds.py``, FlexLLM §6.1–6.2): the windows the planner
   grants each rank's node beside its inference work, until every item's pass is finished;
4. reports each item's loss to the planner, whose CheckEnd (MACE Alg. 1 lines 17–21) retires it
   or requeues it (a requeued item stays unconsumed and is taken again with its loss in its
   priority, MACE §4.1), and ends the micro-step on every rank: every ``accumulation``
   micro-steps the ranks all-reduce their gradients and step their optimizers;
5. every ``steps_per_version`` optimizer steps, or when the adapter's queue is empty, publishes:
   ``reserve_version`` → rank 0 saves (atomic) and makes the files readable from every node →
   ``publish_version`` (one store transaction that marks the items consumed and answers the store's
   served-change number) → ``Planner.load_adapter``, which waits until the planner has followed that
   number; with the gate on, the version is a candidate that the gate (``evaluator.py``) scores on
   rank 0 between steps and the store decides in one transaction.

Faults stay with their adapter: a rank's fault for an adapter (``rank_group.py`` says whose an error
is) pauses that adapter with the error as its reason, drops its unpublished work on every rank and
goes on with the others; the store or planner away, a dead rank or a failed collective return the
error, and the Trainer starts the ranks again.

What stays here shares one state (what the ranks hold, the unpublished version, CheckEnd's verdicts):
picking the step, CheckEnd and publishing. Apart: the grant rounds (``grant_rounds.py``), the calls to
the ranks (``rank_group.py``), the unpublished version's items and counters (``unpublished.py``), the
gate (``evaluator.py``), the messages and the rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from actors.learning.lora.evaluator import VersionEvaluator
from actors.learning.lora.grant_rounds import GrantRounds
from actors.learning.lora.messages import (
    GrantWaited,
    ItemLoss,
    SaveVersion,
    StepAbandoned,
    StepBegun,
    StepDone,
    StepPlan,
    TrainerEvent,
    TrainingSpec,
    VersionMeta,
    VersionPublished,
    WorkDropped,
)
from actors.learning.lora.rank_group import RankFault, RankGroup, transient
from actors.learning.lora.unpublished import UnpublishedVersion
from actors.learning.messages import PassReport, PassVerdict
from actors.learning.store.unit_kind import unit_kind
from planners.turns import TrainingTurns
from settings import AppConfig

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 5.0  # an idle driver waits on the store at most this long (new feedback wakes it at once; so does a stop)
ADOPT_EVERY_S = 5.0  # a busy driver looks this often for candidates it did not publish (uploads) to judge
SPEC_TTL_S = 2.0  # a PATCHed adapter (mode, learning rate) takes effect within this
CALL_TIMEOUT_S = 30.0
LOAD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Flush:
    """Publish what is trained of ``adapter`` (its next step is refused, or another adapter's turn came)."""

    adapter: str


class LoraDriver:
    """The loop of one queue partition (``line``: a node under ``per_node``, None when synced) over its ranks."""

    def __init__(
        self,
        cfg: AppConfig,
        ranks: list[Any],
        nodes: list[int],
        line: int | None,
        *,
        store: Any,
        planner: Any,
        eval_file: str | None,
        should_stop: Callable[[], bool],
        report: Callable[[str, TrainerEvent], None],
        warn: Callable[[str, str], None],
    ) -> None:
        self.cfg, self.t = cfg, cfg.training
        self.group, self.nodes, self.line = RankGroup(ranks), nodes, line
        self.rounds = GrantRounds(self.group, nodes, planner, self.warn)
        self.node_id = nodes[0]  # the node whose planner state judges CheckEnd (rank 0's)
        self.store, self.planner = store, planner
        self.should_stop, self.report, self._warn_to = should_stop, report, warn
        self.loaded: tuple[str, int | None] | None = None  # (adapter, version) the ranks' weights started from
        self.unpublished = UnpublishedVersion()  # of the adapter the ranks train (``loaded``)
        # CheckEnd's last verdict for items it sent back (MACE Alg. 1 line 21): trained again, never held, until retired.
        self.requeued: dict[int, PassVerdict] = {}
        self.specs: dict[str, tuple[float, TrainingSpec]] = {}
        self.store_changes = -1  # the store's change number as of the last idle wait (-1: look at once)
        self.turns = TrainingTurns()
        self.not_before: dict[str, float] = {}  # adapter -> when to pick it again (after a fault)
        self.evaluator = VersionEvaluator(
            self.store,
            line,
            self.t,
            cfg.data_path,
            eval_file,
            rank_zero=self.group,
            spec_changed=lambda adapter: self.specs.pop(adapter, None),
            load_on_replicas=self.load_on_replicas,
            report=lambda adapter, event: self.report(adapter, event),
            warn=lambda where, exc: self.warn(where, exc),
        )
        self._adopted_at = 0.0
        self._resume_gate()

    # ---- the loop --------------------------------------------------------------------------------

    def run(self) -> None:
        """Train until asked to stop; raises when the group or the store/planner failed (the Trainer restarts)."""
        while not self.should_stop():
            if time.time() - self._adopted_at > ADOPT_EVERY_S:
                self._resume_gate()  # an uploaded candidate waits for the gate as a trained one does
            if self.evaluator.pending():
                # Scoring shares rank 0's model, so it runs here, between steps.
                self.evaluator.work_one()
            decision = self._next()
            if isinstance(decision, StepPlan):
                self._guarded(decision.adapter, "step", lambda d=decision: self._step(d))
            elif isinstance(decision, Flush):
                self._guarded(
                    decision.adapter, "publish", lambda d=decision: self._finish_version(d.adapter, flush=True)
                )

    def _guarded(self, adapter: str, where: str, work: Callable[[], None]) -> None:
        """Run ``work``; an adapter's own fault pauses that adapter with the error as its reason, and the loop goes
        on with the others. The store or planner away, a rank dead: raised, the Trainer restarts the ranks."""
        try:
            work()
        except Exception as exc:
            if transient(exc):
                raise
            self._adapter_fault(adapter, where, exc)

    # ---- what to do next ----------------------------------------------------------------------------

    def _spec(self, adapter: str) -> TrainingSpec:
        cached = self.specs.get(adapter)
        if cached is None or time.time() - cached[0] > SPEC_TTL_S:
            info = ray.get(self.store.get_adapter.remote(adapter), timeout=CALL_TIMEOUT_S)
            spec = TrainingSpec(
                info.name,
                info.method,
                info.beta,
                info.mode,
                info.learning_rate,
                info.lora,
                info.paused_reason is not None,
                info.tenant,
                info.warmup_steps,
            )
            self.specs[adapter] = cached = (time.time(), spec)
        return cached[1]

    def _next(self) -> StepPlan | Flush | None:
        """The next step, or a flush; None: nothing to do (after waiting for the store to change)."""
        try:
            return self._decide()
        except Exception as exc:
            if not transient(exc):  # e.g. a deleted adapter's spec: look again in a moment
                self.warn("plan", exc)
                time.sleep(IDLE_WAIT_S)
                return None
            raise

    def _idle(self, wake_at: float | None = None) -> None:
        """Nothing to train now: wait until the store changes (new feedback, a changed adapter), at most until
        ``wake_at`` or IDLE_WAIT_S. A long poll, so an idle trainer costs nothing while the app serves."""
        timeout = IDLE_WAIT_S if wake_at is None else max(0.0, min(IDLE_WAIT_S, wake_at - time.time()))
        if self.evaluator.pending():
            timeout = 0.0  # scoring waits: come back to the loop at once
        seen = self.store_changes
        self.store_changes = ray.get(
            self.store.wait_for_change.remote(self.store_changes, timeout), timeout=timeout + CALL_TIMEOUT_S
        )
        if self.store_changes != seen:
            self._resume_gate()  # the change may be an uploaded candidate (POST /v1/adapters/{name}/versions)

    def _decide(self) -> StepPlan | Flush | None:
        # adapter -> (unconsumed, oldest created_at), of this node's partition under per_node
        summary = ray.get(self.store.queue_summary.remote(self.line), timeout=CALL_TIMEOUT_S)
        current = self.loaded[0] if self.loaded else None
        pending = self.unpublished.started
        now = time.time()
        taken = self.unpublished.taken()

        def available(name: str) -> int:
            return summary.get(name, (0, None))[0] - (len(taken) if name == current else 0)

        def trainable(name: str) -> bool:
            # Not while the gate judges the adapter's candidate: the next version must start from
            # whatever is served after the verdict, never from weights the gate may reject.
            # A full unit (full_sft/full_dpo) is not a LoRA adapter: actors/learning/full/loop.py trains it.
            return (
                available(name) > 0
                and unit_kind(self._spec(name).method).trained_by_lora_ranks
                and self._spec(name).mode != "off"
                and not self._spec(name).paused
                and not self.evaluator.judging(name)
                and self.not_before.get(name, 0) <= now
            )

        if pending:
            # One model per rank: finish (publish) the adapter in training before switching.
            if not trainable(current):
                return Flush(current)
            adapter = current
        else:
            names = sorted(n for n in summary if trainable(n))
            if not names:
                waiting = [
                    self.not_before[n]
                    for n in summary
                    if available(n) > 0 and self.not_before.get(n, 0) > now and self._spec(n).mode != "off"
                ]
                self._idle(min(waiting) if waiting else None)
                return None
            # Fair turns: across tenants first, then across the tenant's adapters (planners/turns.py).
            adapter = self.turns.next(names, {n: self._spec(n).tenant for n in names})
            self.turns.trained(adapter, self._spec(adapter).tenant)
        spec = self._spec(adapter)
        cur = ray.get(self.store.current_version.remote(adapter, self.line), timeout=CALL_TIMEOUT_S)
        target = (cur.version, cur.path) if cur is not None else (None, None)
        held = taken if adapter == current else []
        items = ray.get(self.store.take.remote(adapter, self.t.micro_batch, held, self.line), timeout=CALL_TIMEOUT_S)
        if not items:
            self._idle()
            return None
        more = available(adapter) - len(items) > 0
        return StepPlan(
            adapter,
            spec,
            target,
            tuple(items),
            last_of_queue=not more,
            requeued={i.id: self.requeued[i.id] for i in items if i.id in self.requeued},
        )

    # ---- one micro-step ---------------------------------------------------------------------------------

    def _step(self, plan: StepPlan) -> None:
        adapter = plan.adapter
        if (
            self.loaded is not None
            and self.loaded[0] == adapter
            and self.loaded[1] != plan.target[0]
            and self.unpublished.started
        ):
            # The current version moved under unpublished work (a rollback): drop it, train the items again.
            self.report(adapter, WorkDropped())
        begun: list[StepBegun] = self.group.all(lambda r: r.begin_step.remote(plan))
        fault = next((b.fault for b in begun if b.fault), None)
        if fault is not None:
            raise RankFault(fault)
        if self.loaded != (adapter, plan.target[0]):
            self.loaded = (adapter, plan.target[0])
            self.unpublished = UnpublishedVersion()
        rounds = self.rounds.run(plan, begun, lambda: self._abandon_requested(adapter))
        if rounds is None or rounds.fault is not None:
            self._abandon(adapter)  # drop the micro-step on every rank; its items stay queued
            if rounds is None:
                return
            raise RankFault(rounds.fault)
        finished, run_s, windows = rounds.finished, rounds.run_s, rounds.windows
        lengths = {sid: n for b in begun for sid, n in (b.forward_lengths or b.lengths).items()}  # L, the item's tokens
        loss_sum = sum(f.loss * f.weight for f in finished.values())
        weight_sum = sum(f.weight for f in finished.values())
        # CheckEnd before the items become held: a requeued item must not be marked consumed at publish.
        requeued = self._check_end(plan, finished, lengths)
        stepped = self.unpublished.micro_done + 1 >= self.t.accumulation or plan.last_of_queue
        self.group.all(lambda r: r.end_step.remote(stepped))
        loss = loss_sum / max(weight_sum, 1e-12)
        self.unpublished.add_micro_step(plan.items, loss)
        if stepped:
            self.unpublished.applied(self.requeued)
        self.report(
            adapter,
            StepDone(
                samples=len(plan.items),
                loss=loss,
                tokens=sum(lengths.values()),
                seconds=run_s,
                grant_s=time.time() - rounds.started_at - run_s,
                windows=windows,
                shrunk=windows > len(plan.items),
                optimizer_step=stepped,
                requeued=requeued,
            ),
        )
        if rounds.waited_s:
            self.report(adapter, GrantWaited(rounds.waited_s))
        steps = self.unpublished.opt_steps
        if steps >= self.t.steps_per_version or (plan.last_of_queue and steps > 0):
            self._finish_version(adapter, flush=False)

    def _abandon_requested(self, adapter: str) -> bool:
        """Stop, or the adapter's mode became ``off`` mid-step: its unfinished step is dropped."""
        if self.should_stop():
            return True
        try:
            return self._spec(adapter).mode == "off"
        except Exception:
            return False

    def _abandon(self, adapter: str) -> None:
        """Drop the micro-step and the gradients not yet applied on every rank; their items stay queued."""
        self.group.all(lambda r: r.abandon_step.remote())
        self.unpublished.drop_micro_steps()
        self.report(adapter, StepAbandoned())

    def _check_end(self, plan: StepPlan, finished: dict[int, ItemLoss], lengths: dict[int, int]) -> int:
        """Report each item's loss in this pass to the planner; its CheckEnd (MACE Alg. 1 lines 17–21) says
        which items to train again. Returns how many were requeued.

        A requeued item is never held, so no version marks it consumed: it stays in the store's queue
        (counted as queued, at-least-once across a crash) and ``take`` hands it out again once the
        optimizer step has applied this pass, with CheckEnd's t_arr and loss for the grants'
        priorities. Its last pass, retired, is held like any item and consumed by that version.
        """
        reports = [
            PassReport(it.id, lengths[it.id], finished[it.id].loss, plan.arrival(it), plan.passes_before(it))
            for it in plan.items
        ]
        try:
            verdicts = ray.get(
                self.planner.report_passes.remote(self.node_id, plan.adapter, plan.spec.mode, reports),
                timeout=CALL_TIMEOUT_S,
            )
        except Exception as exc:  # planner restarting: one pass per item, as without CheckEnd
            self.warn("report_passes", exc)
            verdicts = [PassVerdict(r.sample_id, "retired", r.passes_before + 1, r.loss, r.arrival) for r in reports]
        for v in verdicts:
            if v.outcome == "requeued":
                self.requeued[v.sample_id] = v
            else:
                self.requeued.pop(v.sample_id, None)
        return sum(v.outcome == "requeued" for v in verdicts)

    # ---- versions ----------------------------------------------------------------------------------------

    def _finish_version(self, adapter: str, flush: bool) -> None:
        """Apply pending gradients if flushing, then publish and tell the ranks how it went."""
        if self.loaded is None or self.loaded[0] != adapter:
            return
        if flush and self.unpublished.micro_done > 0:
            self.group.all(lambda r: r.apply_gradients.remote())
            self.unpublished.applied(self.requeued)
        if self.unpublished.opt_steps == 0:
            return
        created = list(self.unpublished.held_created)
        version, path, candidate = self._publish(adapter)
        if version is None:
            self.group.all(
                lambda r: r.forget.remote(adapter)
            )  # reload the store's current version before the next step
            self.loaded = None
            self.unpublished = UnpublishedVersion()
            return
        if len(self.group) > 1:
            self.group.gather(
                [r.advance.remote(adapter, version) for r in self.group.ranks[1:]]
            )  # rank 0 did on saving
        self.loaded = (adapter, version)
        self.unpublished = UnpublishedVersion()
        self.evaluator.submit(adapter, version, path, candidate=candidate, created=created)

    def _publish(self, adapter: str) -> tuple[int | None, str | None, bool]:
        """Reserve a version, have rank 0 save it, record it in one store transaction, load it on the replicas."""
        from actors.learning.store.models import VersionConflict

        t0 = time.time()
        work = self.unpublished
        samples, loss = work.samples, work.mean_loss()
        parent = self.loaded[1] if self.loaded else None
        marks = [t0]
        try:
            v = ray.get(self.store.reserve_version.remote(adapter, self.line), timeout=CALL_TIMEOUT_S)
            marks.append(time.time())
            meta = VersionMeta(parent, samples, loss, len(work.held), self.t.scope, len(self.group), self.line)
            path = self.group.gather([self.group.ranks[0].save.remote(SaveVersion(adapter, v.version, meta))])[0]
            marks.append(time.time())
            published = ray.get(
                self.store.publish_version.remote(adapter, v.version, path, work.held, samples, loss),
                timeout=CALL_TIMEOUT_S,
            )
            marks.append(time.time())
        except VersionConflict as exc:
            # A rollback moved the current version: drop this work; the items are still queued.
            self.report(adapter, WorkDropped())
            self.warn("publish", exc)
            return None, None, False
        except Exception as exc:
            self.warn("publish", exc)
            if not transient(exc):  # e.g. the version's files could not be written: this adapter's fault
                self._adapter_fault(adapter, "save", exc)
            return None, None, False
        created = list(self.unpublished.held_created)
        names = ("reserve_s", "save_s", "publish_s", "load_s")
        if published.info.state == "candidate":
            # The gate is on: not served until the evaluator passes it (it loads it on the replicas then).
            now = time.time()
            breakdown = dict(zip(names, (round(b - a, 4) for a, b in zip(marks, marks[1:]))))
            self.report(adapter, VersionPublished(v.version, now, now - t0, breakdown, candidate=True))
            return v.version, path, True
        self.load_on_replicas(adapter, published.served_change)
        now = time.time()
        marks.append(now)
        breakdown = dict(zip(names, (round(b - a, 4) for a, b in zip(marks, marks[1:]))))
        self.report(
            adapter, VersionPublished(v.version, now, now - t0, breakdown, tuple(round(now - c, 3) for c in created))
        )
        return v.version, path, False

    def load_on_replicas(self, adapter: str, served_change: int) -> None:
        """The store serves a new version of ``adapter`` as of its ``served_change``: wait until the replicas serve
        it (the planner follows the store anyway; waiting here makes the freshness figures mean "served")."""
        try:
            nodes = self.t.scope_rules.serving_nodes(self.node_id)  # per_node: only this node serves its copy
            ray.get(self.planner.load_adapter.remote(adapter, nodes, served_change), timeout=LOAD_TIMEOUT_S)
        except Exception as exc:  # published in the store; the planner restores it on restart
            self.warn("load_adapter", exc)

    def _resume_gate(self) -> None:
        """Candidates this driver does not judge yet: those a previous driver left undecided (the group failed
        while the gate judged them) and uploaded ones (published by the store, not by a rank)."""
        self._adopted_at = time.time()
        try:
            left = ray.get(self.store.candidates.remote(self.line), timeout=60)
        except Exception as exc:
            self.warn("candidates", exc)
            return
        for v in left:
            if not self.evaluator.has(v.adapter, v.version):
                self.evaluator.submit(v.adapter, v.version, v.path, candidate=True, created=[])

    # ---- faults and reports -----------------------------------------------------------------------

    def _adapter_fault(self, adapter: str, where: str, exc: BaseException | str) -> None:
        """Pause ``adapter`` (its ``paused_reason`` names the error) and forget its work on every rank."""
        message = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, RankFault):
            message = str(exc)
        reason = f"trainer {where} failed: {message}"[:1000]
        logger.warning("adapter %s paused: %s", adapter, reason)
        self.warn(f"{where} {adapter}", message)
        self._drop_adapter(adapter)
        try:
            ray.get(self.store.pause_adapter.remote(adapter, reason), timeout=CALL_TIMEOUT_S)
        except Exception as again:  # the store away: the next fault pauses it; the loop goes on meanwhile
            self.warn("pause_adapter", again)
        self.not_before[adapter] = time.time() + SPEC_TTL_S  # not picked again before the pause is read back

    def _drop_adapter(self, adapter: str) -> None:
        """Forget the adapter's slot, gradients and unpublished work on every rank; its items stay queued."""
        self.specs.pop(adapter, None)
        self.group.all(lambda r: r.forget.remote(adapter))
        if self.loaded is not None and self.loaded[0] == adapter:
            self.loaded = None
            self.unpublished = UnpublishedVersion()

    def warn(self, where: str, exc: BaseException | str) -> None:
        """Log what went wrong at ``where`` and pass it on to the trainer's warnings (the evaluator uses it too)."""
        message = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        logger.warning("trainer driver (line %s), %s: %s", self.line, where, message)
        self._warn_to(f"driver {where}" if self.line is None else f"driver node {self.line} {where}", message)
