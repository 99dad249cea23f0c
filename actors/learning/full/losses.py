"""The pipeline's losses on the last stage: completion-token cross-entropy (SFT), DPO on precomputed reference log-probs.

Labels arrive as tensors beside the logits (DeepSpeed hands the last stage ``labels`` of each
micro-batch): ``targets`` [B, T] (the next token at each position), ``mask`` [B, T] (1 where the
target is a completion token) and, for DPO, ``ref`` [B] (the reference's sequence log-prob of
each row). DPO rows are ``chosen..., rejected...`` of the same pairs.
"""

from __future__ import annotations

from typing import Literal

import torch

from actors.learning.dpo_loss import pair_losses, reward_margin

LossMode = Literal["sft", "dpo", "logp"]


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at each position, [B, T] (float32 for the softmax whatever the activations' dtype)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed log-prob of each row's completion tokens, [B]."""
    return (token_logps(logits, targets) * mask).sum(1)


def sft_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood over the micro-batch's completion tokens (the prompt is masked out)."""
    return -(token_logps(logits, targets) * mask).sum() / mask.sum().clamp(min=1)


def dpo_logits(policy: torch.Tensor, ref: torch.Tensor, beta: float) -> torch.Tensor:
    """β·((log π(y⁺) − log π_ref(y⁺)) − (log π(y⁻) − log π_ref(y⁻))) per pair: the reward margin."""
    (pc, pr), (rc, rr) = policy.chunk(2), ref.chunk(2)
    return reward_margin(pc, pr, rc, rr, beta)


def dpo_loss(policy: torch.Tensor, ref: torch.Tensor, beta: float) -> torch.Tensor:
    """The DPO sigmoid loss −log σ(margin), mean over pairs."""
    return pair_losses(dpo_logits(policy, ref, beta)).mean()


class PipelineLoss:
    """``PipelineModule.loss_fn``: one object per stage whose ``mode`` the stage sets before each batch.

    ``logp`` (with ``eval_batch``, to compute DPO's reference log-probs and measure reward margins)
    appends each micro-batch's per-row sequence log-probs to ``rows`` and returns their sum: DeepSpeed
    adds the losses of a batch's micro-batches together, which needs one shape for all of them.
    """

    def __init__(self, beta: float = 0.1) -> None:
        self.mode: LossMode = "sft"
        self.beta = beta
        self.rows: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: tuple[torch.Tensor, ...]) -> torch.Tensor:
        targets, mask = labels[0], labels[1].to(logits.dtype if logits.is_floating_point() else torch.float32)
        if self.mode == "sft":
            return sft_loss(logits, targets, mask)
        seq = sequence_logps(logits, targets, mask.float())
        if self.mode == "logp":
            self.rows.append(seq.detach().cpu())
            return seq.detach().sum()
        return dpo_loss(seq, labels[2], self.beta)
