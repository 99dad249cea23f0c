"""Control: the central planner actor, its per-node co-serving state and grant decisions, and the fitted cost
profiles it decides from. It may import ``actors.serving``, ``actors.learning``, ``actors.models``,
``planners`` and ``settings``.
"""
