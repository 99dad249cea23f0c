"""The fine-tuning job file and its data: strict keys with clear errors, items checked line by line, separate placement."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from actors.learning.finetune.data import DataFileError, read_items
from actors.learning.finetune.job import JobFileError, load_job, parse_job
from actors.learning.finetune.placement import NODE_ID_LABEL, decide_separate
from actors.learning.finetune.publish import adapter_tar, write_peft_dir

JOB = """\
base: tiny-llama
adapter: {name: support, method: sft, lora: {r: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
data: {path: train.jsonl}
epochs: 2
batch_size: 2
learning_rate: 5e-4
workers: 2
resources_per_worker: {CPU: 0.5}
storage_path: runs
output: {dir: out/support}
"""


def _job(tmp_path: Path, text: str = JOB) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_a_job_file_loads_with_paths_made_absolute(tmp_path):
    job = load_job(_job(tmp_path))
    assert job.learning_rate == 5e-4  # YAML 1.1 would have read "5e-4" as a string
    assert job.resources_per_worker == {"CPU": 0.5} and job.workers == 2 and job.placement == "shared"
    assert job.data.path == str(tmp_path / "train.jsonl") and job.output.dir == str(tmp_path / "out" / "support")
    assert job.storage_path == str(tmp_path / "runs") and job.name == "finetune-support"
    assert job.base == "tiny-llama" and job.max_failures == 1 and job.data.loader == "ray_data"


@pytest.mark.parametrize(
    "change, words",
    [
        ("epochz: 3\n", ["job.yaml: epochz: unknown field"]),
        ("output: {dir: out, dirr: x}\n", ["output.dirr: unknown field"]),
        ("adapter: {name: s, method: sft, lora: {r: 4, rank: 8}}\n", ["adapter.lora.rank: unknown field"]),
        ("adapter: {name: s, method: ppo}\n", ["adapter.method"]),
        ("epochs: '3'\n", ["epochs", "valid integer"]),
        ("workers: 0\n", ["workers", "greater than or equal to 1"]),
        ("output: {dir: out, app_url: 'http://x'}\n", ["either dir", "or app_url"]),
        ("output: {dir: out, create: true}\n", ["apply to app_url only"]),
        ("output: {app_url: 'http://x', key: k, key_env: K}\n", ["key or key_env"]),
        ("placement: apart\n", ["placement"]),
        ("resources_per_worker: {CPU: -1}\n", ["amounts must be >= 0"]),
    ],
)
def test_bad_keys_and_values_are_named(tmp_path, change, words):
    key = change.split(":", 1)[0]
    text = "".join(line + "\n" for line in JOB.splitlines() if not line.startswith(key + ":")) + change
    with pytest.raises(JobFileError) as err:
        load_job(_job(tmp_path, text))
    for w in words:
        assert w in str(err.value), str(err.value)


def test_missing_required_keys_are_listed_together():
    with pytest.raises(JobFileError) as err:
        parse_job({"base": "tiny-llama"})
    for key in (
        "job: adapter: field required",
        "job: data: field required",
        "job: storage_path: field required",
        "job: output: field required",
    ):
        assert key in str(err.value)


def test_a_job_file_that_is_not_a_mapping(tmp_path):
    with pytest.raises(JobFileError, match="expected a mapping"):
        load_job(_job(tmp_path, "- a\n- b\n"))


def test_key_env_reads_the_environment(monkeypatch):
    job = parse_job({**_minimal(), "output": {"app_url": "http://127.0.0.1:1", "key_env": "FT_KEY"}})
    monkeypatch.delenv("FT_KEY", raising=False)
    with pytest.raises(JobFileError, match="FT_KEY is not set"):
        job.output.api_key()
    monkeypatch.setenv("FT_KEY", "sk-x")
    assert job.output.api_key() == "sk-x"


def _minimal() -> dict:
    return {
        "base": "tiny-llama",
        "adapter": {"name": "a"},
        "data": {"path": "/d.jsonl"},
        "storage_path": "/s",
        "output": {"dir": "/o"},
    }


def test_items_are_feedback_shapes_checked_line_by_line(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        {"prompt": "p", "completion": "c"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"adapter": "other-name", "prompt": "q", "completion": "d"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    items = read_items(path, "support", "sft")
    assert [i.kind for i in items] == ["sft"] * 3
    assert items[1].completion == "hello" and items[0].adapter == "support"

    path.write_text('{"prompt": "p"}\nnot json\n{"prompt": "p", "chosen": "a", "rejected": "b"}\n[1]\n')
    with pytest.raises(DataFileError) as err:
        read_items(path, "support", "sft")
    text = str(err.value)
    assert "4 bad item(s)" in text and "line 1: needs completion" in text and "line 2: not JSON" in text
    assert "line 3: a preference pair, but a sft adapter trains on SFT samples" in text
    assert "line 4: expected a JSON object" in text


def test_separate_placement_avoids_the_serving_nodes():
    d = decide_separate(["n1", "n2", "n3"], {"n2"}, "ModelServer")
    assert d.selector == {NODE_ID_LABEL: "!in(n2)"} and d.separate_nodes == ("n1", "n3")
    d = decide_separate(["n1"], {"n1"}, "ModelServer")
    assert d.selector is None and "NO SEPARATE NODE EXISTS" in d.message and d.separate_nodes == ()
    d = decide_separate(["n1", "n2"], set(), "ModelServer")
    assert d.selector is None and "no node runs a ModelServer replica" in d.message
    d = decide_separate(["n1", "n2"], {"dead-node"}, "ModelServer")  # a replica on a node gone: nothing to avoid
    assert d.selector is None


def test_the_upload_archive_holds_the_two_peft_files_at_its_top(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "adapter_config.json").write_text("{}")
    (src / "adapter_model.safetensors").write_bytes(b"x" * 10)
    (src / "optimizer.pt").write_bytes(b"o")
    with tarfile.open(fileobj=io.BytesIO(adapter_tar(src))) as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
    out = write_peft_dir(src, tmp_path / "out", {"epoch": 2})
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "finetune.json",
    ]


def test_the_example_job_and_its_data_are_valid():
    root = Path(__file__).resolve().parents[2]
    job = load_job(root / "configs" / "finetune" / "zebra.yaml")
    assert len(read_items(job.data.path, job.adapter.name, job.adapter.method)) == 8
