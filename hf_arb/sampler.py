"""Epoch plans and an accelerate-aware bucket batch sampler.

The core is a pure function, :func:`plan_epoch`: (bucket ids, batch size, world size, seed, epoch,
options) → an ``int64`` array of shape ``(steps, world, batch)``. Row ``plan[s, r]`` is the batch that
rank ``r`` trains on at step ``s``. The plan is computed *globally* — every rank computes the same array
from the same inputs and reads its own column — so all ranks agree on the number of steps and, with
``sync_buckets=True``, on the bucket of every step.

How a plan is built (``sync_buckets=True``):

1. Rows are grouped by (effective) bucket once, at construction: ``O(n)``.
2. Each bucket's rows are shuffled with their own random stream (``seed, epoch, bucket``; computed block by
   block, see :class:`_BucketPermutation`, so a few positions are cheap to reach) and cut into
   *global* batches of ``world × batch`` rows. What does not fill a last global batch is the bucket's
   leftover: dropped (a different random subset each epoch), completed with repeats from the same
   bucket (``"fill"``), or pooled into catch-all batches served at a base bucket (``"catch_all"``).
3. All global batches are put in one uniformly random order. A uniform shuffle of whole batches draws,
   at every step, a bucket with probability proportional to its remaining batches — exactly NovelAI's
   "probability proportional to remaining size" (see ``docs/sampler.md`` for the proof).
4. Global batch ``j`` is split into ``world`` consecutive chunks of ``batch`` rows; rank ``r`` takes chunk
   ``r``. Only the global batch size enters steps 1–3, so a run checkpointed on ``W1`` processes resumes
   on ``W2`` processes with the same global batch and continues the same global sequence.

:class:`BucketBatchSampler` wraps the plan for ``torch.utils.data.DataLoader(batch_sampler=...)``: it
materialises only the batches it yields (in vectorised chunks), keeps an exact resume cursor
``(epoch, batches_consumed)`` and serialises it as small JSON. :func:`prepare_dataloader` makes it work
behind ``accelerator.prepare`` (see its docstring for why a plain ``prepare`` is wrong for any
per-rank batch sampler).

No global RNG (``random``, ``np.random.*``, ``torch``) is read or written here: every random stream is a
``numpy.random.Generator(PCG64(SeedSequence([seed, epoch, tag, ...])))``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, overload

import numpy as np

logger = logging.getLogger(__name__)

Leftover = Literal["drop", "fill", "catch_all"]
_LEFTOVERS = ("drop", "fill", "catch_all")
_STATE_FORMAT = 1
_PLAN_VERSION = 1  # bump whenever the same inputs would give a different plan: old states are then refused
_CHUNK_STEPS = 4096  # steps materialised at a time while iterating (bounds temporary memory)
_BLOCK = 32768  # mean rows per block of a bucket's lazily computed random order

# tags that separate the random streams of one (seed, epoch)
_TAG_ORDER, _TAG_BUCKET, _TAG_POOL, _TAG_SHARD, _TAG_RANK = 0, 1, 2, 3, 4


def _rng(*entropy: int) -> np.random.Generator:
    """A private generator for one stream; never the global numpy RNG."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(e) for e in entropy])))


# --------------------------------------------------------------------------------------------------
# input validation
# --------------------------------------------------------------------------------------------------


def _as_bucket_ids(bucket_ids: Any) -> np.ndarray:
    """Validate bucket ids → int32 array of shape (n,) (``-1`` = never sampled)."""
    arr = np.asarray(bucket_ids)
    if arr.ndim != 1:
        raise ValueError(
            f"`bucket_ids` must be 1-D (one bucket id per row), got shape {arr.shape}. "
            "Pass the dataset's `bucket` column or a flat list of ints."
        )
    if arr.size and arr.dtype.kind not in "iub":
        if arr.dtype.kind == "f" and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"`bucket_ids` must be integers, got dtype {arr.dtype}. Use the `bucket` column.")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < -1:
        i = int(np.argmin(arr))
        raise ValueError(
            f"`bucket_ids` must be >= -1 (-1 marks a skipped row), but bucket_ids[{i}] = {int(arr[i])}."
        )
    if arr.size and arr.max() >= 2**15 - 1:
        raise ValueError(f"At most 32767 buckets are supported, got bucket id {int(arr.max())}.")
    if arr.size >= 2**31 - 1:
        raise ValueError(f"At most 2**31 - 2 rows are supported, got {arr.size}.")
    return arr.astype(np.int32)


def _check_positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return int(value)


def _check_nonneg(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    return int(value)


def merge_small_buckets(counts: Any, aspects: Any, min_rows: int) -> np.ndarray:
    """Map every bucket with fewer than ``min_rows`` rows onto the nearest big bucket in log aspect.

    Args:
        counts: rows per bucket, shape ``(k,)``.
        aspects: bucket aspect ratios ``width / height``, shape ``(k,)``.
        min_rows: a bucket is "small" below this many rows (the sampler uses one global batch).

    Returns:
        ``np.ndarray[int64]`` of shape ``(k,)``: ``mapping[b]`` is the bucket that serves bucket ``b``'s rows
        (``b`` itself for big or empty buckets). When no bucket is big, everything merges into the most
        populous bucket.
    """
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
        best = np.array([big[np.lexsort((-counts[big], d))[0]] for d in dist])
        mapping[small] = best
    return mapping


# --------------------------------------------------------------------------------------------------
# the epoch layout (sync_buckets=True): shared by plan_epoch and the sampler's lazy iteration
# --------------------------------------------------------------------------------------------------


@dataclass
class _Grouping:
    """Rows grouped by effective bucket (computed once per sampler, O(n)).

    Attributes:
        rows: int32, shape ``(n_valid,)``, row indices grouped by effective bucket, ascending inside a group.
        start: int64, shape ``(k,)``, first position of each bucket in ``rows``.
        count: int64, shape ``(k,)``, rows per effective bucket.
    """

    rows: np.ndarray
    start: np.ndarray
    count: np.ndarray


def _bucket_counts(ids: np.ndarray, k: int) -> np.ndarray:
    """Rows per bucket, int64 shape (k,), without an int64 copy of ``ids`` for few buckets."""
    if k <= 64:
        return np.array([np.count_nonzero(ids == b) for b in range(k)], dtype=np.int64)
    return np.bincount(ids[ids >= 0], minlength=k).astype(np.int64)[:k]


def _group(eff_ids: np.ndarray, k: int) -> _Grouping:
    """Group valid rows (``eff_ids >= 0``) by bucket. ``eff_ids``: int, shape (n,)."""
    count = _bucket_counts(eff_ids, k)
    start = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    if k <= 64:  # k passes of a compare: less memory than an int64 argsort of all rows
        rows = np.empty(int(count.sum()), dtype=np.int32)
        for b in np.flatnonzero(count):
            rows[start[b] : start[b] + count[b]] = np.flatnonzero(eff_ids == b)
        return _Grouping(rows=rows, start=start, count=count)
    keys = eff_ids.astype(np.int16)  # (n,); -1 rows are moved past every bucket
    keys[eff_ids < 0] = k
    order = np.argsort(keys, kind="stable")  # radix sort for int16 keys: O(n)
    del keys
    rows = order[: int(count.sum())].astype(np.int32)
    return _Grouping(rows=rows, start=start, count=count)


class _BucketPermutation:
    """One bucket's uniformly random row order for one epoch, computable block by block.

    Every row draws an i.i.d. block label in ``[0, m)`` (``m ≈ n / _BLOCK``); the order is the concatenation
    of the blocks, each uniformly shuffled with its own stream. Sorting by i.i.d. uniform keys gives a uniform
    permutation, and "label, then a uniform order inside the label" *is* sorting by the key ``label + U``: the
    result is an exactly uniform shuffle. Its use: the rows at a few positions (the first batch after a resume,
    a bucket's leftovers) cost one ``O(n)`` label draw and one small shuffle instead of a full shuffle.

    ``out`` (int32 view, shape ``(n,)``) receives the order; ``rows`` (int32, shape ``(n,)``) are the bucket's
    rows in ascending order.
    """

    def __init__(self, rows: np.ndarray, out: np.ndarray, seed: int, epoch: int, bucket: int, shuffle: bool) -> None:
        self.rows, self.out = rows, out
        self.key = (seed, epoch, _TAG_BUCKET, bucket)
        n = rows.size
        self.shuffle = shuffle
        m = max(1, -(-n // _BLOCK)) if shuffle else 1
        self.labels: np.ndarray | None = None
        if m > 1:
            self.labels = _rng(*self.key).integers(0, m, size=n, dtype=np.uint16)  # (n,)
            counts = np.bincount(self.labels, minlength=m)
        else:
            counts = np.array([n])
        self.ends = np.cumsum(counts).astype(np.int64)  # (m,) end position of each block
        self.starts = self.ends - counts
        self.ready = np.zeros(m, dtype=bool)
        self.lazy_blocks = 0

    def ensure_positions(self, positions: np.ndarray) -> None:
        """Make ``out[positions]`` final (positions: int array, any shape, values in ``[0, n)``)."""
        if self.ready.all():
            return
        blocks = np.unique(np.searchsorted(self.ends, positions, side="right"))
        todo = blocks[~self.ready[blocks]]
        if todo.size == 0:
            return
        if self.labels is None:
            self._write(0, self.rows.copy())
        elif self.lazy_blocks + todo.size <= 2:  # a few blocks: one compare over the labels each
            for b in todo.tolist():
                self._write(b, self.rows[np.flatnonzero(self.labels == b)])
            self.lazy_blocks += todo.size
        else:  # many blocks: group all rows by label once (radix sort), then shuffle what is missing
            grouped = self.rows[np.argsort(self.labels, kind="stable")]
            for b in np.flatnonzero(~self.ready).tolist():
                self._write(b, grouped[self.starts[b] : self.ends[b]])
        if self.ready.all():
            self.labels = None

    def _write(self, block: int, members: np.ndarray) -> None:
        if self.shuffle and members.size > 1:
            _rng(*self.key, block).shuffle(members)
        self.out[self.starts[block] : self.ends[block]] = members
        self.ready[block] = True


class _SyncLayout:
    """One epoch of a synchronised plan, materialised lazily.

    Segments are the ``k`` buckets plus (for ``leftover="catch_all"``) one pool segment ``k``. Global batch
    ``j`` belongs to segment ``seg_of_batch[j]`` with local index ``j - batch_offset[seg]``; step ``s`` serves
    global batch ``order[s]``. Rows of a segment come from ``buffer`` (each bucket's random order, computed
    block by block on first use, then the pool), position ``p`` of segment ``b`` being
    ``buffer[start[b] + p % count[b]]`` (the modulo realises ``"fill"``'s repeats).
    """

    def __init__(self, grouping: _Grouping, global_batch: int, seed: int, epoch: int, shuffle: bool,
                 leftover: str, catch_all_bucket: int | None) -> None:
        self.g = grouping
        self.G = global_batch
        self.seed, self.epoch, self.shuffle, self.leftover = seed, epoch, shuffle, leftover
        k = grouping.count.size
        self.k = k
        n = grouping.count
        if leftover == "fill":
            nb = -(-n // global_batch)
        else:
            nb = n // global_batch
        self.full_batches = n // global_batch  # (k,)
        self.pool_rows = int((n % global_batch).sum()) if leftover == "catch_all" else 0
        pool_batches = self.pool_rows // global_batch
        self.catch_all_bucket = catch_all_bucket
        seg_batches = np.concatenate([nb, [pool_batches]]).astype(np.int64)  # (k + 1,)
        self.seg_batches = seg_batches
        self.batch_offset = np.concatenate([[0], np.cumsum(seg_batches)[:-1]]).astype(np.int64)
        self.num_batches = int(seg_batches.sum())
        seg_target = np.concatenate([np.arange(k), [catch_all_bucket if catch_all_bucket is not None else -1]])
        self.seg_target = seg_target.astype(np.int64)
        # per step: segment and local batch index, int64 shape (steps,)
        seg_of_batch = np.repeat(np.arange(k + 1, dtype=np.int64), seg_batches)
        if shuffle:
            order = _rng(seed, epoch, _TAG_ORDER).permutation(self.num_batches)
        else:
            order = np.arange(self.num_batches, dtype=np.int64)
        self.step_seg = seg_of_batch[order]
        self.step_local = order - self.batch_offset[self.step_seg]
        del seg_of_batch, order
        # buffer: each bucket's order (positions as in grouping.rows), then the catch-all pool
        self.seg_start = np.concatenate([grouping.start, [grouping.rows.size]]).astype(np.int64)
        self.seg_count = np.concatenate([n, [pool_batches * global_batch]]).astype(np.int64)
        self.buffer = np.empty(grouping.rows.size + self.pool_rows, dtype=np.int32)
        self.perms: dict[int, _BucketPermutation] = {}
        self.pool_ready = False
        self._targets: np.ndarray | None = None

    @property
    def step_targets(self) -> np.ndarray:
        """Target bucket per step, int64 shape (steps,), read-only (computed once per epoch)."""
        if self._targets is None:
            self._targets = self.seg_target[self.step_seg]
            self._targets.flags.writeable = False
        return self._targets

    def _perm(self, b: int) -> _BucketPermutation:
        perm = self.perms.get(b)
        if perm is None:
            a, c = int(self.g.start[b]), int(self.g.count[b])
            perm = _BucketPermutation(self.g.rows[a : a + c], self.buffer[a : a + c], self.seed, self.epoch, b,
                                      self.shuffle)
            self.perms[b] = perm
        return perm

    def _ensure(self, seg: np.ndarray, p: np.ndarray) -> None:
        """Make the rows at positions ``p`` (shape (m, width)) of segments ``seg`` (shape (m,)) final."""
        for s in np.unique(seg).tolist():
            if s == self.k:
                self._fill_pool()
            else:
                self._perm(s).ensure_positions(p[seg == s])

    def _fill_pool(self) -> None:
        if self.pool_ready or self.pool_rows == 0:
            self.pool_ready = True
            return
        # leftovers = the tail of each bucket's order beyond its full global batches
        n, G = self.g.count, self.G
        parts = []
        for b in np.flatnonzero(n % G).tolist():
            tail = np.arange(self.full_batches[b] * G, n[b])
            self._perm(b).ensure_positions(tail)
            parts.append(self.buffer[self.g.start[b] + tail])
        pool = np.concatenate(parts)
        if self.shuffle:
            _rng(self.seed, self.epoch, _TAG_POOL).shuffle(pool)
        self.buffer[self.g.rows.size :] = pool
        self.pool_ready = True

    def rows(self, s0: int, s1: int, rank: int | None, batch: int) -> np.ndarray:
        """Rows of steps ``[s0, s1)``.

        Returns int64 of shape ``(s1 - s0, batch)`` for one ``rank``, or ``(s1 - s0, G)`` when ``rank`` is None
        (the whole global batch; rank ``r`` owns columns ``[r * batch, (r + 1) * batch)``).
        """
        seg = self.step_seg[s0:s1]
        loc = self.step_local[s0:s1]
        if rank is None:
            offs = np.arange(self.G, dtype=np.int64)
        else:
            offs = rank * batch + np.arange(batch, dtype=np.int64)
        p = loc[:, None] * self.G + offs[None, :]  # (m, width): position inside the segment
        if self.leftover == "fill":
            p %= self.seg_count[seg][:, None]
        self._ensure(seg, p)
        idx = self.seg_start[seg][:, None] + p
        return self.buffer[idx].astype(np.int64)


# --------------------------------------------------------------------------------------------------
# independent per-rank draws (sync_buckets=False): NovelAI's behaviour, for comparison
# --------------------------------------------------------------------------------------------------


def _plan_independent(eff_ids: np.ndarray, k: int, batch_size: int, world_size: int, seed: int, epoch: int,
                      shuffle: bool, leftover: str, catch_all_bucket: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Each rank shards the rows, batches its own buckets and draws its own bucket order.

    Returns ``(plan, targets)``: int64 ``(steps, world, batch)`` and int64 ``(steps, world)``; ``steps`` is the
    smallest per-rank batch count (extra batches of the other ranks are dropped so that no rank hangs).
    """
    valid = np.flatnonzero(eff_ids >= 0)
    if shuffle:
        valid = _rng(seed, epoch, _TAG_SHARD).permutation(valid)
    per_rank: list[tuple[np.ndarray, np.ndarray]] = []
    B = batch_size
    for r in range(world_size):
        rows_r = valid[r::world_size]
        keys = eff_ids[rows_r]
        batches, targets, pool = [], [], []
        for b in range(k):
            rb = rows_r[keys == b]
            if rb.size == 0:
                continue
            full = rb.size // B
            if leftover == "fill":
                L = -(-rb.size // B) * B
                rb_ext = rb[np.arange(L) % rb.size]
                batches.append(rb_ext.reshape(-1, B))
                targets.append(np.full(L // B, b))
                continue
            batches.append(rb[: full * B].reshape(full, B))
            targets.append(np.full(full, b))
            if leftover == "catch_all":
                pool.append(rb[full * B :])
        if pool:
            p = np.concatenate(pool)
            if shuffle:
                p = _rng(seed, epoch, _TAG_POOL, r).permutation(p)
            c = p.size // B
            batches.append(p[: c * B].reshape(c, B))
            targets.append(np.full(c, catch_all_bucket))
        bt = np.concatenate(batches) if batches else np.empty((0, B), dtype=np.int64)
        tg = np.concatenate(targets) if targets else np.empty(0, dtype=np.int64)
        if shuffle:
            o = _rng(seed, epoch, _TAG_RANK, r).permutation(len(bt))
            bt, tg = bt[o], tg[o]
        per_rank.append((bt.astype(np.int64), tg.astype(np.int64)))
    steps = min(len(t) for _, t in per_rank)
    plan = np.stack([bt[:steps] for bt, _ in per_rank], axis=1) if steps else np.empty((0, world_size, B), np.int64)
    targets = np.stack([tg[:steps] for _, tg in per_rank], axis=1) if steps else np.empty((0, world_size), np.int64)
    return plan.astype(np.int64), targets.astype(np.int64)


# --------------------------------------------------------------------------------------------------
# the pure function
# --------------------------------------------------------------------------------------------------


def _effective_ids(ids: np.ndarray, merge_map: Any | None) -> tuple[np.ndarray, int]:
    k = int(ids.max()) + 1 if ids.size and ids.max() >= 0 else 0
    if merge_map is None:
        return ids, k
    mm = np.asarray(merge_map, dtype=np.int64)
    if mm.ndim != 1 or mm.size < k:
        raise ValueError(f"`merge_map` must have shape (k,) with k >= {k} (one target per bucket), got {mm.shape}.")
    k = max(k, mm.size)
    eff = np.where(ids >= 0, mm[np.maximum(ids, 0)], -1).astype(np.int32)
    return eff, k


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
    ids = _as_bucket_ids(bucket_ids)
    batch_size = _check_positive("batch_size", batch_size)
    world_size = _check_positive("world_size", world_size)
    seed, epoch = _check_nonneg("seed", seed), _check_nonneg("epoch", epoch)
    if leftover not in _LEFTOVERS:
        raise ValueError(f"`leftover` must be one of {_LEFTOVERS}, got {leftover!r}.")
    eff, k = _effective_ids(ids, merge_map)
    if leftover == "catch_all":
        if catch_all_bucket is None:
            raise ValueError('`leftover="catch_all"` needs `catch_all_bucket` (the bucket that serves the leftovers).')
        k = max(k, int(catch_all_bucket) + 1)
    if not sync_buckets:
        plan, targets = _plan_independent(eff, k, batch_size, world_size, seed, epoch, shuffle, leftover,
                                          catch_all_bucket)
        return (plan, targets) if return_buckets else plan
    layout = _SyncLayout(_group(eff, k), world_size * batch_size, seed, epoch, shuffle, leftover, catch_all_bucket)
    steps = layout.num_batches
    plan = np.empty((steps, world_size * batch_size), dtype=np.int64)
    for s0 in range(0, steps, _CHUNK_STEPS):  # chunks bound the index temporaries
        s1 = min(steps, s0 + _CHUNK_STEPS)
        plan[s0:s1] = layout.rows(s0, s1, None, batch_size)
    plan = plan.reshape(steps, world_size, batch_size)
    if return_buckets:
        return plan, np.repeat(layout.step_targets[:, None], world_size, axis=1)
    return plan


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanReport:
    """What one epoch's plan does with the rows (``sampler.report()``).

    Attributes:
        epoch: the epoch described.
        rows_total: rows in ``bucket_ids``; rows_unassigned: rows with bucket ``-1`` (never sampled).
        rows_used: distinct rows trained on this epoch; rows_dropped: assigned rows not trained on this epoch.
        rows_repeated: extra samples beyond one per row (``"fill"``).
        rows_merged: rows served at a bucket other than their own by merging of small buckets.
        rows_catch_all: rows served in catch-all batches.
        steps: batches per rank; global_batch_size: rows per step over all ranks.
        batches_per_bucket: ``{target bucket: global batches}``.
    """

    epoch: int
    rows_total: int
    rows_unassigned: int
    rows_used: int
    rows_dropped: int
    rows_repeated: int
    rows_merged: int
    rows_catch_all: int
    steps: int
    num_replicas: int
    batch_size: int
    global_batch_size: int
    leftover: str
    sync_buckets: bool
    batches_per_bucket: dict[int, int] = field(default_factory=dict)

    @property
    def dropped_fraction(self) -> float:
        """Dropped rows over assigned rows."""
        assigned = self.rows_total - self.rows_unassigned
        return self.rows_dropped / assigned if assigned else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["batches_per_bucket"] = {str(b): c for b, c in self.batches_per_bucket.items()}
        d["dropped_fraction"] = self.dropped_fraction
        return d

    def __str__(self) -> str:
        return (
            f"epoch {self.epoch}: {self.steps:,} steps/rank × {self.num_replicas} ranks × batch {self.batch_size}; "
            f"rows: {self.rows_total:,} total, {self.rows_used:,} used, {self.rows_dropped:,} dropped "
            f"({100 * self.dropped_fraction:.1f}%), {self.rows_repeated:,} repeated, {self.rows_merged:,} merged, "
            f"{self.rows_catch_all:,} in catch-all batches, {self.rows_unassigned:,} unassigned (bucket -1); "
            f"leftover={self.leftover!r}, sync_buckets={self.sync_buckets}"
        )


# --------------------------------------------------------------------------------------------------
# the sampler
# --------------------------------------------------------------------------------------------------


def _default_world() -> tuple[int, int]:
    """(num_replicas, rank) from accelerate's PartialState if initialised, else torch.distributed, else (1, 0)."""
    state_mod = sys.modules.get("accelerate.state")
    if state_mod is not None:
        ps = getattr(state_mod, "PartialState", None)
        if ps is not None and getattr(ps, "_shared_state", None):
            st = ps()
            return int(st.num_processes), int(st.process_index)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size()), int(dist.get_rank())
    return 1, 0


def _aspects(resolutions: np.ndarray) -> np.ndarray:
    """width / height per bucket, shape (k,); NaN where a resolution is unknown (0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        a = resolutions[:, 0] / resolutions[:, 1]
    a[~(resolutions > 0).all(axis=1)] = np.nan
    return a


def _read_dataset(ds: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """Bucket ids (n,) and, when the dataset carries them, resolutions (k, 2) from an annotated Dataset."""
    names = list(getattr(ds, "column_names", []) or [])
    if "bucket" not in names:
        raise ValueError(
            f"The dataset has no `bucket` column (columns: {names}). Annotate it first with "
            "`hf_arb.add_bucket_columns(ds, buckets)` or pass the bucket ids as an array."
        )
    res = None
    try:  # the BucketSet stored in the `bucket` feature by add_bucket_columns: every bucket, also empty ones
        from .hub import buckets_from_features

        stored = buckets_from_features(getattr(ds, "features", None))
        if stored is not None:
            res = np.asarray(stored.resolutions, dtype=np.int64)
    except Exception:  # noqa: BLE001 - fall back to the columns
        res = None
    cols = [c for c in ("bucket", "bucket_width", "bucket_height") if c in names and (res is None or c == "bucket")]
    table = ds.select_columns(cols).with_format("numpy")[:]
    ids = np.asarray(table["bucket"])
    if res is None and "bucket_width" in cols and "bucket_height" in cols:
        valid = ids >= 0
        if valid.any():
            k = int(ids[valid].max()) + 1
            res = np.zeros((k, 2), dtype=np.int64)
            res[ids[valid], 0] = np.asarray(table["bucket_width"])[valid]
            res[ids[valid], 1] = np.asarray(table["bucket_height"])[valid]
    return ids, res


class BucketBatchSampler:
    """Batch sampler for aspect-ratio buckets: every batch is full and of one bucket, every rank gets the same
    number of batches, and (by default) all ranks are in the same bucket at every step.

    Args:
        bucket_ids: bucket id per row, shape ``(n,)`` (``-1`` rows are never sampled), or an annotated
            ``datasets.Dataset`` (its ``bucket`` column; ``bucket_width``/``bucket_height`` give the resolutions).
        batch_size: rows per batch on one rank.
        num_replicas: number of data-parallel ranks. Default: accelerate's ``PartialState`` when initialised,
            else ``torch.distributed``, else 1.
        rank: this process's rank, same defaults.
        seed: run seed (>= 0); together with the epoch it fixes the order.
        shuffle: shuffle rows and batch order (``False``: fixed order, for evaluation).
        sync_buckets: same bucket on every rank at every step (default). ``False`` reproduces NovelAI's
            independent per-rank draws (for comparison; no elastic resume).
        leftover: ``"drop"`` (default), ``"fill"`` or ``"catch_all"``; see :func:`plan_epoch`.
        return_keys: yield batches of ``(row, target_bucket, epoch)`` tuples instead of row indices.
        catch_all_bucket: bucket serving catch-all batches. Default: the bucket closest to square (needs
            resolutions), else the most populous bucket.
        merge_small: merge buckets with fewer rows than one global batch into the nearest bucket in log aspect
            (needs resolutions).
        buckets: a ``BucketSet`` or resolutions of shape ``(k, 2)`` as ``(width, height)``; read from the
            dataset when it is annotated.
        log_report: log :meth:`report` once when iteration first starts.

    Example:
        ```py
        >>> sampler = BucketBatchSampler([0] * 6 + [1] * 4, batch_size=2, num_replicas=1, rank=0, seed=0)
        >>> len(sampler), all(len(b) == 2 for b in sampler)
        (5, True)
        ```
    """

    def __init__(
        self,
        bucket_ids: Any,
        batch_size: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        sync_buckets: bool = True,
        leftover: Leftover = "drop",
        return_keys: bool = False,
        catch_all_bucket: int | None = None,
        merge_small: bool = False,
        buckets: Any | None = None,
        log_report: bool = True,
    ) -> None:
        resolutions = None
        if hasattr(bucket_ids, "column_names"):
            bucket_ids, resolutions = _read_dataset(bucket_ids)
        if buckets is not None:
            resolutions = np.asarray(getattr(buckets, "resolutions", buckets), dtype=np.int64)
            if resolutions.ndim != 2 or resolutions.shape[1] != 2:
                raise ValueError(f"`buckets` must be a BucketSet or (k, 2) resolutions, got shape {resolutions.shape}.")
        ids = _as_bucket_ids(bucket_ids)
        self.batch_size = _check_positive("batch_size", batch_size)
        if num_replicas is None or rank is None:
            w, r = _default_world()
            num_replicas = w if num_replicas is None else num_replicas
            rank = r if rank is None else rank
        self.num_replicas = _check_positive("num_replicas", num_replicas)
        self.rank = _check_nonneg("rank", rank)
        if self.rank >= self.num_replicas:
            raise ValueError(f"`rank` must be < num_replicas ({self.num_replicas}), got {self.rank}.")
        self.seed = _check_nonneg("seed", seed)
        self.shuffle = bool(shuffle)
        self.sync_buckets = bool(sync_buckets)
        if leftover not in _LEFTOVERS:
            raise ValueError(f"`leftover` must be one of {_LEFTOVERS}, got {leftover!r}.")
        self.leftover: str = leftover
        self.return_keys = bool(return_keys)
        self.log_report = bool(log_report)
        self.drop_last = False  # every batch is full; read by accelerate's BatchSamplerShard
        n_valid = int(np.count_nonzero(ids >= 0))
        self._rows_total, self._rows_unassigned = int(ids.size), int(ids.size - n_valid)
        if n_valid == 0:
            raise ValueError(
                f"No row has a bucket (got {ids.size} rows, all -1 or none). The sampler needs at least one "
                "assigned row: check the annotation (`skip_reason` column) or the bucket set."
            )
        k = int(ids.max()) + 1
        if resolutions is not None and resolutions.shape[0] < k:
            raise ValueError(f"`buckets` has {resolutions.shape[0]} resolutions but bucket id {k - 1} occurs.")
        self.resolutions = resolutions
        counts = _bucket_counts(ids, k)
        self._counts = counts
        G = self.global_batch_size
        merge_map = None
        if merge_small:
            if resolutions is None:
                raise ValueError(
                    "`merge_small=True` needs bucket resolutions to find the nearest bucket in log aspect: pass "
                    "`buckets=BucketSet(...)` (or an annotated dataset with bucket_width/bucket_height columns)."
                )
            merge_map = merge_small_buckets(counts, _aspects(resolutions)[:k], G if sync_buckets else self.batch_size)
        self._merge_map = merge_map
        if leftover == "catch_all":
            if catch_all_bucket is None:
                if resolutions is not None:
                    la = np.abs(np.log(_aspects(resolutions)))  # NaN for unknown (0 x 0) entries: sorted last
                    area = resolutions[:, 0] * resolutions[:, 1]
                    catch_all_bucket = int(np.lexsort((-area, la))[0])
                else:
                    catch_all_bucket = int(np.argmax(counts))
            catch_all_bucket = _check_nonneg("catch_all_bucket", catch_all_bucket)
        self.catch_all_bucket = catch_all_bucket
        self._eff, self._k = _effective_ids(ids, merge_map)
        if catch_all_bucket is not None:
            self._k = max(self._k, catch_all_bucket + 1)
        self._grouping = _group(self._eff, self._k) if self.sync_buckets else None
        self._fingerprint = self._compute_fingerprint(ids)
        if self.sync_buckets:  # the grouping is all a synchronised plan needs: free the id arrays
            self._eff = None  # type: ignore[assignment]
        # cursor
        self._epoch = 0
        self._consumed = 0
        self._driven = 0  # > 0 while a tracking loader (prepare_dataloader) counts consumption
        self._logged = False
        self._cache: tuple[int, Any] | None = None  # (epoch, _SyncLayout | (plan, targets))
        self._steps0 = self._steps_of(0)  # constant over epochs when synced; per epoch otherwise
        if self._steps0 == 0:
            raise ValueError(self._zero_batches_message())
        rep = self.report()
        if rep.dropped_fraction > 0.10:
            msg = (
                f"BucketBatchSampler drops {rep.rows_dropped:,} of {rep.rows_total - rep.rows_unassigned:,} "
                "assigned rows "
                f"({100 * rep.dropped_fraction:.1f}% > 10%) per epoch with global batch {G}. Remedies: "
                + ", ".join(self._remedies()) + "."
            )
            warnings.warn(msg, UserWarning, stacklevel=2)

    # ---------------------------------------------------------------- properties
    @property
    def global_batch_size(self) -> int:
        """Rows per step over all ranks: ``num_replicas * batch_size``."""
        return self.num_replicas * self.batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch already handed out (the resume position)."""
        return self._consumed

    @property
    def steps_per_epoch(self) -> int:
        """Batches per rank in a whole epoch (``len(sampler)`` at the start of an epoch). With
        ``sync_buckets=False`` it can vary a little from epoch to epoch (the shortest rank sets it)."""
        return self._steps_in(self._epoch)

    def _steps_in(self, epoch: int) -> int:
        return self._steps0 if self.sync_buckets else self._steps_of(epoch)

    def _remedies(self) -> list[str]:
        out = ["a smaller `batch_size`", "fewer buckets"]
        if self.leftover != "fill":
            out.append('`leftover="fill"`' + ("" if self.leftover == "catch_all" else ' or `"catch_all"`'))
        if self._merge_map is None:
            out.append("`merge_small=True` (merge small buckets)")
        return out

    def _zero_batches_message(self) -> str:
        G = self.global_batch_size
        return (
            f"The epoch plan has zero batches: no bucket holds a full global batch of {G} rows "
            f"(num_replicas {self.num_replicas} × batch_size {self.batch_size}); largest bucket has "
            f"{int(self._counts.max())} rows, {int(self._counts.sum())} assigned rows in all. Remedies: "
            + ", ".join(self._remedies()) + "."
        )

    def _compute_fingerprint(self, ids: np.ndarray) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(memoryview(np.ascontiguousarray(ids)).cast("B"))
        if self._merge_map is not None:
            h.update(np.ascontiguousarray(self._merge_map, dtype=np.int64).tobytes())
        return h.hexdigest()

    def _options(self) -> dict[str, Any]:
        return {
            "shuffle": self.shuffle,
            "sync_buckets": self.sync_buckets,
            "leftover": self.leftover,
            "catch_all_bucket": self.catch_all_bucket,
            "merge_small": self._merge_map is not None,
        }

    # ---------------------------------------------------------------- planning
    def _layout(self, epoch: int) -> Any:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if self.sync_buckets:
            assert self._grouping is not None
            obj: Any = _SyncLayout(self._grouping, self.global_batch_size, self.seed, epoch, self.shuffle,
                                   self.leftover, self.catch_all_bucket)
        else:
            obj = _plan_independent(self._eff, self._k, self.batch_size, self.num_replicas, self.seed, epoch,
                                    self.shuffle, self.leftover, self.catch_all_bucket)
        self._cache = (epoch, obj)
        return obj

    def _steps_of(self, epoch: int) -> int:
        lay = self._layout(epoch)
        return lay.num_batches if self.sync_buckets else len(lay[1])

    def _rows(self, epoch: int, s0: int, s1: int, rank: int | None) -> np.ndarray:
        """Rows of steps [s0, s1): (m, batch) for ``rank``, or (m, world, batch) for all ranks."""
        lay = self._layout(epoch)
        if self.sync_buckets:
            out = lay.rows(s0, s1, rank, self.batch_size)
            return out if rank is not None else out.reshape(-1, self.num_replicas, self.batch_size)
        plan = lay[0][s0:s1]
        return plan[:, rank] if rank is not None else plan

    def _targets(self, epoch: int) -> np.ndarray:
        """Target bucket per step: (steps,) when synced, else (steps, world)."""
        lay = self._layout(epoch)
        return lay.step_targets if self.sync_buckets else lay[1]

    def plan(self, epoch: int | None = None) -> np.ndarray:
        """The whole plan of ``epoch`` (default: the current one): int64 of shape ``(steps, num_replicas, batch_size)``.

        Identical to :func:`plan_epoch` with this sampler's arguments.
        """
        e = self._epoch if epoch is None else _check_nonneg("epoch", epoch)
        steps = self._steps_of(e)
        return self._rows(e, 0, steps, None)

    def batch_buckets(self, epoch: int | None = None) -> np.ndarray:
        """Target bucket of each of this rank's batches in ``epoch`` (default: current), int64 shape ``(steps,)``.

        Indexed by the step inside the epoch; while iterating through :func:`prepare_dataloader`'s loader, the
        batch in hand is step ``sampler.batches_consumed - 1``.
        """
        e = self._epoch if epoch is None else _check_nonneg("epoch", epoch)
        t = self._targets(e)
        if t.ndim == 2:
            t = t[:, self.rank]
            t.flags.writeable = False
        return t  # a read-only view, cheap enough to call at every step

    # ---------------------------------------------------------------- cursor
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate. A new epoch starts at its first batch; setting the current epoch again
        keeps a (restored) mid-epoch position, so ``for e in range(start, n): sampler.set_epoch(e)`` resumes."""
        epoch = _check_nonneg("epoch", epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._consumed = 0

    def _advance(self, epoch: int, consumed: int) -> None:
        """Move the cursor: ``consumed`` batches of ``epoch`` handed out (``consumed == steps`` = epoch done)."""
        self._epoch, self._consumed = epoch, min(consumed, self._steps_in(epoch))

    def _normalise(self) -> None:
        """A finished epoch becomes the start of the next one."""
        if self._consumed >= self._steps_in(self._epoch):
            self._epoch, self._consumed = self._epoch + 1, 0

    def __len__(self) -> int:
        """Batches the next iteration yields: the whole epoch, or what is left of it after a mid-epoch resume."""
        steps = self._steps_in(self._epoch)
        return self._steps_in(self._epoch + 1) if self._consumed >= steps else steps - self._consumed

    def _log_once(self) -> None:
        if self.log_report and not self._logged:
            self._logged = True
            logger.info("hf_arb BucketBatchSampler: %s", self.report())

    def _batches(self, rank: int | None) -> Iterator[list]:
        """Yield the remaining batches of the current epoch: this rank's (``rank``) or whole steps (``None``,
        lists of ``num_replicas`` batches). Counts consumption itself unless a tracking loader does."""
        self._log_once()
        self._normalise()
        e, start = self._epoch, self._consumed
        steps = self._steps_in(e)
        targets = self._targets(e)
        s0, size = start, 1  # chunks grow 1, 8, 64, ... steps: the first batch only shuffles its own bucket
        while s0 < steps:
            s1 = min(steps, s0 + size)
            size = min(size * 8, _CHUNK_STEPS)
            rows = self._rows(e, s0, s1, rank)
            if self.return_keys:
                tg = targets[s0:s1]
                if rank is not None and tg.ndim == 2:
                    tg = tg[:, rank]
                tgl = tg.tolist()
                if rank is not None:
                    chunk: list = [[(r, t, e) for r in batch] for batch, t in zip(rows.tolist(), tgl)]
                else:
                    chunk = [
                        [[(r, (t[w] if isinstance(t, list) else t), e) for r in b] for w, b in enumerate(step)]
                        for step, t in zip(rows.tolist(), tgl)
                    ]
            else:
                chunk = rows.tolist()
            for i, item in enumerate(chunk):
                if not self._driven:
                    self._advance(e, s0 + i + 1)
                yield item
            s0 = s1
        if not self._driven and self._epoch == e:
            self._normalise()

    def __iter__(self) -> Iterator[list]:
        _refuse_double_sharding(self, sys._getframe(1))
        return self._iter_rank()

    def _iter_rank(self) -> Iterator[list]:
        yield from self._batches(self.rank)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Small JSON-serialisable resume state: epoch, batches consumed, seed, batch sizes, options and a
        fingerprint of the bucket ids."""
        return {
            "format": _STATE_FORMAT,
            "plan_version": _PLAN_VERSION,
            "epoch": self._epoch,
            "batches_consumed": self._consumed,
            "steps_per_epoch": self.steps_per_epoch,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_replicas": self.num_replicas,
            "global_batch_size": self.global_batch_size,
            "options": self._options(),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor in O(1). Rejects a state from a different dataset, seed, global batch or options,
        naming the field. With the same global batch (``num_replicas * batch_size``) the number of processes may
        change (elastic resume; ``sync_buckets=True`` only)."""
        if isinstance(state, str):
            state = json.loads(state)
        fmt = state.get("format")
        if fmt != _STATE_FORMAT:
            raise ValueError(f"Sampler state field `format` is {fmt!r}, this version reads {_STATE_FORMAT}.")

        def mismatch(name: str, saved: Any, ours: Any, fix: str) -> ValueError:
            return ValueError(
                f"Sampler state field `{name}` does not match: saved {saved!r}, this sampler has {ours!r}. {fix}"
            )

        if state.get("plan_version") != _PLAN_VERSION:
            raise mismatch("plan_version", state.get("plan_version"), _PLAN_VERSION,
                           "The state comes from an hf_arb version that orders batches differently; resume with "
                           "that version, or start the epoch afresh with `sampler.set_epoch(epoch)`.")
        if state.get("fingerprint") != self._fingerprint:
            raise mismatch("fingerprint", state.get("fingerprint"), self._fingerprint,
                           "The bucket ids differ from the checkpointed run: resume on the same annotated dataset "
                           "(same rows, same order, same bucket set and merging).")
        if state.get("seed") != self.seed:
            raise mismatch("seed", state.get("seed"), self.seed, "Build the sampler with the checkpoint's seed.")
        if state.get("global_batch_size") != self.global_batch_size:
            raise mismatch("global_batch_size", state.get("global_batch_size"), self.global_batch_size,
                           "Resume with num_replicas × batch_size equal to the checkpointed run's.")
        if not self.sync_buckets:
            for name in ("batch_size", "num_replicas"):
                if state.get(name) != getattr(self, name):
                    raise mismatch(name, state.get(name), getattr(self, name),
                                   "With sync_buckets=False the plan is per rank: keep the same processes and "
                                   "batch size.")
        saved_opts = state.get("options", {})
        for name, ours in self._options().items():
            if saved_opts.get(name) != ours:
                raise mismatch(f"options.{name}", saved_opts.get(name), ours,
                               f"Build the sampler with {name}={saved_opts.get(name)!r}.")
        epoch = _check_nonneg("epoch", state.get("epoch"))
        consumed = _check_nonneg("batches_consumed", state.get("batches_consumed"))
        steps = self._steps_in(epoch)  # O(1) when synced; plans the epoch with sync_buckets=False
        if consumed > steps:
            raise mismatch("batches_consumed", consumed, f"<= {steps}", "The state is corrupt.")
        self._advance(epoch, consumed)
        self._normalise()

    # ---------------------------------------------------------------- report
    def report(self, epoch: int | None = None) -> PlanReport:
        """Rows used, dropped, repeated, merged and served in catch-all batches in ``epoch`` (default: current)."""
        e = self._epoch if epoch is None else _check_nonneg("epoch", epoch)
        counts = self._counts
        unassigned = self._rows_unassigned
        assigned = int(counts.sum())
        merged = 0
        if self._merge_map is not None:
            moved = self._merge_map[: counts.size] != np.arange(counts.size)
            merged = int(counts[moved].sum())
        targets = self._targets(e)
        steps = len(targets)
        G, W, B = self.global_batch_size, self.num_replicas, self.batch_size
        if self.sync_buckets:
            lay = self._layout(e)
            n = lay.g.count
            full = int((lay.full_batches * G).sum())
            if self.leftover == "fill":
                used, repeated, catch = assigned, int(lay.seg_batches[:-1].sum() * G - assigned), 0
            elif self.leftover == "catch_all":
                catch = int(lay.seg_batches[-1] * G)
                used, repeated = full + catch, 0
            else:
                used, repeated, catch = full, 0, 0
            del n
            tvals, tcounts = np.unique(targets, return_counts=True)
        else:
            plan = self._layout(e)[0]
            used = int(np.unique(plan).size)
            repeated = int(plan.size - used)
            catch = int((targets == self.catch_all_bucket).sum() * B) if self.leftover == "catch_all" else 0
            tvals, tcounts = np.unique(targets, return_counts=True)
        return PlanReport(
            epoch=e, rows_total=self._rows_total, rows_unassigned=unassigned, rows_used=used,
            rows_dropped=assigned - used, rows_repeated=repeated, rows_merged=merged, rows_catch_all=catch,
            steps=steps, num_replicas=W, batch_size=B, global_batch_size=G, leftover=self.leftover,
            sync_buckets=self.sync_buckets,
            batches_per_bucket={int(t): int(c) for t, c in zip(tvals.tolist(), tcounts.tolist())},
        )

    def __repr__(self) -> str:
        return (
            f"BucketBatchSampler(rows={self._rows_total}, batch_size={self.batch_size}, "
            f"num_replicas={self.num_replicas}, "
            f"rank={self.rank}, seed={self.seed}, epoch={self._epoch}, batches_consumed={self._consumed}, "
            f"steps_per_epoch={self.steps_per_epoch}, leftover={self.leftover!r}, sync_buckets={self.sync_buckets})"
        )


# --------------------------------------------------------------------------------------------------
# accelerate / DataLoader integration
# --------------------------------------------------------------------------------------------------


def _refuse_double_sharding(sampler: BucketBatchSampler, caller: Any) -> None:
    """Raise when accelerate shards or dispatches a per-rank sampler a second time (each rank would get a
    ``1/world`` share of its planned batches, or slices of them). Looks at the few frames that iterate us."""
    dl_mod = sys.modules.get("accelerate.data_loader")
    if dl_mod is None or sampler.num_replicas == 1:
        return
    shard_cls = getattr(dl_mod, "BatchSamplerShard", None)
    dispatch_cls = getattr(dl_mod, "DataLoaderDispatcher", None)
    frame, depth = caller, 0
    while frame is not None and depth < 10:
        owner = frame.f_locals.get("self")
        culprit = None
        if shard_cls is not None and isinstance(owner, shard_cls) and (owner.num_processes > 1 or owner.split_batches):
            culprit = "BatchSamplerShard (accelerate's round-robin of batches to ranks)"
        elif dispatch_cls is not None and type(owner) is dispatch_cls and owner.state.num_processes > 1:
            culprit = "DataLoaderDispatcher (dispatch_batches=True)"
        if culprit:
            raise RuntimeError(
                f"BucketBatchSampler is being sharded a second time by accelerate's {culprit}: the sampler already "
                f"yields only rank {sampler.rank}'s planned batches, so each process would train on a fraction of "
                "them. Prepare the loader with `hf_arb.prepare_dataloader(accelerator, dataloader)` instead of "
                "`accelerator.prepare(dataloader)`."
            )
        frame, depth = frame.f_back, depth + 1


class _GlobalPlanView:
    """The batch sampler handed to ``accelerator.prepare``: the *global* plan in step-major order.

    ``mode="shard"``: yields ``num_replicas`` batches per step (rank 0's, rank 1's, ...), so accelerate's
    round-robin (``BatchSamplerShard``: batch ``i`` → rank ``i % world``) and ``DataLoaderDispatcher``
    (concatenate ``world`` batches, slice per rank) give every rank exactly its planned batch.
    ``mode="split"`` (``split_batches=True``): yields one list of ``global_batch_size`` rows per step; rank ``r``'s
    slice ``[r * batch, (r + 1) * batch)`` is its planned batch.

    ``.sampler`` is the :class:`BucketBatchSampler`, where accelerate's ``set_epoch`` lookup finds it.
    """

    def __init__(self, sampler: BucketBatchSampler, mode: str) -> None:
        self.sampler = sampler
        self.mode = mode
        self.drop_last = False

    @property
    def batch_size(self) -> int:
        s = self.sampler
        return s.global_batch_size if self.mode == "split" else s.batch_size

    def __len__(self) -> int:
        return len(self.sampler) * (1 if self.mode == "split" else self.sampler.num_replicas)

    def __iter__(self) -> Iterator[list]:
        s = self.sampler
        if not s._driven and 0 < s.batches_consumed < s.steps_per_epoch:
            warnings.warn(
                f"The sampler resumes at batch {s.batches_consumed} of epoch {s.epoch}, but it is read through a "
                "loader that prepare_dataloader did not return (e.g. accelerator.skip_first_batches). If that loader "
                "skips batches too, they are skipped twice: after load_state, iterate the prepared loader itself.",
                UserWarning, stacklevel=2,
            )
        for step in s._batches(None):
            if self.mode == "split":
                yield [x for b in step for x in b]
            else:
                yield from step

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


class _TrackingMixin:
    """Counts batches when they are handed to the training loop (not when read ahead by workers or by
    accelerate's one-batch look-ahead), so ``sampler.state_dict()`` is exact at any checkpoint."""

    _arb_sampler: BucketBatchSampler

    @property  # type: ignore[misc]
    def iteration(self) -> int:  # accelerate's epoch counter follows the sampler's cursor
        return self._arb_sampler.epoch

    @iteration.setter
    def iteration(self, value: int) -> None:
        self._arb_sampler.set_epoch(int(value))

    def _inner_iter(self) -> Iterator[Any]:
        return super().__iter__()  # type: ignore[misc]

    def __iter__(self) -> Iterator[Any]:
        sampler = self._arb_sampler
        sampler._normalise()
        e, n = sampler.epoch, sampler.batches_consumed
        sampler._driven += 1
        finished = False
        try:
            for batch in self._inner_iter():
                n += 1
                sampler._advance(e, n)
                yield batch
            finished = True
        finally:
            sampler._driven -= 1
        if finished and sampler.epoch == e:
            sampler._normalise()


class _TrackedLoader(_TrackingMixin):
    """Plain-PyTorch counterpart (no accelerate): wraps a ``DataLoader(batch_sampler=sampler)``."""

    def __init__(self, dataloader: Any, sampler: BucketBatchSampler) -> None:
        self.dataloader = dataloader
        self._arb_sampler = sampler

    def _inner_iter(self) -> Iterator[Any]:
        return iter(self.dataloader)

    def __len__(self) -> int:
        return len(self._arb_sampler)

    def set_epoch(self, epoch: int) -> None:
        self._arb_sampler.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataloader", "_arb_sampler"):
            raise AttributeError(name)
        return getattr(self.dataloader, name)


_TRACKED_CLASSES: dict[type, type] = {}


def _tracking_class(cls: type) -> type:
    if cls not in _TRACKED_CLASSES:
        _TRACKED_CLASSES[cls] = type(f"ARB{cls.__name__}", (_TrackingMixin, cls), {"__module__": __name__})
    return _TRACKED_CLASSES[cls]


def _find_sampler(dataloader: Any) -> BucketBatchSampler:
    bs = getattr(dataloader, "batch_sampler", None)
    if isinstance(bs, BucketBatchSampler):
        return bs
    sm = getattr(dataloader, "sampler", None)
    if isinstance(sm, BucketBatchSampler):
        return sm
    raise TypeError(
        "prepare_dataloader needs a DataLoader built with `batch_sampler=BucketBatchSampler(...)`, got batch_sampler "
        f"{type(bs).__name__}. Build it as `DataLoader(dataset, batch_sampler=sampler, collate_fn=...)`."
    )


def prepare_dataloader(accelerator: Any, dataloader: Any) -> Any:
    """Prepare a ``DataLoader(dataset, batch_sampler=BucketBatchSampler(...))`` for distributed training.

    Why not ``accelerator.prepare(dataloader)``: accelerate wraps a custom batch sampler in ``BatchSamplerShard``,
    which deals batch ``i`` to rank ``i % world``. Our sampler already yields only this rank's batches, so a plain
    ``prepare`` would shard twice (each rank trains on a ``1/world`` of its plan) — and with ``split_batches`` it
    would split every batch. This helper instead hands accelerate the *global* plan in step-major order, so
    accelerate's own sharding (or dispatching) delivers exactly each rank's planned batches, whatever its
    configuration. It also:

    * makes ``dataloader.set_epoch``/accelerate's automatic epoch counter and the sampler's cursor one and the same
      (accelerate calls ``set_epoch(iteration)`` at every pass and finds the sampler on ``batch_sampler.sampler``);
    * counts batches when they reach the training loop, so ``accelerator.save_state`` with
      ``accelerator.register_for_checkpointing(sampler)`` records the exact position even with DataLoader workers
      reading ahead, and ``accelerator.load_state`` resumes mid-epoch at the next batch.

    Args:
        accelerator: an ``accelerate.Accelerator``, or ``None`` for plain PyTorch (``torchrun`` without
            accelerate): the loader is then only wrapped for exact resume counting.
        dataloader: a ``torch.utils.data.DataLoader`` whose ``batch_sampler`` is a :class:`BucketBatchSampler`.

    Returns:
        The prepared loader (an accelerate ``DataLoaderShard``/``DataLoaderDispatcher`` subclass). ``len()`` is
        the number of batches the next pass yields on this rank.
    """
    sampler = _find_sampler(dataloader)
    if accelerator is None:
        return _TrackedLoader(dataloader, sampler)
    if getattr(accelerator, "use_stateful_dataloader", False):
        raise ValueError(
            "prepare_dataloader does not support DataLoaderConfiguration(use_stateful_dataloader=True): the "
            "StatefulDataLoader would restore its own position on load_state and skip the batches a second time. "
            "The sampler's state (accelerator.register_for_checkpointing(sampler)) already resumes exactly; "
            "use the default use_stateful_dataloader=False."
        )
    from accelerate.data_loader import _PYTORCH_DATALOADER_KWARGS
    from torch.utils.data import DataLoader

    world, rank = int(accelerator.num_processes), int(accelerator.process_index)
    if (sampler.num_replicas, sampler.rank) != (world, rank):
        raise ValueError(
            f"The sampler was built for num_replicas={sampler.num_replicas}, rank={sampler.rank}, but the accelerator "
            f"runs {world} processes and this is process {rank}. Build the sampler after creating the Accelerator "
            "(the defaults then read accelerate's state) or pass num_replicas/rank explicitly."
        )
    mode = "split" if getattr(accelerator, "split_batches", False) else "shard"
    if world == 1:
        view: Any = sampler
    else:
        view = _GlobalPlanView(sampler, mode)
    kwargs = {k: getattr(dataloader, k, v) for k, v in _PYTORCH_DATALOADER_KWARGS.items()
              if k not in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    if hasattr(dataloader, "in_order"):
        kwargs["in_order"] = dataloader.in_order
    new = DataLoader(dataloader.dataset, batch_sampler=view, **kwargs)
    # DeepSpeed reads the micro batch from `DataLoader.batch_size`, which is None with a batch sampler
    ds_plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    if ds_plugin is not None and ds_plugin.is_auto("train_micro_batch_size_per_gpu"):
        ds_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = sampler.batch_size
    prepared = accelerator.prepare(new)
    if len(prepared) != len(sampler):
        raise RuntimeError(
            f"After accelerator.prepare this rank would get {len(prepared)} batches per pass, but the plan has "
            f"{len(sampler)}. Please report this accelerate configuration to hf_arb."
        )
    cls = type(prepared)
    tracked = _tracking_class(cls).__new__(_tracking_class(cls))
    state = dict(prepared.__dict__)
    state.pop("iteration", None)
    tracked.__dict__.update(state)
    tracked._arb_sampler = sampler
    dls = getattr(accelerator, "_dataloaders", None)
    if isinstance(dls, list):
        for i, d in enumerate(dls):
            if d is prepared:
                dls[i] = tracked
    return tracked
