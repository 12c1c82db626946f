"""Resolution tiers as pure functions: each row's bucket in every tier, from its stored size, vectorised.

A run at several base resolutions (512 and 1024, say) has one :class:`~hf_arb.buckets.BucketSet` per tier, built by
the same preset rule (:meth:`Tiers.preset`). The annotation stores every row's size once (``original_width``,
``original_height``); :func:`tier_bucket_ids` derives the row's bucket in each tier from it, in chunks, and marks
``-1`` where the row is not eligible there: no bucket (pruned by the set's rule), or the row would need more than
``max_upscale`` to cover its bucket (``max(bucket_w / w, bucket_h / h)``). Nothing of the dataset is copied per
tier: a tier is a column of small ints (``int16``), which the sampler turns into one bucket-grouped row index per
tier (:mod:`~hf_arb.sampling.planning.index`, 4 bytes per eligible row, shareable as a memory-mapped file).

OneTrainer's rule (a tier per row and epoch, uniform among the eligible ones) row by row: :func:`random_tier_ids`
combines the tier columns into one id per row over all (tier, bucket) pairs, with a counter-based hash of
``(seed, epoch, row)``, so that any process computes the same draw for any chunk of rows (the packing sampler's
draw; the bucketed ``random`` schedule draws the same law per row group, :mod:`~hf_arb.sampling.tiered.draw`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hf_arb.buckets.sets import BucketSet

from ..planning.batch_sizes import batch_sizes_for_pixels
from ..planning.index import CHUNK

TIER_RANDOM = 31  #: stream tag of the ``random`` schedule's per-row draw (hf_arb.rng's tags are < 30)
_M1, _M2, _GAMMA = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class Tiers:
    """The tiers of a multi-resolution run.

    Attributes:
        resolutions: the base resolution of each tier, ``(T,)`` ints (e.g. ``(512, 1024)``), unique.
        bucket_sets: one BucketSet per tier.
        max_upscale: a row serves a tier only if covering its bucket there scales it by at most this (1.0: never
            upscale).
    """

    resolutions: tuple[int, ...]
    bucket_sets: tuple[BucketSet, ...]
    max_upscale: float = 1.0

    def __post_init__(self) -> None:
        if len(self.resolutions) != len(self.bucket_sets) or not self.resolutions:
            raise ValueError(f"Tiers need one BucketSet per resolution, got {len(self.resolutions)} resolutions and "
                             f"{len(self.bucket_sets)} bucket sets.")
        if len(set(self.resolutions)) != len(self.resolutions):
            raise ValueError(f"Tier resolutions must be unique, got {list(self.resolutions)}: drop the duplicates.")
        if not (float(self.max_upscale) > 0 and np.isfinite(self.max_upscale)):
            raise ValueError(f"`max_upscale` must be a finite number > 0 (1.0: no upscale), got {self.max_upscale!r}.")

    @classmethod
    def preset(cls, name: str, resolutions: Sequence[int], step: int | None = None, *, max_upscale: float = 1.0,
               **kwargs: Any) -> Tiers:
        """One :meth:`BucketSet.preset` ``name`` per base resolution (the same rule, scaled), e.g.
        ``Tiers.preset("budget", [512, 1024])``; ``kwargs`` go to every preset."""
        res = tuple(int(r) for r in resolutions)
        return cls(res, tuple(BucketSet.preset(name, r, step, **kwargs) for r in res), float(max_upscale))

    @property
    def num_tiers(self) -> int:
        """``T``."""
        return len(self.resolutions)

    @property
    def num_buckets(self) -> np.ndarray:
        """Buckets per tier, int64 ``(T,)``."""
        return np.array([len(b) for b in self.bucket_sets], np.int64)

    @property
    def offsets(self) -> np.ndarray:
        """First combined (tier, bucket) id of each tier, int64 ``(T + 1,)`` (the last: the total ``K``)."""
        return np.concatenate([[0], np.cumsum(self.num_buckets)]).astype(np.int64)

    def fingerprint(self) -> list[dict[str, Any]]:
        """What identifies the tiers in a sampler state: resolution and bucket-set fingerprint of each tier."""
        return [{"resolution": r, "buckets": b.fingerprint} for r, b in zip(self.resolutions, self.bucket_sets)]


def tier_bucket_ids(widths: Any, heights: Any, tiers: Tiers, *, out: np.ndarray | None = None) -> np.ndarray:
    """Every row's bucket in every tier, ``-1`` where it is not eligible: int16 ``(T, n)``.

    Args:
        widths, heights: the rows' stored sizes, shape ``(n,)``; rows with a missing (NaN) or non-positive size are
            eligible nowhere.
        tiers: the :class:`Tiers` (bucket sets and ``max_upscale``).
        out: optional int16 array ``(T, n)`` to fill (e.g. a memory-mapped ``.npy`` shared by a node's ranks).

    Computed in chunks of :data:`~hf_arb.sampling.planning.index.CHUNK` rows (temporaries of a few MB whatever ``n``).
    """
    w_all, h_all = np.asarray(widths), np.asarray(heights)
    if w_all.shape != h_all.shape or w_all.ndim != 1:
        raise ValueError(f"`widths` and `heights` must be 1-D of the same length, got {w_all.shape} and "
                         f"{h_all.shape}. Pass the `original_width` and `original_height` columns.")
    n, T = w_all.size, tiers.num_tiers
    if any(len(b) >= 2**15 - 1 for b in tiers.bucket_sets):
        raise ValueError("A tier has more than 32766 buckets: use a smaller bucket set.")
    if out is None:
        out = np.empty((T, n), np.int16)
    elif out.shape != (T, n) or out.dtype != np.int16:
        raise ValueError(f"`out` must be int16 of shape {(T, n)}, got {out.dtype} {out.shape}.")
    limit = float(tiers.max_upscale) * (1 + 1e-9)
    for c0 in range(0, n, CHUNK):
        w = w_all[c0 : c0 + CHUNK].astype(np.float64)  # (m,)
        h = h_all[c0 : c0 + CHUNK].astype(np.float64)
        good = np.isfinite(w) & np.isfinite(h) & (w > 0) & (h > 0)  # (m,)
        wg, hg = w[good], h[good]
        for t, bs in enumerate(tiers.bucket_sets):
            ids = np.full(w.size, -1, np.int16)
            if wg.size:
                b, _ = bs.assign(wg, hg)  # (m_good,) int32, -1 where pruned
                res = bs.resolutions[np.maximum(b, 0)].astype(np.float64)  # (m_good, 2)
                scale = np.maximum(res[:, 0] / wg, res[:, 1] / hg)
                ids[good] = np.where((b >= 0) & (scale <= limit), b, -1)
            out[t, c0 : c0 + w.size] = ids
    return out


def tier_batch_sizes(tiers: Tiers, *, batch_size: Any = None, max_pixels_per_batch: int | None = None,
                     needed: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """Rows per rank of a batch of every (tier, bucket): a list of int64 ``(k_t,)`` arrays.

    Args:
        tiers: the :class:`Tiers`.
        batch_size: with ``max_pixels_per_batch``: a cap on every batch (None: no cap). Without: one int for every
            bucket, or one entry per tier (an int, or ints of shape ``(k_t,)``).
        max_pixels_per_batch: one pixel budget for every tier: bucket ``b`` of tier ``t`` gets
            ``floor(budget / (w × h))`` rows (:func:`~hf_arb.sampling.planning.batch_sizes.batch_sizes_for_pixels`), so
            a 512² step holds four times the images of a 1024² one.
        needed: optional bool masks ``(k_t,)`` of the buckets that must hold one image (those with rows).
    """
    T = tiers.num_tiers
    if max_pixels_per_batch is not None:
        return [batch_sizes_for_pixels(bs, max_pixels_per_batch, max_batch_size=batch_size,
                                       needed=None if needed is None else needed[t])
                for t, bs in enumerate(tiers.bucket_sets)]
    if batch_size is None:
        raise ValueError("Pass `batch_size` (an int, or one per tier) or `max_pixels_per_batch` (one pixel budget "
                         "for every tier).")
    per_tier = list(batch_size) if isinstance(batch_size, (list, tuple)) else [batch_size] * T
    if len(per_tier) != T:
        raise ValueError(f"`batch_size` has {len(per_tier)} entries for {T} tiers: give one per tier "
                         f"{list(tiers.resolutions)}, or one int.")
    out = []
    for t, (b, k) in enumerate(zip(per_tier, tiers.num_buckets.tolist())):
        arr = np.asarray(b)
        sizes = np.full(k, arr, np.int64) if arr.ndim == 0 else arr.astype(np.int64)
        if sizes.shape != (k,) or arr.dtype.kind not in "iu" or (sizes < 1).any():
            raise ValueError(f"The batch size of tier {t} ({tiers.resolutions[t]}) must be a positive int or {k} "
                             f"positive ints (one per bucket), got {b!r}.")
        out.append(sizes)
    return out


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser of ``x`` (uint64, any shape): a counter-based hash, uniform 64-bit output."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def row_draws(seed: int, epoch: int, rows: np.ndarray) -> np.ndarray:
    """A uniform uint64 per row for ``(seed, epoch)``: ``rows`` int ``(m,)`` → uint64 ``(m,)``."""
    key = splitmix64(np.array([seed * 0x1000193 + TIER_RANDOM], np.uint64))[0]
    key = splitmix64(np.array([key ^ np.uint64(epoch)], np.uint64))[0]
    return splitmix64(rows.astype(np.uint64) ^ key)


def random_tier_ids(tier_ids: np.ndarray, offsets: np.ndarray, seed: int, epoch: int, *,
                    out: np.ndarray | None = None) -> np.ndarray:
    """OneTrainer's draw for one epoch: each row's combined (tier, bucket) id, ``-1`` where eligible nowhere.

    Args:
        tier_ids: :func:`tier_bucket_ids`, int16 ``(T, n)``.
        offsets: first combined id of each tier, ``(T + 1,)`` (:attr:`Tiers.offsets`).
        seed, epoch: key of the draw; row ``r`` trains at the ``(hash(seed, epoch, r) mod e_r)``-th of its ``e_r``
            eligible tiers (uniform among them).
        out: optional int16 array ``(n,)`` to fill.

    Returns:
        int16 ``(n,)``: ``offsets[t] + bucket`` of the drawn tier ``t``. Computed in chunks.
    """
    T, n = tier_ids.shape
    if offsets[-1] >= 2**15 - 1:
        raise ValueError(f"The tiers have {int(offsets[-1])} buckets in all; at most 32766 are supported.")
    out = np.empty(n, np.int16) if out is None else out
    off = np.asarray(offsets[:T], np.int64)[:, None]  # (T, 1)
    for c0 in range(0, n, CHUNK):
        ids = np.asarray(tier_ids[:, c0 : c0 + CHUNK])  # (T, m)
        elig = ids >= 0
        n_el = elig.sum(axis=0)  # (m,)
        u = row_draws(seed, epoch, np.arange(c0, c0 + ids.shape[1], dtype=np.int64))
        j = (u % np.maximum(n_el, 1).astype(np.uint64)).astype(np.int64)  # (m,) which eligible tier
        pick = elig & (np.cumsum(elig, axis=0, dtype=np.int16) == j + 1)  # (T, m) one True where eligible
        t = np.argmax(pick, axis=0)  # (m,)
        comb = (off[:, 0][t] + ids[t, np.arange(ids.shape[1])]).astype(np.int16)
        out[c0 : c0 + ids.shape[1]] = np.where(n_el > 0, comb, -1)
    return out


def sizes_fingerprint(widths: np.ndarray, heights: np.ndarray, tiers: Tiers) -> str:
    """A hash of the sizes ``(n,)`` (chunk by chunk, no ``O(n)`` copy), the tiers' bucket sets and
    ``max_upscale``: a saved state only applies to the same tier columns. Sizes are hashed as float32 (exact for
    sides below 2²⁴; NaN kept), so integer columns and a dataset's float column with nulls hash alike."""
    h = hashlib.blake2b(digest_size=16)
    for c0 in range(0, widths.size, CHUNK):
        for col in (widths, heights):
            h.update(memoryview(np.ascontiguousarray(col[c0 : c0 + CHUNK], dtype=np.float32)).cast("B"))
    h.update(repr((tiers.fingerprint(), float(tiers.max_upscale))).encode())
    return h.hexdigest()


__all__ = ["TIER_RANDOM", "Tiers", "random_tier_ids", "row_draws", "sizes_fingerprint", "splitmix64",
           "tier_batch_sizes",
           "tier_bucket_ids"]
