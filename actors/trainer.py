"""Trainer: the supervisor actor that runs the co-located LoRA SFT/DPO worker loop under Ray Train (docs/learning.md, "The trainer").

Two halves, in the manner of verl's single controller and its worker group:

- :class:`Trainer` (a named Ray actor, 0 CPU) holds no model. ``run()`` starts a background
  thread that calls Ray Train's ``TorchTrainer.fit()`` with :func:`train_loop` and starts it
  again if it ever fails for good; it also collects what the workers report, for ``status()``.
- :func:`train_loop` runs in each Ray Train worker, one per logical node (or
  ``training.workers``), placed on the physical Ray node that holds that node's replica
  (``ScalingConfig.label_selector``) with ``training.resources_per_worker``. Scope ``synced``:
  rank 0 (the leader) reads the feedback queue and decides what to do; every rank trains a
  disjoint share of each micro-batch; gradients are summed through the torch process group
  (gloo on CPU), so all ranks hold the same weights and every published version is one model.

Per micro-step: the leader takes up to ``micro_batch`` queued items of one adapter (round robin
over adapters with feedback, skipping mode ``off``); every rank takes its share and runs it in
token windows (FlexLLM §6.1, ``app.lora_training.WindowedPass``): it asks ``Planner.grant`` for
its own node, which answers with the windows the node's iteration scheduler fits beside the
inference work there now (``planners/iteration.py``), runs them, and asks again until its items
are done; a synced step's ranks go round by round (one small all-reduce per round) and apply
their gradients together. Then the leader reports each item's loss in the pass to the planner
(``Planner.report_passes``): CheckEnd (MACE Alg. 1 lines 17–21) retires it or requeues it, and a
requeued item stays unconsumed and is trained again in a later micro-step with its loss in its
priority (MACE §4.1). Every ``accumulation`` micro-steps an optimizer step; every
``steps_per_version`` optimizer steps, or as soon as the
queue has nothing more for this adapter, rank 0 publishes: ``reserve_version`` ->
``save_adapter_version`` (atomic) -> ``publish_version`` (marks the items consumed) ->
``Planner.load_adapter``; rank 0 then evaluates the version on the held-out pairs (win rate,
CLPD) in a background thread, so evaluation never delays the next version.

With the adapter's quality gate on (the default), ``publish_version`` makes the version a
candidate instead and ``Planner.load_adapter`` waits: the background thread scores it on the
adapter's held-out slice against the served version, the store records the verdict (served or
rejected) and only a served one is loaded. The leader trains other adapters meanwhile, and that
adapter again only after the verdict, from whatever is served then.

Faults: Ray Train restarts a failed worker group (``FailureConfig(max_failures=-1)``); Ray
restarts this actor (``max_restarts=-1``), which then starts training again by itself. A new
worker group resumes from the store's current version and its queue: an item is consumed only
when a published version trained on it, so nothing acknowledged is lost (docs/learning.md §2).
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import ray

from app.config import AppConfig
from planners.types import PassReport, PassVerdict

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
IDLE_WAIT_S = 1.0  # an idle leader waits on the store at most this long (new feedback wakes it at once)
SPEC_TTL_S = 2.0  # a PATCHed adapter (mode, learning rate) takes effect within this
MAX_GRANT_SLEEP_S = 1.0  # a refused step asks again at least this often
STOP_CHECK_S = 1.0
RESTART_BACKOFF_S = 5.0
LOAD_TIMEOUT_S = 120.0


def resolve_eval_file(path: str | None) -> tuple[str | None, str | None]:
    """The held-out preference file as an absolute path, or (None, why not); relative paths: cwd, then the project root."""
    if not path:
        return None, None
    p = Path(path).expanduser()
    for candidate in ([p] if p.is_absolute() else [Path.cwd() / p, ROOT / p]):
        if candidate.is_file():
            return str(candidate.resolve()), None
    return None, f"training.eval_file {path!r} not found (relative paths: cwd, then {ROOT}); evaluation off"


class Trainer:
    """Create with ``ray.remote(Trainer).options(name=cfg.trainer_actor_name, num_cpus=0, max_restarts=-1,
    max_concurrency=100)``; then ``run()`` once. The planner creates it and passes its own handle."""

    def __init__(self, config: AppConfig, model_dir: str, namespace: str, planner: Any) -> None:
        self.cfg = config
        self.model_dir = model_dir
        self.namespace = namespace
        self.planner = planner  # the planner's actor handle (it created this actor and passes itself)
        self._lock = threading.RLock()  # methods run on the actor's thread pool (max_concurrency)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.state = "idle"
        self.started_at: float | None = None
        self.fits = 0  # worker groups started by fit() (Ray Train restarts inside one fit are counted by workers)
        self.worker_starts = 0
        self.workers: dict[int, dict[str, Any]] = {}
        self.adapters: dict[str, dict[str, Any]] = {}
        self.errors: deque[dict[str, Any]] = deque(maxlen=20)
        self.eval_file, why = resolve_eval_file(self.cfg.training.eval_file)
        if why:
            self._error("config", why)
        self.problem: str | None = None
        t = self.cfg.training
        if t.scope == "per_node" and t.workers is not None and t.workers != self.cfg.cluster.nodes:
            # Each node's copy is trained by the one worker on that node; more or fewer cannot split a queue.
            self.problem = (f"training.scope 'per_node' needs one worker per node: workers={t.workers}, "
                            f"nodes={self.cfg.cluster.nodes} (leave workers unset)")
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
        return self.status()

    def stop(self) -> dict[str, Any]:
        """Ask the workers to finish (the leader sees it within about a second); status at once."""
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
                logger.exception("Ray Train fit failed")
                self._error("fit", f"{type(exc).__name__}: {exc}")
            self.state = "restarting"
            self._stop.wait(RESTART_BACKOFF_S)
        self.state = "stopped"

    def _fit(self) -> None:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        t = self.cfg.training
        locations = self._node_locations()
        nodes = [loc["node_id"] for loc in locations]
        workers = t.workers or len(nodes)
        node_of_rank = [nodes[r % len(nodes)] for r in range(workers)]
        where = {loc["node_id"]: loc.get("ray_node_id") for loc in locations}
        located = all(where.get(n) for n in node_of_rank)
        if not located:
            self._error("placement", f"no Ray node known for some logical node ({where}); workers placed anywhere")
        resources = dict(t.resources_per_worker)
        use_gpu = resources.get("GPU", 0) > 0
        scaling = ScalingConfig(
            num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources,
            label_selector=[{"ray.io/node-id": where[n]} for n in node_of_rank] if located else None,
        )
        run_config = RunConfig(
            name=f"{self.cfg.name}-trainer", storage_path=str(self.cfg.data_path / "ray_train"),
            failure_config=FailureConfig(max_failures=-1),
        )
        loop_config = {"config": self.cfg, "model_dir": self.model_dir, "namespace": self.namespace,
                       "planner": self.planner, "node_of_rank": node_of_rank, "eval_file": self.eval_file}
        self.state = "starting"
        TorchTrainer(train_loop, train_loop_config=loop_config, scaling_config=scaling, run_config=run_config).fit()

    def _node_locations(self) -> list[dict[str, Any]]:
        """Where each logical node's replica lives; waits (up to a minute) for the planner to place them."""
        deadline = time.time() + 60
        locations: list[dict[str, Any]] = []
        while not self._stop.is_set():
            try:
                locations = ray.get(self.planner.node_locations.remote(), timeout=30)
            except Exception as exc:
                self._error("node_locations", f"{type(exc).__name__}: {exc}")
            if locations and (all(loc.get("ray_node_id") for loc in locations) or time.time() > deadline):
                break
            self._stop.wait(1.0)
        if not locations:
            locations = [{"node_id": i, "ray_node_id": None} for i in range(self.cfg.cluster.nodes)]
        return locations

    # ---- reports from the workers ----------------------------------------------------------

    def _error(self, where: str, message: str) -> None:
        logger.warning("trainer %s: %s", where, message)
        self.errors.append({"at": time.time(), "where": where, "message": message[:2000]})

    def worker_started(self, rank: int, node_id: int, pid: int, ray_node_id: str) -> bool:
        with self._lock:
            self.worker_starts += 1
            self.workers[rank] = {"rank": rank, "node_id": node_id, "pid": pid, "ray_node_id": ray_node_id,
                                  "started_at": time.time()}
            if self.state in ("starting", "restarting"):
                self.state = "running"
        return self._stop.is_set()

    def worker_error(self, where: str, message: str) -> None:
        self._error(where, message)

    def should_stop(self) -> bool:
        return self._stop.is_set()

    def record(self, adapter: str, event: dict[str, Any]) -> bool:
        """The leader's account of a step, a wait, a published version or an evaluation; returns the stop flag."""
        with self._lock:
            self._record(adapter, event)
        return self._stop.is_set()

    def _record(self, adapter: str, event: dict[str, Any]) -> None:
        a = self.adapters.setdefault(adapter, {
            "version": None, "versions_published": 0, "samples_trained": 0, "steps": 0, "optimizer_steps": 0,
            "last_loss": None, "last_step_s": None, "grants_waited": 0, "grant_wait_s": 0.0, "shrunk_steps": 0,
            "windows": 0, "abandoned_steps": 0, "requeued": 0,
            "conflicts": 0, "last_published_at": None, "freshness_s": [], "win_rate": None, "clpd": None,
            "eval_s": None, "publish_s": None, "last_grant_s": None, "last_publish_breakdown": None,
            "evaluated_version": None, "token_logprob": None, "gate_passed": 0, "gate_rejected": 0, "last_gate": None,
        })
        kind = event.get("kind")
        if kind == "step":
            a["steps"] += 1
            a["samples_trained"] += event["samples"]
            a["last_loss"], a["last_step_s"], a["last_grant_s"] = event["loss"], event["seconds"], event["grant_s"]
            a["shrunk_steps"] += int(event.get("shrunk", False))
            a["windows"] += event.get("windows", 0)
            a["optimizer_steps"] += int(event.get("optimizer_step", False))
            a["requeued"] += event.get("requeued", 0)  # passes CheckEnd sent back for another pass
        elif kind == "wait":
            a["grants_waited"] += 1
            a["grant_wait_s"] += event["seconds"]
        elif kind == "published":
            if not event.get("candidate"):  # a candidate is served only once the gate passes it
                a["version"] = event["version"]
            a["versions_published"] += 1
            a["last_published_at"], a["publish_s"] = event["at"], event["seconds"]
            a["last_publish_breakdown"] = event["breakdown"]
            a["freshness_s"] = (a["freshness_s"] + event["freshness_s"])[-200:]
        elif kind == "conflict":
            a["conflicts"] += 1
        elif kind == "abandoned":
            a["abandoned_steps"] += 1
        elif kind == "eval":
            a["win_rate"], a["clpd"], a["eval_s"] = event.get("win_rate"), event.get("clpd"), event["seconds"]
            a["token_logprob"], a["evaluated_version"] = event.get("token_logprob"), event["version"]
        elif kind == "gate":
            served = event["state"] == "served"
            a["gate_passed" if served else "gate_rejected"] += 1
            a["last_gate"] = {k: event[k] for k in ("version", "state", "reason", "score", "baseline_version",
                                                     "baseline_score", "seconds")}
            a["eval_s"] = event["seconds"]
            if served:
                a["version"] = event["version"]
                a["freshness_s"] = (a["freshness_s"] + event["freshness_s"])[-200:]
                if event.get("score") is not None:
                    a["win_rate"], a["clpd"] = event.get("win_rate"), event.get("clpd")
                    a["token_logprob"], a["evaluated_version"] = event.get("token_logprob"), event["version"]

    def status(self) -> dict[str, Any]:
        """JSON-able state for ``/v1/status``: workers, per-adapter progress, recent errors."""
        with self._lock:
            return self._status()

    def _status(self) -> dict[str, Any]:
        adapters = {}
        for name, a in self.adapters.items():
            fresh = a["freshness_s"]  # seconds from an item's acceptance to its version being loaded
            adapters[name] = {k: v for k, v in a.items() if k != "freshness_s"} | {
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
            "errors": list(self.errors),
        }


# ================================================================================================
# The worker loop (runs inside Ray Train workers).


def train_loop(loop_config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: returns only when the Trainer actor asks to stop."""
    _Worker(loop_config).run()


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal [start, end) shares of n items; the first shares get the extras."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for r in range(parts):
        end = start + base + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


def _arrival(plan: dict[str, Any], item: dict[str, Any]) -> float:
    """t_arr of the item's pass in this micro-step (MACE §4.1): when CheckEnd requeued it, else its acceptance."""
    again = plan.get("requeued", {}).get(item["id"])
    return item["created_at"] if again is None else again.arrival


def _last_loss(plan: dict[str, Any], item: dict[str, Any]) -> float:
    """L_DPO of MACE §4.1's γ·L_DPO priority term: the item's loss in its previous pass (0 before its first)."""
    again = plan.get("requeued", {}).get(item["id"])
    return 0.0 if again is None else again.loss


def _passes_before(plan: dict[str, Any], item: dict[str, Any]) -> int:
    again = plan.get("requeued", {}).get(item["id"])
    return 0 if again is None else again.passes


class _Worker:
    """One rank's state: the model of the adapter being trained, and (rank 0) the queue bookkeeping."""

    def __init__(self, lc: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        from ray import train

        self.torch, self.dist = torch, dist
        self.cfg: AppConfig = lc["config"]
        self.t = self.cfg.training
        self.model_dir = lc["model_dir"]
        ctx = train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.node_id = lc["node_of_rank"][self.rank]
        # per_node (LEMIX §V-B): every rank trains its own node's copy on the feedback routed to that
        # node, alone: it plans and publishes for itself and never joins a collective. synced: rank 0
        # plans and publishes, and all ranks average gradients.
        self.per_node = self.t.scope == "per_node"
        self.line = self.node_id if self.per_node else None  # the store's queue/version partition
        self.leader = self.rank == 0 or self.per_node
        self.group_rank, self.group_world = (0, 1) if self.per_node else (self.rank, self.world)
        self.distributed = (not self.per_node and self.world > 1 and dist.is_available()
                            and dist.is_initialized())
        # Share the node's cores with its inference engine: as many threads as CPUs granted (at least 1).
        torch.set_num_threads(max(1, int(self.t.resources_per_worker.get("CPU", 1))))
        # Import the training stack now (several seconds on a busy CPU), not when the first feedback waits.
        import peft  # noqa: F401
        import transformers  # noqa: F401

        from app import lora_training  # noqa: F401

        ns = lc["namespace"]
        self.store = ray.get_actor(self.cfg.feedback_actor_name, namespace=ns)
        self.planner = lc["planner"]
        self.sup = ray.get_actor(self.cfg.trainer_actor_name, namespace=ns)
        # The leader's quality gate and held-out scoring (a background thread, see _Evaluator).
        self.evaluator: _Evaluator | None = _Evaluator(self, lc.get("eval_file")) if self.leader else None
        # Model state, the same on every rank.
        self.model = self.tok = self.opt = None
        self.loaded: tuple[str, int | None] | None = None  # (adapter, store version the weights are)
        self.micro_done = 0  # micro-steps whose gradients are accumulated but not applied
        self.opt_steps = 0  # optimizer steps since the last published version
        self.last_round_s = 0.0  # wall time of the last granted windows, told to the planner at the next ask
        # Leader-only bookkeeping.
        self.held: list[int] = []  # item ids trained into the unpublished weights
        self.held_created: list[float] = []
        self.pending_items: list[dict[str, Any]] = []  # items of accumulated micro-steps not yet applied
        self.version_samples = 0
        self.version_losses: list[tuple[float, int]] = []
        # CheckEnd's last verdict for items it sent back (MACE Alg. 1 line 21): trained again, never held, until retired.
        self.requeued: dict[int, PassVerdict] = {}
        self.specs: dict[str, tuple[float, dict[str, Any]]] = {}
        self.store_changes = -1  # the store's change number as of the last idle wait (-1: look at once)
        self.last_adapter: str | None = None
        self.not_before: dict[str, float] = {}  # adapter -> when to ask for a grant again
        self._stop_checked, self._stop = 0.0, False
        if self.evaluator is not None:
            self._resume_gate()
        ray.get(self.sup.worker_started.remote(self.rank, self.node_id, os.getpid(),
                                               ray.get_runtime_context().get_node_id()))

    # ---- collectives (no-ops with one rank) ---------------------------------------------------

    def bcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def allreduce(self, values: list[float], op: str = "sum") -> list[float]:
        if not self.distributed:
            return values
        t = self.torch.tensor(values, dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX if op == "max" else self.dist.ReduceOp.SUM)
        return t.tolist()

    def allreduce_grads(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.distributed:
            return
        flat = self.torch.cat([(p.grad if p.grad is not None else self.torch.zeros_like(p)).reshape(-1)
                               for p in params])
        self.dist.all_reduce(flat, op=self.dist.ReduceOp.SUM)  # shares were pre-scaled: sum = batch mean
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset: offset + n].view_as(p).clone()
            offset += n

    # ---- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        while True:
            plan = self.bcast(self._plan() if self.leader else None)
            op = plan["op"]
            if op == "stop":
                return
            if op == "idle":
                if plan["sleep"]:
                    time.sleep(plan["sleep"])
            elif op == "step":
                self._ensure_model(plan)
                self._step(plan)
            elif op == "flush":
                self._finish_version(plan, flush=True)

    def _stop_requested(self) -> bool:
        if time.time() - self._stop_checked >= STOP_CHECK_S:
            self._stop_checked = time.time()
            try:
                self._stop = bool(ray.get(self.sup.should_stop.remote(), timeout=10))
            except Exception:
                self._stop = False  # the supervisor is restarting; our fate follows it anyway
        return self._stop

    def _report(self, adapter: str, event: dict[str, Any]) -> None:
        try:
            self.sup.record.remote(adapter, event)
        except Exception:
            pass

    def _warn(self, where: str, exc: BaseException | str) -> None:
        message = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        logger.warning("trainer rank %d, %s: %s", self.rank, where, message)
        try:
            self.sup.worker_error.remote(f"rank {self.rank} {where}", message)
        except Exception:
            pass

    # ---- leader: what to do next ---------------------------------------------------------------

    def _spec(self, adapter: str) -> dict[str, Any]:
        cached = self.specs.get(adapter)
        if cached is None or time.time() - cached[0] > SPEC_TTL_S:
            info = ray.get(self.store.get_adapter.remote(adapter))
            spec = {"name": info.name, "method": info.method, "beta": info.beta, "mode": info.mode,
                    "learning_rate": info.learning_rate, "lora": info.lora.model_dump(),
                    "paused": info.paused_reason is not None}
            self.specs[adapter] = cached = (time.time(), spec)
        return cached[1]

    def _plan(self) -> dict[str, Any]:
        try:
            return self._plan_unsafe()
        except Exception as exc:  # a store or planner hiccup: say so, look again in a moment
            self._warn("plan", exc)
            return {"op": "idle", "sleep": 1.0}

    def _idle(self, wake_at: float | None = None) -> dict[str, Any]:
        """Nothing to train now: wait until the store changes (new feedback, a changed adapter), at most
        until ``wake_at`` or IDLE_WAIT_S. A long poll, so an idle trainer costs nothing while the app
        serves, and new feedback is picked up at once."""
        timeout = IDLE_WAIT_S if wake_at is None else max(0.0, min(IDLE_WAIT_S, wake_at - time.time()))
        self.store_changes = ray.get(self.store.wait_for_change.remote(self.store_changes, timeout),
                                     timeout=timeout + 30)
        return {"op": "idle", "sleep": 0.0}

    def _plan_unsafe(self) -> dict[str, Any]:
        if self._stop_requested():
            return {"op": "stop"}
        # adapter -> (unconsumed, oldest created_at), of this node's partition under per_node
        summary = ray.get(self.store.queue_summary.remote(self.line))
        current = self.loaded[0] if self.loaded else None
        pending = self.micro_done > 0 or self.opt_steps > 0

        now = time.time()

        taken = [it["id"] for it in self.pending_items] + self.held  # trained into unpublished weights

        def available(name: str) -> int:
            return summary.get(name, (0, None))[0] - (len(taken) if name == current else 0)

        def trainable(name: str) -> bool:
            # Not while the gate judges the adapter's candidate: the next version must start from
            # whatever is served after the verdict, never from weights the gate may reject.
            return (available(name) > 0 and self._spec(name)["mode"] != "off" and not self._spec(name)["paused"]
                    and not (self.evaluator is not None and self.evaluator.judging(name))
                    and self.not_before.get(name, 0) <= now)

        if pending:
            # One model per process: finish (publish) the adapter in training before switching; also
            # publish what is trained when its next step is refused (publishing needs no grant).
            if trainable(current):
                adapter = current
            else:
                return {"op": "flush", "adapter": current}
        else:
            names = sorted(n for n in summary if trainable(n))
            if not names:
                waiting = [self.not_before[n] for n in summary
                           if available(n) > 0 and self.not_before.get(n, 0) > now and self._spec(n)["mode"] != "off"]
                return self._idle(min(waiting) if waiting else None)
            later = [n for n in names if self.last_adapter is None or n > self.last_adapter]
            adapter = (later or names)[0]  # round robin in name order
        spec = self._spec(adapter)
        cur = ray.get(self.store.current_version.remote(adapter, self.line))
        target = (cur.version, cur.path) if cur is not None else (None, None)
        held = taken if adapter == current else []
        items = ray.get(self.store.take.remote(adapter, self.t.micro_batch, held, self.line))
        if not items:
            return self._idle()
        more = available(adapter) - len(items) > 0
        return {
            "op": "step", "adapter": adapter, "spec": spec, "target": target,
            "items": [{"id": i.id, "prompt": i.prompt, "messages": i.messages, "completion": i.completion,
                       "chosen": i.chosen, "rejected": i.rejected, "created_at": i.created_at} for i in items],
            "last_of_queue": not more,
            # Items CheckEnd sent back: their t_arr and last loss go into the grants' priorities (MACE §4.1).
            "requeued": {i.id: self.requeued[i.id] for i in items if i.id in self.requeued},
        }

    # ---- every rank: model, step, version --------------------------------------------------------

    def _ensure_model(self, plan: dict[str, Any]) -> None:
        """Load the adapter's current published version (or a fresh LoRA) unless the weights already are it."""
        from app.lora_training import load_lora_model, make_optimizer

        adapter, (version, path) = plan["adapter"], plan["target"]
        if self.model is not None and self.loaded == (adapter, version):
            return
        if self.loaded is not None and self.loaded[0] == adapter and (self.micro_done or self.opt_steps):
            # The current version moved under unpublished work (a rollback): drop it, train the items again.
            self._report(adapter, {"kind": "conflict"})
        spec = plan["spec"]
        self.model = self.tok = self.opt = None
        self.model, self.tok = load_lora_model(self.model_dir, spec["lora"], adapter_dir=path)
        self.opt = make_optimizer(self.model, spec["learning_rate"], state_dir=path)
        self.loaded = (adapter, version)
        self._reset_version()

    def _reset_version(self) -> None:
        self.micro_done = self.opt_steps = 0
        self.held, self.held_created, self.pending_items = [], [], []
        self.version_samples, self.version_losses = 0, []
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)

    def _ask_windows(self, plan: dict[str, Any], passes: dict[int, Any], todo: list[dict[str, Any]]
                     ) -> tuple[list[list[int]], float]:
        """Ask the planner which windows of this rank's unfinished items may run now on its node."""
        if not todo:
            return [], 0.0
        samples = [{"id": it["id"], "tokens": passes[it["id"]].length, "done": passes[it["id"]].done,
                    "arrival": _arrival(plan, it), "dpo_loss": _last_loss(plan, it)} for it in todo]
        ran_s, self.last_round_s = self.last_round_s, 0.0
        try:
            g = ray.get(self.planner.grant.remote(self.node_id, plan["adapter"], plan["spec"]["mode"], samples,
                                                  ran_s), timeout=30)
        except Exception as exc:  # planner restarting: treat as "wait", never train unasked
            self._warn("grant", exc)
            return [], MAX_GRANT_SLEEP_S
        return g["windows"], float(g.get("wait_s", 0.0))

    def _abandon_requested(self, adapter: str) -> bool:
        """Stop, or the adapter's mode became ``off`` mid-step: its unfinished step is dropped."""
        if self._stop_requested():
            return True
        try:
            return self._spec(adapter)["mode"] == "off"
        except Exception:
            return False

    def _step(self, plan: dict[str, Any]) -> None:
        from app.lora_training import WindowedPass, batch_scales

        adapter, spec, items = plan["adapter"], plan["spec"], plan["items"]
        bounds = _split(len(items), self.group_world)
        lo, hi = bounds[self.group_rank]
        mine = items[lo:hi]
        # Scales that make the accumulated gradient the mean over the whole micro-step (all ranks'
        # items), over `accumulation` micro-steps; the sum over ranks is then the batch mean.
        scales = batch_scales(self.tok, items, spec["method"], scale=1.0 / self.t.accumulation,
                              max_length=self.t.max_length)[lo:hi]
        passes = {it["id"]: WindowedPass(self.model, self.tok, it, spec["method"], beta=spec["beta"],
                                         max_length=self.t.max_length, scale=sc) for it, sc in zip(mine, scales)}
        weight = {it["id"]: (passes[it["id"]].loss_tokens if spec["method"] == "sft" else 1) for it in mine}
        t_start = time.time()
        run_s, waited_s, windows, loss_sum, weight_sum = 0.0, 0.0, 0, 0.0, 0.0
        item_loss: dict[int, float] = {}  # each item's own loss in this pass, for CheckEnd and its next priority
        while True:
            todo = [it for it in mine if passes[it["id"]].done < passes[it["id"]].length]
            granted, wait = self._ask_windows(plan, passes, todo)
            t0 = time.time()
            for sid, start, end in granted:
                p = passes.get(sid)
                if p is None or start != p.done or end > p.length:
                    continue  # a stale grant (the planner saw an older state): ask again
                p.forward(end)
                windows += 1
                if p.done == p.length:
                    st = p.finish()
                    item_loss[sid] = st.loss  # DPO: −log σ(β·(Δ⁺ − Δ⁻)); SFT: mean token NLL
                    loss_sum += st.loss * weight[sid]
                    weight_sum += weight[sid]
            ran = len(granted)
            elapsed = time.time() - t0
            run_s += elapsed
            if ran:
                self.last_round_s = elapsed
            left = sum(p.done < p.length for p in passes.values())
            abandon = float(self.leader and self._abandon_requested(adapter))
            left_all, ran_all, abandon, wait = self.allreduce([float(left), float(ran), abandon, wait], op="max")
            if abandon:
                for p in passes.values():
                    p.abandon()
                self._drop_micro_steps(adapter)
                return
            if left_all == 0:
                break
            if ran_all == 0:
                pause = min(max(wait, 0.001), MAX_GRANT_SLEEP_S)
                time.sleep(pause)
                waited_s += pause
        # One collective for the sums and every item's loss and length (each item is in exactly one share).
        sums = self.allreduce([loss_sum, weight_sum, float(sum(p.length for p in passes.values())), float(windows)]
                              + [item_loss.get(it["id"], 0.0) for it in items]
                              + [float(passes[it["id"]].length) if it["id"] in passes else 0.0 for it in items])
        loss_sum, weight_sum, tokens, windows = sums[:4]
        windows = int(windows)
        # CheckEnd before the optimizer step: a requeued item must not become held (marked consumed at publish).
        requeued = self._check_end(plan, sums[4:4 + len(items)], sums[4 + len(items):]) if self.leader else 0
        self.micro_done += 1
        self.pending_items += items
        loss = loss_sum / max(weight_sum, 1e-12)
        self.version_samples += len(items)
        self.version_losses.append((loss, len(items)))
        flush = plan["last_of_queue"]
        stepped = self.micro_done >= self.t.accumulation or flush
        if stepped:
            self._optimizer_step()
        if self.leader:
            self._report(adapter, {"kind": "step", "samples": len(items), "loss": loss, "tokens": int(tokens),
                                   "seconds": run_s, "grant_s": time.time() - t_start - run_s, "windows": windows,
                                   "shrunk": windows > len(items), "optimizer_step": stepped,
                                   "requeued": requeued})
            if waited_s:
                self._report(adapter, {"kind": "wait", "seconds": waited_s})
        if self.opt_steps >= self.t.steps_per_version or (flush and self.opt_steps > 0):
            self._finish_version(plan, flush=False)

    def _check_end(self, plan: dict[str, Any], losses: list[float], tokens: list[float]) -> int:
        """Report each item's loss in this pass to the planner; its CheckEnd (MACE Alg. 1 lines 17–21) says
        which items to train again. Returns how many were requeued.

        A requeued item is never held, so no version marks it consumed: it stays in the store's queue
        (counted as queued, at-least-once across a crash) and ``take`` hands it out again once the
        optimizer step has applied this pass, with CheckEnd's t_arr and loss for the grants'
        priorities. Its last pass, retired, is held like any item and consumed by that version.
        """
        reports = [PassReport(it["id"], int(n), float(loss), _arrival(plan, it), _passes_before(plan, it))
                   for it, loss, n in zip(plan["items"], losses, tokens)]
        try:
            verdicts = ray.get(self.planner.report_passes.remote(self.node_id, plan["adapter"], plan["spec"]["mode"],
                                                                 reports), timeout=30)
        except Exception as exc:  # planner restarting: one pass per item, as without CheckEnd
            self._warn("report_passes", exc)
            verdicts = [PassVerdict(r.sample_id, "retired", r.passes_before + 1, r.loss, r.arrival) for r in reports]
        for v in verdicts:
            if v.outcome == "requeued":
                self.requeued[v.sample_id] = v
            else:
                self.requeued.pop(v.sample_id, None)
        return sum(v.outcome == "requeued" for v in verdicts)

    def _drop_micro_steps(self, adapter: str) -> None:
        """Forget the gradients not yet applied; their items stay queued (they were never held)."""
        self.opt.zero_grad(set_to_none=True)
        self.micro_done, self.pending_items = 0, []
        self._report(adapter, {"kind": "abandoned"})

    def _optimizer_step(self) -> None:
        from app.lora_training import optimizer_step

        if self.micro_done < self.t.accumulation:
            # A partial accumulation (the queue ran dry): rescale to the mean over the steps taken.
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.t.accumulation / self.micro_done)
        self.allreduce_grads()
        optimizer_step(self.model, self.opt)
        self.micro_done = 0
        self.opt_steps += 1
        if self.leader:
            # Items CheckEnd requeued stay unheld (still queued in the store) until their last pass.
            done = [it for it in self.pending_items if it["id"] not in self.requeued]
            self.held += [it["id"] for it in done]
            self.held_created += [it["created_at"] for it in done]
        self.pending_items = []

    def _finish_version(self, plan: dict[str, Any], flush: bool) -> None:
        """Apply pending gradients if flushing, then publish on rank 0 and tell every rank how it went."""
        if self.model is None or (flush and self.loaded and self.loaded[0] != plan["adapter"]):
            return
        if flush and self.micro_done > 0:
            self._optimizer_step()
        if self.opt_steps == 0:
            return
        outcome = self._publish(plan["adapter"]) if self.leader else None
        outcome = self.bcast(outcome)
        adapter = plan["adapter"]
        if outcome["version"] is None:
            self.loaded = None  # reload the store's current version before the next step
            self._reset_version()
            return
        self.loaded = (adapter, outcome["version"])
        self.last_adapter = adapter
        self._reset_version()
        if self.leader:
            self._evaluate(adapter, outcome)

    def _publish(self, adapter: str) -> dict[str, Any]:
        from app.feedback_store import VersionConflict
        from app.lora_training import save_adapter_version

        t0 = time.time()
        samples = self.version_samples
        loss = sum(l * n for l, n in self.version_losses) / max(1, sum(n for _, n in self.version_losses))
        parent = self.loaded[1] if self.loaded else None
        marks = [t0]
        try:
            v = ray.get(self.store.reserve_version.remote(adapter, self.line))
            marks.append(time.time())
            path = save_adapter_version(self.model, self.opt, self.cfg.adapters_path, adapter, v.version, {
                "parent": parent, "samples_trained": samples, "loss": loss, "items": len(self.held),
                "scope": self.t.scope, "world_size": self.world, "node": self.line})
            marks.append(time.time())
            published = ray.get(self.store.publish_version.remote(adapter, v.version, str(path), self.held, samples,
                                                                  loss))
            marks.append(time.time())
        except VersionConflict as exc:
            # A rollback moved the current version: drop this work; the items are still queued.
            self._report(adapter, {"kind": "conflict"})
            self._warn("publish", exc)
            return {"version": None}
        except Exception as exc:
            self._warn("publish", exc)
            return {"version": None}
        created = list(self.held_created)
        if published.state == "candidate":
            # The gate is on: not served until the evaluator passes it (it loads it on the replicas then).
            now = time.time()
            breakdown = dict(zip(("reserve_s", "save_s", "publish_s"),
                                 (round(b - a, 4) for a, b in zip(marks, marks[1:]))))
            self._report(adapter, {"kind": "published", "version": v.version, "at": now, "seconds": now - t0,
                                   "breakdown": breakdown, "freshness_s": [], "candidate": True})
            return {"version": v.version, "path": str(path), "candidate": True, "created": created}
        try:
            nodes = [self.node_id] if self.per_node else None  # per_node: only this node serves its copy
            ray.get(self.planner.load_adapter.remote(adapter, v.version, str(path), nodes), timeout=LOAD_TIMEOUT_S)
        except Exception as exc:  # published in the store; the planner restores it on restart
            self._warn("load_adapter", exc)
        now = time.time()
        marks.append(now)
        breakdown = dict(zip(("reserve_s", "save_s", "publish_s", "load_s"),
                             (round(b - a, 4) for a, b in zip(marks, marks[1:]))))
        self._report(adapter, {"kind": "published", "version": v.version, "at": now, "seconds": now - t0,
                               "breakdown": breakdown,
                               "freshness_s": [round(now - c, 3) for c in created]})
        return {"version": v.version, "path": str(path), "candidate": False, "created": created}

    # ---- the quality gate and held-out scores --------------------------------------------------------

    def _evaluate(self, adapter: str, outcome: dict[str, Any]) -> None:
        if self.evaluator is not None:
            self.evaluator.submit(adapter, outcome["version"], outcome["path"], candidate=outcome["candidate"],
                                  created=outcome["created"])

    def _resume_gate(self) -> None:
        """Candidates that a previous leader left undecided (it died while the gate judged them) are judged now."""
        try:
            left = ray.get(self.store.candidates.remote(self.line), timeout=60)
        except Exception as exc:
            self._warn("candidates", exc)
            return
        for v in left:
            self.evaluator.submit(v.adapter, v.version, v.path, candidate=True, created=[])


class _Evaluator:
    """The leader's background thread: the quality gate, and held-out scores of every version.

    A candidate (its adapter's gate on) is scored on the adapter's held-out slice, the oldest
    ``max_eval_items`` held-out feedback items (or ``training.eval_file`` when it has none), and so
    is the version served now (the base model before the first; scores are cached per version and
    slice, so usually only the candidate is scored). ``planners.gate.judge`` compares them; the
    store records the verdict in one transaction and a passed candidate is loaded on the replicas.
    The leader does not train an adapter while its candidate is judged, so the next version starts
    from whatever is served after the verdict, never from rejected weights.

    Versions served without the gate are scored the same way, so the served version's held-out win
    rate is known with the gate off too; when they come faster than that, only the newest waiting
    one per adapter is scored. Each version is loaded from its directory into a model copy of its
    own, so scoring never touches the weights in training.
    """

    MAX_ATTEMPTS = 3  # a candidate whose scoring fails this often is rejected with the error as its reason
    MAX_CACHED = 256

    def __init__(self, worker: _Worker, eval_file: str | None) -> None:
        self.worker, self.t = worker, worker.t
        self.eval_file = eval_file
        self._file_pairs: list[dict[str, str]] | None = None
        self._candidates: deque[dict[str, Any]] = deque()
        self._served: dict[str, dict[str, Any]] = {}  # adapter -> newest version served without the gate
        self._judging: dict[str, int] = {}  # adapter -> its candidates not decided yet
        # (adapter, version, "held-out" or "eval-file") -> {item id (eval file: index) -> its own score}
        self._scores: dict[tuple[str, int | None, str], dict[int, Any]] = {}
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="evaluator", daemon=True).start()

    def judging(self, adapter: str) -> bool:
        """Whether a candidate of ``adapter`` waits for its verdict (the leader does not train it meanwhile)."""
        with self._cv:
            return self._judging.get(adapter, 0) > 0

    def submit(self, adapter: str, version: int, path: str, *, candidate: bool, created: list[float]) -> None:
        job = {"adapter": adapter, "version": version, "path": path, "candidate": candidate, "created": created,
               "attempts": 0, "submitted_at": time.time()}
        with self._cv:
            if candidate:
                self._candidates.append(job)
                self._judging[adapter] = self._judging.get(adapter, 0) + 1
            else:
                self._served[adapter] = job
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._candidates and not self._served:
                    self._cv.wait()
                # Candidates first: training of their adapter waits for them.
                job = self._candidates.popleft() if self._candidates else self._served.popitem()[1]
            if not job["candidate"]:
                try:
                    self._score_served(job)
                except Exception as exc:
                    self.worker._warn("evaluate", exc)
                continue
            done = True
            try:
                self._gate(job)
            except Exception as exc:
                job["attempts"] += 1
                self.worker._warn("gate", exc)
                if job["attempts"] < self.MAX_ATTEMPTS:
                    done = False
                    time.sleep(2.0)  # e.g. the store actor restarting
                    with self._cv:
                        self._candidates.appendleft(job)
                else:
                    self._give_up(job, exc)
            finally:
                if done:
                    with self._cv:
                        self._judging[job["adapter"]] -= 1

    # ---- what is scored, and how --------------------------------------------------------------------

    def _eval_file_pairs(self) -> list[dict[str, str]]:
        from app.lora_training import read_preference_jsonl

        if self.eval_file and self._file_pairs is None:
            try:
                self._file_pairs = read_preference_jsonl(self.eval_file, limit=self.t.eval_pairs,
                                                         max_text_bytes=4 * self.t.max_length)
            except Exception as exc:
                self.worker._warn("eval_file", exc)
                self._file_pairs = []
        return self._file_pairs or []

    def _slice(self, adapter: str, max_items: int) -> tuple[list[Any], str, str]:
        """(items, a key naming exactly these items, how to call them in a reason); no items: nothing to score on."""
        items = ray.get(self.worker.store.held_out_items.remote(adapter, max_items), timeout=60)
        if items:
            return items, "held-out:" + ",".join(str(it.id) for it in items), "held-out items"
        pairs = self._eval_file_pairs()
        if pairs:
            return pairs, "eval-file", f"pairs of training.eval_file {os.path.basename(self.eval_file)}"
        return [], "", ""

    def _score(self, adapter: str, version: int | None, path: str | None, info: Any, items: list[Any],
               key: str) -> dict[str, float]:
        """Held-out scores of one version (``path`` None: the base model) on ``items``.

        Each item's own score (a pair's log-probability difference, a completion's log-likelihood
        and token count) is cached per version, so while the held-out slice grows toward
        ``max_eval_items`` only its new items are scored, and the served version, scored before,
        costs nothing more.
        """
        from app.lora_training import (
            completion_eval,
            evaluate_completions,
            evaluate_preferences,
            load_lora_model,
            preference_eval,
        )

        held_out = key.startswith("held-out")
        ids = [it.id for it in items] if held_out else list(range(len(items)))
        cache_key = (adapter, version, "held-out" if held_out else "eval-file")
        if cache_key not in self._scores and len(self._scores) >= self.MAX_CACHED:
            self._scores.clear()
        cached = self._scores.setdefault(cache_key, {})
        missing = [(i, it) for i, it in zip(ids, items) if i not in cached]
        if missing:
            # A fresh LoRA has B = 0: exactly the base model, for comparisons before the first served version.
            model, tok = load_lora_model(self.worker.model_dir, info.lora.model_dump(), adapter_dir=path)
            todo = [it for _, it in missing]
            try:
                if info.method == "dpo":
                    found = evaluate_preferences(model, tok, todo, max_length=self.t.max_length).diffs
                else:
                    # An sft adapter's own held-out items have a completion; eval_file pairs score their chosen answer.
                    found = evaluate_completions(model, tok, todo, field="completion" if held_out else "chosen",
                                                 max_length=self.t.max_length).per_item
            finally:
                del model
            cached.update(zip((i for i, _ in missing), found))
        if info.method == "dpo":
            ev = preference_eval([cached[i] for i in ids])
            return {"score": ev.win_rate, "win_rate": ev.win_rate, "clpd": ev.clpd}
        tokens = completion_eval([cached[i] for i in ids])
        return {"score": tokens.token_logprob, "token_logprob": tokens.token_logprob}

    # ---- the gate --------------------------------------------------------------------------------

    def _gate(self, job: dict[str, Any]) -> None:
        from app.feedback_store import VersionConflict
        from planners.gate import Verdict, judge

        w = self.worker
        adapter, version, path = job["adapter"], job["version"], job["path"]
        t0 = time.time()
        info = ray.get(w.store.get_adapter.remote(adapter), timeout=60)
        current = ray.get(w.store.current_version.remote(adapter, w.line), timeout=60)
        base_version, base_path = (current.version, current.path) if current is not None else (None, None)
        base_name = "the base model" if current is None else f"v{current.version}"
        items, key, slice_name = self._slice(adapter, info.gate.max_eval_items)
        cand: dict[str, float] = {}
        base: dict[str, float] = {}
        if not items:
            verdict = Verdict(True, "nothing to compare on: no held-out feedback yet (or held_out_share 0) and no "
                                    "training.eval_file")
        else:
            cand = self._score(adapter, version, path, info, items, key)
            base = self._score(adapter, base_version, base_path, info, items, key)
            verdict = judge(info.method, cand["score"], base["score"], info.gate.margin, items=len(items),
                            baseline_name=base_name, slice_name=slice_name)
        try:
            decided = ray.get(w.store.decide_version.remote(
                adapter, version, passed=verdict.passed, reason=verdict.reason, score=cand.get("score"),
                baseline_version=base_version if items else None, baseline_score=base.get("score"),
                win_rate=cand.get("win_rate"), clpd=cand.get("clpd"), token_logprob=cand.get("token_logprob"),
                eval_items=len(items) or None), timeout=60)
        except VersionConflict as exc:  # promoted (or otherwise decided) through the API meanwhile
            w._warn("gate", exc)
            return
        w.specs.pop(adapter, None)  # a pause the verdict caused takes effect at the next plan
        freshness: list[float] = []
        if decided.state == "served":
            try:
                nodes = [w.node_id] if w.per_node else None
                ray.get(w.planner.load_adapter.remote(adapter, version, path, nodes), timeout=LOAD_TIMEOUT_S)
            except Exception as exc:  # served in the store; the planner restores it on restart
                w._warn("load_adapter", exc)
            now = time.time()
            freshness = [round(now - c, 3) for c in job["created"]]
        w._report(adapter, {"kind": "gate", "version": version, "state": decided.state, "reason": decided.reason,
                            "score": decided.score, "baseline_score": decided.baseline_score,
                            "baseline_version": decided.baseline_version, "win_rate": cand.get("win_rate"),
                            "clpd": cand.get("clpd"), "token_logprob": cand.get("token_logprob"),
                            "seconds": time.time() - t0, "at": time.time(), "freshness_s": freshness})

    def _give_up(self, job: dict[str, Any], exc: BaseException) -> None:
        """Scoring failed again and again: reject the candidate, with the error as the reason (not served unproven)."""
        try:
            ray.get(self.worker.store.decide_version.remote(
                job["adapter"], job["version"], passed=False,
                reason=f"the gate could not score it: {type(exc).__name__}: {str(exc)[:300]}"), timeout=60)
        except Exception as again:
            self.worker._warn("gate", again)

    def _score_served(self, job: dict[str, Any]) -> None:
        """Held-out scores of a version served without the gate (the gate off), for the API and the metrics."""
        w = self.worker
        adapter, version = job["adapter"], job["version"]
        t0 = time.time()
        info = ray.get(w.store.get_adapter.remote(adapter), timeout=60)
        items, key, _ = self._slice(adapter, info.gate.max_eval_items)
        if not items:
            return
        scores = self._score(adapter, version, job["path"], info, items, key)
        ray.get(w.store.record_scores.remote(adapter, version, eval_items=len(items), **scores), timeout=60)
        w._report(adapter, {"kind": "eval", "version": version, "win_rate": scores.get("win_rate"),
                            "clpd": scores.get("clpd"), "token_logprob": scores.get("token_logprob"),
                            "seconds": time.time() - t0})
