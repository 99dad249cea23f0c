"""Stage-level scheduling of one node's pipeline: inference and training ops on each stage (LEMIX §IV-B–§IV-D).

- ``work``: tasks, lanes (which devices form a pipeline) and per-stage ops;
- ``scheduler``: ``StageScheduler``, the queues and the pick loop (``schedule`` / ``complete``);
- ``orders``: the order policies (``lemix``, ``round_robin``, ``least_utilized``, ``separate``),
  registered as kind ``stage_order``.

Live caller: ``actors/learning/full/scheduled.py`` (``ScheduledPipeline``), which runs the ops on a
node's stage actors.
"""

from planners.pipeline.scheduler import StageScheduler
from planners.pipeline.work import Lane, OpDone, PipelineTask, StageOp, shared_lanes, split_lanes

__all__ = ["Lane", "OpDone", "PipelineTask", "StageOp", "StageScheduler", "shared_lanes", "split_lanes"]
