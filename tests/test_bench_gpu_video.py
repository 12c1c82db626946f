"""benchmarks/bench_gpu_video.py (issue 38's GPU measurement): its plan is the pipeline's default clip against the
``wan`` preset's buckets at the token budget, its code paths run on the CPU with the tiny config, and the docs show
the committed GPU result as the script renders it."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu_video as bench  # noqa: E402


def test_the_fixed_clip_is_wan_pipelines_default_and_the_model_is_1_3b():
    from diffusers import WanPipeline

    defaults = {k: v.default for k, v in inspect.signature(WanPipeline.__call__).parameters.items()}
    spec = bench.load_spec(tiny=False)
    assert spec["clip"] == [defaults["width"], defaults["height"], defaults["num_frames"]]
    assert spec["text"]["tokens"] == defaults["max_sequence_length"]
    from bench_gpu import count_parameters

    assert 1.3e9 <= count_parameters(spec) < 1.5e9  # "1.3B": 1.42 B with embeddings and heads


def test_every_frame_count_is_planned_at_the_token_budget():
    import numpy as np

    from hf_arb import BucketSet

    spec = bench.load_spec(tiny=False)
    cases = bench.plan_cases(spec, tiny=False)
    preset = np.asarray(BucketSet.preset("wan").resolutions)
    budget = cases[0]["budget"]
    assert budget == max(bench.latent_tokens(spec, tuple(r)) for r in preset.tolist())  # the sampler's minimum
    assert [(c["shape"], c["batch"]) for c in cases if c["kind"] == "fixed"] == [(spec["clip"], 1), (spec["clip"], 2)]
    buckets = [c for c in cases if c["kind"] == "bucket"]
    assert {c["shape"][2] for c in buckets} == set(preset[:, 2].tolist())
    for c in buckets:
        assert c["shape"] in preset.tolist()
        assert c["batch"] * c["tokens"] <= budget < (c["batch"] + 1) * c["tokens"], c  # floor(budget / tokens)
    # 832x480x81 (21 latent frames x 30 x 52): the tokens the table reports
    assert bench.latent_tokens(spec, (832, 480, 81)) == 21 * 30 * 52


def test_tiny_run_on_cpu(tmp_path: Path):
    out = tmp_path / "r.json"
    from test_train import reset_accelerate

    try:
        assert bench.main(["--device", "cpu", "--tiny", "--repeats", "1", "--out", str(out)]) == 0
    finally:
        reset_accelerate()  # a fresh process's state for the worker's later tests
    result = json.loads(out.read_text())
    spec = bench.load_spec(tiny=True)
    planned = [(c["shape"], c["batch"]) for c in bench.plan_cases(spec, tiny=True)]
    assert [(c["shape"], c["batch"]) for c in result["cases"]] == planned
    assert all(c["finite"] and c["step_s"] > 0 for c in result["cases"])
    assert "--out" not in result["command"]
    assert "| fixed | 64x32x9 | 1 |" in bench.markdown(result)


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "results" / "gpu_video").glob("*.json")),
                         ids=lambda p: p.stem)
def test_docs_show_the_committed_gpu_result(path: Path):
    result = json.loads(path.read_text())
    assert not result["tiny"] and result["device"] == "cuda"
    assert bench.markdown(result) in (ROOT / "docs" / "benchmarks.md").read_text()
