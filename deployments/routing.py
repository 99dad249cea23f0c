"""Placement of each request on a node, decided where routing happens (LEMIX §IV-B/C through ``planners/placement/``).

With HAProxy in front (``app/serve_env.py``), HAProxy asks an *ingress request router* which
model server replica takes each request, then forwards the request straight to it
(``compat.with_ingress_request_router``, the hook Ray Serve LLM's direct streaming uses;
HAProxy's Lua calls ``POST /internal/route`` with the request body):

- :class:`PlacementRouter` is that router deployment. It turns the body into a :class:`Task`
  (model, the prompt's token count estimated from its length (:class:`PromptEstimate`: the replica
  tokenizes it, once), ``max_tokens``, the request's ``X-Request-Id`` as its id) and asks the model
  server deployment's handle to choose a replica without sending anything
  (``DeploymentHandle.choose_replica``).
- :class:`NodeRequestRouter` is the model server deployment's Serve request router
  (``ray.serve.request_router.RequestRouter``). It keeps the configured placement policy from the
  registry and a :class:`RoutingTable` fed by the planner's published snapshot (node facts,
  execution traces for the policy's calibration, the training steps granted now, which it commits
  so inference is planned past their backwards), polled every ``planner.trace_flush_seconds``.
  The policy chooses a node; the router answers with that node's replica. No request waits on
  the planner actor.

The router reads a body only for a request whose key it knows (or in local mode, with no keys):
HAProxy's Lua forwards the client's ``Authorization`` header with the body
(``deployments/haproxy_patch.py``), and a request with no key or an unknown one is placed without
reading its body (on any replica, which answers it 401), so a client without a key cannot make the
router parse or tokenize anything. It places a tenant's adapter under the engine's name for it
(acme's ``base:support`` is ``base:acme/support``, as the replica maps it), and a request that names
no ``max_tokens`` at the length the replica will give it (``limits.max_tokens`` for chat).

With one node there is nothing to choose, and the app attaches no router: HAProxy forwards every
request to the one replica. With several nodes of which one takes requests (the others starting or
replaced), the router answers with it at once, without the policy. A request the policy cannot place (an unknown model, no node serving
an adapter) goes to any live replica, which answers it (404, or the base model's 503) itself, so a
client error never becomes HAProxy's routing failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

import compat
from actors.serving import request_stages
from deployments.front_door import ROUTER_MARKER_HEADER
from deployments.guard import bearer_token
from deployments.keys import LOCAL, Principal
from deployments.prompt_tokens import PromptCounter
from deployments.request_rules import default_output_tokens, engine_model_name
from planners import registry
from planners.routing import RoutingTable
from planners.types import Task
from settings import AppConfig

# Whoever sends a request the router cannot identify (HAProxy not forwarding keys): names go as sent.
ANONYMOUS = Principal(None, False, "anonymous")
logger = logging.getLogger(__name__)

DECISIONS_KEPT = 4096  # Serve may ask choose_replicas more than once per request: one decision each
# The planner's long poll answers at least this often, and at once on a change (Planner.routing_snapshot).
SNAPSHOT_WAIT_S = 5.0


class NodeRequestRouter(RequestRouter):
    """The model server deployment's request router: the placement policy picks the node."""

    def initialize_state(self, poll_s: float | None = None, **kwargs: Any) -> None:
        """``poll_s``: how often at most to read the planner's snapshot (``planner.trace_flush_seconds``)."""
        self.poll_s = poll_s
        self.table = RoutingTable()
        self.policy: Any = None
        self._policy_key: tuple[str, str] | None = None
        self._decided: OrderedDict[str, int] = OrderedDict()
        self._planner: Any = None
        if poll_s is not None:
            self._event_loop.create_task(self._follow_planner())

    # ---- the planner's snapshot --------------------------------------------------------------

    async def _follow_planner(self) -> None:
        while True:
            try:
                if self._planner is None:
                    from actors.control.planner import find_planner

                    self._planner = await asyncio.to_thread(
                        find_planner, self._deployment_id.app_name, self._deployment_id.name
                    )
                snapshot = await self._planner.routing_snapshot.remote(
                    self.table.seq, self.table.version, SNAPSHOT_WAIT_S
                )
                self._adopt_policy(snapshot.placement, snapshot.placement_params)
                for trace in self.table.update(snapshot):
                    self.policy.observe(trace)
                # Training steps granted on a node enter this policy's Q_train^n (LEMIX Alg. 1), planned
                # from their grant, and leave it once done; inference forwards are planned past them.
                placed, done = self.table.training_changes()
                for p in placed:
                    self.policy.commit(p.task, p.node_id, p.task.arrival)
                for task_id in done:
                    self.policy.forget(task_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the planner (re)starting: keep routing on what is known
                logger.warning("placement router: no planner snapshot (%s: %s)", type(exc).__name__, exc)
                self._planner = None
                await asyncio.sleep(1.0)
            await asyncio.sleep(self.poll_s)

    def _adopt_policy(self, name: str, params: dict[str, Any]) -> None:
        key = (name, json.dumps(params, sort_keys=True, default=repr))
        if key != self._policy_key:
            self.policy = registry.create("placement", name, **params)
            self._policy_key = key
            self.table.policy_replaced()
            logger.info("placement router: policy %s", name)

    # ---- Serve's hook -----------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if len(candidate_replicas) == 1:
            return [candidate_replicas]  # one node takes requests now: nothing to decide
        by_node = {r.replica_metadata.get("node_id"): r for r in candidate_replicas}
        task = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(task, Task) or self.policy is None:
            return [candidate_replicas]  # no task (a handle call) or no snapshot yet: Serve's own pick
        key = pending_request.metadata.internal_request_id
        node = self._decided.get(key)
        if node not in by_node:
            node = self._place(task, by_node)
            self._decided[key] = node
            while len(self._decided) > DECISIONS_KEPT:
                self._decided.popitem(last=False)
        return [[by_node[node]]] if node in by_node else [candidate_replicas]

    def _place(self, task: Task, by_node: dict[Any, RunningReplica]) -> int | None:
        if not self.table.knows(task.model):
            return None  # any replica answers the 404
        now = time.time()
        node = self.policy.choose(task, self.table.views(task.model, by_node.keys()), now)
        if node is not None:
            self.table.placed(node, now)
        return node


router_app = FastAPI()


class PromptEstimate:
    """The prompt's token count a placement plans with, from the length of its text: the model's tokenizer is
    measured once, at start (tokens per character of a sample, and what the chat template adds per message and
    per conversation), not run on every request. The replica's vLLM tokenizes the request anyway; a second,
    exact count here cost the router a tokenizer pass (and a chat template render) per request, on the path
    of every request, to plan with a figure that only has to be close."""

    SAMPLE = (
        "Could you help me plan a short trip? I would like to spend three days in a city by the sea, walk "
        "a lot, eat well and visit one or two museums. Please suggest a plan for each day, with the places "
        "to see in the morning and the afternoon, where to have dinner, and how to get around without a "
        "car. Keep it simple and tell me what to book in advance."
    )

    def __init__(self, counter: PromptCounter) -> None:
        self.counter = counter
        self.per_char = max(1e-3, len(counter.tok(self.SAMPLE).input_ids) / len(self.SAMPLE))
        self.bos = max(0, len(counter.tok("").input_ids))
        one = counter.count({"messages": [{"role": "user", "content": self.SAMPLE}]})
        two = counter.count(
            {
                "messages": [
                    {"role": "user", "content": self.SAMPLE},
                    {"role": "assistant", "content": self.SAMPLE},
                    {"role": "user", "content": self.SAMPLE},
                ]
            }
        )
        text = self._text_tokens(self.SAMPLE)
        self.per_message = max(0.0, (two - one - 2 * text) / 2)
        self.per_chat = max(0.0, one - text - self.per_message)

    def _text_tokens(self, text: str) -> float:
        return len(text) * self.per_char

    def count(self, body: dict[str, Any]) -> int:
        try:
            if "messages" in body:
                messages = body["messages"] if isinstance(body["messages"], list) else []
                total = self.per_chat
                for m in messages:
                    content = m.get("content") if isinstance(m, dict) else None
                    if isinstance(content, list):  # OpenAI content parts: their text counts
                        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
                    total += self.per_message + self._text_tokens(content if isinstance(content, str) else "")
                return max(1, round(total))
            prompt = body.get("prompt")
            prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
            total = 0.0
            for p in prompts:
                total += len(p) if isinstance(p, list) else self.bos + self._text_tokens(p) if isinstance(p, str) else 0
            return max(1, round(total))
        except Exception:  # a malformed body: the replica rejects it, the count does not matter
            return 1


@serve.ingress(router_app)
class PlacementRouter:
    """HAProxy's ingress request router: ``POST /internal/route`` answers which replica takes the request."""

    def __init__(self, server: Any, config: AppConfig) -> None:
        from actors.models.default_model import model_dir
        from deployments.keys import KeyRing

        self.server = server
        self.cfg = config
        self.keys = KeyRing.load(config.auth.keys_file, config.auth.keys_env, config.data_path)
        self._warned_unmarked = False
        self.counter = PromptEstimate(PromptCounter(model_dir(config)))
        compat.start_handle(self.server)

    @router_app.post("/internal/route")
    async def route(self, request: Request) -> dict[str, Any]:
        arrival = time.perf_counter()
        task = None
        principal = self._principal(request.headers)
        if principal is not None:
            task = self._task(await request.body(), request.headers.get("x-request-id"), principal)
        counted = time.perf_counter()
        try:
            async with compat.choose_replica(self.server, *(() if task is None else (task,))) as chosen:
                endpoint, replica_id = compat.chosen_http_endpoint(chosen)
                if endpoint is None:
                    raise HTTPException(503, f"replica {chosen.replica_id} has no HTTP endpoint")
                host, port = endpoint
                log = request_stages.request_log()
                if log is not None:  # a benchmark's request log: this hop's share of the request's time
                    log.write(
                        {
                            "kind": "route",
                            "id": request.headers.get("x-request-id", ""),
                            "arrival": arrival,
                            "counted": counted,
                            "chosen": time.perf_counter(),
                        }
                    )
                return {"host": host, "port": port, "replica_id": replica_id}
        except HTTPException:
            raise
        except Exception as exc:  # HAProxy falls back to its own balancing on any non-200
            raise HTTPException(503, f"{type(exc).__name__}: {exc}") from None

    @router_app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    def _principal(self, headers: Mapping[str, str]) -> Principal | None:
        """Who sends this request, when placement may read its body: local mode, or the holder of a known key.
        None: the body is not read (no key, an unknown one); any replica then answers 401."""
        if not self.keys.enabled:
            return LOCAL
        if ROUTER_MARKER_HEADER not in headers:
            # HAProxy was not started through app/serve_env.py: no key reaches the router, so it cannot tell
            # a client with a key from one without; it places by the body as before, and says so once.
            if not self._warned_unmarked:
                self._warned_unmarked = True
                logger.warning(
                    "placement router: HAProxy does not forward the client's key (start Serve with "
                    "app/serve_env.py's settings); bodies are read before the key is checked"
                )
            return ANONYMOUS
        return self.keys.identify(bearer_token(headers.get("authorization")))

    def _task(self, raw: bytes, request_id: str | None, principal: Principal) -> Task | None:
        try:
            body = json.loads(raw) if raw else None
        except (ValueError, RecursionError):  # the replica answers 400; routing does not need the body
            return None
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return None
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        prompt_tokens = self.counter.count(body)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            # The length the replica gives it, within the room the prompt leaves (as vLLM's get_max_tokens).
            room = max(1, self.cfg.model.max_model_len - prompt_tokens)
            max_tokens = min(
                room,
                default_output_tokens("messages" in body, self.cfg.limits.max_tokens, self.cfg.model.max_model_len),
            )
        return Task(
            task_id=request_id or "",
            kind="inference",
            model=engine_model_name(principal, body["model"]),
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            arrival=time.time(),
        )
