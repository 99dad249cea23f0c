"""Learning while serving: the trainer supervisor (``trainer``), the LoRA trainer (``lora/``), full-model training
(``full/``), the feedback store (``store/``) and version files (``versions/``). It may import ``actors.models``,
``planners`` and ``settings``.
"""
