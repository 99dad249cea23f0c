"""LoRA training primitives for the co-located trainer: SFT/DPO micro-steps, MACE metrics, atomic adapter versions.

Everything here is a plain function on a ``peft`` model, so a Ray Train worker loop can run one
micro-step at a time between planner grants (docs/learning.md):

    model, tok = load_lora_model(model_dir, spec.lora, adapter_dir=current.path if current else None)
    opt = make_optimizer(model, spec.learning_rate, state_dir=current.path if current else None)
    stats = dpo_step(model, tok, items, beta=spec.beta, scale=1 / accum)   # forward + backward
    optimizer_step(model, opt)                                             # clip, step, zero_grad
    path = save_adapter_version(model, opt, root, spec.name, version, meta)

When the node scheduler grants token windows instead of whole samples (FlexLLM §6.1),
:class:`WindowedPass` runs one item across several grants and leaves the same gradient:

    p = WindowedPass(model, tok, item, "dpo", beta=spec.beta, scale=1 / batch)  # length = item_length(...)
    p.forward(window.end)   # once per granted window, in order
    stats = p.finish()      # after the last: loss, backward sweep, LoRA .grad += scale·∇loss

Conventions (the same as TRL's trainers, so numbers are comparable): prompt and completion are
tokenized separately and concatenated, the completion ends with EOS, only completion tokens
carry loss, and a sequence log-probability is the *sum* of its completion tokens' log-probs.

Why not TRL's loss code: TRL 1.16 keeps the DPO loss inside ``DPOTrainer._compute_loss`` (and
the SFT loss inside ``SFTTrainer``), methods of a ``transformers.Trainer`` that owns the dataset,
the dataloader, the accelerator and the optimizer loop; there is no standalone per-step loss
function to call from a grant-driven loop (its public helpers, ``selective_log_softmax`` and
``use_adapter``, are a gather-minus-logsumexp and ``model.disable_adapter()``). The loss itself is
one line; :func:`dpo_step` reproduces TRL's ``loss_type="sigmoid"`` with
``f_divergence_type="reverse_kl"`` and its PEFT reference (the same model with adapters
disabled, no second copy of the base weights), without importing TRL into the trainer process.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from actors.adapter_versions import (  # noqa: F401 (part of this module's API)
    ADAPTER_FILES,
    META_FILE,
    TEMP_PREFIX,
    VERSION_DIR_RE,
    fsync_dir,
    fsync_tree,
    is_complete_version,
    version_dir,
)

OPTIMIZER_FILE = "optimizer.pt"
DEFAULT_MAX_LENGTH = 512


@dataclass(frozen=True)
class StepStats:
    """What one micro-step did: mean loss, per-sample losses, and the work it cost (for the planner's budget)."""

    loss: float
    samples: int
    tokens: int  # non-padding tokens through the trained forward pass (DPO: chosen + rejected)
    per_sample_loss: list[float] = field(default_factory=list)
    reward_margin: float | None = None  # DPO: mean β·(Δ⁺ − Δ⁻), the implicit reward gap


@dataclass(frozen=True)
class PreferenceEval:
    """MACE §3.1 alignment metrics over a preference set."""

    win_rate: float
    clpd: float
    pairs: int
    diffs: tuple[float, ...] = ()  # log π(y⁺|x) − log π(y⁻|x) of each pair, in order


@dataclass(frozen=True)
class Encoded:
    input_ids: torch.Tensor  # [B, T], right-padded
    attention_mask: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T], 1 on completion tokens (incl. EOS)


# ----------------------------------------------------------------------------------------------
# Model and optimizer.


def seed_everything(seed: int) -> None:
    """Seed Python and torch RNGs (LoRA init, dropout), so a run is reproducible."""
    random.seed(seed)
    torch.manual_seed(seed)


def load_lora_model(model_dir: str | Path, lora_settings: Any, adapter_dir: str | Path | None = None, *,
                    seed: int = 0, device: str | torch.device | None = None,
                    dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Return ``(peft_model, tokenizer)``: the base model with a fresh LoRA adapter, or resumed from ``adapter_dir``.

    ``lora_settings`` has ``r``, ``alpha``, ``target_modules``, ``dropout`` (``actors.feedback_store.LoraSettings``
    or a mapping). When resuming, the saved ``adapter_config.json`` wins over ``lora_settings``.
    """
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    seed_everything(seed)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    else:
        model = get_peft_model(base, lora_config(lora_settings))
    model.train()
    return model, tokenizer


def lora_config(lora_settings: Any) -> Any:
    """The ``peft.LoraConfig`` of an adapter's LoRA settings (``r``, ``alpha``, ``target_modules``, ``dropout``)."""
    from peft import LoraConfig

    s = _settings(lora_settings)
    return LoraConfig(r=int(s["r"]), lora_alpha=float(s["alpha"]), target_modules=list(s["target_modules"]),
                      lora_dropout=float(s.get("dropout", 0.0)), bias="none", task_type="CAUSAL_LM")


def _settings(s: Any) -> Mapping[str, Any]:
    if isinstance(s, Mapping):
        return s
    if hasattr(s, "model_dump"):
        return s.model_dump()
    return vars(s)


def make_optimizer(model: Any, learning_rate: float, *, weight_decay: float = 0.0,
                   state_dir: str | Path | None = None) -> torch.optim.AdamW:
    """AdamW over the trainable (LoRA) parameters; restores its moments from ``state_dir/optimizer.pt`` if given."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay)
    if state_dir is not None and (Path(state_dir) / OPTIMIZER_FILE).exists():
        state = torch.load(Path(state_dir) / OPTIMIZER_FILE, map_location=params[0].device, weights_only=True)
        optimizer.load_state_dict(state)
        for group in optimizer.param_groups:  # the adapter's current settings win over the saved ones
            group["lr"], group["weight_decay"] = learning_rate, weight_decay
    return optimizer


def optimizer_step(model: Any, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = 1.0) -> float:
    """Clip the accumulated gradients, apply them, and clear them; return the pre-clip gradient norm."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


# ----------------------------------------------------------------------------------------------
# Tokenization and log-probabilities.


def _get(item: Any, name: str) -> str:
    value = item.get(name) if isinstance(item, Mapping) else getattr(item, name, None)
    if not isinstance(value, str):
        raise ValueError(f"a batch item has no text field {name!r}")
    return value


def _messages(item: Any) -> Sequence[Mapping[str, str]] | None:
    value = item.get("messages") if isinstance(item, Mapping) else getattr(item, "messages", None)
    return value or None


@dataclass(frozen=True)
class PromptedText:
    """An item's context and one of its answers as the model sees them.

    ``templated``: the text came from the chat template, which already holds the special tokens
    (so it is tokenized without adding any) and ends the answer with the template's end of turn.
    A raw prompt is tokenized as the completions API does (with the tokenizer's BOS), and the
    answer gets EOS appended.
    """

    prompt: str
    answer: str
    templated: bool


def prompted_text(tokenizer: Any, item: Any, answer_field: str) -> PromptedText:
    """The text to train or score for ``item``'s ``answer_field`` ("completion", "chosen" or "rejected").

    Chat items (``messages``) are rendered with the tokenizer's chat template exactly as vLLM's chat
    endpoint renders a request (``add_generation_prompt=True``, the template's default system turn
    included), so that what is trained is what is served. The answer is the text the template puts
    after that prompt for an assistant turn, cut after the end-of-turn token.
    """
    answer = _get(item, answer_field)
    messages = _messages(item)
    if messages is None:
        return PromptedText(_get(item, "prompt"), answer, templated=False)
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    prompt = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([*turns, {"role": "assistant", "content": answer}], tokenize=False)
    if not full.startswith(prompt):
        raise ValueError("the chat template renders an assistant turn that does not extend its generation prompt")
    reply = full[len(prompt):]
    eos = tokenizer.eos_token or ""
    cut = reply.find(eos, reply.find(answer) + len(answer)) if eos else -1
    reply = reply[: cut + len(eos)] if cut >= 0 else reply.rstrip() + eos  # generation stops at EOS
    return PromptedText(prompt, reply, templated=True)


def encode(tokenizer: Any, prompts: Sequence[str], completions: Sequence[str], *,
           max_length: int = DEFAULT_MAX_LENGTH, add_eos: bool = True,
           templated: Sequence[bool] | None = None) -> Encoded:
    """Tokenize prompt and completion separately, concatenate, right-pad; mark the completion tokens.

    ``templated[i]``: row i is chat-template text (see :class:`PromptedText`): no special tokens are
    added and no EOS is appended. Over ``max_length`` the prompt keeps at least half the budget, as
    its first token (BOS) plus its tail (the text right before the answer), and the completion keeps
    its head in the rest.
    """
    if len(prompts) != len(completions) or not prompts:
        raise ValueError("encode needs equally many prompts and completions, at least one")
    templated = list(templated) if templated is not None else [False] * len(prompts)
    p_ids = [tokenizer(p, add_special_tokens=not t)["input_ids"] for p, t in zip(prompts, templated)]
    c_ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []
    rows = [_fit(p, c + ([] if t else eos), max_length) for p, c, t in zip(p_ids, c_ids, templated)]
    width = max(len(p) + len(c) for p, c in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    comp = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        comp[i, len(p): len(p) + len(c)] = 1
    return Encoded(ids, attn, comp)


def _fit(prompt: list[int], completion: list[int], max_length: int) -> tuple[list[int], list[int]]:
    if max_length < 2:
        raise ValueError("max_length must be at least 2")
    if not prompt:
        raise ValueError("empty prompt after tokenization")
    if len(prompt) + len(completion) <= max_length:
        return prompt, completion
    keep_p = min(len(prompt), max(max_length // 2, max_length - len(completion)))
    prompt = prompt[:1] + (prompt[len(prompt) - (keep_p - 1):] if keep_p > 1 else [])
    return prompt, completion[: max_length - keep_p]


def token_logprobs(model: Any, enc: Encoded) -> torch.Tensor:
    """log π of each next token, shape [B, T-1] (position t scores token t+1); differentiable."""
    device = next(model.parameters()).device
    ids, attn = enc.input_ids.to(device), enc.attention_mask.to(device)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    # gather - logsumexp == log_softmax gathered, without a second [B, T, V] tensor (TRL does the same).
    return logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def completion_logprobs(model: Any, enc: Encoded) -> torch.Tensor:
    """Per-row sum of log π(token | prefix) over the completion tokens, shape [B]; differentiable."""
    logps = token_logprobs(model, enc)
    return (logps * enc.completion_mask[:, 1:].to(logps.device)).sum(dim=1)


@contextmanager
def _mode(model: Any, training: bool) -> Iterator[None]:
    was = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was)


def sequence_logprobs(model: Any, tokenizer: Any, prompts: Sequence[str], completions: Sequence[str], *,
                      batch_size: int = 8, max_length: int = DEFAULT_MAX_LENGTH,
                      templated: Sequence[bool] | None = None) -> list[float]:
    """log π(completion | prompt) for each pair (sum over completion tokens incl. EOS), in eval mode, batched."""
    out: list[float] = []
    templated = list(templated) if templated is not None else [False] * len(prompts)
    with torch.no_grad(), _mode(model, False):
        for i in range(0, len(prompts), batch_size):
            enc = encode(tokenizer, prompts[i: i + batch_size], completions[i: i + batch_size], max_length=max_length,
                         templated=templated[i: i + batch_size])
            out.extend(completion_logprobs(model, enc).tolist())
    return out


def sequence_logprob(model: Any, tokenizer: Any, prompt: str, completion: str, *,
                     max_length: int = DEFAULT_MAX_LENGTH) -> float:
    """log π(completion | prompt): the sum of the completion tokens' log-probabilities given the prompt."""
    return sequence_logprobs(model, tokenizer, [prompt], [completion], max_length=max_length)[0]


# ----------------------------------------------------------------------------------------------
# Training micro-steps: forward + backward; the caller runs optimizer_step after its accumulation.


def sft_step(model: Any, tokenizer: Any, batch: Sequence[Any], *, scale: float = 1.0,
             max_length: int = DEFAULT_MAX_LENGTH) -> StepStats:
    """Cross-entropy on the completion tokens only (prompt masked), token mean over the batch; backward(loss·scale).

    ``batch``: items with ``prompt`` and ``completion`` (FeedbackItem or mappings). ``scale`` = 1/k for
    gradient accumulation over k micro-batches.
    """
    texts = [prompted_text(tokenizer, b, "completion") for b in batch]
    enc = encode(tokenizer, [t.prompt for t in texts], [t.answer for t in texts], max_length=max_length,
                 templated=[t.templated for t in texts])
    with _mode(model, True):
        logps = token_logprobs(model, enc)
    mask = enc.completion_mask[:, 1:].to(logps.device)
    per_sample = -(logps * mask).sum(1) / mask.sum(1).clamp(min=1)
    loss = -(logps * mask).sum() / mask.sum().clamp(min=1)
    (loss * scale).backward()
    loss = loss.detach()
    return StepStats(loss=loss.item(), samples=len(batch), tokens=int(enc.attention_mask.sum()),
                     per_sample_loss=per_sample.detach().tolist())


def _dpo_logits(model: Any, tokenizer: Any, batch: Sequence[Any], beta: float, max_length: int,
                grad: bool) -> tuple[torch.Tensor, Encoded]:
    """β·(Δ⁺ − Δ⁻) per pair, Δ = log π_θ(y|x) − log π_ref(y|x), π_ref = the model with its adapter disabled."""
    texts = ([prompted_text(tokenizer, b, "chosen") for b in batch]
             + [prompted_text(tokenizer, b, "rejected") for b in batch])  # rows: chosen..., rejected...
    enc = encode(tokenizer, [t.prompt for t in texts], [t.answer for t in texts], max_length=max_length,
                 templated=[t.templated for t in texts])
    # Reference first, without grad and in eval mode (no dropout noise in π_ref); no second weight copy.
    with torch.no_grad(), _mode(model, False), model.disable_adapter():
        ref = completion_logprobs(model, enc)
    with torch.set_grad_enabled(grad), _mode(model, grad):
        policy = completion_logprobs(model, enc)
    (pc, pr), (rc, rr) = policy.chunk(2), ref.chunk(2)
    return beta * ((pc - rc) - (pr - rr)), enc


def dpo_step(model: Any, tokenizer: Any, batch: Sequence[Any], beta: float, *, scale: float = 1.0,
             max_length: int = DEFAULT_MAX_LENGTH) -> StepStats:
    """DPO sigmoid loss −log σ(β·(Δ⁺ − Δ⁻)), mean over pairs (MACE §3.1 L_DPO); runs backward(loss·scale).

    MACE writes L_DPO = E[log σ(·)] as the objective to maximise; the loss minimised here is its
    negative, as in the DPO paper and TRL. ``batch``: items with ``prompt``, ``chosen``, ``rejected``.
    """
    logits, enc = _dpo_logits(model, tokenizer, batch, beta, max_length, grad=True)
    losses = -F.logsigmoid(logits)
    loss = losses.mean()
    (loss * scale).backward()
    loss = loss.detach()
    return StepStats(loss=loss.item(), samples=len(batch), tokens=int(enc.attention_mask.sum()),
                     per_sample_loss=losses.detach().tolist(), reward_margin=float(logits.detach().mean()))


def dpo_sample_losses(model: Any, tokenizer: Any, batch: Sequence[Any], beta: float, *,
                      max_length: int = DEFAULT_MAX_LENGTH) -> list[float]:
    """Per-pair DPO loss without gradients: the alignment reward γ·L_DPO that MACE §4.1 adds to a sample's priority."""
    logits, _ = _dpo_logits(model, tokenizer, batch, beta, max_length, grad=False)
    return (-F.logsigmoid(logits)).tolist()


# ----------------------------------------------------------------------------------------------
# Token-level fine-tuning (FlexLLM §6.1): one training pass over an item, run as token windows.

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
            with torch.no_grad(), _mode(self.model, False), self.model.disable_adapter():
                logits = self.model(input_ids=ids, position_ids=positions, past_key_values=seg.ref_cache,
                                    use_cache=True).logits
                ref = self._logp_sum(logits, seg, a, b)
            seg.ref_logp = ref if seg.ref_logp is None else seg.ref_logp + ref
        past = [(torch.cat(kv[0::2], dim=-2), torch.cat(kv[1::2], dim=-2)) for kv in seg.past]
        cache = _capturing_cache_class()(past)
        with _mode(self.model, True):
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
                margin = self.beta * ((sums[0] - chosen.ref_logp) - (sums[1] - rejected.ref_logp))
                loss = -F.logsigmoid(margin)
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


# ----------------------------------------------------------------------------------------------
# Alignment metrics.


def evaluate_preferences(model: Any, tokenizer: Any, pairs: Sequence[Any], *, batch_size: int = 8,
                         max_length: int = DEFAULT_MAX_LENGTH) -> PreferenceEval:
    """Win rate and CLPD of the policy on preference pairs, as defined in MACE §3.1.

    Win rate = E[1[π_θ(y⁺|x) > π_θ(y⁻|x)]] (strict: ties lose); CLPD = E[log π_θ(y⁺|x) − log π_θ(y⁻|x)].
    π_θ(y|x) is the whole-sequence probability (sum of token log-probs, not length-normalised), as
    the paper's formulas state. ``pairs``: items with ``prompt``, ``chosen``, ``rejected``.
    """
    if not pairs:
        raise ValueError("evaluate_preferences needs at least one pair")
    def score(field: str) -> list[float]:
        texts = [prompted_text(tokenizer, p, field) for p in pairs]
        return sequence_logprobs(model, tokenizer, [t.prompt for t in texts], [t.answer for t in texts],
                                 batch_size=batch_size, max_length=max_length, templated=[t.templated for t in texts])

    chosen, rejected = score("chosen"), score("rejected")
    return preference_eval([c - r for c, r in zip(chosen, rejected)])


@dataclass(frozen=True)
class CompletionEval:
    """How likely the policy finds held-out SFT completions: the quality gate's score of an sft adapter."""

    token_logprob: float  # Σ log π(completion tokens) / number of completion tokens, over all items
    items: int
    tokens: int
    per_item: tuple[tuple[float, int], ...] = ()  # (Σ log π over its completion tokens, their number), in order


def evaluate_completions(model: Any, tokenizer: Any, items: Sequence[Any], *, field: str = "completion",
                         batch_size: int = 8, max_length: int = DEFAULT_MAX_LENGTH) -> CompletionEval:
    """Mean per-token log-likelihood of each item's ``field`` given its context, in eval mode.

    The token mean over the whole set is the negative of the SFT loss (``sft_step``) on it, so a
    version that trains well on this distribution scores higher. ``field`` "chosen" scores the
    better answers of preference pairs.
    """
    if not items:
        raise ValueError("evaluate_completions needs at least one item")
    per_item: list[tuple[float, int]] = []
    with torch.no_grad(), _mode(model, False):
        for i in range(0, len(items), batch_size):
            texts = [prompted_text(tokenizer, it, field) for it in items[i: i + batch_size]]
            enc = encode(tokenizer, [t.prompt for t in texts], [t.answer for t in texts], max_length=max_length,
                         templated=[t.templated for t in texts])
            sums = completion_logprobs(model, enc).tolist()
            counts = enc.completion_mask[:, 1:].sum(dim=1).tolist()
            per_item += [(float(s), int(n)) for s, n in zip(sums, counts)]
    return completion_eval(per_item)


def completion_eval(per_item: Sequence[tuple[float, int]]) -> CompletionEval:
    """The set's score from its items' (log-likelihood sum, token count): the token mean over all of them."""
    total, tokens = sum(s for s, _ in per_item), sum(n for _, n in per_item)
    return CompletionEval(token_logprob=total / max(tokens, 1), items=len(per_item), tokens=tokens,
                          per_item=tuple(per_item))


def preference_eval(diffs: Sequence[float]) -> PreferenceEval:
    """MACE §3.1's win rate and CLPD from each pair's log π(y⁺|x) − log π(y⁻|x)."""
    return PreferenceEval(win_rate=sum(d > 0 for d in diffs) / len(diffs), clpd=sum(diffs) / len(diffs),
                          pairs=len(diffs), diffs=tuple(diffs))


def read_preference_jsonl(path: str | Path, *, limit: int | None = None,
                          max_text_bytes: int | None = None) -> list[dict[str, str]]:
    """Load ``{prompt, chosen, rejected}`` pairs from a JSONL file (e.g. the HH-RLHF samples), optionally truncated.

    ``max_text_bytes`` cuts each text to that many UTF-8 bytes (on a character boundary): with the
    byte-level embedded tokenizer, bytes are tokens.
    """
    pairs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(pairs) >= limit:
                break
            if line.strip():
                row = json.loads(line)
                pairs.append({k: _cut(row[k], max_text_bytes) for k in ("prompt", "chosen", "rejected")})
    return pairs


def _cut(text: str, max_bytes: int | None) -> str:
    if max_bytes is None:
        return text
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


# ----------------------------------------------------------------------------------------------
# Adapter versions on disk: <root>/<adapter>/v<version>/, written atomically.


def save_adapter_version(model: Any, optimizer: torch.optim.Optimizer | None, root: str | Path,
                         adapter_name: str, version: int, meta: Mapping[str, Any] | None = None, *,
                         peft_name: str | None = None) -> Path:
    """Write the adapter (vLLM-loadable peft files), ``optimizer.pt`` and ``meta.json`` to ``v<version>`` atomically.

    Everything goes into a temporary sibling directory, every file and the directory are fsynced,
    then one ``os.rename`` makes the version visible: a reader sees the whole version or none.
    Raises FileExistsError if the version exists (numbers come from FeedbackStore.reserve_version).
    """
    final = version_dir(root, adapter_name, version)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        raise FileExistsError(f"{final} already exists; versions are immutable")
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{final.name}-", dir=final.parent))
    try:
        if peft_name is None:
            model.save_pretrained(str(tmp), safe_serialization=True)
        else:
            write_peft_adapter(model, peft_name, tmp)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        info = {"adapter": adapter_name, "version": int(version), "created_at": time.time(), **(meta or {})}
        (tmp / META_FILE).write_text(json.dumps(info, indent=2, sort_keys=True, default=str))
        missing = [f for f in ADAPTER_FILES if not (tmp / f).exists()]
        if missing:
            raise RuntimeError(f"peft did not write {missing}; vLLM could not load this adapter")
        fsync_tree(tmp)
        os.rename(tmp, final)  # atomic within one file system; fails if final appeared meanwhile
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_peft_adapter(model: Any, peft_name: str, out: str | Path) -> None:
    """Write one adapter of a multi-adapter ``PeftModel`` as a plain, vLLM-loadable adapter directory.

    ``save_pretrained`` puts every adapter but ``default`` into a subdirectory named after it, which
    vLLM would not find; this writes the same two files at the top of ``out``.
    """
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = get_peft_model_state_dict(model, adapter_name=peft_name)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()},
              str(Path(out) / "adapter_model.safetensors"), metadata={"format": "pt"})
    model.peft_config[peft_name].save_pretrained(str(out))


def latest_version(root: str | Path, adapter_name: str, *,
                   clean_temp_older_than_s: float | None = 60.0) -> tuple[int, Path] | None:
    """The newest complete ``v<N>`` of an adapter on disk, or None; removes leftover temp dirs of crashed saves.

    Only temp dirs older than ``clean_temp_older_than_s`` are removed (None: keep all), so a save in
    progress in another process is not pulled from under it. Which version is *published* is the
    FeedbackStore's business: resume from ``store.current_version(...)``, not from this.
    """
    base = Path(root) / adapter_name
    if not base.is_dir():
        return None
    best: tuple[int, Path] | None = None
    now = time.time()
    for entry in base.iterdir():
        if entry.name.startswith(TEMP_PREFIX):
            if clean_temp_older_than_s is not None and now - entry.stat().st_mtime >= clean_temp_older_than_s:
                shutil.rmtree(entry, ignore_errors=True)
            continue
        m = VERSION_DIR_RE.match(entry.name)
        if m and entry.is_dir() and is_complete_version(entry) and (best is None or int(m[1]) > best[0]):
            best = (int(m[1]), entry)
    return best


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta.json`` of a version directory."""
    return json.loads((Path(path) / META_FILE).read_text())
