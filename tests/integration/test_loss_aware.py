"""MACE's loss-aware pieces in the live app: the reported loss orders the grants, CheckEnd requeues.

The session app's real trainer reports every item's loss after each pass (MACE §4.1's L_DPO; an
SFT item's mean token NLL) and the planner's node schedulers use it: CheckEnd (MACE Alg. 1 lines
17–21) sends an item whose loss is above ``loss_threshold`` back for another pass, at most
``max_passes`` passes, and the γ·L term of its priority decides which of the requeued items the
next grants serve first. The test switches the iteration params live (``Planner.set_policies``)
and restores them afterwards.
"""

from __future__ import annotations

import time
from itertools import pairwise

import pytest
import ray

from tests.helpers import restore_policies, switch_policies
from tests.integration.test_learning import (  # noqa: F401
    _adapter,
    _create,
    _feedback,
    _status,
    _version_model,
    cfg,
    store,
    trainer,
)

# Four SFT items whose first-pass losses (base model: a fresh LoRA adds nothing) differ clearly.
TEXTS = [
    ("Say a colour:", " blue"),
    ("Count to five:", " 1 2 3 4 5"),
    ("What is 2+2?", " 4, of course."),
    ("Spell 'cat' backwards:", " tac"),
    ("Name a day:", " Monday."),
    ("Repeat: zzzz", " zzzz zzzz"),
]


def _first_pass_losses(config, items: list[dict]) -> list[float]:
    """Each item's mean token NLL as the trainer's first pass computes it (WindowedPass on a fresh LoRA)."""
    from actors.learning.lora.windowed_pass import WindowedPass

    model, tok = _version_model(config, None)
    out = []
    for it in items:
        p = WindowedPass(model, tok, it, "sft", max_length=config.training.max_length)
        p.forward(p.length)
        out.append(p.finish().loss)
    return out


def _grants(app_url: str, adapter: str) -> dict[int, list[dict]]:
    """node -> the planner's recent non-empty grants for ``adapter``, oldest first."""
    return {
        n["node_id"]: [g for g in n["training_grants"]["recent"] if g["adapter"] == adapter and g["samples"]]
        for n in _status(app_url)["nodes"]
    }


def _verdicts(app_url: str, adapter: str) -> list[dict]:
    return sorted(
        (
            v
            for n in _status(app_url)["nodes"]
            for v in n["training_grants"]["passes_recent"]
            if v["adapter"] == adapter
        ),
        key=lambda v: v["at"],
    )


def _first_seen(ids: list[int]) -> list[int]:
    return list(dict.fromkeys(ids))


def test_reported_loss_orders_the_grants_and_check_end_requeues(app_url, trainer, cfg, store, planner):
    name = "mace-loss"
    items = [{"adapter": name, "prompt": p, "completion": c} for p, c in TEXTS]
    losses = _first_pass_losses(cfg, items)
    # Four with clearly distinct losses, posted in ascending loss: each node's share then arrives
    # in ascending loss, so ordering by loss (descending) must reverse it.
    ranked = sorted(range(len(items)), key=lambda i: losses[i])
    picked = [ranked[0]] + [b for a, b in pairwise(ranked) if losses[b] - losses[a] > 1e-3]
    assert len(picked) >= 4, ("texts too alike in loss", losses)
    posted = [items[i] for i in picked[:4]]

    params = {"loss_threshold": 0.0, "max_passes": 2, "max_ft_samples": 1}  # every item: exactly two passes
    before_policies = switch_policies(planner, iteration="hybrid", iteration_params=params)
    try:
        _create(
            app_url,
            name,
            method="sft",
            learning_rate=1e-3,
            mode="hybrid",
            lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
        )
        ids = _feedback(app_url, posted)
        deadline, verdicts = time.time() + 90, []
        while time.time() < deadline:
            verdicts = _verdicts(app_url, name)
            if sum(v["outcome"] == "retired" for v in verdicts) == 4 and _adapter(app_url, name)["queued"] == 0:
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"not trained twice and consumed within 90 s: {verdicts}, {_adapter(app_url, name)}")
        grants = _grants(app_url, name)
    finally:
        restore_policies(planner, before_policies)

    # CheckEnd: each item's first pass (loss > 0 = threshold) was requeued, its second retired (max_passes).
    first = {v["id"]: v for v in verdicts if v["passes"] == 1}
    second = {v["id"]: v for v in verdicts if v["passes"] == 2}
    assert set(first) == set(second) == set(ids), verdicts
    assert all(v["outcome"] == "requeued" for v in first.values())
    assert all(v["outcome"] == "retired" for v in second.values())
    for i, item_id in enumerate(ids):  # the reported loss is the item's own first-pass NLL
        assert first[item_id]["loss"] == pytest.approx(losses[picked[i]], abs=1e-3)
    requeued_at = max(v["at"] for v in first.values())

    # Order of grants: pass 1 in arrival order (no loss known yet; one POST, so equal t_arr and the
    # scheduler's tie-break by id string), pass 2 by the reported loss (γ·L_DPO, MACE §4.1).
    share = {item_id: node for node, ids_ in ((0, ids[:2]), (1, ids[2:])) for item_id in ids_}
    changed = []
    for node, log in grants.items():
        mine = [i for i in ids if share[i] == node]
        before = _first_seen([s for g in log if g["at"] < requeued_at for s in g["samples"]])
        after = _first_seen([s for g in log if g["at"] >= requeued_at for s in g["samples"]])
        assert before == sorted(mine, key=str), (node, log)
        assert after == sorted(mine, key=lambda i: -first[i]["loss"]), (node, log, first)
        changed.append(after != before)
    # Posted in ascending loss, so ids ascend with the loss: the loss reversed the order (on both
    # nodes, unless a share's ids straddle a power of ten and already sort descending as strings).
    assert any(changed), grants

    # The store: requeued items were not consumed by the version of their first pass, only by the
    # version that holds their last pass; nothing stays queued and nothing is counted twice.
    consumed = {i: ray.get(store.feedback_item.remote(i))[1] for i in ids}
    info = _adapter(app_url, name)
    published = sorted(v["version"] for v in info["versions"])
    assert len(published) >= 2 and set(consumed.values()) == {published[-1]}, (consumed, published)
    assert info["queued"] == 0
    stats = _status(app_url)["training"]["adapters"][name]
    assert stats["requeued"] == 4 and stats["samples_trained"] == 8, stats
