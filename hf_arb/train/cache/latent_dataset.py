"""A map-style dataset over a built latent cache (:mod:`hf_arb.train.cache.latents`): the cached-latents counterpart of
:class:`hf_arb.images.dataset.BucketedImageDataset`, keyed and collated the same way."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hf_arb.images.collate import choose_caption, collate_common

from .latents import CacheIndex, LatentCache, LatentCacheError, variant_for_epoch

logger = logging.getLogger(__name__)


class CachedLatentDataset:
    """Map-style dataset over a built cache; items are keyed like ``BucketedImageDataset``'s.

    ``dataset[(row, bucket, epoch)]`` → ``{"latent_stats": (2, C, h, w) float32 tensor, "original_size",
    "crop_top_left", "target_size", "caption", "row", "source_row", "bucket"}`` (``source_row``: the row whose
    pixels the entry was encoded from, another row of the same bucket where this one failed to decode);
    :meth:`collate` stacks a batch into ``latent_stats`` ``(B, 2, C, h, w)``, ``original_sizes`` / ``crop_top_lefts`` /
    ``target_sizes`` ``(B, 2)``, ``captions`` (list of str), ``rows`` and ``buckets`` (``(B,)``). With reference indexes
    (``index.references``, an edit model) items add ``reference_latent_stats``: one ``(2, C, h_j, w_j)`` per column
    (a damaged reference entry raises :class:`LatentCacheError`: rebuild the cache).

    Args:
        cache, index: from :func:`build_index` / :func:`fill_cache`.
        captions: one caption, or a list of captions, per dataset row. From a list, epoch ``e`` takes the caption
            ``BucketedImageDataset`` takes (same per-row stream; the global RNG is not used).
        seed: for caption choice.
        repair: ``(row, bucket, epoch)`` → encode that entry again and write it to the cache. Called when an entry
            fails verification on read (damaged after the cache was built); the entry is re-read afterwards.
            Without it a damaged entry raises :class:`LatentCacheError`.
        target_buckets: an edit model's composite table's target column ``(c,)``: keys carry composite ids, items
            report the target bucket (as :class:`~hf_arb.images.references.BucketedReferenceDataset` does).
    """

    def __init__(self, cache: LatentCache, index: CacheIndex, captions: Sequence[Any], seed: int = 0,
                 repair: Callable[[int, int, int], None] | None = None,
                 target_buckets: Sequence[int] | None = None) -> None:
        self.cache = cache
        self.index = index
        self.captions = captions
        self.seed = int(seed)
        self.repair = repair
        self.target_buckets = None if target_buckets is None else np.asarray(target_buckets, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.captions)

    def _caption(self, row: int, epoch: int) -> str:
        return choose_caption(self.captions[row], seed=self.seed, epoch=epoch, row=row)

    def __getitem__(self, key: tuple[int, int, int]) -> dict[str, Any]:
        import torch

        row, bucket, epoch = (int(x) for x in key)
        entry = self.index.key(row, bucket, epoch)
        try:
            stats, meta = self.cache.read(entry)
        except (LatentCacheError, KeyError) as e:
            if self.repair is None:
                raise
            logger.warning("Latent cache entry %s (row %d, bucket %d) unusable (%s): encoding it again.", entry, row,
                           bucket, getattr(e, "reason", "missing"))
            self.repair(row, bucket, epoch)
            self.index.repaired += 1
            stats, meta = self.cache.read(entry)
        item = {
            "latent_stats": torch.from_numpy(np.array(stats, dtype=np.float32)),
            "original_size": meta["original_size"],
            "crop_top_left": meta["crop_top_left"],
            "target_size": meta["target_size"],
            "caption": self._caption(row, epoch),
            "row": row,
            "source_row": int(meta.get("replaced_by", row)),  # the row whose pixels the entry holds
            "bucket": bucket if self.target_buckets is None else int(self.target_buckets[bucket]),
        }
        if self.index.references:  # an edit model: each reference's cached posterior (bucket = composite id)
            item["reference_latent_stats"] = [
                torch.from_numpy(np.array(self.cache.read(ref.key(row, bucket, epoch))[0], dtype=np.float32))
                for ref in self.index.references]
        return item

    @staticmethod
    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        """Stack a batch: ``latent_stats`` ``(B, 2, C, h, w)`` plus the common fields (:mod:`hf_arb.images.collate`);
        an edit model's ``reference_latent_stats``: one ``(B, 2, C, h_j, w_j)`` tensor per reference column."""
        import torch

        batch = {"latent_stats": torch.stack([it["latent_stats"] for it in items]), **collate_common(items)}
        if "reference_latent_stats" in items[0]:
            batch["reference_latent_stats"] = [torch.stack([it["reference_latent_stats"][j] for it in items])
                                               for j in range(len(items[0]["reference_latent_stats"]))]
        return batch


class CachedLatentsWithReferences:
    """:class:`CachedLatentDataset` items plus the references' fitted pixels, for an edit family whose text encoder
    sees the reference image (Qwen-Image-Edit: ``Family.reference_pixels_with_cache``).

    ``dataset[(row, composite id, epoch)]`` adds ``reference_pixel_values`` (one ``(3, H_j, W_j)`` per column) to
    the cached item, fitted for the cached *variant* of that epoch (``epoch % variants``), so the pixels the text
    encoder sees and the cached latents come from the same crop and flip (and from the same replacement row where
    the row's target or reference failed to decode when the cache was built); :meth:`collate` stacks them into one
    ``(B, 3, H_j, W_j)`` tensor per column. Only the references are opened; the target's latents are read.

    Args:
        cached: the dataset over the cache.
        images: a :class:`~hf_arb.images.references.BucketedReferenceDataset` over the same rows and keys.
    """

    def __init__(self, cached: CachedLatentDataset, images: Any) -> None:
        self.cached, self.images = cached, images

    def __len__(self) -> int:
        return len(self.cached)

    def __getitem__(self, key: tuple[int, int, int]) -> dict[str, Any]:
        item = self.cached[key]
        _, bucket, epoch = (int(x) for x in key)
        variant = variant_for_epoch(epoch, self.cached.index.variants)
        # A row whose image failed to decode when the cache was built holds its replacement's latents (target and
        # references): the encoder sees that replacement's references too, never the broken file.
        source = item["source_row"]
        item["reference_pixel_values"] = self.images.reference_sample((source, bucket, variant))[
            "reference_pixel_values"]
        return item

    @staticmethod
    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        """:meth:`CachedLatentDataset.collate` plus ``reference_pixel_values``: one ``(B, 3, H_j, W_j)`` per column."""
        import torch

        batch = CachedLatentDataset.collate(items)
        batch["reference_pixel_values"] = [torch.stack([it["reference_pixel_values"][j] for it in items])
                                           for j in range(len(items[0]["reference_pixel_values"]))]
        return batch
