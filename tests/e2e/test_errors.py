"""Bad input gets the right status and an OpenAI-shaped error body; the service keeps answering."""

from __future__ import annotations

import httpx
import pytest

MODEL = "tiny-llama"


def _assert_openai_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == status
    for w in words:
        assert w.lower() in err["message"].lower(), err["message"]
    return err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_json_is_400(app_url, path):
    r = httpx.post(
        app_url + path, content=b'{"model": "tiny-llama", "prompt": ', headers={"content-type": "application/json"}
    )
    _assert_openai_error(r, 400, "json")


def test_body_that_is_not_an_object_is_400(app_url):
    _assert_openai_error(httpx.post(app_url + "/v1/completions", json=[1, 2]), 400, "object")


def test_missing_model_is_400(app_url):
    _assert_openai_error(httpx.post(app_url + "/v1/completions", json={"prompt": "x"}), 400, "model")


def test_unknown_model_is_404(app_url):
    err = _assert_openai_error(
        httpx.post(app_url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "gpt-9"
    )
    assert err["param"] == "model"
    r = httpx.post(app_url + "/v1/chat/completions", json={"model": f"{MODEL}:nobody", "messages": []})
    _assert_openai_error(r, 404, "does not exist")


@pytest.mark.parametrize(
    "body, words",
    [
        ({"max_tokens": -1}, ["max_tokens"]),
        ({"temperature": "hot"}, ["temperature"]),
        ({"n": 0}, ["n"]),
        ({"top_p": 7}, ["top_p"]),
        ({"prompt": 12.5}, ["prompt"]),
    ],
)
def test_bad_parameter_is_400(app_url, body, words):
    r = httpx.post(app_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", **body})
    _assert_openai_error(r, 400, *words)


def test_chat_without_messages_is_400(app_url):
    _assert_openai_error(httpx.post(app_url + "/v1/chat/completions", json={"model": MODEL}), 400, "messages")


def test_prompt_longer_than_the_context_is_400_with_the_limits(app_url):
    r = httpx.post(app_url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 1100, "max_tokens": 4})
    _assert_openai_error(r, 400, "1024")  # the test app's max_model_len


def test_output_is_capped_at_the_context_as_vllm_does(app_url):
    # vLLM 0.32 shortens max_tokens to what the context leaves rather than rejecting the request.
    r = httpx.post(app_url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 1000, "max_tokens": 500})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] <= 1024


def test_unknown_route_is_an_openai_shaped_404(app_url):
    _assert_openai_error(httpx.get(app_url + "/v1/nothing-here"), 404)


def test_service_keeps_answering_after_bad_requests(app_url):
    for _ in range(3):
        httpx.post(app_url + "/v1/completions", content=b"garbage")
    r = httpx.post(app_url + "/v1/completions", json={"model": MODEL, "prompt": "still alive", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"]


@pytest.mark.parametrize("extra", [{"echo": True, "logprobs": 1}, {"prompt_logprobs": 1}])
def test_prompt_logprobs_are_refused_while_lora_is_enabled(app_url, extra):
    # They crash vLLM's CPU LoRA kernels (vLLM #16668): a clear 400, and the engine stays up.
    r = httpx.post(app_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    _assert_openai_error(r, 400, "lora")
    assert (
        httpx.post(app_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code
        == 200
    )
