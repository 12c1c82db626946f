"""Header-only clip metadata: displayed size, rotation, frame count, fps, duration and codec, no frame decoded.

:func:`clip_metadata` opens a clip with PyAV's demuxer (``av.open``: FFmpeg reads the container's header, the MP4
``moov`` box or the Matroska/WebM segment info and track entries) and reads the video stream's parameters. FFmpeg's
stream probe reads the first packet but, told so by :data:`PROBE_OPTIONS`, decodes nothing (by default it decodes the
first frame to learn the pixel format, which costs as much as decoding it). The reader was chosen by measurement
(``benchmarks/bench_video_meta.py``, docs/video.md): PyAV is one wheel with its own FFmpeg (no system library), reads
every container FFmpeg knows, and its header read is many times faster than decoding the first frame; torchcodec's
wheel needs a CUDA torch and system FFmpeg libraries, and a hand-written box parser would cover MP4 and WebM only.

The size is the *displayed* size, as :func:`hf_arb.images.sizes.read_image_size` honours EXIF orientation: a clip
whose display matrix rotates it by 90 or 270 degrees (phones record portrait video as landscape frames with such a
matrix) has its width and height swapped. FFmpeg exposes the display matrix of a stream as side data that PyAV 18
writes (``VideoStream.set_display_rotation``) but reads only from decoded frames (``VideoFrame.rotation``); the
header-only read takes it from FFmpeg's own stream summary (``Container.dumps_format``: ``Display Matrix: rotation of
-90.00 degrees``), with the legacy ``rotate`` stream tag as a fallback.

A container that stores no frame count (WebM, Matroska) gets ``round(duration * fps)`` and ``frames_exact=False``.
An image (JPEG, PNG, WebP, BMP, TIFF, GIF) is a 1-frame clip with ``fps = 0``, sized by its EXIF-aware header.
Anything unreadable raises :class:`ClipMetadataError` naming the source and a short, stable reason.
"""

from __future__ import annotations

import io
import os
import re
import threading
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, BinaryIO, NamedTuple, Union

from hf_arb.images.sizes import ImageSizeError, open_and_read, read_image_size

ClipSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO, Mapping[str, Any]]

#: leading bytes of still-image formats: such a value is a 1-frame clip sized by its (EXIF-aware) header
IMAGE_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*")

_ROTATION = re.compile(r"Display Matrix: rotation of (-?\d+(?:\.\d+)?) degrees")
_STREAM = re.compile(r"^\s*Stream #\d+:(\d+)", re.MULTILINE)
#: what FFmpeg's stream probe (``avformat_find_stream_info``, run by ``av.open``) is told so that it decodes no frame:
#: its probing decoder skips every frame, runs on one thread, and is given a pixel format, since without one it decodes
#: the first frame to learn it (H.264, VP9: 10-40 ms for a 720p clip). The pixel format is not reported.
PROBE_OPTIONS = {"skip_frame": "all", "threads": "1", "pixel_format": "yuv420p"}
_LOG_LOCK = threading.Lock()  # av.logging's level is process-wide: one summary read at a time


class ClipMetadataError(ValueError):
    """A clip's metadata could not be read from its header.

    Attributes:
        source: a short description of the input (a path, ``"<bytes: 123>"``, ``"<file object>"``).
        reason: a short, stable reason (``"file not found"``, ``"empty (0 bytes)"``, ``"no video stream (audio
            only)"``, ``"zero frames"``, ``"truncated or corrupt container"``, ...); :func:`clip_columns
            <hf_arb.video.arrow_batch.clip_columns>` writes it to ``skip_reason`` as ``"unreadable: <reason>"``.
    """

    def __init__(self, source: str, reason: str, detail: str = "") -> None:
        self.source, self.reason, self.detail = source, reason, detail
        super().__init__(f"Cannot read the clip metadata of {source}: {reason}" + (f" ({detail})" if detail else "")
                         + ".")


class ClipMetadata(NamedTuple):
    """What a clip's header says (a named tuple: ``width, height, rotation, frames, ...``).

    Attributes:
        width, height: the displayed size in pixels (swapped for a 90/270 degree display rotation).
        rotation: the display rotation in degrees, counter-clockwise as FFmpeg reports it (0, 90, 180 or -90, ...).
        frames: the number of frames: the container's count, or ``round(duration * fps)`` (see ``frames_exact``).
        frames_exact: whether ``frames`` is the container's own count (MP4) rather than derived from the duration.
        fps: the average frame rate (0.0 for an image).
        duration: seconds (0.0 for an image).
        codec: the video codec's FFmpeg name (``"h264"``, ``"vp9"``, ...; ``"image"`` for a still image).
    """

    width: int
    height: int
    rotation: int
    frames: int
    frames_exact: bool
    fps: float
    duration: float
    codec: str

    @property
    def is_image(self) -> bool:
        """True for a still image (a 1-frame clip with fps 0)."""
        return self.codec == "image"


def _describe(src: Any) -> str:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return f"<bytes: {len(src)}>"
    if isinstance(src, (str, os.PathLike)):
        return repr(os.fspath(src))
    return getattr(src, "name", None) and repr(src.name) or f"<{type(src).__name__}>"


def _is_image(head: bytes) -> bool:
    return head.startswith(IMAGE_SIGNATURES) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def _image(fp: BinaryIO, source: str) -> ClipMetadata:
    try:
        w, h = read_image_size(fp)
    except ImageSizeError as e:
        raise ClipMetadataError(source, e.reason, e.detail) from e
    return ClipMetadata(w, h, 0, 1, True, 0.0, 0.0, "image")


def rotation_of(container: Any, stream: Any) -> int:
    """The display rotation of ``stream`` in degrees (counter-clockwise), read from the header only.

    Args:
        container: an open ``av`` input container.
        stream: one of its video streams.

    Returns:
        The rotation rounded to an int (``0`` when the stream has no display matrix nor ``rotate`` tag).
    """
    import av.logging

    with _LOG_LOCK:
        level = av.logging.get_level()
        av.logging.set_level(av.logging.INFO)  # dumps_format captures FFmpeg's INFO lines; nothing is printed
        try:
            text = container.dumps_format()
        finally:
            av.logging.set_level(level)
    starts = [(m.start(), int(m.group(1))) for m in _STREAM.finditer(text)]
    for k, (pos, index) in enumerate(starts):
        if index == stream.index:
            end = starts[k + 1][0] if k + 1 < len(starts) else len(text)
            if found := _ROTATION.search(text, pos, end):
                return round(float(found.group(1)))
    try:
        return round(float(stream.metadata.get("rotate", 0)))  # the tag older muxers wrote
    except (TypeError, ValueError):
        return 0


def _seconds(stream: Any, container: Any) -> float:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    tag = stream.metadata.get("DURATION") or stream.metadata.get("duration")  # Matroska's per-track tag
    if tag:
        try:
            h, m, s = tag.split(":")
            return int(h) * 3600 + int(m) * 60 + float(s)
        except ValueError:
            pass
    if container.duration is not None:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return 0.0


def _video(fp: Any, source: str) -> ClipMetadata:
    try:
        import av
    except ImportError as e:
        raise ImportError("Reading clips needs PyAV: pip install 'hf_arb[video]' (or pip install av).") from e

    try:
        container = av.open(fp, mode="r", options=PROBE_OPTIONS)
    except av.FFmpegError as e:
        raise ClipMetadataError(source, "truncated or corrupt container", f"{type(e).__name__}: {e}"[:160]) from e
    with container:
        streams = [s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic]
        if not streams:
            reason = "no video stream (audio only)" if container.streams.audio else "no video stream"
            raise ClipMetadataError(source, reason)
        stream = streams[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if not width or not height:
            raise ClipMetadataError(source, "zero-sized video", f"header says {width}x{height}")
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate or Fraction(0)
        fps = float(rate)
        duration = _seconds(stream, container)
        frames, exact = int(stream.frames or 0), bool(stream.frames)
        if not frames:
            frames = round(duration * fps)
        if frames <= 0:
            raise ClipMetadataError(source, "zero frames", f"duration {duration:g} s at {fps:g} fps")
        rotation = rotation_of(container, stream)
        codec = stream.codec_context.name
    if rotation % 180:
        width, height = height, width
    return ClipMetadata(int(width), int(height), rotation, frames, exact, fps, duration, codec)


def metadata_of_open(fp: BinaryIO, source: str) -> ClipMetadata:
    """:func:`clip_metadata` of an open binary file object; ``source`` names it in error messages."""
    pos = fp.tell() if fp.seekable() else None
    head = fp.read(16)
    if not head:
        raise ClipMetadataError(source, "empty (0 bytes)")
    if pos is None:
        fp = io.BytesIO(head + fp.read())
    else:
        fp.seek(pos)
    try:
        return _image(fp, source) if _is_image(head) else _video(fp, source)
    finally:
        if pos is not None:
            try:
                fp.seek(pos)
            except (OSError, ValueError):
                pass


def _from_path(path: str, source: str | None = None) -> ClipMetadata:
    return open_and_read(path, source or repr(path), metadata_of_open, ClipMetadataError)


def clip_metadata(source: ClipSource) -> ClipMetadata:
    """Read a clip's displayed size, rotation, frame count, fps, duration and codec from its header, no frame decoded.

    Args:
        source: a path (``str`` or ``os.PathLike``; ``hf://`` and other fsspec URLs too), the encoded bytes, a binary
            file object (its position is restored), or a ``datasets.Video(decode=False)`` / ``Image(decode=False)``
            value ``{"bytes": ..., "path": ...}`` (bytes win when both are set). An image is a 1-frame clip.

    Returns:
        A :class:`ClipMetadata`.

    Raises:
        ClipMetadataError: a missing or empty file, a truncated or corrupt container, no video stream, zero frames;
            the message names the source and the reason.

    Example:
        ```py
        >>> from hf_arb.video import clip_metadata
        >>> clip_metadata("portrait_phone_clip.mp4")  # 1920x1080 frames, display matrix -90 degrees
        ClipMetadata(width=1080, height=1920, rotation=-90, frames=300, frames_exact=True, fps=30.0, ...)
        ```
    """
    if isinstance(source, Mapping):
        data, path = source.get("bytes"), source.get("path")
        if data is not None:
            return _from_bytes(data, f"<bytes: {len(data)}>" + (f" ({path!r})" if path else ""))
        if path:
            return _from_path(os.fspath(path))
        raise ClipMetadataError(f"<{type(source).__name__}>", "no bytes and no path", "the value is empty")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _from_bytes(source, _describe(source))
    if isinstance(source, (str, os.PathLike)):
        return _from_path(os.fspath(source))
    if hasattr(source, "read"):
        return metadata_of_open(source, _describe(source))  # type: ignore[arg-type]
    raise ClipMetadataError(_describe(source), "unsupported input type",
                            "pass a path, bytes, a binary file object or a {'bytes', 'path'} dict")


def _from_bytes(data: bytes | bytearray | memoryview, source: str) -> ClipMetadata:
    if len(data) == 0:
        raise ClipMetadataError(source, "empty (0 bytes)")
    return metadata_of_open(io.BytesIO(data), source)
