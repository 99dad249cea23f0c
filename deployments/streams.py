"""Joins a token stream's SSE pieces into fewer, larger writes (``ingress.stream_batching_ms``).

Each SSE piece of a streamed response is one write through the model server's HTTP server and
HAProxy. Joining the pieces that arrive within ``interval_s`` of each other trades inter-token
smoothness for fewer writes; Ray Serve LLM batches its streams for the same reason. The first
piece is sent at once, so TTFT is unchanged. Off by default (0), as in ``vllm serve``: with
tokens taking one hop, a write per token is cheap (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

_END = object()
Piece = TypeVar("Piece", str, bytes)


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def coalesce(pieces: AsyncIterator[Piece], interval_s: float) -> AsyncIterator[Piece]:
    """Yield ``pieces`` in order, each yield joining whatever arrived within ``interval_s`` of the last one.

    A piece that arrives after a quiet gap longer than ``interval_s`` goes out at once. Closing the
    returned generator (a client that went away) cancels the source, which aborts the request in vLLM.
    """
    if interval_s <= 0:
        async for piece in pieces:
            yield piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for piece in pieces:
                queue.put_nowait(piece)
            queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # hand the source's error to the consumer, in order
            queue.put_nowait(_Failed(exc))

    task = asyncio.get_running_loop().create_task(pump())
    last_sent = float("-inf")
    try:
        while True:
            batch = [await queue.get()]
            wait = last_sent + interval_s - time.monotonic()
            if wait > 0 and batch[-1] is not _END and not isinstance(batch[-1], _Failed):
                await asyncio.sleep(wait)
            while not queue.empty() and batch[-1] is not _END and not isinstance(batch[-1], _Failed):
                batch.append(queue.get_nowait())
            tail = batch[-1]
            parts = [p for p in batch if isinstance(p, (str, bytes))]
            text = parts[0][:0].join(parts) if parts else None
            if text:
                yield text
                last_sent = time.monotonic()
            if tail is _END:
                return
            if isinstance(tail, _Failed):
                raise tail.exc
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass  # the cancel above: the producer stopped as asked
            except Exception:
                logger.debug("the stream's producer failed after its client left", exc_info=True)


Scope = dict[str, Any]
Message = dict[str, Any]


class CoalesceEventStreams:
    """ASGI middleware: the body of every ``text/event-stream`` response goes through :func:`coalesce`."""

    def __init__(self, app: Callable[..., Awaitable[None]], interval_s: float) -> None:
        self.app = app
        self.interval_s = interval_s

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http" or self.interval_s <= 0:
            await self.app(scope, receive, send)
            return
        queue: asyncio.Queue = asyncio.Queue()
        pump: asyncio.Task | None = None

        async def pieces() -> AsyncIterator[bytes]:
            while (body := await queue.get()) is not _END:
                yield body

        async def forward() -> None:
            async for joined in coalesce(pieces(), self.interval_s):
                await send({"type": "http.response.body", "body": joined, "more_body": True})

        async def send_joined(message: Message) -> None:
            nonlocal pump
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or ())
                if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                    pump = asyncio.get_running_loop().create_task(forward())
                await send(message)
            elif pump is not None and message["type"] == "http.response.body":
                if message.get("body"):
                    queue.put_nowait(message["body"])
                if not message.get("more_body", False):
                    queue.put_nowait(_END)
                    await pump
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await send(message)

        try:
            await self.app(scope, receive, send_joined)
        finally:
            if pump is not None and not pump.done():
                pump.cancel()
