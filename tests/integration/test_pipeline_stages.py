"""Full-model pipeline training (issue 15): stage i in bundle i, full_sft and full_dpo versions HF loads, rollback."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from actors.learning.full.layout import LlamaDims, layer_names, layer_param_counts
from actors.learning.full.messages import PipelineSettings, TrainingSample

SFT = [
    TrainingSample(prompt="Q: sky color?\nA:", completion=" blue"),
    TrainingSample(prompt="Q: pet?\nA:", completion=" cat"),
]
DPO = [
    TrainingSample(prompt="Q: grass color?\nA:", chosen=" green", rejected=" pink"),
    TrainingSample(prompt="Q: sea color?\nA:", chosen=" blue", rejected=" red"),
]


@pytest.fixture(scope="module")
def pipeline(ray_cluster, data_dir, tmp_path_factory):
    """A placement group of two bundles (a node with cluster.stages: 2) and its started trainer."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from actors.learning.full.trainer import PipelineTrainer
    from actors.models import default_model

    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=120)
    settings = PipelineSettings(
        model_dir=str(default_model.ensure(data_dir)),
        versions_root=str(tmp_path_factory.mktemp("full-versions")),
        stage_resources={"CPU": 0.5},
        micro_batch=2,
        accumulation=2,
        learning_rate=2e-3,
        beta=0.5,
        max_length=64,
    )
    trainer = PipelineTrainer(settings, pg)
    trainer.start()
    yield trainer
    trainer.shutdown()
    remove_placement_group(pg)


def _hf(path: str):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval(), AutoTokenizer.from_pretrained(path)


def _sft_stats(model, tok, samples) -> tuple[float, int]:
    """(completion-token mean NLL, completion tokens the model's greedy choice gets right under teacher forcing)."""
    import torch

    from actors.learning.lora.steps import encode

    enc = encode(tok, [s.prompt for s in samples], [s.completion for s in samples], max_length=64)
    with torch.no_grad():
        logits = model(input_ids=enc.input_ids, attention_mask=enc.attention_mask).logits[:, :-1]
    targets, mask = enc.input_ids[:, 1:], enc.completion_mask[:, 1:].bool()
    nll = -torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return float(nll[mask].mean()), int((logits.argmax(-1) == targets)[mask].sum())


def test_stage_i_runs_in_bundle_i_and_holds_a_contiguous_slice(pipeline):
    import ray
    from ray.util.state import list_actors

    pg_id = pipeline.pg.id.hex()
    # This session's cluster by its address: other Ray instances may run on the same machine.
    actors = {
        a.actor_id: a
        for a in list_actors(
            address=ray.get_runtime_context().gcs_address, filters=[("placement_group_id", "=", pg_id)], detail=True
        )
    }
    for i, info in enumerate(pipeline.info):
        state = actors[info.actor_id]
        assert state.state == "ALIVE" and state.class_name == "PipelineStage"
        # Ray books an actor's share of bundle i of group G as <resource>_group_<i>_<G>.
        assert f"CPU_group_{i}_{pg_id}" in state.required_resources, state.required_resources
        assert info.stage_id == i and info.placement_group_id == pg_id
    dims = LlamaDims.from_config(json.loads((Path(pipeline.settings.model_dir) / "config.json").read_text()))
    bounds = pipeline.info[0].bounds
    assert [(i.layer_start, i.layer_stop) for i in pipeline.info] == list(zip(bounds, bounds[1:]))
    assert bounds[0] == 0 and bounds[-1] == len(layer_names(dims)) and bounds[1] > 1  # a decoder layer on each side
    # DeepSpeed's counts agree with the pure layout's (the tiny model is untied: no head counted twice).
    assert sum(i.params for i in pipeline.info) == sum(layer_param_counts(dims))


def test_full_sft_publishes_a_version_hf_loads_and_rollback_resumes_from_it(pipeline):
    import torch

    base, tok = _hf(pipeline.settings.model_dir)
    loss0, right0 = _sft_stats(base, tok, SFT)
    v1 = pipeline.train(SFT, "full_sft", unit="base", version=1, steps=6)
    # The pipeline's forward is the HF model's: its first loss is HF's loss at the starting weights.
    assert math.isclose(v1.losses[0], loss0, rel_tol=1e-4), (v1.losses[0], loss0)
    assert v1.losses[-1] < 0.7 * v1.losses[0], v1.losses
    meta = json.loads((Path(v1.path) / "meta.json").read_text())
    assert meta["version"] == 1 and meta["method"] == "full_sft" and meta["steps"] == 6
    trained, _ = _hf(v1.path)
    changed = [n for n, p in trained.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
    assert len(changed) == len(base.state_dict())  # every tensor trained, none lost on the way
    loss1, right1 = _sft_stats(trained, tok, SFT)
    assert loss1 < loss0 and right1 > right0, (loss0, loss1, right0, right1)

    # Rollback: a DPO version moves on from v1; training from v1 again starts from v1's weights.
    pipeline.train(DPO, "full_dpo", unit="base", version=2, steps=1)
    v3 = pipeline.train(SFT, "full_sft", unit="base", version=3, steps=1, resume_from=v1.path)
    assert v3.parent == v1.path
    assert math.isclose(v3.losses[0], loss1, rel_tol=1e-4), (v3.losses[0], loss1)


def test_full_dpo_raises_the_reward_margin(pipeline):
    from actors.learning.lora.steps import sequence_logprobs

    start = pipeline.weights_from
    v = pipeline.train(DPO, "full_dpo", unit="dpo", version=1, steps=2)
    assert v.losses[0] == pytest.approx(math.log(2), rel=1e-4)  # policy = reference at the first step
    assert v.reward_margin > 0.05 and v.losses[-1] < v.losses[0], v
    # The same margin measured on the HF models of the starting weights and of the version.
    (ref, tok), (pol, _) = _hf(start), _hf(v.path)
    margins = []
    for s in DPO:
        d = [
            sequence_logprobs(pol, tok, [s.prompt], [y])[0] - sequence_logprobs(ref, tok, [s.prompt], [y])[0]
            for y in (s.chosen, s.rejected)
        ]
        margins.append(pipeline.settings.beta * (d[0] - d[1]))
    assert sum(margins) / len(margins) == pytest.approx(v.reward_margin, rel=1e-3, abs=1e-4)


def test_deepspeeds_own_schedule_computes_the_same_losses_as_the_stage_scheduler(pipeline, tmp_path_factory):
    """``schedule: deepspeed`` (DeepSpeed's train_batch) and ``planner`` (the stage scheduler, op by op) are
    two orders of the same computation: from the same weights, the same steps give the same losses."""
    from dataclasses import replace

    from actors.learning.full.trainer import PipelineTrainer

    assert pipeline.settings.schedule == "planner" and pipeline.node is not None
    start = pipeline.weights_from
    ours = pipeline.train(SFT, "full_sft", unit="same", version=1, steps=3, resume_from=start)
    theirs_trainer = PipelineTrainer(
        replace(pipeline.settings, schedule="deepspeed", versions_root=str(tmp_path_factory.mktemp("ds-versions"))),
        pipeline.pg,
    )
    theirs_trainer.weights_from = start
    try:
        theirs = theirs_trainer.train(SFT, "full_sft", unit="same", version=1, steps=3)
    finally:
        theirs_trainer.shutdown()
    assert theirs_trainer.node is None
    # The first loss is the same forward; later ones differ by the optimizers' float order (fused AdamW here).
    assert ours.losses[0] == pytest.approx(theirs.losses[0], rel=1e-5), (ours.losses, theirs.losses)
    assert ours.losses == pytest.approx(theirs.losses, rel=1e-2), (ours.losses, theirs.losses)
