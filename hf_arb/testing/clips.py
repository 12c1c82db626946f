"""Tiny real video clips, encoded locally with PyAV, for tests, benchmarks and docs (no download).

:func:`panning_frames` makes motion from one photo (a window sliding across it); :func:`write_clip` encodes frames
as H.264 in MP4 or VP9 in WebM (or any codec and container PyAV's FFmpeg has), optionally with a display matrix
(``VideoStream.set_display_rotation``) as phones write for portrait video, and optionally with the MP4 header first
(``movflags=faststart``), as web video is served, optionally at a variable frame rate (each frame's time given, as
phones record in low light) or with a chosen keyframe interval.

Damaged and odd clips for the bad-clip paths: :func:`cut_clip` (an interrupted download), :func:`flip_bytes` (bit rot
in the media data), :func:`audio_only_clip` (a soundtrack saved as a video) and :func:`empty_video_clip` (a video track
that holds no frame).
"""

from __future__ import annotations

import io
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CODECS", "audio_only_clip", "cut_clip", "empty_video_clip", "flip_bytes", "mux_silence", "panning_frames",
           "save_mixed_clip_folder", "write_clip"]

#: (codec, container format) by file suffix
CODECS = {".mp4": ("libx264", "mp4"), ".webm": ("libvpx-vp9", "webm"), ".mkv": ("libx264", "matroska")}


def panning_frames(photo: np.ndarray, frames: int, width: int = 64, height: int = 48) -> np.ndarray:
    """``frames`` crops of ``photo`` (H, W, 3 uint8) sliding left to right then down: uint8 ``(frames, height, width,
    3)``, real image content with motion. The photo must be at least ``width + frames`` wide and ``height`` tall."""
    h, w = photo.shape[:2]
    dx = max(1, (w - width) // max(1, frames))
    out = np.empty((frames, height, width, 3), np.uint8)
    for i in range(frames):
        x, y = (i * dx) % (w - width + 1), (i * dx // 3) % (h - height + 1)
        out[i] = photo[y:y + height, x:x + width, :3]
    return out


def save_mixed_clip_folder(folder: str | os.PathLike[str], photo: np.ndarray) -> str:
    """A folder of clips and stills, as the video families train on: 4 MP4 clips of 13 frames and 4 WebM clips of 9
    (64x48, a window panning across ``photo``, uint8 ``(H, W, 3)`` at least 80 wide and 48 tall) and 4 PNG stills
    (frames of the same pan). Returns the folder as a string (``--train_data_dir``)."""
    from PIL import Image

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    frames = panning_frames(photo, 17)  # (17, 48, 64, 3)
    for i in range(4):
        write_clip(out / f"pan{i}.mp4", frames[i:i + 13])
        write_clip(out / f"pan{i}.webm", frames[i:i + 9], suffix=".webm")
        Image.fromarray(frames[4 * i]).save(out / f"still{i}.png")
    return str(out)


def write_clip(dest: str | os.PathLike[str] | None, frames: np.ndarray, fps: int = 8, *, suffix: str = ".mp4",
               rotation: float | None = None, faststart: bool = False, times: np.ndarray | None = None,
               gop: int | None = None) -> bytes:
    """Encode ``frames`` (uint8 ``(F, H, W, 3)``, H and W even) at ``fps``; write them to ``dest`` (when given) and
    return the bytes.

    Args:
        dest: a file to write (its suffix picks the codec unless ``suffix`` is given), or None.
        frames: the RGB frames.
        fps: the frame rate.
        suffix: ``.mp4`` (H.264), ``.webm`` (VP9) or ``.mkv`` (H.264 in Matroska), used when ``dest`` is None.
        rotation: a display rotation in degrees, counter-clockwise (``set_display_rotation``); None writes none.
        faststart: MP4 only: the ``moov`` header before the media data (needs ``dest``: FFmpeg rewrites the file).
        times: seconds, shape ``(F,)``, increasing: each frame's presentation time (a variable frame rate, written
            in milliseconds); None: ``i / fps``.
        gop: a keyframe every ``gop`` frames exactly (None: the encoder's default: x264 up to 250 apart, and at scene
            cuts; VP9 128).
    """
    import av

    if dest is not None:
        suffix = Path(dest).suffix
    codec, fmt = CODECS[suffix]
    if faststart and dest is None:
        raise ValueError("faststart rewrites the file in a second pass: pass a `dest` path.")
    buf = io.BytesIO()
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(os.fspath(dest) if faststart else buf, "w", format=fmt, options=options) as out:
        exact_gop = {"sc_threshold": "0"} if gop is not None and codec == "libx264" else {}  # no extra scene cuts
        stream = out.add_stream(codec, rate=fps, options=exact_gop)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        if rotation is not None:
            stream.set_display_rotation(rotation)
        if gop is not None:
            stream.codec_context.gop_size = gop
        if times is not None:
            if len(times) != len(frames) or np.any(np.diff(times) <= 0):
                raise ValueError("`times` needs one increasing time per frame.")
            stream.time_base = stream.codec_context.time_base = Fraction(1, 1000)
        for i, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
            if times is not None:
                frame.pts, frame.time_base = round(float(times[i]) * 1000), Fraction(1, 1000)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    if faststart:
        return Path(dest).read_bytes()
    data = buf.getvalue()
    if dest is not None:
        Path(dest).write_bytes(data)
    return data


def cut_clip(data: bytes, keep: float) -> bytes:
    """The first ``keep`` fraction of an encoded clip, as an interrupted download leaves it."""
    return data[: int(len(data) * keep)]


def flip_bytes(data: bytes, count: int = 200, seed: int = 0, after: bytes = b"mdat") -> bytes:
    """``data`` with ``count`` bytes inverted at random places between the first ``after`` marker (MP4's media data)
    and the ``moov`` header after it if any, so the header stays readable, as bit rot leaves a file."""
    out = bytearray(data)
    start = data.index(after) + 64 if after in data else len(data) // 4
    end = data.find(b"moov", start)
    for i in np.random.default_rng(seed).integers(start, end if end > start else len(data), count):
        out[i] ^= 0xFF
    return bytes(out)


def audio_only_clip(seconds: float = 1.0, fmt: str = "mp4") -> bytes:
    """An MP4 (or another container) holding one silent AAC track and no video: a soundtrack saved as a clip."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream("aac", rate=8000)
        mux_silence(out, stream, seconds)
    return buf.getvalue()


def mux_silence(out: Any, stream: Any, seconds: float) -> None:
    """Encode ``seconds`` of mono silence at 8 kHz into the audio ``stream`` of the open container ``out``."""
    import av

    for i in range(max(1, int(seconds * 8000 / 1024))):
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 8000, i * 1024
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)


def empty_video_clip(seconds: float = 2.0, width: int = 64, height: int = 48, fps: int = 8) -> bytes:
    """A Matroska file whose H.264 video track holds no frame, beside a silent audio track: its header reads (the
    duration is the audio's, so it claims ``seconds * fps`` frames) but no frame decodes."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        video = out.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = out.add_stream("aac", rate=8000)
        out.start_encoding()
        mux_silence(out, audio, seconds)
    return buf.getvalue()
