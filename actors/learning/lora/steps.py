"""LoRA training primitives for the co-located trainer: loading, SFT/DPO micro-steps, atomic adapter versions.

Everything here is a plain function on a ``peft`` model, so a Ray Train worker loop can run one
micro-step at a time between planner grants (docs/learning.md):

    model, tok = load_lora_model(model_dir, spec.lora, adapter_dir=current.path if current else None)
    opt = make_optimizer(model, spec.learning_rate, state_dir=current.path if current else None)
    stats = dpo_step(model, tok, items, beta=spec.beta, scale=1 / accum)   # forward + backward
    optimizer_step(model, opt)                                             # clip, step, zero_grad
    path = save_adapter_version(model, opt, root, spec.name, version, meta)

When the node scheduler grants token windows instead of whole samples (FlexLLM §6.1),
``actors/learning/lora/windowed_pass.py`` runs one item across several grants and leaves the same gradient;
``actors/learning/lora/alignment.py`` scores versions (win rate, CLPD, completion log-likelihood).

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

import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from actors.learning.dpo_loss import pair_losses, reward_margin
from actors.learning.versions.layout import (  # noqa: F401 (part of this module's API)
    ADAPTER_FILES,
    META_FILE,
    OPTIMIZER_FILE,
    TEMP_PREFIX,
    fsync_dir,
    fsync_tree,
    version_dir,
)

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


def load_lora_model(
    model_dir: str | Path,
    lora_settings: Any,
    adapter_dir: str | Path | None = None,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any]:
    """Return ``(peft_model, tokenizer)``: the base model with a fresh LoRA adapter, or resumed from ``adapter_dir``.

    ``lora_settings`` has ``r``, ``alpha``, ``target_modules``, ``dropout`` (``actors.learning.store.models.LoraSettings``
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
    targets = s["target_modules"]  # a list of names, or peft's "all-linear" shorthand (a string)
    return LoraConfig(
        r=int(s["r"]),
        lora_alpha=float(s["alpha"]),
        target_modules=targets if isinstance(targets, str) else list(targets),
        lora_dropout=float(s.get("dropout", 0.0)),
        bias="none",
        task_type="CAUSAL_LM",
    )


def _settings(s: Any) -> Mapping[str, Any]:
    if isinstance(s, Mapping):
        return s
    if hasattr(s, "model_dump"):
        return s.model_dump()
    return vars(s)


def make_optimizer(
    model: Any, learning_rate: float, *, weight_decay: float = 0.0, state_dir: str | Path | None = None
) -> torch.optim.AdamW:
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
    reply = full[len(prompt) :]
    eos = tokenizer.eos_token or ""
    cut = reply.find(eos, reply.find(answer) + len(answer)) if eos else -1
    reply = reply[: cut + len(eos)] if cut >= 0 else reply.rstrip() + eos  # generation stops at EOS
    return PromptedText(prompt, reply, templated=True)


def encode(
    tokenizer: Any,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    add_eos: bool = True,
    templated: Sequence[bool] | None = None,
) -> Encoded:
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
        comp[i, len(p) : len(p) + len(c)] = 1
    return Encoded(ids, attn, comp)


def _fit(prompt: list[int], completion: list[int], max_length: int) -> tuple[list[int], list[int]]:
    if max_length < 2:
        raise ValueError("max_length must be at least 2")
    if not prompt:
        raise ValueError("empty prompt after tokenization")
    if len(prompt) + len(completion) <= max_length:
        return prompt, completion
    keep_p = min(len(prompt), max(max_length // 2, max_length - len(completion)))
    prompt = prompt[:1] + (prompt[len(prompt) - (keep_p - 1) :] if keep_p > 1 else [])
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
def model_mode(model: Any, training: bool) -> Iterator[None]:
    was = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was)


def sequence_logprobs(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    batch_size: int = 8,
    max_length: int = DEFAULT_MAX_LENGTH,
    templated: Sequence[bool] | None = None,
) -> list[float]:
    """log π(completion | prompt) for each pair (sum over completion tokens incl. EOS), in eval mode, batched."""
    out: list[float] = []
    templated = list(templated) if templated is not None else [False] * len(prompts)
    with torch.no_grad(), model_mode(model, False):
        for i in range(0, len(prompts), batch_size):
            enc = encode(
                tokenizer,
                prompts[i : i + batch_size],
                completions[i : i + batch_size],
                max_length=max_length,
                templated=templated[i : i + batch_size],
            )
            out.extend(completion_logprobs(model, enc).tolist())
    return out


# ----------------------------------------------------------------------------------------------
# Training micro-steps: forward + backward; the caller runs optimizer_step after its accumulation.


def sft_step(
    model: Any, tokenizer: Any, batch: Sequence[Any], *, scale: float = 1.0, max_length: int = DEFAULT_MAX_LENGTH
) -> StepStats:
    """Cross-entropy on the completion tokens only (prompt masked), token mean over the batch; backward(loss·scale).

    ``batch``: items with ``prompt`` and ``completion`` (FeedbackItem or mappings). ``scale`` = 1/k for
    gradient accumulation over k micro-batches.
    """
    texts = [prompted_text(tokenizer, b, "completion") for b in batch]
    enc = encode(
        tokenizer,
        [t.prompt for t in texts],
        [t.answer for t in texts],
        max_length=max_length,
        templated=[t.templated for t in texts],
    )
    with model_mode(model, True):
        logps = token_logprobs(model, enc)
    mask = enc.completion_mask[:, 1:].to(logps.device)
    per_sample = -(logps * mask).sum(1) / mask.sum(1).clamp(min=1)
    loss = -(logps * mask).sum() / mask.sum().clamp(min=1)
    (loss * scale).backward()
    loss = loss.detach()
    return StepStats(
        loss=loss.item(),
        samples=len(batch),
        tokens=int(enc.attention_mask.sum()),
        per_sample_loss=per_sample.detach().tolist(),
    )


def completion_token_weights(mask: torch.Tensor, first_tokens: int, weight: float) -> torch.Tensor:
    """Per-token loss weights over a completion mask [B, T]: ``weight`` on each row's first ``first_tokens``
    completion tokens, 1 on the rest, 0 off the completion (issue 37: an opening phrase is a few tokens among
    many content tokens, which dominate the mean loss)."""
    position = torch.cumsum(mask, dim=1)  # 1 on the first completion token, 2 on the next, ...
    return mask * torch.where(
        position <= first_tokens,
        torch.full_like(mask, weight, dtype=torch.float32),
        torch.ones_like(mask, dtype=torch.float32),
    )


def sft_step_first_weighted(
    model: Any,
    tokenizer: Any,
    batch: Sequence[Any],
    *,
    first_tokens: int,
    weight: float,
    scale: float = 1.0,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> StepStats:
    """:func:`sft_step` with the completion's first ``first_tokens`` tokens weighted ``weight`` in the mean loss
    (Σ w·NLL / Σ w); ``weight`` 1 is exactly :func:`sft_step`."""
    texts = [prompted_text(tokenizer, b, "completion") for b in batch]
    enc = encode(
        tokenizer,
        [t.prompt for t in texts],
        [t.answer for t in texts],
        max_length=max_length,
        templated=[t.templated for t in texts],
    )
    with model_mode(model, True):
        logps = token_logprobs(model, enc)
    w = completion_token_weights(enc.completion_mask[:, 1:].to(logps.device).float(), first_tokens, weight)
    per_sample = -(logps * w).sum(1) / w.sum(1).clamp(min=1e-9)
    loss = -(logps * w).sum() / w.sum().clamp(min=1e-9)
    (loss * scale).backward()
    return StepStats(
        loss=loss.detach().item(),
        samples=len(batch),
        tokens=int(enc.attention_mask.sum()),
        per_sample_loss=per_sample.detach().tolist(),
    )


def _dpo_logits(
    model: Any, tokenizer: Any, batch: Sequence[Any], beta: float, max_length: int, grad: bool
) -> tuple[torch.Tensor, Encoded]:
    """β·(Δ⁺ − Δ⁻) per pair, Δ = log π_θ(y|x) − log π_ref(y|x), π_ref = the model with its adapter disabled."""
    texts = [prompted_text(tokenizer, b, "chosen") for b in batch] + [
        prompted_text(tokenizer, b, "rejected") for b in batch
    ]  # rows: chosen..., rejected...
    enc = encode(
        tokenizer,
        [t.prompt for t in texts],
        [t.answer for t in texts],
        max_length=max_length,
        templated=[t.templated for t in texts],
    )
    # Reference first, without grad and in eval mode (no dropout noise in π_ref); no second weight copy.
    with torch.no_grad(), model_mode(model, False), model.disable_adapter():
        ref = completion_logprobs(model, enc)
    with torch.set_grad_enabled(grad), model_mode(model, grad):
        policy = completion_logprobs(model, enc)
    (pc, pr), (rc, rr) = policy.chunk(2), ref.chunk(2)
    return reward_margin(pc, pr, rc, rr, beta), enc


def dpo_step(
    model: Any,
    tokenizer: Any,
    batch: Sequence[Any],
    beta: float,
    *,
    scale: float = 1.0,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> StepStats:
    """DPO sigmoid loss −log σ(β·(Δ⁺ − Δ⁻)), mean over pairs (MACE §3.1 L_DPO); runs backward(loss·scale).

    MACE writes L_DPO = E[log σ(·)] as the objective to maximise; the loss minimised here is its
    negative, as in the DPO paper and TRL. ``batch``: items with ``prompt``, ``chosen``, ``rejected``.
    """
    logits, enc = _dpo_logits(model, tokenizer, batch, beta, max_length, grad=True)
    losses = pair_losses(logits)
    loss = losses.mean()
    (loss * scale).backward()
    loss = loss.detach()
    return StepStats(
        loss=loss.item(),
        samples=len(batch),
        tokens=int(enc.attention_mask.sum()),
        per_sample_loss=losses.detach().tolist(),
        reward_margin=float(logits.detach().mean()),
    )


# ----------------------------------------------------------------------------------------------
# Adapter versions on disk: <root>/<adapter>/v<version>/, written atomically.


def save_adapter_version(
    model: Any,
    optimizer: torch.optim.Optimizer | None,
    root: str | Path,
    adapter_name: str,
    version: int,
    meta: Mapping[str, Any] | None = None,
    *,
    peft_name: str | None = None,
) -> Path:
    """Write the adapter (vLLM-loadable peft files), ``optimizer.pt`` and ``meta.json`` to ``v<version>`` atomically.

    Everything goes into a temporary sibling directory, every file and the directory are fsynced,
    then one ``os.rename`` makes the version visible: a reader sees the whole version or none.
    Raises FileExistsError if the version exists (numbers come from FeedbackDatabase.reserve_version).
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
    save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in state.items()},
        str(Path(out) / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    model.peft_config[peft_name].save_pretrained(str(out))


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta.json`` of a version directory."""
    return json.loads((Path(path) / META_FILE).read_text())
