"""The epoch plan with a batch size per bucket: a ragged plan, still one pure function of its inputs.

With one batch size, :func:`~hf_arb.sampling.planning.plan.plan_epoch` returns a dense ``(steps, world, batch)`` array.
With a batch size per bucket (a pixel budget, :mod:`~hf_arb.sampling.planning.batch_sizes`) the steps have different
widths, so
:func:`plan_epoch_ragged` returns a :class:`RaggedPlan`: one flat row array cut by per-step offsets, with the
bucket and batch size of every step. The layout is the synchronised one (:mod:`~hf_arb.sampling.planning.sync`) with a
global batch ``G_b = world × b_b`` per bucket ``b``: every rank trains the same bucket, hence the same batch
size, at every step; every rank has the same number of steps; a bucket's leftover is what does not fill its own
last global batch (dropped, filled or pooled, as with one batch size, and reported); and since a bucket's steps are
``⌊n_b / G_b⌋``, a uniform shuffle of the global batches draws buckets in proportion to their remaining *batches*,
i.e. to their rows divided by their batch size, so every row keeps the same chance per epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hf_arb.checks import check_nonneg, check_positive

from .index import build_index
from .plan import CHUNK_STEPS, Leftover, as_bucket_ids, check_leftover, check_merge_map, num_buckets
from .sync import SyncLayout


@dataclass(frozen=True)
class RaggedPlan:
    """One epoch's steps when batch sizes differ by bucket.

    Attributes:
        rows: ``int64 (R,)``, every step's rows, step after step; within a step, rank 0's batch, rank 1's, ….
        offsets: ``int64 (steps + 1,)``: step ``s`` is ``rows[offsets[s]:offsets[s + 1]]`` (``world × batch[s]``).
        buckets: ``int64 (steps,)``: the bucket every rank trains at step ``s``.
        batch: ``int64 (steps,)``: rows per rank at step ``s`` (that bucket's batch size).
        world: number of ranks.
    """

    rows: np.ndarray
    offsets: np.ndarray
    buckets: np.ndarray
    batch: np.ndarray
    world: int

    @property
    def num_steps(self) -> int:
        """Steps per rank in the epoch."""
        return int(self.buckets.size)

    def step(self, s: int) -> np.ndarray:
        """Step ``s``'s rows, int64 ``(world, batch[s])``: row ``r`` is rank ``r``'s batch."""
        return self.rows[self.offsets[s] : self.offsets[s + 1]].reshape(self.world, -1)


def as_batch_sizes(batch_sizes: Any, k: int) -> np.ndarray:
    """``batch_sizes`` (an int, or one per bucket, shape ``(k',)`` with ``k' >= k``) as int64 ``(max(k, k'),)``."""
    b = np.asarray(batch_sizes)
    if b.ndim == 0:
        return np.full(max(k, 1), check_positive("batch_size", batch_sizes), np.int64)
    if b.ndim != 1 or b.size < k or b.dtype.kind not in "iu" or (b < 1).any():
        raise ValueError(f"`batch_sizes` must be a positive int or positive ints of shape (k,) with k >= {k} (one "
                         f"per bucket id), got {b.tolist() if b.size < 20 else b.shape}.")
    return b.astype(np.int64)


def iter_ragged(layout: SyncLayout, start: int = 0, rank: int | None = None,
                max_chunk: int = CHUNK_STEPS) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(step, rows)`` for steps ``[start, steps)``, ``rows`` int64 ``(world, b)`` (with ``rank``:
    ``(1, b)``), computed in chunks of 1, 8, 64, … steps (the first step after a resume costs one step)."""
    s0, size = start, 1
    while s0 < layout.num_steps:
        s1 = min(layout.num_steps, s0 + size)
        size = min(size * 8, max_chunk)
        flat, off = layout.rows_flat(s0, s1, rank)
        for i in range(s1 - s0):
            yield s0 + i, flat[off[i] : off[i + 1]].reshape(1 if rank is not None else layout.world, -1)
        s0 = s1


def plan_epoch_ragged(
    bucket_ids: Any,
    batch_sizes: Any,
    world_size: int = 1,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    leftover: Leftover = "drop",
    catch_all_bucket: int | None = None,
    merge_map: Any | None = None,
) -> RaggedPlan:
    """Plan one epoch for all ranks with a batch size per bucket (``sync_buckets=True``): a pure function.

    Args:
        bucket_ids: bucket id per row, shape ``(n,)``; ``-1`` rows are never sampled.
        batch_sizes: rows per rank of a batch of each bucket, int64 ``(k,)`` (from
            :func:`~hf_arb.sampling.planning.batch_sizes.batch_sizes_for_pixels`), or one int (then the plan's rows
            equal
            :func:`~hf_arb.sampling.planning.plan.plan_epoch`'s, flattened).
        world_size, seed, epoch, shuffle, leftover, catch_all_bucket, merge_map: as in
            :func:`~hf_arb.sampling.planning.plan.plan_epoch`. Catch-all batches take ``catch_all_bucket``'s batch size.

    Returns:
        A :class:`RaggedPlan` (``rows (R,)``, ``offsets (steps + 1,)``, ``buckets (steps,)``, ``batch (steps,)``).

    Example:
        ```py
        >>> p = plan_epoch_ragged([0] * 8 + [1] * 4, batch_sizes=[4, 1], world_size=2, seed=0)
        >>> p.num_steps, sorted(p.batch.tolist())
        (3, [1, 1, 4])
        ```
    """
    ids = as_bucket_ids(bucket_ids)
    world_size = check_positive("world_size", world_size)
    seed, epoch = check_nonneg("seed", seed), check_nonneg("epoch", epoch)
    leftover = check_leftover(leftover)  # type: ignore[assignment]
    if leftover == "catch_all" and catch_all_bucket is None:
        raise ValueError('`leftover="catch_all"` needs `catch_all_bucket` (the bucket that serves the leftovers).')
    extra = int(catch_all_bucket) + 1 if leftover == "catch_all" else 0
    mm = None if merge_map is None else check_merge_map(merge_map, ids)
    k = max(num_buckets(ids) if mm is None else mm.size, extra)
    sizes = as_batch_sizes(batch_sizes, k)
    k = max(k, sizes.size)
    layout = SyncLayout(build_index(ids, mm, k), world_size, sizes, seed, epoch, shuffle, leftover, catch_all_bucket)
    return materialise(layout)


def materialise(layout: SyncLayout) -> RaggedPlan:
    """A synchronised layout's whole epoch as a :class:`RaggedPlan` (computed in chunks of steps)."""
    parts, ends = [], [np.zeros(1, np.int64)]
    for s0 in range(0, layout.num_steps, CHUNK_STEPS):  # chunks bound the index temporaries
        s1 = min(layout.num_steps, s0 + CHUNK_STEPS)
        flat, off = layout.rows_flat(s0, s1)
        parts.append(flat)
        ends.append(off[1:] + ends[-1][-1])
    rows = np.concatenate(parts) if parts else np.empty(0, np.int64)
    buckets = layout.step_targets(0, layout.num_steps)[:, 0] if layout.num_steps else np.empty(0, np.int64)
    return RaggedPlan(rows=rows, offsets=np.concatenate(ends), buckets=buckets,
                      batch=layout.step_batch(0, layout.num_steps), world=layout.world)


__all__ = ["RaggedPlan", "iter_ragged", "materialise", "plan_epoch_ragged"]
