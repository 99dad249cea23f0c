"""The OpenAI API end to end: the real `openai` client against the Serve app with two nodes."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.helpers import placed_now, placed_since

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(app_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completion_returns_the_requested_number_of_tokens(client):
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    assert r.model == MODEL
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len("The quick brown fox") + 1  # byte tokens + BOS
    assert 1 <= r.usage.completion_tokens <= 12


def test_greedy_completion_is_deterministic(client):
    a = client.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0)
    b = client.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0)
    assert a.choices[0].text == b.choices[0].text


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="seed me", max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_chat_completion_uses_the_chat_template(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    assert r.choices[0].message.role == "assistant"
    # "<s><|user|>\nhello\n<|assistant|>\n" in byte tokens: the template was applied.
    assert r.usage.prompt_tokens == 1 + len("<|user|>\nhello\n<|assistant|>\n")


def test_n_returns_that_many_choices(client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4, n=2, temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y"}], max_tokens=4, n=2)
    assert len(c.choices) == 2


def test_logprobs_are_returned(client):
    r = client.completions.create(model=MODEL, prompt="log", max_tokens=3, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(len(top) >= 1 for top in lp.top_logprobs)


def test_stop_string_ends_generation(client):
    free = client.completions.create(model=MODEL, prompt="stop test", max_tokens=40, temperature=0)
    text = free.choices[0].text
    if len(text) < 4:
        pytest.skip(f"greedy output too short to pick a stop string from: {text!r}")
    stop = text[2:4]
    r = client.completions.create(model=MODEL, prompt="stop test", max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_streaming_completion_arrives_incrementally(client):
    t0 = time.perf_counter()
    arrivals, pieces = [], []
    stream = client.completions.create(model=MODEL, prompt="stream", max_tokens=24, temperature=0, stream=True)
    for chunk in stream:
        arrivals.append(time.perf_counter() - t0)
        pieces.append(chunk.choices[0].text)
    whole = client.completions.create(model=MODEL, prompt="stream", max_tokens=24, temperature=0)
    assert "".join(pieces) == whole.choices[0].text
    # Streamed as generated, not held back and sent at the end. Alone every token is its own piece; when the replica's
    # loop falls behind, vLLM merges the tokens a stream has waiting into one piece, as its own server does (CI,
    # 2026-11-30: 24 tokens in 5 pieces over 176 ms under the cluster lane's load). A stream held back reads as one
    # piece, or a few within a millisecond.
    assert len(arrivals) >= 3, f"{len(arrivals)} pieces: the stream was held back"
    assert arrivals[-1] - arrivals[0] > 0.02, f"every piece within {(arrivals[-1] - arrivals[0]) * 1000:.1f} ms"


def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 10
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content is not None) >= 1


def test_models_lists_the_base_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == MODEL


def test_health_and_status(app_url):
    assert httpx.get(f"{app_url}/health").status_code == 200
    status = httpx.get(f"{app_url}/v1/status").json()
    assert [n["state"] for n in status["nodes"]] == ["ready", "ready"]
    assert status["placement"] == "round_robin"


def test_sixteen_concurrent_streams_reach_both_nodes_through_the_placement_router_token_by_token(app_url):
    before = placed_now(app_url)
    aclient = openai.AsyncOpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(i: int) -> list[float]:
        """When each streamed piece with a token arrived (every one of the sixteen runs at once)."""
        if i % 2:
            stream = await aclient.completions.create(
                model=MODEL, prompt=f"request {i}", max_tokens=32, stream=True, extra_body={"ignore_eos": True}
            )
        else:
            stream = await aclient.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"request {i}"}],
                max_tokens=32,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        return [time.perf_counter() async for chunk in stream if chunk.choices]

    async def all16():
        return await asyncio.gather(*(one(i) for i in range(16)))

    arrivals = asyncio.run(all16())
    # Token by token under the burst, as vLLM's own server streams: every stream in many pieces spread over its
    # generation, read apart (a stream held back and sent in one piece reads as a few pieces within a millisecond).
    # Not one piece per token: when the replica's loop falls behind the engine (a loaded machine), vLLM merges the
    # tokens waiting for a stream into one piece (seen in a full suite run: 32 tokens in 8 pieces over 0.8 s).
    # Under the cluster lane's load one stream in a run came in 3 pieces over 46 ms (2026-11-29, run d): still not
    # held back, so each stream needs 3 pieces over 20 ms, and three in four the 6 pieces over 50 ms seen alone.
    assert len(arrivals) == 16
    spread = [(len(times), round(times[-1] - times[0], 3)) for times in arrivals]
    assert all(n >= 3 and s > 0.02 for n, s in spread), spread
    assert sum(n >= 6 and s > 0.05 for n, s in spread) >= 12, spread
    gaps = sorted(b - a for times in arrivals for a, b in zip(times, times[1:]))
    assert gaps[len(gaps) // 2] > 0.001, f"median gap between pieces {gaps[len(gaps) // 2] * 1000:.3f} ms"
    placed = placed_since(app_url, before, 16)
    assert sum(placed.values()) == 16
    assert placed == {0: 8, 1: 8}, placed  # round robin over two ready nodes
    # Replicas report execution traces back: the planner counts every finished request.
    deadline = time.time() + 10
    while time.time() < deadline:
        nodes = httpx.get(f"{app_url}/v1/status").json()["nodes"]
        if all(n["in_flight"] == 0 for n in nodes):
            break
        time.sleep(0.2)
    assert all(n["in_flight"] == 0 for n in nodes), nodes
