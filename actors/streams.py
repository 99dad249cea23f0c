"""Joins a token stream's SSE pieces into fewer, larger pieces, so each Ray object hop carries several tokens.

Every piece a replica yields costs two Ray object hops (replica → ingress → proxy) with Python
work on both ends of each: about 1.7 ms of CPU per piece here (docs/benchmarks.md). Ray Serve LLM
batches its streams for the same reason. The first piece is sent at once, so TTFT is unchanged;
later pieces wait at most ``interval_s`` and leave together.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

_END = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def coalesce(pieces: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
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
            text = "".join(p for p in batch if isinstance(p, str))
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
            except (asyncio.CancelledError, Exception):
                pass
