"""Stored completions over HTTP: keep a chat or completion request's answer, read it back and delete it by its id.

A request is stored when it says ``"store": true`` (OpenAI's parameter) or names an adapter created with
``store_completions: true``. :meth:`CompletionRecorder.admit` runs once the model server's checks admitted the
request: it pins the adapter version that will answer (the version the node serves at admission, so a version
published during a stream does not change which version answered) and renders the prompt as the engine sees it.
:meth:`Admitted.record` reads vLLM's answer (the JSON body, or the event stream as it passes through to the
client, untouched) and stores it in the feedback store (``actors/learning/store/completion_rows.py``) before the
answer ends, so a GET or a feedback right after it finds it.

``GET /v1/chat/completions/{id}`` answers OpenAI's ``chat.completion`` object (plus ``coserve``: the adapter
version that answered, the rendered prompt, the sampling parameters) to the tenant that made it;
``DELETE`` removes it. Another tenant's id is a 404 exactly as a missing one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from actors.learning.store.completion_rows import ChatMessage, SamplingParams, StoredCompletion
from deployments.guard import PRINCIPAL

logger = logging.getLogger("ray.serve")

STORE_FLAG_TTL_S = 10.0  # how long an adapter's store_completions flag is trusted before it is read again


def _text(content: Any) -> str:
    """A chat message's content as text: a string, or the text parts of OpenAI's content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


def chat_turns(messages: Any) -> tuple[ChatMessage, ...]:
    """A chat request's messages as plain (role, content) turns (what feedback on it trains on)."""
    turns = []
    for m in messages or []:
        m = m if isinstance(m, dict) else (m.model_dump() if hasattr(m, "model_dump") else dict(m))
        turns.append(ChatMessage(str(m.get("role")), _text(m.get("content"))))
    return tuple(turns)


@dataclass
class Admitted:
    """A request admitted to be stored: the record as known before the engine answers."""

    recorder: CompletionRecorder
    request: StoredCompletion  # StoredCompletion.admitted: no id or answer yet

    async def record(self, response: Any) -> Any:
        """``response`` (vLLM's) unchanged; its answer stored once complete (a refusal stores nothing)."""
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._recording(response.body_iterator)
            return response
        if isinstance(response, JSONResponse) and response.status_code == 200:
            try:
                body = json.loads(bytes(response.body))
                await self._store(body.get("id"), _choice_text(body), _finish(body), body.get("usage") or {})
            except Exception:  # storing is a side service: the client still gets its answer
                logger.exception("could not store completion")
        return response

    async def _recording(self, chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The event stream as vLLM sends it; choice 0's deltas, the id, the finish reason and usage kept."""
        ident, parts, finish, usage, pending = None, [], None, {}, ""
        async for chunk in chunks:
            yield chunk
            pending += chunk.decode() if isinstance(chunk, (bytes, bytearray)) else str(chunk)
            *events, pending = pending.split("\n\n")
            for event in events:
                data = event.strip().removeprefix("data:").strip()
                if not data or data == "[DONE]":
                    continue
                try:
                    body = json.loads(data)
                except ValueError:
                    continue
                ident = ident or body.get("id")
                usage = body.get("usage") or usage
                for choice in body.get("choices") or []:
                    if choice.get("index", 0) != 0:
                        continue
                    delta = choice.get("delta")
                    parts.append((delta or {}).get("content") or "" if delta is not None else choice.get("text") or "")
                    finish = choice.get("finish_reason") or finish
        try:
            await self._store(ident, "".join(parts), finish, usage)
        except Exception:
            logger.exception("could not store streamed completion %s", ident)

    async def _store(self, ident: Any, output: str, finish: Any, usage: dict[str, Any]) -> None:
        if not isinstance(ident, str) or not ident:
            return
        record = self.request.answered(
            ident,
            output,
            finish if isinstance(finish, str) else None,
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
            time.time(),
        )
        days = self.recorder.cfg.limits.store_completions_days
        await self.recorder.call_store(lambda store: store.store_completion.remote(record, days))


def _choice_text(body: dict[str, Any]) -> str:
    choice = (body.get("choices") or [{}])[0]
    if "message" in choice:
        return _text((choice.get("message") or {}).get("content"))
    return choice.get("text") or ""


def _finish(body: dict[str, Any]) -> str | None:
    return ((body.get("choices") or [{}])[0]).get("finish_reason")


class CompletionRecorder:
    """The model server's stored completions: which requests to keep, and the routes that read them back."""

    def __init__(
        self,
        cfg: Any,
        call_store: Callable[..., Any],
        served_version: Callable[[str], int | None],
        base: str,
        model_dir: Callable[[], str],
    ) -> None:
        self.cfg = cfg
        self.call_store = call_store  # LearningRoutes.call_store: the feedback store's actor, re-found on restart
        self.served_version = served_version  # engine model name -> the adapter version this node serves now
        self.base = base
        self._model_dir = model_dir
        self._tokenizer: Any = None
        self._flags: dict[str, tuple[float, bool]] = {}  # adapter key -> (read at, store_completions)

    async def admit(self, request: Any, public_model: str) -> Admitted | None:
        """What to store of ``request`` (checked, its ``model`` the engine's name), or None: not stored."""
        model = request.model or ""
        adapter = model[len(self.base) + 1 :] if model.startswith(self.base + ":") else None
        extra = getattr(request, "model_extra", None) or {}
        store = extra.get("store", getattr(request, "store", None))
        if store is not True and not (adapter is not None and await self._adapter_stores(adapter)):
            return None
        version = self.served_version(model) if adapter is not None else 0
        chat = hasattr(request, "messages")
        params = SamplingParams.of(request)
        if chat:
            turns = chat_turns(request.messages)
            prompt = await asyncio.to_thread(self._render, turns)
        else:
            turns, prompt = None, request.prompt if isinstance(request.prompt, str) else json.dumps(request.prompt)
        return Admitted(
            self,
            StoredCompletion.admitted(
                PRINCIPAL.get().tenant or "",
                "chat.completion" if chat else "text_completion",
                public_model,
                adapter,
                version,
                prompt,
                turns,
                params,
            ),
        )

    async def _adapter_stores(self, adapter: str) -> bool:
        now = time.monotonic()
        read_at, flag = self._flags.get(adapter, (-1e9, False))
        if now - read_at > STORE_FLAG_TTL_S:
            try:
                info = await self.call_store(lambda store: store.get_adapter.remote(adapter))
                flag = bool(info.store_completions)
            except Exception:  # an operator's adapter the store does not know: stored only on request
                flag = False
            self._flags[adapter] = (now, flag)
        return flag

    def _render(self, turns: tuple[ChatMessage, ...]) -> str:
        """The chat as the engine's prompt: the model's chat template with the generation prompt, as vLLM renders it."""
        try:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self._model_dir())
            plain = [{"role": t.role, "content": t.content} for t in turns]
            return self._tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        except Exception:  # a model without a chat template: the turns themselves
            return json.dumps([{"role": t.role, "content": t.content} for t in turns])

    # ---- routes ----------------------------------------------------------------------------------

    def install(self, app: FastAPI) -> None:
        r = APIRouter()
        r.add_api_route("/v1/chat/completions/{completion_id}", self.show, methods=["GET"])
        r.add_api_route("/v1/chat/completions/{completion_id}", self.delete, methods=["DELETE"])
        app.include_router(r)

    async def show(self, completion_id: str) -> Response:
        tenant, days = PRINCIPAL.get().tenant, self.cfg.limits.store_completions_days
        done = await self.call_store(lambda store: store.get_completion.remote(completion_id, tenant, days))
        return JSONResponse(openai_shape(done))

    async def delete(self, completion_id: str) -> Response:
        tenant = PRINCIPAL.get().tenant
        await self.call_store(lambda store: store.delete_completion.remote(completion_id, tenant))
        return JSONResponse(
            {
                "object": f"{'chat.completion' if completion_id.startswith('chatcmpl') else 'text_completion'}.deleted",
                "id": completion_id,
                "deleted": True,
            }
        )


def openai_shape(done: StoredCompletion) -> dict[str, Any]:
    """A stored completion as OpenAI's ``GET /v1/chat/completions/{id}`` answers it, with this app's facts beside."""
    usage = None
    if done.prompt_tokens is not None or done.completion_tokens is not None:
        pt, ct = done.prompt_tokens or 0, done.completion_tokens or 0
        usage = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}
    choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason, "logprobs": None}
    if done.object == "chat.completion":
        choice["message"] = {"role": "assistant", "content": done.output}
    else:
        choice["text"] = done.output
    return {
        "id": done.id,
        "object": done.object,
        "created": int(done.created_at),
        "model": done.model,
        "choices": [choice],
        "usage": usage,
        "metadata": {},
        "request_id": done.id,
        "coserve": {
            "adapter_version": done.version,
            "prompt": done.prompt,
            "messages": done.turns(),
            "sampling": done.params.given(),
        },
    }
