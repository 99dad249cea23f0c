"""Resource holders (engines, trainers, placement groups) that ask ``planners/`` for decisions, in five rooms.

- ``models/``: the model files a config serves and the device and dtype a process computes on.
- ``learning/``: learning while serving (the trainer supervisor, LoRA and full-model training, the feedback
  store, version files).
- ``serving/``: the model replica (one vLLM engine with LoRA on one node) and what it needs.
- ``control/``: the central planner actor and its per-node co-serving state and cost profiles.
- ``offline/``: offline multi-LLM batch jobs (SamuLLM).

Rooms import down this list and never up it (``tests/unit/test_layers.py`` enforces it); each room may
import ``planners`` and ``settings``.
"""
