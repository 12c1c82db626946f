"""The two caches of a run: VAE latents per (image, bucket, crop, flip) (:mod:`hf_arb.train.cache.latents`) and
prompt embeddings per caption (the family encodes them)."""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

import numpy as np

from hf_arb.families import Models
from hf_arb.lazy import LazyModule

from ..models import place
from ..schedule import Schedule
from ..sources.dataset import image_dataset
from ..sources.tiers import TierTable, tier_pairs

torch: Any = LazyModule("torch")  # loaded when a function needs it: --help and flag errors answer before torch
logger = logging.getLogger("train_text_to_image_arb")


def build_latent_cache(args: argparse.Namespace, accelerator: Any, ds: Any, buckets: Any, models: Models,
                       sampler: Any, schedule: Schedule, weight_dtype: torch.dtype,
                       references: list[str] | None = None, images: Any = None,
                       column: str | None = None) -> tuple[Any, Any, Any]:
    """Encode this rank's share of the missing (image, bucket, crop, flip) entries; return (cache, index, repair).

    ``references``: an edit model's reference columns (the sampler's keys carry composite ids; each reference's
    latents are cached too). ``images``: the torch dataset whose ``fit_row(...).key()`` keys the entries and whose
    samples are encoded (default: the run's image dataset; clips: :class:`~hf_arb.video.dataset.BucketedClipDataset`,
    whose keys add the frame plan); ``column``: the column hashed for content (default ``--image_column``)."""
    from accelerate.utils import gather_object

    from hf_arb.train.cache import latents as lat

    cache = lat.LatentCache(args.latent_cache_dir or os.path.join(args.output_dir, "latent_cache"))
    vae = place(models.vae, accelerator.device, torch.float32)
    vae_id = lat.vae_fingerprint(vae)
    if args.image_interpolation_mode != "lanczos":  # another resize filter makes other latents
        vae_id = f"{vae_id}|{args.image_interpolation_mode}"
    refs = list(references or [])
    if refs:  # an edit model: the sampler's keys carry composite (target, reference buckets) ids
        from hf_arb.buckets.references import read_composite

        ids, table = read_composite(ds, refs)
    else:
        ids = np.asarray(ds.with_format("numpy")["bucket"])
    rows = np.flatnonzero(ids >= 0)
    tiered = isinstance(buckets, TierTable)  # several tiers: entries keyed by combined (tier, bucket) ids
    if tiered:  # every tier a row is eligible for (the bucket's size in that tier is in the fit plan's key)
        tier_rows = tier_pairs(ds, buckets)
        rows = np.array(sorted({r for r, _ in tier_rows}), np.int64)
    share = rows[lat.plan_share(len(rows), accelerator.process_index, accelerator.num_processes)]
    mine = dict(zip(share.tolist(), lat.content_hashes(ds, column or args.image_column, share.tolist(),
                                                                 show_progress=accelerator.is_local_main_process)))
    hashes_by_row: dict[int, str] = {}
    for part in gather_object([mine]) if accelerator.num_processes > 1 else [mine]:
        hashes_by_row.update(part)
    hashes = [hashes_by_row.get(i, "") for i in range(len(ds))]
    pairs = tier_rows if tiered else planned_pairs(args, ids, sampler, schedule)
    variants = planned_variants(args, schedule)
    images = image_dataset(args, ds, buckets, refs) if images is None else images
    if tiered:  # the BucketedImageDataset over every tier's sizes, keyed (row, combined id, epoch)
        images = images.images
    target_of = (lambda b: int(table[b, 0])) if refs else (lambda b: b)
    index = lat.build_index(sorted(pairs), hashes, lambda row, b, v: images.fit_row(row, target_of(b), v).key(),
                            variants=variants, vae_id=vae_id)

    def load_batch(keys: list[tuple[int, int, int]]) -> dict[str, Any]:
        return images.collate([images[k] for k in keys])

    def encode(pixels: torch.Tensor) -> torch.Tensor:
        return posterior_stats(vae, pixels.to(accelerator.device, torch.float32))  # (B, 2, C, h, w)

    t0 = time.perf_counter()
    lat.fill_cache(cache, index, rank=accelerator.process_index, world=accelerator.num_processes,
                   load_batch=load_batch, encode=encode, batch_size=args.train_batch_size,
                   show_progress=accelerator.is_local_main_process)
    index.references = [reference_index(args, accelerator, ds, images, sorted(pairs), j, cache, load_batch, encode,
                                        variants, vae_id, column=column) for j, column in enumerate(refs)]
    for ref in index.references:  # the run's counts cover the reference entries too
        index.encoded, index.reused, index.repaired = (index.encoded + ref.encoded, index.reused + ref.reused,
                                                       index.repaired + ref.repaired)
    accelerator.wait_for_everyone()
    mine = [(index.encoded, index.reused, index.repaired)]
    counts = gather_object(mine) if accelerator.num_processes > 1 else mine
    index.encoded, index.reused, index.repaired = (sum(c[i] for c in counts) for i in range(3))
    logger.info("Latent cache %s: encoded %d (%d of them damaged entries), reused %d entries (%d variant(s) per "
                "image) in %.1f s.", cache.root, index.encoded, index.repaired, index.reused, index.variants,
                time.perf_counter() - t0)
    place(models.vae, dtype=weight_dtype)
    return cache, index, latent_repair(cache, index, load_batch, models.vae)


def posterior_stats(vae: Any, pixels: Any) -> Any:
    """``(B, 2, C, h, w)``: the VAE posterior's mean and std of ``pixels``, without gradients. A batch of one image is
    encoded as two copies: a CPU convolution takes another code path for one image, whose last bits differ, so an
    entry's bits would depend on the batch it happened to fall in (the cache's fill order, an encode's shards)."""
    with torch.no_grad():
        one = pixels.shape[0] == 1
        dist = vae.encode(torch.cat([pixels, pixels]) if one else pixels).latent_dist
        stats = torch.stack([dist.mean, dist.std], dim=1)
        return stats[:1] if one else stats


def planned_pairs(args: argparse.Namespace, ids: np.ndarray, sampler: Any, schedule: Schedule) -> set[tuple[int, int]]:
    """Every ``(row, bucket)`` the run's sampler can ask for: each kept row at its own bucket (``ids``: the bucket
    column), and with --bucket_leftover fill / catch_all the other buckets the all-ranks plan of every epoch trains
    a leftover row at. The latent cache and an encoded dataset (:mod:`hf_arb.train.encoded`) hold these."""
    pairs = {(int(r), int(ids[r])) for r in np.flatnonzero(ids >= 0)}
    if args.bucket_leftover != "drop":  # leftovers may be trained at another bucket: read the all-ranks plan
        for epoch in range(schedule.num_train_epochs):
            plan = sampler.plan(epoch)  # (steps, world, batch): every rank's rows
            if hasattr(plan, "offsets"):  # --max_pixels_per_batch: a ragged plan (flat rows, a bucket per step)
                pairs.update(zip(plan.rows.tolist(), np.repeat(plan.buckets, np.diff(plan.offsets)).tolist()))
                continue
            for r in range(plan.shape[1]):
                targets = sampler.batch_buckets(epoch, rank=r)  # (steps,)
                pairs.update(zip(plan[:, r].ravel().tolist(), np.repeat(targets, plan.shape[2]).tolist()))
    return pairs


def planned_variants(args: argparse.Namespace, schedule: Schedule) -> int:
    """Crop/flip variants per image: 1 for centre crops without flip (every epoch fits an image the same way), else
    --latent_cache_variants or min(epochs, 8); epoch ``e`` trains on variant ``e % variants``."""
    if args.center_crop and not args.random_flip:
        return 1
    return int(args.latent_cache_variants or min(schedule.num_train_epochs, 8))


def reference_index(args: argparse.Namespace, accelerator: Any, ds: Any, images: Any, pairs: list[tuple[int, int]],
                    j: int, cache: Any, load_batch: Any, encode: Any, variants: int, vae_id: str, *,
                    column: str) -> Any:
    """Cache the ``j``-th reference column's (``column``) latents for every ``(row, composite id)`` pair and variant,
    keyed by the reference's content and its own fit plan (bucket, scaled size, crop, flip:
    :meth:`BucketedReferenceDataset. reference_plans`); returns their :class:`~hf_arb.train.cache.latents.CacheIndex`
    (counts included in the run's)."""
    from accelerate.utils import gather_object

    from hf_arb.train.cache import latents as lat

    rows = sorted({r for r, _ in pairs})
    share = [rows[i] for i in lat.plan_share(len(rows), accelerator.process_index, accelerator.num_processes)]
    mine = dict(zip(share, lat.content_hashes(ds, column, share)))
    found: dict[int, str] = {}
    for part in gather_object([mine]) if accelerator.num_processes > 1 else [mine]:
        found.update(part)
    hashes = [found.get(i, "") for i in range(len(ds))]
    index = lat.build_index(pairs, hashes, lambda row, b, v: images.reference_plans(row, b, v)[j].key(),
                            variants=variants, vae_id=vae_id)

    def load_reference(keys: list[tuple[int, int, int]]) -> dict[str, Any]:
        batch = load_batch(keys)
        pixels = batch["reference_pixel_values"][j]  # (B, 3, H_j, W_j)
        return {"pixel_values": pixels, "original_sizes": batch["reference_original_sizes"][:, j],
                "crop_top_lefts": batch["reference_crop_top_lefts"][:, j],
                "target_sizes": torch.tensor([list(pixels.shape[-2:])] * len(keys))}

    return lat.fill_cache(cache, index, rank=accelerator.process_index, world=accelerator.num_processes,
                          load_batch=load_reference, encode=encode, batch_size=args.train_batch_size,
                          show_progress=accelerator.is_local_main_process)


def latent_repair(cache: Any, index: Any, load_batch: Any, vae: Any) -> Any:
    """``(row, bucket, epoch)`` → encode that cache entry again (an entry damaged while training; see
    hf_arb.train.cache.latents)."""

    @torch.no_grad()
    def repair(row: int, bucket: int, epoch: int) -> None:
        batch = load_batch([(row, bucket, epoch % index.variants)])
        dist = vae.encode(batch["pixel_values"].to(vae.device, vae.dtype)).latent_dist
        stats = torch.stack([dist.mean, dist.std], dim=1)[0].float().cpu().numpy()  # (2, C, h, w)
        cache.write(index.key(row, bucket, epoch), stats, {
            "original_size": batch["original_sizes"][0].tolist(), "crop_top_left": batch["crop_top_lefts"][0].tolist(),
            "target_size": batch["target_sizes"][0].tolist()})

    return repair


class TextEncoder:
    """Captions → (hidden states ``(B, 77, D)``, pooled ``(B, P)`` or None); optionally memoised per caption."""

    def __init__(self, models: Models, device: torch.device, dtype: torch.dtype, cache: bool) -> None:
        self.models, self.device, self.dtype = models, device, dtype
        self.memo: dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None = {} if cache else None
        self.trained = models.trained_text_encoders  # LoRA on the encoders: forward through them with gradients

    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.set_grad_enabled(self.trained is not None):
            return self._encode_inner(captions)

    def _encode_inner(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The family's own prompt encoding (:meth:`hf_arb.families.Family.encode_text`), in the run's dtype."""
        h, p = self.models.family.encode_text(self.models, self.models.text_encoders_in_use, captions, self.device)
        return h.to(self.dtype), None if p is None else p.to(self.dtype)

    def __call__(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.memo is None:
            return self._encode(captions)
        todo = sorted({c for c in captions if c not in self.memo})
        if todo:
            h, p = self._encode(todo)
            for i, c in enumerate(todo):
                self.memo[c] = (h[i].cpu(), None if p is None else p[i].cpu())
        hidden = torch.stack([self.memo[c][0] for c in captions]).to(self.device)
        pooled = None if self.memo[captions[0]][1] is None else torch.stack(
            [self.memo[c][1] for c in captions]).to(self.device)
        return hidden, pooled
