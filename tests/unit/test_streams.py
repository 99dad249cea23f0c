"""The stream coalescer: order kept, first piece at once, later pieces joined, errors and cancels passed on."""

from __future__ import annotations

import asyncio
import time

import pytest

from deployments.streams import coalesce


async def _timed(gaps: list[float]):
    """Yield "p0", "p1", ... after sleeping gaps[i] before each."""
    for i, gap in enumerate(gaps):
        await asyncio.sleep(gap)
        yield f"p{i}|"


async def _collect(gen):
    out = []
    start = time.monotonic()
    async for x in gen:
        out.append((time.monotonic() - start, x))
    return out


def test_order_kept_and_fast_pieces_joined():
    out = asyncio.run(_collect(coalesce(_timed([0.0] + [0.005] * 20), 0.05)))
    assert "".join(x for _, x in out) == "".join(f"p{i}|" for i in range(21))
    assert out[0][1] == "p0|" and out[0][0] < 0.03  # the first piece is not held back
    assert len(out) <= 6  # 20 pieces over ~0.1 s in windows of 50 ms: a handful of sends, not 21


def test_slow_pieces_go_out_alone_and_without_delay():
    made: list[float] = []

    async def source():
        async for x in _timed([0.0, 0.3, 0.3, 0.3]):
            made.append(time.monotonic())
            yield x

    async def run():
        out = []
        async for x in coalesce(source(), 0.1):
            out.append((time.monotonic() - made[-1], x))
        return out

    out = asyncio.run(run())
    assert [x for _, x in out] == ["p0|", "p1|", "p2|", "p3|"]
    # Each piece leaves as soon as it is made: none waited out a 100 ms batching window after a
    # quiet gap (measured from the piece's own making, so a slow machine does not fail it).
    assert all(delay < 0.05 for delay, _ in out), out


def test_zero_interval_passes_every_piece_through():
    out = asyncio.run(_collect(coalesce(_timed([0.0] * 5), 0)))
    assert [x for _, x in out] == [f"p{i}|" for i in range(5)]


def test_source_error_is_raised_after_the_pieces_before_it():
    async def failing():
        yield "a"
        yield "b"
        raise ValueError("engine died")

    async def run():
        got = []
        with pytest.raises(ValueError, match="engine died"):
            async for x in coalesce(failing(), 0.01):
                got.append(x)
        return "".join(got)

    assert asyncio.run(run()) == "ab"


def test_closing_the_stream_cancels_the_source():
    state = {"cancelled": False}

    async def endless():
        try:
            while True:
                await asyncio.sleep(0.001)
                yield "x"
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    async def run():
        gen = coalesce(endless(), 0.01)
        await gen.__anext__()
        await gen.__anext__()
        await gen.aclose()

    asyncio.run(run())
    assert state["cancelled"]


def _sse_app(gaps: list[float], content_type: bytes = b"text/event-stream"):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
        for i, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def _run_asgi(app):
    sent = []
    start = time.monotonic()

    async def send(message):
        sent.append((time.monotonic() - start, message))

    await app({"type": "http"}, None, send)
    return sent


def test_middleware_joins_an_event_stream_and_ends_it_once():
    from deployments.streams import CoalesceEventStreams

    sent = asyncio.run(_run_asgi(CoalesceEventStreams(_sse_app([0.0] + [0.005] * 20), 0.05)))
    bodies = [m for _, m in sent if m["type"] == "http.response.body"]
    assert b"".join(m["body"] for m in bodies) == b"".join(f"data: {i}\n\n".encode() for i in range(21))
    assert bodies[0]["body"] == b"data: 0\n\n"  # the first token is not held back
    assert len(bodies) <= 7 and [m["more_body"] for m in bodies].count(False) == 1
    assert bodies[-1]["more_body"] is False


def test_middleware_leaves_other_responses_alone():
    from deployments.streams import CoalesceEventStreams

    sent = asyncio.run(_run_asgi(CoalesceEventStreams(_sse_app([0.0, 0.001, 0.001], b"application/json"), 0.05)))
    assert len([m for _, m in sent if m["type"] == "http.response.body"]) == 4
