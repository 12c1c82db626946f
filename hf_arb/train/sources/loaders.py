"""From the dataset to batches: the sampler (bucketed, ragged or packed), the DataLoader, the step arithmetic
and each micro-batch's generator and loss weight."""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.checks import UsageError
from hf_arb.families import Models
from hf_arb.lazy import LazyModule

from ..cache.caches import build_latent_cache
from ..files import SKIPPED_ROWS_FILE
from ..schedule import Schedule
from .dataset import SAMPLER_FLAG_NAMES, image_dataset
from .tiers import TieredImages, TierTable, make_tier_pack_sampler, make_tier_sampler

torch: Any = LazyModule("torch")  # loaded when a function needs it: --help and flag errors answer before torch
logger = logging.getLogger("train_text_to_image_arb")


def make_sampler(args: argparse.Namespace, ds: Any, buckets: Any, accelerator: Any,
                 references: list[str] | None = None, batch_sizes: dict[int, int] | None = None) -> Any:
    """The global epoch plan over all ranks; a plain ``accelerator.prepare`` deals each rank its batches.
    ``references``: an edit model's reference columns (a batch stacks rows of one composite key); ``batch_sizes``:
    ``{bucket: rows per device}`` instead of ``--train_batch_size`` (a clip run's token budget)."""
    from hf_arb import BucketBatchSampler

    if args.packing and isinstance(buckets, TierTable):  # packs over tiers: a tier is a token cap per image
        return make_tier_pack_sampler(args, ds, buckets, accelerator)
    if args.packing:
        return make_pack_sampler(args, ds, accelerator)
    if isinstance(buckets, TierTable):  # --resolution 512,1024: one TieredBatchSampler over every tier
        return make_tier_sampler(args, ds, buckets, accelerator)
    from hf_arb.flag_parser import in_flags

    try:
        with warnings.catch_warnings(record=True) as caught:  # the library's advice, said once in flags below
            warnings.simplefilter("always", UserWarning)
            ids: Any = ds
            table_buckets = buckets
            if references:  # an edit model: the composite key stacks every batch
                from hf_arb.buckets.references import read_composite

                ids, table = read_composite(ds, references)
                table_buckets = np.asarray(getattr(buckets, "resolutions", buckets))[table[:, 0]]  # (c, 2) targets
            sampler = BucketBatchSampler(
                ids, args.train_batch_size if batch_sizes is None else batch_sizes,
                num_replicas=accelerator.num_processes,  # no rank=: prepare deals the plan
                seed=args.seed, shuffle=True, sync_buckets=not args.no_bucket_sync, leftover=args.bucket_leftover,
                return_keys=True, buckets=table_buckets, max_pixels_per_batch=args.max_pixels_per_batch,
                log_report=False,  # startup_report prints it
            )
    except ValueError as e:  # a pixel budget below a bucket's area, or no full batch: the flags to change
        if args.max_pixels_per_batch is None:
            if str(e).startswith("The epoch plan has zero batches"):
                raise UsageError(in_flags(str(e), SAMPLER_FLAG_NAMES)) from None
            raise
        raise UsageError(f"--max_pixels_per_batch {args.max_pixels_per_batch}: {e}") from None
    for w in caught:
        if not issubclass(w.category, UserWarning) or "Remedies:" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        elif accelerator.is_main_process:  # one line, in flags, without the warning's source line
            names = SAMPLER_FLAG_NAMES if batch_sizes is None else {  # a clip run's sizes: its flags
                **SAMPLER_FLAG_NAMES,
                "a smaller batch per bucket": "smaller batches (--video_token_budget, --image_train_batch_size)"}
            logger.warning("%s", in_flags(str(w.message), names))
    return sampler


def make_pack_sampler(args: argparse.Namespace, ds: Any, accelerator: Any) -> Any:
    """--packing: every image at its own size (at most (--resolution/16)^2 tokens), packs of --max_tokens tokens."""
    from hf_arb import PackBatchSampler

    image_tokens = min(args.max_tokens, max(1, (args.resolution // 16) ** 2))
    try:
        return PackBatchSampler(ds, args.max_tokens, max_image_tokens=image_tokens,
                                num_replicas=accelerator.num_processes, rank=accelerator.process_index,
                                seed=args.seed, leftover="fill" if args.bucket_leftover == "fill" else "drop",
                                log_report=False)
    except ValueError as err:
        raise UsageError(f"--packing --max_tokens {args.max_tokens}: {err}") from None


def packed_model(args: argparse.Namespace, models: Models) -> Any:
    """What ``accelerator.prepare`` wraps: with --packing, a module whose forward is the packed loss, so that DDP
    synchronises the packed computation; else the denoiser itself."""
    if not args.packing:
        return models.unet
    from hf_arb.packing.loss import PackedFlowModel

    return PackedFlowModel(models.unet)


def packable_rows(sampler: Any) -> int:
    """Rows with a size to pack (in some tier, for a TieredPackBatchSampler)."""
    tables = (sampler.sizes,) if hasattr(sampler.sizes, "tokens") else sampler.sizes
    return int(np.any([t.tokens > 0 for t in tables], axis=0).sum())


def packing_report(sampler: Any) -> str:
    """--packing's startup lines: this epoch's packs, padding and left-out rows, and the crop to the patch grid."""
    rep = sampler.report()
    tiered = not hasattr(sampler.sizes, "tokens")  # a TieredPackBatchSampler: one size table per tier
    sizes = sampler.epoch_sizes(sampler.epoch) if tiered else sampler.sizes
    ok = sizes.tokens > 0
    tiers = ""
    if tiered:
        tiers = "; this epoch's rows per tier: " + ", ".join(
            f"{r}: {n:,} (cap {min(sampler.max_tokens, (r // 16) ** 2):,} tokens)"
            for r, n in zip(sampler.tiers.resolutions, sampler.tier_rows()))
    return (f"{rep.text()}\nimages at their own size: {int(ok.sum()):,} rows, mean "
            f"{sizes.tokens[ok].mean() if ok.any() else 0:,.0f} "
            f"tokens (cap {int(sampler.max_image_tokens):,}), mean crop to the 16 px grid "
            f"{100 * sampler.mean_crop_fraction():.2f}% of the area; pack budget {sampler.max_tokens:,} tokens{tiers}")


def build_dataloader(args: argparse.Namespace, accelerator: Any, ds: Any, buckets: Any, models: Models, sampler: Any,
                     schedule: Schedule, weight_dtype: torch.dtype,
                     references: list[str] | None = None, collate_wrap: Any = None,
                     masks: Any = None) -> tuple[Any, Any]:
    """DataLoader over images (fitted to the batch's bucket) or, with --cache_latents, over cached latents.
    ``references``: an edit model's reference columns (composite keys; batches report the target bucket);
    ``collate_wrap``: ``collate -> collate`` adding per-row fields (several datasets: each row's loss weight);
    ``masks``: ``--masked_loss``'s :class:`~hf_arb.images.masks.MaskSpec` (every batch carries ``loss_mask``).

    Returns ``(dataloader, cache index or None)``; the loader still has to go through ``accelerator.prepare``.
    """
    if args.cache_latents:
        from hf_arb.train.cache.latent_dataset import CachedLatentDataset

        cache, index, repair = build_latent_cache(args, accelerator, ds, buckets, models, sampler, schedule,
                                                  weight_dtype, references=references)
        captions = ds.select_columns([args.caption_column])[args.caption_column]
        # re-encoding in a loader worker needs the VAE there: fine on CPU, not for a CUDA VAE in a forked worker
        in_process = args.dataloader_num_workers == 0 or accelerator.device.type == "cpu"
        targets = None
        if references:  # composite keys; batches report the target bucket
            from hf_arb.buckets.references import read_composite

            targets = read_composite(ds, references)[1][:, 0]
        dataset: Any = CachedLatentDataset(cache, index, captions, seed=args.seed,
                                           repair=repair if in_process else None,
                                           target_buckets=targets)
        collate = CachedLatentDataset.collate
        if isinstance(buckets, TierTable):  # the sampler's (row, tier, bucket, epoch) keys
            dataset = TieredImages(dataset, buckets)
        elif targets is not None and getattr(models.family, "reference_pixels_with_cache", False):
            from hf_arb.train.cache.latent_dataset import CachedLatentsWithReferences

            # its encoder sees them
            dataset = CachedLatentsWithReferences(dataset, image_dataset(args, ds, buckets, references))
            collate = dataset.collate
        if masks is not None:  # masks recomputed with each cached variant's plan (hf_arb.train.sources.masks)
            from .masks.data import CachedLatentsWithMasks

            dataset = CachedLatentsWithMasks(dataset, image_dataset(args, ds, buckets, masks=masks))
            collate = dataset.collate
    else:
        index = None
        if args.packing:
            from hf_arb import PackedImageDataset

            packed: Any = PackedImageDataset
            if masks is not None:  # each image's loss mask on its own latent grid
                from .masks.data import MaskedPackedImageDataset as packed
            dataset = packed(
                ds, sampler.sizes, **({} if masks is None else {"masks": masks}), image_column=args.image_column,
                caption_column=args.caption_column, seed=args.seed,
                center_crop=args.center_crop, random_flip=args.random_flip, resample=args.image_interpolation_mode,
                on_bad_image=args.on_bad_image, bad_image_log=Path(args.output_dir) / SKIPPED_ROWS_FILE)
        else:
            dataset = image_dataset(args, ds, buckets, references, masks=masks)
        collate = dataset.collate
    if collate_wrap is not None:
        collate = collate_wrap(collate)
    from hf_arb.train.signals import ignore_stop_signals_in_worker  # the main process decides when to stop

    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                         num_workers=args.dataloader_num_workers,
                                         worker_init_fn=ignore_stop_signals_in_worker,
                                         # transformers' Trainer default: page-locked batches on a GPU, which
                                         # accelerate then copies with non_blocking=True (environment.py)
                                         pin_memory=accelerator.device.type == "cuda")
    return loader, index


