"""``slide`` end to end and the one frame-planning rule (issue 37, item 3).

- One rule: :func:`hf_arb.video.plan_frames` plans annotation (the frame count a clip holds, a slide window's plan),
  training (each row's plan, its cache key) and decoding (the frames asked of the decoder). A hypothesis test over
  (source fps, target fps, frame count, mode) checks that the plan the annotated columns give is the one decoding
  uses, inside the clip, with the bucket's frame count; real CFR and VFR clips (H.264 and VP9, one at 20 fps: an
  integer stride of round(20 / 16) = 1 counted 20 frames where decoding finds 16) decode exactly their annotated
  ``bucket_frames``, and a constant-rate clip exactly its planned source frames.
- ``slide``: ``add_bucket_columns`` (and ``hf-arb annotate --frame-sampling slide``) turns a long clip into one row per
  window, each with its own ``frame_start``; the summary counts the added rows; the Arrow-batch function the engines
  map gives the same rows; training takes each window as its own row (its own plan and cache key) and a resumed run
  trains the same windows to the same losses (3 steps, checkpoint at 2).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
from _photos import photo, save_photo
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("av")

from hf_arb import BucketSet, add_bucket_columns  # noqa: E402
from hf_arb.annotate.arrow_batch import BatchAnnotator  # noqa: E402
from hf_arb.annotate.clips import clip_bucket_columns, slide_windows  # noqa: E402
from hf_arb.testing.clips import panning_frames, write_clip  # noqa: E402
from hf_arb.video import (  # noqa: E402
    FramePlan,
    clip_metadata,
    held_frames,
    nearest_frames,
    plan_frames,
    read_clip,
    slide_counts,
)
from hf_arb.video.dataset import BucketedClipDataset  # noqa: E402

#: Wan's 4k+1 counts up to 17 at two aspects, and 1 frame (stills)
CLIP_SET = BucketSet([(w, h, f) for f in (1, 5, 9, 13, 17) for (w, h) in ((64, 48), (48, 64))])
#: a variable frame rate: 20 fps runs broken by 0.2 s pauses
VFR_TIMES = np.cumsum([0.0] + [0.05 if i % 3 else 0.2 for i in range(39)])


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Clips panning across a photo (64x48): long CFR ones (MP4 and WebM at 24 fps, MP4 at 20 fps), a slow one (8
    fps), a VFR one, a still and a cut file."""
    d = tmp_path_factory.mktemp("slide")
    frames = panning_frames(np.asarray(photo("astronaut.png")), 60)
    write_clip(d / "a_long.mp4", frames, fps=24, gop=8)
    write_clip(d / "b_long.webm", frames, fps=24, gop=8)
    write_clip(d / "c_20fps.mp4", frames[:20], fps=20)
    write_clip(d / "d_slow.mp4", frames[:9], fps=8)
    write_clip(d / "e_vfr.mp4", frames[:40], times=VFR_TIMES, gop=8)
    save_photo(d / "f_still.jpg", "rocket.jpg", "JPEG", size=(64, 48))
    data = (d / "a_long.mp4").read_bytes()
    (d / "g_cut.mp4").write_bytes(data[:500])
    return d


def _dataset(d: Path) -> datasets.Dataset:
    paths = [str(p) for p in sorted(d.iterdir())]
    return datasets.Dataset.from_dict({"video": paths, "caption": [Path(p).stem for p in paths]})


# ------------------------------------------------------------------------------------------- the one rule
@settings(max_examples=300, deadline=None)
@given(frames=st.integers(1, 400),
       fps=st.sampled_from([8.0, 12.0, 15.0, 20.0, 23.976, 24.0, 25.0, 29.97, 30.0, 50.0, 59.94, 60.0]),
       target_fps=st.sampled_from([None, 8.0, 12.0, 15.0, 16.0, 24.0, 30.0]),
       mode=st.sampled_from(["head", "random", "uniform", "slide"]), stride=st.sampled_from([None, 1, 3, 8]),
       seed=st.integers(0, 2**31), epoch=st.integers(0, 5))
def test_the_annotated_plan_is_what_decoding_plans(frames: int, fps: float, target_fps: float | None, mode: str,
                                                   stride: int | None, seed: int, epoch: int) -> None:
    """The plan of each annotated row (``frame_start``, ``frame_stride``, ``bucket_frames``) is the plan training
    and decoding use for it: the same source frames, the bucket's frame count of them, all inside the clip, and a
    constant-rate clip's decoder, choosing by timestamp, takes exactly those frames."""
    meta = pa.table({"original_width": pa.array([64], pa.int32()), "original_height": pa.array([48], pa.int32()),
                     "original_frames": pa.array([frames], pa.int32()), "original_fps": pa.array([fps], pa.float32()),
                     "frames_exact": [True], "skip_reason": pa.array([None], pa.string())})
    table = clip_bucket_columns(meta, CLIP_SET, target_fps=target_fps, frame_sampling=mode)
    if mode == "slide":
        table = slide_windows(table, CLIP_SET, target_fps=target_fps, slide_stride=stride)
    rows = table.to_pylist()
    stored_fps = float(np.float32(fps))  # what the column holds, and training reads
    held = frames if mode == "uniform" else int(held_frames(frames, stored_fps, target_fps))
    if held < 5:  # shorter than the smallest clip bucket: 1-frame buckets (slide: a window per frame held)
        assert {r["bucket_frames"] for r in rows} == {1}
    count = rows[0]["bucket_frames"]
    assert count == int(CLIP_SET.frame_counts[CLIP_SET.frame_counts <= held].max())  # the longest that fits
    if mode == "slide":
        assert len(rows) == int(slide_counts(frames, stored_fps, count, target_fps, stride))
    for window, r in enumerate(rows):
        start = r["frame_start"]
        assert (start is not None) == (mode == "slide")
        # what training plans from the columns (BucketedClipDataset.frame_plan) and hands read_clip to decode
        plan = plan_frames(frames, stored_fps, count, target_fps=target_fps, mode=mode, seed=seed, epoch=epoch,
                           row=7, start=start)
        idx = plan.indices()
        assert idx.shape == (count,) and idx.min() >= 0 and idx.max() < frames
        if mode != "uniform":  # the annotated columns are the plan
            assert plan.stride == r["frame_stride"]
            annotated = FramePlan(0 if start is None else start, r["frame_stride"], count)
            if mode != "random":
                assert np.array_equal(annotated.indices(), idx)
        if mode == "slide":  # the window the row stands for, as planned by its index
            assert np.array_equal(plan_frames(frames, stored_fps, count, target_fps=target_fps, mode="slide",
                                              window=window, stride=stride).indices(), idx)
        times = np.arange(frames) / stored_fps  # a constant-rate clip's frame times
        assert np.array_equal(nearest_frames(times, idx / stored_fps), idx)  # the decoder's pick: the plan


@pytest.mark.parametrize("target_fps", [16.0, None])
@pytest.mark.parametrize("mode", ["head", "uniform", "slide"])
def test_real_clips_decode_exactly_their_annotated_frames(clip_dir: Path, target_fps: float | None,
                                                          mode: str) -> None:
    """Every kept clip row decodes to its ``bucket_frames`` frames, none refused as too short (the 20 fps clip holds
    16 frames at 16 fps: a 13-frame bucket), and a constant-rate clip's frames are the planned source frames."""
    ds = add_bucket_columns(_dataset(clip_dir), CLIP_SET, target_fps=target_fps, frame_sampling=mode,
                            show_summary=False)
    data = BucketedClipDataset(ds, CLIP_SET, video_column="video", target_fps=target_fps, mode=mode, seed=1,
                               caption_column="caption")
    rows = ds.select_columns(["video", "bucket", "bucket_frames", "original_fps", "frame_start"]).to_list()
    if target_fps == 16.0:  # 16 frames at 16 fps; uniform spreads the bucket over all 20
        assert next(r for r in rows if "20fps" in r["video"])["bucket_frames"] == (17 if mode == "uniform" else 13)
    clips = 0
    for row, r in enumerate(rows):
        if r["bucket"] < 0 or not r["original_fps"]:
            continue
        clips += 1
        w, h, f = (int(v) for v in CLIP_SET[r["bucket"]])
        sample = data[(row, r["bucket"], 0)]
        assert sample["row"] == row and tuple(sample["pixel_values"].shape) == (3, f, h, w)  # not replaced
        plan = data.frame_plan(row, r["bucket"], 0)
        res = read_clip(r["video"], (w, h), f, target_fps=target_fps, mode=mode, plan=plan)
        assert res.frames.shape[0] == f
        m = clip_metadata(r["video"])
        if "vfr" not in r["video"]:
            assert np.array_equal(np.rint(res.times * m.fps).astype(int), plan.indices())
        if mode != "slide":  # planned from the header alone, as ClipFrameReader reads a clip: the same count
            assert read_clip(r["video"], (w, h), f, target_fps=target_fps, mode=mode).frames.shape[0] == f
    assert clips >= 5


# ------------------------------------------------------------------------------------------- slide: annotate
def test_slide_turns_a_long_clip_into_windows_counted_in_the_summary(clip_dir: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """At 16 fps the 60-frame 24 fps clips hold 40 frames: a 17-frame bucket, its windows 17 target frames = 25.5
    source frames apart (the nearest whole frame, ties to the earlier: 25), as many as fit (starts 0 and 25; a third
    at 50 would end past frame 59); every column of the clip repeated in each window row; the still and the cut file
    stay one row; the summary counts the added rows; the Video feature is kept."""
    ds = _dataset(clip_dir).cast_column("video", datasets.Video())
    out = add_bucket_columns(ds, CLIP_SET, target_fps=16, frame_sampling="slide")
    printed = capsys.readouterr().out
    rows = out.select_columns(["caption", "bucket", "bucket_frames", "frame_stride", "frame_start"]).to_list()
    long = [r for r in rows if r["caption"] == "a_long"]
    assert [(r["bucket_frames"], r["frame_stride"], r["frame_start"]) for r in long] == [(17, 1.5, 0), (17, 1.5, 25)]
    assert [r["frame_start"] for r in rows if r["caption"] == "b_long"] == [0, 25]
    assert [r["frame_start"] for r in rows if r["caption"] == "c_20fps"] == [0]  # 16 frames: one 13-frame window
    assert [r["frame_start"] for r in rows if r["caption"] == "f_still"] == [None]
    assert [r["bucket"] for r in rows if r["caption"] == "g_cut"] == [-1]
    slow = [r["frame_start"] for r in rows if r["caption"] == "d_slow"]  # 8 -> 16 fps: 17 frames, one window
    assert slow == [0]
    clips = sum(1 for r in rows if r["frame_start"] == 0)
    windows = sum(1 for r in rows if r["frame_start"] is not None)
    assert len(rows) == len(ds) + windows - clips
    assert f"slide: {clips} clips -> {windows} rows ({windows - clips} added by windows)" in printed
    assert isinstance(out.features["video"], datasets.Video) and BucketSet.from_dataset(out) == CLIP_SET
    # the Arrow-batch function Ray Data and Spark map gives the same rows
    raw = _dataset(clip_dir)
    fn = BatchAnnotator.create(CLIP_SET, image_column=None, video_column="video", target_fps=16.0,
                               frame_sampling="slide")
    arrow = fn(raw.with_format("arrow")[:])
    assert arrow.num_rows == len(out)
    assert arrow.drop_columns(["video"]).to_pylist() == out.remove_columns(["video"]).to_list()
    # a smaller slide stride overlaps the windows: more rows
    more = add_bucket_columns(raw, CLIP_SET, target_fps=16, frame_sampling="slide", slide_stride=4,
                              show_summary=False)
    assert [r for r in more["frame_start"] if r is not None][:5] == [0, 6, 12, 18, 24]


def test_slide_refusals_name_the_fix(clip_dir: Path) -> None:
    """A slide stride without slide, a stream, an image set; and training a dataset of slide windows with another
    --frame_sampling (or whole clips with slide): each one line naming the fix."""
    import argparse

    from hf_arb.checks import UsageError
    from hf_arb.train.sources.clips import check_windows

    raw = _dataset(clip_dir)
    windows = add_bucket_columns(raw, CLIP_SET, frame_sampling="slide", show_summary=False)
    whole = add_bucket_columns(raw, CLIP_SET, show_summary=False)
    with pytest.raises(UsageError, match=r"--frame_sampling head: the dataset was annotated with --frame-sampling "
                                         r"slide \(\d+ rows are clip windows"):
        check_windows(argparse.Namespace(frame_sampling="head"), windows)
    with pytest.raises(UsageError, match="annotate it with hf-arb annotate --frame-sampling slide"):
        check_windows(argparse.Namespace(frame_sampling="slide"), whole)
    check_windows(argparse.Namespace(frame_sampling="slide"), windows)
    check_windows(argparse.Namespace(frame_sampling="random"), whole)
    with pytest.raises(ValueError, match="slide_stride=4 applies to frame_sampling='slide'"):
        add_bucket_columns(raw, CLIP_SET, video_column="video", slide_stride=4)
    with pytest.raises(ValueError, match="annotate a map-style Dataset"):
        add_bucket_columns(raw.to_iterable_dataset(), CLIP_SET, video_column="video", frame_sampling="slide")
    with pytest.raises(ValueError, match="frame_sampling='slide' applies to clips"):
        add_bucket_columns(datasets.Dataset.from_dict({"image": ["x.jpg"]}), BucketSet.sdxl(),
                           frame_sampling="slide")


def test_cli_annotate_frame_sampling_slide(clip_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hf_arb.cli.app import main

    """``hf-arb annotate FOLDER --frame-sampling slide`` (a videofolder of MP4s): 60 frames at 24 fps -> two 17-frame
    windows at 16 fps, the VFR clip (40 frames, 9.6 fps on average) three, the others one; the summary counts them."""
    folder = tmp_path / "clips"
    folder.mkdir()
    for name in ("a_long.mp4", "c_20fps.mp4", "d_slow.mp4", "e_vfr.mp4"):
        shutil.copy(clip_dir / name, folder / name)
    out = tmp_path / "out"
    assert main(["annotate", str(folder), "--frames", "1,5,9,13,17", "--resolution", "64", "--step", "16",
                 "--target-fps", "16", "--frame-sampling", "slide", "--output-dir", str(out)]) == 0
    assert "slide: 4 clips -> 7 rows (3 added by windows)" in capsys.readouterr().out
    saved = datasets.load_from_disk(str(out))["train"]
    assert saved["frame_start"] == [0, 25, 0, 0, 0, 10, 20]


# ------------------------------------------------------------------------------------------- slide: training
@pytest.mark.slow
def test_slide_rows_train_each_window_and_resume_exactly(clip_dir: Path, tmp_path: Path, family_assets) -> None:
    """The unchanged script with --frame_sampling slide on raw clips: each window is its own row (its own frame plan
    and cache key); 3 steps with a checkpoint at 2, resumed: step 3 trains the same windows to the same loss."""
    from _train_fixtures import CLIP
    from test_train import read_trace, run_script

    import train_text_to_image_arb as script
    from hf_arb.train.sources.clips import ClipSource

    folder = tmp_path / "long"
    folder.mkdir()
    for name in ("a_long.mp4", "b_long.webm"):
        shutil.copy(clip_dir / name, folder / name)
    argv = ["--pretrained_model_name_or_path", family_assets["wan"], "--train_data_dir", str(folder), *CLIP,
            "--frame_sampling", "slide", "--rank", "4", "--learning_rate", "2e-2", "--max_train_steps", "3",
            "--checkpointing_steps", "2"]
    source = ClipSource(script.parse_args([*argv, "--output_dir", str(tmp_path / "probe")]), None)
    source.load(None)
    starts = source.ds["frame_start"]
    assert starts == [0, 9, 18, 27, 36, 45, 0, 9, 18, 27, 36, 45]  # 60 frames: six 9-frame windows each
    data = source.dataset()
    plans = [data.fit_row(r, int(source.ds["bucket"][r]), 0).frames for r in range(6)]  # one clip's windows
    assert plans == [(s, 1, 9) for s in starts[:6]]  # each window its own frame plan, in its cache key
    assert data.fit_row(1, None, 0).key() == data.fit_row(1, None, 3).key()  # a window's frames: every epoch
    run_script([*argv, "--output_dir", str(tmp_path / "full")])
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    run_script([*argv, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", "latest"])
    full, again = read_trace(tmp_path / "full", 0), read_trace(tmp_path / "resumed", 0)
    assert [t["step"] for t in full] == [0, 1, 2] and all(len(t["shape"]) == 5 for t in full)
    assert [(t["step"], t["rows"], t["loss"]) for t in again] == [(t["step"], t["rows"], t["loss"])
                                                                  for t in full[2:]]
    # a resume that would cut the clips into other windows, or train whole clips, stops in one line naming the flag
    for changed, fix in ((["--slide_stride", "5"], "drop --slide_stride"),
                         (["--frame_sampling", "head"], "pass --frame_sampling slide")):
        with pytest.raises(script.UsageError, match=fix):  # argparse: the later flag wins
            run_script([*argv, *changed, "--output_dir", str(tmp_path / "full"), "--resume_from_checkpoint", "latest"])
