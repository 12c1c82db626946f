"""The bucket columns of clips: header metadata (:func:`hf_arb.video.clip_columns`) → (width, height, frames) buckets.

:func:`clip_bucket_columns` is the clip branch of :func:`hf_arb.annotate.arrow_batch.bucket_columns`, the one
Arrow-batch function every engine maps (``datasets``, Ray Data, Spark). For a clip set (``BucketSet.has_frames``) it
returns the :data:`~hf_arb.buckets.schema.BUCKET_COLUMNS` followed by the
:data:`~hf_arb.buckets.schema.CLIP_BUCKET_COLUMNS`:

- each clip's displayed size, frames and fps come from its container's header only (no frame decoded; rotation
  honoured); an image in the same column is a 1-frame clip at fps 0;
- the frame plan's stride: every ``frame_stride``-th frame trains, ``max(1, round(fps / target_fps))`` when the model's
  frame rate is given (1 otherwise), and the bucket's frame count is matched against the frames the clip holds at that
  stride (``(frames - 1) // stride + 1``), so the planned window always fits (:func:`hf_arb.video.frames.frame_plan`
  draws its start per epoch);
- a bad clip never raises: an unreadable one keeps the reason :func:`~hf_arb.video.clip_columns` gave it
  (``"unreadable: truncated or corrupt container"``, ``"missing"``), one shorter than the smallest frame bucket gets
  ``"too_few_frames: ..."`` (unless the set loops short clips), and the summary counts and names them.

:func:`image_clip_columns` appends the same columns to the bucket columns of images or sizes (1 frame each), so a clip
set annotates an image column or width/height columns with the schema it annotates clips with.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hf_arb.buckets.matching import SHORT_CLIP_REASON
from hf_arb.buckets.schema import clip_arrow_schema
from hf_arb.buckets.sets import BucketSet

from .core import annotate_sizes


def check_clip_set(buckets: BucketSet, video_column: str | None) -> None:
    """Refuse a video column with a set that has no frame axis, before any row is read.

    Raises:
        ValueError: naming the column and the sets that fit.
    """
    if video_column is not None and not buckets.has_frames:
        raise ValueError(f"video_column={video_column!r} needs a BucketSet with a frame axis, (width, height, frames) "
                         f"buckets; this one has (width, height) buckets only ({len(buckets)} of them). Build one with "
                         "BucketSet([(w, h, frames), ...]) or a video preset (e.g. BucketSet.preset('wan')), or "
                         "annotate images with image_column=...")


def strides(fps: np.ndarray, target_fps: float | None) -> np.ndarray:
    """The frame plan's stride of each clip, int64 of the shape of ``fps``: ``max(1, round(fps / target_fps))``, 1 for
    an image (fps 0) or when ``target_fps`` is None (as :func:`hf_arb.video.frames.frame_plan`)."""
    fps = np.asarray(fps, np.float64)
    if target_fps is None:
        return np.ones(fps.shape, np.int64)
    if not target_fps > 0:
        raise ValueError(f"`target_fps` must be > 0 frames per second (e.g. 16 for Wan), got {target_fps!r}.")
    with np.errstate(invalid="ignore"):
        s = np.rint(np.where(fps > 0, fps, 0.0) / target_fps)  # numpy rounds half to even, as Python's round
    return np.maximum(s, 1).astype(np.int64)


def clip_bucket_columns(meta: pa.Table, buckets: BucketSet, *, target_fps: float | None = None,
                        max_upscale: float | None = None, min_size: int | None = None) -> pa.Table:
    """The bucket columns of clips from their metadata columns, vectorised.

    Args:
        meta: :func:`hf_arb.video.clip_columns`' columns (``original_width``, ``original_height``,
            ``original_frames``, ``original_fps``, ``frames_exact``, ``skip_reason``), one row per clip.
        buckets: a clip set (``(width, height, frames)`` buckets).
        target_fps: the model's frame rate (16 for Wan); the stride and the frames a clip holds follow from it.
        max_upscale, min_size: as in :func:`hf_arb.add_bucket_columns`.

    Returns:
        A table of :func:`~hf_arb.buckets.schema.clip_arrow_schema`, one row per clip, in order.
    """
    check_clip_set(buckets, "video")
    frames = pc.fill_null(meta.column("original_frames"), 0).to_numpy().astype(np.int64)  # (n,)
    fps = pc.fill_null(pc.cast(meta.column("original_fps"), pa.float64()), 0.0).to_numpy()  # (n,)
    read = pc.is_null(meta.column("skip_reason")).to_numpy(zero_copy_only=False)  # (n,) header read
    stride = strides(fps, target_fps)  # (n,)
    held = np.where(frames >= 1, (frames - 1) // stride + 1, 0)  # (n,) frames at the stride
    reasons = np.asarray(meta.column("skip_reason").to_pylist(), dtype=object)  # (n,) few distinct, None when read
    short = read & buckets.too_short(held)  # (n,)
    if short.any():
        least = int(buckets.frame_counts[0])
        for i in np.flatnonzero(short).tolist():
            at = f" ({held[i]} at every {stride[i]}th frame)" if stride[i] > 1 else ""
            reasons[i] = f"{SHORT_CLIP_REASON}: {frames[i]} frames{at}, fewer than the smallest frame bucket's {least}"
    w = pc.cast(meta.column("original_width"), pa.float64()).to_numpy(zero_copy_only=False)  # (n,) NaN unread
    h = pc.cast(meta.column("original_height"), pa.float64()).to_numpy(zero_copy_only=False)
    base = annotate_sizes(w, h, buckets, reasons=reasons.tolist(), frames=np.maximum(held, 1),
                          max_upscale=max_upscale, min_size=min_size)
    return _append(base, buckets, frames, fps, meta.column("frames_exact"), stride, read)


def image_clip_columns(base: pa.Table, buckets: BucketSet) -> pa.Table:
    """The bucket columns of images (or sizes) annotated with a clip set, with the clip columns appended: 1 frame at
    fps 0 each, stride 1."""
    n = base.num_rows
    read = pc.is_valid(base.column("original_width")).to_numpy(zero_copy_only=False)  # (n,)
    return _append(base, buckets, np.ones(n, np.int64), np.zeros(n), pa.array(np.ones(n, bool)),
                   np.ones(n, np.int64), read)


def _append(base: pa.Table, buckets: BucketSet, frames: np.ndarray, fps: np.ndarray, exact: Any, stride: np.ndarray,
            read: np.ndarray) -> pa.Table:
    ids = pc.fill_null(base.column("bucket"), -1).to_numpy().astype(np.int64)  # (n,)
    kept = ids >= 0
    bucket_frames = buckets.resolutions[np.where(kept, ids, 0), 2]  # (n,)
    arrays = [*base.columns,
              pa.array(bucket_frames.astype(np.int32), pa.int32(), mask=~kept),
              pa.array(frames.astype(np.int32), pa.int32(), mask=~read),
              pa.array(fps.astype(np.float32), pa.float32(), mask=~read),
              pc.if_else(pa.array(read), pc.cast(exact, pa.bool_()), pa.scalar(None, pa.bool_())),
              pa.array(stride.astype(np.int32), pa.int32(), mask=~read)]
    return pa.Table.from_arrays(arrays, schema=clip_arrow_schema())


def detect_video_column(features: Any, column_names: Any, image_column: str | None) -> str | None:
    """The clip column of a dataset when none is named: its one ``datasets.Video`` column, else a column named
    ``video``; None when ``image_column`` is a column (an image dataset) or there is no such column."""
    names = list(column_names or [])
    if image_column is not None and image_column in names:
        return None
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        return None
    videos = [k for k, v in (features or {}).items() if isinstance(v, datasets.Video)]
    if len(videos) == 1:
        return videos[0]
    return "video" if "video" in names else None


__all__ = ["check_clip_set", "clip_bucket_columns", "detect_video_column", "image_clip_columns", "strides"]
