"""A torch dataset over an annotated ``datasets.Dataset`` that fits every image to its batch's bucket.

:class:`BucketedImageDataset` turns a row (or a ``(row, bucket, epoch)`` key from
``BucketBatchSampler(..., return_keys=True)``) into a sample; :func:`collate_buckets` stacks samples of
one bucket into the batch dict the training script consumes:

=================  =============================  ==========================================================
key                shape / type                   meaning
=================  =============================  ==========================================================
``pixel_values``   ``(B, 3, H, W)`` float32       the fitted images in [-1, 1]; ``(W, H)`` is the bucket
``original_sizes`` ``(B, 2)`` int64               ``(h, w)`` of each displayed source image (SDXL)
``crop_top_lefts`` ``(B, 2)`` int64               ``(y, x)`` of each crop in the scaled image (SDXL)
``target_sizes``   ``(B, 2)`` int64               ``(h, w)`` of the bucket (SDXL ``target_size``)
``input_ids``      ``(B, L)`` int64               token ids, only when a tokenizer is given
``input_ids_2``    ``(B, L)`` int64               second tokenizer's ids (SDXL), when two are given
``captions``       ``list[str]`` of length B      the captions used (always present)
``rows``           ``(B,)`` int64                 row indices into the wrapped dataset
``buckets``        ``(B,)`` int64                 bucket id the sample was fitted to
``flipped``        ``(B,)`` bool                  whether the sample was mirrored
=================  =============================  ==========================================================

Per-row randomness (crop offset, flip, choice among several captions) comes from
``numpy.random.default_rng(SeedSequence([seed, epoch, row, stream]))``: a resumed run, another worker
count or another rank reproduces the same crops. Nothing reads or writes a global RNG.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hf_arb.buckets.schema import read_resolutions
from hf_arb.buckets.sets import BucketSet
from hf_arb.rng import ROW_CROP, ROW_FLIP, ROW_REPLACE, row_rng

from .bad_images import BAD_IMAGE_POLICIES, BadImageLog, replacement_order
from .collate import choose_caption, collate_buckets
from .fitting import (
    FitPlan,
    describe_source,
    displayed_size,
    exif_orientation,
    open_image,
    plan_fit,
    render_plan,
    resample_filter,
    to_tensor,
)

__all__ = ["BucketedImageDataset", "ImageDecodeError", "collate_buckets", "row_rng"]

# Independent random streams per (seed, epoch, row): adding flips never changes the crops.


class ImageDecodeError(RuntimeError):
    """An image of the dataset could not be opened or decoded at training time."""


_ADVICE = ("Skip such rows up front: re-annotate with `hf-arb annotate SOURCE --verify --output-dir DIR` (or "
           "add_bucket_columns(ds, buckets, verify=True)) and train on it (--dataset_name DIR); or let training "
           "substitute a row of the same bucket: --on_bad_image replace (BucketedImageDataset's default, "
           "on_bad_image='replace').")
_MAX_REPLACEMENT_TRIES = 16
_EXTRAS = "__hf_arb_extras__"  # the record key that carries render_extras' output from _render to __getitem__


class _SizeMismatch(ValueError):
    """The image displays at another size than its annotation says (a stale annotation)."""


def _column_arrays(ds: Any, columns: Sequence[str]) -> dict[str, np.ndarray]:
    """Whole columns as numpy arrays, honouring an indices mapping (``select``/``shuffle``)."""
    if not columns:
        return {}
    view = ds.select_columns(list(columns)).with_format("numpy")
    batch = view[0 : len(ds)]
    return {c: np.asarray(batch[c]) for c in columns}


class BucketedImageDataset(torch.utils.data.Dataset):
    """Fit the images of an annotated ``datasets.Dataset`` to buckets, one sample per key.

    Args:
        ds: a ``datasets.Dataset`` annotated by :func:`hf_arb.add_bucket_columns` (columns ``bucket``,
            ``bucket_width``, ``bucket_height``, ``original_width``, ``original_height``) with an image
            column (``datasets.Image``, a path string, bytes or ``{"bytes", "path"}``) and a caption column.
        buckets: the ``BucketSet`` (or ``(k, 2)`` table) bucket ids refer to. ``None`` restores it from the
            dataset (:meth:`BucketSet.from_dataset`), falling back to the bucket size columns.
        image_column: image column name.
        caption_column: caption column (a string, a list of strings — one is drawn per epoch — or null,
            read as ``""``). ``None`` gives empty captions.
        tokenizer: a ``transformers`` tokenizer, or a sequence of them (SDXL: two → ``input_ids`` and
            ``input_ids_2``). Captions are padded / truncated to ``model_max_length``.
        seed: seed of the per-row randomness.
        center_crop: centre crops instead of random ones.
        random_flip: mirror each sample with probability 1/2 (decided per row and epoch).
        resample: Pillow filter name, see :func:`hf_arb.fit_to_bucket`.
        background: colour transparent pixels are composited over.
        draft, draft_gap: the JPEG decoder downscale, see :func:`hf_arb.fit_to_bucket`.
        bucket_column: column with the bucket id of each row.
        check_sizes: raise when an image's displayed size differs from its ``original_width`` /
            ``original_height`` columns (stale annotation), so :meth:`fit_row` always matches
            ``__getitem__``.
        on_bad_image: what a row whose image cannot be opened or decoded (or, with ``check_sizes``, displays at
            another size than annotated) does. ``"replace"`` (default, what the training script does): return a
            deterministic replacement row of the same bucket instead (see :mod:`hf_arb.images.bad_images`), count it in
            :attr:`bad_images` and log it once, so one body-truncated file that header-only annotation kept does not
            end the epoch. ``"error"``: raise :class:`ImageDecodeError` naming the row and file.
        bad_image_log: with ``"replace"``, a JSON-lines file each bad row is appended to (the training script uses
            ``<output_dir>/skipped_rows.jsonl``).

    Keys accepted by ``__getitem__``:
        * ``int`` row: fitted to the row's own ``bucket`` at the epoch set by :meth:`set_epoch`.
        * ``(row, bucket, epoch)``: fitted to ``bucket`` (the batch's target bucket, which may differ from
          the row's own under merging) with that epoch's randomness — what
          ``BucketBatchSampler(..., return_keys=True)`` yields. Prefer it with ``num_workers > 0``:
          workers hold copies of the dataset and never see a later ``set_epoch``.

    Example:
        ```py
        >>> from torch.utils.data import DataLoader
        >>> from hf_arb import BucketBatchSampler, BucketedImageDataset
        >>> data = BucketedImageDataset(annotated, random_flip=True, seed=0)
        >>> sampler = BucketBatchSampler(annotated, 8, seed=0, return_keys=True)
        >>> loader = DataLoader(data, batch_sampler=sampler, collate_fn=data.collate, num_workers=4)
        ```
    """

    def __init__(self, ds: Any, buckets: BucketSet | Sequence[Sequence[int]] | np.ndarray | None = None, *,
                 image_column: str = "image", caption_column: str | None = "text", tokenizer: Any = None,
                 seed: int = 0, center_crop: bool = False, random_flip: bool = False, resample: str = "lanczos",
                 background: Sequence[int] = (255, 255, 255), draft: bool = True, draft_gap: float | None = None,
                 bucket_column: str = "bucket", check_sizes: bool = True, on_bad_image: str = "replace",
                 bad_image_log: str | Any | None = None) -> None:
        import datasets

        if on_bad_image not in BAD_IMAGE_POLICIES:
            raise ValueError(f"`on_bad_image` must be one of {BAD_IMAGE_POLICIES}, got {on_bad_image!r}.")
        self.on_bad_image = on_bad_image
        self.bad_images = BadImageLog(bad_image_log)

        if not isinstance(ds, datasets.Dataset):
            raise TypeError(
                f"BucketedImageDataset wraps a map-style datasets.Dataset, got {type(ds).__name__}. "
                "Bucketed batches need random access: materialise an IterableDataset first."
            )
        for name, col in (("image_column", image_column), ("bucket_column", bucket_column),
                          ("caption_column", caption_column)):
            if col is not None and col not in ds.column_names:
                raise ValueError(f"`{name}`={col!r} is not a column of the dataset; columns are {ds.column_names}.")
        if int(seed) < 0:
            raise ValueError(f"`seed` must be a non-negative integer, got {seed!r}.")
        feature = ds.features[image_column]
        if isinstance(feature, datasets.Image) and feature.decode:
            # Raw {"bytes", "path"} cells: we decode ourselves (JPEG draft, EXIF in stored orientation).
            ds = ds.cast_column(image_column, datasets.Image(decode=False))
        self.resolutions = read_resolutions(ds, buckets, bucket_column)  # (k, 2) width, height
        size_cols = [c for c in ("original_width", "original_height") if c in ds.column_names]
        extra = [c for c in ("bucket_width", "bucket_height") if c in ds.column_names]
        cols = _column_arrays(ds, [bucket_column, *size_cols, *extra])
        self._bucket = cols[bucket_column].astype(np.int64)  # (n,)
        self._size = (
            np.nan_to_num(np.stack([cols["original_width"], cols["original_height"]],
                                   1)).astype(np.int32) if len(size_cols) == 2 else None
        )  # (n, 2) width, height or None
        if len(extra) == 2:
            self._check_table(np.nan_to_num(np.stack([cols["bucket_width"], cols["bucket_height"]],
                                                     1)).astype(np.int64))
        self._view = ds.select_columns([image_column] + ([caption_column] if caption_column else []))
        self._skip_reason = ds.select_columns(["skip_reason"]) if "skip_reason" in ds.column_names else None
        self.image_column = image_column
        self.caption_column = caption_column
        self.tokenizers: list[Any] = (
            [] if tokenizer is None else list(tokenizer) if isinstance(tokenizer, (list, tuple)) else [tokenizer]
        )
        self.seed = int(seed)
        self.center_crop = bool(center_crop)
        self.random_flip = bool(random_flip)
        self.resample = resample
        self.background = tuple(background)
        self.draft = bool(draft)
        self.draft_gap = None if draft_gap is None else float(draft_gap)
        self.check_sizes = bool(check_sizes)
        self.epoch = 0
        # Validate rendering options here, not in a worker on the first batch.
        filt = resample_filter(resample)
        if len(self.background) != 3 or not all(isinstance(c, (int,
                                                               np.integer)) and 0 <= c <= 255 for c in self.background):
            raise ValueError(f"`background` must be an (r, g, b) triple of 0–255 integers, got {background!r}.")
        if self.draft_gap is not None and not self.draft_gap >= 1.0:
            raise ValueError(f"`draft_gap` must be >= 1 or None, got {draft_gap!r}.")
        gap = "default" if self.draft_gap is None else f"{self.draft_gap:g}"
        self._render_id = (
            f"{filt.name.lower()};draft={'off' if not self.draft else gap};bg={','.join(map(str, self.background))}"
        )

    # ----------------------------------------------------------------------------- bookkeeping
    def _check_table(self, wh: np.ndarray) -> None:
        """All kept rows' bucket_width/height must match ``resolutions[bucket]`` (vectorised)."""
        kept = np.flatnonzero(self._bucket >= 0)
        ids = self._bucket[kept]
        bad = ids >= len(self.resolutions)
        if not bad.any():
            bad = (self.resolutions[ids, :2] != wh[kept]).any(axis=1)  # (k, 3) clip tables: their sizes
        if bad.any():
            r = int(kept[np.flatnonzero(bad)[0]])
            raise ValueError(
                f"Row {r} has bucket {int(self._bucket[r])} of size {tuple(wh[r].tolist())}, which does not match "
                f"the `buckets` passed ({len(self.resolutions)} buckets). The dataset was annotated with another "
                "BucketSet: pass that one, or `buckets=None` to restore it from the dataset."
            )

    def __len__(self) -> int:
        return int(self._bucket.shape[0])

    def set_epoch(self, epoch: int) -> None:
        """Epoch whose randomness integer keys use (tuple keys carry their own)."""
        if int(epoch) < 0:
            raise ValueError(f"`epoch` must be >= 0, got {epoch!r}.")
        self.epoch = int(epoch)

    @property
    def bucket_ids(self) -> np.ndarray:
        """Each row's own bucket id, shape ``(n,)``, ``-1`` = skipped at annotation."""
        return self._bucket

    def resolution(self, bucket: int) -> tuple[int, int]:
        """``(width, height)`` of bucket ``bucket``."""
        b = int(bucket)
        if not (0 <= b < len(self.resolutions)) or (self.resolutions[b] <= 0).any():
            raise ValueError(
                f"Bucket {b} is not in this dataset's bucket table ({len(self.resolutions)} entries). "
                "Pass the BucketSet the dataset was annotated with as `buckets=`."
            )
        w, h = self.resolutions[b].tolist()
        return (int(w), int(h))

    def _parse_key(self, key: Any) -> tuple[int, int, int]:
        if isinstance(key, (tuple, list)):
            if len(key) != 3:
                raise ValueError(f"A tuple key must be (row, bucket, epoch), got {key!r}.")
            row, bucket, epoch = (int(k) for k in key)
        else:
            row, bucket, epoch = int(key), -2, self.epoch
        n = len(self)
        if not 0 <= row < n:
            raise IndexError(f"Row {row} is out of range for a dataset of {n} rows.")
        if bucket == -2:
            bucket = int(self._bucket[row])
        if bucket < 0:
            reason = self._skip_reason[row]["skip_reason"] if self._skip_reason is not None else None
            raise ValueError(
                f"Row {row} has bucket -1: it was skipped at annotation ({reason or 'no reason recorded'}). "
                "Drive the DataLoader with BucketBatchSampler, which never yields skipped rows."
            )
        return row, bucket, epoch

    # ----------------------------------------------------------------------------- randomness
    def fit_row(self, row: int, bucket: int | None = None, epoch: int | None = None,
                size: Sequence[int] | None = None) -> FitPlan:
        """The crop/flip decision for a row, without opening the image.

        Uses the ``original_width`` / ``original_height`` columns (or ``size``). ``__getitem__`` renders
        exactly this plan, and ``plan.render`` names this dataset's filter / decoder / background options, so
        ``(image content, plan.key())`` is a complete latent-cache key.

        Args:
            row: row index.
            bucket: target bucket id; default the row's own.
            epoch: default the epoch set by :meth:`set_epoch`.
            size: displayed ``(width, height)``; default the annotation columns.
        """
        row = int(row)
        bucket = int(self._bucket[row]) if bucket is None else int(bucket)
        epoch = self.epoch if epoch is None else int(epoch)
        if size is None:
            if self._size is None:
                raise ValueError(
                    "fit_row needs the image size: the dataset has no original_width/original_height columns. "
                    "Annotate with hf_arb.add_bucket_columns or pass `size=(width, height)`."
                )
            size = (int(self._size[row, 0]), int(self._size[row, 1]))
        flip = self.random_flip and bool(row_rng(self.seed, epoch, row, ROW_FLIP).random() < 0.5)
        if self.center_crop:
            plan = plan_fit(size, self.resolution(bucket), crop="center", flip=flip)
        else:
            plan = plan_fit(size, self.resolution(bucket), crop="random", rng=row_rng(self.seed, epoch, row, ROW_CROP),
                            flip=flip)
        return dataclasses.replace(plan, render=self._render_id)

    def _caption(self, record: dict[str, Any], row: int, epoch: int) -> str:
        if not self.caption_column:
            return ""
        return choose_caption(record[self.caption_column], seed=self.seed, epoch=epoch, row=row,
                              column=self.caption_column)

    # ----------------------------------------------------------------------------- samples
    def _render(self, row: int, bucket: int, epoch: int) -> tuple[Any, FitPlan, dict[str, Any]]:
        """Open, check and fit one row; raises :class:`ImageDecodeError` (decode) or ``_SizeMismatch`` (size)."""
        record = self._view[row]
        source = record[self.image_column]
        try:
            im = open_image(source)
            orientation = exif_orientation(im)
            size = displayed_size(im, orientation)
        except Exception as e:  # noqa: BLE001 - any decoder failure becomes one clear error
            raise ImageDecodeError(
                f"Row {row}: cannot open the image in column {self.image_column!r} from {describe_source(source)}: "
                f"{type(e).__name__}: {e}. {_ADVICE}"
            ) from e
        if self.check_sizes and self._size is not None and tuple(self._size[row].tolist()) != size:
            raise _SizeMismatch(
                f"Row {row}: the image from {describe_source(source)} displays as {size[0]}x{size[1]} but the "
                f"annotation says {self._size[row, 0]}x{self._size[row, 1]} (original_width x original_height). "
                "Re-annotate the dataset, or pass check_sizes=False to trust the pixels."
            )
        plan = self.fit_row(row, bucket, epoch, size=size)
        try:
            image, _ = render_plan(
                im, plan, orientation, resample=self.resample, background=self.background, draft=self.draft,
                draft_gap=self.draft_gap
            )
        except Exception as e:  # noqa: BLE001
            raise ImageDecodeError(
                f"Row {row}: cannot decode the image in column {self.image_column!r} from {describe_source(source)}: "
                f"{type(e).__name__}: {e}. {_ADVICE}"
            ) from e
        extras = self.render_extras(row, im, orientation, plan)  # an ImageDecodeError here replaces the row too
        return image, plan, {**record, _EXTRAS: extras} if extras else record

    def render_extras(self, row: int, im: Any, orientation: int, plan: FitPlan) -> dict[str, Any]:
        """What a subclass adds to a sample, rendered with the same plan from the opened image ``im`` (a loss
        mask: :class:`hf_arb.images.masks.MaskedImages`). Raising :class:`ImageDecodeError` makes the row a bad
        row (replaced and counted, or an error with ``on_bad_image="error"``). None here."""
        return {}

    def _describe(self, row: int) -> str:
        return describe_source(self._view[row][self.image_column])

    def _render_or_replace(self, row: int, bucket: int, epoch: int) -> tuple[Any, FitPlan, dict[str, Any], int]:
        """:meth:`_render`, or with ``on_bad_image="replace"`` the first replacement row that renders."""
        try:
            return (*self._render(row, bucket, epoch), row)
        except (ImageDecodeError, _SizeMismatch) as e:
            if self.on_bad_image == "error":
                raise
            first = e
        order = replacement_order(row_rng(self.seed, epoch, row, ROW_REPLACE), row, bucket, self._bucket)
        failed = [row]
        for other in order[:_MAX_REPLACEMENT_TRIES].tolist():
            try:
                image, plan, record = self._render(other, bucket, epoch)
            except (ImageDecodeError, _SizeMismatch) as e:
                self.bad_images.record(other, _short(e), bucket=bucket, epoch=epoch, source=self._describe(other))
                failed.append(other)
                continue
            self.bad_images.record(row, _short(first), replaced_by=other, bucket=bucket, epoch=epoch,
                                   source=self._describe(row))
            return image, plan, record, other
        raise ImageDecodeError(
            f"Row {row} and {len(failed) - 1} replacement row(s) of bucket {bucket} ({failed[1:]}) could not be "
            f"decoded: {first}"
        ) from first

    def __getitem__(self, key: int | tuple[int, int, int]) -> dict[str, Any]:
        row, bucket, epoch = self._parse_key(key)
        image, plan, record, used = self._render_or_replace(row, bucket, epoch)
        if used != row:
            row = used  # the sample is the replacement row's: its image, caption and geometry
        caption = self._caption(record, row, epoch)
        sample: dict[str, Any] = {
            "pixel_values": to_tensor(image),  # (3, H, W) float32 in [-1, 1]
            "original_size": plan.original_size,  # (h, w)
            "crop_top_left": plan.crop_top_left,  # (y, x)
            "target_size": plan.target_size,  # (h, w)
            "caption": caption,
            "row": row,
            "bucket": bucket,
            "epoch": epoch,
            "flipped": plan.flipped,
        }
        sample.update(record.get(_EXTRAS, {}))  # render_extras' keys (a loss mask)
        for i, tok in enumerate(self.tokenizers):
            ids = tok(caption, max_length=tok.model_max_length, padding="max_length", truncation=True,
                      return_tensors="pt").input_ids
            sample["input_ids" if i == 0 else f"input_ids_{i + 1}"] = ids[0]  # (L,)
        return sample

    @staticmethod
    def collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Stack samples of one bucket; see :func:`collate_buckets`."""
        return collate_buckets(samples)


def _short(error: BaseException) -> str:
    """The decoder's own message from one of our errors (drops the row/source preamble and the advice)."""
    text = str(error).replace(_ADVICE, "").strip()
    return text.split(": ", 2)[-1][:200] if text.startswith("Row ") else text[:200]


