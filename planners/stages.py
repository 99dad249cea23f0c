"""Execution stages for offline multi-LLM jobs: which models run together, with which (dp, tp), on which devices.

Source: SamuLLM (shared/papers/samullm.md). The pieces, each citing its section:

- output-length sampling from a per-model eCDF, truncated at the output limit (§2, §4.1):
  :func:`sample_output_lengths`, :func:`output_cdf_from_pairs`;
- the request-scheduling simulator of one engine (§2 "The inference process can be simulated",
  §4.1) with per-iteration latency from the shared cost model (Eq. 5): :func:`simulate_engine`,
  and of one model with ``dp`` replicas plus its load time: :func:`simulate_model`;
- execution plans (Eq. 3, valid under device memory) and stages (Eq. 4): :class:`ExecutionPlan`,
  :class:`Stage`, :func:`valid_plans`; the stage-level simulator over the application DAG (§3, §4.1
  "topological order", self-loop fusion of §4.2): :class:`JobSimulator`;
- the greedy stage search with preemption (§4.2, Algorithm 1) and the baselines of §5
  (Max-heuristic, Min-heuristic, no-preemption and known-output-length variants of §5.5):
  registry kind ``stages``, names ``greedy``, ``max``, ``min``;
- link-aware device choice minimising reloads and the dynamic re-adjustment of the running phase
  (§4.3): :func:`assign_devices`, :func:`adjust_stage`.

Pure: plain data in and out, numpy only; no Ray, torch, vLLM or I/O (docs/architecture.md). The only clock
read is ``time.perf_counter`` for :attr:`Plan.search_time_s`, which is reported, never decided on.

Assumptions worth knowing (each repeated where it is used):

- Work is measured as ``weight_bytes × tokens processed``: proportional to the FLOPs of §3's stage
  throughput (2·params FLOPs per token) without needing a FLOP count per model.
- Tensor parallelism scales the per-token and per-sequence terms of Eq. 5 by a speedup
  ``tp·efficiency^log2(tp)`` and leaves the per-iteration constant alone (:class:`TensorParallelScaling`),
  unless the caller supplies a profiled cost model for that degree under the key ``"<model>@tp<k>"``.
- A request preempted at a stage boundary keeps the tokens it generated: it restarts with them
  appended to its prompt (re-prefill), unless its model keeps the same plan, in which case it keeps
  decoding with its KV cache. A change of tp reloads every replica (load time from the table); a
  change of dp alone keeps the common replicas running and loads only the added ones.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Sequence

import numpy as np

from planners.costs import CostModel, IterationLatency, OutputLengthCDF
from planners.registry import register

# Relative slack when comparing simulated times: closed-form jumps and step-by-step sums differ in the last bits.
_EPS = 1e-9


# --- Output lengths (§2, §4.1) ------------------------------------------------------------------


def output_cdf_from_pairs(pairs: Iterable[tuple[int, int]], max_output_tokens: int | None = None) -> OutputLengthCDF:
    """The eCDF of output lengths from ``(prompt_tokens, response_tokens)`` pairs (SamuLLM §2, §4.1).

    SamuLLM observes that output lengths hardly depend on the prompt, so only the responses enter
    the CDF; the prompts are checked but not used. A response longer than ``max_output_tokens`` is
    counted at the limit, as the engine that produced it under that limit would have stopped there.
    """
    resp = []
    for prompt, response in pairs:
        if prompt < 0 or response < 0:
            raise ValueError(f"token counts must be >= 0, got ({prompt}, {response})")
        resp.append(response)
    if not resp:
        raise ValueError("need at least one (prompt, response) pair")
    arr = np.asarray(resp, dtype=np.int64)
    if max_output_tokens is not None:
        if max_output_tokens < 1:
            raise ValueError("max_output_tokens must be >= 1")
        arr = np.minimum(arr, max_output_tokens)
    return OutputLengthCDF.from_samples(arr)


def sample_output_lengths(cdf: OutputLengthCDF, prompt_tokens: Sequence[int] | np.ndarray, max_output_tokens: int,
                          max_seq_len: int | None = None,
                          rng: np.random.Generator | int | None = 0) -> np.ndarray:
    """One output length per request: L ~ eCDF, truncated at min(m, M − prompt) (SamuLLM §4.1).

    ``m`` is the output limit of the sampling settings and ``M`` the model's maximum sequence length;
    the engine stops at the limit, so a longer draw becomes the limit rather than being redrawn.
    Every length is at least 1 (a request always produces one token).
    """
    prompts = np.asarray(prompt_tokens, dtype=np.int64)
    out = cdf.sample(prompts.size, rng, max_tokens=max_output_tokens)
    if max_seq_len is not None:
        out = np.minimum(out, np.maximum(max_seq_len - prompts, 1))
    return out.astype(np.int64)


# --- The engine simulator (§2, §4.1) ------------------------------------------------------------


@dataclass(frozen=True)
class EngineConfig:
    """The scheduler limits of one vLLM engine: max running requests and max batched tokens per iteration."""

    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_batched_tokens must be >= 1")
        if self.max_batched_tokens < self.max_num_seqs:
            # vLLM refuses this too: every running sequence must fit one decode token in the budget.
            raise ValueError("max_batched_tokens must be >= max_num_seqs")


@dataclass(frozen=True)
class IterationSegment:
    """``iterations`` consecutive engine iterations with the same running set (the simulator's trace unit).

    Within a segment every iteration prefills ``prefill_tokens`` and decodes ``decode_seqs``
    sequences; the decoding sequences' context starts at ``context_tokens`` and grows by
    ``decode_seqs`` per iteration. ``running`` counts requests holding a running slot.
    """

    start_s: float
    iterations: int
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    running: int

    def per_iteration(self) -> Iterator[tuple[int, int, int]]:
        """(prefill tokens, decode sequences, context tokens) of each iteration in the segment."""
        for i in range(self.iterations):
            yield self.prefill_tokens, self.decode_seqs, self.context_tokens + i * self.decode_seqs


@dataclass(frozen=True)
class EngineRun:
    """What :func:`simulate_engine` predicts for one engine (one replica).

    ``finish_s[j]`` is when request j produced its last token (inf: not within the run);
    ``generated[j]`` the tokens it produced in this run; ``decoding[j]`` whether it was decoding
    (KV cache in place) when the run stopped at ``until_s``. ``curve_s`` / ``curve_tokens`` give the
    cumulative tokens processed (prefill + decode) over time, for throughput up to any instant.
    """

    iterations: int
    busy_s: float
    end_s: float
    finish_s: np.ndarray
    generated: np.ndarray
    decoding: np.ndarray
    curve_s: np.ndarray
    curve_tokens: np.ndarray
    segments: tuple[IterationSegment, ...] = ()

    @property
    def finished_all(self) -> bool:
        return bool(np.all(np.isfinite(self.finish_s)))

    def tokens_by(self, t: float) -> float:
        """Tokens processed by time ``t`` (linear between recorded events)."""
        return float(np.interp(t, self.curve_s, self.curve_tokens))

    def per_iteration(self) -> Iterator[tuple[int, int, int]]:
        """(prefill tokens, decode sequences, context tokens) of every iteration; needs ``record=True``."""
        for seg in self.segments:
            yield from seg.per_iteration()


def _iteration_terms(latency: CostModel | IterationLatency) -> tuple[float, float, float, float]:
    it = latency.iteration if isinstance(latency, CostModel) else latency
    return it.base, it.per_prefill_token, it.per_decode_seq, it.per_context_token


def _iters_to_reach(span: float, a: float, c: float, ctx: float, n: int) -> int:
    """Smallest k >= 1 with S(k) = k·a + c·(k·ctx + n·k(k−1)/2) >= span: decode iterations until an instant."""
    if span <= 0:
        return 1
    first = a + c * ctx
    quad = c * n / 2.0
    if quad <= 0:
        return math.ceil(span / first) if first > 0 else 1 << 62
    lin = first - quad
    k = max(1, math.ceil((-lin + math.sqrt(lin * lin + 4 * quad * span)) / (2 * quad)))

    def s(x: int) -> float:
        return x * a + c * (x * ctx + n * x * (x - 1) / 2.0)

    while k > 1 and s(k - 1) >= span:
        k -= 1
    while s(k) < span:
        k += 1
    return k


def simulate_engine(prompt_tokens: Sequence[int] | np.ndarray, output_tokens: Sequence[int] | np.ndarray,
                    latency: CostModel | IterationLatency, config: EngineConfig = EngineConfig(), *,
                    ready_s: Sequence[float] | np.ndarray | None = None,
                    parent: Sequence[int] | np.ndarray | None = None,
                    resumed: Sequence[bool] | np.ndarray | None = None,
                    start_s: float = 0.0, until_s: float = math.inf, record: bool = False) -> EngineRun:
    """Simulate one vLLM engine running requests to completion (SamuLLM §2, §4.1; latency by Eq. 5).

    Scheduling follows vLLM's FCFS continuous batching: each iteration first gives one token to
    every decoding request, then continues partial prefills, then admits waiting requests in
    arrival order while fewer than ``max_num_seqs`` run and the ``max_batched_tokens`` budget lasts.
    With ``chunked_prefill`` a prompt may be split over iterations; without it a prompt that does
    not fit the rest of the budget waits (head of line). The iteration that completes a prompt
    also samples the request's first token; each later iteration adds one token.

    ``ready_s[j]``: when request j may be admitted (inf: never in this run). ``parent[j]``: index of
    an earlier request whose finish makes j ready (a fused self-loop, §4.1/§4.2), or −1.
    ``resumed[j]``: j already holds its KV cache (its prompt includes what it generated), so it
    decodes without prefill. The engine starts at ``start_s`` (after its model load) and stops
    after the iteration that crosses ``until_s``.

    Complexity: O((N + P) log N) for N requests, P = iterations that prefill or admit
    (≤ N + Σprompt / max_batched_tokens): stretches where only decodes run are taken in one
    closed-form jump (S(k) = k·a + c·(k·ctx + n·k(k−1)/2)) up to the next finish, admission or ``until_s``.
    """
    p = np.asarray(prompt_tokens, dtype=np.int64).reshape(-1)
    o = np.asarray(output_tokens, dtype=np.int64).reshape(-1)
    n = p.size
    if o.size != n:
        raise ValueError("prompt_tokens and output_tokens differ in length")
    if n and (p.min() < 1 or o.min() < 1):
        raise ValueError("every request needs >= 1 prompt token and >= 1 output token")
    if not config.chunked_prefill and n and p.max() > config.max_batched_tokens:
        raise ValueError(f"a prompt of {int(p.max())} tokens never fits max_batched_tokens="
                         f"{config.max_batched_tokens} without chunked prefill")
    ready = np.zeros(n) if ready_s is None else np.asarray(ready_s, dtype=float).reshape(-1)
    par = np.full(n, -1, dtype=np.int64) if parent is None else np.asarray(parent, dtype=np.int64).reshape(-1)
    res = np.zeros(n, dtype=bool) if resumed is None else np.asarray(resumed, dtype=bool).reshape(-1)
    if ready.size != n or par.size != n or res.size != n:
        raise ValueError("ready_s, parent and resumed need one entry per request")
    if np.any(par >= np.arange(n)):
        raise ValueError("parent[j] must be an earlier request (or -1)")
    base, kp, kd, kc = _iteration_terms(latency)
    cap, budget_max = config.max_num_seqs, config.max_batched_tokens
    pl, ol = p.tolist(), o.tolist()

    finish = np.full(n, math.inf)
    gen = np.zeros(n, dtype=np.int64)
    children: dict[int, list[int]] = {}
    waiting: list[tuple[float, int]] = []
    for j in range(n):
        if par[j] >= 0:
            children.setdefault(int(par[j]), []).append(j)
    t, g, iters, busy, tokens = float(start_s), 0, 0, 0.0, 0
    dec: list[tuple[int, int]] = []  # (g at which the request finishes, request)
    n_dec, ctx = 0, 0
    for j in np.flatnonzero(res & (par < 0)).tolist():
        if n_dec < cap and ready[j] <= t:
            heapq.heappush(dec, (ol[j], j))  # ol[j] more decode iterations
            n_dec += 1
            ctx += pl[j]
    in_dec = {j for _, j in dec}
    for j in range(n):
        if par[j] < 0 and j not in in_dec and math.isfinite(ready[j]):
            heapq.heappush(waiting, (max(float(ready[j]), t), j))
    prefilling: deque[list[int]] = deque()
    curve_s, curve_tok = [t], [0]
    segs: list[IterationSegment] = []

    def release(j: int, at: float) -> None:
        for c in children.get(j, ()):
            heapq.heappush(waiting, (max(float(ready[c]), at), c))

    while t < until_s:
        n_run = n_dec + len(prefilling)
        admissible = bool(waiting) and waiting[0][0] <= t and n_run < cap
        if not prefilling and not admissible:
            if n_dec == 0:
                if not waiting:
                    break
                t = waiting[0][0]  # idle until the next request is ready: no iterations
                curve_s.append(t)
                curve_tok.append(tokens)
                continue
            # Only decodes run and nothing changes until a finish, an admission or until_s: one jump.
            a = base + kd * n_dec
            k = dec[0][0] - g
            if waiting and n_run < cap:
                k = min(k, _iters_to_reach(waiting[0][0] - t, a, kc, ctx, n_dec))
            if until_s < math.inf:
                k = min(k, _iters_to_reach(until_s - t, a, kc, ctx, n_dec))
            dt = k * a + kc * (k * ctx + n_dec * k * (k - 1) / 2.0)
            if record:
                segs.append(IterationSegment(t, k, 0, n_dec, ctx, n_run))
            t += dt
            busy += dt
            iters += k
            g += k
            tokens += n_dec * k
            ctx += n_dec * k
            while dec and dec[0][0] <= g:
                _, j = heapq.heappop(dec)
                finish[j], gen[j] = t, ol[j]
                ctx -= pl[j] + ol[j]
                n_dec -= 1
                release(j, t)
            curve_s.append(t)
            curve_tok.append(tokens)
            continue
        # A general iteration: decodes, then partial prefills, then admissions (vLLM's order).
        budget = budget_max - n_dec
        pre, completed = 0, []
        for item in list(prefilling):
            take = min(item[1], budget)
            budget -= take
            pre += take
            item[1] -= take
            if item[1] == 0:
                prefilling.remove(item)
                completed.append(item[0])
        while budget > 0 and waiting and waiting[0][0] <= t and n_run < cap:
            j = waiting[0][1]
            left = pl[j]
            take = min(left, budget) if config.chunked_prefill else left
            if take > budget:
                break
            heapq.heappop(waiting)
            budget -= take
            pre += take
            n_run += 1
            if take == left:
                completed.append(j)
            else:
                prefilling.append([j, left - take])
        lat = base + kp * pre + kd * n_dec + kc * ctx
        if record:
            segs.append(IterationSegment(t, 1, pre, n_dec, ctx, n_run))
        t += lat
        busy += lat
        iters += 1
        g += 1
        tokens += pre + n_dec
        ctx += n_dec
        while dec and dec[0][0] <= g:
            _, j = heapq.heappop(dec)
            finish[j], gen[j] = t, ol[j]
            ctx -= pl[j] + ol[j]
            n_dec -= 1
            release(j, t)
        for j in completed:
            if ol[j] == 1:
                finish[j], gen[j] = t, 1
                release(j, t)
            else:
                heapq.heappush(dec, (g + ol[j] - 1, j))
                n_dec += 1
                ctx += pl[j] + 1
        curve_s.append(t)
        curve_tok.append(tokens)

    decoding = np.zeros(n, dtype=bool)
    for gf, j in dec:
        decoding[j] = True
        gen[j] = ol[j] - (gf - g)
    return EngineRun(iters, busy, t, finish, gen, decoding, np.asarray(curve_s), np.asarray(curve_tok, dtype=float),
                     tuple(segs))


def replica_of(prompt_tokens: np.ndarray, output_tokens: np.ndarray, parent: np.ndarray, dp: int) -> np.ndarray:
    """Which of ``dp`` replicas serves each request: whole self-loop chains, longest-processing-time first.

    A chain (a request and its self-loop descendants) stays on one replica so its KV-free handoff
    needs no cross-replica traffic; chains go, largest token total first, to the least-loaded
    replica (ties: lowest index). The runtime should route the same way for predictions to hold.
    """
    n = prompt_tokens.size
    root = np.arange(n)
    par = parent.tolist()
    for j in range(n):
        if par[j] >= 0:
            root[j] = root[par[j]]
    if dp == 1 or n == 0:
        return np.zeros(n, dtype=np.int64)
    work = np.bincount(root, weights=(prompt_tokens + output_tokens).astype(float), minlength=n)
    roots = np.unique(root)
    order = roots[np.lexsort((roots, -work[roots]))]
    load = [(0.0, r) for r in range(dp)]
    chosen = np.empty(n, dtype=np.int64)
    for r in order.tolist():
        w, k = heapq.heappop(load)
        chosen[r] = k
        heapq.heappush(load, (w + work[r], k))
    return chosen[root]


@dataclass(frozen=True)
class ModelRun:
    """What :func:`simulate_model` predicts for one model with ``dp`` replicas (arrays over its requests)."""

    end_s: float
    """When the last request finished (inf: some request did not finish in this run)."""
    finish_s: np.ndarray
    generated: np.ndarray
    decoding: np.ndarray
    replicas: tuple[EngineRun, ...]

    @property
    def iterations(self) -> int:
        return sum(r.iterations for r in self.replicas)

    def tokens_by(self, t: float) -> float:
        return sum(r.tokens_by(t) for r in self.replicas)


def simulate_model(prompt_tokens: np.ndarray, output_tokens: np.ndarray, latency: CostModel | IterationLatency,
                   config: EngineConfig = EngineConfig(), dp: int = 1, *, ready_s: np.ndarray | None = None,
                   parent: np.ndarray | None = None, resumed: np.ndarray | None = None,
                   load_s: float | Sequence[float] = 0.0, until_s: float = math.inf, record: bool = False) -> ModelRun:
    """Simulate a model's ``dp`` replicas (SamuLLM §4.1: load time from the table, then the engines).

    Requests are split by :func:`replica_of`; replica k is one :func:`simulate_engine` starting at
    ``load_s`` (or ``load_s[k]``: replicas kept from the previous stage start at 0, new ones after
    their load; replicas load in parallel). ``latency`` is the per-replica cost (already scaled
    for its tensor-parallel degree).
    """
    p = np.asarray(prompt_tokens, dtype=np.int64)
    o = np.asarray(output_tokens, dtype=np.int64)
    n = p.size
    ready = np.zeros(n) if ready_s is None else np.asarray(ready_s, dtype=float)
    par = np.full(n, -1, dtype=np.int64) if parent is None else np.asarray(parent, dtype=np.int64)
    res = np.zeros(n, dtype=bool) if resumed is None else np.asarray(resumed, dtype=bool)
    rep = replica_of(p, o, par, dp)
    loads = [float(load_s)] * dp if np.isscalar(load_s) else [float(x) for x in load_s]  # type: ignore[union-attr]
    if len(loads) != dp:
        raise ValueError("load_s needs one entry per replica")
    finish = np.full(n, math.inf)
    gen = np.zeros(n, dtype=np.int64)
    decoding = np.zeros(n, dtype=bool)
    runs = []
    for k in range(dp):
        idx = np.flatnonzero(rep == k)
        local = np.full(n, -1, dtype=np.int64)
        local[idx] = np.arange(idx.size)
        lp = np.where(par[idx] >= 0, local[np.maximum(par[idx], 0)], -1)
        run = simulate_engine(p[idx], o[idx], latency, config, ready_s=ready[idx], parent=lp, resumed=res[idx],
                              start_s=loads[k], until_s=until_s, record=record)
        finish[idx], gen[idx], decoding[idx] = run.finish_s, run.generated, run.decoding
        runs.append(run)
    end = float(finish.max()) if n else 0.0
    return ModelRun(max(end, min(loads)), finish, gen, decoding, tuple(runs))


# --- Job description (§3) -----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """One node of the application graph: a model and the requests it must answer (SamuLLM §3).

    ``prompt_tokens`` has one entry per request (so ``n_requests`` is its length); for a node fed
    by an edge that carries outputs, it is the prompt without the upstream output (template +
    own text), and the planner adds the (sampled) upstream output length. ``output_tokens``, when
    given, are the true lengths (the known-output-length variant of §5.5 and tests use them).
    ``cost_key`` names the entry of the ``costs`` mapping (default: ``name``); ``load_time_s`` is
    the load-time table of §4.1 as ``((tp, seconds), ...)``.
    """

    name: str
    weight_bytes: float
    prompt_tokens: tuple[int, ...]
    max_output_tokens: int
    kv_bytes_per_token: float = 0.0
    max_seq_len: int | None = None
    output_tokens: tuple[int, ...] | None = None
    cost_key: str | None = None
    load_time_s: tuple[tuple[int, float], ...] = ()
    tp_options: tuple[int, ...] = (1, 2, 4, 8)
    engine: EngineConfig = EngineConfig()

    def __post_init__(self) -> None:
        if self.weight_bytes <= 0:
            raise ValueError(f"model {self.name!r}: weight_bytes must be > 0")
        if self.max_output_tokens < 1:
            raise ValueError(f"model {self.name!r}: max_output_tokens must be >= 1")
        if any(x < 1 for x in self.prompt_tokens):
            raise ValueError(f"model {self.name!r}: prompt lengths must be >= 1")
        if self.output_tokens is not None and len(self.output_tokens) != len(self.prompt_tokens):
            raise ValueError(f"model {self.name!r}: output_tokens needs one entry per request")
        if not self.tp_options or any(tp < 1 for tp in self.tp_options):
            raise ValueError(f"model {self.name!r}: tp_options must be positive")

    @property
    def n_requests(self) -> int:
        return len(self.prompt_tokens)

    @property
    def key(self) -> str:
        return self.cost_key or self.name

    def load_time(self, tp: int) -> float:
        """Seconds to load on ``tp`` devices: the table's entry for ``tp``, else the nearest smaller one, else 0."""
        best = None
        for k, s in self.load_time_s:
            if k <= tp and (best is None or k > best[0]):
                best = (k, s)
        return 0.0 if best is None else float(best[1])


@dataclass(frozen=True)
class Edge:
    """Data flow ``src → dst`` (SamuLLM §3). ``request_map[j]``: the ``src`` request whose output ``dst``
    request j needs (−1: none); ``None`` maps request j to request j. ``src == dst`` is a self-loop
    (e.g. a running summary): its map must point to earlier requests. With ``carries_output`` the
    upstream output is part of the downstream prompt."""

    src: str
    dst: str
    request_map: tuple[int, ...] | None = None
    carries_output: bool = True


def chain_maps(chunks_per_document: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """For chain summarisation with requests ordered document by document, chunk by chunk:
    the self-loop map (each chunk after the previous summary) and the index of each document's
    last request (what an evaluator reads)."""
    parents, last = [], []
    i = 0
    for k in chunks_per_document:
        if k < 1:
            raise ValueError("every document needs >= 1 chunk")
        parents.extend([-1] + list(range(i, i + k - 1)))
        i += k
        last.append(i - 1)
    return tuple(parents), tuple(last)


@dataclass(frozen=True)
class JobGraph:
    """The application's computation graph: models (nodes) and data-flow edges, self-loops allowed (§3)."""

    models: tuple[ModelSpec, ...]
    edges: tuple[Edge, ...] = ()

    def __post_init__(self) -> None:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError("model names must be unique")
        spec = {m.name: m for m in self.models}
        for e in self.edges:
            if e.src not in spec or e.dst not in spec:
                raise ValueError(f"edge {e.src}->{e.dst} names an unknown model")
            n_dst, n_src = spec[e.dst].n_requests, spec[e.src].n_requests
            mp = e.request_map
            if mp is None:
                if e.src == e.dst:
                    raise ValueError(f"self-loop on {e.src} needs a request_map")
                if n_src != n_dst:
                    raise ValueError(f"edge {e.src}->{e.dst}: request counts differ ({n_src} vs {n_dst}); "
                                     "give a request_map")
            else:
                if len(mp) != n_dst or any(not -1 <= s < n_src for s in mp):
                    raise ValueError(f"edge {e.src}->{e.dst}: request_map needs {n_dst} indices in [-1, {n_src})")
                if e.src == e.dst and any(s >= j for j, s in enumerate(mp)):
                    raise ValueError(f"self-loop on {e.src}: request j may only follow an earlier request")
        self.topological_order()  # raises on a cycle

    def spec(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def upstream(self, name: str) -> tuple[str, ...]:
        """Models whose outputs ``name`` reads (self-loops excluded)."""
        return tuple(dict.fromkeys(e.src for e in self.edges if e.dst == name and e.src != name))

    def topological_order(self) -> tuple[str, ...]:
        """Models in dependency order, ties in declaration order (self-loops ignored: fused, §4.2)."""
        order: list[str] = []
        left = [m.name for m in self.models]
        while left:
            done = set(order)
            nxt = next((m for m in left if all(u in done for u in self.upstream(m))), None)
            if nxt is None:
                raise ValueError(f"the application graph has a cycle among {left}")
            order.append(nxt)
            left.remove(nxt)
        return tuple(order)


def fuse_self_loops(job: JobGraph) -> tuple[JobGraph, dict[str, np.ndarray]]:
    """SamuLLM §4.2: fuse each self-loop node into one node whose requests become ready dynamically.

    Returns the graph without self-edges and, per model, ``parent[j]`` (the earlier request whose
    output request j waits for, −1 if none) for the simulator to release requests on the fly.
    """
    parents = {m.name: np.full(m.n_requests, -1, dtype=np.int64) for m in job.models}
    for e in job.edges:
        if e.src == e.dst:
            mp = np.asarray(e.request_map, dtype=np.int64)
            parents[e.src] = np.maximum(parents[e.src], mp)  # one self-loop per node is the supported case
    return JobGraph(job.models, tuple(e for e in job.edges if e.src != e.dst)), parents


# --- Devices, plans, stages (§3 Eq. 3–4, §4.3) ---------------------------------------------------


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
        return tuple(self.devices[k * self.tp:(k + 1) * self.tp] for k in range(self.dp)) if self.devices else ()

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
        speedup = tp * self.efficiency ** doublings
        return replace(it, base=it.base + self.allreduce_s * doublings,
                       per_prefill_token=it.per_prefill_token / speedup, per_decode_seq=it.per_decode_seq / speedup,
                       per_context_token=it.per_context_token / speedup)


def iteration_cost(costs: Mapping[str, CostModel], key: str, tp: int,
                   scaling: TensorParallelScaling = TensorParallelScaling()) -> IterationLatency:
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
        return {"start_s": self.start_s, "duration_s": self.duration_s, "plans": [p.to_dict() for p in self.plans],
                "finishes": list(self.finishes), "loads": list(self.loads),
                "model_end_s": {m: (None if math.isinf(s) else s) for m, s in self.model_end_s}}


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
        return {"planner": self.planner, "preemption": self.preemption,
                "known_output_lengths": self.known_output_lengths, "predicted_s": self.predicted_s,
                "search_time_s": self.search_time_s, "stages": [s.to_dict() for s in self.stages]}


@dataclass(frozen=True)
class StageEstimate:
    """The simulator's prediction for one candidate stage: duration (first finish), work rate, per-model ends."""

    duration_s: float
    throughput: float
    model_end_s: Mapping[str, float]


# --- The stage-level simulator ---------------------------------------------------------------------


@dataclass
class _Work:
    """Mutable remaining work of one model between stages (internal to :class:`JobSimulator`)."""

    spec: ModelSpec
    prompt: np.ndarray
    out: np.ndarray       # tokens still to generate
    done: np.ndarray
    resumable: np.ndarray
    parent: np.ndarray
    inputs: list[tuple[str, np.ndarray]]
    longest: int
    cap: Mapping[int, int]  # tp -> max running requests the KV cache allows
    loading: tuple[float, ...] = ()  # per replica of the running plan: load seconds left at the stage start

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

    def __init__(self, job: JobGraph, devices: DeviceSet, costs: Mapping[str, CostModel], *,
                 known_output_lengths: bool = False, seed: int = 0,
                 tp_scaling: TensorParallelScaling = TensorParallelScaling()) -> None:
        self.job, self.devices, self.costs, self.tp_scaling = job, devices, costs, tp_scaling
        fused, parents = fuse_self_loops(job)
        self.order = fused.topological_order()
        self._upstream = {m: fused.upstream(m) for m in self.order}
        self.work = self._initial_work(fused, parents, known_output_lengths, np.random.default_rng(seed))
        self._plans = {m: valid_plans(job.spec(m), devices, self.work[m].longest) for m in self.order}
        self.now_s = 0.0
        self.running: dict[str, ExecutionPlan] = {}
        self._cache: dict[Any, ModelRun] = {}
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

    def _initial_work(self, fused: JobGraph, parents: Mapping[str, np.ndarray], known: bool,
                      rng: np.random.Generator) -> dict[str, _Work]:
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
            work[name] = _Work(spec, prompt, out, np.zeros(n, dtype=bool), np.zeros(n, dtype=bool), par, inputs,
                               max(longest, 1), cap)
        return work

    @staticmethod
    def _truncate(spec: ModelSpec, prompt: np.ndarray, raw: np.ndarray, par: np.ndarray, self_edge: Edge | None
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
        return tuple(m for m in self.unfinished()
                     if all(self.work[u].finished or u in selected for u in self._upstream[m]))

    def placeable(self, plans: Iterable[ExecutionPlan]) -> bool:
        """Whether these plans' tp groups fit the devices' links at once (counts and topology)."""
        sizes = tuple(sorted((p.tp for p in plans for _ in range(p.dp)), reverse=True))
        hit = self._placeable.get(sizes)
        if hit is None:
            hit = sum(sizes) <= self.devices.count and _pack(self.devices, sizes, set()) is not None
            self._placeable[sizes] = hit
        return hit

    def total_work(self, model: str) -> float:
        """Remaining tokens (prompt + output) of ``model`` × its weight bytes: the work unit of throughput."""
        w = self.work[model]
        todo = ~w.done
        return float(w.spec.weight_bytes * (w.prompt[todo].sum() + w.out[todo].sum()))

    # -- simulation --

    def _run(self, plan: ExecutionPlan, runs: Mapping[str, ModelRun], until_s: float = math.inf) -> ModelRun:
        m = plan.model
        w = self.work[m]
        ready = np.zeros(w.spec.n_requests)
        for src, mp in w.inputs:
            if self.work[src].finished:
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
        run = simulate_model(w.prompt[idx], w.out[idx], lat, cfg, plan.dp, ready_s=ready[idx], parent=lp,
                             resumed=w.resumable[idx] if same else None,
                             load_s=load, until_s=until_s)
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
            hit = self._cache.get(key)
            if hit is None:
                hit = self._cache[key] = self._run(plan, runs)
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
        cut = self._runs(stage, until_s=dur * (1 + _EPS) + _EPS)
        loads = tuple(m for m, p in stage.items() if self.running.get(m) is None or self.running[m].shape != p.shape)
        for m, run in cut.items():
            w = self.work[m]
            fin = np.isfinite(run.finish_s) & ~w.done
            if est.model_end_s[m] <= dur * (1 + _EPS) + _EPS:
                fin = ~w.done  # the stage-ending model(s): done by definition
            partial = ~fin & ~w.done & (run.generated > 0)
            w.prompt[partial] += run.generated[partial]
            w.out[partial] -= run.generated[partial]
            w.resumable = run.decoding & ~fin & ~w.done
            w.done = w.done | fin
        for m in self.order:
            w = self.work[m]
            # Set before self.running changes below: _loads reads the plans this stage started from.
            w.loading = tuple(max(0.0, x - dur) for x in self._loads(stage[m])) if m in stage else ()
            if m not in stage:
                w.resumable[:] = False
        start = self.now_s
        self.now_s += dur
        self.running = {m: p for m, p in stage.items() if not self.work[m].finished}
        self._cache.clear()
        return Stage(tuple(stage[m] for m in self.order if m in stage), start, dur,
                     tuple(m for m in self.order if m in stage and self.work[m].finished), loads,
                     tuple((m, est.model_end_s[m]) for m in self.order if m in stage))

    def copy(self) -> JobSimulator:
        """An independent copy (for exhaustive search in tests and what-if questions)."""
        new = object.__new__(JobSimulator)
        new.__dict__.update(self.__dict__)
        new.work = {m: replace(w, prompt=w.prompt.copy(), out=w.out.copy(), done=w.done.copy(),
                               resumable=w.resumable.copy()) for m, w in self.work.items()}
        new.running = dict(self.running)
        new._cache = {}
        return new


# --- Device choice (§4.3) -----------------------------------------------------------------------


def _pack(devices: DeviceSet, sizes: Sequence[int], taken: set[int],
          prefer: Sequence[Collection[int]] | None = None) -> list[tuple[int, ...]] | None:
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

        def score(g: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
            broken = sum(1 for d in g for e in free if e not in g and devices.links is not None
                         and devices.linked(d, e))
            return -len(want.intersection(g)), broken, g

        best = min(devices.groups(sizes[i], free), key=score, default=None)
        if best is None:
            return None
        chosen[i] = best
        taken.update(best)
    return chosen  # type: ignore[return-value]


def assign_devices(plans: Sequence[ExecutionPlan], devices: DeviceSet,
                   previous: Sequence[ExecutionPlan] = (),
                   reload_s: Mapping[str, float] | None = None) -> tuple[ExecutionPlan, ...]:
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
        groups = _pack(devices, sizes, taken, prefer)
        if groups is None:
            continue
        it = iter(groups)
        placed = {p.model: tuple(d for _ in range(p.dp) for d in next(it)) for p in rest}
        return tuple(replace(p, devices=prev[p.model].devices if p.model in kept else placed[p.model])
                     for p in plans)
    raise ValueError(f"no linked placement on {devices.count} devices for {[p.shape for p in plans]}")


def _place_stages(stages: Sequence[Stage], devices: DeviceSet, job: JobGraph) -> tuple[Stage, ...]:
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


# --- Stage selection: Algorithm 1 and the §5 baselines -----------------------------------------------


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
                if gain > _EPS * max(thr, 1.0) and (best is None or gain > best[0]):
                    best = (gain, cand, n_used, c_thr)
        if best is None:
            break
        _, stage, used, thr = best
    return tuple(stage[m] for m in sim.order if m in stage)


def _fastest(sim: JobSimulator, base: Mapping[str, ExecutionPlan], model: str, max_devices: int
             ) -> ExecutionPlan | None:
    best, best_end = None, math.inf
    for p in sim.plans(model):
        if p.n_devices > max_devices or not sim.placeable([*base.values(), p]):
            continue
        end = sim.estimate([*base.values(), p]).model_end_s[model]
        if end < best_end * (1 - _EPS):
            best, best_end = p, end
    return best


def select_max(sim: JobSimulator, preemption: bool = True) -> tuple[ExecutionPlan, ...]:
    """Max-heuristic (SamuLLM §5): all devices to one model at a time, in topological order, with
    the plan the cost model predicts fastest for it. Preemption makes no difference (§5.5)."""
    for m in sim.ready():
        p = _fastest(sim, {}, m, sim.devices.count)
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
    for k in range(min(len(cands), free), 0, -1):
        share = [free // k + (1 if i < free % k else 0) for i in range(k)]
        stage = dict(fixed)
        for m, s in zip(cands[:k], share):
            p = _fastest(sim, stage, m, s)
            if p is None:
                break
            stage[m] = p
        else:
            return tuple(stage[m] for m in sim.order if m in stage)
    return tuple(fixed[m] for m in sim.order if m in fixed)


Selector = Callable[[JobSimulator, bool], Sequence[ExecutionPlan]]


class StagePlanner:
    """Plans a whole job: select a stage, commit it, repeat until every model is done (§4.2 outer loop).

    Shared by ``greedy``, ``max`` and ``min`` (registry kind ``stages``); ``preemption=False`` is
    the no-preemption variant and ``known_output_lengths=True`` the variant of §5.5 that plans with
    the true output lengths (``ModelSpec.output_tokens``) instead of sampled ones.
    """

    name = ""
    selector: Selector = staticmethod(select_greedy)

    def __init__(self, preemption: bool = True, known_output_lengths: bool = False, seed: int = 0,
                 tp_scaling: TensorParallelScaling | None = None) -> None:
        self.preemption = preemption
        self.known_output_lengths = known_output_lengths
        self.seed = seed
        self.tp_scaling = tp_scaling or TensorParallelScaling()

    def simulator(self, job: JobGraph, devices: DeviceSet, costs: Mapping[str, CostModel]) -> JobSimulator:
        return JobSimulator(job, devices, costs, known_output_lengths=self.known_output_lengths, seed=self.seed,
                            tp_scaling=self.tp_scaling)

    def plan(self, job: JobGraph, devices: DeviceSet, costs: Mapping[str, CostModel]) -> Plan:
        """The stage sequence for ``job`` on ``devices`` with device ids chosen, and its predicted time."""
        t0 = time.perf_counter()  # reported as search time only; no decision depends on it
        sim = self.simulator(job, devices, costs)
        for m in sim.unfinished():
            if not sim.plans(m):
                raise ValueError(f"model {m!r} fits no (dp, tp) plan on {devices.count} device(s) of "
                                 f"{devices.memory_bytes:.3g} bytes")
        stages = []
        while not sim.done:
            chosen = type(self).selector(sim, self.preemption)
            if not chosen:
                raise ValueError(f"no stage can run the unfinished models {list(sim.unfinished())}")
            stages.append(sim.advance(chosen))
        placed = _place_stages(stages, devices, job)
        return Plan(placed, sim.now_s, time.perf_counter() - t0, self.name, self.preemption,
                    self.known_output_lengths)


@register("stages", "greedy")
class GreedyStages(StagePlanner):
    """SamuLLM's planner: Algorithm 1 per stage (:func:`select_greedy`)."""

    name = "greedy"
    selector = staticmethod(select_greedy)


@register("stages", "max")
class MaxStages(StagePlanner):
    """Max-heuristic baseline (:func:`select_max`)."""

    name = "max"
    selector = staticmethod(select_max)


@register("stages", "min")
class MinStages(StagePlanner):
    """Min-heuristic baseline (:func:`select_min`)."""

    name = "min"
    selector = staticmethod(select_min)


@register("stages", "best")
class BestStages(StagePlanner):
    """Greedy with the heuristics as candidates: plans with ``greedy``, ``max`` and ``min`` and keeps
    the plan with the lowest predicted time; the search time is all three searches.

    Not in SamuLLM: Algorithm 1 is itself a heuristic, and on a chain it can pick a plan its own
    cost model predicts slower than Min's (it ranks a stage by work rate per added device, so a
    model load hidden behind another model's run never counts in its favour; see
    docs/benchmarks.md). Taking the best predicted plan makes the planner never worse than a
    heuristic under its own model, at about twice greedy's search time. ``Plan.planner`` names
    the candidate kept, as ``best:<name>``.
    """

    name = "best"
    candidates: tuple[type[StagePlanner], ...] = (GreedyStages, MaxStages, MinStages)

    def plan(self, job: JobGraph, devices: DeviceSet, costs: Mapping[str, CostModel]) -> Plan:
        t0 = time.perf_counter()
        plans, errors = [], []
        for cls in self.candidates:
            try:
                plans.append(cls(self.preemption, self.known_output_lengths, self.seed, self.tp_scaling)
                             .plan(job, devices, costs))
            except ValueError as exc:  # a candidate that finds no plan leaves the others
                errors.append(exc)
        if not plans:
            raise errors[0]
        kept = min(plans, key=lambda p: p.predicted_s)  # ties: the earlier candidate (greedy first)
        return replace(kept, search_time_s=time.perf_counter() - t0, planner=f"best:{kept.planner}")


# --- Dynamic adjustment in the running phase (§4.3) --------------------------------------------------


@dataclass(frozen=True)
class Adjustment:
    """What to run now: ``run`` (with devices), the planned stage reached, and what changed."""

    stage_index: int
    run: tuple[ExecutionPlan, ...]
    started: tuple[str, ...]
    stopped: tuple[str, ...]


def adjust_stage(plan: Plan, stage_index: int, running: Sequence[ExecutionPlan], finished: Collection[str],
                 job: JobGraph, devices: DeviceSet) -> Adjustment:
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
        later = [s.plan_of(p.model) for s in stages[stage_index + 1:]]
        nxt = stages[stage_index + 1].plan_of(p.model) if stage_index + 1 < len(stages) else None
        if all(q is None for q in later) or (nxt is not None and nxt.shape == p.shape):
            keep[p.model] = p
        else:
            tentative.append(p)
    new: dict[str, ExecutionPlan] = {}
    reached = stage_index

    def free() -> int:
        return (devices.count - sum(p.n_devices for p in keep.values()) - sum(p.n_devices for p in new.values())
                - sum(p.n_devices for p in tentative))

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


# --- Executing a plan against true output lengths (§4.3 runtime, §5 "inference time") ------------------


@dataclass(frozen=True)
class Replay:
    """A plan executed in simulation against the true output lengths: the time it took and what ran.

    ``stages`` has one entry per stretch between two model finishes, as actually run after the
    adjustments; ``fallbacks`` counts stretches where the adjusted set could not progress and the
    ready models ran one at a time on every device instead (what the runtime does then).
    """

    actual_s: float
    stages: tuple[Stage, ...]
    fallbacks: int = 0


def _progressing(sim: JobSimulator, run: Sequence[ExecutionPlan]) -> list[ExecutionPlan]:
    """The plans of ``run`` whose inputs are ready within the set, if one of them can finish; else []."""
    plans = {p.model: p for p in run if p.model in sim.unfinished()}
    while True:  # dropping a model can strand its downstream: repeat until stable
        ready = set(sim.ready(plans))
        kept = {m: p for m, p in plans.items() if m in ready}
        if len(kept) == len(plans):
            break
        plans = kept
    if not plans or not math.isfinite(sim.estimate(plans.values()).duration_s):
        return []
    return [plans[m] for m in sim.order if m in plans]


def replay_plan(plan: Plan, job: JobGraph, devices: DeviceSet, costs: Mapping[str, CostModel],
                tp_scaling: TensorParallelScaling = TensorParallelScaling()) -> Replay:
    """Run ``plan`` in simulation with the true output lengths (``ModelSpec.output_tokens``), no new search.

    This is the running phase of SamuLLM §4.3 with the simulator as the engines: whenever a model
    finishes, :func:`adjust_stage` decides what runs next from the plan, exactly as the Ray runtime
    does, and :meth:`JobSimulator.advance` runs that set (reloads, kept KV caches, pipelined inputs
    as in planning) until the next model finishes. A plan searched with sampled lengths thus meets
    the lengths it did not see; its ``actual_s`` is SamuLLM's inference time (§5), and for a plan
    searched with the true lengths (§5.5) it equals the prediction unless the adjustment deviates.
    """
    sim = JobSimulator(job, devices, costs, known_output_lengths=True, tp_scaling=tp_scaling)
    index, running, stages, fallbacks = -1, (), [], 0
    while not sim.done:
        finished = {m.name for m in job.models if m.name not in sim.unfinished()}
        adj = adjust_stage(plan, index, running, finished, job, devices)
        index, running = adj.stage_index, adj.run
        run = _progressing(sim, adj.run)
        if not run:  # nothing in the adjusted set can finish: the runtime's fallback (Max heuristic)
            fallbacks += 1
            run = list(select_max(sim))
            running = tuple(assign_devices(run, devices))
        stages.append(sim.advance(run))
    return Replay(sim.now_s, tuple(stages), fallbacks)
