"""A two-stage node serves and trains the full model at once, every stage in its bundle (issue 15, items 1 and 4).

The stage scheduler (planners/pipeline) picks each op; the stage actors run them. Tiny model.
"""

from __future__ import annotations

import pytest

from actors.learning.full.messages import PipelineSettings, TokenBatch

PROMPTS = [[5, 17, 33, 8, 91], [12, 4, 4, 60]]


def _settings(data_dir, tmp_path_factory, chunks: int = 1) -> PipelineSettings:
    from actors.models import default_model

    return PipelineSettings(
        model_dir=str(default_model.ensure(data_dir)),
        versions_root=str(tmp_path_factory.mktemp("scheduled-versions")),
        stage_resources={"CPU": 0.5},
        micro_batch=2,
        accumulation=2,
        learning_rate=5e-3,
        max_length=64,
        chunks=chunks,
    )


@pytest.fixture(scope="module")
def group(ray_cluster):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=120)
    yield pg
    remove_placement_group(pg)


def _batch(seed: int) -> TokenBatch:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (2, 24), generator=g)
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    mask = torch.zeros(ids.shape)
    mask[:, 8:-1] = 1
    return TokenBatch(ids, targets, mask)


def _hf_greedy(model_dir: str, prompt: list[int], n: int) -> list[int]:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.foreground  # its profile times the stages: not beside the suite at idle priority
def test_lemix_node_serves_and_trains_at_once_with_each_stage_in_its_bundle(group, data_dir, tmp_path_factory):
    import ray
    from ray.util.state import list_actors

    from actors.learning.full.scheduled import ScheduledPipeline

    # Each stage runs as two ops (chunks of its layers): four positions over the two devices.
    node = ScheduledPipeline(_settings(data_dir, tmp_path_factory, chunks=2), group, order="lemix")
    try:
        info = node.start()
        pg_id = group.id.hex()
        actors = {
            a.actor_id: a
            for a in list_actors(
                address=ray.get_runtime_context().gcs_address, filters=[("placement_group_id", "=", pg_id)], detail=True
            )
        }
        for i, stage in enumerate(info):
            state = actors[stage.actor_id]
            assert state.state == "ALIVE" and state.class_name == "PipelineStage"
            assert f"CPU_group_{i}_{pg_id}" in state.required_resources, state.required_resources
        assert info[0].layer_stop == info[1].layer_start  # two contiguous slices of one model

        cost = node.profile()
        assert cost.forward.fit is not None and cost.forward(1, 64) > cost.forward(1, 8) > 0

        # Served alone first: the stages' greedy tokens are the HF model's.
        node.submit_inference("alone", PROMPTS[0], new_tokens=3)
        node.run()
        assert node.results["alone"].tokens == _hf_greedy(node.settings.model_dir, PROMPTS[0], 3)

        # Then both at once: four micro-batches (two optimizer steps) and two requests.
        for k in range(4):
            node.submit_training(f"mb{k}", _batch(k % 2))
        for i, p in enumerate(PROMPTS):
            node.submit_inference(f"req{i}", p, new_tokens=2)
        node.run()
        for i in range(len(PROMPTS)):
            r = node.results[f"req{i}"]
            assert len(r.tokens) == 2 and r.finished_at >= r.first_token_at > r.arrival
        assert node.trained == ["mb0", "mb1", "mb2", "mb3"] and node.scheduler.steps == 2
        # The same two batches again after a step: the loss went down (real training on the stages).
        assert node.losses[2] < node.losses[0] and node.losses[3] < node.losses[1], node.losses
        # Inference and training shared both stages: each device ran both kinds of op, one at a time.
        for device in (0, 1):
            spans = sorted((d.start, d.end, d.op.kind) for d in node.timeline if d.op.device == device)
            assert {k for _, _, k in spans} == {"inference", "training"}
            assert all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:]))
        # Each micro-batch went through all four positions, each chunk on its stage's device.
        mb0 = [
            (d.op.phase, d.op.position, d.op.device)
            for d in sorted(node.timeline, key=lambda d: d.start)
            if d.op.task_id == "mb0"
        ]
        assert mb0 == [
            ("forward", 0, 0),
            ("forward", 1, 0),
            ("forward", 2, 1),
            ("forward", 3, 1),
            ("backward", 3, 1),
            ("backward", 2, 1),
            ("backward", 1, 0),
            ("backward", 0, 0),
        ]
        # The step ran on both stages at once, after every backward of its mini-batch.
        steps = [d for d in node.timeline if d.op.phase == "step"]
        assert sorted(d.op.device for d in steps) == [0, 0, 1, 1]
    finally:
        node.shutdown()


def test_separate_node_serves_on_device_0_and_syncs_the_trained_weights_into_it(group, data_dir, tmp_path_factory):
    import ray
    import torch

    from actors.learning.full.scheduled import ScheduledPipeline

    node = ScheduledPipeline(
        _settings(data_dir, tmp_path_factory), group, order="separate", order_params={"sync_every": 1}
    )
    try:
        node.start()
        served_before = ray.get(node.actors[0].state_slice.remote())
        for k in range(2):
            node.submit_training(f"mb{k}", _batch(k))
        node.submit_inference("req", PROMPTS[1], new_tokens=2)
        node.run()
        assert {d.op.device for d in node.timeline if d.op.kind == "inference"} == {0}
        assert node.scheduler.steps == 1 and sum(d.op.phase == "sync" for d in node.timeline) == 2
        served, trained = ray.get([a.state_slice.remote() for a in node.actors])
        assert served.keys() == trained.keys()
        assert all(torch.equal(served[k], trained[k]) for k in served)  # the sync copied every tensor
        assert any(not torch.equal(served[k], served_before[k]) for k in served)  # and they had moved
    finally:
        node.shutdown()
