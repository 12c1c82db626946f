"""``--masked_loss``: the map-style and packed sources with a loss mask per image (:mod:`hf_arb.images.masks`).

:func:`masked_class` is how :func:`~hf_arb.train.sources.source_class` gives a run with a mask source (``--alpha_mask``,
``--mask_column``, ``--mask_dir``) its class: :class:`MaskedBucketedSource` or :class:`MaskedPackedSource`. Each
batch then carries ``loss_mask`` (each latent cell's weight) and every family's loss uses it when present
(:mod:`hf_arb.families.loss_mask`); the loop never asks whether the run is masked.

- Images: the dataset renders each mask with its image's plan (:class:`~hf_arb.images.masks.MaskedImageDataset`,
  :class:`MaskedPackedImageDataset`); a row without a usable mask is replaced and counted like a broken image.
- ``--cache_latents``: the cache holds image latents only (its keys and entries do not depend on masks, so masked
  and unmasked runs share them); each batch's masks are recomputed from the mask files with the cached variant's
  exact plan (:class:`CachedLatentsWithMasks`; ``--alpha_mask`` opens the image for its alpha, no VAE), and a row
  whose mask is missing is replaced by a cached row of its bucket, counted the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.checks import UsageError
from hf_arb.images.masks import MaskedImages, MaskSpec, mask_files
from hf_arb.packing.dataset import PackedImageDataset

from ..files import SKIPPED_ROWS_FILE
from .bucketed import BucketedSource
from .packed import PackedSource

logger = logging.getLogger("train_text_to_image_arb")

#: the reason every mask line of skipped_rows.jsonl starts with (hf_arb.images.masks.MaskError's messages)
MASK_REASON = "mask "


def mask_spec(args: argparse.Namespace) -> MaskSpec | None:
    """The run's :class:`~hf_arb.images.masks.MaskSpec` from its flags (checked by
    :func:`hf_arb.train.flags.mask_flags.check_mask_flags`), or ``None`` without ``--masked_loss``."""
    if not getattr(args, "masked_loss", False):
        return None
    source = "alpha" if args.alpha_mask else "column" if args.mask_column else "dir"
    return MaskSpec(source, column=args.mask_column, folder=args.mask_dir,
                    unmasked_weight=float(args.unmasked_weight))


def latent_factor(models: Any) -> int:
    """Pixels per latent cell along a side: the family's VAE factor (``vae_scale_factor``), else the diffusers rule
    ``2 ** (len(block_out_channels) - 1)``."""
    factor = getattr(models.family, "vae_scale_factor", None)
    if callable(factor):
        return int(factor(models.vae))
    return 2 ** (len(models.vae.config.block_out_channels) - 1)


def rows_with_masks(ds: Any, image_column: str, spec: MaskSpec) -> np.ndarray:
    """Whether each row has a mask to read, ``(n,)`` bool, without opening a file: the mask column's non-null cells,
    or the image names (or stems) found in the mask folder (vectorised over the Arrow columns); all True for
    ``"alpha"``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if spec.source == "alpha":
        return np.ones(len(ds), bool)
    column = spec.column if spec.source == "column" else image_column
    table = ds.select_columns([column]).with_format("arrow")[:]
    cells = table.column(column).combine_chunks()
    if spec.source == "column":
        has = pc.is_valid(cells)
        if pa.types.is_struct(cells.type):
            has = pc.and_(has, pc.or_(pc.is_valid(pc.struct_field(cells, "bytes")),
                                      pc.is_valid(pc.struct_field(cells, "path"))))
        return np.asarray(pc.fill_null(has, False).to_numpy(zero_copy_only=False), bool)
    paths = pc.struct_field(cells, "path") if pa.types.is_struct(cells.type) else cells.cast(pa.string())
    names = pc.replace_substring_regex(paths, r"^.*[/\\]", "")
    stems = pc.replace_substring_regex(names, r"\.[^.]*$", "")
    files = mask_files(spec.folder or ".")
    found = pc.or_(pc.is_in(names, value_set=pa.array([k for k in files if not k.startswith("stem:")], pa.string())),
                   pc.is_in(stems, value_set=pa.array([k[5:] for k in files if k.startswith("stem:")], pa.string())))
    return np.asarray(pc.fill_null(found, False).to_numpy(zero_copy_only=False), bool)


class MaskedSource:
    """A mixin over a map-style or packed source: the mask source is checked with the data (before any model), the
    latent grid is the VAE's, the loader's dataset renders masks, the start-up report and the run statistics say
    what masking did."""

    masks: MaskSpec | None = None
    args: argparse.Namespace

    def load(self, accelerator: Any) -> None:
        super().load(accelerator)  # type: ignore[misc]
        spec = mask_spec(self.args)
        assert spec is not None
        ds = self.ds  # type: ignore[attr-defined]
        if spec.source == "column" and spec.column not in ds.column_names:
            raise UsageError(f"--mask_column value '{spec.column}' needs to be one of: {', '.join(ds.column_names)}")
        kept = np.asarray(ds.with_format("numpy")["bucket"]) >= 0
        has = rows_with_masks(ds, self.args.image_column, spec)
        self.mask_counts = (int((has & kept).sum()), int(kept.sum()))
        if not (has & kept).any():
            flag = f"--mask_column {spec.column}" if spec.source == "column" else f"--mask_dir {spec.folder}"
            raise UsageError(f"{flag}: none of the {int(kept.sum())} trainable rows has a mask (name each mask file "
                             "like its image: cat.png for cat.png or cat.jpg). Check the folder or column.")
        self.masks = spec

    def loader(self, accelerator: Any, models: Any, schedule: Any, weight_dtype: Any) -> Any:
        self.masks = dataclasses.replace(self.masks, latent_factor=latent_factor(models))  # type: ignore[arg-type]
        return super().loader(accelerator, models, schedule, weight_dtype)  # type: ignore[misc]

    def report(self, accelerator: Any, schedule: Any, models: Any) -> None:
        super().report(accelerator, schedule, models)  # type: ignore[misc]
        if accelerator.is_main_process and self.masks is not None:
            has, kept = self.mask_counts
            missing = "" if has == kept else (f"; {kept - has} of {kept} rows have no mask: each is replaced by a row "
                                              f"of its bucket and listed in {SKIPPED_ROWS_FILE}")
            print(self.masks.describe() + missing, flush=True)

    def stats(self, micro_step: int) -> dict[str, Any]:
        from hf_arb.images.bad_images import read_bad_rows

        rows = read_bad_rows(Path(self.args.output_dir) / SKIPPED_ROWS_FILE)
        return {**super().stats(micro_step),  # type: ignore[misc]
                "mask_rows_replaced": sum(str(r.get("reason", "")).startswith(MASK_REASON) for r in rows)}


class MaskedBucketedSource(MaskedSource, BucketedSource):
    """:class:`~hf_arb.train.sources.bucketed.BucketedSource` with a loss mask per image."""


class MaskedPackedSource(MaskedSource, PackedSource):
    """:class:`~hf_arb.train.sources.packed.PackedSource` with a loss mask per image (each on its own latent grid)."""


#: the sources masks apply to (the flag checks refuse --masked_loss with the others)
MASKED = {BucketedSource: MaskedBucketedSource, PackedSource: MaskedPackedSource}


def masked_class(args: argparse.Namespace, cls: type) -> type:
    """``cls`` itself, or its masked counterpart when the run has a mask source."""
    if mask_spec(args) is None:
        return cls
    if cls not in MASKED:  # the flag checks refuse these combinations first
        raise UsageError(f"--masked_loss is not supported with this run's mode ({cls.__name__}) yet.")
    return MASKED[cls]


class MaskedPackedImageDataset(MaskedImages, PackedImageDataset):
    """Images at their own size with each one's ``loss_mask`` ``(1, H_i / f, W_i / f)`` (a list per pack)."""


class CachedLatentsWithMasks:
    """A :class:`~hf_arb.train.cache.latent_dataset.CachedLatentDataset`'s items plus each one's ``loss_mask``,
    recomputed from the mask with the plan of the cached variant (``epoch % variants``) of the row whose pixels the
    entry holds (``source_row``).

    A row whose mask is missing, unreadable or of another size is replaced by the first row of the same bucket
    (in :func:`~hf_arb.images.bad_images.replacement_order`, from ``(seed, epoch, row)``) that has a cached entry and
    a mask, recorded once in the images' bad-row log, as the image path does; ``on_bad_image="error"`` raises.

    Args:
        cached: the dataset over the latent cache.
        images: a :class:`~hf_arb.images.masks.MaskedImageDataset` over the same rows (its plans and its log).
    """

    def __init__(self, cached: Any, images: Any) -> None:
        self.cached, self.images = cached, images

    def __len__(self) -> int:
        return len(self.cached)

    def _item(self, row: int, bucket: int, epoch: int) -> dict[str, Any]:
        from hf_arb.train.cache.latents import variant_for_epoch

        item = self.cached[(row, bucket, epoch)]
        variant = variant_for_epoch(epoch, self.cached.index.variants)
        item["loss_mask"] = self.images.mask_sample((item["source_row"], bucket, variant))
        return item

    def __getitem__(self, key: Any) -> dict[str, Any]:
        from hf_arb.images.bad_images import replacement_order
        from hf_arb.images.masks import MaskError
        from hf_arb.rng import ROW_REPLACE, row_rng

        row, bucket, epoch = (int(k) for k in key)
        try:
            return self._item(row, bucket, epoch)
        except MaskError as e:
            if self.images.on_bad_image == "error":
                raise
            first = e
        order = replacement_order(row_rng(self.images.seed, epoch, row, ROW_REPLACE), row, bucket,
                                  self.images.bucket_ids)
        for other in order[:16].tolist():
            try:
                item = self._item(other, bucket, epoch)
            except (MaskError, KeyError):  # no mask either, or not cached at this bucket
                continue
            self.images.bad_images.record(row, str(first).split(": ", 1)[-1], replaced_by=other, bucket=bucket,
                                          epoch=epoch)
            item["row"] = other
            return item
        raise MaskError(f"Row {row} and the rows of its bucket tried in its place have no usable mask: {first}")

    @staticmethod
    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        """The cached batch plus ``loss_mask`` ``(B, 1, h, w)``."""
        import torch

        from hf_arb.train.cache.latent_dataset import CachedLatentDataset

        batch = CachedLatentDataset.collate(items)
        batch["loss_mask"] = torch.stack([it["loss_mask"] for it in items])
        return batch


__all__ = ["CachedLatentsWithMasks", "MaskedBucketedSource", "MaskedPackedImageDataset", "MaskedPackedSource",
           "MaskedSource", "latent_factor", "mask_spec", "masked_class", "rows_with_masks"]
