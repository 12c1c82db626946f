"""The epoch plan as a pure function of (bucket ids, batch size, world size, seed, epoch, options).

:func:`plan_epoch` returns an ``int64`` array of shape ``(steps, world, batch)``: ``plan[s, r]`` is the batch rank
``r`` trains on at step ``s``. Every rank computes the same array from the same inputs, so all ranks agree on the
number of steps and, with ``sync_buckets=True``, on the bucket of every step.

How a synchronised plan is built (:mod:`~hf_arb.sampling.planning.sync` has the details):

1. Rows are grouped by (effective) bucket once: a 4-byte-per-row index (:mod:`~hf_arb.sampling.planning.index`), which
   the sampler can share between the ranks of a node as a memory-mapped file.
2. Each bucket's rows are put in a pseudo-random order by a keyed Feistel permutation (``seed, epoch, bucket``;
   :mod:`~hf_arb.sampling.planning.feistel`) and cut into *global* batches of ``world × batch`` rows. What does not fill
   a last global batch is the bucket's leftover: dropped (a different random subset each epoch), completed with
   repeats from the same bucket (``"fill"``), or pooled into catch-all batches served at a base bucket
   (``"catch_all"``).
3. All global batches are put in one random order (another Feistel permutation). A uniform shuffle of whole
   batches draws, at every step, a bucket with probability proportional to its remaining batches — exactly
   NovelAI's "probability proportional to remaining size" (``docs/sampler.md`` has the proof).
4. Global batch ``j`` is split into ``world`` consecutive chunks of ``batch`` rows; rank ``r`` takes chunk ``r``.
   Only the global batch size enters steps 1–3, so a run checkpointed on ``W1`` processes resumes on ``W2``
   processes with the same global batch and continues the same global sequence.

Every permutation is evaluated at the positions a step needs, so step ``t``'s batch costs ``O(batch)`` whatever
``t`` (``O(1)`` resume) and an epoch's state is ``O(buckets)``.
"""

from __future__ import annotations

from typing import Any, Literal, overload

import numpy as np

from hf_arb.checks import check_nonneg, check_positive  # noqa: F401  (re-exported)

from .index import RowIndex, build_index
from .layout import IndependentLayout, bucket_counts
from .sync import SyncLayout

Leftover = Literal["drop", "fill", "catch_all"]
LEFTOVERS = ("drop", "fill", "catch_all")
CHUNK_STEPS = 4096  # steps materialised at a time (bounds temporary memory)


# --------------------------------------------------------------------------------------------------- validation
def as_bucket_ids(bucket_ids: Any) -> np.ndarray:
    """Validate bucket ids → an integer array of shape ``(n,)`` (``-1`` = never sampled).

    An integer numpy array is returned as it is (no copy: at 10⁸ rows an ``int8``/``int16`` id column is
    100–200 MB, and the plan never needs a wider copy); lists, bools and integral floats are converted.
    """
    arr = np.asarray(bucket_ids)
    if arr.ndim != 1:
        raise ValueError(
            f"`bucket_ids` must be 1-D (one bucket id per row), got shape {arr.shape}. "
            "Pass the dataset's `bucket` column or a flat list of ints."
        )
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind == "b":
        arr = arr.astype(np.int8)
    elif arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"`bucket_ids` must be integers, got dtype {arr.dtype}. Use the `bucket` column.")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < -1:
        i = int(np.argmin(arr))
        raise ValueError(f"`bucket_ids` must be >= -1 (-1 marks a skipped row), but bucket_ids[{i}] = {lo}.")
    if hi >= 2**15 - 1:
        raise ValueError(f"At most 32766 buckets are supported, got bucket id {hi}.")
    return arr


def check_leftover(leftover: Any) -> str:
    """``leftover`` if it is one of :data:`LEFTOVERS`, else a ValueError listing them."""
    if leftover not in LEFTOVERS:
        raise ValueError(f"`leftover` must be one of {LEFTOVERS}, got {leftover!r}.")
    return str(leftover)


# --------------------------------------------------------------------------------------------------- merging
def merge_small_buckets(counts: Any, aspects: Any, min_rows: int, groups: Any = None) -> np.ndarray:
    """Map every bucket with fewer than ``min_rows`` rows onto the nearest big bucket in log aspect.

    Args:
        counts: rows per bucket, shape ``(k,)``.
        aspects: bucket aspect ratios ``width / height``, shape ``(k,)``.
        min_rows: a bucket is "small" below this many rows (the sampler uses one global batch; ``(k,)`` per bucket).
        groups: optional ``(k,)`` labels (the buckets' frame counts): a bucket merges only within its group, so an
            image never joins a clip's batch, nor a 17-frame clip an 81-frame one.

    Returns:
        ``np.ndarray[int64]`` of shape ``(k,)``: ``mapping[b]`` is the bucket that serves bucket ``b``'s rows
        (``b`` itself for big or empty buckets). When no bucket (of a group) is big, everything (of the group)
        merges into the most populous bucket.
    """
    if groups is not None and np.unique(np.asarray(groups)).size > 1:  # one group (images): the plain merge
        g = np.asarray(groups)
        counts = np.asarray(counts, dtype=np.int64)
        if g.shape != counts.shape:
            raise ValueError(f"`groups` must have shape {counts.shape}, got {g.shape}.")
        mapping = np.arange(counts.size, dtype=np.int64)
        per_bucket = np.ndim(min_rows) > 0  # one minimum per bucket (its global batch) or one for all
        for label in np.unique(g).tolist():  # the few frame counts
            members = np.flatnonzero(g == label)
            mins = np.asarray(min_rows)[members] if per_bucket else min_rows
            mapping[members] = members[merge_small_buckets(counts[members], np.asarray(aspects)[members], mins)]
        return mapping
    counts = np.asarray(counts, dtype=np.int64)
    log_aspect = np.log(np.asarray(aspects, dtype=np.float64))
    if counts.shape != log_aspect.shape or counts.ndim != 1:
        raise ValueError(
            f"`counts` and `aspects` must both have shape (k,), got {counts.shape} and {log_aspect.shape}."
        )
    mapping = np.arange(counts.size, dtype=np.int64)
    big = np.flatnonzero(counts >= min_rows)
    if big.size == 0:
        big = np.array([int(np.argmax(counts))])
    small = np.flatnonzero((counts > 0) & (counts < min_rows))
    small = small[~np.isin(small, big)]
    if small.size:
        dist = np.abs(log_aspect[small, None] - log_aspect[None, big])  # (small, big)
        # ties → the bigger bucket (lexsort: last key is primary)
        mapping[small] = [big[np.lexsort((-counts[big], d))[0]] for d in dist]
    return mapping


def num_buckets(ids: np.ndarray) -> int:
    """``max(ids) + 1`` (0 when no row is assigned)."""
    return int(ids.max()) + 1 if ids.size and ids.max() >= 0 else 0


def check_merge_map(merge_map: Any, ids: np.ndarray) -> np.ndarray:
    """``merge_map`` as int64 ``(k',)`` with ``k' >=`` the number of bucket ids, else a ValueError."""
    k = num_buckets(ids)
    mm = np.asarray(merge_map, dtype=np.int64)
    if mm.ndim != 1 or mm.size < k:
        raise ValueError(f"`merge_map` must have shape (k,) with k >= {k} (one target per bucket), got {mm.shape}.")
    return mm


def effective_ids(ids: np.ndarray, merge_map: Any | None) -> tuple[np.ndarray, int]:
    """Bucket ids after merging (shape ``(n,)``; an ``O(n)`` copy when merging) and the number of bucket ids
    ``k`` they range over. Only the independent per-rank layout needs them row by row."""
    k = num_buckets(ids)
    if merge_map is None:
        return ids, k
    mm = check_merge_map(merge_map, ids)
    eff = np.where(ids >= 0, mm[np.maximum(ids, 0)], -1).astype(np.int32)
    return eff, max(k, mm.size)


# --------------------------------------------------------------------------------------------------- layouts
def make_layout(eff_ids: np.ndarray | None, k: int, *, batch_size: int, world_size: int, seed: int, epoch: int,
                shuffle: bool, sync_buckets: bool, leftover: str, catch_all_bucket: int | None,
                index: RowIndex | None = None) -> SyncLayout | IndependentLayout:
    """The layout of one epoch (see :mod:`hf_arb.sampling.planning.layout`). A synchronised layout reads the grouped
    rows ``index`` (built from ``eff_ids`` when None); an independent one reads ``eff_ids``."""
    if sync_buckets:
        if index is None:
            index = build_index(eff_ids, None, k)  # type: ignore[arg-type]
        return SyncLayout(index, world_size, batch_size, seed, epoch, shuffle, leftover, catch_all_bucket)
    return IndependentLayout(eff_ids, k, world_size, batch_size, seed, epoch, shuffle, leftover, catch_all_bucket)


def iter_chunks(layout: Any, start: int = 0, max_chunk: int = CHUNK_STEPS, rank: int | None = None) -> Any:
    """Yield ``(s0, rows)`` with ``rows`` of shape ``(m, world, batch)`` for steps ``[start, steps)`` (with
    ``rank``: ``(m, 1, batch)``, that rank's batches only).

    Chunks grow 1, 8, 64, … steps: the first batch after a resume computes one step.
    """
    s0, size = start, 1
    while s0 < layout.num_steps:
        s1 = min(layout.num_steps, s0 + size)
        size = min(size * 8, max_chunk)
        yield s0, layout.rows(s0, s1, rank)
        s0 = s1


# --------------------------------------------------------------------------------------------------- the function
@overload
def plan_epoch(bucket_ids: Any, batch_size: int, world_size: int = ..., *, seed: int = ..., epoch: int = ...,
               shuffle: bool = ..., sync_buckets: bool = ..., leftover: Leftover = ...,
               catch_all_bucket: int | None = ..., merge_map: Any | None = ...,
               return_buckets: Literal[False] = ...) -> np.ndarray: ...


@overload
def plan_epoch(bucket_ids: Any, batch_size: int, world_size: int = ..., *, seed: int = ..., epoch: int = ...,
               shuffle: bool = ..., sync_buckets: bool = ..., leftover: Leftover = ...,
               catch_all_bucket: int | None = ..., merge_map: Any | None = ...,
               return_buckets: Literal[True]) -> tuple[np.ndarray, np.ndarray]: ...


def plan_epoch(
    bucket_ids: Any,
    batch_size: int,
    world_size: int = 1,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    sync_buckets: bool = True,
    leftover: Leftover = "drop",
    catch_all_bucket: int | None = None,
    merge_map: Any | None = None,
    return_buckets: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Plan one epoch for all ranks: a pure function of its arguments.

    Args:
        bucket_ids: bucket id per row, shape ``(n,)``; ``-1`` rows are never sampled.
        batch_size: rows per batch on one rank.
        world_size: number of ranks (data-parallel processes).
        seed: the run's seed (>= 0).
        epoch: the epoch (>= 0); a different epoch gives a different order.
        shuffle: shuffle rows inside buckets and the order of batches. ``False`` gives a fixed order
            (buckets in id order, rows ascending).
        sync_buckets: ``True`` plans global batches of ``world_size * batch_size`` rows of one bucket, so every
            rank is in the same bucket at every step. ``False`` reproduces NovelAI's independent per-rank draws
            (steps truncated to the shortest rank).
        leftover: what happens to rows that do not fill a last (global) batch of their bucket: ``"drop"``,
            ``"fill"`` (repeat rows of the same bucket) or ``"catch_all"`` (pool them into batches served at
            ``catch_all_bucket``).
        catch_all_bucket: target bucket of catch-all batches (required for ``leftover="catch_all"``).
        merge_map: optional int array of shape ``(k,)``: rows of bucket ``b`` are served as bucket
            ``merge_map[b]`` (see :func:`merge_small_buckets`).
        return_buckets: also return the target bucket of every batch.

    Returns:
        ``plan``: ``np.ndarray[int64]`` of shape ``(steps, world_size, batch_size)``, ``plan[s, r]`` being rank
        ``r``'s batch at step ``s``. With ``return_buckets=True``: ``(plan, buckets)`` where ``buckets`` is
        ``np.ndarray[int64]`` of shape ``(steps, world_size)`` (equal along axis 1 when ``sync_buckets``).

    Example:
        ```py
        >>> plan = plan_epoch([0, 0, 0, 0, 1, 1, 1, 1, -1], batch_size=2, world_size=2, seed=0)
        >>> plan.shape
        (2, 2, 2)
        ```
    """
    ids = as_bucket_ids(bucket_ids)
    batch_size, world_size = check_positive("batch_size", batch_size), check_positive("world_size", world_size)
    seed, epoch = check_nonneg("seed", seed), check_nonneg("epoch", epoch)
    leftover = check_leftover(leftover)  # type: ignore[assignment]
    if leftover == "catch_all" and catch_all_bucket is None:
        raise ValueError('`leftover="catch_all"` needs `catch_all_bucket` (the bucket that serves the leftovers).')
    extra = int(catch_all_bucket) + 1 if leftover == "catch_all" else 0
    index = None
    if sync_buckets:
        mm = None if merge_map is None else check_merge_map(merge_map, ids)
        k = max(num_buckets(ids) if mm is None else mm.size, extra)
        eff = None
        index = build_index(ids, mm, k)
    else:
        eff, k = effective_ids(ids, merge_map)
        k = max(k, extra)
    layout = make_layout(eff, k, batch_size=batch_size, world_size=world_size, seed=seed, epoch=epoch,
                         shuffle=shuffle, sync_buckets=sync_buckets, leftover=leftover,
                         catch_all_bucket=catch_all_bucket, index=index)
    plan = np.empty((layout.num_steps, world_size, batch_size), dtype=np.int64)
    for s0 in range(0, layout.num_steps, CHUNK_STEPS):  # chunks bound the index temporaries
        s1 = min(layout.num_steps, s0 + CHUNK_STEPS)
        plan[s0:s1] = layout.rows(s0, s1)
    if return_buckets:
        return plan, np.array(layout.targets, dtype=np.int64)
    return plan


__all__ = ["Leftover", "LEFTOVERS", "bucket_counts", "merge_small_buckets", "plan_epoch"]
