"""Tiny real video clips, encoded locally with PyAV, for tests, benchmarks and docs (no download).

:func:`panning_frames` makes motion from one photo (a window sliding across it); :func:`write_clip` encodes frames
as H.264 in MP4 or VP9 in WebM (or any codec and container PyAV's FFmpeg has), optionally with a display matrix
(``VideoStream.set_display_rotation``) as phones write for portrait video, and optionally with the MP4 header first
(``movflags=faststart``), as web video is served.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

__all__ = ["CODECS", "panning_frames", "write_clip"]

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


def write_clip(dest: str | os.PathLike[str] | None, frames: np.ndarray, fps: int = 8, *, suffix: str = ".mp4",
               rotation: float | None = None, faststart: bool = False) -> bytes:
    """Encode ``frames`` (uint8 ``(F, H, W, 3)``, H and W even) at ``fps``; write them to ``dest`` (when given) and
    return the bytes.

    Args:
        dest: a file to write (its suffix picks the codec unless ``suffix`` is given), or None.
        frames: the RGB frames.
        fps: the frame rate.
        suffix: ``.mp4`` (H.264), ``.webm`` (VP9) or ``.mkv`` (H.264 in Matroska), used when ``dest`` is None.
        rotation: a display rotation in degrees, counter-clockwise (``set_display_rotation``); None writes none.
        faststart: MP4 only: the ``moov`` header before the media data (needs ``dest``: FFmpeg rewrites the file).
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
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    if faststart:
        return Path(dest).read_bytes()
    data = buf.getvalue()
    if dest is not None:
        Path(dest).write_bytes(data)
    return data
