"""Batch fine-tuning of a LoRA adapter from a dataset on Ray Train (``python -m app.finetune JOB.yaml``).

Why Ray Train here, and plain actors for co-serving: this job trains one adapter over a whole
dataset for a fixed number of epochs, with workers that fail and come back from the last epoch's
checkpoint, which is what Ray Train's ``TorchTrainer`` is built for (worker group, process group,
``ray.train.report`` checkpoints, ``FailureConfig`` restarts, Ray Data shards). The co-serving
trainer (``actors/learning/trainer.py``) runs plain actors instead, because ``TorchTrainer`` always
reserves a placement group of its own for its workers, so a rank could never share the bundle of
the serving replica it trains beside, nor take its work a planner grant at a time.

- ``job.py``: the job file, a strict pydantic model (unknown keys are an error that names them);
- ``data.py``: reading and validating the items (the shapes of ``/v1/feedback``);
- ``worker.py``: the loop each Ray Train worker runs, with the project's own SFT/DPO steps;
- ``placement.py``: ``placement: separate``, training only on nodes with no serving replica;
- ``publish.py``: the adapter as a PEFT directory, or a new version of a running app's adapter.
"""
