"""Clips through annotation (issue 37 item 1): ``add_bucket_columns`` / ``hf-arb annotate`` with a video column, on
real clips encoded here with PyAV from a real photo with motion (H.264 in MP4, VP9 in WebM, one rotated by a display
matrix, one at 24 fps), images in the same column, and damaged files. Only container headers are read; every clip
lands in a (width, height, frames) bucket whose frame window fits it; bad clips are named, never raised."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
from _photos import photo, save_photo

pytest.importorskip("av")

from hf_arb import BucketSet, add_bucket_columns  # noqa: E402
from hf_arb.annotate.arrow_batch import BatchAnnotator  # noqa: E402
from hf_arb.annotate.summary import summarize_annotation  # noqa: E402
from hf_arb.buckets.schema import BUCKET_COLUMNS, CLIP_BUCKET_COLUMNS  # noqa: E402
from hf_arb.testing.clips import panning_frames, write_clip  # noqa: E402
from hf_arb.video import clip_metadata, frame_plan  # noqa: E402

#: Wan's 4k+1 frame counts at two aspects (and 1 frame: images) at a 64x48 scale
CLIP_SET = BucketSet([(w, h, f) for f in (1, 5, 9, 13, 17) for (w, h) in ((64, 48), (48, 64), (64, 64))])
ADDED = (*BUCKET_COLUMNS, *CLIP_BUCKET_COLUMNS)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of clips panning across the astronaut photo, a still, and damaged files."""
    d = tmp_path_factory.mktemp("clips")
    frames = panning_frames(np.asarray(photo("astronaut.png")), 24)
    write_clip(d / "a_h264_9.mp4", frames[:9])
    write_clip(d / "b_vp9_13.webm", frames[:13])
    write_clip(d / "c_rot_17.mp4", frames[:17], rotation=-90)  # 64x48 frames shown portrait
    write_clip(d / "d_24fps_24.mp4", frames, fps=24)
    write_clip(d / "e_h264_3.mp4", frames[:3])  # shorter than every clip bucket: a 1-frame bucket, or skipped
    save_photo(d / "f_still.jpg", "rocket.jpg", "JPEG", orientation=6, size=(64, 48))  # shown 48x64
    data = (d / "a_h264_9.mp4").read_bytes()
    (d / "g_cut.mp4").write_bytes(data[: len(data) // 2])  # moov at the end: the header itself is cut
    (d / "h_garbage.webm").write_bytes(b"\x1aE\xdf\xa3" + bytes(range(256)) * 2)
    return d


def _paths(d: Path) -> list[str | None]:
    return [str(p) for p in sorted(d.iterdir())] + [None]


def _bucket_of(w: int, h: int, frames: int, buckets: BucketSet = CLIP_SET) -> tuple[int, ...]:
    """Brute force: the largest frame count <= frames, then the nearest aspect (log) among its buckets."""
    res = buckets.resolutions
    f = res[:, 2][res[:, 2] <= frames].max()
    cand = np.flatnonzero(res[:, 2] == f)
    err = np.abs(np.log(res[cand, 0] / res[cand, 1]) - np.log(w / h))
    return tuple(res[cand[np.argmin(err)]].tolist())


def test_paths_bytes_and_video_feature_give_the_same_header_only_columns(clip_dir: Path) -> None:
    paths = _paths(clip_dir)
    by_path = add_bucket_columns(datasets.Dataset.from_dict({"video": paths}), CLIP_SET, show_summary=False)
    assert by_path.column_names == ["video", *ADDED]
    rows = by_path.remove_columns(["video"]).to_list()
    for path, row in zip(paths, rows):
        name = Path(path).name if path else "null"
        if name in ("g_cut.mp4", "h_garbage.webm"):
            assert row["bucket"] == -1 and row["skip_reason"].startswith("unreadable: "), name
            continue
        if path is None:
            assert row["bucket"] == -1 and row["skip_reason"] == "missing"
            continue
        m = clip_metadata(path)  # the header, as the clip columns read it
        assert (row["original_width"], row["original_height"], row["original_frames"]) == (m.width, m.height,
                                                                                            m.frames), name
        assert row["original_fps"] == pytest.approx(m.fps) and row["frame_stride"] == 1, name
        bucket = (row["bucket_width"], row["bucket_height"], row["bucket_frames"])
        assert bucket == _bucket_of(m.width, m.height, m.frames) == CLIP_SET[row["bucket"]], name
    named = {Path(p).name: r for p, r in zip(paths[:-1], rows)}
    assert (named["c_rot_17.mp4"]["original_width"], named["c_rot_17.mp4"]["original_height"]) == (48, 64)
    assert named["c_rot_17.mp4"]["bucket_width"] == 48  # the displayed size picks a portrait bucket
    assert named["f_still.jpg"]["bucket_frames"] == 1 and named["f_still.jpg"]["original_fps"] == 0  # a 1-frame clip
    assert (named["f_still.jpg"]["original_width"], named["f_still.jpg"]["original_height"]) == (48, 64)  # EXIF 6
    assert named["b_vp9_13.webm"]["frames_exact"] is False and named["a_h264_9.mp4"]["frames_exact"] is True
    # bytes (the Hub layout) and a datasets.Video feature read the same headers
    cells = [None if p is None else {"bytes": Path(p).read_bytes(), "path": Path(p).name} for p in paths]
    feat = datasets.Features({"video": datasets.Video()})
    as_video = add_bucket_columns(datasets.Dataset.from_dict({"video": cells}, features=feat), CLIP_SET,
                                  show_summary=False)
    assert isinstance(as_video.features["video"], datasets.Video) and as_video.features["video"].decode
    raw = add_bucket_columns(datasets.Dataset.from_dict({"clip": [c and c["bytes"] for c in cells]}), CLIP_SET,
                             video_column="clip", show_summary=False)
    for other in (as_video, raw):
        assert other.remove_columns([other.column_names[0]]).to_list() == rows
    assert BucketSet.from_dataset(as_video) == CLIP_SET  # the frame axis travels in the feature


def test_streaming_and_arrow_engines_agree(clip_dir: Path) -> None:
    paths = _paths(clip_dir)
    ds = datasets.Dataset.from_dict({"video": paths})
    want = add_bucket_columns(ds, CLIP_SET, show_summary=False).remove_columns(["video"]).to_list()
    streamed = add_bucket_columns(ds.to_iterable_dataset(), CLIP_SET)
    assert [{c: r[c] for c in ADDED} for r in streamed] == want
    fn = BatchAnnotator.create(CLIP_SET, image_column=None, video_column="video")  # what Ray and Spark map
    out = fn(pa.record_batch({"video": pa.array(paths)}))
    assert out.schema.names == ["video", *ADDED] and out.drop_columns(["video"]).to_pylist() == want


def test_target_fps_strides_and_the_window_fits(clip_dir: Path) -> None:
    """The stride is fps / target_fps source frames per trained frame: at Wan's 16 fps a 24 fps clip of 24 frames
    holds 16 (frames 0, 1, 3, 4, ..., 22), so it lands in the 13-frame buckets (an integer stride, round(24 / 16) = 2,
    counted 12 and picked the 9-frame ones); every kept clip's frame plan has its bucket's frames, inside the clip."""
    ds = datasets.Dataset.from_dict({"video": _paths(clip_dir)})
    out = add_bucket_columns(ds, CLIP_SET, target_fps=4, show_summary=False).to_list()
    kept = [r for r in out if r["bucket"] >= 0]
    assert {r["frame_stride"] for r in kept if r["original_fps"] == 8} == {2}
    fast = next(r for r in kept if r["original_fps"] == 24)
    assert fast["frame_stride"] == 6 and fast["bucket_frames"] == 1  # 24 frames every 6th: 4 frames -> 1
    for r in (r for r in kept if r["original_fps"] > 0):  # the clips (a still has no stride)
        plan = frame_plan(r["original_frames"], r["original_fps"], r["bucket_frames"], "wan", target_fps=4,
                          mode="random", seed=3, row=1)
        assert plan.count == r["bucket_frames"] and plan.stride == r["frame_stride"]
        assert plan.indices().max() < r["original_frames"]
    at16 = add_bucket_columns(ds, CLIP_SET, target_fps=16, show_summary=False).to_list()
    fast = next(r for r in at16 if r["original_fps"] == 24)
    assert (fast["frame_stride"], fast["bucket_frames"]) == (1.5, 13)


def test_short_clips_skipped_by_name_or_looped(clip_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without 1-frame buckets the still and a 3-frame clip are shorter than every bucket: skipped and named, or
    looped into the 5-frame buckets with short_clips='loop'."""
    clips_only = BucketSet([(w, h, f) for f in (5, 9) for (w, h) in ((64, 48), (48, 64))])
    ds = datasets.Dataset.from_dict({"video": _paths(clip_dir)})
    out = add_bucket_columns(ds, clips_only)
    printed = capsys.readouterr().out
    reasons = dict(zip([Path(p).name if p else None for p in ds["video"]], out["skip_reason"]))
    assert reasons["e_h264_3.mp4"] == "too_few_frames: 3 frames, fewer than the smallest frame bucket's 5"
    assert reasons["f_still.jpg"].startswith("too_few_frames: 1 frames")
    assert "too_few_frames 2" in printed and "e_h264_3.mp4): too_few_frames" in printed  # counted and named
    assert "unreadable 2" in printed and "g_cut.mp4): unreadable: " in printed
    looped = add_bucket_columns(ds, clips_only.replace(short_clips="loop"), show_summary=False).to_list()
    short = [r for r, p in zip(looped, ds["video"]) if p and Path(p).name in ("e_h264_3.mp4", "f_still.jpg")]
    assert [r["bucket_frames"] for r in short] == [5, 5]


def test_summary_counts_buckets_frames_and_fps(clip_dir: Path) -> None:
    out = add_bucket_columns(datasets.Dataset.from_dict({"video": _paths(clip_dir)}), CLIP_SET, show_summary=False)
    s = summarize_annotation(out)
    assert dict(s.frames_histogram) == {"1": 1, "3": 1, "9": 1, "13": 1, "17": 1, "24": 1}
    assert dict(s.fps_histogram) == {"0": 1, "8": 4, "24": 1}
    d = s.to_dict()
    assert d["counts"]["48x64x17"] == 1 and d["counts"]["64x48x9"] == 1 and d["frames"]["24"] == 1
    text = str(s)
    assert "rows per bucket (width x height x frames" in text and "rows per fps (frame rate" in text
    assert "48 x 64    x 17" in text
    # what push_to_hub writes: the card's YAML restores the (W, H, F) set, its table has the frames and the counts
    from hf_arb.annotate.hub import update_card_text
    from hf_arb.buckets.schema import buckets_from_card

    card = update_card_text(None, "me/clips", CLIP_SET, {"default": {"train": d}}, None)
    assert buckets_from_card(card) == CLIP_SET and "`bucket_frames`" in card
    assert f"| {CLIP_SET.index((48, 64, 17))} | 48 | 64 | 17 | 0.750 | 1 |" in card


def test_refusals_name_the_fix(clip_dir: Path) -> None:
    ds = datasets.Dataset.from_dict({"video": _paths(clip_dir)})
    with pytest.raises(ValueError, match=r"video_column='video' needs a BucketSet with a frame axis"):
        add_bucket_columns(ds, BucketSet.sdxl(), video_column="video")
    with pytest.raises(ValueError, match=r"target_fps.*> 0"):
        add_bucket_columns(ds, CLIP_SET, target_fps=0)
    with pytest.raises(ValueError, match=r"video_column='clip': the dataset has no such column"):
        add_bucket_columns(ds, CLIP_SET, video_column="clip")
    with pytest.raises(ValueError, match=r"no such column but a clip column 'video': annotate clips with \(width, "):
        add_bucket_columns(ds, BucketSet.sdxl())


def test_images_and_sizes_with_a_clip_set_are_one_frame_clips(tmp_path: Path) -> None:
    """A clip set annotates an image column or width/height columns with the same columns: 1 frame at fps 0."""
    sizes = datasets.Dataset.from_dict({"w": [640, 300, None], "h": [480, 400, 10]})
    out = add_bucket_columns(sizes, CLIP_SET, width_column="w", height_column="h", show_summary=False)
    assert out.column_names == ["w", "h", *ADDED]
    assert out["bucket_frames"] == [1, 1, None] and out["original_frames"] == [1, 1, None]
    assert out["original_fps"][:2] == [0.0, 0.0] and out["frame_stride"][:2] == [1, 1]
    assert [CLIP_SET[b] for b in out["bucket"][:2]] == [(64, 48, 1), (48, 64, 1)]
    images = datasets.Dataset.from_dict({"image": [str(save_photo(tmp_path / "p.png", "coffee.png", "PNG"))]})
    one = add_bucket_columns(images, CLIP_SET, show_summary=False)[0]
    assert (one["bucket_frames"], one["original_frames"], one["frames_exact"]) == (1, 1, True)
    again = add_bucket_columns(add_bucket_columns(images, CLIP_SET, show_summary=False), BucketSet.sdxl(),
                               show_summary=False)
    assert again.column_names == ["image", *BUCKET_COLUMNS]  # an image set replaces every clip column


def test_cli_annotate_a_folder_of_clips_then_stats(clip_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``hf-arb annotate FOLDER --frames`` (datasets' videofolder: a Video column, detected), then ``hf-arb stats``:
    rows and batches per (W, H, F), frames and fps; the stored set has the frame axis. Without --frames a video
    column is refused in one line."""
    from hf_arb.cli.app import main

    folder = tmp_path / "mp4s"
    folder.mkdir()
    for p in clip_dir.glob("[acd]_*.mp4"):
        (folder / p.name).write_bytes(p.read_bytes())
    out = tmp_path / "annotated"
    assert main(["annotate", str(folder), "--frames", "1,5,9,13,17", "--resolution", "64", "--step", "16",
                 "--target-fps", "8", "--output-dir", str(out)]) == 0
    annotated = datasets.load_from_disk(str(out))["train"]
    bs = BucketSet.from_dataset(annotated)
    assert bs.has_frames and sorted(bs.frame_counts.tolist()) == [1, 5, 9, 13, 17]
    assert sorted(annotated["bucket_frames"]) == [5, 9, 17]  # 24 frames at 24 fps, every 3rd for 8 fps: 8 -> 5
    capsys.readouterr()
    assert main(["stats", str(out), "--train-batch-size", "1", "--num-processes", "1"]) == 0
    printed = capsys.readouterr().out
    assert "x frames" in printed and "rows per frames" in printed and "batches per epoch" in printed
    with pytest.raises(SystemExit) as exc:
        main(["annotate", str(folder), "--video-column", "video", "--output-dir", str(tmp_path / "x")])
    assert exc.value.code == 2 and "--video-column video needs clip buckets: pass --frames" in capsys.readouterr().err


def test_report_rows_batches_histograms_and_frame_strips(clip_dir: Path) -> None:
    """The report of a clip dataset: per (W, H, F) bucket rows and steps, the frames and fps histograms, and per sample
    clip a strip of the frames of its epoch-0 window (frame_plan's, at the row's stride) with its one crop; the strip's
    frames are those frames (checked against decoding every frame) in their displayed orientation."""
    import av

    from hf_arb.annotate.report import build_report, clip_window, render_html, strip_frames

    ds = datasets.Dataset.from_dict({"video": _paths(clip_dir)})
    rep = build_report(ds, CLIP_SET, video_column="video", k=2, batch_size=1, seed=5)
    assert rep.buckets.has_frames and dict(rep.frames_hist)["17"] == 1 and dict(rep.fps_hist)["8"] == 4
    assert int(rep.steps[CLIP_SET.index((48, 64, 17))]) == 1  # one batch of 1 in the rotated clip's bucket
    strips = [s for b in rep.samples for s in rep.samples[b] if s.window is not None]
    assert sorted(s.name for s in strips) == ["a_h264_9.mp4", "b_vp9_13.webm", "c_rot_17.mp4", "d_24fps_24.mp4",
                                              "e_h264_3.mp4"]  # the still is a thumbnail
    for s in strips:
        path = clip_dir / s.name
        m = clip_metadata(path)
        bucket = _bucket_of(m.width, m.height, m.frames)
        window = clip_window(m.frames, m.fps, bucket[2], 1, seed=5, row=s.row)
        assert s.window == tuple(window) and set(s.frames) <= set(window.indices().tolist())
        assert s.frames[0] == window.start and s.frames[-1] == window.indices()[-1]
        with av.open(str(path)) as c:  # ground truth: every frame decoded, in display orientation
            every = [f.to_image().rotate(f.rotation, expand=True) for f in c.decode(video=0)]
        got = strip_frames({"bytes": path.read_bytes(), "path": None}, list(s.frames), m.fps)
        for i, im in zip(s.frames, got):
            assert im.size == (m.width, m.height), s.name  # displayed: the rotated clip is portrait
            assert np.abs(np.asarray(im, np.int16) - np.asarray(every[i], np.int16)).max() == 0, (s.name, i)
    page = render_html(rep)
    assert "id='clip-histograms'" in page and "data-field='frames'" in page and "trains frames" in page
    assert "too_few_frames" not in page and "unreadable" in page
