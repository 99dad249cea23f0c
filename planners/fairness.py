"""Fair admission across tenants: per-tenant virtual token counters and the queue that admits requests to the engine.

VTC, "Fairness in Serving Large Language Models" (Sheng et al., OSDI 2024). Each tenant t has a
virtual token counter c_t, the service it has received: w_p per prompt token when a request of t
is admitted, w_q per output token as it is generated, each divided by t's weight (a paying tenant
with weight 2 pays half per token, so it gets twice the share). When the engine has room, the
waiting request of the tenant with the least c_t goes next (VTC Alg. 2). A tenant that had nothing
waiting or running is lifted to the least counter among the active tenants before it queues
(``c_t = max(c_t, min_active c)``), so a tenant that was idle does not bank credit and then starve
the others; with nobody active, to the counter the last active tenant left with. Between two
backlogged tenants the service difference stays bounded (VTC Thm. 4.4: 2·max(w_p·L_in + w_q·M));
a tenant alone takes every slot it is allowed.

vLLM's ``priority`` scheduling only reorders its waiting queue and preempts only under KV-cache
pressure (vLLM #19057), never for a free sequence slot, so a flood that already holds every running
slot keeps it. :class:`AdmissionQueue` therefore holds requests in front of the engine: at most
``slots`` sequences are admitted at once (the engine's ``max_num_seqs``), and one tenant at most
``tenant_slots`` of them, so a slot stays free for another tenant's next request. An admitted
request also carries its tenant's counter as its vLLM priority (lower runs first).

Training shares the counters: the planner keeps one :class:`TenantCounters` across nodes, charged with what the
replicas report they served each tenant and with the training tokens of each tenant's adapters
(:meth:`TenantCounters.charge_training`), and shows each tenant's share in ``/v1/status``.

Pure: no I/O, no clocks (the caller passes ``now``); the replica's ``actors/serving/fair_admission.py``
holds the asyncio side.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from planners.registry import register


@dataclass(frozen=True)
class TokenWeights:
    """VTC's cost of a token: w_p per prompt (prefill) token, w_q per output (decode) token, w_t per training token."""

    prefill: float = 1.0
    decode: float = 2.0
    training: float = 1.0

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.training) < 0:
            raise ValueError("token weights must be >= 0")


@dataclass(frozen=True)
class TenantTokens:
    """What one replica served a tenant since its last report (``NodeReport.tenant_tokens``)."""

    tenant: str
    requests: int
    prompt_tokens: int
    output_tokens: int


@dataclass
class TenantService:
    """What one tenant has been served (raw token counts; the counter holds them weighted)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    training_tokens: int = 0
    requests: int = 0


class TenantCounters:
    """VTC's virtual token counters c_t, one per tenant, and the raw service behind them."""

    def __init__(self, weights: TokenWeights | None = None, tenant_weights: Mapping[str, float] | None = None) -> None:
        self.weights = weights or TokenWeights()
        self.tenant_weights = dict(tenant_weights or {})
        if any(w <= 0 for w in self.tenant_weights.values()):
            raise ValueError("tenant weights must be > 0")
        self._counters: dict[str, float] = {}
        self.service: dict[str, TenantService] = {}
        self._floor = 0.0  # the least active counter when the active set last emptied (VTC's c_l)

    def weight(self, tenant: str) -> float:
        """The tenant's share weight (1 unless ``tenant_weights`` names it)."""
        return self.tenant_weights.get(tenant, 1.0)

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def counters(self) -> dict[str, float]:
        return dict(self._counters)

    def lift(self, tenant: str, active: Iterable[str]) -> None:
        """``tenant`` becomes active again: raise its counter to the least counter of the ``active`` tenants
        (VTC Alg. 2, lines 4-8), or to where the last active tenant left off when none is active."""
        others = [self.counter(t) for t in active if t != tenant]
        floor = min(others) if others else self._floor
        self._counters[tenant] = max(self.counter(tenant), floor)

    def went_idle(self, tenant: str, active: Iterable[str]) -> None:
        """``tenant`` has nothing waiting or running any more; remember the floor if nobody else is active."""
        if not any(t != tenant for t in active):
            self._floor = max(self._floor, self.counter(tenant))

    def _add(self, tenant: str, cost: float) -> None:
        self._counters[tenant] = self.counter(tenant) + cost / self.weight(tenant)

    def charge_prefill(self, tenant: str, tokens: int) -> None:
        """A request of ``tenant`` with ``tokens`` prompt tokens was admitted."""
        s = self.service.setdefault(tenant, TenantService())
        s.prompt_tokens += tokens
        s.requests += 1
        self._add(tenant, self.weights.prefill * tokens)

    def charge_decode(self, tenant: str, tokens: int) -> None:
        """The engine generated ``tokens`` more output tokens for ``tenant``."""
        self.service.setdefault(tenant, TenantService()).output_tokens += tokens
        self._add(tenant, self.weights.decode * tokens)

    def charge_served(self, served: Iterable[TenantTokens]) -> None:
        """Inference a replica reports it served (the planner's ledger across nodes)."""
        for t in served:
            s = self.service.setdefault(t.tenant, TenantService())
            s.requests += t.requests
            s.prompt_tokens += t.prompt_tokens
            s.output_tokens += t.output_tokens
            self._add(t.tenant, self.weights.prefill * t.prompt_tokens + self.weights.decode * t.output_tokens)

    def charge_training(self, tenant: str, tokens: int) -> None:
        """The trainer ran ``tokens`` training tokens for an adapter of ``tenant`` (its share pays for them)."""
        self.service.setdefault(tenant, TenantService()).training_tokens += tokens
        self._add(tenant, self.weights.training * tokens)

    def share(self, tenant: str) -> float:
        """The tenant's part of all weighted service so far, in [0, 1] (0 when nobody has been served)."""
        total = sum(self._weighted(t) for t in self.service)
        return self._weighted(tenant) / total if total > 0 else 0.0

    def summary(self) -> dict[str, dict[str, float]]:
        """Per tenant: requests, prompt, output and training tokens, counter, and share of the weighted service."""
        return {
            t: {
                "requests": s.requests,
                "prompt_tokens": s.prompt_tokens,
                "output_tokens": s.output_tokens,
                "training_tokens": s.training_tokens,
                "counter": round(self.counter(t), 1),
                "share": round(self.share(t), 4),
            }
            for t, s in sorted(self.service.items())
        }

    def _weighted(self, tenant: str) -> float:
        s = self.service.get(tenant)
        if s is None:
            return 0.0
        w = self.weights
        return w.prefill * s.prompt_tokens + w.decode * s.output_tokens + w.training * s.training_tokens


@dataclass(frozen=True)
class AdmissionRequest:
    """A request that asks the engine for ``slots`` sequences (its ``n``)."""

    request_id: str
    tenant: str
    prompt_tokens: int
    arrival: float
    slots: int = 1
    keyed: bool = True
    """False: local mode (no API keys), one user and nobody to be fair to: never held, never capped; vLLM's own
    queue orders its requests, as under ``fcfs``."""


@dataclass(frozen=True)
class Admission:
    """A request let into the engine, with the vLLM priority it runs at (lower first) and how long it waited."""

    request_id: str
    tenant: str
    priority: int
    waited: float


class AdmissionPolicy:
    """Which waiting request goes to the engine next, and whether the queue holds requests at all.

    Params (every policy; the counters are kept under each, for ``/metrics`` and training shares):
    ``prefill_weight`` (w_p, 1), ``decode_weight`` (w_q, 2), ``training_weight`` (1): the cost of a prompt,
    an output and a training token.
    """

    qualified_name = "admission.?"
    holds = True
    """False: every request goes to the engine at once (vLLM's own order decides)."""
    sets_priority = False
    """True: admitted requests carry a vLLM priority, so the engine must schedule by ``priority``."""

    def __init__(self, prefill_weight: float = 1.0, decode_weight: float = 2.0, training_weight: float = 1.0) -> None:
        self.weights = TokenWeights(float(prefill_weight), float(decode_weight), float(training_weight))

    def order(self, head: AdmissionRequest, counters: TenantCounters) -> tuple[float, ...]:
        """Sort key of a tenant's oldest waiting request: the least goes next."""
        raise NotImplementedError

    def priority(self, tenant: str, counters: TenantCounters) -> int:
        """The vLLM priority of an admitted request of ``tenant`` (lower runs first)."""
        return 0


@register("admission", "fcfs")
class FirstComeFirstServed(AdmissionPolicy):
    """The baseline: every request goes to the engine as it arrives and vLLM runs them first come, first served."""

    holds = False

    def order(self, head: AdmissionRequest, counters: TenantCounters) -> tuple[float, ...]:
        return (head.arrival,)


@register("admission", "vtc")
class VirtualTokenCounter(AdmissionPolicy):
    """Ours: VTC (Sheng et al., OSDI 2024, Alg. 2): the tenant with the least virtual token counter goes next.

    ``hold`` (True): the queue holds requests while the engine's slots (or the tenant's share of them) are taken;
    False sends every request at once with its counter as the vLLM priority alone, which reorders vLLM's waiting
    queue but never frees a running slot (``bench/fairness.py`` measures both).
    """

    sets_priority = True

    def __init__(self, hold: bool = True, **weights: float) -> None:
        super().__init__(**weights)
        self.holds = bool(hold)

    def order(self, head: AdmissionRequest, counters: TenantCounters) -> tuple[float, ...]:
        return (counters.counter(head.tenant), head.arrival)

    def priority(self, tenant: str, counters: TenantCounters) -> int:
        return int(counters.counter(tenant))


@dataclass
class _Running:
    tenant: str
    slots: int


@dataclass
class AdmissionQueue:
    """One engine's admissions: per-tenant FIFO queues in front of it, ordered by ``policy`` across tenants.

    ``slots``: sequences the engine runs at once (its ``max_num_seqs``); ``tenant_slots``: the most one tenant
    may hold (fewer, so a slot stays free for someone else; None: no cap). The caller reports each request's
    life: :meth:`arrive`, then :meth:`admit` (which returns what may go now), :meth:`generated` as output
    tokens come, :meth:`finish` at its end, or :meth:`cancel` if it leaves while waiting.
    """

    policy: AdmissionPolicy
    counters: TenantCounters
    slots: int
    tenant_slots: int | None = None
    waiting: dict[str, deque[AdmissionRequest]] = field(default_factory=dict)
    running: dict[str, _Running] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)  # tenant -> slots its running requests hold

    def __post_init__(self) -> None:
        if self.slots < 1 or (self.tenant_slots is not None and self.tenant_slots < 1):
            raise ValueError("slots and tenant_slots must be >= 1")

    def active(self) -> set[str]:
        """Tenants with a request waiting or running."""
        return {t for t, q in self.waiting.items() if q} | {t for t, n in self.held.items() if n > 0}

    def in_use(self) -> int:
        return sum(self.held.values())

    def queued(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def arrive(self, request: AdmissionRequest) -> None:
        """``request`` asks to run; an idle tenant's counter is lifted first."""
        active = self.active()
        if request.tenant not in active:
            self.counters.lift(request.tenant, active)
        self.waiting.setdefault(request.tenant, deque()).append(request)

    def admit(self, now: float) -> list[Admission]:
        """The waiting requests that go to the engine now, in the policy's order (each charged its prompt)."""
        out: list[Admission] = []
        while True:
            heads = [q[0] for q in self.waiting.values() if q and self._fits(q[0])]
            if not heads:
                return out
            head = min(heads, key=lambda h: self.policy.order(h, self.counters))
            self.waiting[head.tenant].popleft()
            slots = self._slots_of(head)
            self.running[head.request_id] = _Running(head.tenant, slots)
            self.held[head.tenant] = self.held.get(head.tenant, 0) + slots
            # The priority is the counter before this request's own prompt is charged: the tenant's turn.
            priority = self.policy.priority(head.tenant, self.counters)
            self.counters.charge_prefill(head.tenant, head.prompt_tokens)
            out.append(Admission(head.request_id, head.tenant, priority, max(0.0, now - head.arrival)))

    def generated(self, tenant: str, tokens: int) -> None:
        """The engine produced ``tokens`` output tokens for a request of ``tenant``."""
        if tokens > 0:
            self.counters.charge_decode(tenant, tokens)

    def finish(self, request_id: str) -> None:
        """An admitted request ended (finished, failed or cancelled): its slots are free."""
        r = self.running.pop(request_id, None)
        if r is None:
            return
        self.held[r.tenant] -= r.slots
        if self.held[r.tenant] <= 0:
            del self.held[r.tenant]
            if not self.waiting.get(r.tenant):
                self.counters.went_idle(r.tenant, self.active())

    def cancel(self, request_id: str, tenant: str) -> None:
        """A waiting request left before it was admitted (its client went away)."""
        q = self.waiting.get(tenant)
        if q:
            for r in q:
                if r.request_id == request_id:
                    q.remove(r)
                    break
            if not q and tenant not in self.held:
                self.counters.went_idle(tenant, self.active())

    def _slots_of(self, r: AdmissionRequest) -> int:
        # A request asking for more sequences than the engine runs still goes (vLLM queues the rest itself).
        return min(r.slots, self.slots, self.tenant_slots or self.slots)

    def _fits(self, r: AdmissionRequest) -> bool:
        if not self.policy.holds or not r.keyed:
            return True
        slots = self._slots_of(r)
        if self.in_use() + slots > self.slots:
            return False
        return self.tenant_slots is None or self.held.get(r.tenant, 0) + slots <= self.tenant_slots


def tenant_slot_cap(max_num_seqs: int) -> int:
    """The most sequence slots one tenant (or one API key) may hold of an engine's ``max_num_seqs``: all but an
    eighth (at least one), so another tenant's next request finds a slot free without waiting for one to end."""
    return max(1, max_num_seqs - max(1, max_num_seqs // 8))


def key_in_flight_cap(max_num_seqs: int, held: bool) -> int:
    """The default of how many requests one API key may have in flight on an engine of ``max_num_seqs`` slots.

    Either way no key holds every slot. Under a policy that ``held`` requests in front of the engine, the queue keeps
    a tenant to :func:`tenant_slot_cap` slots and its other requests wait there, ready the moment a slot frees: twice
    the slots. Otherwise the key itself is capped at :func:`tenant_slot_cap`. (Measured with ``bench/fairness.py``:
    a tenant alone capped at 28 of 32 in flight, its other clients answered 429 and retrying every second, streamed
    half the tokens per second of one whose requests waited.)
    """
    return 2 * max_num_seqs if held else tenant_slot_cap(max_num_seqs)
