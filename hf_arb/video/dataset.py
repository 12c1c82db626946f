""":class:`BucketedClipDataset`: the rows of a clip dataset annotated with (width, height, frames) buckets, fitted to
each batch's bucket. A still (``original_fps`` 0) goes through the image path (:class:`hf_arb.BucketedImageDataset`);
a clip decodes only its planned frames (:func:`~hf_arb.video.decode.read_clip`) at the bucket's size and frame count,
one crop for every frame. A bad clip is a bad row as a bad image is: replaced by another row of its bucket, counted
and named (:mod:`hf_arb.images.bad_images`), never ending the run."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hf_arb.checks import UsageError
from hf_arb.images.dataset import BucketedImageDataset, ImageDecodeError
from hf_arb.images.fitting import to_tensor
from hf_arb.rng import ROW_FLIP, row_rng

from .decode import ClipFrames, read_clip
from .temporal import FramePlan, plan_frames


@dataclass(frozen=True)
class ClipPlan:
    """A clip row's geometry and frame plan: :meth:`key` is the fit plan's key plus the frame plan, a complete
    latent-cache key with the clip's content (``--cache_latents``).

    Attributes:
        fit: the :class:`~hf_arb.images.geometry.FitPlan` every frame is fitted with (one crop per clip).
        frames: ``(start, stride, count)`` of the planned source frames (stride 0 for one frame).
        indices: a digest of every planned source frame index (variable strides, uniform spacing, loops).
    """

    fit: Any
    frames: tuple[int, int, int]
    indices: str

    def key(self) -> tuple[Any, ...]:
        return (*self.fit.key(), "frames", *self.frames, self.indices)


def window_starts(ds: Any) -> np.ndarray:
    """int64 ``(n,)``: each row's annotated ``frame_start`` (a ``slide`` window's first source frame), ``-1`` where
    the row has none (the run's ``--frame_sampling`` plans it) or the dataset has no such column."""
    if "frame_start" not in ds.column_names:
        return np.full(len(ds), -1, np.int64)
    col = ds.select_columns(["frame_start"]).with_format("arrow")[:].column(0)
    return np.asarray(col.fill_null(-1).to_numpy(), np.int64)


class BucketedClipDataset(BucketedImageDataset):
    """Clips and stills of an annotated clip dataset, one sample per ``(row, bucket, epoch)`` key.

    ``pixel_values`` is ``(3, F, H, W)`` float32 in [-1, 1] for a bucket of ``F > 1`` frames, ``(3, H, W)`` for a
    1-frame bucket (a still, or a clip's one frame), so a batch is ``(B, C, F, H, W)`` clips or ``(B, C, H, W)``
    stills, never both (a batch is one bucket). Each sample carries ``kind`` (``"clips"`` or ``"stills"``).

    Args:
        ds: a dataset annotated with a clip set (:func:`hf_arb.add_bucket_columns` with ``video_column``): its
            ``original_fps`` tells stills (0) from clips.
        buckets: the clip set (``(k, 3)`` resolutions).
        video_column: the clip column (paths, bytes, ``{"bytes", "path"}`` or a ``datasets.Video`` feature).
        target_fps, mode, loop: :func:`read_clip`'s (the run's ``--target_fps``, ``--frame_sampling``,
            ``--short_clips loop``). A row annotated with a ``slide`` window (``frame_start``) trains that window.
        **kwargs: :class:`~hf_arb.BucketedImageDataset`'s (seed, crops, flips, filter, bad-row policy and log).
    """

    def __init__(self, ds: Any, buckets: Any, *, video_column: str, target_fps: float | None = None,
                 mode: str = "head", loop: bool = False, **kwargs: Any) -> None:
        import datasets

        feature = ds.features.get(video_column)
        if isinstance(feature, datasets.Video) and feature.decode:  # raw {"bytes", "path"}: PyAV reads them
            ds = ds.cast_column(video_column, datasets.Video(decode=False))
        super().__init__(ds, buckets, image_column=video_column, **kwargs)
        if self.resolutions.shape[1] != 3:
            raise ValueError("BucketedClipDataset needs (width, height, frames) buckets; use BucketedImageDataset for "
                             "(width, height) ones.")
        cols = ds.select_columns(["original_fps", "original_frames"]).with_format("numpy")[:]
        self._fps = np.nan_to_num(np.asarray(cols["original_fps"], dtype=np.float64))  # (n,) 0: a still
        self._frames = np.nan_to_num(np.asarray(cols["original_frames"], dtype=np.float64)).astype(np.int64)  # (n,)
        self._still = ~(self._fps > 0)  # (n,)
        self._start = window_starts(ds)  # (n,) an annotated slide row's first source frame, -1 elsewhere
        self.target_fps, self.mode, self.loop = target_fps, mode, loop

    def frame_plan(self, row: int, bucket: int, epoch: int) -> FramePlan:
        """The row's :class:`~hf_arb.video.temporal.FramePlan` in ``bucket`` and ``epoch``, from its annotated columns
        (``original_frames``, ``original_fps``, and a slide row's ``frame_start``) by the one rule
        (:func:`~hf_arb.video.temporal.plan_frames`): the cache key and the decoder use this very plan."""
        start = int(self._start[row])
        return plan_frames(int(self._frames[row]), float(self._fps[row]), self.frames(bucket),
                           target_fps=self.target_fps, mode=self.mode, seed=self.seed, epoch=epoch, row=row,
                           loop=self.loop, start=start if start >= 0 else None)

    def resolution(self, bucket: int) -> tuple[int, int]:
        """``(width, height)`` of bucket ``bucket``."""
        w, h = self.resolution_row(bucket)[:2]
        return (int(w), int(h))

    def resolution_row(self, bucket: int) -> tuple[int, ...]:
        b = int(bucket)
        if not (0 <= b < len(self.resolutions)) or (self.resolutions[b] <= 0).any():
            raise ValueError(f"Bucket {b} is not in this dataset's bucket table ({len(self.resolutions)} entries). "
                             "Pass the BucketSet the dataset was annotated with as `buckets=`.")
        return tuple(int(v) for v in self.resolutions[b])

    def frames(self, bucket: int) -> int:
        """The frame count of bucket ``bucket``."""
        return self.resolution_row(bucket)[2]

    def fit_row(self, row: int, bucket: int | None = None, epoch: int | None = None,
                size: Sequence[int] | None = None) -> Any:
        """A still's :class:`~hf_arb.images.geometry.FitPlan`; a clip's :class:`ClipPlan` (the same crop and flip,
        drawn from the same streams as :func:`read_clip`'s, plus the planned frames), without opening the file."""
        plan = super().fit_row(row, bucket, epoch, size)
        row = int(row)
        if self._still[row]:
            return plan
        b = int(self._bucket[row]) if bucket is None else int(bucket)
        e = self.epoch if epoch is None else int(epoch)
        idx = self.frame_plan(row, b, e).indices(int(self._frames[row]))  # (F,) source frames
        stride = int(idx[1] - idx[0]) if len(idx) > 1 else 0
        digest = hashlib.sha256(idx.astype(np.int64).tobytes()).hexdigest()[:16]
        return ClipPlan(plan, (int(idx[0]), stride, len(idx)), digest)

    def _render(self, row: int, bucket: int, epoch: int) -> tuple[Any, Any, dict[str, Any]]:
        if self._still[row]:
            return super()._render(row, bucket, epoch)
        record = self._view[row]
        source = record[self.image_column]
        flip = self.random_flip and bool(row_rng(self.seed, epoch, row, ROW_FLIP).random() < 0.5)
        try:
            plan = self.frame_plan(row, bucket, epoch)  # a stale annotation (ValueError) is a bad row
            clip = read_clip(source, self.resolution(bucket), self.frames(bucket), target_fps=self.target_fps,
                             mode=self.mode, seed=self.seed, epoch=epoch, row=row, loop=self.loop,
                             crop="center" if self.center_crop else "random", flip=flip, resample=self.resample,
                             plan=plan)
        except (UsageError, ImportError):
            raise  # the run's mistake (an option, PyAV missing), not one clip's
        except Exception as e:  # noqa: BLE001 - a bad clip is a bad row: replaced, counted, named
            raise ImageDecodeError(f"Row {row}: cannot read the clip in column {self.image_column!r} from "
                                   f"{self._describe(row)}: {type(e).__name__}: {e}") from e
        return clip, clip, record

    def __getitem__(self, key: int | tuple[int, int, int]) -> dict[str, Any]:
        row, bucket, epoch = self._parse_key(key)
        frames = self.frames(bucket)
        image, plan, record, used = self._render_or_replace(row, bucket, epoch)
        if isinstance(image, ClipFrames):
            pixels = torch.from_numpy(np.ascontiguousarray(image.frames)).float().div_(127.5).sub_(1.0)  # (F, 3, H, W)
            pixels = pixels.permute(1, 0, 2, 3)  # (3, F, H, W): the layout the video VAEs encode
            geometry = (image.original_size, image.crop_top_left, image.flipped)
        else:
            pixels = to_tensor(image)[:, None]  # (3, 1, H, W)
            geometry = (plan.original_size, plan.crop_top_left, plan.flipped)
        if pixels.shape[1] != frames:
            raise ValueError(f"Row {used}: {pixels.shape[1]} frames for a bucket of {frames}; a still trains in a "
                             "1-frame bucket only.")
        w, h = self.resolution(bucket)
        return {"pixel_values": pixels[:, 0] if frames == 1 else pixels,  # (3, H, W) or (3, F, H, W) in [-1, 1]
                "original_size": tuple(geometry[0]), "crop_top_left": tuple(geometry[1]), "target_size": (h, w),
                "caption": self._caption(record, used, epoch), "row": used, "bucket": bucket, "epoch": epoch,
                "flipped": bool(geometry[2]), "kind": "stills" if frames == 1 else "clips"}

    @staticmethod
    def collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Stack samples of one bucket (:func:`~hf_arb.images.collate.collate_buckets`) and tag the batch's kind."""
        batch = BucketedImageDataset.collate(samples)
        batch["kind"] = samples[0]["kind"]  # one bucket: every sample is of one kind
        return batch


__all__ = ["BucketedClipDataset", "ClipPlan", "window_starts"]
