"""Token-level fine-tuning (FlexLLM §6.1): one LoRA training pass over a feedback item, run as token windows across grants.

A trainer rank (``actors/learning/lora/rank.py``) runs :class:`WindowedPass` when the node scheduler grants
token windows instead of whole samples; it leaves the same gradient as ``sft_step`` / ``dpo_step``
of ``actors/learning/lora/steps.py`` on the item:

    p = WindowedPass(model, tok, item, "dpo", beta=spec.beta, scale=1 / batch)  # length = item_length(...)
    p.forward(window.end)   # once per granted window, in order
    stats = p.finish()      # after the last: loss, backward sweep, LoRA .grad += scale·∇loss
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.learning.dpo_loss import pair_losses, reward_margin
from actors.learning.lora.steps import DEFAULT_MAX_LENGTH, encode, model_mode, prompted_text

WINDOW_METHODS = ("sft", "dpo")


@dataclass(frozen=True)
class WindowStats:
    """What a finished :class:`WindowedPass` did: the item's loss, its tokens, and the DPO loss for CheckEnd."""

    loss: float  # the item's loss, unscaled (SFT: token mean over its completion; DPO: −log σ(β·(Δ⁺ − Δ⁻)))
    tokens: int  # L, the tokens through the trained forward (DPO: chosen + rejected)
    dpo_loss: float | None = None  # DPO only: the value to report to the scheduler (MACE §4.1, γ·L_DPO)
    reward_margin: float | None = None  # DPO only: β·(Δ⁺ − Δ⁻)


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
    """One forward over tokens [a, b) of one segment: its graph is kept until finish() sweeps it backward."""

    segment: int
    logp: torch.Tensor  # Σ log π over the completion targets scored in the piece (part of the graph)
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # (K/V output in the graph, its leaf copy handed to later pieces)


def _item_segments(tokenizer: Any, item: Any, method: str, max_length: int) -> list[tuple[list[int], list[int]]]:
    """(token ids, completion mask) of each sequence of the stream, exactly as sft_step / dpo_step encode them."""
    if method not in WINDOW_METHODS:
        raise ValueError(f"unknown training method {method!r}; expected one of {WINDOW_METHODS}")
    texts = [prompted_text(tokenizer, item, f) for f in (("completion",) if method == "sft" else ("chosen", "rejected"))]
    enc = encode(tokenizer, [t.prompt for t in texts], [t.answer for t in texts], max_length=max_length,
                 templated=[t.templated for t in texts])
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


def batch_scales(tokenizer: Any, items: Sequence[Any], method: str, *, scale: float = 1.0,
                 max_length: int = DEFAULT_MAX_LENGTH) -> list[float]:
    """Per-item ``scale`` for WindowedPasses whose accumulated gradient equals ``sft_step``/``dpo_step`` on ``items``.

    DPO's batch loss is a mean over pairs: every item gets ``scale / B``. SFT's is a token mean over
    the whole batch, not a mean of per-item means: item i gets ``scale · n_i / Σ_j n_j`` with n_i its
    completion (loss-bearing) tokens, so ``scale / B`` is right only when all n_i are equal.
    """
    if not items:
        raise ValueError("batch_scales needs at least one item")
    if method == "dpo":
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

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            self.new_kv[layer_idx] = (key_states, value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return CapturingCache


class WindowedPass:
    """One training pass over one feedback item, run as consecutive token windows (FlexLLM §6.1).

    The node scheduler (``planners.coserving``) grants fine-tune work as token windows [start, end)
    of an item's stream of ``length`` tokens; ``forward(end)`` runs one grant and ``finish()``, after
    the last, applies the loss: the LoRA gradient it accumulates equals that of one full-sequence
    step (``sft_step`` / ``dpo_step`` on this item alone, same ``scale``) up to float rounding.

    The stream: SFT, the sequence sft_step trains on; DPO, the chosen sequence followed by the
    rejected one, each as dpo_step encodes it (a window crossing the boundary runs as two forwards,
    one per sequence, each on its own KV cache). π_ref (the model with its adapter disabled, eval
    mode, no grad) runs window by window on a third, plain KV cache, so every forward, policy or
    reference, processes only its window's tokens.

    Forward (Alg. 2 lines 3–11): each window runs with the K/V of the earlier windows as its KV
    cache (positions continue at ``done``) and keeps its autograd graph. Its new K/V are handed to
    later windows as *detached leaf copies* that require grad, so a later window's backward leaves
    ∂loss/∂K, ∂loss/∂V of earlier tokens in those leaves' ``.grad`` (Fig. 8, the KV-gradient
    accumulation) instead of flowing into a graph that has already been freed.

    Backward (lines 12–21, in ``finish()``): the loss is a function of per-window sums of completion
    log-probs (SFT: −Σ/n; DPO: −log σ(β·(Δ⁺ − Δ⁻)), only known once both sequences are complete,
    which is why nothing runs backward before ``finish()``). Its gradient w.r.t. those sums seeds the
    windows, swept in reverse order: window j backpropagates its log-prob sum together with its K/V
    outputs weighted by the gradient accumulated on their leaf copies (all later windows are done
    by then), which fills the LoRA ``.grad`` and the leaf grads of windows before j. Unlike
    FlexLLM's layer-wise sweep, each window's backward goes through all layers at once.

    Batch means (what ``scale`` to pass): ``finish()`` adds ``scale · ∇loss_item``. ``dpo_step``'s loss
    is a mean over pairs, so ``scale = 1/B`` per item reproduces ``dpo_step`` on a batch of B.
    ``sft_step``'s is a *token* mean over the whole batch, so the batch step is reproduced by
    ``scale = n_i / Σ_j n_j`` (n_i = ``loss_tokens``), not by 1/B unless all items have as many
    completion tokens; :func:`batch_scales` computes both. ``scale`` is read in ``finish()``, so a
    trainer may set it after the passes of a micro-batch are built.

    Costs and constraints: the graphs of all windows live until ``finish()`` (activation memory as
    for the full sequence), and each window's graph keeps its own concatenated copy of the prefix
    K/V (attention saves its inputs), Σ_j l_j tokens per layer over the pass. The weights must not
    change between the first ``forward`` and ``finish()``: run ``optimizer_step`` only between
    passes (an in-place update would also invalidate the saved graphs). LoRA dropout draws fresh
    noise per window, so with dropout > 0 the pass equals a full step only in distribution.
    Nothing touches ``.grad`` before ``finish()``: ``abandon()`` after a refused window is free.
    """

    def __init__(self, model: Any, tokenizer: Any, item: Any, method: str, *, beta: float = 0.1,
                 max_length: int = DEFAULT_MAX_LENGTH, scale: float = 1.0) -> None:
        self.model, self.method, self.beta, self.scale = model, method, float(beta), float(scale)
        device = next(model.parameters()).device
        self._segments: list[_Segment] = []
        offset = 0
        for ids, comp in _item_segments(tokenizer, item, method, max_length):
            self._segments.append(_Segment(torch.tensor(ids, device=device),
                                           torch.tensor(comp[1:], dtype=torch.float32, device=device), offset))
            offset += len(ids)
        self.length: int = offset
        self.loss_tokens: int = sum(int(s.target_mask.sum()) for s in self._segments)
        self.done: int = 0
        self._pieces: list[_Piece] = []
        self._closed = False

    def forward(self, end: int) -> None:
        """Forward tokens [done, end) of the stream on top of the earlier windows' KV; keep the graph for finish()."""
        self._check_open()
        if not self.done < end <= self.length:
            raise ValueError(f"forward(end={end}) needs {self.done} < end <= {self.length}: the item's stream has "
                             f"{self.length} tokens and {self.done} are forwarded already")
        for k, seg in enumerate(self._segments):
            a, b = max(self.done, seg.offset) - seg.offset, min(end, seg.offset + seg.length) - seg.offset
            if a < b:
                self._forward_piece(k, seg, a, b)
        self.done = end

    def _forward_piece(self, k: int, seg: _Segment, a: int, b: int) -> None:
        ids = seg.ids[a:b].unsqueeze(0)
        positions = torch.arange(a, b, device=ids.device).unsqueeze(0)
        if self.method == "dpo":
            from transformers import DynamicCache

            if seg.ref_cache is None:
                seg.ref_cache = DynamicCache()
            with torch.no_grad(), model_mode(self.model, False), self.model.disable_adapter():
                logits = self.model(input_ids=ids, position_ids=positions, past_key_values=seg.ref_cache,
                                    use_cache=True).logits
                ref = self._logp_sum(logits, seg, a, b)
            seg.ref_logp = ref if seg.ref_logp is None else seg.ref_logp + ref
        past = [(torch.cat(kv[0::2], dim=-2), torch.cat(kv[1::2], dim=-2)) for kv in seg.past]
        cache = _capturing_cache_class()(past)
        with model_mode(self.model, True):
            logits = self.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits
        logp = self._logp_sum(logits, seg, a, b)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        new_past: list[list[torch.Tensor]] = []
        for layer in range(len(cache.new_kv)):
            leaves = []
            for out in cache.new_kv[layer]:
                # Layer 0's K does not depend on any LoRA weight when k_proj is not adapted: a constant, no leaf.
                leaf = out.detach().requires_grad_(out.requires_grad)
                if out.requires_grad:
                    pairs.append((out, leaf))
                leaves.append(leaf)
            new_past.append(leaves)
        seg.past = new_past if not seg.past else [old + new for old, new in zip(seg.past, new_past)]
        self._pieces.append(_Piece(k, logp, pairs))

    @staticmethod
    def _logp_sum(logits: torch.Tensor, seg: _Segment, a: int, b: int) -> torch.Tensor:
        # Position t scores token t+1; the segment's last position scores nothing (as token_logprobs' [:, :-1]).
        m = min(b, seg.length - 1) - a
        if m <= 0:
            return logits.new_zeros((), dtype=torch.float32)
        lg = logits[0, :m].float()
        target = seg.ids[a + 1: a + 1 + m]
        logps = lg.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lg, dim=-1)
        return (logps * seg.target_mask[a: a + m]).sum()

    def finish(self) -> WindowStats:
        """Compute the item's loss, sweep the windows backward, add ``scale``·∇loss into the LoRA ``.grad``."""
        self._check_open()
        if self.done != self.length:
            raise ValueError(f"finish() needs the whole stream forwarded: {self.done} of {self.length} tokens done")
        try:
            sums = [torch.zeros((), device=self._segments[0].ids.device) for _ in self._segments]
            for piece in self._pieces:
                sums[piece.segment] = sums[piece.segment] + piece.logp.detach()
            sums = [s.requires_grad_() for s in sums]
            if self.method == "sft":
                loss = -sums[0] / max(self.loss_tokens, 1)
                margin = None
            else:
                chosen, rejected = self._segments
                margin = reward_margin(sums[0], sums[1], chosen.ref_logp, rejected.ref_logp, self.beta)
                loss = pair_losses(margin)
            seeds = torch.autograd.grad(loss * self.scale, sums)
            for piece in reversed(self._pieces):
                tensors, grads = [], []
                if piece.logp.requires_grad:
                    tensors.append(piece.logp)
                    grads.append(seeds[piece.segment])
                for out, leaf in piece.kv:
                    if leaf.grad is not None:  # None: no later window attended to it (the last window)
                        tensors.append(out)
                        grads.append(leaf.grad)
                if tensors:
                    torch.autograd.backward(tensors, grads)
                piece.logp, piece.kv = piece.logp.detach(), []  # frees this window's graph and leaf grads
        finally:
            self.abandon()
        loss_value = float(loss.detach())
        if margin is None:
            return WindowStats(loss=loss_value, tokens=self.length)
        return WindowStats(loss=loss_value, tokens=self.length, dpo_loss=loss_value,
                           reward_margin=float(margin.detach()))

    def abandon(self) -> None:
        """Drop the graphs and caches without touching any gradient (a window of the pass was refused)."""
        self._pieces = []
        for seg in self._segments:
            seg.past, seg.ref_cache = [], None
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this WindowedPass is finished or abandoned; build a new one for the item")
