"""The stage scheduler (planners/pipeline) on a simulated clock: per-stage op order, bubbles, Eq. 4, Alg. 2, SEPARATE."""

from __future__ import annotations

import heapq
from dataclasses import replace

import pytest

from planners import registry
from planners.costs import StageLatency, default_cost_model
from planners.memory import MemoryGuard
from planners.pipeline import OpDone, PipelineTask, StageScheduler, shared_lanes, split_lanes

# Per stage of a 2-stage node: a forward takes 10 ms per token, a backward twice that.
COST = replace(
    default_cost_model(), forward=StageLatency(0.0, 0.01, 0.0), backward=StageLatency(0.0, 0.02, 0.0), stages=2
)


def node(order: str, accumulation: int = 2, memory: MemoryGuard | None = None, **params) -> StageScheduler:
    policy = registry.create("stage_order", order, **params)
    lanes = shared_lanes(2) if policy.layout == "shared" else split_lanes(2)
    return StageScheduler(2, lanes, policy, COST, accumulation=accumulation, memory=memory)


def simulate(sched: StageScheduler, tasks: list[PipelineTask], horizon: float = 1e4) -> list[OpDone]:
    """Run ``sched`` to completion: each op takes its planned seconds; a training forward holds
    C·ℓ bytes on its device until its backward there."""
    arrivals = sorted(tasks, key=lambda t: t.arrival)
    running: list[tuple[float, int, object]] = []
    held = [0.0] * sched.devices
    done: list[OpDone] = []
    now, seq = 0.0, 0
    while now < horizon:
        while arrivals and arrivals[0].arrival <= now:
            sched.add(arrivals.pop(0))
        for op in sched.schedule(now):
            seq += 1
            heapq.heappush(running, (now + sched.seconds(op), seq, (op, now)))
        if not running and not arrivals and sched.idle:
            return done
        nxt = [
            t for t in (running[0][0] if running else None, arrivals[0].arrival if arrivals else None) if t is not None
        ]
        now = min(nxt) if nxt else now + 0.05  # only held ops left: look again a little later
        while running and running[0][0] <= now:
            end, _, (op, start) = heapq.heappop(running)
            if op.kind == "training" and op.phase == "forward":
                held[op.device] += op.batch * op.tokens
            elif op.kind == "training" and op.phase == "backward":
                held[op.device] -= op.batch * op.tokens
            d = OpDone(op, start, end, held[op.device])
            done.append(d)
            sched.complete(d)
    raise AssertionError("simulation did not finish")


def training(n: int, tokens: int = 10, at: float = 0.0) -> list[PipelineTask]:
    return [PipelineTask(f"mb{i}", "training", tokens, 1, at) for i in range(n)]


def response_times(done: list[OpDone]) -> dict[str, float]:
    """Per inference task: end of its last forward on the last stage minus its arrival."""
    out: dict[str, float] = {}
    for d in done:
        if d.op.kind == "inference" and d.op.position == 1 and d.op.pass_index == 0:
            out[d.op.task_id] = d.end - d.op.arrival
    return out


def test_micro_batches_run_forward_then_backward_and_every_mini_batch_ends_in_one_step_on_both_stages():
    sched = node("lemix", accumulation=2)
    done = simulate(sched, training(4))
    assert sched.steps == 2 and sched.idle
    for mb in ("mb0", "mb1", "mb2", "mb3"):
        seq = [(d.op.phase, d.op.device) for d in sorted(done, key=lambda d: d.start) if d.op.task_id == mb]
        assert seq == [("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0)]
    steps = [d for d in done if d.op.phase == "step"]
    assert len(steps) == 4 and {d.op.device for d in steps} == {0, 1}
    first, second = sorted({d.start for d in steps})
    # The second mini-batch starts only after the first step (a flush), and no stage ever runs two ops at once.
    assert min(d.start for d in done if d.op.task_id in ("mb2", "mb3")) >= first + sched.seconds(steps[0].op) - 1e-9
    for dev in (0, 1):
        spans = sorted((d.start, d.end) for d in done if d.op.device == dev)
        assert all(b[0] >= a[1] - 1e-9 for a, b in zip(spans, spans[1:]))


def test_lemix_serves_a_request_in_a_training_bubble_before_queued_training():
    sched = node("lemix", accumulation=4)
    req = PipelineTask("req", "inference", 10, 1, 0.05)
    done = simulate(sched, training(4) + [req])
    on_stage0 = [d.op.task_id for d in sorted(done, key=lambda d: d.start) if d.op.device == 0]
    # mb0 was running when the request came; the request goes next, ahead of mb1's forward.
    assert on_stage0[:2] == ["mb0", "req"], on_stage0
    # It waits 0.05 s for mb0's forward on stage 0, then runs on stage 1 ahead of mb0's backward.
    assert response_times(done)["req"] == pytest.approx(0.05 + 0.1 + 0.1, abs=1e-6)


def steady_stream(n: int, gap: float, tokens: int = 5) -> list[PipelineTask]:
    return [PipelineTask(f"req{i}", "inference", tokens, 1, 0.3 + i * gap) for i in range(n)]


def test_eq4_holds_training_back_where_round_robin_makes_requests_miss_the_slo():
    # Requests every 0.5 s take 0.1 s alone; a 40-token micro-batch's forward holds a stage 0.4 s.
    tasks = steady_stream(20, 0.5) + training(6, tokens=40)
    slo = 0.25
    rr = response_times(simulate(node("round_robin", accumulation=2), tasks))
    lemix_sched = node("lemix", accumulation=2, response_slo_s=slo, max_defer_s=3.0)
    lemix = response_times(simulate(lemix_sched, tasks))
    assert len(rr) == len(lemix) == 20
    missed_rr = sum(r > slo for r in rr.values())
    missed_lemix = sum(r > slo for r in lemix.values())
    assert missed_rr >= 5 and missed_lemix < missed_rr, (missed_rr, missed_lemix)
    assert lemix_sched.steps == 3  # held back, not starved (max_defer_s bounds each hold)


def test_least_utilized_serves_the_kind_that_has_had_less_of_the_stage():
    sched = node("least_utilized", accumulation=1)
    done = simulate(sched, training(3, tokens=20) + steady_stream(6, 0.01, tokens=2))
    assert sched.steps == 3
    stage0 = [d.op.kind for d in sorted(done, key=lambda d: d.start) if d.op.device == 0 and d.op.phase == "forward"]
    # Training got the stage first (0.2 s); then inference, far cheaper, runs until it has had as much.
    assert stage0[:2] == ["training", "inference"] and stage0.count("inference") == 6


def test_separate_serves_on_device_0_trains_on_device_1_and_syncs_after_each_step():
    sched = node("separate", accumulation=2, sync_every=1)
    done = simulate(sched, training(4) + steady_stream(5, 0.2))
    assert {d.op.device for d in done if d.op.kind == "inference"} == {0}
    assert {d.op.device for d in done if d.op.phase in ("forward", "backward") and d.op.kind == "training"} == {1}
    syncs = sorted(d.start for d in done if d.op.phase == "sync")
    steps = sorted(d.end for d in done if d.op.phase == "step")
    assert len(steps) == 2 and len(syncs) == 4  # each on both devices, after each step
    assert syncs[0] >= steps[0] and syncs[2] >= steps[1]


def test_memory_guard_makes_a_forward_wait_until_a_backward_frees_its_stage():
    # Each 10-token micro-batch holds 10 "bytes" per stage; the stage may hold 15: one at a time.
    per_token = replace(COST, memory=replace(COST.memory, activation_bytes_per_token=1.0))
    guard = MemoryGuard(per_token, peak_bytes=15.0, threshold_fraction=1.0, t_max_s=100.0, min_ratio=1.0)
    guarded = node("lemix", accumulation=4, memory=guard)
    done = simulate(guarded, training(4))
    held = max(d.held_bytes for d in done if d.op.device == 0)
    assert held == 10 and guarded.steps == 1
    free = simulate(node("round_robin", accumulation=4), training(4))
    assert max(d.held_bytes for d in free if d.op.device == 0) == 20  # 1F1B's bound, S = 2 in flight


def test_policies_are_registered_and_layouts_checked():
    assert {"lemix", "round_robin", "least_utilized", "separate"} <= set(registry.names("stage_order"))
    with pytest.raises(ValueError, match="at least 2 devices"):
        split_lanes(1)
    with pytest.raises(ValueError, match="no lane of this node serves"):
        StageScheduler(
            2,
            (split_lanes(2)[1], replace(split_lanes(2)[0], kinds=frozenset({"training"}))),
            registry.create("stage_order", "separate"),
            COST,
        ).add(PipelineTask("r", "inference", 3))


def test_a_chunked_stage_lets_a_request_in_between_two_chunks_of_a_training_pass():
    policy = registry.create("stage_order", "lemix")
    lanes = shared_lanes(2, chunks=2)
    assert lanes[0].devices == (0, 0, 1, 1) and lanes[0].stages == 2 and lanes[0].positions == 4
    sched = StageScheduler(2, lanes, policy, COST, accumulation=1)
    # A 20-token micro-batch: each chunk forward takes 0.1 s (half a stage); the request comes at 0.05 s.
    done = simulate(sched, training(1, tokens=20) + [PipelineTask("req", "inference", 10, 1, 0.05)])
    stage0 = [
        (d.op.task_id, d.op.position)
        for d in sorted(done, key=lambda d: d.start)
        if d.op.device == 0 and d.op.phase == "forward"
    ]
    # The request runs both chunks of a stage in one op (fewer round trips), between mb0's two chunks.
    assert stage0 == [("mb0", 0), ("req", 0), ("mb0", 1)]
    req = [(d.op.device, d.op.position) for d in sorted(done, key=lambda d: d.start) if d.op.task_id == "req"]
    assert req == [(0, 0), (1, 2)]
    # Waited 0.05 s for mb0's first chunk, then its four chunks of 0.05 s each.
    assert max(d.end for d in done if d.op.task_id == "req") - 0.05 == pytest.approx(0.05 + 4 * 0.05, abs=1e-6)
