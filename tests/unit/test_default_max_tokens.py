"""A request that names no output length is capped at limits.max_tokens and at the room its prompt leaves (issue 29
item 3): the default is set on vLLM's own request objects, and vLLM's get_max_tokens then takes the room."""

from __future__ import annotations

import pytest

from deployments.request_rules import default_max_tokens

chat_protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol", reason="vLLM is not installed")
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: E402
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return chat_protocol.ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def completion(**fields):
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def engine_max_tokens(request, prompt_tokens: int, max_model_len: int = 1024) -> int:
    """What vLLM's serving classes compute from the request (chat prefers max_completion_tokens)."""
    asked = getattr(request, "max_completion_tokens", None)
    return get_max_tokens(max_model_len, asked if asked is not None else request.max_tokens, prompt_tokens, {})


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_chat_without_max_tokens_is_capped_at_the_limit_and_the_room_left():
    for request in (chat(ignore_eos=True), chat(max_tokens=None), chat(max_completion_tokens=None)):
        assert engine_max_tokens(request, prompt_tokens=3) == 1021  # today: the rest of the context
        default_max_tokens(request, 32)
        assert engine_max_tokens(request, prompt_tokens=3) == 32
        assert engine_max_tokens(request, prompt_tokens=1010) == 14  # the room left is less
    for named in (chat(max_tokens=7), chat(max_completion_tokens=40)):  # a length the client names stays
        before = engine_max_tokens(named, 3)
        default_max_tokens(named, 32)
        assert engine_max_tokens(named, 3) == before  # (40 > the limit is refused as a 400 after this)


def test_a_completion_keeps_vllms_16_unless_the_limit_is_lower():
    request = completion()
    default_max_tokens(request, 32)
    assert request.max_tokens == 16
    for request in (completion(), completion(max_tokens=None)):
        default_max_tokens(request, 8)
        assert request.max_tokens == 8  # not a 400 for a length the client never sent
    named = completion(max_tokens=5)
    default_max_tokens(named, 4)
    assert named.max_tokens == 5  # over the limit: the caller's 400


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_router_plans_with_the_length_the_replica_gives():
    from deployments.request_rules import default_output_tokens

    assert default_output_tokens(True, 256, 2048) == 256  # chat: limits.max_tokens
    assert default_output_tokens(False, 256, 2048) == 16  # completion: vLLM's and OpenAI's 16
    assert default_output_tokens(False, 8, 2048) == 8  # never past the limit
    assert default_output_tokens(True, 256, 2048, model_default=100) == 100  # the generation config's, if less
    assert default_output_tokens(True, 4096, 1024) == 1024  # never past the context
    # What the replica sets (the same rule) is what vLLM then runs, for both kinds, explicit nulls included.
    for request, is_chat in (
        (chat(), True),
        (chat(max_tokens=None), True),
        (completion(), False),
        (completion(max_tokens=None), False),
    ):
        default_max_tokens(request, default_output_tokens(is_chat, 256, 1024))
        assert engine_max_tokens(request, prompt_tokens=3) == (256 if is_chat else 16)
