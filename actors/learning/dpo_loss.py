"""The one DPO loss every trainer here uses: LoRA steps, token-windowed passes and full-model pipeline stages.

DPO's sigmoid loss (Rafailov et al. 2023; MACE §3.1 L_DPO; TRL's ``loss_type="sigmoid"``):
margin = β·((log π_θ(y⁺|x) − log π_ref(y⁺|x)) − (log π_θ(y⁻|x) − log π_ref(y⁻|x))), loss = −log σ(margin).
MACE writes L_DPO = E[log σ(·)] as the objective to maximise; the loss minimised is its negative.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reward_margin(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                  ref_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """β·(Δ⁺ − Δ⁻) per pair, Δ = log π_θ(y|x) − log π_ref(y|x) (summed completion log-probs)."""
    return beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))


def pair_losses(margin: torch.Tensor) -> torch.Tensor:
    """−log σ(margin) per pair."""
    return -F.logsigmoid(margin)
