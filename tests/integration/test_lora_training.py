"""Real LoRA SFT/DPO steps on the embedded tiny model, MACE metrics, and atomic adapter versions."""

from __future__ import annotations

import json
import math
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from actors.learning.lora import alignment as ae  # noqa: E402
from actors.learning.lora import steps as lt
from actors.learning.versions.layout import is_complete_version  # noqa: E402
from actors.models.default_model import build_tokenizer, ensure  # noqa: E402

LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}
ITEM = {"prompt": "Human: what is the capital of France?\nAssistant:", "completion": " Paris, of course."}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure(tmp_path_factory.mktemp("lora-model"))


@pytest.fixture(scope="module")
def hh_pairs(shared_data):
    path = shared_data / "preferences" / "hh_rlhf_train_sample.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not found: the HH-RLHF sample is needed for the DPO test")
    # Byte-level tokenizer: 96 bytes per text keeps a DPO step around a second on this CPU.
    return ae.read_preference_jsonl(path, limit=4, max_text_bytes=96)


def lora_weights(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def test_encode_masks_prompt_appends_eos_and_truncates():
    tok = build_tokenizer()
    enc = lt.encode(tok, ["ab", "abcd"], ["xyz", "q"])
    assert enc.input_ids.tolist()[0] == [
        tok.bos_token_id,
        ord("a"),
        ord("b"),
        ord("x"),
        ord("y"),
        ord("z"),
        tok.eos_token_id,
    ]
    assert enc.completion_mask.tolist() == [[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1]]
    assert enc.attention_mask.tolist()[1] == [1] * 7
    # Over the limit: the prompt keeps BOS + its tail in half the budget, the completion its head.
    short = lt.encode(tok, ["0123456789"], ["abcdef"], max_length=8)
    assert short.input_ids.tolist()[0] == [tok.bos_token_id, *b"789abcd"]
    assert short.completion_mask.tolist()[0] == [0, 0, 0, 0, 1, 1, 1, 1]
    fits = lt.encode(tok, ["0123456789"], ["ab"], max_length=8)  # short answer: the prompt gets the rest
    assert fits.input_ids.tolist()[0] == [tok.bos_token_id, *b"6789ab", tok.eos_token_id]


def test_sft_steps_raise_the_completion_logprob_and_mask_the_prompt(model_dir):
    model, tok = lt.load_lora_model(model_dir, LORA, seed=0)
    opt = lt.make_optimizer(model, 1e-2)
    before = lt.sequence_logprobs(model, tok, [ITEM["prompt"]], [ITEM["completion"]])[0]
    first = lt.sft_step(model, tok, [ITEM])
    # Loss is the token mean over the completion (+EOS) only: -log p(completion | prompt) / its tokens.
    n_completion = len(ITEM["completion"].encode()) + 1
    assert first.loss == pytest.approx(-before / n_completion, rel=1e-4)
    losses = [first.loss]
    lt.optimizer_step(model, opt)
    for _ in range(3):
        losses.append(lt.sft_step(model, tok, [ITEM]).loss)
        lt.optimizer_step(model, opt)
    after = lt.sequence_logprobs(model, tok, [ITEM["prompt"]], [ITEM["completion"]])[0]
    assert losses == sorted(losses, reverse=True), losses
    assert after > before + 5.0, (before, after)


def test_dpo_starts_at_log2_and_raises_the_preference_margin(model_dir, hh_pairs):
    model, tok = lt.load_lora_model(model_dir, LORA, seed=0)
    opt = lt.make_optimizer(model, 1e-2)
    prompts = [p["prompt"] for p in hh_pairs]
    chosen0 = lt.sequence_logprobs(model, tok, prompts, [p["chosen"] for p in hh_pairs])
    rejected0 = lt.sequence_logprobs(model, tok, prompts, [p["rejected"] for p in hh_pairs])
    before = ae.evaluate_preferences(model, tok, hh_pairs)
    # MACE §3.1 by hand: win rate and CLPD from the sequence log-probs.
    margins0 = [c - r for c, r in zip(chosen0, rejected0)]
    assert before.win_rate == sum(m > 0 for m in margins0) / 4
    assert before.clpd == pytest.approx(sum(margins0) / 4, rel=1e-6)

    first = lt.dpo_step(model, tok, hh_pairs, beta=0.1)
    assert first.loss == pytest.approx(math.log(2), abs=1e-6) and first.reward_margin == pytest.approx(0, abs=1e-6)
    lt.optimizer_step(model, opt)
    for _ in range(3):
        lt.dpo_step(model, tok, hh_pairs, beta=0.1)
        lt.optimizer_step(model, opt)
    after = ae.evaluate_preferences(model, tok, hh_pairs)
    assert after.clpd > before.clpd + 1.0, (before, after)
    assert after.win_rate >= before.win_rate
    margins = [
        c - r
        for c, r in zip(
            lt.sequence_logprobs(model, tok, prompts, [p["chosen"] for p in hh_pairs]),
            lt.sequence_logprobs(model, tok, prompts, [p["rejected"] for p in hh_pairs]),
        )
    ]
    assert all(m > m0 for m, m0 in zip(margins, margins0)), (margins0, margins)  # every pair moved the right way
    # The reference is the untouched base model: disabling the adapter gives back the step-0 numbers.
    with model.disable_adapter():
        assert lt.sequence_logprobs(model, tok, prompts, [p["chosen"] for p in hh_pairs]) == pytest.approx(chosen0)


def test_gradient_accumulation_matches_one_full_batch(model_dir):
    items = [{"prompt": "p1", "completion": "abcd"}, {"prompt": "p2", "completion": "wxyz"}]
    grads = []
    for micro in ([items], [items[:1], items[1:]]):
        model, tok = lt.load_lora_model(model_dir, LORA, seed=0)
        lt.make_optimizer(model, 1e-3)
        for batch in micro:
            lt.sft_step(model, tok, batch, scale=1 / len(micro))
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    for full, accumulated in zip(*grads):
        assert torch.allclose(full, accumulated, atol=1e-6)


def test_same_seed_same_adapter_and_steps(model_dir):
    runs = []
    for seed in (0, 0, 1):
        model, tok = lt.load_lora_model(model_dir, {**LORA, "dropout": 0.1}, seed=seed)
        init = lora_weights(model)
        lt.seed_everything(seed)
        loss = lt.sft_step(model, tok, [ITEM]).loss
        runs.append((init, loss))
    (a, la), (b, lb), (c, lc) = runs
    assert all(torch.equal(a[k], b[k]) for k in a) and la == lb
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_saved_version_loads_back_identically_and_the_optimizer_resumes(model_dir, tmp_path):
    model, tok = lt.load_lora_model(model_dir, LORA, seed=0)
    opt = lt.make_optimizer(model, 1e-2)
    for _ in range(2):
        lt.sft_step(model, tok, [ITEM])
        lt.optimizer_step(model, opt)
    path = lt.save_adapter_version(model, opt, tmp_path, "acme", 1, {"samples_trained": 2, "loss": 1.5})
    assert path == tmp_path / "acme" / "v1"
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "meta.json"} <= set(os.listdir(path))
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    meta = lt.read_meta(path)
    assert (meta["adapter"], meta["version"], meta["samples_trained"]) == ("acme", 1, 2)

    resumed, _ = lt.load_lora_model(model_dir, {"r": 2, "alpha": 1, "target_modules": ["o_proj"]}, adapter_dir=path)
    want, got = lora_weights(model), lora_weights(resumed)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert lt.sequence_logprobs(resumed, tok, [ITEM["prompt"]], [ITEM["completion"]])[0] == pytest.approx(
        lt.sequence_logprobs(model, tok, [ITEM["prompt"]], [ITEM["completion"]])[0], abs=1e-5
    )

    resumed_opt = lt.make_optimizer(resumed, 1e-2, state_dir=path)
    a, b = opt.state_dict()["state"], resumed_opt.state_dict()["state"]
    assert a.keys() == b.keys() and all(float(a[k]["step"]) == float(b[k]["step"]) == 2 for k in a)
    assert all(torch.equal(a[k]["exp_avg_sq"], b[k]["exp_avg_sq"]) for k in a)
    # One more identical step on both: same weights, which a fresh optimizer (no moments) would not give.
    for m, o in ((model, opt), (resumed, resumed_opt)):
        lt.sft_step(m, tok, [ITEM])
        lt.optimizer_step(m, o)
    want, got = lora_weights(model), lora_weights(resumed)
    assert all(torch.allclose(want[k], got[k], atol=1e-6) for k in want)


def test_interrupted_save_leaves_no_version_dir(model_dir, tmp_path, monkeypatch):
    model, _ = lt.load_lora_model(model_dir, LORA, seed=0)
    opt = lt.make_optimizer(model, 1e-3)
    v1 = lt.save_adapter_version(model, opt, tmp_path, "acme", 1, {})
    with pytest.raises(FileExistsError):
        lt.save_adapter_version(model, opt, tmp_path, "acme", 1, {})  # versions are immutable

    def crash(*args, **kwargs):  # dies after the peft files are written, before optimizer.pt
        raise OSError("No space left on device (simulated)")

    monkeypatch.setattr(lt.torch, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        lt.save_adapter_version(model, opt, tmp_path, "acme", 2, {})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "acme")) == ["v1"]

    # A process killed mid-save leaves its temp dir; an incomplete v3 (e.g. a manual copy) is not a version.
    leftover = tmp_path / "acme" / ".tmp-v2-crashed"
    leftover.mkdir()
    (leftover / "adapter_config.json").write_text("{")
    (tmp_path / "acme" / "v3").mkdir()
    assert is_complete_version(v1) and not is_complete_version(tmp_path / "acme" / "v3")
    with pytest.raises(ValueError):
        lt.version_dir(tmp_path, "../etc", 1)


CHAT_ITEM = {"messages": [{"role": "user", "content": "Capital of France?"}], "completion": "Paris."}


def test_chat_items_train_on_the_served_template_and_its_end_of_turn(model_dir):
    model, tok = lt.load_lora_model(model_dir, LORA, seed=0)
    text = lt.prompted_text(tok, CHAT_ITEM, "completion")
    # Exactly the prompt vLLM's chat endpoint renders, and the answer up to the end of turn.
    assert text.prompt == tok.apply_chat_template(CHAT_ITEM["messages"], tokenize=False, add_generation_prompt=True)
    assert (text.answer, text.templated) == ("Paris." + tok.eos_token, True)
    enc = lt.encode(tok, [text.prompt], [text.answer], templated=[True])
    ids = enc.input_ids[0].tolist()
    assert ids.count(tok.bos_token_id) == 1 and ids[-1] == tok.eos_token_id and ids[-2] != tok.eos_token_id
    before = lt.sequence_logprobs(model, tok, [text.prompt], [text.answer], templated=[True])[0]
    opt = lt.make_optimizer(model, 1e-2)
    for _ in range(3):
        lt.sft_step(model, tok, [CHAT_ITEM])
        lt.optimizer_step(model, opt)
    after = lt.sequence_logprobs(model, tok, [text.prompt], [text.answer], templated=[True])[0]
    assert after > before + 1.0, (before, after)


def test_held_out_scores_of_parts_combine_to_the_score_of_the_whole(model_dir):
    """The quality gate caches each held-out item's own score and scores only new ones: the parts must add up."""
    model, tok = lt.load_lora_model(model_dir, LORA)
    items = [
        {"prompt": f"Q{i}: say hi\nA:", "completion": " hi" * (i + 1), "chosen": " hi", "rejected": " no" * i}
        for i in range(1, 6)
    ]
    whole = ae.evaluate_completions(model, tok, items, batch_size=2)
    parts = (
        ae.evaluate_completions(model, tok, items[:3]).per_item
        + ae.evaluate_completions(model, tok, items[3:]).per_item
    )
    combined = ae.completion_eval(parts)
    assert combined.tokens == whole.tokens == sum(n for _, n in whole.per_item) and combined.items == 5
    assert combined.token_logprob == pytest.approx(whole.token_logprob, rel=1e-5)
    assert whole.token_logprob < 0
    pref = ae.evaluate_preferences(model, tok, items)
    again = ae.preference_eval(
        ae.evaluate_preferences(model, tok, items[:2]).diffs + ae.evaluate_preferences(model, tok, items[2:]).diffs
    )
    assert (again.win_rate, again.pairs) == (pref.win_rate, 5) and again.clpd == pytest.approx(pref.clpd, rel=1e-5)


def test_lora_targets_are_what_peft_wraps_in_the_model(model_dir):
    """The names POST /v1/adapters accepts (actors/learning/lora/targets.py) are the ones peft can wrap: each short
    name makes a LoRA model, an unknown one is refused by both, and "all-linear" goes to peft as its shorthand."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from actors.learning.lora.targets import lora_targetable_modules, short_names, unknown_targets

    modules = lora_targetable_modules(str(model_dir))
    names = short_names(modules)
    assert names == [
        "down_proj",
        "embed_tokens",
        "gate_proj",
        "k_proj",
        "lm_head",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert unknown_targets(["q_proj", "layers.3.mlp.down_proj", "model.embed_tokens"], modules) == []
    assert unknown_targets(["self_attn", "no_such_module", "proj"], modules) == ["self_attn", "no_such_module", "proj"]
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    wrapped = get_peft_model(base, lt.lora_config({"r": 2, "alpha": 4, "target_modules": names}))
    touched = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in wrapped.named_parameters() if ".lora_" in n}
    assert touched == set(names)
    linear = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        lt.lora_config({"r": 2, "alpha": 4, "target_modules": "all-linear"}),
    )
    assert set(linear.peft_config["default"].target_modules) == set(names) - {"embed_tokens", "lm_head"}
    with pytest.raises(ValueError):
        get_peft_model(
            AutoModelForCausalLM.from_pretrained(model_dir),
            lt.lora_config({"r": 2, "alpha": 4, "target_modules": ["no_such_module"]}),
        )
