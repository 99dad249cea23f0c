"""One micro-step's grant rounds: ask the planner which token windows fit beside inference, run them, repeat.

FlexLLM §6.1–6.2: each round asks ``Planner.grant`` for each rank's node (the items' progress, t_arr
and last loss for MACE §4.1's priorities, the rank's memory use), sends each granted rank its
windows (:class:`RoundPlan`), gathers :class:`RoundDone` and tells the planner when the windows ran,
until every item's pass (forward, then backward) is done. A refused request waits in the planner for
the node's next report; the planner away means "wait", never train unasked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from actors.learning.lora.messages import ItemLoss, RoundDone, RoundPlan, StepBegun, StepPlan
from actors.learning.lora.rank_group import RankGroup
from actors.learning.messages import Grant, GrantRequest, MemoryUse, SampleProgress, WindowsRan

MAX_GRANT_SLEEP_S = 1.0  # a refused step asks again at least this often
CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RoundsDone:
    """What a micro-step's rounds did: each item's loss, the seconds run and waited, the windows, the start."""

    finished: dict[int, ItemLoss]
    run_s: float
    waited_s: float
    windows: int
    started_at: float
    fault: str | None = None
    """A rank's fault for the adapter in the last round: the driver drops the step and pauses the adapter."""


class GrantRounds:
    """Runs the grant rounds of one driver's micro-steps on its ranks (``nodes[i]``: rank i's node)."""

    def __init__(
        self, group: RankGroup, nodes: list[int], planner: Any, warn: Callable[[str, BaseException | str], None]
    ) -> None:
        self.group, self.nodes, self.planner, self.warn = group, nodes, planner, warn

    def run(self, plan: StepPlan, begun: list[StepBegun], abandon: Callable[[], bool]) -> RoundsDone | None:
        """Grant and run windows round by round until every rank's items are done, or a rank's fault;
        None: ``abandon`` said to drop the step (stop, or the adapter's mode became ``off``)."""
        adapter = plan.adapter
        by_id = {it.id: it for it in plan.items}
        lengths = [dict(b.lengths) for b in begun]  # the work of each pass: forward, then backward
        forward = [dict(b.forward_lengths) for b in begun]
        done = [dict.fromkeys(b.lengths, 0) for b in begun]
        memory: list[MemoryUse | None] = [None] * len(self.group)
        optimizer_bytes = [b.optimizer_bytes for b in begun]
        finished: dict[int, ItemLoss] = {}
        t_start = time.time()
        run_s = waited_s = 0.0
        windows = 0
        while True:
            todo = [i for i in range(len(self.group)) if any(done[i][s] < n for s, n in lengths[i].items())]
            if not todo:
                return RoundsDone(finished, run_s, waited_s, windows, t_start)
            if abandon():
                return None
            asked = time.time()
            requests = {
                i: GrantRequest(
                    self.nodes[i],
                    adapter,
                    plan.spec.mode,
                    tuple(
                        SampleProgress(
                            sid,
                            n,
                            done[i][sid],
                            plan.arrival(by_id[sid]),
                            plan.last_loss(by_id[sid]),
                            forward[i].get(sid),
                        )
                        for sid, n in lengths[i].items()
                        if done[i][sid] < n
                    ),
                    memory[i],
                    optimizer_bytes[i],
                )
                for i in todo
            }
            grants = self._grants(requests)
            for i in todo:
                memory[i] = None  # told once
            runs = {i: g for i, g in grants.items() if g.windows}
            if not runs:
                wait = min((g.wait_s for g in grants.values()), default=MAX_GRANT_SLEEP_S)
                time.sleep(min(max(wait, 0.001), MAX_GRANT_SLEEP_S))
                waited_s += time.time() - asked  # a refused request waits in the planner for the node's next reports
                continue
            t0 = time.time()
            results: list[RoundDone] = self.group.gather(
                [
                    self.group.ranks[i].run_windows.remote(RoundPlan(g.windows, g.offload_optimizer))
                    for i, g in runs.items()
                ]
            )
            run_s += time.time() - t0
            fault = None
            for i, res in zip(runs, results):
                if res.windows:  # measured against its prediction, the last round of the step included
                    self._windows_ran(
                        WindowsRan(
                            self.nodes[i],
                            adapter,
                            res.ran_at,
                            res.ran_s,
                            res.forward_s,
                            max(0.0, res.ran_s - res.forward_s),
                        )
                    )
                done[i].update(res.done)
                finished.update(res.finished)
                memory[i], optimizer_bytes[i] = res.memory, res.optimizer_bytes
                windows += res.windows
                fault = fault or res.fault
            if fault is not None:
                return RoundsDone(finished, run_s, waited_s, windows, t_start, fault)

    def _windows_ran(self, run: WindowsRan) -> None:
        """Tell the planner when a grant's windows ran (not waited on: the next ask is queued behind it)."""
        try:
            self.planner.windows_ran.remote(run)
        except Exception as exc:
            self.warn("windows_ran", exc)

    def _grants(self, requests: dict[int, GrantRequest]) -> dict[int, Grant]:
        """The planner's grant for each rank's node, asked together; the planner away means "wait", never train unasked."""
        try:
            answers = ray.get([self.planner.grant.remote(r) for r in requests.values()], timeout=CALL_TIMEOUT_S)
        except Exception as exc:
            self.warn("grant", exc)
            return {i: Grant((), MAX_GRANT_SLEEP_S, "planner away") for i in requests}
        return dict(zip(requests, answers))
