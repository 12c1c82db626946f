"""Images of a pack, each at its own size: the data side of packing (:class:`~hf_arb.packing.sampler.PackBatchSampler`).

:class:`PackedImageDataset` is a :class:`~hf_arb.images.dataset.BucketedImageDataset` whose "buckets" are the rows' own
fitted sizes (:func:`~hf_arb.packing.layout.fit_sizes`): every row is resized to its ``resize_width × resize_height``
and cropped (by less than one patch a side) to ``width × height``, with the same EXIF handling, resampling, random
or centre crop, flip, caption choice and bad-image policy (a replacement row has the same fitted size, so the pack
keeps its token count). :func:`collate_packs` keeps the images apart:

==================  ===============================  ===============================================================
key                 shape / type                     meaning
==================  ===============================  ===============================================================
``pixel_values``    ``list`` of ``(3, H_i, W_i)``    each image in [-1, 1] at its own fitted size
``grids``           ``(m, 2)`` int64                 latent token grid ``(H_i, W_i) / (vae_scale_factor × patch)``
``target_sizes``    ``(m, 2)`` int64                 ``(H_i, W_i)``; ``original_sizes``, ``crop_top_lefts`` as usual
``captions``        ``list[str]``                    one per image; ``rows``, ``buckets`` (size group), ``flipped``
``input_ids*``      ``(m, L)`` int64                 when tokenizers are given
==================  ===============================  ===============================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hf_arb.images.collate import collate_common
from hf_arb.images.dataset import BucketedImageDataset
from hf_arb.images.geometry import FitPlan, cover_size, crop_plan
from hf_arb.rng import ROW_CROP, ROW_FLIP, row_rng

from .layout import FittedSizes

__all__ = ["PackedImageDataset", "collate_packs"]


def collate_packs(samples: Sequence[dict[str, Any]], step: int = 16) -> dict[str, Any]:
    """One pack's samples as a batch dict (keys in the module docstring); ``step`` = VAE factor × patch size.

    Raises:
        ValueError: an empty pack, or an image side that is not a multiple of ``step``.
    """
    if len(samples) == 0:
        raise ValueError("Cannot collate an empty pack.")
    shapes = np.array([s["pixel_values"].shape[-2:] for s in samples], dtype=np.int64)  # (m, 2) H, W
    if (shapes % step).any():
        bad = int(np.flatnonzero((shapes % step).any(1))[0])
        raise ValueError(f"Row {samples[bad]['row']}: image {shapes[bad, 1]}x{shapes[bad, 0]} is not on the "
                         f"{step} px grid of the model; fit it with `fit_sizes` (PackedImageDataset does).")
    batch: dict[str, Any] = {
        "pixel_values": [s["pixel_values"] for s in samples],
        "grids": torch.as_tensor(shapes // step),
        **collate_common(samples),
        "flipped": torch.tensor([s["flipped"] for s in samples], dtype=torch.bool),
    }
    for key in sorted(k for k in samples[0] if k.startswith("input_ids")):
        batch[key] = torch.stack([s[key] for s in samples])
    return batch


class PackedImageDataset(BucketedImageDataset):
    """An annotated ``datasets.Dataset`` whose rows render at their own fitted size, keyed like the packs of a
    :class:`~hf_arb.packing.sampler.PackBatchSampler`.

    Args:
        ds: an annotated map-style ``datasets.Dataset`` (as for :class:`~hf_arb.images.dataset.BucketedImageDataset`).
        sizes: every row's fitted size, ``sampler.sizes`` (:func:`~hf_arb.packing.sampler.pack_sizes`); a
            :class:`~hf_arb.packing.tier_sampler.TieredPackBatchSampler`'s is one per tier, and a key's size picks
            the tier.
        vae_scale_factor, patch_size: the model's latent step, for :attr:`step` and the collated ``grids``.
        **kwargs: :class:`~hf_arb.images.dataset.BucketedImageDataset`'s options (``image_column``, ``caption_column``,
            ``tokenizer``, ``seed``, ``center_crop``, ``random_flip``, ``resample``, ``on_bad_image``, …).

    Keys: ``(row, width, height, epoch)`` from the sampler (the size is checked against ``sizes``), or an ``int``
    row (its own size, the epoch of :meth:`set_epoch`). :attr:`bucket_ids` and a sample's ``bucket`` are the
    row's size group: an index into :attr:`resolutions`, the table of distinct fitted sizes ``(width, height)``.

    Example:
        ```py
        >>> sampler = PackBatchSampler(annotated, max_tokens=4096, seed=0)
        >>> data = PackedImageDataset(annotated, sampler.sizes, seed=0, random_flip=True)
        >>> loader = DataLoader(data, batch_sampler=sampler, collate_fn=data.collate, num_workers=2)
        ```
    """

    def __init__(self, ds: Any, sizes: FittedSizes | Sequence[FittedSizes], *, vae_scale_factor: int = 8,
                 patch_size: int = 2, **kwargs: Any) -> None:
        if "buckets" in kwargs:
            raise TypeError("PackedImageDataset takes no `buckets`: every row has its own size (`sizes`).")
        super().__init__(ds, **kwargs)
        tables = (sizes,) if isinstance(sizes, FittedSizes) else tuple(sizes)  # one per tier (TieredPackBatchSampler)
        if not tables or any(s.tokens.shape != (len(self),) for s in tables):
            covers = sorted({s.tokens.size for s in tables})
            raise ValueError(f"`sizes` covers {' or '.join(map(str, covers)) or 'no'} rows but the dataset has "
                             f"{len(self)}: pass the `sizes` of a PackBatchSampler built on this dataset.")
        self.sizes, self.tier_sizes = tables[0], tables
        self.step = int(vae_scale_factor) * int(patch_size)
        wh = np.stack([np.stack([s.width, s.height], 1) for s in tables]).astype(np.int64)  # (T, n, 2)
        ok = np.stack([s.tokens > 0 for s in tables])  # (T, n)
        table, group = np.unique(wh[ok], axis=0, return_inverse=True)
        groups = np.full(ok.shape, -1, dtype=np.int64)  # (T, n) size group of each row at each tier
        groups[ok] = group.reshape(-1)
        # the parent's bucket table and bucket ids become the fitted-size table and each row's size group (the
        # first tier where it has a size)
        first = np.argmax(ok, axis=0)  # (n,)
        self.resolutions, self._bucket = table, groups[first, np.arange(len(self))]
        self._groups, self._wh = groups, wh

    def _parse_key(self, key: Any) -> tuple[int, int, int]:
        if isinstance(key, (tuple, list)) and len(key) == 4:
            row, width, height, epoch = (int(k) for k in key)
            if not 0 <= row < len(self):
                raise IndexError(f"Row {row} is out of range for a dataset of {len(self)} rows.")
            match = np.flatnonzero((self._wh[:, row] == (width, height)).all(axis=1) & (self._groups[:, row] >= 0))
            if not match.size:
                have = " or ".join(f"{a}x{b}" for a, b in self._wh[self._groups[:, row] >= 0, row].tolist())
                raise ValueError(f"Row {row}: the sampler asks for {width}x{height} but this dataset fits the row to "
                                 f"{have or 'no size'}; build the dataset with the sampler's `sizes`.")
            return super()._parse_key((row, int(self._groups[match[0], row]), epoch))
        return super()._parse_key(key)

    def fit_row(self, row: int, bucket: int | None = None, epoch: int | None = None,
                size: Sequence[int] | None = None) -> FitPlan:
        """The crop/flip decision of a row without opening the image: resized to the row's ``resize_width ×
        resize_height`` (its annotated size; another displayed size is scaled to cover), cropped to the size of
        ``bucket`` (default: the row's own size group)."""
        row = int(row)
        bucket = int(self._bucket[row]) if bucket is None else int(bucket)
        epoch = self.epoch if epoch is None else int(epoch)
        target = self.resolution(bucket)
        annotated = None if self._size is None else (int(self._size[row, 0]), int(self._size[row, 1]))
        size = annotated if size is None else (int(size[0]), int(size[1]))
        if size is None:
            raise ValueError("fit_row needs the image size: annotate the dataset or pass `size=(width, height)`.")
        tier = np.flatnonzero(self._groups[:, row] == bucket)  # the tier whose fitted size is this bucket
        if size == annotated and tier.size:
            fitted = self.tier_sizes[int(tier[0])]
            scaled = (int(fitted.resize_width[row]), int(fitted.resize_height[row]))
        else:
            scaled = cover_size(size[0], size[1], target[0], target[1])
        flip = self.random_flip and bool(row_rng(self.seed, epoch, row, ROW_FLIP).random() < 0.5)
        rng = None if self.center_crop else row_rng(self.seed, epoch, row, ROW_CROP)
        plan = crop_plan(size, scaled, target, crop="center" if self.center_crop else "random", rng=rng, flip=flip)
        return dataclasses.replace(plan, render=self._render_id)

    def collate(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:  # type: ignore[override]
        """:func:`collate_packs` with this dataset's latent step."""
        return collate_packs(samples, self.step)
