"""KTO's loss (Ethayarajh et al. 2024, Eq. 8) against values computed by hand, and its shared building blocks."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from actors.learning.dpo_loss import kto_losses, log_ratio, reward_margin  # noqa: E402


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kto_loss_matches_the_hand_computed_value():
    # log π_θ(y|x) = -10, log π_ref(y|x) = -12: r = 2; β = 0.1, z₀ = 0.
    # up:   1 - σ(0.1·2)  = 1 - 0.549834 = 0.450166
    # down: 1 - σ(-0.1·2) = 1 - 0.450166 = 0.549834
    policy, ref = torch.tensor([-10.0, -10.0]), torch.tensor([-12.0, -12.0])
    got = kto_losses(policy, ref, torch.tensor([True, False]), beta=0.1)
    assert got.tolist() == pytest.approx([0.450166, 0.549834], abs=1e-6)
    # A reference point z₀ = 0.5 moves both: σ(0.1·1.5) = 0.537430, and λ_D = 2, λ_U = 0.5 weigh them.
    got = kto_losses(policy, ref, torch.tensor([True, False]), beta=0.1, reference_point=0.5,
                     desirable_weight=2.0, undesirable_weight=0.5)
    assert got.tolist() == pytest.approx([2 * (1 - 0.537430), 0.5 * (1 - sigmoid(-0.15))], abs=1e-6)
    # z₀ below 0 is clamped to 0 (the KL estimate cannot be negative), and carries no gradient.
    z0 = torch.tensor(-3.0, requires_grad=True)
    assert kto_losses(policy[:1], ref[:1], torch.tensor([True]), 0.1, reference_point=z0).item() == \
        pytest.approx(0.450166, abs=1e-6)


def test_the_kto_gradient_raises_a_liked_answer_and_lowers_a_disliked_one():
    policy = torch.tensor([-10.0, -10.0], requires_grad=True)
    loss = kto_losses(policy, torch.tensor([-12.0, -12.0]), torch.tensor([True, False]), beta=0.1).sum()
    loss.backward()
    # d/dr (1 - σ(βr)) = -β σ(βr)(1 - σ(βr)) = -0.1 · 0.549834 · 0.450166 = -0.024751
    assert policy.grad.tolist() == pytest.approx([-0.0247517, 0.0247517], abs=1e-6)


def test_dpo_and_kto_share_the_log_ratio():
    pc, pr, rc, rr = (torch.tensor(v) for v in (-5.0, -9.0, -6.0, -7.0))
    assert reward_margin(pc, pr, rc, rr, 0.5).item() == pytest.approx(0.5 * (log_ratio(pc, rc) - log_ratio(pr, rr)).item())
    assert reward_margin(pc, pr, rc, rr, 0.5).item() == pytest.approx(0.5 * ((-5 + 6) - (-9 + 7)))
