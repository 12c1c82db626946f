"""Clips into frames (issue 37, items 3 and 6): the temporal modes and timestamp resampling as pure functions, the
decoder that seeks and decodes only the planned frames (bit-equal to a full decode's frames at the same instants,
fitted with one crop), and bad clips counted and named instead of ending a run. Clips are real H.264/MP4 and
VP9/WebM encoded here with PyAV from a real photo with motion (64x48), one with a variable frame rate, one rotated,
and damaged ones."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from _photos import photo, save_photo
from hypothesis import given, settings
from hypothesis import strategies as st

av = pytest.importorskip("av")

from hf_arb.checks import UsageError  # noqa: E402
from hf_arb.images.fitting import render_plan  # noqa: E402
from hf_arb.images.geometry import plan_fit  # noqa: E402
from hf_arb.rng import ROW_CROP, row_rng  # noqa: E402
from hf_arb.testing.clips import (  # noqa: E402
    audio_only_clip,
    cut_clip,
    empty_video_clip,
    flip_bytes,
    panning_frames,
    write_clip,
)
from hf_arb.video import (  # noqa: E402
    BAD_CLIP_KINDS,
    CLIP_NOTES,
    BadClip,
    BadClipLog,
    ClipFrameReader,
    ClipLimits,
    FrameRule,
    clip_metadata,
    clip_problems,
    decode_frames,
    frame_indices,
    frame_plan,
    held_frames,
    nearest_frames,
    plan_frames,
    read_clip,
    sample_times,
    slide_rows,
)

#: a variable frame rate: 20 fps runs broken by 0.2 s pauses (as phones record in low light)
VFR_TIMES = np.cumsum([0.0] + [0.05 if i % 3 else 0.2 for i in range(39)])


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> file: 64x48 clips panning across a photo; keyframes every 8 frames so that seeking skips some."""
    d = tmp_path_factory.mktemp("frames")
    frames = panning_frames(np.asarray(photo("hubble_deep_field.jpg")), 60)
    out = {"mp4": d / "pan.mp4", "webm": d / "pan.webm", "vfr": d / "vfr.mp4", "vfr_webm": d / "vfr.webm",
           "rot": d / "rot.mp4", "short": d / "short.webm"}
    write_clip(out["mp4"], frames, fps=24, gop=8)
    write_clip(out["webm"], frames, fps=24, gop=8)
    write_clip(out["vfr"], frames[:40], times=VFR_TIMES, gop=8)
    write_clip(out["vfr_webm"], frames[:40], times=VFR_TIMES, gop=8)
    write_clip(out["rot"], frames[:9], rotation=-90, faststart=True)
    write_clip(out["short"], frames[:9], fps=8)
    return out


def _full_decode(path: Path) -> tuple[np.ndarray, list]:
    """Every frame of a clip: (presentation times in seconds, PIL images), by decoding all of them."""
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        pairs = [(float((f.pts - (s.start_time or 0)) * f.time_base), f.to_image()) for f in c.decode(s)]
    return np.array([t for t, _ in pairs]), [im for _, im in pairs]


def _fitted(images: list, idx: np.ndarray, plan, orientation: int = 1) -> np.ndarray:
    return np.stack([np.asarray(render_plan(images[i], plan, orientation, draft=False)[0]).transpose(2, 0, 1)
                     for i in idx])


# ------------------------------------------------------------------------------------------- the decoder
@pytest.mark.parametrize("kind", ["mp4", "webm"])
@pytest.mark.parametrize("mode, target_fps", [("head", 16.0), ("random", 16.0), ("random", None), ("uniform", None),
                                              ("slide", 16.0)])
def test_decoded_frames_equal_a_full_decode(clips: dict[str, Path], kind: str, mode: str,
                                            target_fps: float | None) -> None:
    """The decoded frames are bit-equal to a full decode's frames of the plan (the one rule, ``plan_frames``), all
    fitted with one crop, even where WebM's millisecond timestamps would tip an instant half-way between two frames
    (uniform's position 29.5) to the later one; and the decoder stops after the last planned frame."""
    path = clips[kind]
    pts, images = _full_decode(path)
    m = clip_metadata(path)
    times = sample_times(m.frames, m.fps, 13, target_fps=target_fps, mode=mode, seed=1, epoch=2, row=3, window=1)
    res = read_clip(path, (32, 40), 13, target_fps=target_fps, mode=mode, seed=1, epoch=2, row=3, window=1,
                    crop="random")
    idx = plan_frames(m.frames, m.fps, 13, target_fps=target_fps, mode=mode, seed=1, epoch=2, row=3,
                      window=1).indices()
    assert np.array_equal(idx, frame_indices(m.frames, m.fps, times))  # the plan's frames are its instants' nearest
    plan = plan_fit((64, 48), (32, 40), crop="random", rng=row_rng(1, 2, 3, ROW_CROP))
    assert res.frames.shape == (13, 3, 40, 32) and res.frames.dtype == np.uint8
    assert np.array_equal(res.target_times, times) and np.array_equal(res.times, pts[idx])
    assert np.array_equal(res.frames, _fitted(images, idx, plan))  # one crop for every frame
    assert (res.crop_top_left, res.original_size, res.scaled_size) == (plan.crop_top_left, (48, 64), plan.scaled_size)
    keyframe = (idx[0] // 8) * 8  # gop=8: the keyframe at or before the first planned frame
    assert res.decoded <= idx[-1] - keyframe + 2  # from that keyframe to one frame past the last planned one
    if mode != "uniform":
        assert res.decoded < len(pts)


def test_resampling_picks_the_nearest_frame_by_timestamp(clips: dict[str, Path]) -> None:
    """24 fps to 16 fps takes frames 0, 2, 3, 5, 6, ... (the nearest, ties to the earlier); 8 fps to 16 fps shows
    each frame twice, at its real speed."""
    times = sample_times(60, 24.0, 9, target_fps=16)
    assert frame_indices(60, 24.0, times).tolist() == [0, 1, 3, 4, 6, 7, 9, 10, 12]
    res = read_clip(clips["mp4"], (64, 48), 9, target_fps=16)
    assert np.allclose(res.times * 24, [0, 1, 3, 4, 6, 7, 9, 10, 12])
    slow = read_clip(clips["short"], (64, 48), 9, target_fps=16)
    assert np.allclose(slow.times * 8, [0, 0, 1, 1, 2, 2, 3, 3, 4])
    assert np.array_equal(slow.frames[0], slow.frames[1]) and not np.array_equal(slow.frames[1], slow.frames[2])


@pytest.mark.parametrize("kind", ["vfr", "vfr_webm"])
def test_variable_frame_rate_is_resampled_by_timestamps(clips: dict[str, Path], kind: str) -> None:
    """A VFR clip: the frames chosen are those nearest each instant by their own timestamps, not by an average
    rate; the clip is flagged and counted as ``vfr`` (trained, not skipped)."""
    pts, images = _full_decode(clips[kind])
    assert np.allclose(pts, VFR_TIMES)
    times = sample_times(40, 8.0, 9, target_fps=12.0)
    res = decode_frames(clips[kind], times, (64, 48))
    idx = nearest_frames(pts, times)
    assert idx.tolist() == [0, 0, 1, 2, 3, 4, 4, 6, 6]  # the frames at 0, .2, .25, .3, .5 and .6 s
    assert frame_indices(40, 8.0, times).tolist() == [0, 1, 1, 2, 3, 3, 4, 5, 5]  # what an average rate would pick
    assert np.array_equal(res.times, pts[idx]) and res.vfr
    assert np.array_equal(res.frames, _fitted(images, idx, plan_fit((64, 48), (64, 48), "center")))
    reader = ClipFrameReader(target_fps=12.0)
    assert reader(clips[kind], (64, 48), 9, row=4) is not None
    assert reader.log.counts == {"vfr": 1} and reader.log.names["vfr"][0].startswith("row 4:")
    assert not read_clip(clips["mp4"], (64, 48), 9).vfr


def test_rotated_clip_frames_are_shown_upright(clips: dict[str, Path]) -> None:
    """A -90 degree display matrix (a phone's portrait clip): frames come out rotated clockwise as FFmpeg shows
    them, with the displayed size."""
    res = read_clip(clips["rot"], (48, 64), 9)
    _, images = _full_decode(clips["rot"])
    assert res.original_size == (64, 48) and res.rotation == -90 and res.frames.shape == (9, 3, 64, 48)
    stored = np.stack([np.asarray(im) for im in images])  # (9, 48, 64, 3) as stored
    assert np.array_equal(res.frames.transpose(0, 2, 3, 1), np.rot90(stored, k=-1, axes=(1, 2)))


def test_inputs_and_images(clips: dict[str, Path], tmp_path: Path) -> None:
    data = clips["webm"].read_bytes()
    want = read_clip(clips["webm"], (32, 32), 5).frames
    with open(clips["webm"], "rb") as f:
        assert np.array_equal(read_clip(f, (32, 32), 5).frames, want)
    assert np.array_equal(read_clip({"bytes": data, "path": "x.webm"}, (32, 32), 5).frames, want)
    assert np.array_equal(read_clip({"bytes": None, "path": str(clips["webm"])}, (32, 32), 5).frames, want)
    jpg = save_photo(tmp_path / "p.jpg", "rocket.jpg", "JPEG", orientation=6, size=(64, 48))
    one = read_clip(jpg, (48, 64), 1)  # an image is a 1-frame clip, EXIF orientation applied
    assert one.frames.shape == (1, 3, 64, 48) and one.original_size == (64, 48)
    t = one.to_tensor()
    assert tuple(t.shape) == (1, 3, 64, 48) and float(t.min()) >= -1 and float(t.max()) <= 1


def test_loop_plays_a_short_clip_again(clips: dict[str, Path]) -> None:
    """9 frames at 8 fps for a 17-frame bucket: refused as too short, or looped from the start when asked."""
    with pytest.raises(BadClip, match="too_short .9 frames at 8 fps hold 9, fewer than 17"):
        read_clip(clips["short"], (64, 48), 17)
    res = read_clip(clips["short"], (64, 48), 17, loop=True)
    assert res.looped and np.allclose(res.times * 8, [*range(9), *range(8)])
    assert np.array_equal(res.frames[9:], res.frames[:8])
    assert not read_clip(clips["short"], (64, 48), 9).looped


# ------------------------------------------------------------------------------------------- bad clips
def test_each_bad_clip_kind_is_counted_and_named(clips: dict[str, Path], tmp_path: Path) -> None:
    """Every kind of bad clip gives None (never raises), and is counted and named by row in the log and its
    JSON-lines file; a clip read again is not counted twice."""
    mp4 = clips["mp4"].read_bytes()
    write_clip(tmp_path / "fs.mp4", panning_frames(np.asarray(photo("astronaut.png")), 30), faststart=True)
    sources = {
        "unreadable": b"\x00\x00\x00\x18ftypisom" + bytes(range(256)) * 4,
        "corrupt": flip_bytes(mp4),
        "truncated": cut_clip((tmp_path / "fs.mp4").read_bytes(), 0.6),  # a cut MP4 body, header first
        "truncated_webm": cut_clip(clips["webm"].read_bytes(), 0.5),  # the stream ends early
        "no_video": audio_only_clip(),
        "no_video_empty": empty_video_clip(seconds=2.0),  # a video track without a frame
        "too_short": clips["short"],
        "vfr": clips["vfr"],
        "ok": clips["webm"],
    }
    log = BadClipLog(tmp_path / "skipped_clips.jsonl")
    reader = ClipFrameReader(log, target_fps=8.0)
    got = {name: reader(src, (32, 32), 13, row=i) for i, (name, src) in enumerate(sources.items())}
    assert {k for k, v in got.items() if v is not None} == {"vfr", "ok"}
    reader(sources["corrupt"], (32, 32), 13, row=1)  # the same row again: counted once
    strict = ClipFrameReader(log, limits=ClipLimits(max_side=60, min_side=8, max_seconds=100))
    assert strict(clips["mp4"], (32, 32), 5, row=20) is None
    for limits, row in [(ClipLimits(min_side=50), 21), (ClipLimits(max_seconds=1.0), 22), (ClipLimits(max_fps=20), 23)]:
        assert ClipFrameReader(log, limits=limits)(clips["mp4"], (32, 32), 5, row=row) is None
    assert ClipFrameReader(log, loop=True)(clips["short"], (32, 32), 17, row=24) is not None
    assert log.counts == {"unreadable": 1, "corrupt": 1, "truncated": 2, "no_video": 2, "too_short": 1, "vfr": 1,
                          "too_large": 1, "too_small": 1, "too_long": 1, "bad_fps": 1, "looped": 1}
    assert set(log.counts) == set(BAD_CLIP_KINDS) | set(CLIP_NOTES)  # every kind exercised
    assert log.names["truncated"] == [f"row 2: <bytes: {len(sources['truncated'])}>",
                                      f"row 3: <bytes: {len(sources['truncated_webm'])}>"]
    assert log.names["too_short"] == [f"row 6: {str(clips['short'])!r}"] and log.skipped == 11
    lines = [json.loads(x) for x in (tmp_path / "skipped_clips.jsonl").read_text().splitlines()]
    assert len(lines) == 13 and {x["kind"] for x in lines} == set(log.counts)
    detail = {(x["kind"], x["row"]): x["detail"] for x in lines}
    assert detail["truncated", 2].endswith("(the data ends mid-packet)")  # a packet cut short by the end of the file
    assert detail["truncated", 3].startswith("the stream ends at ")  # the demuxer ran out before the planned frames
    assert detail["too_large", 20] == "64x48 has a side above max_side=60"
    assert detail["too_long", 22] == "2.5 s is above max_seconds=1"
    assert detail["no_video", 4] == "no video stream (audio only)"
    assert detail["no_video", 5] == "the video stream holds no frame"
    summary = log.summary()
    assert "truncated: 2 skipped (row 2: " in summary and "vfr: 1 trained" in summary


def test_usage_errors_still_raise(clips: dict[str, Path]) -> None:
    """A mistake of the run (not of one clip) is not swallowed as a bad clip."""
    reader = ClipFrameReader(mode="sideways")
    with pytest.raises(UsageError, match="unknown temporal mode 'sideways'"):
        reader(clips["mp4"], (32, 32), 5)
    with pytest.raises(UsageError, match="unknown ClipFrameReader option"):
        ClipFrameReader(fps=16)
    with pytest.raises(UsageError, match="window 9 does not exist: this clip has 2 windows"):
        sample_times(60, 24.0, 17, target_fps=16, mode="slide", window=9)


def test_clip_problems_is_vectorised_and_names_each_reason() -> None:
    w = np.array([64, 9000, 10, 64, 64, 64, 64, 600])
    h = np.array([48, 100, 48, 48, 48, 48, 48, 400])
    frames = np.array([100, 100, 100, 100, 10**6, 9, 0, 1])
    fps = np.array([24.0, 24, 24, 5000, 24, 8, 24, 0])  # the last row: an image
    got = clip_problems(w, h, frames, fps, target_frames=17, target_fps=16.0).tolist()
    assert got == [None, "too_large: 9000x100 has a side above max_side=8192",
                   "too_small: 10x48 has a side below min_side=16", "bad_fps: 5000 fps is outside 0.1..1000",
                   "too_long: 41666.7 s is above max_seconds=3600",
                   None,  # 9 frames at 8 fps span 1 s: 17 instants at 16 fps (each frame shown twice)
                   "no_video: zero frames", "too_short: 1 frames at 0 fps hold 1 at 16 fps, fewer than 17"]
    assert clip_problems(w, h, frames, fps).tolist()[5:] == [None, "no_video: zero frames", None]  # no length check
    one = (np.array([64]), np.array([48]), np.array([9]), np.array([8.0]))
    assert clip_problems(*one, target_frames=17, target_fps=8.0).tolist() == [
        "too_short: 9 frames at 8 fps hold 9 at 8 fps, fewer than 17"]
    assert clip_problems(*one, target_frames=17).tolist() == ["too_short: 9 frames at 8 fps hold 9, fewer than 17"]
    assert clip_problems(*one, target_frames=17, target_fps=8.0, loop=True).tolist() == [None]
    assert clip_problems(*one, target_frames=np.array([9]), mode="uniform").tolist() == [None]


# ------------------------------------------------------------------------------------------- pure functions
@settings(max_examples=200, deadline=None)
@given(frames=st.integers(1, 600), fps=st.sampled_from([8.0, 23.976, 24.0, 25.0, 29.97, 30.0, 60.0]),
       target=st.integers(1, 97), target_fps=st.sampled_from([None, 8.0, 16.0, 24.0, 30.0]),
       mode=st.sampled_from(["head", "random", "uniform", "slide"]), seed=st.integers(0, 2**31),
       epoch=st.integers(0, 9), row=st.integers(0, 10**6), stride=st.sampled_from([None, 1, 4, 17]),
       loop=st.booleans())
def test_sampled_frames_count_order_range_and_spacing(frames: int, fps: float, target: int, target_fps: float | None,
                                                      mode: str, seed: int, epoch: int, row: int, stride: int | None,
                                                      loop: bool) -> None:
    held = int(held_frames(frames, fps, target_fps))
    fits = frames >= target if mode == "uniform" else held >= target
    window = int(slide_rows(np.array([frames]), np.array([fps]), target, target_fps, stride).counts[0]) // 2
    kw = dict(target_fps=target_fps, mode=mode, seed=seed, epoch=epoch, row=row, window=window, stride=stride)
    if not fits and not loop:
        with pytest.raises(ValueError, match="skip it"):
            sample_times(frames, fps, target, **kw)
        return
    times = sample_times(frames, fps, target, **kw, loop=loop)
    idx = frame_indices(frames, fps, times)
    assert times.shape == idx.shape == (target,)  # count
    assert idx.min() >= 0 and idx.max() < frames  # within range
    assert np.array_equal(times, sample_times(frames, fps, target, **kw, loop=loop))  # a pure function
    if not fits:  # looped from the start, at the target rate
        period = frames / fps
        assert np.all((times >= 0) & (times < period + 1e-9))
        return
    assert np.all(np.diff(times) > 0) and np.all(np.diff(idx) >= 0)  # monotonic
    assert times[0] >= 0 and times[-1] <= (frames - 1) / fps + 1e-9
    if mode == "uniform":
        assert idx[0] == 0 and (target == 1 or idx[-1] == frames - 1)  # end to end
        assert np.all(np.diff(idx) >= 1)  # distinct frames
        return
    rate = fps if target_fps is None else target_fps
    assert np.allclose(np.diff(times), 1 / rate)  # fps spacing
    assert np.all(np.abs(idx - times * fps) <= 0.5 + 1e-6)  # each the nearest frame
    if mode == "head":
        assert times[0] == 0
    if mode == "random" and (target_fps is None or fps / target_fps == round(fps / target_fps)):
        plan = frame_plan(frames, fps, target, FrameRule("any", max(1, target - 1)), seed=seed, epoch=epoch, row=row,
                          target_fps=target_fps, mode="random")  # the existing draw, kept
        if plan.count == target:
            assert np.array_equal(idx, plan.indices())


@settings(max_examples=100, deadline=None)
@given(frames=st.lists(st.integers(0, 400), min_size=0, max_size=30), target=st.integers(1, 40),
       target_fps=st.sampled_from([None, 8.0, 16.0]), stride=st.sampled_from([None, 1, 3, 20]), loop=st.booleans())
def test_slide_rows_expand_each_clip_into_its_windows(frames: list[int], target: int, target_fps: float | None,
                                                      stride: int | None, loop: bool) -> None:
    n = np.array(frames, np.int64)
    fps = np.full(n.shape, 24.0)
    out = slide_rows(n, fps, target, target_fps, stride, loop)
    want_rows, want_windows = [], []
    step = 24.0 / (target_fps or 24.0)  # source frames per target frame
    apart = max(1, int(np.ceil((stride or target) * step - 0.5 - 1e-6)))  # window starts, in source frames
    for r, f in enumerate(frames):  # the obvious loop: every start `apart` frames on whose window ends in the clip
        held = int(held_frames(f, 24.0, target_fps))
        count = 0
        while held >= target and count * apart + (target - 1) * step <= f - 1 + 1e-6:
            count += 1
        count = count or int(loop and f > 0)
        want_rows += [r] * count
        want_windows += list(range(count))
        for w in {0, count - 1} if count else ():  # the first and last windows are valid ones for sample_times
            times = sample_times(f, 24.0, target, target_fps=target_fps, mode="slide", window=w, stride=stride,
                                 loop=loop)
            assert times.shape == (target,)
            if held >= target:
                assert times[-1] <= (f - 1) / 24.0 + 1e-9
    assert out.rows.tolist() == want_rows and out.windows.tolist() == want_windows
    assert out.clips + out.short == len(frames) and out.summary().startswith(f"slide: {out.clips} clips -> "
                                                                             f"{len(want_rows)} rows")


@settings(max_examples=100, deadline=None)
@given(ft=st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=40, unique=True),
       t=st.lists(st.floats(-5, 110, allow_nan=False), min_size=1, max_size=20))
def test_nearest_frames_is_the_argmin_of_the_distance(ft: list[float], t: list[float]) -> None:
    frames = np.sort(np.array(ft))
    got = nearest_frames(frames, np.array(t))
    dist = np.abs(frames[None, :] - np.array(t)[:, None])
    best = dist.min(axis=1)
    assert np.all(dist[np.arange(len(t)), got] <= best + 1e-6)  # the nearest (ties within TIE_S: either)
    assert np.all(np.diff(got[np.argsort(t, kind="stable")]) >= 0)


def test_random_windows_draw_from_the_frames_stream() -> None:
    """mode='random' draws its start from row_rng(seed, epoch, row, ROW_FRAMES), as frame_plan does: the same start
    for consecutive frames, and every epoch another window of a long clip."""
    starts = {float(sample_times(300, 30.0, 17, target_fps=15.0, mode="random", seed=3, epoch=e, row=7)[0])
              for e in range(100)}
    assert len(starts) > 50 and max(starts) <= (299 - 32) / 30 + 1e-9
    a = sample_times(200, 16.0, 17, mode="random", seed=3, epoch=0, row=7)
    assert np.array_equal(frame_indices(200, 16.0, a), frame_plan(200, 16.0, 17, "wan", seed=3, epoch=0, row=7)
                          .indices())


def test_decoder_refuses_bad_times(clips: dict[str, Path]) -> None:
    with pytest.raises(UsageError, match="times must be seconds >= 0"):
        decode_frames(clips["mp4"], np.array([-1.0]), (32, 32))
    with pytest.raises(BadClip, match="unreadable"):
        decode_frames(io.BytesIO(b""), np.array([0.0]), (32, 32))
