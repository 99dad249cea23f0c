"""The LoRA SFT/DPO trainer: the driver that owns the loop (``driver``), the ranks that compute (``rank``), the gate.

The driver runs in the Trainer supervisor actor and is the only one that reads the feedback store
or asks the planner; ranks hold the model, compute their share of each step and all-reduce
gradients. What they send each other is in ``messages``.
"""
