"""Full-weight sync's pure parts: version locations, checkpoint fit, fingerprints, the engine flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from actors.serving.engine_args import engine_flags
from actors.serving.engine_weights import EXTENSION, combine_fingerprints, shape_mismatch, version_of
from settings import load

ROOT = Path(__file__).resolve().parents[2]


def test_version_location_names_unit_and_version():
    assert version_of("/data/full/smollm2-135m-instruct/v3") == ("smollm2-135m-instruct", 3)
    assert version_of("s3://bucket/prefix/base/v12/") == ("base", 12)
    for bad in ("/data/full/base", "v3", "/data/base/version3", "/data/base/v"):
        with pytest.raises(ValueError, match="not a version location"):
            version_of(bad)


def test_checkpoint_must_have_the_served_models_names_and_shapes():
    ref = {"a.weight": (4, 8), "b.weight": (8,)}
    assert shape_mismatch(dict(ref), ref) is None
    assert "missing ['b.weight']" in shape_mismatch({"a.weight": (4, 8)}, ref)
    assert "unexpected ['c']" in shape_mismatch({**ref, "c": (1,)}, ref)
    assert "a.weight (5, 8) != (4, 8)" in shape_mismatch({**ref, "a.weight": (5, 8)}, ref)


def test_engine_fingerprint_depends_on_every_worker_not_their_order():
    a, b = {"rank": 0, "digest": "aa"}, {"rank": 1, "digest": "bb"}
    assert combine_fingerprints([a, b]) == combine_fingerprints([b, a])
    assert combine_fingerprints([a, b]) != combine_fingerprints([a, {"rank": 1, "digest": "bc"}])
    assert len(combine_fingerprints([a])) == 16


def test_every_engine_carries_the_weights_extension_and_it_imports_light():
    cfg = load({"model": {"embedded": "tiny-llama"}})
    flags = engine_flags(cfg, "/m", "tiny-llama")
    assert flags[flags.index("--worker-extension-cls") + 1] == EXTENSION
    # vLLM imports it by name in every worker: no torch, vLLM or Ray at import time.
    code = (
        "import sys; import actors.serving.engine_weights as m; "
        "assert not {'torch', 'vllm', 'ray'} & set(sys.modules), sorted(sys.modules); "
        "assert callable(m.FullWeightsExtension.coserve_load_full_weights)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
