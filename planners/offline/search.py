"""Stage selection: the greedy search with preemption (SamuLLM Alg. 1, §4.2), its §5 baselines, and the §4.3 adjustment.

Our own planner, which takes these as baselines and candidates, is ``planners/offline/plan_search.py``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from planners.costs import CostModel
from planners.offline.devices import DeviceSet, ExecutionPlan, Plan, TensorParallelScaling, assign_devices, place_stages
from planners.offline.engine_sim import EPS
from planners.offline.job import JobGraph
from planners.offline.job_sim import JobSimulator
from planners.registry import register


def select_greedy(sim: JobSimulator, preemption: bool = True) -> tuple[ExecutionPlan, ...]:
    """One stage of SamuLLM Algorithm 1 (§4.2), after Optimus.

    Repeatedly add to the stage the plan with the highest throughput gain per added device: a new
    ready model with a plan, or a running model's plan replaced by a larger one (more devices).
    Stop when no candidate fits or none raises the stage throughput (:meth:`JobSimulator.estimate`).
    Load time counts for new or changed plans, so keeping a plan is favoured when a change does
    not pay for its reload. Without
    preemption, unfinished models of the previous stage keep their plans and cannot grow.
    """
    fixed = dict(sim.running) if not preemption else {}
    stage = dict(fixed)
    used = sum(p.n_devices for p in stage.values())
    thr = sim.estimate(stage.values()).throughput
    while True:
        best: tuple[float, dict[str, ExecutionPlan], int, float] | None = None
        for m in sim.ready(stage):
            cur = stage.get(m)
            if m in fixed:
                continue
            for p in sim.plans(m):
                if cur is not None and p.n_devices <= cur.n_devices:
                    continue
                n_used = used - (cur.n_devices if cur else 0) + p.n_devices
                if n_used > sim.devices.count:
                    continue
                cand = {**stage, m: p}
                if not sim.placeable(cand.values()):
                    continue
                c_thr = sim.estimate(cand.values()).throughput
                gain = (c_thr - thr) / (n_used - used)
                if gain > EPS * max(thr, 1.0) and (best is None or gain > best[0]):
                    best = (gain, cand, n_used, c_thr)
        if best is None:
            break
        _, stage, used, thr = best
    return tuple(stage[m] for m in sim.order if m in stage)


def fastest_plan(
    sim: JobSimulator, base: Mapping[str, ExecutionPlan], model: str, max_devices: int
) -> ExecutionPlan | None:
    """The plan of ``model`` on at most ``max_devices`` devices, placeable beside ``base``, that the
    simulator predicts ends first (ties: the earlier of :meth:`JobSimulator.plans`)."""
    best, best_end = None, math.inf
    for p in sim.plans(model):
        if p.n_devices > max_devices or not sim.placeable([*base.values(), p]):
            continue
        end = sim.estimate([*base.values(), p]).model_end_s[model]
        if end < best_end * (1 - EPS):
            best, best_end = p, end
    return best


def select_max(sim: JobSimulator, preemption: bool = True) -> tuple[ExecutionPlan, ...]:
    """Max-heuristic (SamuLLM §5): all devices to one model at a time, in topological order, with
    the plan the cost model predicts fastest for it. Preemption makes no difference (§5.5)."""
    for m in sim.ready():
        p = fastest_plan(sim, {}, m, sim.devices.count)
        if p is not None:
            return (p,)
    return ()


def select_min(sim: JobSimulator, preemption: bool = True) -> tuple[ExecutionPlan, ...]:
    """Min-heuristic (SamuLLM §5, after Saturn): as many ready models as possible, devices split evenly.

    Models are taken in topological order (a downstream model may join its running upstream);
    k = min(models, free devices), the free devices are split as evenly as possible (the first
    models get the remainder), each model takes its fastest plan within its share, and k shrinks
    until every chosen model fits. Without preemption, unfinished models keep their plans and only
    the devices they leave free are split.
    """
    fixed = dict(sim.running) if not preemption else {}
    free = sim.devices.count - sum(p.n_devices for p in fixed.values())
    cands: list[str] = []
    for m in sim.unfinished():
        if m not in fixed and m in sim.ready({*fixed, *cands}):
            cands.append(m)
    stage = even_split(sim, fixed, cands, free)
    return tuple(stage[m] for m in sim.order if m in stage)


def even_split(
    sim: JobSimulator, fixed: Mapping[str, ExecutionPlan], cands: Sequence[str], free: int
) -> dict[str, ExecutionPlan]:
    """``fixed`` plus the first k of ``cands``, each on its fastest plan within an even share of ``free`` devices.

    k starts at min(candidates, free devices) and shrinks until every chosen model fits its share
    (the first models get the remainder); ``fixed`` alone when not even one fits (SamuLLM §5's Min).
    """
    for k in range(min(len(cands), free), 0, -1):
        share = [free // k + (1 if i < free % k else 0) for i in range(k)]
        stage = dict(fixed)
        for m, s in zip(cands[:k], share):
            p = fastest_plan(sim, stage, m, s)
            if p is None:
                break
            stage[m] = p
        else:
            return stage
    return dict(fixed)


Selector = Callable[[JobSimulator, bool], Sequence[ExecutionPlan]]


class StagePlanner:
    """Plans a whole job: select a stage, commit it, repeat until every model is done (§4.2 outer loop).

    Shared by ``greedy``, ``max`` and ``min`` (registry kind ``stages``); ``preemption=False`` is
    the no-preemption variant and ``known_output_lengths=True`` the variant of §5.5 that plans with
    the true output lengths (``ModelSpec.output_tokens``) instead of sampled ones.
    """

    name = ""
    selector: Selector = staticmethod(select_greedy)

    def __init__(
        self,
        preemption: bool = True,
        known_output_lengths: bool = False,
        seed: int = 0,
        tp_scaling: TensorParallelScaling | None = None,
    ) -> None:
        self.preemption = preemption
        self.known_output_lengths = known_output_lengths
        self.seed = seed
        self.tp_scaling = tp_scaling or TensorParallelScaling()

    def simulator(self, job: JobGraph, devices: DeviceSet, costs: Mapping[str, CostModel]) -> JobSimulator:
        return JobSimulator(
            job,
            devices,
            costs,
            known_output_lengths=self.known_output_lengths,
            seed=self.seed,
            tp_scaling=self.tp_scaling,
        )

    def plan(self, job: JobGraph, devices: DeviceSet, costs: Mapping[str, CostModel]) -> Plan:
        """The stage sequence for ``job`` on ``devices`` with device ids chosen, and its predicted time."""
        return self.plan_on(self.simulator(job, devices, costs))

    def plan_on(self, sim: JobSimulator) -> Plan:
        """Plan from a fresh simulator of the job (advanced to the end); lets callers share one's predictions."""
        t0 = time.perf_counter()  # reported as search time only; no decision depends on it
        job, devices = sim.job, sim.devices
        for m in sim.unfinished():
            if not sim.plans(m):
                raise ValueError(
                    f"model {m!r} fits no (dp, tp) plan on {devices.count} device(s) of "
                    f"{devices.memory_bytes:.3g} bytes"
                )
        stages = []
        while not sim.done:
            chosen = type(self).selector(sim, self.preemption)
            if not chosen:
                raise ValueError(f"no stage can run the unfinished models {list(sim.unfinished())}")
            stages.append(sim.advance(chosen))
        placed = place_stages(stages, devices, job)
        return Plan(placed, sim.now_s, time.perf_counter() - t0, self.name, self.preemption, self.known_output_lengths)


def _heuristic(name: str, selector: Selector, doc: str) -> type[StagePlanner]:
    """The registered :class:`StagePlanner` ``<Name>Stages`` that selects each stage with ``selector``."""
    cls_name = f"{name.capitalize()}Stages"
    cls = type(
        cls_name,
        (StagePlanner,),
        {
            "name": name,
            "selector": staticmethod(selector),
            "__doc__": doc,
            "__module__": __name__,
            "__qualname__": cls_name,
        },
    )
    return register("stages", name)(cls)


GreedyStages = _heuristic("greedy", select_greedy, "SamuLLM's planner: Algorithm 1 per stage (:func:`select_greedy`).")
MaxStages = _heuristic("max", select_max, "Max-heuristic baseline (:func:`select_max`).")
MinStages = _heuristic("min", select_min, "Min-heuristic baseline (:func:`select_min`).")


# --- Dynamic adjustment in the running phase (§4.3) --------------------------------------------------


@dataclass(frozen=True)
class Adjustment:
    """What to run now: ``run`` (with devices), the planned stage reached, and what changed."""

    stage_index: int
    run: tuple[ExecutionPlan, ...]
    started: tuple[str, ...]
    stopped: tuple[str, ...]


def adjust_stage(
    plan: Plan,
    stage_index: int,
    running: Sequence[ExecutionPlan],
    finished: Collection[str],
    job: JobGraph,
    devices: DeviceSet,
) -> Adjustment:
    """Dynamic scheduler of SamuLLM §4.3, called whenever a model finishes; no search is redone.

    ``stage_index``: the planned stage the runtime is in (−1 before anything runs, which yields
    stage 0; then the value this function returned last); ``running``: what runs now, with devices;
    ``finished``: every model done.
    Each unfinished running model keeps its plan if no later stage has it, or if the next stage
    has it with the same (dp, tp). The next stage's pairs are then scheduled (a running model with
    another plan is replanned; other running models give up devices, last-started first, only as
    needed); the remaining running models keep their old plans while devices last. A stage counts
    as reached once all its pairs run or are finished; the one after it is considered only when the
    models the plan expected to end that stage have finished. Devices: :func:`assign_devices`.
    """
    done = set(finished)
    stages = plan.stages
    alive = [p for p in running if p.model not in done]
    cur = {p.model: p for p in alive}
    keep: dict[str, ExecutionPlan] = {}
    tentative: list[ExecutionPlan] = []
    for p in alive:
        later = [s.plan_of(p.model) for s in stages[stage_index + 1 :]]
        nxt = stages[stage_index + 1].plan_of(p.model) if stage_index + 1 < len(stages) else None
        if all(q is None for q in later) or (nxt is not None and nxt.shape == p.shape):
            keep[p.model] = p
        else:
            tentative.append(p)
    new: dict[str, ExecutionPlan] = {}
    reached = stage_index

    def free() -> int:
        return (
            devices.count
            - sum(p.n_devices for p in keep.values())
            - sum(p.n_devices for p in new.values())
            - sum(p.n_devices for p in tentative)
        )

    k = stage_index + 1
    # The first step follows the finish that triggered this call; later ones need the planned enders done.
    while k < len(stages) and (k == stage_index + 1 or all(m in done for m in stages[k - 1].finishes)):
        complete = True
        for q in stages[k].plans:
            m = q.model
            if m in done or (m in keep and keep[m].shape == q.shape) or (m in new and new[m].shape == q.shape):
                continue
            holders = {*keep, *new, *(p.model for p in tentative)}
            if m in keep or m in new or any(u not in done and u not in holders for u in job.upstream(m)):
                complete = False  # replanning a kept model, or inputs not ready: wait for the next finish
                break
            saved = list(tentative)
            tentative = [p for p in tentative if p.model != m]  # its own old plan gives way first
            while free() < q.n_devices and tentative:
                tentative.pop()
            if free() < q.n_devices:
                tentative = saved
                complete = False
                break
            new[m] = ExecutionPlan(m, q.dp, q.tp)
        if not complete:
            break
        reached = k
        k += 1
    run_plans = [*keep.values(), *tentative, *new.values()]
    placed = assign_devices(run_plans, devices, alive, {p.model: job.spec(p.model).load_time(p.tp) for p in run_plans})
    started = tuple(p.model for p in placed if p.model not in cur or cur[p.model] != p)
    kept = {p.model for p in placed}
    stopped = tuple(p.model for p in alive if p.model not in kept)
    return Adjustment(reached, placed, started, stopped)
