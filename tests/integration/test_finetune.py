"""Fine-tuning from a dataset on Ray Train v2: two workers, a checkpoint each epoch, one worker killed, a resume, a PEFT dir.

The tiny embedded model and a small JSONL file written here. The last worker exits hard once during
epoch 2 (the job's test-only crash, guarded by a marker file in the test's tmp dir); Ray Train
restarts the worker group (``max_failures: 1``) and every worker goes on from epoch 1's checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.learning.finetune.job import parse_job

PROMPTS = [
    "What is the capital of France?",
    "Name a prime number.",
    "Say hello.",
    "What colour is the sky?",
    "Count to three.",
    "Who wrote Hamlet?",
    "What is 2 + 2?",
    "Name a fruit.",
]
ANSWER = "zebra zebra zebra"  # one answer for every prompt: a pattern the tiny model learns in a few steps


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _job(tmp_path: Path, data_dir: Path, data_path: Path, **over) -> dict:
    return {
        "base": "tiny-llama",
        "data_dir": str(data_dir),
        "adapter": {
            "name": "zebra",
            "method": "sft",
            "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj"]},
        },
        "data": {"path": str(data_path), "loader": "ray_data", "max_length": 96},
        "epochs": 3,
        "batch_size": 2,
        "learning_rate": 5e-3,
        "workers": 2,
        "resources_per_worker": {"CPU": 0.5},
        "storage_path": str(tmp_path / "runs"),
        "max_failures": 1,
        "output": {"dir": str(tmp_path / "adapter")},
        **over,
    }


def _greedy(model, tok, prompt: str, n: int = 8) -> list[int]:
    import torch

    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture
def quick_polls(monkeypatch):
    """Ray Train's controller polls its workers every 2 s by default: at each epoch's checkpoint commit, to see a
    dead worker, and to see the run finish. Every 0.5 s here (Ray Train passes the variable on to the controller
    it starts); a missed poll is only a failure after RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S (10 min)."""
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


def test_two_workers_checkpoint_each_epoch_survive_a_kill_and_resume(ray_cluster, data_dir, tmp_path, quick_polls):
    from actors.learning.finetune.run import run_finetune

    rows = [{"prompt": p, "completion": ANSWER} for p in PROMPTS[:6]]
    # Chat items in OpenAI's fine-tuning shape (the answer is the last assistant turn): Ray Data reads
    # the turns as a list column, and the worker turns them back into plain dicts.
    rows += [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": ANSWER}]} for p in PROMPTS[6:]
    ]
    data = _write(tmp_path / "train.jsonl", rows)
    job = parse_job(_job(tmp_path, data_dir, data))
    marker = tmp_path / "crashed-once"
    lines: list[str] = []

    run = run_finetune(job, crash_once=f"2:{marker}", log=lines.append)
    print("\n".join(lines))

    # (b) a worker died during epoch 2, once
    assert marker.exists() and "epoch 2" in marker.read_text()
    # (a) a checkpoint each epoch, (c) the group that finished started after epoch 1's checkpoint
    assert [r["epoch"] for r in run.reports] == [1, 2, 3], run.reports
    assert [r["resumed_from"] for r in run.reports] == [0, 1, 1], run.reports
    assert all(r["world_size"] == 2 and r["samples"] == 8 for r in run.reports), run.reports
    assert run.state["epoch"] == 3 and [h["epoch"] for h in run.state["history"]] == [1, 2, 3]
    run_dir = Path(run.checkpoint_dir).parent
    assert sorted(p.name for p in run_dir.glob("epoch-*")) == ["epoch-0001", "epoch-0002", "epoch-0003"]
    for ckpt in run_dir.glob("epoch-*"):
        assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "state.json"} <= {
            p.name for p in ckpt.iterdir()
        }
    losses = [h["loss"] for h in run.state["history"]]
    assert losses[-1] < losses[0], losses

    # (d) the PEFT directory loads on the tiny base, and the adapter changed what the model says
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.learning.finetune.run import resolve_base

    out = Path(run.output)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    base_dir = resolve_base(job)
    tok = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    before = _greedy(base, tok, PROMPTS[0])
    tuned = PeftModel.from_pretrained(base, str(out)).eval()
    after = _greedy(tuned, tok, PROMPTS[0])
    assert after != before, (before, after)  # (the loss fell too, above)


def test_dpo_from_a_file_on_two_workers(ray_cluster, data_dir, tmp_path, quick_polls):
    """DPO with the file loader (every worker reads the file, takes every second item): the loss falls well below log 2."""
    from actors.learning.finetune.run import run_finetune

    rows = [{"prompt": p, "chosen": ANSWER, "rejected": "I do not know."} for p in PROMPTS]
    data = _write(tmp_path / "pairs.jsonl", rows)
    job = parse_job(
        _job(
            tmp_path,
            data_dir,
            data,
            epochs=2,
            max_failures=0,
            learning_rate=5e-3,
            adapter={
                "name": "zebra-dpo",
                "method": "dpo",
                "beta": 0.5,
                "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            },
            data={"path": str(data), "loader": "file", "max_length": 96},
        )
    )
    run = run_finetune(job, log=lambda _: None)
    history = run.state["history"]
    assert [h["epoch"] for h in history] == [1, 2] and all(h["samples"] == 8 for h in history)
    # A new adapter starts at −log σ(0) = log 2 ≈ 0.693 (its first steps score as the reference does).
    assert history[-1]["loss"] < min(history[0]["loss"], 0.5), history
