"""Prior preservation's pairing: every instance row of a batch gets a class row of the batch's bucket.

A pure function of the run's seed, the epoch and the step's rows (which the epoch plan fixes from the seed, the epoch
and the step): no state, no rank. So every rank pairs a step's rows alike, and a resumed run pairs exactly as the
uninterrupted one did.

* Class rows are grouped by bucket (:func:`class_pools`). A bucket with no class row of its own borrows the pool of
  the nearest bucket that has some (in log aspect ratio, then log area, then the lower id); the borrowed class images
  are fitted (resized to cover and cropped) into the instance batch's bucket like any other image.
* In epoch ``e`` the pool of bucket ``p`` is shuffled with ``generator(seed, e, p, PAIR_STREAM)``, and the instance
  row that is ``j``-th of its own bucket (in row order) takes the shuffled pool's entry ``j mod len(pool)``
  (:func:`paired_class_rows`). Rows of one bucket thus take distinct class rows while the pool is at least as large
  as the bucket; a smaller pool is cycled.

Example:
    ```py
    >>> import numpy as np
    >>> from hf_arb.sampling.pairing import class_pools, instance_ranks, paired_class_rows
    >>> res = np.array([[64, 64], [96, 48]])
    >>> pools = class_pools(np.array([0, 0, 1]), res)
    >>> ranks = instance_ranks(np.array([1, 0, 1]))
    >>> paired_class_rows(np.array([0, 2]), np.array([1, 1]), epoch=0, seed=0, ranks=ranks, pools=pools).tolist()
    [2, 2]
    ```
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hf_arb.rng import generator

__all__ = ["PAIR_STREAM", "ClassPools", "class_pools", "instance_ranks", "paired_class_rows"]

#: the entropy tag of the pools' per-epoch shuffles (``generator(seed, epoch, pool bucket, PAIR_STREAM)``)
PAIR_STREAM = 0x5052


@dataclass(frozen=True)
class ClassPools:
    """Class rows by bucket.

    Attributes:
        order: the assigned class rows grouped by bucket (ascending bucket, then row), int64 ``(m,)``.
        start: ``order[start[b]:start[b + 1]]`` are bucket ``b``'s class rows, int64 ``(k + 1,)``.
        source: the bucket whose class rows serve bucket ``b`` (``b`` itself when it has some, else the nearest
            bucket that has; -1 when no bucket has a class row), int64 ``(k,)``.
    """

    order: np.ndarray
    start: np.ndarray
    source: np.ndarray

    @property
    def counts(self) -> np.ndarray:
        """Class rows of each bucket (its own, not borrowed), int64 ``(k,)``."""
        return np.diff(self.start)

    def pool(self, bucket: int) -> np.ndarray:
        """The class rows that serve ``bucket`` (borrowed where it has none)."""
        src = int(self.source[bucket])
        if src < 0:
            raise ValueError("No class row is assigned to any bucket: there is nothing to pair with.")
        return self.order[self.start[src]:self.start[src + 1]]


def class_pools(class_buckets: np.ndarray, resolutions: np.ndarray) -> ClassPools:
    """Group class rows by bucket and pick, for each bucket without any, the nearest bucket with some.

    Args:
        class_buckets: the bucket of each class row, ``(m,)`` (-1: skipped, never paired).
        resolutions: the bucket table's ``(width, height)``, ``(k, 2)``.
    """
    res = np.asarray(resolutions, dtype=np.float64).reshape(-1, 2)
    k = len(res)
    ids = np.asarray(class_buckets, dtype=np.int64).reshape(-1)
    if ids.size and ids.max() >= k:
        raise ValueError(f"A class row's bucket {int(ids.max())} is outside the table of {k} buckets.")
    rows = np.flatnonzero(ids >= 0)
    order = rows[np.argsort(ids[rows], kind="stable")]
    counts = np.bincount(ids[rows], minlength=k)
    start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    have = np.flatnonzero(counts > 0)
    source = np.full(k, -1, np.int64)
    if have.size:
        aspect, area = np.log(res[:, 0] / res[:, 1]), np.log(res[:, 0] * res[:, 1])
        d_aspect = np.round(np.abs(aspect[:, None] - aspect[None, have]), 12)  # (k, h); rounded: ties are ties
        d_area = np.round(np.abs(area[:, None] - area[None, have]), 12)
        # lexicographic minimum over (aspect distance, area distance, bucket id); have is ascending, so argmin's
        # first index breaks the last tie by the lower id
        best_aspect = d_aspect == d_aspect.min(axis=1, keepdims=True)
        masked_area = np.where(best_aspect, d_area, np.inf)
        source = have[np.argmin(masked_area, axis=1)]
    return ClassPools(order=order, start=start, source=source)


def instance_ranks(instance_buckets: np.ndarray) -> np.ndarray:
    """Each row's position among the rows of its own bucket, in row order (-1 for skipped rows), int64 ``(n,)``."""
    ids = np.asarray(instance_buckets, dtype=np.int64).reshape(-1)
    ranks = np.full(ids.shape, -1, np.int64)
    rows = np.flatnonzero(ids >= 0)
    if rows.size:
        order = rows[np.argsort(ids[rows], kind="stable")]  # by bucket, rows ascending within
        sorted_ids = ids[order]
        first = np.searchsorted(sorted_ids, sorted_ids, side="left")
        ranks[order] = np.arange(order.size) - first
    return ranks


def paired_class_rows(rows: np.ndarray, targets: np.ndarray, *, epoch: int, seed: int, ranks: np.ndarray,
                      pools: ClassPools) -> np.ndarray:
    """The class row paired with each instance row of a step.

    Args:
        rows: the step's instance rows, ``(b,)``.
        targets: the bucket each of them trains in (the batch's bucket), ``(b,)``.
        epoch: the epoch; seed: the run's seed.
        ranks: :func:`instance_ranks` of the instance bucket column.
        pools: :func:`class_pools` of the class bucket column.

    Returns:
        int64 ``(b,)`` class rows, each from the pool serving its target bucket.
    """
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    targets = np.asarray(targets, dtype=np.int64).reshape(-1)
    out = np.empty(rows.shape, np.int64)
    position = np.maximum(ranks[rows], 0)  # a catch-all row keeps its own bucket's rank
    for t in np.unique(targets):
        pool = pools.pool(int(t))
        src = int(pools.source[t])
        shuffled = pool[generator(seed, epoch, src, PAIR_STREAM).permutation(pool.size)]
        sel = targets == t
        out[sel] = shuffled[position[sel] % pool.size]
    return out
