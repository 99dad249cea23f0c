"""Token-level fine-tuning windows (FlexLLM §6.1) on the embedded tiny model with a real peft LoRA.

A pass run as windows across several grants must leave the same LoRA gradient as the full-sequence
step. Tolerances: float32 throughout, and the only differences are the order of float sums (a
window's log-prob sum, then the sum of windows, vs. one sum over the row) and matmul shapes; the
observed max abs gradient difference is ~2e-7 on gradients of magnitude ~0.2, so rtol 1e-4 /
atol 1e-6 leave a wide margin while a missing KV-gradient path (difference ~0.1) cannot hide.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from actors.learning.lora import steps as lt  # noqa: E402
from actors.learning.lora import windowed_pass as wp  # noqa: E402
from actors.models.default_model import ensure  # noqa: E402

RTOL, ATOL = 1e-4, 1e-6
ALL_PROJ = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "dropout": 0.0}
QV = {**ALL_PROJ, "target_modules": ["q_proj", "v_proj"]}  # layer 0's K then depends on no LoRA weight

ITEM = {"prompt": "Human: what is the capital of France?\nAssistant:", "completion": " Paris, of course."}
ITEM_LONG = {
    "prompt": "Human: say something.\nAssistant:",
    "completion": " Something rather longer than the other answer, so the token counts differ.",
}
PAIR = {"prompt": "Human: name a colour.\nAssistant:", "chosen": " Blue, like the sky.", "rejected": " I won't."}
PAIR_2 = {"prompt": "Human: 2+2?\nAssistant:", "chosen": " 4", "rejected": " It is five, obviously."}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(data_dir):
    return ensure(data_dir)


def lora_model(model_dir, settings=ALL_PROJ):
    model, tok = lt.load_lora_model(model_dir, settings, seed=0)
    # peft starts lora_B at zero, which makes every lora_A gradient zero: randomise B so all are tested.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model, tok


def zero_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert out and all(g is not None for g in out.values())
    return out


def assert_same_grads(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=RTOL, atol=ATOL), (
            name,
            (got[name] - want[name]).abs().max().item(),
        )
    return max((got[n] - want[n]).abs().max().item() for n in want)


def step_grads(model, fn):
    zero_grads(model)
    stats = fn()
    return stats, grads(model)


def windowed(model, tok, item, method, ends, **kw):
    p = wp.WindowedPass(model, tok, item, method, **kw)
    for end in ends:
        p.forward(end)
    return p.finish()


def granted(model, tok, item, method, forward_ends, backward_step, **kw):
    """The pass as a trainer runs it across grants: forward windows, then backward grants of ``backward_step``
    token-equivalents each (FlexLLM Alg. 2 lines 12–21); returns the stats and each grant's progress."""
    p = wp.WindowedPass(model, tok, item, method, **kw)
    for end in forward_ends:
        p.run(end)
    progress = []
    while not p.complete:
        before = p.done
        p.run(min(p.work, p.done + backward_step))
        progress.append(p.done - before)
    return p.stats, progress


def test_item_length_is_the_encoded_stream(model_dir):
    _, tok = lora_model(model_dir, QV)
    enc = lt.encode(tok, [ITEM["prompt"]], [ITEM["completion"]])
    assert wp.item_length(tok, ITEM, "sft") == enc.input_ids.shape[1]
    pair = lt.encode(tok, [PAIR["prompt"]] * 2, [PAIR["chosen"], PAIR["rejected"]])
    assert wp.item_length(tok, PAIR, "dpo") == int(pair.attention_mask.sum())
    assert wp.item_length(tok, ITEM, "sft", max_length=16) == 16  # the same _fit truncation
    with pytest.raises(ValueError, match="unknown training method"):
        wp.item_length(tok, ITEM, "ppo")


@pytest.mark.parametrize("settings", [ALL_PROJ, QV], ids=["qkvo", "qv"])
@pytest.mark.parametrize("cuts", [[5, 23], [], [5, 23, 60, -1]], ids=["three", "one", "last-token-alone"])
def test_sft_windows_give_the_full_sequence_gradient(model_dir, settings, cuts):
    model, tok = lora_model(model_dir, settings)
    length = wp.item_length(tok, ITEM, "sft")
    ends = [c % length for c in cuts] + [length]
    want_stats, want = step_grads(model, lambda: lt.sft_step(model, tok, [ITEM], scale=0.7))
    got_stats, got = step_grads(model, lambda: windowed(model, tok, ITEM, "sft", ends, scale=0.7))
    assert_same_grads(got, want)
    assert got_stats.loss == pytest.approx(want_stats.loss, rel=1e-6)
    assert got_stats.tokens == want_stats.tokens == length
    assert got_stats.dpo_loss is None


def test_each_forward_runs_only_its_window(model_dir):
    model, tok = lora_model(model_dir)
    seen: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    try:
        windowed(model, tok, ITEM, "sft", [5, 23, wp.item_length(tok, ITEM, "sft")])
        n_chosen = lt.encode(tok, [PAIR["prompt"]], [PAIR["chosen"]]).input_ids.shape[1]
        length = wp.item_length(tok, PAIR, "dpo")
        seen_sft, seen[:] = list(seen), []
        windowed(model, tok, PAIR, "dpo", [n_chosen + 3, length])
    finally:
        hook.remove()
    assert seen_sft == [5, 18, wp.item_length(tok, ITEM, "sft") - 23]
    # DPO: each piece twice (reference, then policy); the first window crosses into the rejected sequence.
    assert seen == [n_chosen, n_chosen, 3, 3, length - n_chosen - 3, length - n_chosen - 3]


@pytest.mark.parametrize("cuts", [[7, "c+5"], ["c-1", "c", "c+1"], []], ids=["crossing", "at-boundary", "one"])
def test_dpo_windows_give_the_full_sequence_gradient(model_dir, cuts):
    model, tok = lora_model(model_dir)
    n_chosen = lt.encode(tok, [PAIR["prompt"]], [PAIR["chosen"]]).input_ids.shape[1]
    length = wp.item_length(tok, PAIR, "dpo")
    ends = [c if isinstance(c, int) else n_chosen + int(c[1:] or 0) for c in cuts] + [length]
    want_stats, want = step_grads(model, lambda: lt.dpo_step(model, tok, [PAIR], beta=0.1, scale=0.7))
    got_stats, got = step_grads(model, lambda: windowed(model, tok, PAIR, "dpo", ends, beta=0.1, scale=0.7))
    assert_same_grads(got, want)
    # The log-prob sums are ~-300 in float32 (resolution ~3e-5) and Δ subtracts two of them: summing
    # per window moves β·Δ by ~1e-6, hence rel 1e-5 on the loss rather than 1e-6.
    assert got_stats.loss == pytest.approx(want_stats.loss, rel=1e-5)
    assert got_stats.dpo_loss == got_stats.loss
    assert got_stats.reward_margin == pytest.approx(want_stats.reward_margin, abs=1e-5)
    assert got_stats.tokens == want_stats.tokens == length


def test_batch_mean_scales(model_dir):
    model, tok = lora_model(model_dir)
    items = [ITEM, ITEM_LONG]

    def accumulate(method, batch, scales, **kw):
        zero_grads(model)
        losses = [
            windowed(model, tok, it, method, [7, wp.item_length(tok, it, method)], scale=s, **kw).loss
            for it, s in zip(batch, scales)
        ]
        return losses, grads(model)

    # SFT: sft_step's batch loss is a token mean over the whole batch, so 1/B per item is wrong when
    # the items have different numbers of completion tokens, and n_i / Σ n_j is right.
    counts = [wp.item_loss_tokens(tok, it, "sft") for it in items]
    assert counts[0] != counts[1]
    batch_stats, want = step_grads(model, lambda: lt.sft_step(model, tok, items))
    _, half = accumulate("sft", items, [0.5, 0.5])
    assert max((half[n] - want[n]).abs().max().item() for n in want) > 1e-3
    scales = wp.batch_scales(tok, items, "sft")
    assert scales == pytest.approx([n / sum(counts) for n in counts])
    losses, got = accumulate("sft", items, scales)
    assert_same_grads(got, want)
    assert sum(s * x for s, x in zip(scales, losses)) == pytest.approx(batch_stats.loss, rel=1e-6)

    # DPO: dpo_step's loss is a mean over pairs, so 1/B per item is exactly the batch step.
    pairs = [PAIR, PAIR_2]
    assert wp.batch_scales(tok, pairs, "dpo") == [0.5, 0.5]
    batch_stats, want = step_grads(model, lambda: lt.dpo_step(model, tok, pairs, beta=0.1))
    losses, got = accumulate("dpo", pairs, [0.5, 0.5], beta=0.1)
    assert_same_grads(got, want)
    assert sum(losses) / 2 == pytest.approx(batch_stats.loss, rel=1e-5)


def test_misuse_raises_and_abandon_leaves_grads_alone(model_dir):
    model, tok = lora_model(model_dir, QV)
    zero_grads(model)
    length = wp.item_length(tok, ITEM, "sft")
    p = wp.WindowedPass(model, tok, ITEM, "sft")
    assert (p.length, p.done) == (length, 0)
    with pytest.raises(ValueError, match=rf"forward\(end={length + 1}\) needs 0 < end <= {length}"):
        p.forward(length + 1)
    p.forward(10)
    with pytest.raises(ValueError, match=r"needs 10 < end"):
        p.forward(10)  # an empty window, or one going back, is a caller bug
    with pytest.raises(ValueError, match=rf"finish\(\) needs the whole stream forwarded: 10 of {length}"):
        p.finish()
    assert p.done == 10  # a refused call changes nothing: the pass can go on
    p.abandon()
    assert all(q.grad is None for q in model.parameters())  # nothing reached .grad before finish()
    with pytest.raises(ValueError, match="finished or abandoned"):
        p.forward(length)
    done = wp.WindowedPass(model, tok, ITEM, "sft")
    done.forward(length)
    done.finish()
    with pytest.raises(ValueError, match="finished or abandoned"):
        done.finish()


@pytest.mark.parametrize("step", [1, 7, 40])
def test_the_backward_runs_in_grants_and_gives_the_full_sequence_gradient(model_dir, step):
    """No grant carries a whole sample's backward: each backward grant runs (level, window) units up to its tokens,
    and the gradient after the last one equals sft_step's and dpo_step's (issue 38)."""
    model, tok = lora_model(model_dir)
    length = wp.item_length(tok, ITEM, "sft")
    want_stats, want = step_grads(model, lambda: lt.sft_step(model, tok, [ITEM], scale=0.7))
    zero_grads(model)
    stats, progress = granted(model, tok, ITEM, "sft", [5, 23, length], step, scale=0.7)
    assert_same_grads(grads(model), want)
    assert stats.loss == pytest.approx(want_stats.loss, rel=1e-6)
    assert sum(progress) == length and all(d > 0 for d in progress)
    # A grant overruns its tokens by less than one unit: the largest unit is a window's head.
    largest_unit = max(5, 18, length - 23) * max(wp.level_weights(model))
    assert max(progress) <= step + largest_unit + 1
    assert len(progress) >= length // (step + largest_unit + 1)

    n_chosen = lt.encode(tok, [PAIR["prompt"]], [PAIR["chosen"]]).input_ids.shape[1]
    pair_length = wp.item_length(tok, PAIR, "dpo")
    want_stats, want = step_grads(model, lambda: lt.dpo_step(model, tok, [PAIR], beta=0.1, scale=0.7))
    zero_grads(model)
    stats, progress = granted(model, tok, PAIR, "dpo", [7, n_chosen + 5, pair_length], step, beta=0.1, scale=0.7)
    assert_same_grads(grads(model), want)
    assert stats.reward_margin == pytest.approx(want_stats.reward_margin, abs=1e-5)
    assert sum(progress) == pair_length


def test_the_backward_waits_for_the_forward_and_its_levels_are_weighed_by_parameters(model_dir):
    model, tok = lora_model(model_dir, QV)
    weights = wp.level_weights(model)
    assert len(weights) == 1 + model.get_base_model().config.num_hidden_layers
    assert sum(weights) == pytest.approx(1.0) and len(set(round(w, 9) for w in weights[1:])) == 1
    p = wp.WindowedPass(model, tok, ITEM, "sft")
    assert p.work == 2 * p.length
    p.run(10)
    with pytest.raises(ValueError, match="backward needs the whole stream forwarded"):
        p.backward(p.length + 1)
    p.run(p.length + 1)  # the forward's rest, then the first backward unit: the last window's head
    assert p.length < p.done < p.work and p.stats is not None
    assert all(q.grad is None for q in model.parameters())  # no LoRA weight in the head
    p.run(p.done + p.length // 2)
    assert any(q.grad is not None for q in model.parameters()) and not p.complete


@pytest.mark.parametrize("label", [True, False], ids=["up", "down"])
def test_kto_windows_give_the_full_sequence_gradient(model_dir, label):
    """KTO (an unpaired label) runs windowed as DPO does: the reference with the adapter disabled, the loss of
    dpo_loss.kto_losses on the completion's log-prob sums, the same gradient as the full-sequence computation."""
    from actors.learning.dpo_loss import kto_losses

    model, tok = lora_model(model_dir)
    item = {**ITEM, "label": label}
    length = wp.item_length(tok, item, "kto")
    assert length == wp.item_length(tok, ITEM, "sft")  # one sequence: context + the labelled answer

    def full():
        enc = lt.encode(tok, [item["prompt"]], [item["completion"]])
        mask = enc.completion_mask[:, 1:]
        with torch.no_grad(), lt.model_mode(model, False), model.disable_adapter():
            ref = (lt.token_logprobs(model, enc) * mask).sum(1)
        with lt.model_mode(model, True):
            policy = (lt.token_logprobs(model, enc) * mask).sum(1)
        loss = kto_losses(policy, ref, torch.tensor([label]), 0.1).mean()
        (loss * 0.7).backward()
        return loss.item()

    zero_grads(model)
    want_loss = full()
    want = grads(model)
    got_stats, got = step_grads(model, lambda: windowed(model, tok, item, "kto", [5, 17, length], beta=0.1, scale=0.7))
    assert_same_grads(got, want)
    assert got_stats.loss == pytest.approx(want_loss, rel=1e-5)
    assert got_stats.tokens == length
    with pytest.raises(ValueError, match="labelled"):
        wp.WindowedPass(model, tok, ITEM, "kto")  # no label: refused, never trained as one
