"""``--masked_loss``'s data side in a run: the run's :class:`~hf_arb.images.masks.MaskSpec` from its flags, the rows
with a mask (counted before any model loads), the packed dataset with masks, and the cached latents with masks
(:class:`CachedLatentsWithMasks`). The sources that use them: :mod:`hf_arb.train.sources.masks`."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from hf_arb.images.masks import MaskedImages, MaskSpec, mask_files
from hf_arb.packing.dataset import PackedImageDataset


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


class MaskedPackedImageDataset(MaskedImages, PackedImageDataset):
    """Images at their own size with each one's ``loss_mask`` ``(1, H_i / f, W_i / f)`` (a list per pack)."""


class CachedLatentsWithMasks:
    """A :class:`~hf_arb.train.cache.latent_dataset.CachedLatentDataset`'s items plus each one's ``loss_mask``,
    recomputed from the mask with the plan of the cached variant (``epoch % variants``) of the row whose pixels the
    entry holds (``source_row``).

    A row whose mask is missing, unreadable or of another size is replaced by the first row of the same bucket
    (in :func:`~hf_arb.images.bad_images.replacement_order`, from ``(seed, epoch, row)``) that has a cached entry and
    a mask, recorded once in the images' bad-row log, as the image path does (where no row of its bucket has one,
    it trains with an all-zero mask: skipped, and recorded the same way); ``on_bad_image="error"`` raises.

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
        import torch

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
        # no row of this bucket has both a cached entry and a mask: the row trains with weight 0 (skipped), counted
        item = self.cached[(row, bucket, epoch)]
        item["loss_mask"] = torch.zeros(1, *item["latent_stats"].shape[-2:])
        self.images.bad_images.record(row, str(first).split(": ", 1)[-1] + "; no row of its bucket has a mask: "
                                      "trained with weight 0", bucket=bucket, epoch=epoch)
        return item

    @staticmethod
    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        """The cached batch plus ``loss_mask`` ``(B, 1, h, w)``."""
        import torch

        from hf_arb.train.cache.latent_dataset import CachedLatentDataset

        batch = CachedLatentDataset.collate(items)
        batch["loss_mask"] = torch.stack([it["loss_mask"] for it in items])
        return batch


__all__ = ["CachedLatentsWithMasks", "MaskedPackedImageDataset", "latent_factor", "mask_spec", "rows_with_masks"]
