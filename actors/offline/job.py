"""Offline multi-LLM jobs: the YAML job spec, the workloads it names, and their translation to the stage planner.

A job (SamuLLM §3) is a set of models, an application graph over them and an input file. The
graph is one of the shapes SamuLLM evaluates (§5.1) or explicit edges:

- ``ensemble``: every model answers every input prompt;
- ``routing``: a routing file names the model that answers each input (uneven splits, Table 1);
- ``chain_summary``: each document is cut into chunks; a summarizer reads chunk k with its own
  summary of chunks < k (a self-loop), and an evaluator reads each document's final summary;
- ``edges``: explicit ``[src, dst]`` pairs over the inputs (request j of ``dst`` reads request j
  of ``src``); a self-loop ``[m, m]`` makes request j of ``m`` read its request j − 1;
- ``mixed``: several of the above in one job, each with its own models and input (SamuLLM §5.4
  runs chain summary and ensembling together): ``parts``, planned and run as one graph.

:func:`build_workload` turns a job into per-model requests (ids and own text) plus planner edges,
and :func:`job_graph` into :class:`planners.offline.JobGraph` with token counts from each model's
own tokenizer. Nothing here runs a model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from planners.offline import Edge, EngineLimits, JobGraph, ModelSpec, chain_maps

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]*$"


class _JobSpecPart(BaseModel):
    """A part of an offline job spec: an unknown key is an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class EmbeddedSpec(_JobSpecPart):
    """A tiny Llama the project builds itself (no model hub here): hidden size, layers, seed."""

    hidden_size: int = Field(256, ge=64, multiple_of=64)
    layers: int = Field(4, ge=1)
    seed: int = 0


class JobModel(_JobSpecPart):
    name: str = Field(pattern=NAME_PATTERN)
    path: str | None = Field(None, description="A local HF model directory; null: build the embedded model below.")
    embedded: EmbeddedSpec = Field(default_factory=EmbeddedSpec)
    max_output_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.8, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 0
    template: str = Field(
        "{prompt}",
        description="This model's prompt: {prompt} is its own text (input, chunk), {upstream} the "
        "output it reads over an edge (empty when none).",
    )
    load_s: float | None = Field(
        None,
        gt=0,
        description="Seconds this model's engine takes to start (its row "
        "of SamuLLM §4.1's load-time table); null: engine_load_s.",
    )

    def local_dir(self, data_dir: Path) -> Path:
        """The model's directory on this host; an embedded model is built into ``data_dir`` on first use.

        Each process that loads the model calls this on its own host (the driver for planning, each
        engine actor for serving), so no node needs a path another node made.
        """
        if self.path:
            return Path(self.path).expanduser()
        from actors.models.default_model import TinyLlamaSpec, ensure

        e = self.embedded
        return ensure(
            data_dir,
            TinyLlamaSpec(
                hidden_size=e.hidden_size,
                num_layers=e.layers,
                num_heads=e.hidden_size // 64,
                intermediate_size=3 * e.hidden_size,
                seed=e.seed,
            ),
        )


class DevicesSpec(_JobSpecPart):
    count: int = Field(1, ge=1)
    memory_gb: float = Field(4.0, gt=0, description="Memory of one device (host memory share on CPU).")
    links: list[tuple[int, int]] | None = Field(None, description="Linked pairs (e.g. NVLink); null: all linked.")
    tp_options: list[int] = Field(
        [1], min_length=1, description="Tensor-parallel degrees a model may use (vLLM on CPU: 1 only)."
    )
    bundle: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="Ray resources of one device: the job reserves one placement-group bundle of these per "
        "device before it starts, e.g. {GPU: 1, CPU: 4} on a GPU host.",
    )

    @model_validator(mode="after")
    def _bundle(self) -> DevicesSpec:
        if not self.bundle or any(v < 0 for v in self.bundle.values()) or not any(self.bundle.values()):
            raise ValueError(f"devices.bundle must name some positive resources, got {self.bundle}")
        return self


class AppSpec(_JobSpecPart):
    kind: Literal["ensemble", "routing", "chain_summary", "edges", "mixed"]
    routing_file: str | None = Field(None, description="routing: JSONL of {id, model}.")
    summarizer: str | None = Field(None, description="chain_summary: the model that summarizes chunk by chunk.")
    evaluator: str | None = Field(None, description="chain_summary: the model that reads each final summary.")
    chunk_chars: int = Field(2000, ge=1, description="chain_summary: characters per chunk.")
    max_chunks: int | None = Field(None, ge=1, description="chain_summary: keep at most this many chunks per document.")
    edges: list[tuple[str, str]] = Field(default_factory=list, description="edges: [src, dst] pairs.")
    parts: list[PartSpec] = Field(default_factory=list, description="mixed: the sub-applications.")


class PartSpec(_JobSpecPart):
    """One sub-application of a ``mixed`` job: its own models (a subset, disjoint from other parts'),
    input file and graph; the input fields default to the job's."""

    models: list[str] = Field(min_length=1)
    input: str
    app: AppSpec
    text_field: str | None = None
    id_field: str | None = None
    max_inputs: int | None = Field(None, ge=1)


AppSpec.model_rebuild()


class JobSpec(_JobSpecPart):
    """What ``python -m app.offline plan|run JOB.yaml`` reads."""

    name: str = Field(pattern=NAME_PATTERN)
    models: list[JobModel] = Field(min_length=1)
    app: AppSpec
    input: str | None = Field(
        None,
        description="JSONL of {id, prompt} (chain_summary: {id, text}); relative to the "
        "job file. Required except for app.kind mixed (each part has one).",
    )
    text_field: str | None = Field(
        None, description="The input field with the text; default prompt (text for chain_summary)."
    )
    id_field: str = "id"
    max_inputs: int | None = Field(None, ge=1, description="Use only the first N input rows.")
    devices: DevicesSpec = Field(default_factory=DevicesSpec)
    output_dir: str = Field("offline-out", description="Outputs, plan.json, summary; relative to the job file.")
    output_lengths_file: str | None = Field(
        None, description="JSONL of {prompt, response} (e.g. ShareGPT) for the output-length eCDF (SamuLLM §4.1)."
    )
    max_num_seqs: int = Field(32, ge=1, description="Engine batch limit of every replica.")
    engine_load_s: float = Field(
        30.0,
        gt=0,
        description="Seconds an engine takes to start, for models without their own load_s (SamuLLM "
        "§4.1's load-time table). 30: a vLLM CPU engine here; measure yours (bench/offline.py "
        "real does).",
    )
    max_model_len: int = Field(2048, ge=16)
    enforce_eager: bool = Field(
        False,
        description="Skip vLLM's graph compilation: faster engine start, slower "
        "iterations (for short demo and test jobs).",
    )
    planner: str = Field(
        "search",
        description="The stage planner (registry kind stages): search (ours), or the "
        "baselines greedy (SamuLLM Alg. 1), max, min; --planner overrides.",
    )
    preemption: bool = Field(
        True, description="Let a stage boundary change a running model's plan; --no-preemption overrides."
    )

    @model_validator(mode="after")
    def _graph_names(self) -> JobSpec:
        from planners.registry import names

        if self.planner not in names("stages"):
            raise ValueError(f"planner {self.planner!r} is not one of {names('stages')}")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique: {names}")
        known = set(names)
        a = self.app
        if a.kind == "routing" and not a.routing_file:
            raise ValueError("app.kind routing needs app.routing_file")
        if a.kind == "chain_summary":
            for role in ("summarizer", "evaluator"):
                if getattr(a, role) not in known:
                    raise ValueError(f"app.{role} must name one of the models {names}")
        for src, dst in a.edges:
            if src not in known or dst not in known:
                raise ValueError(f"app.edges: [{src}, {dst}] names an unknown model; models: {names}")
        if a.kind == "edges" and not a.edges:
            raise ValueError("app.kind edges needs app.edges")
        if a.kind == "mixed":
            self._check_parts(names)
        elif a.parts:
            raise ValueError("app.parts is for app.kind mixed only")
        elif not self.input:
            raise ValueError(f"app.kind {a.kind} needs an input file")
        return self

    def _check_parts(self, names: list[str]) -> None:
        if not self.app.parts:
            raise ValueError("app.kind mixed needs app.parts")
        seen: dict[str, int] = {}
        for i, part in enumerate(self.app.parts):
            if part.app.kind == "mixed":
                raise ValueError(f"app.parts[{i}]: a part cannot itself be mixed")
            for m in part.models:
                if m not in names:
                    raise ValueError(f"app.parts[{i}]: unknown model {m!r}; models: {names}")
                if m in seen:
                    raise ValueError(
                        f"app.parts[{i}]: model {m!r} is already in part {seen[m]}; a model node "
                        "belongs to one part (give a second copy another name)"
                    )
                seen[m] = i
        unused = [m for m in names if m not in seen]
        if unused:
            raise ValueError(f"models in no part of the mixed job: {unused}")
        self.part_jobs()  # each part must be a valid job on its own

    def part_jobs(self) -> list[JobSpec]:
        """Each part of a ``mixed`` job as a job of its own (same settings, its models, input and graph)."""
        out = []
        for part in self.app.parts:
            spec = self.model_dump()
            spec.update(
                models=[m for m in spec["models"] if m["name"] in part.models],
                app=part.app.model_dump(),
                input=part.input,
                text_field=part.text_field or self.text_field,
                id_field=part.id_field or self.id_field,
                max_inputs=part.max_inputs or self.max_inputs,
            )
            out.append(JobSpec.model_validate(spec))
        return out


def load_job(path: str | Path) -> tuple[JobSpec, Path]:
    """The validated job and the directory its relative paths are read from."""
    path = Path(path)
    return JobSpec.model_validate(yaml.safe_load(path.read_text())), path.resolve().parent


# ---- workloads ---------------------------------------------------------------------------------


@dataclass
class NodeRequests:
    """The requests of one model node: stable ids (for resume) and each request's own text."""

    model: str
    ids: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


@dataclass
class Workload:
    nodes: dict[str, NodeRequests]
    edges: list[Edge]

    def reads(self, model: str) -> list[Edge]:
        """The edges whose outputs ``model``'s prompts include (self-loop included)."""
        return [e for e in self.edges if e.dst == model]


def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise ValueError(f"{path}:{n}: not JSON: {exc}") from None
            if limit is not None and len(rows) >= limit:
                break
    return rows


def build_workload(job: JobSpec, base_dir: Path) -> Workload:
    """Per-model requests and the planner's edges for ``job`` (reads the input and routing files)."""
    if job.app.kind == "mixed":  # the parts' graphs side by side: disjoint models, so nothing collides
        parts = [build_workload(sub, base_dir) for sub in job.part_jobs()]
        nodes = {name: n for w in parts for name, n in w.nodes.items()}
        return Workload({m.name: nodes[m.name] for m in job.models}, [e for w in parts for e in w.edges])
    a = job.app
    text_field = job.text_field or ("text" if a.kind == "chain_summary" else "prompt")
    rows = read_jsonl(base_dir / job.input, job.max_inputs)
    if not rows:
        raise ValueError(f"{job.input}: no input rows")
    for i, r in enumerate(rows):
        if not isinstance(r.get(text_field), str) or job.id_field not in r:
            raise ValueError(f"{job.input} row {i}: needs a string {text_field!r} and an {job.id_field!r}")
    ids = [str(r[job.id_field]) for r in rows]
    texts = [r[text_field] for r in rows]
    names = [m.name for m in job.models]
    nodes = {n: NodeRequests(n) for n in names}
    edges: list[Edge] = []
    if a.kind in ("ensemble", "edges"):
        for n in names:
            nodes[n].ids, nodes[n].texts = list(ids), list(texts)
        for src, dst in a.edges:
            if src == dst:  # request j continues from request j − 1 of the same model
                edges.append(Edge(src, dst, tuple(range(-1, len(ids) - 1))))
            else:
                edges.append(Edge(src, dst))
    elif a.kind == "routing":
        routes = {str(r["id"]): r["model"] for r in read_jsonl(base_dir / a.routing_file)}
        for i, t in zip(ids, texts):
            model = routes.get(i)
            if model not in nodes:
                raise ValueError(f"{a.routing_file}: input {i!r} is routed to {model!r}, not one of {names}")
            nodes[model].ids.append(i)
            nodes[model].texts.append(t)
    else:  # chain_summary
        chunks = [chunk_text(t, a.chunk_chars)[: a.max_chunks] for t in texts]
        summ, ev = nodes[a.summarizer], nodes[a.evaluator]
        for doc_id, parts in zip(ids, chunks):
            summ.ids += [f"{doc_id}#{k}" for k in range(len(parts))]
            summ.texts += parts
            ev.ids.append(doc_id)
            ev.texts.append("")
        parents, last = chain_maps([len(p) for p in chunks])
        edges += [Edge(a.summarizer, a.summarizer, parents), Edge(a.summarizer, a.evaluator, last)]
    empty = [n for n in names if not nodes[n].ids]
    if empty:
        raise ValueError(f"models with no requests: {empty} (check the routing file or the app kind)")
    return Workload(nodes, edges)


def chunk_text(text: str, chunk_chars: int) -> list[str]:
    """Cut ``text`` into pieces of about ``chunk_chars`` characters, at a line or word break when one is near."""
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + chunk_chars)
        if end < len(text):
            cut = max(text.rfind("\n", start, end), text.rfind(" ", start, end))
            if cut > start + chunk_chars // 2:
                end = cut + 1
        out.append(text[start:end])
        start = end
    return out or [""]


def render_prompt(template: str, text: str, upstream: str = "") -> str:
    """A model's prompt from its template, its own text and the upstream output it reads."""
    return template.replace("{prompt}", text).replace("{upstream}", upstream)


# ---- the planner's view ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """What planning needs to know of a model checkpoint, read from its directory."""

    weight_bytes: float
    kv_bytes_per_token: float
    max_position_embeddings: int


def model_facts(model_dir: Path) -> ModelFacts:
    """Weights from the safetensors files; KV bytes per token = 2 · layers · kv heads · head dim · dtype bytes."""
    cfg = json.loads((model_dir / "config.json").read_text())
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) or float(cfg.get("num_parameters", 1))
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(cfg.get("dtype") or cfg.get("torch_dtype"), 2)
    kv = 2 * cfg["num_hidden_layers"] * heads * head_dim * dtype_bytes
    return ModelFacts(float(weights), float(kv), int(cfg.get("max_position_embeddings", 2048)))


def job_graph(
    job: JobSpec,
    work: Workload,
    facts: dict[str, ModelFacts],
    count_tokens: dict[str, Callable[[str], int]],
    load_s: dict[str, float] | None = None,
) -> JobGraph:
    """The planner's graph: per model its prompt lengths (template filled, upstream output excluded:
    the planner adds the sampled upstream length), memory facts and load time."""
    specs = []
    for m in job.models:
        n = work.nodes[m.name]
        f = facts[m.name]
        prompts = tuple(max(1, count_tokens[m.name](render_prompt(m.template, t))) for t in n.texts)
        specs.append(
            ModelSpec(
                name=m.name,
                weight_bytes=f.weight_bytes,
                prompt_tokens=prompts,
                max_output_tokens=m.max_output_tokens,
                kv_bytes_per_token=f.kv_bytes_per_token,
                max_seq_len=min(job.max_model_len, f.max_position_embeddings),
                load_time_s=((1, (load_s or {}).get(m.name, 0.0)),),
                tp_options=tuple(job.devices.tp_options),
                engine=EngineLimits(max_num_seqs=job.max_num_seqs, max_batched_tokens=max(2048, job.max_model_len)),
            )
        )
    return JobGraph(tuple(specs), tuple(work.edges))


def weight_scale(facts: ModelFacts, reference: ModelFacts) -> float:
    """How much slower per token a model is than the profiled reference, taken as the ratio of weight bytes."""
    return max(facts.weight_bytes / reference.weight_bytes, 1e-3) if reference.weight_bytes > 0 else 1.0


def remaining_workload(work: Workload, done: dict[str, set[str]]) -> tuple[Workload, dict[str, list[int]]]:
    """The part of ``work`` still to run (resume), and per model the kept requests' indices in ``work``.

    Models with every request done drop out; an edge into a kept request whose source request is
    done maps to −1 (its output already exists, nothing to wait for), others are renumbered.
    """
    keep = {m: [j for j, i in enumerate(n.ids) if i not in done.get(m, set())] for m, n in work.nodes.items()}
    keep = {m: k for m, k in keep.items() if k}
    nodes = {
        m: NodeRequests(m, [work.nodes[m].ids[j] for j in k], [work.nodes[m].texts[j] for j in k])
        for m, k in keep.items()
    }
    edges = []
    for e in work.edges:
        if e.src not in keep or e.dst not in keep:
            continue
        new_index = {j: r for r, j in enumerate(keep[e.src])}
        src_of = (lambda j: j) if e.request_map is None else e.request_map.__getitem__
        edges.append(
            Edge(
                e.src,
                e.dst,
                tuple(new_index.get(src_of(j), -1) if src_of(j) >= 0 else -1 for j in keep[e.dst]),
                e.carries_output,
            )
        )
    return Workload(nodes, edges), keep
