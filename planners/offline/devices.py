"""Devices, execution plans (Eq. 3), stages (Eq. 4) and the link-aware choice of devices for them (SamuLLM §3, §4.3)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from planners.costs import CostModel, IterationLatency
from planners.offline.job import JobGraph, ModelSpec


@dataclass(frozen=True)
class DeviceSet:
    """The devices of one node: count, memory each, and which pairs are linked (e.g. NVLink).

    ``links=None`` means every pair is linked (NVSwitch). A tensor-parallel group must be fully
    linked (every pair in it), so with NVLink pairs only, tp ≤ 2. ``memory_utilization`` is the
    fraction of each device the engine may use (vLLM's ``gpu_memory_utilization``).
    """

    count: int
    memory_bytes: float
    links: tuple[tuple[int, int], ...] | None = None
    memory_utilization: float = 0.9
    _linked: frozenset[tuple[int, int]] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.count < 1 or self.memory_bytes <= 0 or not 0 < self.memory_utilization <= 1:
            raise ValueError("need count >= 1, memory_bytes > 0 and memory_utilization in (0, 1]")
        if self.links is not None:
            if any(not (0 <= a < self.count and 0 <= b < self.count) or a == b for a, b in self.links):
                raise ValueError("links must be pairs of distinct device indices")
            pairs = frozenset((min(a, b), max(a, b)) for a, b in self.links)
            object.__setattr__(self, "_linked", pairs)

    def linked(self, a: int, b: int) -> bool:
        return self.links is None or (min(a, b), max(a, b)) in self._linked

    def is_group(self, devs: Sequence[int]) -> bool:
        """Whether ``devs`` may form one tensor-parallel group (all pairs linked)."""
        return all(self.linked(a, b) for a, b in itertools.combinations(devs, 2))

    def groups(self, size: int, free: Collection[int] | None = None) -> Iterator[tuple[int, ...]]:
        """Every linked group of ``size`` devices among ``free`` (default: all), in index order."""
        pool = sorted(range(self.count) if free is None else free)
        for combo in itertools.combinations(pool, size):
            if self.is_group(combo):
                yield combo

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * self.memory_utilization


@dataclass(frozen=True)
class ExecutionPlan:
    """A model execution plan (SamuLLM Eq. 3): ``dp`` replicas of ``tp`` devices each.

    ``devices`` is empty until devices are chosen; then replica k runs on
    ``devices[k·tp:(k+1)·tp]``.
    """

    model: str
    dp: int
    tp: int
    devices: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise ValueError("dp and tp must be >= 1")
        if self.devices and len(self.devices) != self.dp * self.tp:
            raise ValueError(f"{self.model}: {len(self.devices)} devices for dp={self.dp} × tp={self.tp}")

    @property
    def n_devices(self) -> int:
        return self.dp * self.tp

    @property
    def shape(self) -> tuple[int, int]:
        return self.dp, self.tp

    @property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.devices[k * self.tp : (k + 1) * self.tp] for k in range(self.dp)) if self.devices else ()

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dp": self.dp, "tp": self.tp, "devices": list(self.devices)}


def valid_plans(spec: ModelSpec, devices: DeviceSet, longest_sequence: int) -> tuple[ExecutionPlan, ...]:
    """Every (dp, tp) valid for ``spec`` on ``devices`` (SamuLLM §3, Eq. 3).

    Valid: each device of a replica holds ``weights/tp`` plus the KV cache of one sequence of
    ``longest_sequence`` tokens (``kv_bytes_per_token/tp`` per token) within its usable memory,
    the node has a linked group of ``tp`` devices, and ``dp·tp`` devices exist.
    """
    out = []
    for tp in sorted(set(spec.tp_options)):
        if tp > devices.count or next(devices.groups(tp), None) is None:
            continue
        if (spec.weight_bytes + spec.kv_bytes_per_token * longest_sequence) / tp > devices.usable_bytes:
            continue
        out.extend(ExecutionPlan(spec.name, dp, tp) for dp in range(1, devices.count // tp + 1))
    return tuple(out)


@dataclass(frozen=True)
class TensorParallelScaling:
    """How Eq. 5's constants change with the tensor-parallel degree when no profile exists for it.

    The token and sequence terms shrink by the speedup ``tp·efficiency^log2(tp)`` (each doubling
    keeps ``efficiency`` of the ideal 2×: all-reduce and imbalance); the per-iteration constant
    (scheduling, sampling, launch overhead) does not shrink and grows by ``allreduce_s`` per
    doubling. SamuLLM profiles every plan instead (§4.1): pass ``costs["<model>@tp<k>"]`` to do so.
    """

    efficiency: float = 0.85
    allreduce_s: float = 0.0

    def apply(self, it: IterationLatency, tp: int) -> IterationLatency:
        if tp == 1:
            return it
        doublings = math.log2(tp)
        speedup = tp * self.efficiency**doublings
        return replace(
            it,
            base=it.base + self.allreduce_s * doublings,
            per_prefill_token=it.per_prefill_token / speedup,
            per_decode_seq=it.per_decode_seq / speedup,
            per_context_token=it.per_context_token / speedup,
        )


def iteration_cost(
    costs: Mapping[str, CostModel], key: str, tp: int, scaling: TensorParallelScaling = TensorParallelScaling()
) -> IterationLatency:
    """Eq. 5 for model ``key`` at tensor-parallel degree ``tp``: a profiled ``key@tp<k>`` entry, else scaled."""
    direct = costs.get(f"{key}@tp{tp}")
    if direct is not None:
        return direct.iteration
    if key not in costs:
        raise KeyError(f"no cost model for {key!r} (have {sorted(costs)})")
    return scaling.apply(costs[key].iteration, tp)


@dataclass(frozen=True)
class Stage:
    """An execution stage (SamuLLM Eq. 4): models running together with fixed plans for ``duration_s``.

    The stage ends when its first model finishes (§4.2); ``finishes`` are the models predicted to
    be done at its end, ``loads`` those (re)loaded at its start, and ``model_end_s`` each model's
    predicted time to finish (from the stage start) if its plan were kept to the end.
    """

    plans: tuple[ExecutionPlan, ...]
    start_s: float
    duration_s: float
    finishes: tuple[str, ...]
    loads: tuple[str, ...] = ()
    model_end_s: tuple[tuple[str, float], ...] = ()

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(p.model for p in self.plans)

    @property
    def n_devices(self) -> int:
        return sum(p.n_devices for p in self.plans)

    def plan_of(self, model: str) -> ExecutionPlan | None:
        return next((p for p in self.plans if p.model == model), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "start_s": self.start_s,
            "duration_s": self.duration_s,
            "plans": [p.to_dict() for p in self.plans],
            "finishes": list(self.finishes),
            "loads": list(self.loads),
            "model_end_s": {m: (None if math.isinf(s) else s) for m, s in self.model_end_s},
        }


@dataclass(frozen=True)
class Plan:
    """An application execution plan (§3): the stage sequence, its predicted time and the search time."""

    stages: tuple[Stage, ...]
    predicted_s: float
    search_time_s: float = field(compare=False)
    planner: str = "greedy"
    preemption: bool = True
    known_output_lengths: bool = False

    @property
    def end_to_end_s(self) -> float:
        """Predicted inference time plus search time: SamuLLM's end-to-end metric (§5)."""
        return self.predicted_s + self.search_time_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "planner": self.planner,
            "preemption": self.preemption,
            "known_output_lengths": self.known_output_lengths,
            "predicted_s": self.predicted_s,
            "search_time_s": self.search_time_s,
            "stages": [s.to_dict() for s in self.stages],
        }


@dataclass(frozen=True)
class StageEstimate:
    """The simulator's prediction for one candidate stage: duration (first finish), work rate, per-model ends."""

    duration_s: float
    throughput: float
    model_end_s: Mapping[str, float]


def pack_devices(
    devices: DeviceSet, sizes: Sequence[int], taken: set[int], prefer: Sequence[Collection[int]] | None = None
) -> list[tuple[int, ...]] | None:
    """Linked groups for ``sizes`` (largest first) among free devices, or None.

    Among the possible groups it takes the one overlapping most with ``prefer[i]`` (where the model
    was), then the one that breaks the fewest still-free links (so a lone replica does not split a
    linked pair a later tp=2 group needs), then the lowest indices.
    """
    taken = set(taken)
    chosen: list[tuple[int, ...] | None] = [None] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        free = [d for d in range(devices.count) if d not in taken]
        want = set(prefer[i]) if prefer else set()

        def score(
            g: tuple[int, ...], free: list[int] = free, want: set[int] = want
        ) -> tuple[int, int, tuple[int, ...]]:
            broken = sum(
                1 for d in g for e in free if e not in g and devices.links is not None and devices.linked(d, e)
            )
            return -len(want.intersection(g)), broken, g

        best = min(devices.groups(sizes[i], free), key=score, default=None)
        if best is None:
            return None
        chosen[i] = best
        taken.update(best)
    return chosen  # type: ignore[return-value]


def assign_devices(
    plans: Sequence[ExecutionPlan],
    devices: DeviceSet,
    previous: Sequence[ExecutionPlan] = (),
    reload_s: Mapping[str, float] | None = None,
) -> tuple[ExecutionPlan, ...]:
    """Choose devices for a stage's plans, link-aware and minimising reloads (SamuLLM §4.3).

    A model whose (dp, tp) is unchanged from ``previous`` keeps its devices (no reload). If the
    remaining tp groups then cannot all be linked (fragmentation), the cheapest set of kept models
    (by ``reload_s``, default 1 s each) is moved. Other models prefer devices they held before.
    Returns the plans, in order, with ``devices`` set; raises ValueError if nothing fits.
    """
    prev = {p.model: p for p in previous if p.devices}
    keepable = [p.model for p in plans if p.model in prev and prev[p.model].shape == p.shape]
    cost = reload_s or {}
    subsets: list[tuple[str, ...]] = [()]
    if keepable:
        if len(keepable) <= 10:
            subsets = [s for r in range(len(keepable) + 1) for s in itertools.combinations(keepable, r)]
        else:
            subsets = [(), tuple(keepable)]
        subsets.sort(key=lambda s: (sum(cost.get(m, 1.0) for m in s), len(s)))
    for moved in subsets:
        kept = {m for m in keepable if m not in moved}
        taken = {d for m in kept for d in prev[m].devices}
        rest = [p for p in plans if p.model not in kept]
        sizes = [p.tp for p in rest for _ in range(p.dp)]
        prefer = [prev[p.model].devices if p.model in prev else () for p in rest for _ in range(p.dp)]
        groups = pack_devices(devices, sizes, taken, prefer)
        if groups is None:
            continue
        it = iter(groups)
        placed = {p.model: tuple(d for _ in range(p.dp) for d in next(it)) for p in rest}
        return tuple(replace(p, devices=prev[p.model].devices if p.model in kept else placed[p.model]) for p in plans)
    raise ValueError(f"no linked placement on {devices.count} devices for {[p.shape for p in plans]}")


def place_stages(stages: Sequence[Stage], devices: DeviceSet, job: JobGraph) -> tuple[Stage, ...]:
    out: list[Stage] = []
    prev: tuple[ExecutionPlan, ...] = ()
    for st in stages:
        reload = {p.model: job.spec(p.model).load_time(p.tp) for p in st.plans}
        plans = assign_devices(st.plans, devices, prev, reload)
        before = {p.model: p for p in prev}
        loads = tuple(p.model for p in plans if p.model not in before or before[p.model] != p)
        out.append(replace(st, plans=plans, loads=loads))
        prev = plans
    return tuple(out)
