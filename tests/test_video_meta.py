"""Header-only clip metadata, the clip columns of an Arrow batch, and the video VAEs' frame rules (issue 37, first
slice), on real clips encoded here with PyAV from a real photo with motion: H.264 in MP4 and VP9 in WebM, one rotated
by a display matrix, odd frame counts, a truncated and a corrupt file, an audio-only file and images mixed in."""

from __future__ import annotations

import inspect
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from _photos import encode, photo, save_photo
from hypothesis import given, settings
from hypothesis import strategies as st

av = pytest.importorskip("av")

from hf_arb.checks import UsageError  # noqa: E402
from hf_arb.testing.clips import panning_frames, write_clip  # noqa: E402
from hf_arb.video import (  # noqa: E402
    CLIP_COLUMNS,
    FRAME_RULES,
    ClipMetadataError,
    clip_columns,
    clip_metadata,
    frame_plan,
    held_frames,
    skip_counts,
    valid_frame_counts,
)


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> file: 64x48 clips panning across the astronaut photo at 8 fps."""
    d = tmp_path_factory.mktemp("clips")
    frames = panning_frames(np.asarray(photo("astronaut.png")), 17)
    out = {
        "mp4_9": d / "h264_9.mp4", "webm_11": d / "vp9_11.webm", "mp4_rot_17": d / "h264_rot.mp4",
        "webm_rot_13": d / "vp9_rot.webm", "mp4_10": d / "h264_10.mp4",
    }
    write_clip(out["mp4_9"], frames[:9])
    write_clip(out["webm_11"], frames[:11])
    write_clip(out["mp4_rot_17"], frames, rotation=-90, faststart=True)  # a phone's portrait clip
    write_clip(out["webm_rot_13"], frames[:13], rotation=90)
    write_clip(out["mp4_10"], frames[:10], fps=24)
    data = out["mp4_9"].read_bytes()
    (d / "truncated.mp4").write_bytes(data[: len(data) // 2])  # moov at the end: the header itself is cut
    (d / "garbage.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom" + bytes(range(256)) * 4)
    out["truncated"], out["garbage"] = d / "truncated.mp4", d / "garbage.mp4"
    out["jpeg_rot"] = save_photo(d / "rot.jpg", "rocket.jpg", "JPEG", orientation=6, size=(64, 48))
    return out


def _decoded(path: Path) -> tuple[int, int, int, int]:
    """Ground truth by decoding every frame: (displayed width, height, frames, rotation)."""
    with av.open(str(path)) as c:
        frames = list(c.decode(video=0))
    rot = frames[0].rotation
    w, h = frames[0].width, frames[0].height
    return (h, w, len(frames), rot) if rot % 180 else (w, h, len(frames), rot)


@pytest.mark.parametrize("name, codec, exact", [
    ("mp4_9", "h264", True), ("webm_11", "vp9", False), ("mp4_rot_17", "h264", True), ("webm_rot_13", "vp9", False),
    ("mp4_10", "h264", True),
])
def test_header_metadata_matches_decoding_every_frame(clips: dict[str, Path], name: str, codec: str,
                                                      exact: bool) -> None:
    m = clip_metadata(clips[name])
    assert (m.width, m.height, m.frames, m.rotation) == _decoded(clips[name])
    assert (m.codec, m.frames_exact) == (codec, exact)  # WebM stores no count: duration x fps, and says so
    fps = 24 if name == "mp4_10" else 8
    assert m.fps == fps and m.duration == pytest.approx(m.frames / fps, abs=1e-3)


def test_rotation_gives_the_displayed_size(clips: dict[str, Path]) -> None:
    assert clip_metadata(clips["mp4_rot_17"])[:3] == (48, 64, -90)  # stored 64x48, shown portrait
    assert clip_metadata(clips["webm_rot_13"])[:3] == (48, 64, 90)
    assert clip_metadata(clips["mp4_9"])[:3] == (64, 48, 0)


def test_no_frame_is_decoded(clips: dict[str, Path]) -> None:
    """A faststart MP4 cut right after its header still gives its metadata (nothing past the header is read), while
    decoding it fails: the reader never decodes, and (as for images without --verify) cannot see a cut
    body."""
    data = clips["mp4_rot_17"].read_bytes()
    header_only = data[: data.index(b"mdat") + 8]
    assert clip_metadata(header_only)[:4] == (48, 64, -90, 17)
    with av.open(io.BytesIO(header_only)) as c, pytest.raises(av.FFmpegError):
        next(c.decode(video=0))  # the media data is gone: a decoder fails


def test_inputs_bytes_file_objects_and_dicts(clips: dict[str, Path]) -> None:
    path = clips["webm_11"]
    want = clip_metadata(path)
    with open(path, "rb") as f:
        f.read(3)
        f.seek(0)
        assert clip_metadata(f) == want and f.tell() == 0
    assert clip_metadata(path.read_bytes()) == clip_metadata(str(path)) == want
    assert clip_metadata({"bytes": path.read_bytes(), "path": "x.webm"}) == clip_metadata({"path": str(path)}) == want


def test_images_are_one_frame_clips_with_exif_orientation(clips: dict[str, Path]) -> None:
    m = clip_metadata(clips["jpeg_rot"])
    assert (m.width, m.height, m.frames, m.fps, m.is_image) == (48, 64, 1, 0.0, True)
    assert clip_metadata(encode(photo("coffee.png"), "PNG"))[:4] == (600, 400, 0, 1)


@pytest.mark.parametrize("name, reason", [
    ("truncated", "truncated or corrupt container"), ("garbage", "truncated or corrupt container"),
])
def test_broken_clips_raise_a_named_reason(clips: dict[str, Path], name: str, reason: str) -> None:
    with pytest.raises(ClipMetadataError) as e:
        clip_metadata(clips[name])
    assert e.value.reason == reason and name in str(e.value)


def _audio_only() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        s = out.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for p in [*s.encode(frame), *s.encode()]:
            out.mux(p)
    return buf.getvalue()


def test_clip_columns_counts_bad_clips_and_reads_images_as_one_frame(clips: dict[str, Path]) -> None:
    """A column of paths and one of datasets.Video storage (struct<bytes, path>), images mixed in: every good row
    read, every bad one named and counted, none raising."""
    import datasets

    paths = [str(clips[k]) for k in ("mp4_9", "webm_rot_13", "truncated", "garbage", "jpeg_rot")]
    paths += [None, str(clips["mp4_9"].parent / "missing.mp4")]
    png = encode(photo("coffee.png", (32, 24)), "PNG")
    video = pa.array([{"bytes": clips["mp4_10"].read_bytes(), "path": "a.mp4"}, {"bytes": None, "path": paths[1]},
                      {"bytes": png, "path": None}, {"bytes": _audio_only(), "path": "song.mp4"},
                      {"bytes": b"", "path": None}, None, {"bytes": None, "path": paths[2]}],
                     datasets.Video(decode=False).pa_type)
    table = pa.table({"path": paths, "video": video, "caption": list("abcdefg")})
    by_path = clip_columns(table, "path")
    assert by_path.column_names == ["path", "video", "caption", *CLIP_COLUMNS]
    got = by_path.select(["original_width", "original_height", "original_frames", "original_fps"]).to_pylist()
    assert [tuple(r.values()) for r in got] == [(64, 48, 9, 8.0), (48, 64, 13, 8.0), *[(None,) * 4] * 2,
                                                (48, 64, 1, 0.0), *[(None,) * 4] * 2]
    assert by_path.column("frames_exact").to_pylist() == [True, False, None, None, True, None, None]
    assert skip_counts(by_path) == {"unreadable: truncated or corrupt container": 2, "missing": 1,
                                    "unreadable: file not found": 1}
    batch = clip_columns(table.to_batches()[0], "video")  # a RecordBatch in, a RecordBatch out
    assert isinstance(batch, pa.RecordBatch)
    assert batch.column("original_frames").to_pylist() == [10, 13, 1, None, None, None, None]
    assert batch.column("original_fps").to_pylist() == [24.0, 8.0, 0.0, None, None, None, None]
    assert skip_counts(batch) == {"unreadable: no video stream (audio only)": 1, "unreadable: empty (0 bytes)": 1,
                                  "missing": 1, "unreadable: truncated or corrupt container": 1}
    again = clip_columns(batch, "video")  # the clip columns are replaced, not duplicated
    assert again.schema == batch.schema and again.to_pylist() == batch.to_pylist()
    with pytest.raises(ValueError, match="'clip' is not in the batch"):
        clip_columns(table, "clip")


def test_without_pyav_a_column_fails_once_naming_the_extra(clips: dict[str, Path],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """No PyAV: one ImportError naming the fix, not every row quietly skipped as unreadable."""
    import sys

    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'hf_arb\[video\]'"):
        clip_columns(pa.table({"video": [str(clips["mp4_9"])]}), "video")
    assert clip_metadata(clips["jpeg_rot"]).frames == 1  # images need no PyAV


# ------------------------------------------------------------------------------------------- frame rules
def _pipeline_steps() -> dict[str, int]:
    """Each video pipeline's temporal VAE factor as the pipeline itself states it (components None: its default)."""
    import diffusers

    out = {}
    for name in ("WanPipeline", "LTXPipeline", "LTX2Pipeline", "HunyuanVideoPipeline", "CogVideoXPipeline"):
        cls = getattr(diffusers, name)
        required = {p: None for p, v in inspect.signature(cls.__init__).parameters.items()
                    if p != "self" and v.default is inspect.Parameter.empty}
        pipe = cls(**required)
        out[name] = getattr(pipe, "vae_scale_factor_temporal", None) or pipe.vae_temporal_compression_ratio
    # HunyuanVideo15Pipeline's __init__ reads vae.config even without a VAE: take its VAE class's default instead
    vae = inspect.signature(diffusers.AutoencoderKLHunyuanVideo15.__init__).parameters
    out["HunyuanVideo15Pipeline"] = vae["temporal_compression_ratio"].default
    return out


def _default_frames(name: str) -> int:
    import diffusers

    default = inspect.signature(getattr(diffusers, name).__call__).parameters["num_frames"].default
    if name == "CogVideoXPipeline":  # num_frames=None: the transformer's sample_frames
        default = inspect.signature(diffusers.CogVideoXTransformer3DModel.__init__).parameters["sample_frames"].default
    return default


def test_frame_rules_are_the_pipelines_own() -> None:
    steps = _pipeline_steps()
    assert steps == {p: r.step for r in FRAME_RULES.values() for p in r.pipelines}
    assert {FRAME_RULES["wan"].step, FRAME_RULES["hunyuan_video"].step, FRAME_RULES["cogvideox"].step} == {4}
    assert FRAME_RULES["ltx"].step == 8
    for rule in FRAME_RULES.values():
        for name in rule.pipelines:
            if name == "LTX2Pipeline":  # num_frames=None: a duration it predicts
                continue
            frames = _default_frames(name)
            assert rule.is_valid(frames), (name, frames)
            assert rule.latent_frames(frames) == (frames - 1) // steps[name] + 1
    wan = FRAME_RULES["wan"]  # Wan's __call__ keeps num_frames iff num_frames % step == 1
    assert [n for n in range(1, 40) if wan.is_valid(n)] == [n for n in range(1, 40) if n % steps["WanPipeline"] == 1]


def test_valid_frame_counts() -> None:
    assert valid_frame_counts("wan", 17).tolist() == [1, 5, 9, 13, 17]
    assert valid_frame_counts("ltx", 24).tolist() == [1, 9, 17]
    assert valid_frame_counts("wan", 0).tolist() == []
    with pytest.raises(UsageError, match="unknown frame rule 'sora'"):
        valid_frame_counts("sora", 9)


def test_frame_plan_refuses_what_the_rule_forbids() -> None:
    with pytest.raises(UsageError, match="16 frames do not fit the wan rule .4k\\+1 frames.: use 13 or 17"):
        frame_plan(100, 30, 16, "wan")
    with pytest.raises(UsageError, match="nothing to train on"):
        frame_plan(0, 30, 17, "wan")
    with pytest.raises(UsageError, match="target_fps must be > 0"):
        frame_plan(100, 30, 17, "wan", target_fps=0)
    assert frame_plan(1, 0.0, 81, "wan", target_fps=16) == (0, 0.0, 1)  # an image: one frame
    plan = frame_plan(100, 30, 17, "wan", target_fps=16, mode="head")  # 30 fps -> 16 fps: 1.875 frames apart
    assert plan == (0, 1.875, 17) and plan.indices().tolist()[:6] == [0, 2, 4, 6, 7, 9]


@settings(max_examples=200, deadline=None)
@given(frames=st.integers(1, 400), fps=st.sampled_from([0.0, 8.0, 24.0, 29.97, 30.0, 60.0]),
       k=st.integers(0, 30), rule=st.sampled_from(sorted(FRAME_RULES)),
       target_fps=st.sampled_from([None, 8.0, 16.0, 24.0]), seed=st.integers(0, 2**31), epoch=st.integers(0, 50),
       row=st.integers(0, 10**6), mode=st.sampled_from(["head", "random"]))
def test_frame_plan_window_is_valid_inside_and_deterministic(frames: int, fps: float, k: int, rule: str,
                                                             target_fps: float | None, seed: int, epoch: int,
                                                             row: int, mode: str) -> None:
    r = FRAME_RULES[rule]
    target = r.step * k + 1
    plan = frame_plan(frames, fps, target, rule, seed=seed, epoch=epoch, row=row, target_fps=target_fps, mode=mode)
    assert plan.count in valid_frame_counts(rule, target)
    idx = plan.indices()
    assert idx.min() == plan.start >= 0 and idx.max() < frames
    gaps = np.diff(idx)  # the nearest frames to positions `stride` apart: floor or ceil of it
    assert np.all((gaps >= np.floor(plan.stride)) & (gaps <= np.ceil(plan.stride)))
    held = int(held_frames(frames, fps, target_fps))  # frames at the target rate: the one rule's count
    if held >= target:
        assert plan.count == target  # the bucket's count whenever the clip holds it
    else:
        assert plan.count + r.step > held  # else the longest the rule allows
    if mode == "head":
        assert plan.start == 0
    assert plan == frame_plan(frames, fps, target, rule, seed=seed, epoch=epoch, row=row, target_fps=target_fps,
                              mode=mode)


def test_random_windows_cover_the_clip_across_epochs() -> None:
    starts = {frame_plan(200, 16, 17, "wan", seed=3, epoch=e, row=7).start for e in range(200)}
    assert min(starts) < 10 and 200 - 17 - 10 < max(starts) <= 200 - 17 and len(starts) > 100  # uniform over 0..183
    assert frame_plan(200, 16, 17, "wan", seed=3, epoch=0, row=7) != frame_plan(200, 16, 17, "wan", seed=3, epoch=0,
                                                                               row=8)
