"""The bucket columns of clips: header metadata (:func:`hf_arb.video.clip_columns`) → (width, height, frames) buckets.

:func:`clip_bucket_columns` is the clip branch of :func:`hf_arb.annotate.arrow_batch.bucket_columns`, the one
Arrow-batch function every engine maps (``datasets``, Ray Data, Spark). For a clip set (``BucketSet.has_frames``) it
returns the :data:`~hf_arb.buckets.schema.BUCKET_COLUMNS` followed by the
:data:`~hf_arb.buckets.schema.CLIP_BUCKET_COLUMNS`:

- each clip's displayed size, frames and fps come from its container's header only (no frame decoded; rotation
  honoured); an image in the same column is a 1-frame clip at fps 0;
- the frame plan (:func:`hf_arb.video.temporal.plan_frames`, the one rule training and decoding follow): the stride
  ``frame_stride`` is ``fps / target_fps`` source frames per trained frame (1 without a target rate), and the
  bucket's frame count is matched against the frames the clip holds at the target rate
  (:func:`~hf_arb.video.temporal.held_frames`; all its frames for ``frame_sampling="uniform"``), so the planned window
  always fits and decoding returns exactly ``bucket_frames`` frames;
- ``frame_sampling="slide"``: :func:`slide_windows` turns each kept clip into one row per window of its bucket's
  frame count, each with its own ``frame_start`` (the other columns repeated); the summary counts the added rows;
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
from hf_arb.video.temporal import TEMPORAL_MODES, frame_steps, held_frames, slide_counts, slide_strides

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
    """The frame plan's stride of each clip, float64 of the shape of ``fps``: ``fps / target_fps`` source frames per
    trained frame, 1 for an image (fps 0) or when ``target_fps`` is None (:func:`~hf_arb.video.temporal.frame_steps`,
    the rule :func:`~hf_arb.video.temporal.plan_frames` plans with)."""
    if target_fps is not None and not target_fps > 0:
        raise ValueError(f"`target_fps` must be > 0 frames per second (e.g. 16 for Wan), got {target_fps!r}.")
    return frame_steps(fps, target_fps)


def check_frame_sampling(frame_sampling: str | None, slide_stride: int | None) -> None:
    """Refuse an unknown sampling mode, or a slide stride without ``slide``, naming the fix."""
    if frame_sampling is not None and frame_sampling not in TEMPORAL_MODES:
        raise ValueError(f"frame_sampling={frame_sampling!r}: use one of {list(TEMPORAL_MODES)}.")
    if slide_stride is not None and frame_sampling != "slide":
        raise ValueError(f"slide_stride={slide_stride} applies to frame_sampling='slide' (one row per window); pass "
                         "frame_sampling='slide' or drop slide_stride.")
    if slide_stride is not None and not (isinstance(slide_stride, (int, np.integer)) and slide_stride >= 1):
        raise ValueError(f"slide_stride must be a positive number of target frames, got {slide_stride!r}.")


def clip_bucket_columns(meta: pa.Table, buckets: BucketSet, *, target_fps: float | None = None,
                        max_upscale: float | None = None, min_size: int | None = None,
                        frame_sampling: str | None = None) -> pa.Table:
    """The bucket columns of clips from their metadata columns, vectorised.

    Args:
        meta: :func:`hf_arb.video.clip_columns`' columns (``original_width``, ``original_height``,
            ``original_frames``, ``original_fps``, ``frames_exact``, ``skip_reason``), one row per clip.
        buckets: a clip set (``(width, height, frames)`` buckets).
        target_fps: the model's frame rate (16 for Wan); the stride and the frames a clip holds follow from it.
        max_upscale, min_size: as in :func:`hf_arb.add_bucket_columns`.
        frame_sampling: the temporal mode the clips will train with: ``"uniform"`` matches a clip's own frame count
            (it spreads the bucket's frames over the whole clip), the others (default) the frames it holds at
            ``target_fps``.

    Returns:
        A table of :func:`~hf_arb.buckets.schema.clip_arrow_schema`, one row per clip, in order (``frame_start``
        null: :func:`slide_windows` sets it).
    """
    check_clip_set(buckets, "video")
    check_frame_sampling(frame_sampling, None)
    frames = pc.fill_null(meta.column("original_frames"), 0).to_numpy().astype(np.int64)  # (n,)
    fps = pc.fill_null(pc.cast(meta.column("original_fps"), pa.float64()), 0.0).to_numpy()  # (n,)
    read = pc.is_null(meta.column("skip_reason")).to_numpy(zero_copy_only=False)  # (n,) header read
    stride = strides(fps, target_fps)  # (n,)
    held = frames if frame_sampling == "uniform" else held_frames(frames, fps, target_fps)  # (n,) the one rule
    reasons = np.asarray(meta.column("skip_reason").to_pylist(), dtype=object)  # (n,) few distinct, None when read
    short = read & buckets.too_short(held)  # (n,)
    if short.any():
        least = int(buckets.frame_counts[0])
        for i in np.flatnonzero(short).tolist():
            at = f" ({held[i]} at {target_fps:g} fps)" if target_fps is not None and fps[i] > 0 else ""
            reasons[i] = f"{SHORT_CLIP_REASON}: {frames[i]} frames{at}, fewer than the smallest frame bucket's {least}"
    w = pc.cast(meta.column("original_width"), pa.float64()).to_numpy(zero_copy_only=False)  # (n,) NaN unread
    h = pc.cast(meta.column("original_height"), pa.float64()).to_numpy(zero_copy_only=False)
    base = annotate_sizes(w, h, buckets, reasons=reasons.tolist(), frames=np.maximum(held, 1),
                          max_upscale=max_upscale, min_size=min_size)
    return _append(base, buckets, frames, fps, meta.column("frames_exact"), stride, read)


def slide_windows(table: pa.Table, buckets: BucketSet, *, target_fps: float | None = None,
                  slide_stride: int | None = None) -> pa.Table:
    """``frame_sampling="slide"``: each kept clip of an annotated table once per window, vectorised.

    A clip of bucket frame count ``F`` gets the windows :func:`~hf_arb.video.temporal.slide_rows` lists (``F`` frames,
    ``slide_stride`` target frames apart, default ``F``: windows that do not overlap), each a row with every column of
    the clip's row and its own ``frame_start`` (the window's first source frame; the plan is ``(frame_start,
    frame_stride, bucket_frames)``). A clip looped into its bucket (``short_clips="loop"``) is one window; stills and
    skipped rows stay one row with ``frame_start`` null. Rows keep their order (a clip's windows in a run).

    Args:
        table: an annotated table (the input columns and the clip bucket columns, one row per clip).
        buckets: the clip set it was annotated with.
        target_fps: the annotation's target frame rate.
        slide_stride: target frames between window starts (default: the bucket's frame count).

    Returns:
        The expanded table (same schema); :func:`slide_counts_of` counts its clips and windows.
    """
    check_frame_sampling("slide", slide_stride)
    ids = pc.fill_null(table.column("bucket"), -1).to_numpy().astype(np.int64)  # (n,)
    frames = pc.fill_null(table.column("original_frames"), 0).to_numpy().astype(np.int64)  # (n,)
    fps = pc.fill_null(pc.cast(table.column("original_fps"), pa.float64()), 0.0).to_numpy()  # (n,)
    target = pc.fill_null(table.column("bucket_frames"), 0).to_numpy().astype(np.int64)  # (n,)
    clip = (ids >= 0) & (fps > 0)  # (n,) stills and skipped rows stay one row
    counts = np.ones(ids.shape, np.int64)  # (n,)
    step = np.zeros(ids.shape, np.int64)  # (n,) source frames between window starts
    loop = buckets.short_clips == "loop"
    for f in np.unique(target[clip]).tolist():  # few distinct frame counts: each one vectorised
        rows = np.flatnonzero(clip & (target == f))
        counts[rows] = slide_counts(frames[rows], fps[rows], int(f), target_fps, slide_stride, loop)
        step[rows] = slide_strides(fps[rows], int(f), target_fps, slide_stride)
    take = np.repeat(np.arange(ids.size, dtype=np.int64), counts)  # (m,)
    window = np.arange(take.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)  # (m,)
    out = table.take(pa.array(take))
    start = pa.array((window * step[take]).astype(np.int32), pa.int32(), mask=~clip[take])
    return out.set_column(out.column_names.index("frame_start"), out.schema.field("frame_start"), start)


def slide_counts_of(frame_start: Any) -> tuple[int, int] | None:
    """``(clips, windows)`` of an annotated ``frame_start`` column: the rows with a start, and those at window 0 (each
    clip's first); None when no row has one (the dataset was not annotated with ``slide``)."""
    col = frame_start if isinstance(frame_start, (pa.Array, pa.ChunkedArray)) else pa.array(frame_start, pa.int64())
    windows = len(col) - col.null_count
    if windows == 0:
        return None
    return int(pc.sum(pc.equal(col, 0)).as_py() or 0), int(windows)


def image_clip_columns(base: pa.Table, buckets: BucketSet) -> pa.Table:
    """The bucket columns of images (or sizes) annotated with a clip set, with the clip columns appended: 1 frame at
    fps 0 each, stride 1, no window start."""
    n = base.num_rows
    read = pc.is_valid(base.column("original_width")).to_numpy(zero_copy_only=False)  # (n,)
    return _append(base, buckets, np.ones(n, np.int64), np.zeros(n), pa.array(np.ones(n, bool)),
                   np.ones(n, np.float64), read)


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
              pa.array(stride.astype(np.float64), pa.float64(), mask=~read),
              pa.nulls(len(ids), pa.int32())]
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


__all__ = ["check_clip_set", "check_frame_sampling", "clip_bucket_columns", "detect_video_column",
           "image_clip_columns", "slide_counts_of", "slide_windows", "strides"]
