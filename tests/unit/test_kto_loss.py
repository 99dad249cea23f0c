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
    got = kto_losses(
        policy,
        ref,
        torch.tensor([True, False]),
        beta=0.1,
        reference_point=0.5,
        desirable_weight=2.0,
        undesirable_weight=0.5,
    )
    assert got.tolist() == pytest.approx([2 * (1 - 0.537430), 0.5 * (1 - sigmoid(-0.15))], abs=1e-6)
    # z₀ below 0 is clamped to 0 (the KL estimate cannot be negative), and carries no gradient.
    z0 = torch.tensor(-3.0, requires_grad=True)
    assert kto_losses(policy[:1], ref[:1], torch.tensor([True]), 0.1, reference_point=z0).item() == pytest.approx(
        0.450166, abs=1e-6
    )


def test_the_kto_gradient_raises_a_liked_answer_and_lowers_a_disliked_one():
    policy = torch.tensor([-10.0, -10.0], requires_grad=True)
    loss = kto_losses(policy, torch.tensor([-12.0, -12.0]), torch.tensor([True, False]), beta=0.1).sum()
    loss.backward()
    # d/dr (1 - σ(βr)) = -β σ(βr)(1 - σ(βr)) = -0.1 · 0.549834 · 0.450166 = -0.024751
    assert policy.grad.tolist() == pytest.approx([-0.0247517, 0.0247517], abs=1e-6)


def test_dpo_and_kto_share_the_log_ratio():
    pc, pr, rc, rr = (torch.tensor(v) for v in (-5.0, -9.0, -6.0, -7.0))
    assert reward_margin(pc, pr, rc, rr, 0.5).item() == pytest.approx(
        0.5 * (log_ratio(pc, rc) - log_ratio(pr, rr)).item()
    )
    assert reward_margin(pc, pr, rc, rr, 0.5).item() == pytest.approx(0.5 * ((-5 + 6) - (-9 + 7)))


def test_a_kto_score_follows_the_evidence_rule_of_a_mean_of_item_changes():
    """The gate judges a kto adapter on its signed label log-likelihood with sft's rule: a mean of per-item
    changes, thin below the items that can show the margin, a measured drop rejected."""
    from planners.gate import judge

    thin = judge("kto", -2.0, -2.0, 0.05, items=1, baseline_name="v1", item_changes=[0.0])
    assert thin.passed and thin.thin and "signed label log-likelihood" in thin.reason
    changes = [0.01, -0.01, 0.02, 0.0] * 25  # 100 items, spread ~0.012: the mean's noise ~0.0025
    assert not judge("kto", -2.0, -2.0, 0.05, items=100, baseline_name="v1", item_changes=changes).thin
    dropped = judge("kto", -2.2, -2.0, 0.05, items=100, baseline_name="v1", item_changes=changes)
    assert not dropped.passed and "more than the margin" in dropped.reason
