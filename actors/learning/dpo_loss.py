"""The preference losses every trainer here uses, from one set of building blocks: DPO (pairs) and KTO (unpaired labels).

DPO's sigmoid loss (Rafailov et al. 2023; MACE §3.1 L_DPO; TRL's ``loss_type="sigmoid"``):
margin = β·((log π_θ(y⁺|x) − log π_ref(y⁺|x)) − (log π_θ(y⁻|x) − log π_ref(y⁻|x))), loss = −log σ(margin).
MACE writes L_DPO = E[log σ(·)] as the objective to maximise; the loss minimised is its negative.

KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", Eq. 8): one answer y
labelled desirable or undesirable, r = log π_θ(y|x) − log π_ref(y|x) (the same implicit reward as DPO's Δ),
z₀ the reference point (the policy's KL from the reference, not differentiated), and
v = λ_D·σ(β·(r − z₀)) for a desirable answer, λ_U·σ(β·(z₀ − r)) for an undesirable one; loss = λ_y − v.

The reference point z₀ = KL(π_θ(y'|x) ‖ π_ref(y'|x)). The paper (§4.1, the implementation notes beside Eq. 8)
estimates it per batch of m labelled examples from *mismatched* pairs: each prompt x_i with another example's
answer y_j, ẑ₀ = max(0, (1/m)·Σ_i log π_θ(y_j|x_i)/π_ref(y_j|x_i)), not back-propagated; TRL's KTOTrainer does
the same by cycling the batch's completions by one (``KL_completion_ids``) and clamping the detached mean at 0.
The live trainer here passes z₀ = 0, the estimate's lower clamp: it trains a token-windowed pass over one item
at a time (``WindowedPass``), which has no other item's answer to mismatch with, and a mismatched forward would
double each item's policy and reference work. With z₀ = 0 a fresh adapter (r = 0) has exactly the paper's loss
(ẑ₀ is 0 there too); as the policy drifts, an upward drift on every answer is no longer charged against the
desirable ones' gain, so the gate's held-out label score (and the retention set) are what bound it.
``kto_losses`` takes any z₀ (a tensor or a float) for a caller that estimates it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def log_ratio(policy: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Δ = log π_θ(y|x) − log π_ref(y|x) (summed completion log-probs): the implicit reward over β of DPO and KTO."""
    return policy - ref


def reward_margin(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """β·(Δ⁺ − Δ⁻) per pair, Δ = log π_θ(y|x) − log π_ref(y|x) (summed completion log-probs)."""
    return beta * (log_ratio(policy_chosen, ref_chosen) - log_ratio(policy_rejected, ref_rejected))


def pair_losses(margin: torch.Tensor) -> torch.Tensor:
    """−log σ(margin) per pair."""
    return -F.logsigmoid(margin)


def kto_losses(
    policy: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor,
    beta: float,
    reference_point: torch.Tensor | float = 0.0,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """KTO's loss λ_y − v(x, y) per labelled answer (Ethayarajh et al. 2024, Eq. 8).

    ``desirable``: a bool tensor, True for a thumbs-up. ``reference_point``: z₀, the KL estimate (detached here,
    as the paper does not differentiate it; clamped at 0 as TRL's KTOTrainer does).
    """
    z0 = torch.as_tensor(reference_point, dtype=policy.dtype, device=policy.device).detach().clamp(min=0)
    r = log_ratio(policy, ref)
    up = desirable_weight * (1 - torch.sigmoid(beta * (r - z0)))
    down = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r)))
    return torch.where(desirable.to(torch.bool), up, down)
