"""Token-level fine-tuning (FlexLLM §6.1): one LoRA training pass over a feedback item, run as token windows across grants.

A trainer rank (``actors/learning/lora/rank.py``) runs :class:`WindowedPass` when the node scheduler grants
token windows instead of whole samples; it leaves the same gradient as ``sft_step`` / ``dpo_step``
of ``actors/learning/lora/steps.py`` on the item. A pass is ``2·L`` tokens of work: the item's
``L`` stream tokens forward, then the same ``L`` backward, and a grant covers any stretch of it:

    p = WindowedPass(model, tok, item, "dpo", beta=spec.beta, scale=1 / batch)  # p.length = L, p.work = 2·L
    p.run(window.end)       # once per granted window [p.done, end), in order: forward, then backward
    p.stats                 # once p.done == p.work: loss; LoRA .grad += scale·∇loss

``forward(end)`` and ``finish()`` (the rest of the backward at once) remain for callers that run a
pass in one piece.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.learning.dpo_loss import kto_losses, log_ratio, pair_losses, reward_margin
from actors.learning.lora.steps import DEFAULT_MAX_LENGTH, encode, model_mode, prompted_text

WINDOW_METHODS = ("sft", "dpo", "kto")
REFERENCE_METHODS = ("dpo", "kto")  # those whose loss compares with π_ref (the model with its adapter disabled)


@dataclass(frozen=True)
class WindowStats:
    """What a finished :class:`WindowedPass` did: the item's loss, its tokens, and the DPO loss for CheckEnd."""

    loss: float  # the item's loss, unscaled (SFT: token mean over its completion; DPO: −log σ(β·(Δ⁺ − Δ⁻)))
    tokens: int  # L, the tokens through the trained forward (DPO: chosen + rejected)
    dpo_loss: float | None = None  # DPO (and KTO): the value to report to the scheduler (MACE §4.1, γ·L_DPO)
    reward_margin: float | None = None  # DPO: β·(Δ⁺ − Δ⁻); KTO: ±β·Δ, positive when the label's way


@dataclass
class _Segment:
    """One sequence of the item's stream (SFT: the one row; DPO: chosen, then rejected), as encode() builds it."""

    ids: torch.Tensor  # [n] on the model's device
    target_mask: torch.Tensor  # [n − 1] float: position t is scored iff token t+1 is a completion token
    offset: int  # where the segment starts in the item's stream
    past: list[list[torch.Tensor]] = field(default_factory=list)  # per layer: [K_0, V_0, K_1, V_1, ...]
    ref_cache: Any = None  # DPO: the no-grad KV cache of the reference (adapter disabled)
    ref_logp: torch.Tensor | None = None  # DPO: log π_ref(y|x) so far

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class _Piece:
    """One forward over tokens [a, b) of one segment, cut at every decoder layer; swept backward layer by layer.

    ``hidden[l]`` is layer l's output in the graph and the detached leaf copy layer l + 1 (or the
    head) computed from; ``kv[l]`` layer l's new K and V, each with its leaf copy handed to later
    pieces. So the graph of layer l of this piece depends on nothing but its input leaf
    ``hidden[l − 1]``, the K/V leaves of earlier pieces at layer l, and the weights: each
    (layer, piece) is one unit of backward work (FlexLLM Alg. 2 lines 13–21).
    """

    segment: int
    tokens: int
    logp: torch.Tensor  # Σ log π over the completion targets scored in the piece (part of the graph)
    hidden: list[tuple[torch.Tensor | None, torch.Tensor | None]]  # per layer: (output in the graph, leaf copy)
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]]  # per layer: [(K/V output in the graph, its leaf copy)]


def _item_segments(tokenizer: Any, item: Any, method: str, max_length: int) -> list[tuple[list[int], list[int]]]:
    """(token ids, completion mask) of each sequence of the stream, exactly as sft_step / dpo_step encode them."""
    if method not in WINDOW_METHODS:
        raise ValueError(f"unknown training method {method!r}; expected one of {WINDOW_METHODS}")
    fields = ("chosen", "rejected") if method == "dpo" else ("completion",)  # KTO: the one labelled answer
    texts = [prompted_text(tokenizer, item, f) for f in fields]
    enc = encode(
        tokenizer,
        [t.prompt for t in texts],
        [t.answer for t in texts],
        max_length=max_length,
        templated=[t.templated for t in texts],
    )
    out = []
    for ids, attn, comp in zip(enc.input_ids.tolist(), enc.attention_mask.tolist(), enc.completion_mask.tolist()):
        n = sum(attn)  # right-padded: the real tokens are the first n
        out.append((ids[:n], comp[:n]))
    return out


def item_length(tokenizer: Any, item: Any, method: str, max_length: int = DEFAULT_MAX_LENGTH) -> int:
    """L, the tokens of an item's stream in a :class:`WindowedPass` (DPO: chosen + rejected), without running it.

    The scheduler's ``FineTuneSample`` tokens and ``token_windows(length, ...)`` need it.
    """
    return sum(len(ids) for ids, _ in _item_segments(tokenizer, item, method, max_length))


def item_loss_tokens(tokenizer: Any, item: Any, method: str, max_length: int = DEFAULT_MAX_LENGTH) -> int:
    """The completion tokens that carry loss in an item (DPO: chosen + rejected); the SFT batch-mean weight."""
    return sum(sum(comp) for _, comp in _item_segments(tokenizer, item, method, max_length))


def batch_scales(
    tokenizer: Any, items: Sequence[Any], method: str, *, scale: float = 1.0, max_length: int = DEFAULT_MAX_LENGTH
) -> list[float]:
    """Per-item ``scale`` for WindowedPasses whose accumulated gradient equals ``sft_step``/``dpo_step`` on ``items``.

    DPO's (and KTO's) batch loss is a mean over items: every item gets ``scale / B``. SFT's is a token mean over
    the whole batch, not a mean of per-item means: item i gets ``scale · n_i / Σ_j n_j`` with n_i its
    completion (loss-bearing) tokens, so ``scale / B`` is right only when all n_i are equal.
    """
    if not items:
        raise ValueError("batch_scales needs at least one item")
    if method in REFERENCE_METHODS:
        _item_segments(tokenizer, items[0], method, max_length)  # validates the method and the fields
        return [scale / len(items)] * len(items)
    counts = [item_loss_tokens(tokenizer, it, method, max_length) for it in items]
    total = max(sum(counts), 1)  # sft_step clamps its denominator the same way
    return [scale * n / total for n in counts]


@functools.lru_cache(maxsize=1)
def _capturing_cache_class() -> type:
    # Built lazily: importing transformers costs seconds and this module must stay light to import.
    from transformers import DynamicCache

    class CapturingCache(DynamicCache):
        """A DynamicCache that also remembers each layer's new (post-RoPE) K/V: the window's own outputs.

        The prefix goes in through ``ddp_cache_data`` (the constructor's way of pre-filling layers);
        the attention layers call ``update`` with exactly the window's K/V before concatenating.
        """

        def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
            super().__init__(ddp_cache_data=past or None)
            self.new_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            self.new_kv[layer_idx] = (key_states, value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return CapturingCache


def decoder_layers(model: Any) -> Any:
    """The decoder layers of a (peft-wrapped) causal LM, in order: ``<base>.model.layers`` (Llama, Mistral, Qwen...)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(base).__name__} has no model.layers: the windowed backward cannot cut it by layer")
    return layers


def level_weights(model: Any) -> list[float]:
    """Each backward level's share of a token's backward work, head first, then layers N−1 … 0.

    Weighted by parameters (the backward of a frozen linear layer costs what its forward does,
    2·params flops a token; attention's context term is small at these lengths): the head is the
    output embedding (tied or not) and the final norm, a layer everything inside it.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = decoder_layers(model)
    head = base.get_output_embeddings().weight.numel() + sum(p.numel() for p in base.model.norm.parameters())
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    total = head + sum(per_layer)
    return [head / total] + [n / total for n in reversed(per_layer)]


class WindowedPass:
    """One training pass over one feedback item, run as token windows across grants (FlexLLM §6.1, Alg. 2).

    The node scheduler (``planners.coserving``) grants fine-tune work as windows [start, end) of the
    pass's ``work`` = 2·L tokens: [0, L) is the forward over the item's stream of L tokens, [L, 2L)
    its backward, in token-equivalents (a token's backward through every layer). ``run(end)`` runs
    one grant. Once ``done == work`` the LoRA gradient it accumulated equals that of one
    full-sequence step (``sft_step`` / ``dpo_step`` on this item alone, same ``scale``) up to float
    rounding, and ``stats`` holds the item's loss.

    The stream: SFT, the sequence sft_step trains on; DPO, the chosen sequence followed by the
    rejected one, each as dpo_step encodes it (a window crossing the boundary runs as two forwards,
    one per sequence, each on its own KV cache). π_ref (the model with its adapter disabled, eval
    mode, no grad) runs window by window on a third, plain KV cache, so every forward, policy or
    reference, processes only its window's tokens.

    Forward (Alg. 2 lines 3–11): each window runs with the K/V of the earlier windows as its KV
    cache (positions continue at ``done``) and keeps its autograd graph, cut at every decoder layer:
    each layer's output goes on to the next layer as a *detached leaf copy* that requires grad, and
    so do its new K/V to later windows (Fig. 8). A later window's backward then leaves ∂loss/∂K,
    ∂loss/∂V of earlier tokens in those leaves' ``.grad`` (the KV-gradient accumulation) instead of
    flowing into a graph that is freed, and each (layer, window) is a graph of its own.

    Backward (lines 12–21): the loss is a function of per-window sums of completion log-probs (SFT:
    −Σ/n; DPO: −log σ(β·(Δ⁺ − Δ⁻)), known once both sequences are complete, so no backward runs
    before the forward is done). Its gradient w.r.t. those sums seeds the windows. Then, as Alg. 2's
    two loops, level by level from the top (the head, then layers N−1 … 0), window by window from
    the last: the head of window j backpropagates its log-prob sum into its top leaf; layer l of
    window j backpropagates its output (with the gradient its leaf received from the level above)
    and its K/V outputs (with the gradients their leaves received from later windows at layer l,
    all done by then), which fills the LoRA ``.grad``, its input leaf's grad, and the K/V leaf grads
    of earlier windows at layer l. One such (level, window) is the unit a backward grant runs: a
    unit of a window of t tokens is t·w_level token-equivalents (``level_weights``: by parameters).
    A grant runs whole units while they fit its tokens, at least one, so it overruns by less than
    one unit; progress is counted in whole token-equivalents.

    Batch means (what ``scale`` to pass): the pass adds ``scale · ∇loss_item``. ``dpo_step``'s loss
    is a mean over pairs, so ``scale = 1/B`` per item reproduces ``dpo_step`` on a batch of B.
    ``sft_step``'s is a *token* mean over the whole batch, so the batch step is reproduced by
    ``scale = n_i / Σ_j n_j`` (n_i = ``loss_tokens``), not by 1/B unless all items have as many
    completion tokens; :func:`batch_scales` computes both. ``scale`` is read when the backward
    starts, so a trainer may set it after the passes of a micro-batch are built.

    Costs and constraints: the graphs of all windows live until their units are swept (activation
    memory as for the full sequence at the forward's end), and each window's graph keeps its own
    concatenated copy of the prefix K/V (attention saves its inputs), Σ_j l_j tokens per layer over
    the pass. The weights must not change between the first ``forward`` and the last unit: run
    ``optimizer_step`` only between passes (an in-place update would also invalidate the saved
    graphs). LoRA dropout draws fresh noise per window, so with dropout > 0 the pass equals a full
    step only in distribution. Nothing touches ``.grad`` before the backward starts: ``abandon()``
    after a refused forward window is free; after that the caller drops the gradients (the rank's
    ``abandon_step`` zeroes them).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        item: Any,
        method: str,
        *,
        beta: float = 0.1,
        max_length: int = DEFAULT_MAX_LENGTH,
        scale: float = 1.0,
    ) -> None:
        self.model, self.method, self.beta, self.scale = model, method, float(beta), float(scale)
        label = item.get("label") if isinstance(item, dict) else getattr(item, "label", None)
        self.label = label if method == "kto" else None
        if method == "kto" and self.label is None:
            raise ValueError("a kto pass needs a labelled item (label true or false)")
        device = next(model.parameters()).device
        self._segments: list[_Segment] = []
        offset = 0
        for ids, comp in _item_segments(tokenizer, item, method, max_length):
            self._segments.append(
                _Segment(
                    torch.tensor(ids, device=device), torch.tensor(comp[1:], dtype=torch.float32, device=device), offset
                )
            )
            offset += len(ids)
        self.length: int = offset
        self.work: int = 2 * offset
        self.loss_tokens: int = sum(int(s.target_mask.sum()) for s in self._segments)
        self.done: int = 0
        self.stats: WindowStats | None = None
        self._pieces: list[_Piece] = []
        self._units: list[tuple[int, int]] = []  # backward units still to run: (level, piece), in order
        self._unit_weights: list[float] = []
        self._swept = 0.0  # token-equivalents of backward run so far
        self._seeds: list[torch.Tensor] = []
        self._closed = False

    @property
    def complete(self) -> bool:
        return self.done == self.work

    def run(self, end: int) -> None:
        """Run the work [done, end): forward up to token L, then backward (FlexLLM Alg. 2)."""
        self._check_open()
        if not self.done < end <= self.work:
            raise ValueError(f"run(end={end}) needs {self.done} < end <= {self.work}")
        if self.done < self.length:
            self.forward(min(end, self.length))
        if end > self.length:
            self.backward(end)

    # ---- forward --------------------------------------------------------------------------------

    def forward(self, end: int) -> None:
        """Forward tokens [done, end) of the stream on top of the earlier windows' KV; keep the graph for the backward."""
        self._check_open()
        if not self.done < end <= self.length:
            raise ValueError(
                f"forward(end={end}) needs {self.done} < end <= {self.length}: the item's stream has "
                f"{self.length} tokens and {self.done} are forwarded already"
            )
        for k, seg in enumerate(self._segments):
            a, b = max(self.done, seg.offset) - seg.offset, min(end, seg.offset + seg.length) - seg.offset
            if a < b:
                self._forward_piece(k, seg, a, b)
        self.done = end

    def _forward_piece(self, k: int, seg: _Segment, a: int, b: int) -> None:
        ids = seg.ids[a:b].unsqueeze(0)
        positions = torch.arange(a, b, device=ids.device).unsqueeze(0)
        if self.method in REFERENCE_METHODS:
            from transformers import DynamicCache

            if seg.ref_cache is None:
                seg.ref_cache = DynamicCache()
            with torch.no_grad(), model_mode(self.model, False), self.model.disable_adapter():
                logits = self.model(
                    input_ids=ids, position_ids=positions, past_key_values=seg.ref_cache, use_cache=True
                ).logits
                ref = self._logp_sum(logits, seg, a, b)
            seg.ref_logp = ref if seg.ref_logp is None else seg.ref_logp + ref
        past = [(torch.cat(kv[0::2], dim=-2), torch.cat(kv[1::2], dim=-2)) for kv in seg.past]
        cache = _capturing_cache_class()(past)
        hidden: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []

        def cut(module: Any, args: Any, output: Any) -> Any:
            # Layer l's output goes on as a leaf: the graph of each layer ends here (one backward unit each).
            out = output[0] if isinstance(output, tuple) else output
            if not out.requires_grad:  # no LoRA weight at or below this layer: nothing to sweep
                hidden.append((None, out))
                return output
            leaf = out.detach().requires_grad_()
            hidden.append((out, leaf))
            return (leaf, *output[1:]) if isinstance(output, tuple) else leaf

        handles = [layer.register_forward_hook(cut) for layer in decoder_layers(self.model)]
        try:
            with model_mode(self.model, True):
                logits = self.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits
        finally:
            for h in handles:
                h.remove()
        logp = self._logp_sum(logits, seg, a, b)
        kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        new_past: list[list[torch.Tensor]] = []
        for layer in range(len(cache.new_kv)):
            leaves, pairs = [], []
            for out in cache.new_kv[layer]:
                # Layer 0's K does not depend on any LoRA weight when k_proj is not adapted: a constant, no leaf.
                leaf = out.detach().requires_grad_(out.requires_grad)
                if out.requires_grad:
                    pairs.append((out, leaf))
                leaves.append(leaf)
            new_past.append(leaves)
            kv.append(pairs)
        seg.past = new_past if not seg.past else [old + new for old, new in zip(seg.past, new_past)]
        self._pieces.append(_Piece(k, b - a, logp, hidden, kv))

    @staticmethod
    def _logp_sum(logits: torch.Tensor, seg: _Segment, a: int, b: int) -> torch.Tensor:
        # Position t scores token t+1; the segment's last position scores nothing (as token_logprobs' [:, :-1]).
        m = min(b, seg.length - 1) - a
        if m <= 0:
            return logits.new_zeros((), dtype=torch.float32)
        lg = logits[0, :m].float()
        target = seg.ids[a + 1 : a + 1 + m]
        logps = lg.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lg, dim=-1)
        return (logps * seg.target_mask[a : a + m]).sum()

    # ---- backward -------------------------------------------------------------------------------

    def backward(self, end: int) -> None:
        """Sweep backward units until ``end`` − L token-equivalents of backward are done (at least one unit)."""
        self._check_open()
        if self.done < self.length:
            raise ValueError(f"backward needs the whole stream forwarded: {self.done} of {self.length} tokens done")
        if not self.done < end <= self.work:
            raise ValueError(f"backward(end={end}) needs {self.done} < end <= {self.work}")
        try:
            if not self._seeds:
                self._begin_backward()
            target = end - self.length
            ran = False
            while self._units:
                nxt = self._swept + self._unit_weights[0]
                # Whole units while they fit the grant, and at least enough to move ``done`` on by one token.
                if ran and nxt > target + 1e-9 and self._progress() > self.done:
                    break
                self._run_unit(*self._units.pop(0))
                self._swept = nxt
                self._unit_weights.pop(0)
                ran = True
            self.done = self._progress()
        except BaseException:
            self.abandon()
            raise
        if self.done == self.work:
            self._pieces, self._seeds, self._closed = [], [], True

    def finish(self) -> WindowStats:
        """Run the rest of the backward at once and return the item's stats (the forward must be complete)."""
        self._check_open()
        if self.done < self.length:
            raise ValueError(f"finish() needs the whole stream forwarded: {self.done} of {self.length} tokens done")
        self.backward(self.work)
        assert self.stats is not None
        return self.stats

    def _progress(self) -> int:
        if not self._units:
            return self.work
        return self.length + min(self.length - 1, math.floor(self._swept + 1e-9))

    def _begin_backward(self) -> None:
        """The loss, its gradient w.r.t. each window's log-prob sum (the seeds), and the backward's units."""
        sums = [torch.zeros((), device=self._segments[0].ids.device) for _ in self._segments]
        for piece in self._pieces:
            sums[piece.segment] = sums[piece.segment] + piece.logp.detach()
        sums = [x.requires_grad_() for x in sums]
        if self.method == "sft":
            loss = -sums[0] / max(self.loss_tokens, 1)
            margin = None
        elif self.method == "kto":
            answer = self._segments[0]
            desirable = torch.tensor(bool(self.label), device=sums[0].device)
            loss = kto_losses(sums[0], answer.ref_logp, desirable, self.beta)
            sign = 1.0 if self.label else -1.0
            margin = sign * self.beta * log_ratio(sums[0], answer.ref_logp)
        else:
            chosen, rejected = self._segments
            margin = reward_margin(sums[0], sums[1], chosen.ref_logp, rejected.ref_logp, self.beta)
            loss = pair_losses(margin)
        self._seeds = list(torch.autograd.grad(loss * self.scale, sums))
        value = float(loss.detach())
        self.stats = (
            WindowStats(loss=value, tokens=self.length)
            if margin is None
            else WindowStats(loss=value, tokens=self.length, dpo_loss=value, reward_margin=float(margin.detach()))
        )
        for seg in self._segments:  # the forward is over: its caches are no longer read
            seg.past, seg.ref_cache = [], None
        weights = level_weights(self.model)
        n = len(self._pieces)
        self._units = [(level, j) for level in range(len(weights)) for j in reversed(range(n))]
        self._unit_weights = [self._pieces[j].tokens * weights[level] for level, j in self._units]

    def _run_unit(self, level: int, j: int) -> None:
        """Level 0 is the head: the window's log-prob sum into its top leaf; level k ≥ 1 is layer N − k."""
        piece = self._pieces[j]
        tensors, grads = [], []
        if level == 0:
            if piece.logp.requires_grad:
                tensors.append(piece.logp)
                grads.append(self._seeds[piece.segment])
            piece.logp = piece.logp.detach()
        else:
            layer = len(piece.hidden) - level
            out, leaf = piece.hidden[layer]
            if (
                out is not None and leaf is not None and leaf.grad is not None
            ):  # None: nothing above this window's layer reached it
                tensors.append(out)
                grads.append(leaf.grad)
            for kv_out, kv_leaf in piece.kv[layer]:
                if kv_leaf.grad is not None:  # None: no later window attended to it (the last window)
                    tensors.append(kv_out)
                    grads.append(kv_leaf.grad)
            piece.hidden[layer] = (None, None)  # frees this unit's graph, its output and its leaf's grad
            piece.kv[layer] = []
        if tensors:
            torch.autograd.backward(tensors, grads)

    def abandon(self) -> None:
        """Drop the graphs and caches; gradients already swept into ``.grad`` stay (the caller drops them)."""
        self._pieces, self._units, self._unit_weights, self._seeds = [], [], [], []
        for seg in self._segments:
            seg.past, seg.ref_cache = [], None
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this WindowedPass is finished or abandoned; build a new one for the item")
