"""The request-scheduling simulator of one vLLM engine and of one model's replicas (SamuLLM §2, §4.1, Eq. 5)."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from planners.costs import CostModel, IterationLatency

EPS = 1e-9


@dataclass(frozen=True)
class EngineLimits:
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


def simulate_engine(
    prompt_tokens: Sequence[int] | np.ndarray,
    output_tokens: Sequence[int] | np.ndarray,
    latency: CostModel | IterationLatency,
    config: EngineLimits = EngineLimits(),
    *,
    ready_s: Sequence[float] | np.ndarray | None = None,
    parent: Sequence[int] | np.ndarray | None = None,
    resumed: Sequence[bool] | np.ndarray | None = None,
    start_s: float = 0.0,
    until_s: float = math.inf,
    record: bool = False,
) -> EngineRun:
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
        raise ValueError(
            f"a prompt of {int(p.max())} tokens never fits max_batched_tokens="
            f"{config.max_batched_tokens} without chunked prefill"
        )
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

    # Python lists in the loop: a numpy scalar read or write per request costs more than the simulation step.
    finish = [math.inf] * n
    gen = [0] * n
    readyl, parl = ready.tolist(), par.tolist()
    children: dict[int, list[int]] = {}
    for j in np.flatnonzero(par >= 0).tolist():
        children.setdefault(parl[j], []).append(j)
    t, g, iters, busy, tokens = float(start_s), 0, 0, 0.0, 0
    dec: list[tuple[int, int]] = []  # (g at which the request finishes, request)
    n_dec, ctx = 0, 0
    for j in np.flatnonzero(res & (par < 0)).tolist():
        if n_dec < cap and ready[j] <= t:
            heapq.heappush(dec, (ol[j], j))  # ol[j] more decode iterations
            n_dec += 1
            ctx += pl[j]
    in_dec = {j for _, j in dec}
    waiting = [(r if r > t else t, j) for j, r in enumerate(readyl) if parl[j] < 0 and r < math.inf and j not in in_dec]
    heapq.heapify(waiting)
    prefilling: deque[list[int]] = deque()
    curve_s, curve_tok = [t], [0]
    segs: list[IterationSegment] = []

    def release(j: int, at: float) -> None:
        for c in children.get(j, ()):
            heapq.heappush(waiting, (max(readyl[c], at), c))

    def retire(at: float, step: int) -> tuple[int, int]:
        """Finish, at ``at``, every decode whose last iteration is ``step`` or earlier; the context
        tokens and sequences they free."""
        freed_ctx = freed = 0
        while dec and dec[0][0] <= step:
            _, j = heapq.heappop(dec)
            finish[j], gen[j] = at, ol[j]
            freed_ctx += pl[j] + ol[j]
            freed += 1
            release(j, at)
        return freed_ctx, freed

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
            freed_ctx, freed = retire(t, g)
            ctx -= freed_ctx
            n_dec -= freed
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
        freed_ctx, freed = retire(t, g)
        ctx -= freed_ctx
        n_dec -= freed
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
    return EngineRun(
        iters,
        busy,
        t,
        np.asarray(finish, dtype=float),
        np.asarray(gen, dtype=np.int64),
        decoding,
        np.asarray(curve_s),
        np.asarray(curve_tok, dtype=float),
        tuple(segs),
    )


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


def simulate_model(
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    latency: CostModel | IterationLatency,
    config: EngineLimits = EngineLimits(),
    dp: int = 1,
    *,
    ready_s: np.ndarray | None = None,
    parent: np.ndarray | None = None,
    resumed: np.ndarray | None = None,
    load_s: float | Sequence[float] = 0.0,
    until_s: float = math.inf,
    record: bool = False,
) -> ModelRun:
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
        run = simulate_engine(
            p[idx],
            o[idx],
            latency,
            config,
            ready_s=ready[idx],
            parent=lp,
            resumed=res[idx],
            start_s=loads[k],
            until_s=until_s,
            record=record,
        )
        finish[idx], gen[idx], decoding[idx] = run.finish_s, run.generated, run.decoding
        runs.append(run)
    end = float(finish.max()) if n else 0.0
    return ModelRun(max(end, min(loads)), finish, gen, decoding, tuple(runs))
