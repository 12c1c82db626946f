"""train_text_to_image_arb.py with ``--max_pixels_per_batch``: a batch size per bucket for SD/SDXL UNets.

The tiny image folder has 4 photos in each of 5 buckets at ``--resolution 64 --bucket_step 16`` (32x96, 48x80,
64x64, 80x48, 96x32); a budget of 12,288 pixels gives them batches of 4, 3, 3, 3 and 4 images.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import test_train
from test_train import COMMON, read_trace, run_script

import train_text_to_image_arb as script
from hf_arb.train import files as train_files  # noqa: E402
from hf_arb.train.schedule import image_loss_weights  # noqa: E402

assets = test_train.assets  # the session's tiny models and images
BUDGET = 12288
EXPECTED = {(32, 96): 4, (48, 80): 3, (64, 64): 3, (80, 48): 3, (96, 32): 4}  # (width, height) -> batch


@pytest.fixture(autouse=True)
def _clean_accelerate_state():
    yield
    test_train.reset_accelerate()


def test_flag_checks_and_loss_weights() -> None:
    base = ["--pretrained_model_name_or_path", "x", "--train_data_dir", "d", "--full_finetune"]
    assert script.parse_args(base).max_pixels_per_batch is None
    for bad, match in ((["--max_pixels_per_batch", "0"], ">= 1"),
                       (["--max_pixels_per_batch", "4096", "--no_bucket_sync"], "--no_bucket_sync")):
        with pytest.raises(script.UsageError, match=match):
            script.parse_args(base + bad)
    # the weights: 1 without a budget; with one, each optimizer step's images weigh the same
    from hf_arb import BucketBatchSampler

    ids = np.repeat(np.arange(3), 40)
    sampler = BucketBatchSampler(ids, None, buckets=[(64, 64), (32, 32), (64, 32)], max_pixels_per_batch=16384,
                                 seed=0, log_report=False)  # batch sizes 4, 16, 8
    off = image_loss_weights(SimpleNamespace(max_pixels_per_batch=None, gradient_accumulation_steps=3), sampler)
    assert off(5) == 1.0
    on = image_loss_weights(SimpleNamespace(max_pixels_per_batch=16384, gradient_accumulation_steps=3), sampler)
    b = sampler.step_batch_sizes(0)
    for j in range(0, len(b) - 2, 3):  # Σ_s w_s / A · (mean of b_s images) = 1 / n per image
        n = b[j : j + 3].sum()
        for s in range(j, j + 3):
            assert on(s) / 3 / b[s] == pytest.approx(1 / n)  # epoch 0: micro step s


@pytest.fixture(scope="module")
def pixel_runs(assets, tmp_path_factory) -> dict:
    """One process, 2 accumulation steps: epoch 0 is 5 micro-batches (one per bucket) in 3 optimizer steps, the
    last one short; a checkpoint at step 2 and a run resumed from it (that short step)."""
    full = tmp_path_factory.mktemp("pixel_full")
    args = ["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"], *COMMON,
            "--train_batch_size", "4", "--max_pixels_per_batch", str(BUDGET), "--gradient_accumulation_steps", "2",
            "--max_train_steps", "3", "--checkpointing_steps", "2", "--center_crop"]
    # 20 photos, batches per bucket of up to 4 under the budget, leftover "drop": the sampler says what it drops
    drops = r"The epoch plan drops \d+ of 20 assigned rows .* Remedies: a smaller --max_pixels_per_batch"
    with test_train.warns_in_log(drops):
        stats = run_script(args + ["--output_dir", str(full)])
    test_train.reset_accelerate()
    resumed = tmp_path_factory.mktemp("pixel_resumed")
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    with test_train.warns_in_log(drops):
        run_script(args + ["--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])
    return {"full": full, "resumed": resumed, "stats": stats}


@pytest.mark.slow
@pytest.mark.xdist_group("train_pixel")
def test_each_bucket_trains_its_batch_size_and_resumes_exactly(pixel_runs) -> None:
    full, stats = pixel_runs["full"], pixel_runs["stats"]
    trace = read_trace(full, 0)
    buckets = json.loads((full / train_files.BUCKETS_FILE).read_text())["resolutions"]
    sizes = set()
    for t in trace:
        w, h = buckets[t["bucket"]]
        assert t["shape"] == [EXPECTED[(w, h)], 3, h, w], t  # (B, 3, H, W): B from the bucket's area
        sizes.add(t["shape"][0])
    assert [t["step"] for t in trace] == [0, 0, 1, 1, 2] and sorted(t["shape"][0] for t in trace) == [3, 3, 3, 4, 4]
    # startup table: a batch column per bucket; upstream's block says the batch is per bucket
    log = stats["log"]
    for (w, h), b in EXPECTED.items():
        assert any(line.split()[:3] == [str(w), "x", str(h)] and line.split()[-1] == str(b)
                   for line in log.splitlines()), (w, h)
    assert "per bucket with --max_pixels_per_batch 12288" in log
    resumed = read_trace(pixel_runs["resumed"], 0)
    tail = [t for t in trace if t["step"] >= 2]
    assert [(t["step"], t["rows"], t["shape"]) for t in resumed] == [(t["step"], t["rows"], t["shape"]) for t in tail]
    np.testing.assert_allclose([t["loss"] for t in resumed], [t["loss"] for t in tail], rtol=1e-5)
    assert test_train.max_weight_diff(full, pixel_runs["resumed"]) < 1e-6


def test_budget_below_a_bucket_is_a_usage_error(assets, tmp_path: Path) -> None:
    with pytest.raises(script.UsageError, match=r"--max_pixels_per_batch 4000: .*cannot hold one image of bucket"):
        script.main(["--pretrained_model_name_or_path", assets["sd"], "--train_data_dir", assets["images"],
                     "--output_dir", str(tmp_path), *COMMON, "--max_pixels_per_batch", "4000"])
