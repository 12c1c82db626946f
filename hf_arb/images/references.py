"""Edit-model samples: the target fitted to its bucket, and every reference image fitted with a crop consistent
with the target's (:class:`BucketedReferenceDataset`).

- ``"strict"`` (the reference takes the target's bucket and crop, as Flux Kontext trains): the reference is scaled
  to the target's scaled size and cut at the target's crop box, so ``reference_crop_top_lefts`` equals
  ``crop_top_lefts`` and a before/after pair of one size gives pixel-aligned crops (:func:`reference_plan`);
- ``"own"`` (its own bucket): the reference covers its own bucket and its crop sits at the same *relative* offset
  as the target's (the same fraction of the excess width and height; the same flip).

A reference that cannot be opened is handled like a broken target: with ``on_bad_image="replace"`` the whole row
(target and references) is replaced by a deterministic row of the same composite bucket, counted in
:attr:`bad_images` and logged to the same JSON-lines file; with ``"error"`` it raises :class:`ImageDecodeError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hf_arb.buckets.references import composite_bucket_ids, reference_info, stored_reference_columns
from hf_arb.rng import ROW_REPLACE, row_rng

from .bad_images import replacement_order
from .collate import collate_buckets
from .dataset import BucketedImageDataset, ImageDecodeError
from .fitting import describe_source, displayed_size, exif_orientation, open_image, render_plan, to_tensor
from .geometry import FitPlan, cover_size, crop_plan

_MAX_TRIES = 16


def reference_plan(target: FitPlan, size: Sequence[int], bucket: Sequence[int] | None = None) -> FitPlan:
    """Where a reference image of displayed ``size`` lands, consistently with the target's plan.

    Args:
        target: the target's :class:`FitPlan`.
        size: the reference's displayed ``(width, height)``.
        bucket: ``None`` for ``"strict"`` (the target's bucket, scaled size and crop box); else the reference's own
            bucket ``(width, height)``, covered by the reference and cropped at the target's relative offset.

    Returns:
        The reference's plan; ``target.flipped`` and ``target.render`` carry over.
    """
    w, h = int(size[0]), int(size[1])
    if bucket is None:
        return FitPlan(size=(w, h), bucket=target.bucket, scaled_size=target.scaled_size,
                       crop_top_left=target.crop_top_left, flipped=target.flipped, render=target.render)
    bw, bh = int(bucket[0]), int(bucket[1])
    sw, sh = cover_size(w, h, bw, bh)
    ex, ey = sw - bw, sh - bh
    (tw, th), (tbw, tbh) = target.scaled_size, target.bucket
    fx = 0.5 if tw == tbw else target.crop_left / (tw - tbw)
    fy = 0.5 if th == tbh else target.crop_top_left[0] / (th - tbh)
    x, y = int(round(fx * ex)), int(round(fy * ey))
    plan = crop_plan((w, h), (sw, sh), (bw, bh), crop="center")
    return dataclasses.replace(plan, crop_top_left=(y, ex - x if target.flipped else x), flipped=target.flipped,
                               render=target.render)


class BucketedReferenceDataset(BucketedImageDataset):
    """:class:`~hf_arb.BucketedImageDataset` plus the reference images of an edit dataset.

    Args:
        ds: a ``datasets.Dataset`` annotated with ``reference_columns`` (:func:`hf_arb.add_bucket_columns`).
        reference_columns: the reference image columns; default every one stored in the annotation.
        composite: the composite table ``(c, 1 + r)`` of :func:`hf_arb.sampling.composite.composite_sampler`: keys
            ``(row, composite id, epoch)`` are then read through it (the sampler's ids). ``None``: keys carry the
            target bucket and each reference uses the row's own reference bucket.
        **kwargs: as for :class:`~hf_arb.BucketedImageDataset`.

    A sample adds to the target's keys ``reference_pixel_values`` (a list, one ``(3, H_j, W_j)`` tensor per
    reference column), ``reference_crop_top_lefts`` (``(y, x)`` per reference), ``reference_original_sizes``
    (``(h, w)`` per reference) and ``reference_buckets`` (``(w, h)`` per reference); :meth:`collate` stacks each.
    """

    def __init__(self, ds: Any, buckets: Any = None, *, reference_columns: Sequence[str] | None = None,
                 composite: np.ndarray | None = None, **kwargs: Any) -> None:
        import datasets

        names = tuple(reference_columns) if reference_columns is not None else stored_reference_columns(ds.features)
        if not names:
            raise ValueError("The dataset has no reference columns: annotate it with add_bucket_columns(..., "
                             "reference_columns=['before']) (hf-arb annotate --reference-column before).")
        infos = [reference_info(ds.features, n) for n in names]
        missing = [n for n, i in zip(names, infos) if i is None]
        if missing:
            raise ValueError(f"Reference column(s) {missing} carry no annotation (no {missing[0]}_bucket column with "
                             "a stored policy): annotate with reference_columns=[...] first.")
        super().__init__(ds, buckets, **kwargs)
        self.reference_columns = names
        self.policies = tuple(i[0] for i in infos)  # type: ignore[index]
        self.reference_resolutions = [np.asarray(i[1].resolutions, dtype=np.int64) for i in infos]  # type: ignore[index]
        cols = [c for n in names for c in (n + "_bucket", n + "_width", n + "_height")]
        arrays = ds.select_columns(cols).with_format("numpy")[0:len(ds)]
        self.reference_ids = np.stack([np.nan_to_num(np.asarray(arrays[n + "_bucket"], float), nan=-1)
                                       for n in names], 1).astype(np.int64)  # (n, r)
        self.reference_sizes = np.stack([np.stack([np.nan_to_num(np.asarray(arrays[n + "_width"], float)),
                                                   np.nan_to_num(np.asarray(arrays[n + "_height"], float))], 1)
                                         for n in names], 1).astype(np.int64)  # (n, r, 2) width, height
        refs = ds.select_columns(list(names))
        for n in names:
            if isinstance(refs.features[n], datasets.Image) and refs.features[n].decode:
                refs = refs.cast_column(n, datasets.Image(decode=False))
        self._refs = refs
        self.composite = None if composite is None else np.asarray(composite, dtype=np.int64)
        self._row_keys = composite_bucket_ids(self.bucket_ids, list(self.reference_ids.T))[0]  # (n,)

    def _buckets_of(self, row: int, key_bucket: int) -> tuple[int, np.ndarray]:
        """(target bucket, reference buckets (r,)) a key asks for."""
        if self.composite is not None:
            entry = self.composite[key_bucket]
            return int(entry[0]), entry[1:]
        return key_bucket, self.reference_ids[row]

    def reference_plans(self, row: int, key_bucket: int, epoch: int | None = None) -> list[FitPlan]:
        """Every reference's :class:`FitPlan` for the key ``(row, key_bucket, epoch)``, without opening an image
        (from the annotated reference sizes): with the reference's content, ``plan.key()`` is a complete latent-cache
        key, as :meth:`fit_row`'s is for the target."""
        bucket, ref_buckets = self._buckets_of(row, key_bucket)
        plan = self.fit_row(row, bucket, epoch)
        return [reference_plan(plan, self.reference_sizes[row, j],
                               None if self.policies[j] == "strict"
                               else self.reference_resolutions[j][int(ref_buckets[j])])
                for j in range(len(self.reference_columns))]

    def _references(self, row: int, plan: FitPlan, ref_buckets: np.ndarray) -> dict[str, Any]:
        """Open and fit every reference of ``row``; raises :class:`ImageDecodeError` naming the column."""
        record = self._refs[row]
        out: dict[str, list[Any]] = {"reference_pixel_values": [], "reference_crop_top_lefts": [],
                                     "reference_original_sizes": [], "reference_buckets": []}
        for j, name in enumerate(self.reference_columns):
            source = record[name]
            try:
                im = open_image(source)
                orientation = exif_orientation(im)
                size = displayed_size(im, orientation)
                bucket = None if self.policies[j] == "strict" else self.reference_resolutions[j][int(ref_buckets[j])]
                ref_plan = reference_plan(plan, size, bucket)
                image, _ = render_plan(im, ref_plan, orientation, resample=self.resample,
                                       background=self.background, draft=self.draft, draft_gap=self.draft_gap)
            except Exception as e:  # noqa: BLE001 - any decoder failure becomes one clear error
                raise ImageDecodeError(f"Row {row}: cannot open the reference image in column {name!r} from "
                                       f"{describe_source(source)}: {type(e).__name__}: {e}") from e
            out["reference_pixel_values"].append(to_tensor(image))  # (3, H_j, W_j)
            out["reference_crop_top_lefts"].append(ref_plan.crop_top_left)
            out["reference_original_sizes"].append(ref_plan.original_size)
            out["reference_buckets"].append(ref_plan.bucket)
        return out

    def reference_sample(self, key: Any) -> dict[str, Any]:
        """The references of ``key`` alone, fitted as :meth:`__getitem__` fits them (the target is not opened):
        ``reference_pixel_values`` (one ``(3, H_j, W_j)`` per column), ``reference_crop_top_lefts``,
        ``reference_original_sizes``, ``reference_buckets``. For a run whose latents come from a cache while a
        text encoder still sees the reference pixels (Qwen-Image-Edit with ``--cache_latents``); a reference that
        cannot be opened raises :class:`ImageDecodeError` naming its column."""
        row, key_bucket, epoch = self._parse_key(key) if self.composite is None else _split_key(key, self.epoch)
        bucket, ref_buckets = self._buckets_of(row, key_bucket)
        return self._references(row, self.fit_row(row, bucket, epoch), ref_buckets)

    def __getitem__(self, key: Any) -> dict[str, Any]:
        row, key_bucket, epoch = self._parse_key(key) if self.composite is None else _split_key(key, self.epoch)
        bucket, ref_buckets = self._buckets_of(row, key_bucket)
        order = None
        tried: list[int] = []
        candidate = row
        for _ in range(_MAX_TRIES):
            sample = super().__getitem__((candidate, bucket, epoch))
            used = int(sample["row"])
            plan = self.fit_row(used, bucket, epoch)
            try:
                sample.update(self._references(used, plan, ref_buckets))
                if used != row and tried:
                    self.bad_images.record(row, f"reference: {tried[0]}", replaced_by=used, bucket=bucket,
                                           epoch=epoch)
                return sample
            except ImageDecodeError as e:
                if self.on_bad_image == "error":
                    raise
                tried.append(used)
                if used != row:
                    self.bad_images.record(used, str(e)[:200], bucket=bucket, epoch=epoch)
                if order is None:
                    own = self._row_keys  # (n,) each row's own composite key: same shapes first
                    same = int(own[row])
                    order = [int(r) for r in replacement_order(row_rng(self.seed, epoch, row, ROW_REPLACE), row,
                                                               same, own).tolist() if r not in tried]
                if not order:
                    break
                candidate = order.pop(0)
        raise ImageDecodeError(f"Row {row} and {len(tried) - 1} replacement row(s) have references that could not be "
                               f"decoded ({tried}). Re-annotate with --verify, or fix the files.")

    @staticmethod
    def collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """:func:`collate_buckets` of the targets, plus ``reference_pixel_values``: a list with one
        ``(B, 3, H_j, W_j)`` tensor per reference column, and ``reference_crop_top_lefts`` ``(B, r, 2)`` int64."""
        batch = collate_buckets(samples)
        r = len(samples[0]["reference_pixel_values"])
        batch["reference_pixel_values"] = [torch.stack([s["reference_pixel_values"][j] for s in samples])
                                           for j in range(r)]
        batch["reference_crop_top_lefts"] = torch.tensor([s["reference_crop_top_lefts"] for s in samples],
                                                         dtype=torch.int64)  # (B, r, 2)
        batch["reference_original_sizes"] = torch.tensor([s["reference_original_sizes"] for s in samples],
                                                         dtype=torch.int64)  # (B, r, 2)
        return batch


def _split_key(key: Any, epoch: int) -> tuple[int, int, int]:
    """``(row, composite id, epoch)`` from a sampler key, or an int row (its own composite at ``epoch``)."""
    if isinstance(key, (tuple, list)):
        if len(key) != 3:
            raise ValueError(f"A tuple key must be (row, composite id, epoch), got {key!r}.")
        return int(key[0]), int(key[1]), int(key[2])
    raise ValueError("With `composite=` the dataset takes (row, composite id, epoch) keys: build the sampler with "
                     "composite_sampler(..., return_keys=True).")
