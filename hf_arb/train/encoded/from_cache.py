"""``hf-arb encode --from-cache DIR``: convert a per-file latent cache (``--cache_latents --latent_cache_dir DIR``,
:mod:`hf_arb.train.cache.latents`) into an encoded dataset, with no VAE call.

The plan is :func:`~hf_arb.train.encoded.encode.plan_encode`'s (the run's own, from its flags); each planned
``(row, bucket, variant)`` entry is looked up under the key the cache itself computes for it
(:func:`~hf_arb.train.cache.latents.build_index` over the content hashes, the fit plans and the VAE's weights
fingerprint; the VAE is loaded for that hash, never run) and its float16 posterior is copied as is. Prompt
embeddings are not in the per-file cache: the text encoders encode them, exactly as ``hf-arb encode`` does.

Every planned entry is checked first (:meth:`~hf_arb.train.cache.latents.LatentCache.check`); a missing or damaged
one refuses the conversion in one line naming how many and which, before any latents shard is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.checks import UsageError

from .encode import EncodeBatch, EncodePlan, encode_share, finish, plan_encode


class CacheBatch(EncodeBatch):
    """:class:`~hf_arb.train.encoded.encode.EncodeBatch` whose latents come from a per-file latent cache: the same
    columns, read instead of encoded (the VAE is loaded for its weights fingerprint, never called). Prompts are
    encoded by the text encoders as in an encode."""

    progress_desc = "Reading the latent cache"

    def __init__(self, args: argparse.Namespace, ds: Any = None, buckets: Any = None, device: Any = None, *,
                 cache_dir: str | Path, plan: EncodePlan) -> None:
        super().__init__(args, ds, buckets, device)
        from ..cache.latents import LatentCache, build_index, content_hashes

        self.cache = LatentCache(cache_dir)
        vae_id = self.vae_id  # the cache's key, as build_latent_cache computes it
        if args.image_interpolation_mode != "lanczos":
            vae_id = f"{vae_id}|{args.image_interpolation_mode}"
        rows = np.unique(plan.entries[:, 0])
        hashes = [""] * len(self.images)
        for r, h in zip(rows.tolist(), content_hashes(plan.ds, args.image_column, rows.tolist())):
            hashes[r] = h
        pairs = sorted({(int(r), int(b)) for r, b in plan.entries[:, :2]})
        self.index = build_index(pairs, hashes, lambda row, b, v: self.images.fit_row(row, b, v).key(),
                                 variants=plan.variants, vae_id=vae_id)
        col = args.caption_column
        self.captions = plan.ds.select_columns([col]) if col in plan.ds.column_names else None  # no image decoded

    def key(self, row: int, bucket: int, variant: int) -> str:
        """The cache key of a planned entry (what ``--cache_latents`` stores it under)."""
        return self.index.keys[(int(row), int(bucket))][int(variant)]

    def problems(self, entries: np.ndarray) -> list[tuple[int, int, int, str]]:
        """``(row, bucket, variant, reason)`` of each planned entry the cache lacks or holds damaged."""
        found = []
        for r, b, v in entries.tolist():
            reason = self.cache.check(self.key(r, b, v))
            if reason is not None:
                found.append((r, b, v, reason))
        return found

    def latents(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The ``latents`` columns of ``batch``'s entries, read from the cache (sorted by row, bucket, variant)."""
        from hf_arb.images.collate import choose_caption

        rows, buckets, variants = (np.asarray(batch[k], np.int64) for k in ("row", "bucket", "variant"))
        order = np.lexsort((variants, buckets, rows))
        out: dict[str, list[Any]] = {k: [] for k in ("row", "bucket", "variant", "source_row", "caption",
                                                      "latent_stats", "latent_shape", "original_size",
                                                      "crop_top_left", "target_size")}
        for i in order.tolist():
            r, b, v = int(rows[i]), int(buckets[i]), int(variants[i])
            stats, meta = self.cache.read(self.key(r, b, v))
            used = int(meta.get("replaced_by", r))  # a row that failed to decode: its replacement's pixels
            col = self.args.caption_column
            caption = "" if self.captions is None else choose_caption(self.captions[used][col], seed=self.images.seed,
                                                                      epoch=v, row=used, column=col)
            for k, x in (("row", r), ("bucket", b), ("variant", v), ("source_row", used), ("caption", caption),
                         ("latent_stats", np.ascontiguousarray(stats).tobytes()), ("latent_shape", list(stats.shape)),
                         ("original_size", meta["original_size"]), ("crop_top_left", meta["crop_top_left"]),
                         ("target_size", meta["target_size"])):
                out[k].append(x)
        return out


def convert_cache(args: argparse.Namespace, out_dir: str | Path, cache_dir: str | Path, *,
                  num_processes: int | None = None, shard_size: int = 1000, prompt_shard_size: int = 10000,
                  device: Any = None, show_progress: bool = True) -> dict[str, Any]:
    """Write the encoded dataset of ``args`` into ``out_dir`` from the per-file latent cache ``cache_dir`` (one
    process; kept shards are reused as in an encode). Raises :class:`UsageError` (one line) when a planned entry is
    missing from the cache or damaged, before writing. Returns the info (as :func:`finish`) and the counts."""
    from ..environment import one_process

    if not one_process():
        raise UsageError("--from-cache reads the cache in one process: run hf-arb encode --from-cache without "
                         "accelerate launch (--num-processes N plans for a training run on N processes).")
    if not Path(cache_dir).is_dir():
        raise UsageError(f"--from-cache {cache_dir}: no such folder (the --latent_cache_dir of a --cache_latents run, "
                         "default OUTPUT_DIR/latent_cache).")
    plan = plan_encode(args, num_processes or 1)
    if device is None:  # as hf-arb encode: the prompt embeddings on the device a run would encode them on
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    made: list[CacheBatch] = []

    def make(a: argparse.Namespace, ds: Any, buckets: Any, dev: Any) -> CacheBatch:
        made.append(CacheBatch(a, ds, buckets, dev, cache_dir=cache_dir, plan=plan))
        bad = made[-1].problems(plan.entries)
        if bad:
            missing = sum(1 for *_, why in bad if why == "missing")
            named = "; ".join(f"row {r} bucket {b} variant {v}: {why}" for r, b, v, why in bad[:3])
            raise UsageError(
                f"--from-cache {cache_dir}: {len(bad)} of the {len(plan.entries)} planned entries are missing "
                f"({missing}) or damaged ({len(bad) - missing}) ({named}{'; ...' if len(bad) > 3 else ''}): fill the "
                "cache by training once with these flags and --cache_latents --latent_cache_dir DIR, or run hf-arb "
                "encode without --from-cache to encode them with the VAE.")
        return made[-1]

    counts = encode_share(args, out_dir, num_processes=num_processes or 1, shard_size=shard_size,
                          prompt_shard_size=prompt_shard_size, device=device, show_progress=show_progress, plan=plan,
                          make_batch=make)
    info = finish(args, out_dir, plan, shard_size=shard_size, prompt_shard_size=prompt_shard_size)
    return {**info, **{k: v for k, v in counts.items() if k != "bad"}}


__all__ = ["CacheBatch", "convert_cache"]
