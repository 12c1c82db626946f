"""Validation videos and per-bucket clip batch sizes (issue 38 items 2 and 4), the fast parts: a video sample (a
pipeline's ``.frames``: PIL frames or an ``(F, H, W, 3)`` array in [0, 1]) written as an H.264 MP4 that PyAV reads
back frame for frame at its size, drawn as a strip for the grid, logged to TensorBoard as the strip; the
``--video_token_budget`` / ``--image_train_batch_size`` flags' mistakes in one line, and the batch size each bucket
gets. The runs (the unchanged script validating tiny Wan into MP4s and TensorBoard, training with the budget,
resuming and refusing a changed budget) are in tests/test_family_wan.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from _train_fixtures import batch_result
from PIL import Image

import train_text_to_image_arb as script
from hf_arb.train.videos import frame_strip, log_videos, read_mp4, save_videos, video_array, write_mp4


def moving_square(frames: int, w: int, h: int) -> np.ndarray:
    """``uint8`` ``(F, H, W, 3)``: a white square moving right over a colour gradient (real motion to encode)."""
    x = np.zeros((frames, h, w, 3), np.uint8)
    x[..., 0] = np.linspace(0, 200, w, dtype=np.uint8)[None, None, :]
    x[..., 2] = np.linspace(0, 200, h, dtype=np.uint8)[None, :, None]
    for f in range(frames):
        x[f, h // 4: h // 4 + 8, 2 * f: 2 * f + 8] = 255
    return x


@pytest.mark.parametrize("w, h, f", [(48, 32, 9), (33, 17, 3)], ids=["even", "odd-sides"])
def test_a_video_is_written_as_an_mp4_that_pyav_reads_back_at_its_size_and_length(tmp_path, w, h, f):
    """H.264 (yuv444p where a side is odd), every frame back at (h, w), close to what was written (lossy)."""
    import av

    frames = moving_square(f, w, h)
    path = write_mp4(tmp_path / "v" / "clip.mp4", frames, fps=16)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and float(stream.average_rate) == 16.0
    back = read_mp4(path)
    assert back.shape == frames.shape
    assert np.abs(back.astype(int) - frames.astype(int)).mean() < 12


def test_video_samples_of_every_pipeline_output_type_are_frames_and_strips():
    """PIL frames (output_type="pil"), floats in [0, 1] (output_type="np") and uint8 give the same (F, H, W, 3) uint8
    frames; the strip puts them side by side; an image-shaped array is refused naming the shape."""
    frames = moving_square(3, 16, 8)
    as_pil = [Image.fromarray(f) for f in frames]
    for sample in (as_pil, frames.astype(np.float32) / 255, frames):
        np.testing.assert_array_equal(video_array(sample), frames)
    strip = frame_strip(frames)
    assert strip.size == (48, 8)
    np.testing.assert_array_equal(np.asarray(strip)[:, 16:32], frames[1])
    with pytest.raises(ValueError, match=r"frames \(F, H, W, 3\), got shape \(8, 16, 3\)"):
        video_array(frames[0])


def test_each_video_of_the_grid_becomes_an_mp4_named_by_prompt_and_bucket_and_a_strip(tmp_path):
    """Two prompts x two shapes x two samples: an MP4 per video named prompt-i-WxHxF-j, the grid rows hold strips,
    and an image sample (an image family's) stays as it was, with no MP4."""
    shapes = [(16, 8, 3), (8, 16, 5)]
    rows = [[list(map(Image.fromarray, moving_square(s[2], s[0], s[1]))) for s in shapes for _ in range(2)]
            for _ in range(2)]
    rows[1][0] = Image.new("RGB", (16, 8))
    strips, videos = save_videos(rows, shapes, 2, tmp_path, fps=16)
    names = [p.name for p, _ in videos]
    assert names == ["prompt-0-16x8x3-0.mp4", "prompt-0-16x8x3-1.mp4", "prompt-0-8x16x5-0.mp4",
                     "prompt-0-8x16x5-1.mp4", "prompt-1-16x8x3-1.mp4", "prompt-1-8x16x5-0.mp4",
                     "prompt-1-8x16x5-1.mp4"]
    assert [im.size for im in strips[0]] == [(48, 8), (48, 8), (40, 16), (40, 16)]
    assert strips[1][0].size == (16, 8) and all(read_mp4(p).shape[0] == f.shape[0] for p, f in videos)


def test_tensorboard_gets_each_videos_strip_without_moviepy(tmp_path):
    """torch's add_video needs moviepy, which is not installed: each video is logged as its frame strip under
    validation_video/<name>."""
    import importlib.util

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    assert importlib.util.find_spec("moviepy") is None
    frames = moving_square(4, 16, 8)
    writer = SummaryWriter(str(tmp_path / "tb"))
    log_videos([SimpleNamespace(name="tensorboard", writer=writer)], [(Path("prompt-0-16x8x4.mp4"), frames)], 7, 16)
    writer.close()
    events = EventAccumulator(str(next((tmp_path / "tb").glob("events.*"))), size_guidance={"images": 0})
    events.Reload()
    [image] = events.Images("validation_video/prompt-0-16x8x4")
    assert (image.step, image.width, image.height) == (7, 64, 8)


# ------------------------------------------------------------------------------------------ the batch-size flags
@pytest.fixture(scope="module")
def wan(family_assets) -> str:
    return family_assets["wan"]


def clip_argv(wan: str, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", wan, "--train_data_dir", "d", "--video_column", "video",
            "--bucket_preset", "wan", "--frames", "1,5,9", "--resolution", "64", *extra]


@pytest.mark.parametrize("extra, message", [
    (["--video_token_budget", "0"], r"--video_token_budget must be >= 1, got 0"),
    (["--image_train_batch_size", "0"], r"--image_train_batch_size must be >= 1, got 0"),
    (["--video_token_budget", "64", "--max_pixels_per_batch", "9000"],
     r"--video_token_budget 64 with --max_pixels_per_batch 9000: two budgets for one batch; pass one"),
    (["--image_train_batch_size", "2", "--max_pixels_per_batch", "9000"],
     r"--image_train_batch_size with --max_pixels_per_batch 9000: the pixel budget sizes the stills' batches too"),
])
def test_batch_size_flag_mistakes_are_refused_in_one_line(wan, extra, message):
    with pytest.raises(script.UsageError, match=message):
        script.parse_args(clip_argv(wan, *extra))


@pytest.mark.parametrize("flag", ["--video_token_budget", "--image_train_batch_size"])
def test_the_batch_size_flags_without_clips_are_refused_naming_video_column(wan, flag):
    with pytest.raises(script.UsageError, match=rf"{flag} applies to clips: add --video_column"):
        script.parse_args(["--pretrained_model_name_or_path", wan, "--train_data_dir", "d", flag, "8"])


def test_each_bucket_gets_the_batch_its_latent_tokens_allow(wan):
    """Wan 2.1's tokens (W/16)(H/16)((F-1)/4+1): under 64 tokens the 9-frame 80x48 bucket (45 tokens) trains 1 row,
    the 5-frame 64x48 bucket (24) 2 (the cap is --train_batch_size 2), the stills --image_train_batch_size 3 (not
    the budget's: their 140 tokens would not fit); a bucket with rows that does not fit one sample is refused naming
    the budget it needs (not the empty 256x256x9 one); without the budget the stills get their own size and clips
    --train_batch_size."""
    import datasets

    from hf_arb import BucketSet
    from hf_arb.families import get_family
    from hf_arb.train.sources.clips import clip_batch_sizes

    buckets = BucketSet([(224, 160, 1), (64, 48, 5), (80, 48, 9), (256, 256, 9)])
    ds = datasets.Dataset.from_dict({"bucket": [0, 0, 1, 2, 2, -1]})  # no row in the 256x256x9 bucket
    family = get_family("wan")
    args = script.parse_args(clip_argv(wan, "--video_token_budget", "64", "--image_train_batch_size", "3",
                                       "--train_batch_size", "2"))
    assert family.latent_patch(args) == (16, 4, 1)
    sizes = clip_batch_sizes(args, ds, buckets, family)
    assert sizes[0] == 3 and sizes[1] == 2 and sizes[2] == 1
    args = script.parse_args(clip_argv(wan, "--video_token_budget", "40", "--image_train_batch_size", "3"))
    with pytest.raises(script.UsageError, match=r"--video_token_budget 40: it cannot hold one sample of bucket 2 "
                                                r"\(80x48x9, 45 latent tokens\)\. Raise --video_token_budget to at "
                                                r"least 45"):
        clip_batch_sizes(args, ds, buckets, family)
    args = script.parse_args(clip_argv(wan, "--image_train_batch_size", "5", "--train_batch_size", "2"))
    assert clip_batch_sizes(args, ds, buckets, family) == {0: 5, 1: 2, 2: 2, 3: 2}
    assert clip_batch_sizes(script.parse_args(clip_argv(wan)), ds, buckets, family) is None


def test_a_family_that_does_not_read_its_latent_patch_refuses_the_token_budget(wan):
    from hf_arb.families import get_family

    with pytest.raises(script.UsageError, match=r"--video_token_budget: the .* family does not read its latent "
                                                r"patch yet; use --max_pixels_per_batch"):
        get_family("flux2").latent_patch(script.parse_args(clip_argv(wan)))


@pytest.mark.slow
def test_two_processes_train_the_same_bucket_with_the_same_batch_size_at_every_step(ddp_batch):
    """--video_token_budget 64 --image_train_batch_size 2 on 2 ranks, one epoch (tests/_train_fixtures.py
    ``clip_budget_runs``): at every step both ranks train one bucket with one batch size, different rows; the 9-frame
    clip steps hold 1 row per rank, the still step 2 (4 stills: one global batch; 8 clips: four)."""
    from test_train import read_trace

    run = batch_result(ddp_batch, "clips-wan-budget")
    traces = [read_trace(run["out"], r) for r in (0, 1)]
    assert [(t["label"], t["shape"]) for t in traces[0]] == [(t["label"], t["shape"]) for t in traces[1]]
    for a, b in zip(*traces):
        assert not set(a["rows"]) & set(b["rows"])
    steps = sorted((int(t["label"].split("x")[2]), t["shape"][0]) for t in traces[0])
    assert steps == [(1, 2), (9, 1), (9, 1), (9, 1), (9, 1)], steps


def test_the_plans_advice_names_the_clip_batch_flags(wan, caplog):
    """A plan that drops rows with a batch size per bucket advises the flags that set those sizes, not
    --max_pixels_per_batch (which the run does not use)."""
    import logging

    import datasets

    from hf_arb import BucketSet
    from hf_arb.train.sources.loaders import make_sampler

    args = script.parse_args(clip_argv(wan, "--video_token_budget", "96", "--rank", "4", "--seed", "0"))
    ds = datasets.Dataset.from_dict({"bucket": [0, 1, 1, 1]})  # one still in a bucket of 2: dropped
    with caplog.at_level(logging.WARNING, logger="train_text_to_image_arb"):
        make_sampler(args, ds, BucketSet([(224, 160, 1), (80, 48, 9)]),
                     SimpleNamespace(num_processes=1, is_main_process=True), batch_sizes={0: 2, 1: 1})
    advice = [r.getMessage() for r in caplog.records if "Remedies" in r.getMessage()]
    assert len(advice) == 1 and "smaller batches (--video_token_budget, --image_train_batch_size)" in advice[0]
    assert "max_pixels_per_batch" not in advice[0]
