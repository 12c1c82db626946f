"""Validation videos: a video family's validation sample (what its pipeline returns in ``.frames``) written as an
MP4 per prompt and bucket, drawn as a frame strip for the grid PNG, and logged to the trackers.

Decided by the sample, never by a family's name: :meth:`hf_arb.families.Family.generate` returns a PIL image for an
image pipeline (``.images``) and the frames for a video pipeline (``.frames``: a list of PIL frames, or an ``(F, H, W,
3)`` array in ``[0, 1]`` for ``output_type="np"``). Every video family (Wan, and any adapter whose pipeline returns
``.frames``) gets the same MP4s, strips and tracker entries.

MP4s are H.264 (``yuv420p``; ``yuv444p`` where a side is odd) written with PyAV, whose wheel ships its own FFmpeg, so
no ``imageio-ffmpeg`` binary is needed. TensorBoard gets ``add_video`` where ``moviepy`` is installed (torch's
``SummaryWriter.add_video`` needs it to encode the GIF), otherwise each video's frame strip with ``add_image``; wandb
gets ``wandb.Video`` of the MP4.
"""

from __future__ import annotations

import logging
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("train_text_to_image_arb")

#: frames per second of a validation MP4 when neither ``--target_fps`` nor the family's ``video_fps`` says
DEFAULT_FPS = 16.0


def is_video(sample: Any) -> bool:
    """A video sample: a list/tuple of frames, or an ``(F, H, W, C)`` array/tensor (an image is a PIL image)."""
    if isinstance(sample, (list, tuple)):
        return True
    return getattr(sample, "ndim", 0) == 4


def video_array(sample: Any) -> np.ndarray:
    """The frames of a video sample as ``uint8`` ``(F, H, W, 3)``: PIL frames, or floats in ``[0, 1]`` (diffusers'
    ``output_type="np"``), or ``uint8`` already."""
    if isinstance(sample, (list, tuple)):
        arr = np.stack([np.asarray(f.convert("RGB")) if hasattr(f, "convert") else np.asarray(f) for f in sample])
    else:
        arr = np.asarray(sample.detach().float().cpu() if hasattr(sample, "detach") else sample)
    if arr.ndim != 4 or arr.shape[-1] not in (1, 3):
        raise ValueError(f"A video sample must be frames (F, H, W, 3), got shape {arr.shape}.")
    if arr.dtype != np.uint8:
        arr = (np.clip(arr.astype(np.float32), 0.0, 1.0) * 255).round().astype(np.uint8)
    return np.repeat(arr, 3, axis=-1) if arr.shape[-1] == 1 else arr


def frame_strip(frames: np.ndarray) -> Any:
    """The frames ``(F, H, W, 3)`` side by side as one PIL image ``(F * W, H)``."""
    from PIL import Image

    f, h, w, c = frames.shape
    return Image.fromarray(np.ascontiguousarray(frames.transpose(1, 0, 2, 3).reshape(h, f * w, c)))


def write_mp4(path: str | Path, frames: np.ndarray, fps: float) -> Path:
    """Write ``uint8`` frames ``(F, H, W, 3)`` as an H.264 MP4 at ``fps`` with PyAV; returns the path."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    f, h, w, _ = frames.shape
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = w, h
        stream.pix_fmt = "yuv420p" if w % 2 == 0 and h % 2 == 0 else "yuv444p"  # 4:2:0 needs even sides
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def video_name(prompt_index: int, shape: tuple[int, ...], image_index: int, count: int) -> str:
    """``prompt-0-64x96x9.mp4`` (``-1``, ``-2``, … after the shape with several videos per prompt and shape)."""
    label = "x".join(str(int(v)) for v in shape)
    return f"prompt-{prompt_index}-{label}" + (f"-{image_index}" if count > 1 else "") + ".mp4"


def save_videos(rows: list[list[Any]], shapes: list[tuple[int, ...]], count: int, folder: Path,
                fps: float) -> tuple[list[list[Any]], list[tuple[Path, np.ndarray]]]:
    """Write each video sample of ``rows`` (one row per prompt, ``count`` samples per shape) as an MP4 in ``folder``;
    return the rows with each video replaced by its frame strip (for the grid) and each MP4's path and frames."""
    strips, videos = [], []
    for i, row in enumerate(rows):
        out = []
        for n, sample in enumerate(row):
            if is_video(sample):
                frames = video_array(sample)
                path = write_mp4(folder / video_name(i, shapes[n // count], n % count, count), frames, fps)
                videos.append((path, frames))
                sample = frame_strip(frames)
            out.append(sample)
        strips.append(out)
    return strips, videos


def log_videos(trackers: Any, videos: list[tuple[Path, np.ndarray]], step: int, fps: float) -> None:
    """Each validation MP4 to the trackers: TensorBoard ``validation_video/<name>`` (``add_video`` with moviepy,
    else the frame strip with ``add_image``), wandb ``validation_video`` (``wandb.Video``)."""
    if not videos:
        return
    import importlib.util

    for tracker in trackers:
        if tracker.name == "tensorboard":
            video = importlib.util.find_spec("moviepy") is not None
            for path, frames in videos:
                tag = f"validation_video/{path.stem}"
                if video:  # (N, T, C, H, W) uint8
                    tracker.writer.add_video(tag, frames.transpose(0, 3, 1, 2)[None], step, fps=int(round(fps)))
                else:
                    tracker.writer.add_image(tag, np.asarray(frame_strip(frames)), step, dataformats="HWC")
        elif tracker.name == "wandb":
            import wandb

            tracker.log({"validation_video": [wandb.Video(str(p), caption=p.stem) for p, _ in videos]})


def read_mp4(path: str | Path) -> np.ndarray:
    """Every frame of a video file as ``uint8`` ``(F, H, W, 3)`` (PyAV)."""
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


__all__ = ["DEFAULT_FPS", "frame_strip", "is_video", "log_videos", "read_mp4", "save_videos", "video_array",
           "video_name", "write_mp4"]
