"""Cluster-level placement: which node runs a task (LEMIX §IV-B/§IV-C, Alg. 1, Eq. 1–4; baselines of §VI-A).

Every policy implements ``choose(task, nodes, now) -> node_id | None`` (None: keep the task queued
and ask again later), ``commit(task, node_id, now)`` (a task someone else placed), ``observe(trace)``
(feedback from a finished task) and ``forget(task_id)``. Policies with a queue-level rule also offer
``prioritize(queue, nodes, now) -> list[Task]`` (LEMIX Eq. 4); for the others the queue order stays
first-come first-served.

One concept a module:

- ``policy``: the interface and ℓ of a task (§IV-A);
- ``baselines``: round robin (NaiveMix), SEPARATE, least utilized (§VI-A);
- ``planning``: Alg. 1, a node's trace queues and a task's forward path through them (§IV-B);
- ``scoring``: Eq. 1–3 of a task on a few nodes, in plain Python; ``node_arrays``: the same on
  many nodes, in numpy over a mirror of their queues;
- ``lemix_settings``: LEMIX's tuning knobs (the config's λ1, λ2, τ, τ_R, ...) in plain words;
- ``lemix``: the LEMIX policy: choose by Eq. 3, Eq. 4 (training waits), calibration (Alg. 2
  lines 13–17);
- ``training``: the planner's own placement of training work in the live app (feedback items,
  granted training steps, Eq. 4 on the grant path).

Importing the package registers every policy (``planners/registry.py`` loads it by kind).
"""

from planners.placement.baselines import LeastUtilized, RoundRobin, Separate
from planners.placement.lemix import LemixPlacement
from planners.placement.lemix_settings import LemixSettings
from planners.placement.planning import NodeEstimate
from planners.placement.policy import PlacementPolicy, task_length
from planners.placement.training import FeedbackChoice, TrainingPlacer, route_feedback

__all__ = [
    "FeedbackChoice",
    "LeastUtilized",
    "LemixPlacement",
    "LemixSettings",
    "NodeEstimate",
    "PlacementPolicy",
    "RoundRobin",
    "Separate",
    "TrainingPlacer",
    "route_feedback",
    "task_length",
]
