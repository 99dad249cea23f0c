"""An offline job: its models, their requests and the DAG of edges between them (SamuLLM §3, §4.2)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planners.offline.engine_sim import EngineLimits


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
    engine: EngineLimits = EngineLimits()

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
                    raise ValueError(
                        f"edge {e.src}->{e.dst}: request counts differ ({n_src} vs {n_dst}); give a request_map"
                    )
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
