"""Serving: the model replica actor (one vLLM engine with LoRA on one node), the engine's arguments, full-weight
sync into a running engine, per-request stage stamps and per-iteration metrics, and CPU affinity. It may import
``actors.learning`` (the version files a replica loads), ``actors.models``, ``planners`` and ``settings``.
"""
