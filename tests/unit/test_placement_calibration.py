"""Calibration must not make a just-used node look slower than idle nodes of the same type."""

from planners import registry
from planners.types import ExecutionTrace, NodeView, Task


def test_sequential_requests_consolidate_when_the_profile_underestimates():
    policy = registry.create("placement", "lemix")
    nodes = [NodeView(0, True), NodeView(1, True), NodeView(2, True)]
    now, chosen = 1000.0, []
    for i in range(8):
        task = Task(f"t{i}", "inference", "m", prompt_tokens=12, max_tokens=8, arrival=now)
        node = policy.choose(task, nodes, now)
        chosen.append(node)
        # The real TTFT is ~8x what the default profile plans: calibration must learn that ...
        policy.observe(ExecutionTrace(task.task_id, node, now, now, now + 0.05, now + 0.15, 13, 8))
        now += 0.45
    # ... for the node type, not just for the node that happened to serve, or work spreads out.
    assert len(set(chosen)) == 1, chosen
    speeds = {q["speed"] for q in policy.queues(now).values()}
    assert len(speeds) == 1 and speeds.pop() > 1.5
