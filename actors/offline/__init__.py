"""Offline multi-LLM batch jobs (SamuLLM): the job spec (``job``), its plan (``plan``), the engine actor of one
stage's model replica (``engine``) and the runner that drives a plan on Ray (``runner``). It may import
``actors.serving``, ``actors.models``, ``planners`` and ``settings``.
"""
