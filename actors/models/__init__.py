"""What is computed on: the model a config serves (the default SmolLM2, its conversion, the tiny test model) and
the device and dtype a process computes on. It may import ``settings`` and ``planners`` only.
"""
