"""Our offline stage planner, ``search``: whole plans judged by the simulator, the baselines' plans among them.

Not in SamuLLM. Algorithm 1 (``greedy``) ranks a stage by its work rate per added device, so it
cannot see what a stage buys later: a model loaded beside its producer while the producer still
runs (its load hidden, fed as outputs finish), a plan kept to save a reload, devices given to the
model that ends last. This planner asks the simulator about whole plans instead: those of a few
base policies (keep running plans; list schedules of per-model target plans taken from the moldable
bound of the job), then a pilot search (Duin & Voß 1999; a rollout algorithm, Bertsekas 1997) that
tries other stages at the first boundary, downstream models beside their producers among them,
each finished by the best base policy. The baselines' whole plans are candidates too, so the chosen
plan's predicted time is never above ``greedy``'s, ``max``'s or ``min``'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from planners.costs import CostModel
from planners.offline.devices import DeviceSet, ExecutionPlan, Plan, Stage, TensorParallelScaling, place_stages
from planners.offline.engine_sim import EPS
from planners.offline.job import JobGraph
from planners.offline.job_sim import JobSimulator
from planners.offline.search import (
    GreedyStages,
    MaxStages,
    MinStages,
    StagePlanner,
    even_split,
    select_greedy,
    select_max,
    select_min,
)
from planners.registry import register

StageChoice = tuple[ExecutionPlan, ...]


def _ordered(sim: JobSimulator, stage: Mapping[str, ExecutionPlan]) -> StageChoice:
    return tuple(stage[m] for m in sim.order if m in stage)


def _used(stage: Mapping[str, ExecutionPlan]) -> int:
    return sum(p.n_devices for p in stage.values())


def _grow(sim: JobSimulator, stage: dict[str, ExecutionPlan], preemption: bool = True) -> dict[str, ExecutionPlan]:
    """Give the devices ``stage`` leaves free to its models: one more replica of the same tp at a time, to
    the model predicted to end last among those it makes end sooner (the new replica loads while the
    others keep running; late in a run a load can cost more than the replica saves). Without
    preemption a running model's plan is never changed, so only models starting now grow."""
    ends = sim.estimate(stage.values()).model_end_s if stage else {}
    while stage:
        free = sim.devices.count - _used(stage)
        grown = False
        for m in sorted(stage, key=lambda k: -ends[k]):
            if not preemption and m in sim.running:
                continue
            p = stage[m]
            q = replace(p, dp=p.dp + 1)
            if p.tp > free or q not in sim.plans(m):
                continue
            trial = {**stage, m: q}
            if not sim.placeable(trial.values()):
                continue
            new_ends = sim.estimate(trial.values()).model_end_s
            if new_ends[m] < ends[m] * (1 - EPS):
                stage, ends, grown = trial, new_ends, True
                break
        if not grown:
            break
    return stage


def select_keep(sim: JobSimulator, preemption: bool = True) -> StageChoice:
    """Keep every running plan; split the free devices evenly over the ready models not running (as
    Min does, downstream models beside their producers included), then grow the models into what is
    left (with preemption, running ones too: more replicas, none reloaded)."""
    stage = {m: p for m, p in sim.running.items() if m in sim.unfinished()}
    free = sim.devices.count - _used(stage)
    cands = [m for m in sim.unfinished() if m not in stage]
    cands = [m for m in cands if m in sim.ready({*stage, *cands})]
    stage = even_split(sim, stage, cands, free)
    if not stage:
        return select_max(sim)
    return _ordered(sim, _grow(sim, stage, preemption))


def _beside(sim: JobSimulator, stage: StageChoice) -> list[StageChoice]:
    """Variants of ``stage`` that run one more ready downstream model beside its producer on its
    smallest plan, taking devices from the stage's largest model if none are free."""
    out = []
    have = {p.model: p for p in stage}
    for m in sim.unfinished():
        if m in have or m not in sim.ready(have.keys()) or m in sim.ready():
            continue  # only models that become ready because a producer is in the stage
        small = min(sim.plans(m), key=lambda p: (p.n_devices, p.tp), default=None)
        if small is None:
            continue
        cur = dict(have)
        while _used(cur) + small.n_devices > sim.devices.count:
            big = max(cur.values(), key=lambda p: (p.n_devices, p.dp))
            if big.dp == 1:
                break
            cur[big.model] = replace(big, dp=big.dp - 1)
        cur[m] = small
        if _used(cur) <= sim.devices.count and sim.placeable(cur.values()) and m in sim.ready(cur.keys()):
            out.append(_ordered(sim, cur))
    return out


Selector = Callable[[JobSimulator, bool], Sequence[ExecutionPlan]]


@dataclass(frozen=True)
class MoldableBound:
    """Each model's own time on each valid plan from the current state, and the bound they give.

    ``bound_s`` is the least T such that every model has a plan that ends within T and the least
    device-seconds of such plans fit on the devices within T: a lower bound on any plan that keeps each
    model on one (dp, tp) from start to end with its inputs already there (a classic bound of moldable
    task scheduling). It ignores waiting on inputs, so it is loose for chains; a plan that changes a
    model's (dp, tp) midway can in principle go below it.
    """

    bound_s: float
    times: Mapping[str, tuple[tuple[ExecutionPlan, float], ...]]
    devices: int

    def shape(self, model: str, target_s: float) -> ExecutionPlan:
        """The plan of ``model`` with the fewest device-seconds among those that end within ``target_s``
        (ties: the faster), else its fastest plan."""
        opts = self.times[model]
        within = [(p.n_devices * t, t, p.n_devices, p.tp) for p, t in opts if t <= target_s * (1 + EPS)]
        if within:
            _, _, n, tp = min(within)
            return next(p for p, t in opts if p.n_devices == n and p.tp == tp)
        return min(opts, key=lambda x: (x[1], x[0].n_devices))[0]


def moldable_bound(sim: JobSimulator) -> MoldableBound:
    """Time every unfinished model alone on each of its plans (:meth:`JobSimulator.solo_end_s`) and the bound."""
    times = {m: tuple((p, sim.solo_end_s(p)) for p in sim.plans(m)) for m in sim.unfinished()}
    n = sim.devices.count
    points = sorted({t for opts in times.values() for _, t in opts if math.isfinite(t)})
    bound = math.inf
    for i, t in enumerate(points):
        area = 0.0
        for opts in times.values():
            fit = [p.n_devices * x for p, x in opts if x <= t * (1 + EPS)]
            if not fit:
                break
            area += min(fit)
        else:
            nxt = points[i + 1] if i + 1 < len(points) else math.inf
            if area / n < nxt:
                bound = max(t, area / n)
                break
    return MoldableBound(bound, times, n)


def shaped_policy(shapes: Mapping[str, ExecutionPlan], order: Sequence[str]) -> Selector:
    """A list scheduler for fixed target plans: keep what runs, grow a running model toward its target
    (with preemption), start ready models in ``order`` on their target (fewer replicas if that is all
    that is free), then give leftover devices to the model predicted to end last. Never reloads a
    running model."""

    def select(sim: JobSimulator, preemption: bool = True) -> StageChoice:
        stage = {m: p for m, p in sim.running.items() if m in sim.unfinished()}
        for m in order:
            if sim.work[m].finished:
                continue
            want, free = shapes[m], sim.devices.count - _used(stage)
            cur = stage.get(m)
            if cur is not None:
                if preemption and cur.tp == want.tp and cur.dp < want.dp and free >= cur.tp:
                    trial = {**stage, m: replace(cur, dp=min(want.dp, cur.dp + free // cur.tp))}
                    if sim.placeable(trial.values()):
                        stage = trial
                continue
            if m not in sim.ready(stage.keys()):
                continue
            for dp in range(want.dp, 0, -1):
                q = ExecutionPlan(m, dp, want.tp)
                if q.n_devices <= free and q in sim.plans(m) and sim.placeable([*stage.values(), q]):
                    stage[m] = q
                    break
        if not stage:
            return select_max(sim)
        return _ordered(sim, _grow(sim, stage, preemption))

    return select


def _valid(sim: JobSimulator, stage: Iterable[ExecutionPlan]) -> bool:
    st = {p.model: p for p in stage}
    return (
        bool(st)
        and _used(st) <= sim.devices.count
        and sim.placeable(st.values())
        and all(m in sim.ready(st.keys()) for m in st)
        and math.isfinite(sim.estimate(st.values()).duration_s)
    )


def _keeps_running(sim: JobSimulator, stage: StageChoice) -> bool:
    have = {p.model: p for p in stage}
    return all(have.get(m) == p for m, p in sim.running.items() if m in sim.unfinished())


def complete(sim: JobSimulator, policy: Selector, preemption: bool = True) -> tuple[float, list[Stage]]:
    """Let ``policy`` choose every remaining stage of a copy of ``sim``: the predicted end and the stages."""
    s, stages = sim.copy(), []
    while not s.done:
        chosen = policy(s, preemption)
        if not chosen:
            return math.inf, stages
        stages.append(s.advance(chosen))
    return s.now_s, stages


def portfolio(sim: JobSimulator, targets: Sequence[float]) -> dict[str, Selector]:
    """The base policies the search starts from, by name: ``min``, ``keep`` and ``shaped`` ones.

    A shaped policy gives each model the plan with the fewest device-seconds that ends within
    ``f`` × the moldable bound (:func:`moldable_bound`), for each ``f`` in ``targets``, and starts the
    models longest first (``lpt``) or in graph order (``topo``); identical ones are listed once.
    """
    out: dict[str, Selector] = {"min": select_min, "keep": select_keep}
    bound = moldable_bound(sim)
    if not math.isfinite(bound.bound_s):
        return out
    seen = set()
    for f in targets:
        shapes = {m: bound.shape(m, bound.bound_s * f) for m in bound.times}
        t_of = {m: next(t for p, t in bound.times[m] if p == shapes[m]) for m in shapes}
        lpt = tuple(sorted(shapes, key=lambda m: (-t_of[m], sim.order.index(m))))
        for name, order in (("lpt", lpt), ("topo", tuple(m for m in sim.order if m in shapes))):
            key = (tuple(sorted((m, p.shape) for m, p in shapes.items())), order)
            if key not in seen:
                seen.add(key)
                out[f"shaped×{f:g}/{name}"] = shaped_policy(shapes, order)
    return out


@register("stages", "search")
class SearchStages(StagePlanner):
    """Our planner: a portfolio of base policies, a pilot search on the best one, and the baselines as candidates.

    1. The whole plans of ``greedy`` (SamuLLM Alg. 1), ``max`` and ``min``.
    2. Whole plans of the base policies of :func:`portfolio`: ``keep`` (never reload a running model;
       free devices to new or growing models) and list schedules of per-model target plans taken from
       the moldable bound at several slacks (``targets``).
    3. The pilot method (Duin & Voß 1999; a rollout algorithm, Bertsekas 1997) on the best base policy:
       at each of the first ``pilot_depth`` stage boundaries, the choices of the ``pilot_width`` best
       base policies, of ``greedy`` and of ``min``, and variants of them that start a downstream model
       beside its producer (fed as its outputs finish), are committed in a copy of the simulator and
       scored by the predicted end of the job when the best base policy finishes it; the best is
       committed. Since that policy's own choice is a candidate, the pilot never ends later than the
       policy alone.

    The plan predicted fastest wins (ties: the earlier listed), so it is never predicted slower than
    ``greedy``, ``max`` or ``min``. ``Plan.planner`` is ``search`` or ``search:<baseline>`` when a
    baseline's plan won. All decisions come from the simulator; the clock is only reported.
    """

    name = "search"
    baselines: tuple[type[StagePlanner], ...] = (GreedyStages, MaxStages, MinStages)

    def __init__(
        self,
        preemption: bool = True,
        known_output_lengths: bool = False,
        seed: int = 0,
        tp_scaling: TensorParallelScaling | None = None,
        pilot_depth: int = 1,
        pilot_width: int = 3,
        targets: Sequence[float] = (1.0, 1.1, 1.25, 1.5, 2.0),
    ) -> None:
        super().__init__(preemption, known_output_lengths, seed, tp_scaling)
        self.pilot_depth, self.pilot_width = pilot_depth, pilot_width
        self.targets = tuple(targets)

    def plan(self, job: JobGraph, devices: DeviceSet, costs: Mapping[str, CostModel]) -> Plan:
        t0 = time.perf_counter()  # reported as search time only; no decision depends on it
        root = self.simulator(job, devices, costs)  # candidates start from its copies: one cache of predictions
        plans, errors = [], []
        for cls in self.baselines:
            try:
                plans.append(
                    cls(self.preemption, self.known_output_lengths, self.seed, self.tp_scaling).plan_on(root.copy())
                )
            except ValueError as exc:  # a baseline that finds no plan leaves the others
                errors.append(exc)
        # The min baseline's plan is what the portfolio's min policy would roll out: not simulated twice.
        known = {p.planner: p.predicted_s for p in plans if p.planner == "min"}
        end, stages = self._search(root, known)
        if math.isfinite(end):
            plans.append(
                Plan(
                    place_stages(stages, devices, job), end, 0.0, self.name, self.preemption, self.known_output_lengths
                )
            )
        if not plans:
            raise errors[0] if errors else ValueError(f"no plan runs the models {list(root.unfinished())}")
        kept = plans[0]
        for p in plans[1:]:
            if p.predicted_s < kept.predicted_s * (1 - EPS):
                kept = p
        name = self.name if kept.planner == self.name else f"{self.name}:{kept.planner}"
        return replace(kept, search_time_s=time.perf_counter() - t0, planner=name)

    def _search(self, root: JobSimulator, known: Mapping[str, float]) -> tuple[float, list[Stage]]:
        """Steps 2 and 3: the best base policy's plan, improved by the pilot over the first boundaries;
        ``known``: ends already predicted for some of the portfolio's policies, by name."""
        policies = portfolio(root, self.targets)
        ends = {
            name: known[name] if name in known else complete(root, pol, self.preemption)[0]
            for name, pol in policies.items()
        }
        ranked = sorted(policies, key=ends.__getitem__)  # stable: ties keep the portfolio's order
        base = policies[ranked[0]]
        leaders = [policies[n] for n in ranked[: self.pilot_width]]
        stages: list[Stage] = []
        sim = root.copy()
        for _ in range(self.pilot_depth):
            if sim.done:
                break
            best, best_end = None, math.inf
            for c in self._candidates(sim, leaders):
                trial = sim.copy()
                trial.advance(c)
                end = complete(trial, base, self.preemption)[0]
                if end < best_end * (1 - EPS):
                    best, best_end = c, end
            if best is None:
                break
            stages.append(sim.advance(best))
        end, rest = complete(sim, base, self.preemption)
        return end, stages + rest

    def _candidates(self, sim: JobSimulator, policies: Sequence[Selector]) -> list[StageChoice]:
        seen: set[StageChoice] = set()
        out: list[StageChoice] = []
        for policy in (*policies, select_greedy, select_min):
            c = tuple(policy(sim, self.preemption))
            for v in (c, *_beside(sim, c)):
                if v and v not in seen and (self.preemption or _keeps_running(sim, v)) and _valid(sim, v):
                    seen.add(v)
                    out.append(v)
        return out
