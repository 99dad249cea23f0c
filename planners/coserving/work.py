"""The work one node's co-serving scheduler weighs: the engine's requests, fine-tune samples, token windows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from planners.costs import CostModel

WorkKind = Literal["prefill", "decode", "ft"]
SampleOutcome = Literal["requeued", "retired"]


@dataclass
class FineTuneSample:
    """One fine-tune sample: ``tokens`` = L, the tokens one training pass over it processes.

    ``arrival`` is MACE's t_arr (reset when CheckEnd requeues the sample); ``dpo_loss`` its last
    DPO loss (0 until the trainer reports one; for an SFT sample its mean token NLL, which takes
    L_DPO's place in MACE §4.1's γ·L_DPO term); ``done`` the tokens of the current pass already
    processed in earlier windows (FlexLLM §6.1); ``passes`` completed passes.
    """

    sample_id: str
    tokens: int
    arrival: float
    dpo_loss: float = 0.0
    done: int = 0
    passes: int = 0
    forward_tokens: int | None = None
    """F: the pass is F tokens forward, then its backward as tokens [F, tokens) (FlexLLM §6.1: the window spans
    both; ``WindowedPass``: tokens = 2·F). None: every window carries its own forward and the window that
    completes the pass the whole backward (the trainer's earlier pass, and the simulator's samples)."""

    @property
    def remaining(self) -> int:
        return self.tokens - self.done


@dataclass(frozen=True)
class LiveRequest:
    """One inference request in flight on a replica, as the replica reports it.

    With no output token yet it waits for (or is in) its prefill; after that it decodes.
    """

    request_id: str
    prompt_tokens: int
    output_tokens: int
    arrival: float
    max_tokens: int

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class EngineIteration:
    """One engine step as its replica saw it: when its tokens reached the replica, and what the step computed.

    ``at`` is the wall time (``time.time()``) at which vLLM's output handler recorded the step, the
    moment its new tokens go out to the requests' streams; ``elapsed_s`` the step's own time in the
    engine core; ``gap_s`` the time since the previous step's tokens went out: for each of the
    ``decode_seqs`` requests that decoded in this step it is their time between tokens (None for the
    first step the replica saw).
    """

    at: float
    elapsed_s: float
    prefill_tokens: int
    decode_seqs: int
    gap_s: float | None = None


@dataclass(frozen=True)
class EngineFacts:
    """What a replica reports of its engine: the requests in flight, iterations so far, KV cache in use.

    A request with no output token yet is waiting for (or in) its prefill; the others decode.
    ``iterations`` counts engine steps since the engine started (monotonic), ``kv_cache_usage``
    is vLLM's fraction of KV blocks in use, ``kv_cache_bytes`` the KV cache's size.
    ``steps_with_waiting`` counts the engine steps after which vLLM's waiting queue still held a
    request (one that step did not start: ``max_num_seqs`` reached, no token budget or KV blocks
    left), since the engine started; ``waiting_peak`` is the most requests that queue held after
    any step. They measure how often request order inside vLLM could matter at all
    (docs/coserving.md, "Admission by priority: measured, then removed"). ``iteration_log`` holds the
    engine steps since the replica's previous report, each with its time between tokens: what the
    planner compares with each fine-tuning window's prediction and counts against the SLOs.
    """

    at: float
    requests: tuple[LiveRequest, ...] = ()
    iterations: int = 0
    kv_cache_usage: float = 0.0
    kv_cache_bytes: float = 0.0
    steps_with_waiting: int = 0
    waiting_peak: int = 0
    iteration_log: tuple[EngineIteration, ...] = ()

    @property
    def kv_used_bytes(self) -> float:
        return self.kv_cache_usage * self.kv_cache_bytes


@dataclass(frozen=True)
class InferenceWork:
    """c of FlexLLM §6.2: the inference work of one window, in the terms of SamuLLM Eq. 5."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0

    @property
    def empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_seqs == 0

    def plus_prefill(self, tokens: int) -> InferenceWork:
        return InferenceWork(self.prefill_tokens + tokens, self.decode_seqs, self.context_tokens)

    def plus_decode(self, context_tokens: int) -> InferenceWork:
        return InferenceWork(self.prefill_tokens, self.decode_seqs + 1, self.context_tokens + context_tokens)

    def latency(self, cost: CostModel) -> float:
        """t_iter(c): one engine iteration over this work; 0 when there is none (the engine idles)."""
        if self.empty:
            return 0.0
        return cost.iteration_latency(self.prefill_tokens, self.decode_seqs, self.context_tokens)


# --- Token-level windows (FlexLLM §6.1) ---------------------------------------------------------


@dataclass(frozen=True)
class TokenWindow:
    """Tokens [start, end) of a sample of ``length`` tokens, run as one slice (FlexLLM §6.1, Alg. 2)."""

    sample_id: str
    start: int
    end: int
    length: int
    forward_tokens: int | None = None
    """As :attr:`FineTuneSample.forward_tokens`: [0, F) of the pass is forward, [F, length) backward."""

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def completes_pass(self) -> bool:
        """The last window of the sequence: after it the accumulated gradient equals the full-sequence one."""
        return self.end >= self.length

    @property
    def phases(self) -> tuple[int, int]:
        """(forward tokens, backward tokens) the window runs: for a pass without phases, its tokens forward and,
        when it completes the pass, the whole sample's backward."""
        f = self.forward_tokens
        if f is None:
            return self.tokens, self.length if self.completes_pass and self.tokens > 0 else 0
        return max(0, min(self.end, f) - self.start), max(0, self.end - max(self.start, f))


def token_windows(length: int, grants: Iterable[int], start: int = 0) -> list[tuple[int, int]]:
    """FlexLLM §6.1: split tokens [start, length) into consecutive windows of the granted sizes.

    Grants are used in order (a grant ≤ 0 gives no window); the last window is clipped at
    ``length``; stops once the sequence is covered. The windows tile [start, covered) with no gap
    or overlap; the torch side accumulates gradients over them (KV and KV-gradient caches).
    """
    if length < 0 or not 0 <= start <= length:
        raise ValueError("need 0 <= start <= length")
    out, pos = [], start
    for g in grants:
        if pos >= length:
            break
        if g <= 0:
            continue
        end = min(length, pos + int(g))
        out.append((pos, end))
        pos = end
    return out


def whole_windows(samples: Sequence[FineTuneSample], count: int) -> tuple[TokenWindow, ...]:
    """The rest of the current pass of the first ``count`` samples, one window each.

    How a grant of whole samples (the retraining policies of ``planners/retraining.py``) is handed
    to a trainer that runs token windows.
    """
    return tuple(
        TokenWindow(s.sample_id, s.done, s.tokens, s.tokens, s.forward_tokens)
        for s in samples[: max(0, count)]
        if s.remaining > 0
    )


@dataclass(frozen=True)
class MicroBatch:
    """Windows the trainer runs as one padded batch: B = ``batch_size`` rows of ``padded_tokens``."""

    windows: tuple[TokenWindow, ...]
    memory_bytes: float
    latency_s: float

    @property
    def batch_size(self) -> int:
        return len(self.windows)

    @property
    def padded_tokens(self) -> int:
        return max((w.tokens for w in self.windows), default=0)

    @property
    def tokens(self) -> int:
        return sum(w.tokens for w in self.windows)
