"""The retention set's scoring on the tiny model: the shared-prefix pass equals the plain one, and the cache's key."""

from __future__ import annotations

import pytest

from actors.learning.lora import retention
from actors.learning.lora.retention import RetentionItem


@pytest.fixture(scope="module")
def tiny(data_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.models.default_model import ensure

    path = ensure(data_dir)  # the session's tiny model, shared with the app's tests
    torch.manual_seed(0)
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_scoring_with_the_shared_prefix_equals_the_plain_pass_and_ends_only_ended_answers(tiny):
    from actors.learning.lora.retention import encoded
    from actors.learning.lora.steps import completion_logprobs

    _, model, tok = tiny
    items = [
        RetentionItem(({"role": "user", "content": q},), a, ended)
        for q, a, ended in (
            ("What is 2 plus 2?", "Four.", True),
            ("Name a colour, please.", "Blue, or maybe green", False),
            ("Hi", "Hello there, how are you today?", True),
        )
    ]
    shared = retention.score_answers(model, tok, items, skip_first=0)
    skipped = retention.score_answers(model, tok, items)  # the gate's: each answer's first tokens left out
    assert [n for _, n in skipped] == [n - retention.SKIP_FIRST_TOKENS for _, n in shared]
    import torch

    with torch.no_grad():
        enc = encoded(tok, items)
        plain = completion_logprobs(model, enc).tolist()
    assert [n for _, n in shared] == enc.completion_mask[:, 1:].sum(1).tolist()
    assert shared[1][1] == len(tok("Blue, or maybe green", add_special_tokens=False)["input_ids"])  # no end scored
    assert shared[0][1] > len(tok("Four.", add_special_tokens=False)["input_ids"])  # the end of turn is scored
    for (s, _), p in zip(shared, plain):
        assert s == pytest.approx(p, abs=1e-4)


def test_the_cache_key_follows_the_base_and_the_prompts(tiny, tmp_path):
    path, _, _ = tiny
    a = tmp_path / "a.jsonl"
    a.write_text('{"prompt": "one"}\n')
    key = retention.fingerprint(path, a)
    assert retention.fingerprint(path, a) == key
    a.write_text('{"prompt": "two"}\n')
    assert retention.fingerprint(path, a) != key
    assert retention.fingerprint(path, a, dtype="bfloat16") != retention.fingerprint(path, a)
