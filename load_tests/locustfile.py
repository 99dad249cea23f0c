"""Locust load test for the OpenAI-compatible API: trace-replayed arrivals, real request shapes.

    locust -f load_tests/locustfile.py --headless --host http://127.0.0.1:8000 -u 8 \
        --run-time 60s --csv reports/locust --html reports/locust.html      # == make load

What it sends
-------------
``POST /v1/completions`` and ``POST /v1/chat/completions``, some with ``"stream": true``. Each
request's prompt and output lengths come from one row of the Azure LLM inference trace
(conversation service, ``ContextTokens`` / ``GeneratedTokens``), capped so prompt + output fit
the model's context (``max_model_len`` from ``GET /v1/models``, or ``--max-model-len``) and the
output to ``--max-output-tokens``. The embedded model's tokenizer is byte-level (1 token = 1
byte), so a prompt of N tokens is N ASCII characters of pseudo-words; requests carry
``ignore_eos`` so outputs have the trace's length (a vLLM extension; ``--no-ignore-eos`` drops it).

Statistics, as Locust records them (CSV/HTML):

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: non-streamed requests, whole latency.
- ``POST /v1/completions [stream]`` and ``POST /v1/chat/completions [stream]``: streamed requests,
  response time = until the last SSE event (``data: [DONE]``), read to the end.
- ``TTFT <name> [stream]``: time to the first SSE event that carries generated text, one entry per
  streamed request (a custom request type, so Locust's "Aggregated" row counts streamed requests
  twice: read the per-name rows).

With ``--feedback-fraction F --feedback-adapter NAME``, a share F of the requests is followed by
``POST /v1/feedback`` (an SFT item: the prompt and a fixed answer), recorded as
``POST /v1/feedback`` (fails unless 202). With ``--thumbs-fraction F`` (and ``--feedback-adapter``), a share F of
the chat requests is sent with ``"store": true`` and followed by a thumbs-up or -down on the completion it was
served, by its id (``{"completion_id", "adapter", "rating"}``: up when the answer has at most ``--thumbs-max-words``
words, the goal's simulated user), recorded as ``POST /v1/feedback [thumbs]``; the adapter should be a ``kto``
one. ``--api-key`` sends a bearer key with every request.

A request fails on a non-200 status, a body without choices, an ``error`` event in the stream, or
a stream that ends without ``[DONE]``.

How arrivals follow the trace (Locust shapes set user counts, not arrival times)
-----------------------------------------------------------------------------
Users do not loop on a think time. There is one shared schedule per Locust process: a list of
``(arrival offset, request)`` built from the trace. ``TraceReplayShape.tick`` builds it on its
first call and fixes the replay's time zero ``t0`` one second later. Every user, when free, pops
the next unclaimed arrival, sleeps until ``t0 + offset``, and sends exactly that request; so
requests leave at the trace's (time-scaled) instants no matter how many users exist, as long as
some user is free when an arrival is due. The shape only sizes the pool for that: every tick
(1 s) it asks for ``in-flight requests + arrivals due in the next --lookahead-s + 2`` users,
never fewer than before (stopping a user would cut its in-flight request) and at most
``--max-users``. If the pool is at its cap and all users are busy, arrivals go out late; every
request's lateness is kept and summarised at the end ("replay lag"), and ``--replay-log`` writes
scheduled vs. actual send times per request as JSON lines. The test stops when the schedule is
exhausted and the last response is in, or at ``--run-time``.

Trace time is divided by ``--trace-speedup`` (env ``TRACE_SPEEDUP``; 2 = twice as fast).
``--trace-offset-s`` skips the trace's first seconds; ``--max-requests`` truncates the schedule.

If the trace file is missing (it lives in ``../shared/data`` beside the repo, which only the
project's machines have), the schedule is synthetic instead: Poisson arrivals at ``--synthetic-rate``
req/s with log-normal lengths around the trace's medians (prompt 1,042, output 200 tokens), and
the run logs ``SYNTHETIC POISSON SCHEDULE`` with the reason.

Common options: ``-u`` is the initial (and minimum) pool size; ``-r`` is not needed (users are
added at once when the schedule needs them); ``--run-time`` is honoured by the shape. All other
settings are the Locust options defined in ``_options`` below (``--trace-speedup 4`` on the
command line; Locust's ``--help`` does not list a locustfile's own options), each also readable
from the environment variable named there (``TRACE_SPEEDUP=4``). Single-process Locust only: in distributed
mode every worker would replay the whole schedule.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import random
import string
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import gevent
import requests
from gevent.lock import Semaphore
from locust import HttpUser, LoadTestShape, events, task
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

log = logging.getLogger("coserve.load")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "traces" / "azure_conv_sample.csv"
# Tokens the chat template and special tokens add around the prompt text (byte-level tokenizer).
TEMPLATE_TOKENS = 32
START_DELAY_S = 1.0


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    g = parser.add_argument_group("coserve trace replay")
    g.add_argument(
        "--trace-file",
        env_var="TRACE_FILE",
        default=str(DEFAULT_TRACE),
        help="Azure trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens); missing file = synthetic Poisson.",
    )
    g.add_argument(
        "--trace-speedup",
        env_var="TRACE_SPEEDUP",
        type=float,
        default=1.0,
        help="Divide trace time by this factor (2 = arrivals twice as fast).",
    )
    g.add_argument(
        "--trace-offset-s",
        env_var="TRACE_OFFSET_S",
        type=float,
        default=0.0,
        help="Skip this many seconds (trace time) from the start of the trace.",
    )
    g.add_argument(
        "--max-requests",
        env_var="MAX_REQUESTS",
        type=int,
        default=0,
        help="Truncate the schedule to this many requests (0 = no limit).",
    )
    g.add_argument(
        "--synthetic-rate",
        env_var="SYNTHETIC_RATE",
        type=float,
        default=2.0,
        help="Poisson rate (req/s) of the synthetic schedule used when the trace is missing.",
    )
    g.add_argument(
        "--synthetic-duration-s",
        env_var="SYNTHETIC_DURATION_S",
        type=float,
        default=3600.0,
        help="Length of the synthetic schedule in seconds.",
    )
    g.add_argument(
        "--model-id",
        env_var="MODEL_ID",
        default="",
        help="Model id to request; default: the first id of GET /v1/models.",
    )
    g.add_argument(
        "--max-model-len",
        env_var="MAX_MODEL_LEN",
        type=int,
        default=0,
        help="Context cap for prompt + output; default: max_model_len from GET /v1/models.",
    )
    g.add_argument(
        "--max-prompt-tokens",
        env_var="MAX_PROMPT_TOKENS",
        type=int,
        default=0,
        help="Extra cap on prompt tokens (0 = only the context cap).",
    )
    g.add_argument(
        "--max-output-tokens",
        env_var="MAX_OUTPUT_TOKENS",
        type=int,
        default=128,
        help="Cap on output tokens (max_tokens) per request.",
    )
    g.add_argument(
        "--chat-fraction",
        env_var="CHAT_FRACTION",
        type=float,
        default=0.5,
        help="Share of requests sent to /v1/chat/completions (the rest: /v1/completions).",
    )
    g.add_argument(
        "--stream-fraction",
        env_var="STREAM_FRACTION",
        type=float,
        default=0.5,
        help="Share of requests sent with stream=true.",
    )
    g.add_argument(
        "--no-ignore-eos",
        env_var="NO_IGNORE_EOS",
        action="store_true",
        default=False,
        help="Do not send ignore_eos (outputs may then end before the trace's length).",
    )
    g.add_argument(
        "--max-users",
        env_var="MAX_USERS",
        type=int,
        default=256,
        help="Upper bound on concurrent users (= requests in flight).",
    )
    g.add_argument(
        "--lookahead-s",
        env_var="LOOKAHEAD_S",
        type=float,
        default=2.0,
        help="The shape keeps a free user for every arrival due within this many seconds.",
    )
    g.add_argument(
        "--request-timeout-s",
        env_var="REQUEST_TIMEOUT_S",
        type=float,
        default=300.0,
        help="Read timeout of one request.",
    )
    g.add_argument(
        "--load-seed", env_var="LOAD_SEED", type=int, default=0, help="Seed for prompt text and the synthetic schedule."
    )
    g.add_argument(
        "--api-key",
        env_var="API_KEY",
        default="",
        help="Sent as `Authorization: Bearer <key>` (an app with auth keys).",
    )
    g.add_argument(
        "--feedback-fraction",
        env_var="FEEDBACK_FRACTION",
        type=float,
        default=0.0,
        help="Share of answered requests followed by a feedback item (SFT: the prompt and the answer).",
    )
    g.add_argument(
        "--feedback-adapter",
        env_var="FEEDBACK_ADAPTER",
        default="",
        help="The adapter that feedback goes to (it must exist); needed with --feedback-fraction.",
    )
    g.add_argument(
        "--thumbs-fraction",
        env_var="THUMBS_FRACTION",
        type=float,
        default=0.0,
        help='Share of chat requests stored ("store": true) and rated by their completion id.',
    )
    g.add_argument(
        "--thumbs-max-words",
        env_var="THUMBS_MAX_WORDS",
        type=int,
        default=25,
        help="A served answer of at most this many words gets a thumbs-up, a longer one a thumbs-down.",
    )
    g.add_argument(
        "--replay-log",
        env_var="REPLAY_LOG",
        default="",
        help="Write one JSON line per sent request (scheduled vs. actual send time) here.",
    )


# ---- the schedule ---------------------------------------------------------------------------


@dataclass
class Arrival:
    index: int
    offset_s: float  # when to send, seconds after t0 (already time-scaled)
    prompt_tokens: int
    output_tokens: int
    chat: bool
    stream: bool
    feedback: bool = False  # followed by a feedback item (--feedback-fraction)
    thumbs: bool = False  # a stored chat completion, rated by its id (--thumbs-fraction)
    sent_s: float | None = None


@dataclass
class Plan:
    arrivals: list[Arrival]
    source: str  # "trace <path>" or "synthetic poisson"
    model: str
    max_model_len: int
    t0: float  # time.time() of offset 0
    ignore_eos: bool
    timeout_s: float
    replay_log: str
    feedback_adapter: str = ""
    thumbs_max_words: int = 25
    next_index: int = 0
    in_flight: int = 0
    done: int = 0
    corpus: str = ""
    rng: random.Random = field(default_factory=random.Random)

    def claim(self) -> Arrival | None:
        """The next unclaimed arrival (gevent is cooperative: no yield between read and bump)."""
        if self.next_index >= len(self.arrivals):
            return None
        a = self.arrivals[self.next_index]
        self.next_index += 1
        return a

    def exhausted(self) -> bool:
        """Every arrival was claimed and its request has finished."""
        return self.done >= len(self.arrivals)

    def due_within(self, now_rel: float, horizon_s: float) -> int:
        """Unclaimed arrivals due before now + horizon (the schedule is sorted by offset)."""
        n = 0
        for a in self.arrivals[self.next_index :]:
            if a.offset_s > now_rel + horizon_s:
                break
            n += 1
        return n

    def prompt(self, n_chars: int) -> str:
        start = self.rng.randrange(0, len(self.corpus) - n_chars)
        return self.corpus[start : start + n_chars]


_plan: Plan | None = None
_plan_lock = Semaphore()


def _fetch_models(host: str, api_key: str = "") -> list[dict[str, Any]]:
    deadline = time.time() + 60
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    while True:
        try:
            r = requests.get(f"{host.rstrip('/')}/v1/models", headers=headers, timeout=10)
            r.raise_for_status()
            return r.json()["data"]
        except (requests.RequestException, KeyError, ValueError) as exc:
            if time.time() > deadline:
                raise RuntimeError(f"GET {host}/v1/models failed for 60 s: {exc}") from exc
            gevent.sleep(2)


def _spread(i: int, alpha: float) -> float:
    """Low-discrepancy sequence in [0, 1): every mix of endpoint/streaming shows up early."""
    return (i * alpha) % 1.0


def _read_trace(path: Path, offset_s: float, speedup: float) -> list[tuple[float, int, int]]:
    rows = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            ts = datetime.strptime(row["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()
            rows.append((ts, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    if not rows:
        raise RuntimeError(f"trace {path} has no rows")
    rows.sort()
    first = rows[0][0]
    out = []
    for ts, ctx, gen in rows:
        t = ts - first - offset_s
        if t >= 0:
            out.append((t / speedup, ctx, gen))
    return out


def _synthetic(rate: float, duration_s: float, rng: random.Random) -> list[tuple[float, int, int]]:
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            return out
        # Log-normal around the conversation trace's medians (1,042 in, 200 out).
        out.append(
            (
                t,
                max(1, int(rng.lognormvariate(math.log(1042), 0.8))),
                max(1, int(rng.lognormvariate(math.log(200), 0.8))),
            )
        )


def _corpus(rng: random.Random, size: int = 1 << 16) -> str:
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(4000)]
    text = []
    n = 0
    while n < size:
        w = rng.choice(words)
        text.append(w)
        n += len(w) + 1
    return " ".join(text)


def get_plan(environment: Environment) -> Plan:
    """Build the shared schedule once per process (first shape tick or first user)."""
    global _plan
    with _plan_lock:
        if _plan is not None:
            return _plan
        opts = environment.parsed_options
        if isinstance(environment.runner, (MasterRunner, WorkerRunner)):
            log.warning("distributed Locust: every worker replays the whole schedule; run single-process")
        host = environment.host or ""
        model, max_len = opts.model_id, opts.max_model_len
        if not model or not max_len:
            cards = _fetch_models(host, opts.api_key)
            if not cards:
                raise RuntimeError(f"GET {host}/v1/models lists no model")
            card = next((c for c in cards if c["id"] == model), cards[0]) if model else cards[0]
            model = model or card["id"]
            max_len = max_len or int(card.get("max_model_len") or 0)
            if not max_len:
                raise RuntimeError("/v1/models gives no max_model_len; pass --max-model-len")
        rng = random.Random(opts.load_seed)
        trace = Path(opts.trace_file).expanduser()
        if trace.is_file():
            rows = _read_trace(trace, opts.trace_offset_s, opts.trace_speedup)
            source = f"trace {trace} (speedup {opts.trace_speedup:g}, offset {opts.trace_offset_s:g} s)"
        else:
            rows = _synthetic(opts.synthetic_rate, opts.synthetic_duration_s, rng)
            source = f"synthetic poisson ({opts.synthetic_rate:g} req/s)"
            log.warning(
                "SYNTHETIC POISSON SCHEDULE: trace file %s not found; sending Poisson arrivals at %g req/s "
                "with log-normal lengths",
                trace,
                opts.synthetic_rate,
            )
        if opts.max_requests > 0:
            rows = rows[: opts.max_requests]
        max_out = max(1, min(opts.max_output_tokens, max_len - TEMPLATE_TOKENS - 1))
        arrivals = []
        for i, (t, ctx, gen) in enumerate(rows):
            out = max(1, min(gen, max_out))
            cap = max_len - out - TEMPLATE_TOKENS
            if opts.max_prompt_tokens > 0:
                cap = min(cap, opts.max_prompt_tokens)
            arrivals.append(
                Arrival(
                    index=i,
                    offset_s=t,
                    prompt_tokens=max(1, min(ctx, cap)),
                    output_tokens=out,
                    chat=_spread(i, 0.6180339887498949) < opts.chat_fraction,
                    stream=_spread(i, 0.4142135623730951) < opts.stream_fraction,
                    feedback=bool(opts.feedback_adapter) and _spread(i, 0.7548776662466927) < opts.feedback_fraction,
                    thumbs=bool(opts.feedback_adapter) and _spread(i, 0.5698402909980532) < opts.thumbs_fraction,
                )
            )
        _plan = Plan(
            arrivals=arrivals,
            source=source,
            model=model,
            max_model_len=max_len,
            t0=time.time() + START_DELAY_S,
            ignore_eos=not opts.no_ignore_eos,
            timeout_s=opts.request_timeout_s,
            replay_log=opts.replay_log,
            feedback_adapter=opts.feedback_adapter,
            thumbs_max_words=opts.thumbs_max_words,
            corpus=_corpus(rng),
            rng=rng,
        )
        span = arrivals[-1].offset_s if arrivals else 0.0
        log.info(
            "replay schedule: %d requests over %.0f s from %s; model %s, max_model_len %d, max output %d tokens",
            len(arrivals),
            span,
            source,
            model,
            max_len,
            max_out,
        )
        return _plan


@events.test_stop.add_listener
def _summary(environment: Environment, **_: Any) -> None:
    plan = _plan
    if plan is None:
        return
    sent = [a for a in plan.arrivals if a.sent_s is not None]
    due = sum(1 for a in plan.arrivals if a.offset_s <= time.time() - plan.t0)
    if sent:
        lags = sorted(a.sent_s - a.offset_s for a in sent)
        p = lambda q: lags[min(len(lags) - 1, int(q * len(lags)))]  # noqa: E731
        log.info(
            "replay lag (actual - scheduled send time): %d sent of %d due; p50 %.3f s, p99 %.3f s, max %.3f s",
            len(sent),
            due,
            p(0.5),
            p(0.99),
            lags[-1],
        )
    if plan.replay_log:
        with open(plan.replay_log, "w") as f:
            for a in sent:
                f.write(
                    json.dumps(
                        {
                            "index": a.index,
                            "scheduled_s": round(a.offset_s, 4),
                            "sent_s": round(a.sent_s, 4),
                            "prompt_tokens": a.prompt_tokens,
                            "output_tokens": a.output_tokens,
                            "chat": a.chat,
                            "stream": a.stream,
                        }
                    )
                    + "\n"
                )


# ---- the user -------------------------------------------------------------------------------


class OpenAIUser(HttpUser):
    """Sends the schedule's requests at their arrival times; see the module docstring."""

    # No think time: the schedule decides when the next request leaves.
    def wait_time(self) -> float:
        return 0

    def on_start(self) -> None:
        key = self.environment.parsed_options.api_key
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"

    @task
    def replay(self) -> None:
        plan = get_plan(self.environment)
        arrival = plan.claim()
        if arrival is None:
            gevent.sleep(1.0)  # schedule done; the shape ends the test once the last response is in
            return
        delay = plan.t0 + arrival.offset_s - time.time()
        if delay > 0:
            gevent.sleep(delay)
        arrival.sent_s = time.time() - plan.t0
        plan.in_flight += 1
        try:
            self.send(plan, arrival)
        finally:
            plan.in_flight -= 1
            plan.done += 1

    def send(self, plan: Plan, a: Arrival) -> None:
        text = plan.prompt(a.prompt_tokens)
        body: dict[str, Any] = {"model": plan.model, "max_tokens": a.output_tokens, "temperature": 0.8}
        if plan.ignore_eos:
            body["ignore_eos"] = True
        thumbs = a.thumbs and a.chat
        if a.chat:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
            if thumbs:
                body["store"] = True
        else:
            path, body["prompt"] = "/v1/completions", text
        if a.stream:
            body["stream"] = True
            served = self._streamed(plan, path, body)
        else:
            served = self._unary(plan, path, body)
        if a.feedback:
            self._feedback(plan, text)
        if thumbs and served is not None:
            self._thumbs(plan, *served)

    def _thumbs(self, plan: Plan, completion_id: str, answer: str) -> None:
        """A thumbs-up or -down on the completion just served, by its id (the store kept it: "store": true)."""
        rating = "up" if len(answer.split()) <= plan.thumbs_max_words else "down"
        item = {"completion_id": completion_id, "adapter": plan.feedback_adapter, "rating": rating}
        with self.client.post(
            "/v1/feedback",
            json=item,
            name="POST /v1/feedback [thumbs]",
            catch_response=True,
            timeout=(10, plan.timeout_s),
        ) as resp:
            if resp.status_code == 202:
                resp.success()
            else:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:300]}")

    def _feedback(self, plan: Plan, prompt: str) -> None:
        """One SFT item for the adapter under test; a 202 means the store has it durably."""
        item = {"adapter": plan.feedback_adapter, "prompt": prompt[:2000], "completion": "A short, helpful answer."}
        with self.client.post(
            "/v1/feedback", json=item, name="POST /v1/feedback", catch_response=True, timeout=(10, plan.timeout_s)
        ) as resp:
            if resp.status_code == 202:
                resp.success()
            else:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:300]}")

    def _unary(self, plan: Plan, path: str, body: dict[str, Any]) -> tuple[str, str] | None:
        """Send one request; (its id, choice 0's text) when it succeeded."""
        with self.client.post(path, json=body, name=path, catch_response=True, timeout=(10, plan.timeout_s)) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:300]}")
                return None
            try:
                data = resp.json()
                ok = bool(data["choices"]) and data["usage"]["completion_tokens"] > 0
            except (ValueError, KeyError, TypeError):
                ok = False
            if ok:
                resp.success()
                choice = data["choices"][0]
                return data.get("id", ""), choice.get("text") or (choice.get("message") or {}).get("content") or ""
            resp.failure(f"response without choices/usage: {resp.text[:300]}")
            return None

    def _streamed(self, plan: Plan, path: str, body: dict[str, Any]) -> tuple[str, str] | None:
        """Send one streamed request, read to the end; (its id, choice 0's text) when it succeeded."""
        name = f"{path} [stream]"
        ident, text = "", []
        start = time.perf_counter()
        with self.client.post(
            path, json=body, name=name, stream=True, catch_response=True, timeout=(10, plan.timeout_s)
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:300]}")
                return None
            ttft = None
            chunks = 0
            nbytes = 0
            done = False
            error = None
            for line in resp.iter_lines():
                if not line:
                    continue
                nbytes += len(line)
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(payload)
                except ValueError:
                    error = f"bad SSE payload: {payload[:200]!r}"
                    break
                if "error" in event:
                    error = f"error event: {json.dumps(event['error'])[:300]}"
                    break
                ident = ident or event.get("id", "")
                for choice in event.get("choices") or []:
                    piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if piece and choice.get("index", 0) == 0:
                        text.append(piece)
                    if piece:
                        chunks += 1
                        if ttft is None:
                            ttft = (time.perf_counter() - start) * 1000
            total = (time.perf_counter() - start) * 1000
            resp.request_meta["response_time"] = total
            resp.request_meta["response_length"] = nbytes
            if error:
                resp.failure(error)
            elif not done:
                resp.failure("stream ended without data: [DONE]")
            elif ttft is None:
                resp.failure("stream carried no generated text")
            else:
                resp.success()
                events.request.fire(
                    request_type="TTFT", name=name, response_time=ttft, response_length=0, exception=None, context={}
                )
                return ident, "".join(text)
        return None


# ---- the shape ------------------------------------------------------------------------------


class TraceReplayShape(LoadTestShape):
    """Sizes the user pool so every scheduled arrival finds a free user; see the module docstring."""

    use_common_options = True  # reads -u (initial pool) and --run-time itself

    def __init__(self) -> None:
        super().__init__()
        self.users = 0

    def tick(self) -> tuple[int, float] | None:
        env = self.runner.environment
        opts = env.parsed_options
        plan = get_plan(env)
        if opts.run_time and self.get_run_time() >= opts.run_time:
            return None
        if plan.exhausted():
            log.info("schedule exhausted: %d requests done", plan.done)
            return None
        now_rel = time.time() - plan.t0
        want = plan.in_flight + plan.due_within(now_rel, opts.lookahead_s) + 2
        floor = opts.num_users or 1
        self.users = min(opts.max_users, max(self.users, want, floor))
        return self.users, float(max(self.users, 1))
