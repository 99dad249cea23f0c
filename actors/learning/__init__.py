"""Learning while serving: the LoRA trainer (``lora/``) and its messages; it may import ``actors`` and ``planners``."""
