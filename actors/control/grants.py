"""The planner's training grants: which token windows a trainer may run now on its node, and where feedback trains.

A trainer asks with its unfinished samples (:class:`GrantRequest`). Adapters in mode ``hybrid`` are granted by
the node's iteration scheduler (``planner.iteration``, FlexLLM §6.2's budget and MACE §4.1–4.2 by default) within
the memory guard's check (LEMIX Alg. 2), both held per node in ``actors/control/node_coserving.py``; the other
modes by the adapter's retraining policy (``planners/retraining.py``), which for ``hybrid`` heeds the placement's
Eq. 4 verdict (LEMIX). Every granted step enters Q_train^n of the planner's training placement until the trainer
reports its passes (CheckEnd, MACE Alg. 1 lines 17–21). New feedback of ``per_node`` scope is placed by the same
training placement (LEMIX Eq. 1–3). Plain Python on the planner actor's event loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from actors.control.nodes import NodeRecord, NodeRegistry
from actors.control.policies import Policies
from actors.learning.messages import Grant, GrantedWindow, GrantRequest, PassReport, PassVerdict, WindowsRan
from planners.coserving import FineTuneSample, whole_windows
from planners.costs import CostModel
from planners.placement import TrainingPlacer
from planners.types import NewFeedback, NodeView
from settings import AppConfig

GRANT_HOLD_S = 1.0  # a refused grant waits here for the node's next reports this long before the trainer asks again


class TrainingGrants:
    """Grant decisions for the trainers, the retraining policies they use, and the placement of new feedback."""

    def __init__(self, cfg: AppConfig, cost_model: CostModel, registry: NodeRegistry, policies: Policies) -> None:
        self.cfg = cfg
        self.cost_model = cost_model
        self.registry = registry
        self.nodes = registry.nodes
        self.policies = policies
        self._retraining: dict[tuple[str, str], Any] = {}  # (adapter, mode) -> policy from the registry
        self._last_run: dict[str, float] = {}

    @property
    def training(self) -> TrainingPlacer:
        """The planner's training placement in force (``Policies.switch`` replaces it)."""
        return self.policies.training

    def _views(self) -> tuple[NodeView, ...]:
        return self.registry.views()

    async def feedback_nodes(self, items: list[NewFeedback], store: Any) -> list[int | None]:
        """per_node scope: the node whose copy trains on each new feedback item, in item order.

        Each item is a training task placed by the training placement: LEMIX's best Eq. 3 score
        (Eq. 1–3), the shortest queue for the other policies (``planners/placement/training.py``).
        """
        queued = {} if self.training.has_eq4 else await store.queued_by_node.remote()
        return self.training.place_feedback(items, self._views(), queued, time.time())

    def adapter_changed(self, adapter: str) -> None:
        """The adapter's training settings changed: build its retraining policy afresh at the next grant."""
        for key in [k for k in self._retraining if k[0] == adapter]:
            del self._retraining[key]

    async def grant(self, request: GrantRequest, store: Any) -> Grant:
        """Which token windows may the trainer on ``request.node_id`` run now for its unfinished samples?

        The trainer owns its samples' progress and sends it with each request (``SampleProgress``:
        tokens, done, t_arr, last loss, MACE §4.1's γ·L_DPO term); when the windows of its previous grant
        ran, it said apart (:meth:`windows_ran`). Adapters in mode ``hybrid`` are granted by the node's iteration
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
        deadline = time.time() + GRANT_HOLD_S
        grant = await self._grant_now(request, store)
        again = GrantRequest(
            request.node_id, request.adapter, request.mode, request.samples, None, request.optimizer_bytes
        )  # what ran is counted once
        reported = self.registry.reported
        while not grant.windows:
            left = deadline - time.time()
            if left <= 0:
                return Grant((), 0.0, grant.reason)
            async with reported:
                try:
                    await asyncio.wait_for(
                        reported.wait(), timeout=min(left, max(grant.wait_s, self.cfg.planner.grant_recheck_s))
                    )
                except TimeoutError:
                    pass
            grant = await self._grant_now(again, store)
        return grant

    async def _grant_now(self, request: GrantRequest, store: Any) -> Grant:
        """One decision on ``request`` with the node's facts as they are now (see :meth:`grant`)."""
        node_id, adapter, mode = request.node_id, request.adapter, request.mode
        node = self.nodes[node_id]
        now = time.time()
        self.training.done(node_id, now)  # it asks again: what it was granted before has run
        queue = [
            FineTuneSample(str(x.sample_id), x.tokens, x.arrival, x.last_loss, x.done, forward_tokens=x.forward_tokens)
            for x in request.samples
        ]
        offload, wait_s = False, self.cfg.planner.grant_recheck_s
        co = node.coserving
        if mode == "hybrid" and self.cfg.planner.iteration is not None:
            windows, reason, budget = co.iteration_windows(queue, node.facts, now)
            windows, reason, offload, wait_s = co.check_memory(
                request, windows, reason, node.facts, self.cost_model.memory.weight_bytes, now
            )
        else:
            windows, reason, budget = await self._retraining_windows(node, adapter, mode, queue, now, store)
        co.record_answer(adapter, mode, windows, reason, budget, node.facts, now)
        if not windows:
            return Grant((), wait_s, reason)
        co.granted(windows, node.facts, now)  # predicted, then measured when the trainer says it ran
        self._training_granted(node_id, adapter, windows, now)
        self._last_run[adapter] = now
        return Grant(tuple(GrantedWindow(int(w.sample_id), w.start, w.end) for w in windows), 0.0, reason, offload)

    def windows_ran(self, run: WindowsRan) -> None:
        """The trainer ran its last grant's windows on ``run.node_id``: measure the grant against its prediction."""
        self.nodes[run.node_id].coserving.windows_ran(run, time.time())

    def report_passes(self, node_id: int, adapter: str, mode: str, reports: list[PassReport]) -> list[PassVerdict]:
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
        self.training.done(self.cfg.training.scope_rules.line(node_id), now)
        scheduled = mode == "hybrid" and self.cfg.planner.iteration is not None
        return node.coserving.check_end(adapter, reports, scheduled, now)

    def _training_granted(self, node_id: int, adapter: str, windows: Any, now: float) -> None:
        """A granted step becomes a training task on its node (C = its samples, ℓ = its longest window):
        it enters Q_train^n of this planner's placement and, through the snapshot, the routers'."""
        step = self.training.step_task(
            node_id, adapter, len({w.sample_id for w in windows}), max(w.tokens for w in windows), now
        )
        self.training.granted(step, node_id, now)

    async def _retraining_windows(
        self, node: NodeRecord, adapter: str, mode: str, queue: list[FineTuneSample], now: float, store: Any
    ) -> tuple[Any, str, int]:
        from planners.retraining import RetrainingView, make_policy

        policy = self._retraining.get((adapter, mode))
        if policy is None:
            # An adapter's own periodic settings win over the shared retraining params.
            own = (await store.get_adapter.remote(adapter)).periodic.model_dump() if mode == "periodic" else None
            policy = make_policy(mode, self.cfg.training.retraining_params, own)
            self._retraining[(adapter, mode)] = policy
        queued, oldest = (await store.queue_summary.remote()).get(adapter, (0, None))
        wanted = len(queue)
        tokens = sum(s.remaining for s in queue)
        # LEMIX Eq. 4, the placement's verdict: the wanted step (C samples of ℓ tokens) on this node now,
        # against the next inference request its stream predicts. Only the hybrid policy heeds it.
        step = self.training.step_task(node.node_id, adapter, wanted, max(1, tokens // max(1, wanted)), now)
        deprioritized = (
            mode == "hybrid" and wanted > 0 and self.training.deprioritized(step, node.node_id, self._views(), now)
        )
        view = RetrainingView(
            now=now,
            node_id=node.node_id,
            queued=queued,
            oldest_queued_age_s=None if oldest is None else now - oldest,
            last_run_at=self._last_run.get(adapter),
            samples_wanted=wanted,
            tokens_wanted=tokens,
            deprioritized=deprioritized,
        )
        decision = policy.decide(view)
        if decision.action != "run":
            return (), decision.reason or mode, 0
        return whole_windows(queue, decision.samples), decision.reason or mode, decision.tokens
