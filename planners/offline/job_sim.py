"""The stage-level simulator of a whole job over its DAG (SamuLLM §4.1 "put them all together", §4.2)."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from planners.costs import CostModel
from planners.offline.devices import (
    DeviceSet,
    ExecutionPlan,
    Stage,
    StageEstimate,
    TensorParallelScaling,
    iteration_cost,
    pack_devices,
    valid_plans,
)
from planners.offline.engine_sim import EPS, ModelRun, simulate_model
from planners.offline.job import Edge, JobGraph, ModelSpec, fuse_self_loops


@dataclass
class _Work:
    """Mutable remaining work of one model between stages (internal to :class:`JobSimulator`)."""

    spec: ModelSpec
    prompt: np.ndarray
    out: np.ndarray  # tokens still to generate
    done: np.ndarray
    resumable: np.ndarray
    parent: np.ndarray
    inputs: list[tuple[str, np.ndarray]]
    longest: int
    cap: Mapping[int, int]  # tp -> max running requests the KV cache allows
    loading: tuple[float, ...] = ()  # per replica of the running plan: load seconds left at the stage start
    started: bool = False  # ran in some stage: its state is no longer the job's start

    @property
    def finished(self) -> bool:
        return bool(self.done.all())


class JobSimulator:
    """Predicts a job stage by stage (SamuLLM §4.1 "put them all together", §4.2 stage boundaries).

    Output lengths are drawn once (seeded) per request, or taken from ``ModelSpec.output_tokens``
    with ``known_output_lengths`` (§5.5). ``estimate(plans)`` predicts a candidate stage without
    changing anything; ``advance(plans)`` commits it: runs the stage until its first model
    finishes and carries every model's remaining requests (and partial outputs) to the next.
    Models in one stage are simulated in topological order; a downstream request becomes ready
    when its upstream request finishes (model-level pipelining, §3). The search, the baselines
    and the tests' brute force all drive this one object.
    """

    def __init__(
        self,
        job: JobGraph,
        devices: DeviceSet,
        costs: Mapping[str, CostModel],
        *,
        known_output_lengths: bool = False,
        seed: int = 0,
        tp_scaling: TensorParallelScaling = TensorParallelScaling(),
    ) -> None:
        self.job, self.devices, self.costs, self.tp_scaling = job, devices, costs, tp_scaling
        fused, parents = fuse_self_loops(job)
        self.order = fused.topological_order()
        self._upstream = {m: fused.upstream(m) for m in self.order}
        self.work = self._initial_work(fused, parents, known_output_lengths, np.random.default_rng(seed))
        self._plans = {m: valid_plans(job.spec(m), devices, self.work[m].longest) for m in self.order}
        self.now_s = 0.0
        self.running: dict[str, ExecutionPlan] = {}
        self._cache: dict[Any, ModelRun] = {}
        # Runs of models still as at the job's start: the same in every state, so shared by every copy for good.
        self._fresh: dict[Any, ModelRun] = {}
        self._ancestors = {m: self._closure(m) for m in self.order}
        self._placeable: dict[tuple[int, ...], bool] = {}

    def _closure(self, m: str) -> frozenset[str]:
        seen: set[str] = set()
        stack = list(self._upstream[m])
        while stack:
            u = stack.pop()
            if u not in seen:
                seen.add(u)
                stack.extend(self._upstream[u])
        return frozenset(seen)

    def _initial_work(
        self, fused: JobGraph, parents: Mapping[str, np.ndarray], known: bool, rng: np.random.Generator
    ) -> dict[str, _Work]:
        work: dict[str, _Work] = {}
        self_edges = {e.src: e for e in self.job.edges if e.src == e.dst}
        for name in self.order:
            spec = fused.spec(name)
            n = spec.n_requests
            prompt = np.asarray(spec.prompt_tokens, dtype=np.int64).copy()
            inputs = []
            for e in fused.edges:
                if e.dst != name:
                    continue
                mp = np.arange(n) if e.request_map is None else np.asarray(e.request_map, dtype=np.int64)
                inputs.append((e.src, mp))
                if e.carries_output:
                    src_out = work[e.src].out
                    prompt += np.where(mp >= 0, src_out[np.maximum(mp, 0)], 0)
            if known:
                if spec.output_tokens is None:
                    raise ValueError(f"known output lengths requested but model {name!r} has no output_tokens")
                raw = np.asarray(spec.output_tokens, dtype=np.int64)
            else:
                cdf = self.costs[spec.key].output_lengths if spec.key in self.costs else None
                if cdf is None:
                    raise KeyError(f"no cost model for {spec.key!r} (have {sorted(self.costs)})")
                raw = cdf.sample(n, rng)
            par = parents[name]
            out = self._truncate(spec, prompt, raw, par, self_edges.get(name))
            longest = int((prompt + out).max()) if n else 1
            if spec.max_seq_len is not None:
                longest = min(longest, spec.max_seq_len)
            mean_seq = float((prompt + out).mean()) if n else 1.0
            cap = {}
            for tp in spec.tp_options:
                free = tp * (self.devices.usable_bytes - spec.weight_bytes / tp)
                fit = free / spec.kv_bytes_per_token / mean_seq if spec.kv_bytes_per_token > 0 else math.inf
                cap[tp] = int(max(1, min(spec.engine.max_num_seqs, fit)))
            work[name] = _Work(
                spec, prompt, out, np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), par, inputs, max(longest, 1), cap
            )
        return work

    @staticmethod
    def _truncate(
        spec: ModelSpec, prompt: np.ndarray, raw: np.ndarray, par: np.ndarray, self_edge: Edge | None
    ) -> np.ndarray:
        out = np.maximum(np.minimum(raw, spec.max_output_tokens), 1)
        carries = self_edge is not None and self_edge.carries_output
        if spec.max_seq_len is None and not carries:
            return out
        limit = spec.max_seq_len if spec.max_seq_len is not None else math.inf
        parl = par.tolist()
        for j in range(out.size):  # in order: a self-loop prompt includes the parent's (truncated) output
            if carries and parl[j] >= 0:
                prompt[j] += out[parl[j]]
            if limit < math.inf:
                out[j] = max(1, min(out[j], limit - prompt[j]))
        return out

    # -- queries --

    @property
    def done(self) -> bool:
        return all(w.finished for w in self.work.values())

    def unfinished(self) -> tuple[str, ...]:
        return tuple(m for m in self.order if not self.work[m].finished)

    def plans(self, model: str) -> tuple[ExecutionPlan, ...]:
        """The model's valid plans (memory and links, §3 Eq. 3)."""
        return self._plans[model]

    def ready(self, selected: Collection[str] = ()) -> tuple[str, ...]:
        """Unfinished models whose inputs are finished or selected in the same stage (§4.2, line 5)."""
        return tuple(
            m for m in self.unfinished() if all(self.work[u].finished or u in selected for u in self._upstream[m])
        )

    def placeable(self, plans: Iterable[ExecutionPlan]) -> bool:
        """Whether these plans' tp groups fit the devices' links at once (counts and topology)."""
        sizes = tuple(sorted((p.tp for p in plans for _ in range(p.dp)), reverse=True))
        hit = self._placeable.get(sizes)
        if hit is None:
            hit = sum(sizes) <= self.devices.count and pack_devices(self.devices, sizes, set()) is not None
            self._placeable[sizes] = hit
        return hit

    def total_work(self, model: str) -> float:
        """Remaining tokens (prompt + output) of ``model`` × its weight bytes: the work unit of throughput."""
        w = self.work[model]
        todo = ~w.done
        return float(w.spec.weight_bytes * (w.prompt[todo].sum() + w.out[todo].sum()))

    # -- simulation --

    def solo_end_s(self, plan: ExecutionPlan) -> float:
        """Seconds until ``plan``'s model would finish from now, alone and with every input already there
        (its load included): the model's own time on that plan, without waiting on upstream models."""
        m = plan.model
        waits = any(not self.work[u].finished for u in self._upstream[m])
        # A model with no unfinished input runs the same alone as in any stage: share _runs' cache entry.
        key = ("solo", m, plan.shape) if waits else (m, plan.shape, ())
        cache = self._fresh if self._untouched(m) else self._cache
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = self._run(plan, {}, inputs_ready=True)
        return hit.end_s

    def _untouched(self, m: str) -> bool:
        """Whether ``m`` is as at the job's start (never run, nothing loading): its run depends on nothing else."""
        return not self.work[m].started and m not in self.running

    def _run(
        self, plan: ExecutionPlan, runs: Mapping[str, ModelRun], until_s: float = math.inf, inputs_ready: bool = False
    ) -> ModelRun:
        m = plan.model
        w = self.work[m]
        ready = np.zeros(w.spec.n_requests)
        for src, mp in w.inputs:
            if self.work[src].finished or inputs_ready:
                continue
            src_done = self.work[src].done
            src_finish = runs[src].finish_s if src in runs else np.full(src_done.size, math.inf)
            t_src = np.where(src_done, 0.0, src_finish)
            ready = np.maximum(ready, np.where(mp >= 0, t_src[np.maximum(mp, 0)], 0.0))
        keep = self.running.get(m)
        same = keep is not None and keep.shape == plan.shape
        load = self._loads(plan)
        todo = ~w.done
        idx = np.flatnonzero(todo)
        local = np.full(todo.size, -1, dtype=np.int64)
        local[idx] = np.arange(idx.size)
        par = w.parent[idx]
        lp = np.where((par >= 0) & ~w.done[np.maximum(par, 0)], local[np.maximum(par, 0)], -1)
        cfg = replace(w.spec.engine, max_num_seqs=w.cap[plan.tp])
        lat = iteration_cost(self.costs, w.spec.key, plan.tp, self.tp_scaling)
        run = simulate_model(
            w.prompt[idx],
            w.out[idx],
            lat,
            cfg,
            plan.dp,
            ready_s=ready[idx],
            parent=lp,
            resumed=w.resumable[idx] if same else None,
            load_s=load,
            until_s=until_s,
        )
        # Re-index to all requests: done ones finished before the stage (time 0 for their dependants).
        full_finish = np.zeros(todo.size)
        full_finish[idx] = run.finish_s
        gen = np.zeros(todo.size, dtype=np.int64)
        gen[idx] = run.generated
        dec = np.zeros(todo.size, dtype=bool)
        dec[idx] = run.decoding
        return ModelRun(run.end_s, full_finish, gen, dec, run.replicas)

    def _loads(self, plan: ExecutionPlan) -> list[float]:
        """Seconds until each replica of ``plan`` can start, from the stage start.

        Replicas of the same tp kept from the previous stage go on without a reload (those whose
        load the stage boundary cut short finish it); added ones load from the start.
        """
        w, keep = self.work[plan.model], self.running.get(plan.model)
        kept = min(keep.dp, plan.dp) if keep is not None and keep.tp == plan.tp else 0
        left = list(w.loading[:kept]) + [0.0] * (kept - len(w.loading[:kept]))
        return left + [w.spec.load_time(plan.tp)] * (plan.dp - kept)

    def _runs(self, stage: Mapping[str, ExecutionPlan], until_s: float = math.inf) -> dict[str, ModelRun]:
        runs: dict[str, ModelRun] = {}
        for m in self.order:
            plan = stage.get(m)
            if plan is None:
                continue
            if until_s < math.inf:
                runs[m] = self._run(plan, runs, until_s)
                continue
            key = (m, plan.shape, tuple(sorted((a, stage[a].shape) for a in self._ancestors[m] if a in stage)))
            # An untouched model whose inputs are all there runs the same in any state: the lasting cache.
            waits = any(not self.work[u].finished for u in self._upstream[m])
            cache = self._fresh if self._untouched(m) and not waits else self._cache
            hit = cache.get(key)
            if hit is None:
                hit = cache[key] = self._run(plan, runs)
            runs[m] = hit
        return runs

    def estimate(self, plans: Iterable[ExecutionPlan]) -> StageEstimate:
        """Predict a candidate stage (§3 Eq. 4, §4.2): it lasts until its first model finishes.

        Its throughput is Σ_m W_m / T_m: each model's remaining work (weight bytes × tokens, ∝ FLOPs)
        over its predicted time to finish with its plan, load included. Judging a plan by its rate
        over the model's whole remaining run (Optimus' speed function) rather than over the first
        finish keeps a short stage from ruling out every model that must load first.
        """
        stage = {p.model: p for p in plans}
        if not stage:
            return StageEstimate(0.0, 0.0, {})
        runs = self._runs(stage)
        ends = {m: r.end_s for m, r in runs.items()}
        dur = min(ends.values())
        thr = sum(self.total_work(m) / t for m, t in ends.items() if 0 < t < math.inf)
        return StageEstimate(dur, thr, ends)

    def advance(self, plans: Sequence[ExecutionPlan]) -> Stage:
        """Commit a stage: run it to its first finish, carry the remaining work, return the :class:`Stage`."""
        stage = {p.model: p for p in plans}
        for m in stage:
            if self.work[m].finished or m not in self.ready(stage):
                raise ValueError(f"model {m!r} is finished or its inputs are not ready")
        if sum(p.n_devices for p in plans) > self.devices.count:
            raise ValueError("the stage needs more devices than exist")
        est = self.estimate(plans)
        dur = est.duration_s
        if not math.isfinite(dur):
            raise ValueError("no model in this stage can finish (inputs never become ready)")
        cut = self._runs(stage, until_s=dur * (1 + EPS) + EPS)
        loads = tuple(m for m, p in stage.items() if self.running.get(m) is None or self.running[m].shape != p.shape)
        for m, run in cut.items():
            w = self.work[m]
            fin = np.isfinite(run.finish_s) & ~w.done
            if est.model_end_s[m] <= dur * (1 + EPS) + EPS:
                fin = ~w.done  # the stage-ending model(s): done by definition
            partial = ~fin & ~w.done & (run.generated > 0)
            w.prompt[partial] += run.generated[partial]
            w.out[partial] -= run.generated[partial]
            w.resumable = run.decoding & ~fin & ~w.done
            w.done = w.done | fin
            w.started = True
        for m in self.order:
            w = self.work[m]
            # Set before self.running changes below: _loads reads the plans this stage started from.
            w.loading = tuple(max(0.0, x - dur) for x in self._loads(stage[m])) if m in stage else ()
            if m not in stage:
                w.resumable[:] = False
        start = self.now_s
        self.now_s += dur
        self.running = {m: p for m, p in stage.items() if not self.work[m].finished}
        self._cache = {}  # a new dict: copies made before this stage keep sharing the old one
        return Stage(
            tuple(stage[m] for m in self.order if m in stage),
            start,
            dur,
            tuple(m for m in self.order if m in stage and self.work[m].finished),
            loads,
            tuple((m, est.model_end_s[m]) for m in self.order if m in stage),
        )

    def copy(self) -> JobSimulator:
        """An independent copy (for exhaustive search in tests and what-if questions)."""
        new = object.__new__(JobSimulator)
        new.__dict__.update(self.__dict__)
        new.work = {
            m: replace(w, prompt=w.prompt.copy(), out=w.out.copy(), done=w.done.copy(), resumable=w.resumable.copy())
            for m, w in self.work.items()
        }
        new.running = dict(self.running)
        # Same state, same predictions: the copy shares the cache until either advances (which replaces,
        # never clears, its own), so candidates tried from one state simulate each (model, plan) once.
        new._cache = self._cache
        return new
