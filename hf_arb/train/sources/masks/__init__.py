"""``--masked_loss``: the map-style and packed sources with a loss mask per image (:mod:`hf_arb.images.masks`).

:func:`masked_class` is how :func:`~hf_arb.train.sources.source_class` gives a run with a mask source (``--alpha_mask``,
``--mask_column``, ``--mask_dir``) its class: :class:`MaskedBucketedSource` or :class:`MaskedPackedSource`. Each
batch then carries ``loss_mask`` (each latent cell's weight) and every family's loss uses it when present
(:mod:`hf_arb.families.loss_mask`); the loop never asks whether the run is masked.

- Images: the dataset renders each mask with its image's plan (:class:`~hf_arb.images.masks.MaskedImageDataset`,
  :class:`~hf_arb.train.sources.masks.data.MaskedPackedImageDataset`); a row without a usable mask is replaced and
  counted like a broken image.
- ``--cache_latents``: the cache holds image latents only (its keys and entries do not depend on masks, so masked
  and unmasked runs share them); each batch's masks are recomputed from the mask files with the cached variant's
  exact plan (:class:`~hf_arb.train.sources.masks.data.CachedLatentsWithMasks`; ``--alpha_mask`` opens the image
  for its alpha, no VAE), and a row whose mask is missing is replaced by a cached row of its bucket, counted the
  same way.

Modules: this package's ``__init__`` (the sources) and :mod:`~hf_arb.train.sources.masks.data` (their data: the
mask flags read, rows with masks, packed and cached masks).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.checks import UsageError
from hf_arb.images.masks import MaskSpec

from ...files import SKIPPED_ROWS_FILE
from ..bucketed import BucketedSource
from ..packed import PackedSource
from .data import latent_factor, mask_spec, rows_with_masks

#: the reason every mask line of skipped_rows.jsonl starts with (hf_arb.images.masks.MaskError's messages)
MASK_REASON = "mask "


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


__all__ = ["MASKED", "MaskedBucketedSource", "MaskedPackedSource", "MaskedSource", "masked_class"]
