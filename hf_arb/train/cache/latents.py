"""Bucketed latent cache: VAE-encode every (image, bucket, crop, flip) once and train from the cache.

Encoding an image with the VAE costs more than the UNet step for small batches; when the VAE is frozen, the
encoding of a given (image, bucket, crop, flip) never changes, so it can be computed once and read back.

Layout of a cache directory (safe to share between runs, datasets and ranks)::

    <root>/ab/ab12…ef.npy    float16, shape (2, C, h, w) ((2, C, F', h, w) for clips): the posterior's mean and std
    <root>/ab/ab12…ef.json   {"original_size": [h, w], "crop_top_left": [y, x], "target_size": [h, w]}

* **Key.** :func:`entry_key` hashes the image *content* (SHA-256 of its encoded bytes), the exact fit plan
  (bucket ``(w, h)``, scaled size, crop offset, flip: ``BucketedImageDataset.fit_row(...).key()``, known without
  decoding the image) and the VAE's identity (:func:`vae_fingerprint`: config and weights). An edited image, a changed
  bucket set or another VAE map to new keys, so only what changed is encoded again; everything else is reused.
* **Posterior, not a sample.** The cache stores the mean and std of the VAE's diagonal Gaussian; training draws
  ``mean + std * eps`` with its own generator, exactly what on-the-fly encoding does with the same ``eps``.
* **Variants.** With random crops or flips, freezing one crop per image would silently change training. Variant
  ``v`` of an image is the crop/flip the data pipeline produces at epoch ``v``; training at epoch ``e`` reads
  variant ``e % variants``. With ``variants >= epochs`` cached training sees exactly what on-the-fly training
  sees. Centre crops without flip have one variant.
* **Atomic writes.** Each file is written to a temporary name in the same directory and renamed; the ``.npy``
  is renamed last, and an entry exists only when its ``.npy`` does. Concurrent writers of the same key write the
  same bytes.
* **Per-rank share.** :func:`plan_share` splits the entries to check by position (``i % world == rank``), so ranks
  never disagree about who encodes what, even while other ranks are writing.
* **Memory-mapped reads.** :meth:`LatentCache.read` opens the ``.npy`` with ``mmap_mode="r"``.
* **Verified entries.** The ``.json`` also records the array's shape, dtype and CRC-32 (under ``"_entry"``, hidden
  from :meth:`LatentCache.read`'s metadata). Every read checks them and that the values are finite; a truncated,
  empty, wrong-shape, NaN-filled or otherwise damaged entry raises :class:`LatentCacheError` instead of training on
  it. :func:`fill_cache` re-encodes bad entries it would reuse (``CacheIndex.repaired``); the dataset over the cache
  (:mod:`hf_arb.train.cache.latent_dataset`) re-encodes through its ``repair`` callback. Non-finite latents are refused
  at write.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from .cache_keys import content_hash, content_hashes, entry_key, vae_fingerprint

__all__ = [
    "LatentCache",
    "LatentCacheError",
    "CacheIndex",
    "vae_fingerprint",
    "content_hash",
    "content_hashes",
    "entry_key",
    "plan_share",
    "variant_for_epoch",
]




def variant_for_epoch(epoch: int, variants: int) -> int:
    """Which cached variant epoch ``epoch`` trains on: ``epoch % variants``."""
    return int(epoch) % max(1, int(variants))


def plan_share(n: int, rank: int, world: int) -> np.ndarray:
    """Positions ``0..n-1`` this rank is responsible for (``i % world == rank``), shape ``(ceil((n-rank)/world),)``."""
    if not (0 <= rank < world):
        raise ValueError(f"rank must be in [0, world) = [0, {world}), got {rank}.")
    return np.arange(rank, n, world, dtype=np.int64)


logger = logging.getLogger(__name__)
_ENTRY = "_entry"  # meta key holding shape / dtype / crc32 of the .npy payload


# ---------------------------------------------------------------------------------------------- store
class LatentCacheError(ValueError):
    """A latent cache entry is missing a part, damaged or does not match what was written.

    Attributes:
        key: the entry's key.
        path: the ``.npy`` (or ``.json``) file at fault.
        reason: a short reason, e.g. ``"truncated .npy (cannot load: …)"`` or ``"non-finite values"``.
    """

    def __init__(self, key: str, path: Path, reason: str) -> None:
        self.key, self.path, self.reason = key, path, reason
        super().__init__(f"Latent cache entry {path}: {reason}. It is re-encoded on the next start of training "
                         f"(or delete the file).")


def _crc32(arr: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B")) & 0xFFFFFFFF


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class LatentCache:
    """A directory of latent posteriors keyed by :func:`entry_key`.

    Args:
        root: cache directory (created on first write).

    Example:
        ```py
        >>> cache = LatentCache("/tmp/latents")
        >>> cache.write("00" * 16, np.zeros((2, 4, 8, 12), np.float16), {"original_size": [64, 96]})
        >>> stats, meta = cache.read("00" * 16)
        >>> stats.shape, stats.dtype
        ((2, 4, 8, 12), dtype('float16'))
        ```
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def _paths(self, key: str) -> tuple[Path, Path]:
        base = self.root / key[:2] / key
        return base.with_suffix(".npy"), base.with_suffix(".json")

    def has(self, key: str) -> bool:
        """True when the entry is complete (its ``.npy`` exists)."""
        return self._paths(key)[0].exists()

    def write(self, key: str, stats: np.ndarray, meta: dict[str, Any]) -> None:
        """Store ``stats`` (``(2, C, h, w)``: mean and std) as float16 plus ``meta``, atomically."""
        import io

        arr = np.asarray(stats)
        if arr.ndim not in (4, 5) or arr.shape[0] != 2:  # (2, C, F', h, w) for clips
            raise ValueError(f"Latent stats must have shape (2, C, h, w) (mean and std), got {arr.shape}.")
        if not np.isfinite(arr).all():
            bad = int((~np.isfinite(arr)).sum())
            raise ValueError(
                f"Latent stats for {key} hold {bad} non-finite value(s) (NaN/inf) out of {arr.size}: the VAE failed on "
                "this image. They are not cached. Encode in float32 (an fp16 VAE overflows; SDXL: pass "
                "--pretrained_vae_model_name_or_path madebyollin/sdxl-vae-fp16-fix) or check the image."
            )
        with np.errstate(over="ignore"):
            arr16 = arr.astype(np.float16)
        if not np.isfinite(arr16).all():
            raise ValueError(
                f"Latent stats for {key} overflow float16 (max |x| = {float(np.abs(arr).max()):.3g}); "
                "the VAE produced values float16 cannot hold. Encode in float32 or use a VAE that does not overflow."
            )
        if _ENTRY in meta:
            raise ValueError(f"Metadata key {_ENTRY!r} is reserved by the latent cache.")
        entry = {"shape": list(arr16.shape), "dtype": "float16", "crc32": _crc32(arr16)}
        npy, meta_path = self._paths(key)
        _atomic_write_bytes(meta_path, json.dumps({**meta, _ENTRY: entry}, sort_keys=True).encode())
        buf = io.BytesIO()
        np.save(buf, arr16)
        _atomic_write_bytes(npy, buf.getvalue())

    def read(self, key: str) -> tuple[np.ndarray, dict[str, Any]]:
        """Memory-mapped ``(2, C, h, w)`` float16 stats and the metadata of an entry, verified.

        Raises:
            KeyError: there is no such entry.
            LatentCacheError: the entry is damaged: unreadable or truncated files, shape / dtype / checksum not
                those written, or non-finite values.
        """
        npy, meta_path = self._paths(key)
        if not npy.exists():
            raise KeyError(f"Latent cache {self.root} has no entry {key}. Rebuild the cache (--cache_latents).")
        try:
            meta = json.loads(meta_path.read_text())
            entry = meta.pop(_ENTRY)
            expected = (tuple(int(x) for x in entry["shape"]), str(entry["dtype"]), int(entry["crc32"]))
        except FileNotFoundError:
            raise LatentCacheError(key, meta_path, "missing .json metadata") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise LatentCacheError(key, meta_path,
                                   f"unreadable .json metadata or no checksum ({type(e).__name__})") from None
        try:
            arr = np.load(npy, mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:
            raise LatentCacheError(key, npy, f"truncated or corrupt .npy ({e})") from None
        if (tuple(arr.shape), str(arr.dtype)) != expected[:2]:
            raise LatentCacheError(key, npy,
                                   f"holds {arr.dtype} {tuple(arr.shape)}, expected {expected[1]} {expected[0]}")
        if _crc32(arr) != expected[2]:
            raise LatentCacheError(key, npy, "checksum mismatch (the file changed after it was written)")
        if ((np.asarray(arr).view(np.uint16) & 0x7C00) == 0x7C00).any():  # float16 exponent all ones: inf or NaN
            raise LatentCacheError(key, npy, "non-finite values")
        return arr, meta

    def check(self, key: str) -> str | None:
        """``None`` when the entry reads back intact, else the reason (missing entries give ``"missing"``)."""
        try:
            self.read(key)
        except KeyError:
            return "missing"
        except LatentCacheError as e:
            return e.reason
        return None

    def read_meta(self, key: str) -> dict[str, Any]:
        meta = json.loads(self._paths(key)[1].read_text())
        meta.pop(_ENTRY, None)
        return meta

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*/*.npy")) if self.root.exists() else 0


@dataclass
class CacheIndex:
    """Which cache entry each ``(row, target bucket, variant)`` reads.

    Attributes:
        keys: ``{(row, bucket_id): [key of variant 0, key of variant 1, ...]}``.
        variants: number of variants per image.
        encoded: entries this process encoded while building (0 when everything was reused), repaired ones included.
        reused: entries this process found already in the cache, intact.
        repaired: entries that existed but were damaged, and were encoded again (while building or, through
            :class:`~hf_arb.train.cache.latent_dataset.CachedLatentDataset`'s ``repair``, while training).
        references: an edit model's reference columns: one index per column, keyed by the same
            ``(row, composite id)`` pairs (the reference's own content and fit plan in each key).
    """

    keys: dict[tuple[int, int], list[str]]
    variants: int
    encoded: int = 0
    reused: int = 0
    repaired: int = 0
    references: list[CacheIndex] = field(default_factory=list)

    def key(self, row: int, bucket: int, epoch: int) -> str:
        try:
            return self.keys[(int(row), int(bucket))][variant_for_epoch(epoch, self.variants)]
        except KeyError:
            raise KeyError(
                f"Row {row} was not cached for bucket {bucket}. The latent cache was built for a different sampler "
                "plan (bucket set, --bucket_leftover or epochs changed?); rebuild it with --cache_latents."
            ) from None


def build_index(
    pairs: Iterable[tuple[int, int]],
    hashes: Sequence[str],
    plan_key: Callable[[int, int, int], Any],
    *,
    variants: int,
    vae_id: str,
) -> CacheIndex:
    """Keys for every ``(row, bucket)`` pair and variant.

    Args:
        pairs: ``(row, bucket_id)`` the sampler can ask for.
        hashes: content hash per row of the dataset, ``len == num_rows``.
        plan_key: ``(row, bucket, epoch)`` → a hashable description of the exact resize/crop/flip the data
            pipeline applies at that epoch (``BucketedImageDataset.fit_row(row, bucket, epoch).key()``), computed
            without opening the image. Variant ``v`` is epoch ``v``'s plan; identical plans (centre crops without
            flip) share one entry.
        variants: variants per image (>= 1).
        vae_id: :func:`vae_fingerprint` of the VAE.
    """
    if variants < 1:
        raise ValueError(f"--latent_cache_variants must be >= 1, got {variants}.")
    keys: dict[tuple[int, int], list[str]] = {}
    for row, bucket in pairs:
        row, bucket = int(row), int(bucket)
        keys[(row, bucket)] = [
            entry_key(hashes[row], plan_key(row, bucket, v), vae_id) for v in range(variants)
        ]
    return CacheIndex(keys=keys, variants=variants)


def fill_cache(
    cache: LatentCache,
    index: CacheIndex,
    *,
    rank: int,
    world: int,
    load_batch: Callable[[list[tuple[int, int, int]]], dict[str, Any]],
    encode: Callable[[Any], Any],
    batch_size: int, show_progress: bool = False,
) -> CacheIndex:
    """Encode this rank's share of the missing entries, batched by bucket; returns ``index`` with counts set.

    Args:
        cache: where entries live.
        index: from :func:`build_index`.
        rank, world: this process and the number of processes; entry ``i`` (in sorted key order) belongs to rank
            ``i % world``.
        load_batch: ``[(row, bucket, variant), ...]`` (one bucket) → a collated batch with ``pixel_values``
            ``(B, 3, H, W)``, ``original_sizes``, ``crop_top_lefts``, ``target_sizes`` (``(B, 2)`` each). The data
            pipeline's item for epoch ``variant`` is exactly variant ``variant``.
        encode: ``pixel_values`` → ``(B, 2, C, H/8, W/8)`` posterior mean and std (any array-like).
        batch_size: images per VAE call.
        show_progress: tqdm bars (checking entries, encoding the missing: counts, rates) on stderr, for the main
        process.
    """
    todo: list[tuple[str, int, int, int]] = sorted(
        {(k, row, bucket, v) for (row, bucket), ks in index.keys.items() for v, k in enumerate(ks)}
    )
    # Deduplicate identical keys (same image content twice in the dataset) before sharing out the work.
    seen: set[str] = set()
    unique = [t for t in todo if not (t[0] in seen or seen.add(t[0]))]  # type: ignore[func-returns-value]
    mine = [unique[i] for i in plan_share(len(unique), rank, world)]
    missing = []
    for t in tqdm(mine, desc="Checking latent cache", unit="entry", disable=not show_progress or not mine):
        reason = cache.check(t[0]) if cache.has(t[0]) else "missing"
        if reason is None:
            continue
        missing.append(t)
        if reason != "missing":
            index.repaired += 1
            logger.warning("Latent cache entry %s (row %d, bucket %d, variant %d) is damaged (%s): encoding it again.",
                           t[0], t[1], t[2], t[3], reason)
    index.reused = len(mine) - len(missing)
    by_bucket: dict[int, list[tuple[str, int, int, int]]] = {}
    for t in missing:
        by_bucket.setdefault(t[2], []).append(t)
    bar = tqdm(total=len(missing), desc="Encoding latents", unit="img", disable=not show_progress or not missing)
    for _bucket, items in sorted(by_bucket.items()):
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            batch = load_batch([(row, b, v) for _, row, b, v in chunk])
            stats = np.asarray(_to_numpy(encode(batch["pixel_values"])))  # (B, 2, C, h, w)
            for j, (key, *_rest) in enumerate(chunk):
                meta = {
                    "original_size": [int(x) for x in _to_numpy(batch["original_sizes"][j])],
                    "crop_top_left": [int(x) for x in _to_numpy(batch["crop_top_lefts"][j])],
                    "target_size": [int(x) for x in _to_numpy(batch["target_sizes"][j])],
                }
                used = int(_to_numpy(batch["rows"][j])) if "rows" in batch else chunk[j][1]
                if used != chunk[j][1]:  # an image that failed to decode: the entry holds its replacement's pixels
                    meta["replaced_by"] = used
                cache.write(key, stats[j], meta)
            index.encoded += len(chunk)
            bar.update(len(chunk))
    bar.close()
    return index


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    return np.asarray(x)
