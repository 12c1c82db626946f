"""The synchronised epoch layout, computed step by step: ``O(buckets)`` state, any step's batch in ``O(batch)``.

Let ``G = world × batch`` (the global batch) and ``n_b`` the rows of (effective) bucket ``b``. With a batch size
per bucket (a pixel budget, :mod:`~hf_arb.sampling.planning.batch_sizes`) every ``G`` below is that bucket's own
``G_b = world × batch_b`` (the pool's is its target bucket's); nothing else changes. One epoch of seed
``s`` and epoch ``e`` is defined by three kinds of keyed permutations (:class:`~hf_arb.sampling.planning.feistel.
FeistelPermutation`), none of them materialised:

* ``π_b`` over ``[0, n_b)`` (key ``s, e, PLAN_BUCKET, b``): bucket ``b``'s row order. Its positions
  ``[i·G, (i+1)·G)`` are the bucket's ``i``-th global batch; the tail ``[f_b·G, n_b)``, ``f_b = n_b // G``,
  is its leftover (``"drop"``: not trained; ``"fill"``: one more batch whose positions wrap modulo ``n_b``;
  ``"catch_all"``: pooled).
* ``σ`` over ``[0, L)`` (key ``s, e, PLAN_POOL``), ``L = Σ n_b mod G``: the catch-all pool is the leftover tails
  concatenated in bucket order, read through ``σ``; its first ``⌊L / G⌋·G`` positions form the pool's batches.
* ``τ`` over ``[0, F)`` (key ``s, e, PLAN_ORDER``), ``F`` the number of global batches: step ``t`` serves global
  batch ``τ(t)``. Global batches are numbered segment after segment (bucket 0's, bucket 1's, …, the pool's), so
  ``τ(t)`` falls in the segment whose cumulative batch count passes it (one ``searchsorted`` over ``k + 1``
  numbers) and is that segment's ``τ(t) − offset``-th batch.

Why this is size-proportional weighting: ``τ`` plays the role of a uniform shuffle of the ``F`` labelled global
batches. For a uniform shuffle, the segment of step ``t`` given all earlier steps is ``b`` with probability
(remaining batches of ``b``) / (remaining batches) — NovelAI's "proportional to remaining size" — and
conversely every bucket sequence then has probability ``Π_b f_b! / F!`` (``docs/sampler.md`` has the
argument). Mapping positions of a shuffled list to segments by cumulative counts is exactly "label each batch
with its segment and shuffle the labelled list", so the construction inherits the property to the extent that
``τ`` is indistinguishable from a uniform shuffle (tested over many keys in ``tests/test_sampler.py``).

Rank ``r`` takes positions ``[r·batch, (r+1)·batch)`` of a global batch, and nothing but ``G`` enters the
layout: the same global sequence for any split of ``G`` into ranks (elastic resume). State per epoch: the
segment tables (``O(k)``) and ``6 × 2`` key words per permutation, created on first use.
"""

from __future__ import annotations

import numpy as np

from hf_arb.rng import PLAN_BUCKET, PLAN_ORDER, PLAN_POOL

from .feistel import FeistelPermutation
from .index import RowIndex


class SyncLayout:
    """One epoch of a synchronised plan: every step is one global batch of ``world × batch`` rows of one bucket.

    Args:
        index: the bucket-grouped rows (:class:`~hf_arb.sampling.planning.index.RowIndex`), shared by every epoch.
        world, batch: ranks and rows per rank (only their product enters the plan).
        seed, epoch: key of the epoch's permutations.
        shuffle: ``False``: every permutation is the identity (buckets in id order, rows ascending).
        leftover: ``"drop"``, ``"fill"`` or ``"catch_all"``.
        catch_all_bucket: target bucket of the pool's batches (``"catch_all"``).
    """

    def __init__(self, index: RowIndex, world: int, batch: int | np.ndarray, seed: int, epoch: int, shuffle: bool,
                 leftover: str, catch_all_bucket: int | None) -> None:
        self.index, self.world = index, world
        n = index.count  # (k,)
        k = self.k = n.size
        b_all = np.asarray(batch, dtype=np.int64)
        if b_all.ndim and b_all.size < k:
            raise ValueError(f"`batch` must give a batch size for each of the {k} buckets, got {b_all.size}.")
        per_bucket = np.full(k, int(b_all), np.int64) if b_all.ndim == 0 else b_all[:k]  # (k,)
        pool_target = catch_all_bucket if catch_all_bucket is not None else -1
        pool_batch = int(per_bucket[pool_target]) if 0 <= pool_target < k else int(per_bucket.max(initial=1))
        #: per-rank rows of one batch of each segment (bucket 0 … k-1, then the pool), int64 ``(k + 1,)``
        self.seg_batch = np.concatenate([per_bucket, [pool_batch]]).astype(np.int64)
        self.uniform = bool((self.seg_batch == self.seg_batch[0]).all())
        #: rows per rank of a batch (the largest one when batch sizes differ by bucket)
        self.batch = int(self.seg_batch.max())
        Gs = self.seg_G = world * self.seg_batch  # (k + 1,) global batch of each segment
        self.G = int(Gs.max())
        self.key, self.shuffle, self.leftover = (seed, epoch), shuffle, leftover
        self.full_batches = n // Gs[:k]  # (k,)
        nb = -(-n // Gs[:k]) if leftover == "fill" else self.full_batches  # (k,) global batches per bucket
        left = n % Gs[:k] if leftover == "catch_all" else np.zeros(k, np.int64)  # (k,) leftover rows per bucket
        self.left_end = np.cumsum(left)  # (k,) end of each bucket's tail in the pool
        self.left_start = self.left_end - left
        self.pool_rows = int(left.sum())
        self.seg_batches = np.concatenate([nb, [self.pool_rows // Gs[k]]]).astype(np.int64)  # (k + 1,)
        self.batch_end = np.cumsum(self.seg_batches)  # (k + 1,)
        self.num_steps = int(self.batch_end[-1])
        self.seg_target = np.concatenate([np.arange(k), [pool_target]]).astype(np.int64)  # (k + 1,)
        self.order = FeistelPermutation(self.num_steps, (seed, epoch, PLAN_ORDER), shuffle)
        self.pool = FeistelPermutation(self.pool_rows, (seed, epoch, PLAN_POOL), shuffle)
        self._perms: dict[int, FeistelPermutation] = {}
        self._targets: np.ndarray | None = None

    # ---------------------------------------------------------------- steps -> segments
    def _segments(self, s0: int, s1: int) -> tuple[np.ndarray, np.ndarray]:
        """Segment (shape ``(m,)``) and batch index inside it (``(m,)``) of steps ``[s0, s1)``."""
        j = self.order(np.arange(s0, s1, dtype=np.int64))  # (m,) global batch of each step
        seg = np.searchsorted(self.batch_end, j, side="right")  # (m,)
        return seg, j - (self.batch_end[seg] - self.seg_batches[seg])

    def step_targets(self, s0: int, s1: int) -> np.ndarray:
        """Target bucket of steps ``[s0, s1)`` on every rank: int64 ``(s1 - s0, world)``."""
        per_step = self.seg_target[self._segments(s0, s1)[0]]  # (m,)
        return np.repeat(per_step[:, None], self.world, axis=1)

    @property
    def targets(self) -> np.ndarray:
        """Target bucket of every batch, int64 ``(steps, world)``, read-only (materialised on first use:
        ``O(steps)``; iterating the sampler never needs it)."""
        if self._targets is None:
            per_step = self.seg_target[self._segments(0, self.num_steps)[0]]
            self._targets = np.broadcast_to(per_step[:, None], (self.num_steps, self.world))
        return self._targets

    def batches_per_target(self) -> dict[int, int]:
        """``{target bucket: global batches}`` of the epoch (closed form)."""
        out: dict[int, int] = {}
        for t, c in zip(self.seg_target.tolist(), self.seg_batches.tolist()):
            if c:
                out[t] = out.get(t, 0) + c
        return dict(sorted(out.items()))

    # ---------------------------------------------------------------- positions -> rows
    def _perm(self, b: int) -> FeistelPermutation:
        perm = self._perms.get(b)
        if perm is None:
            perm = self._perms[b] = FeistelPermutation(int(self.index.count[b]), (*self.key, PLAN_BUCKET, b),
                                                       self.shuffle)
        return perm

    def _bucket_rows(self, b: int, p: np.ndarray) -> np.ndarray:
        """Rows at positions ``p`` (any shape) of bucket ``b``'s permuted order."""
        return self.index.rows(b, self._perm(b)(p))

    def _pool_rows(self, p: np.ndarray) -> np.ndarray:
        """Rows at positions ``p`` (shape ``(m,)``) of the catch-all pool."""
        u = self.pool(p)  # (m,) position in the concatenated tails
        b = np.searchsorted(self.left_end, u, side="right")  # (m,) bucket whose tail holds it
        q = self.full_batches[b] * self.seg_G[b] + (u - self.left_start[b])  # (m,) position in that bucket's order
        out = np.empty(p.shape, dtype=np.int64)
        for bb in np.unique(b).tolist():
            sel = b == bb
            out[sel] = self._bucket_rows(bb, q[sel])
        return out

    def step_batch(self, s0: int, s1: int) -> np.ndarray:
        """Rows per rank of each batch of steps ``[s0, s1)``: int64 ``(s1 - s0,)``."""
        return self.seg_batch[self._segments(s0, s1)[0]]

    def rows_flat(self, s0: int, s1: int, rank: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows of steps ``[s0, s1)`` as a ragged array: ``(flat, offsets)``, int64 of shapes ``(R,)`` and
        ``(m + 1,)`` with ``m = s1 - s0``. Step ``s0 + i``'s rows are ``flat[offsets[i]:offsets[i + 1]]``:
        ``world × b_i`` rows, rank ``r``'s batch being the ``r``-th run of ``b_i`` (with ``rank``: that rank's
        ``b_i`` rows only), ``b_i`` the batch size of the step's bucket."""
        seg, loc = self._segments(s0, s1)  # (m,), (m,)
        width = self.seg_batch[seg] * (self.world if rank is None else 1)  # (m,)
        offsets = np.concatenate([[0], np.cumsum(width)]).astype(np.int64)
        flat = np.empty(int(offsets[-1]), dtype=np.int64)
        by_seg = np.argsort(seg, kind="stable")  # steps grouped by segment
        cuts = np.flatnonzero(np.diff(seg[by_seg])) + 1
        for steps in np.split(by_seg, cuts) if seg.size else []:
            s = int(seg[steps[0]])
            B, G = int(self.seg_batch[s]), int(self.seg_G[s])
            cols = np.arange(G, dtype=np.int64) if rank is None else rank * B + np.arange(B, dtype=np.int64)
            p = loc[steps, None] * G + cols  # (m_s, G or B) positions in the segment
            if s == self.k:
                got = self._pool_rows(p.reshape(-1)).reshape(p.shape)
            else:
                if self.leftover == "fill":
                    p %= self.index.count[s]
                got = self._bucket_rows(s, p)
            flat[offsets[steps, None] + np.arange(cols.size)] = got
        return flat, offsets

    def rows(self, s0: int, s1: int, rank: int | None = None) -> np.ndarray:
        """Rows of steps ``[s0, s1)``: int64 of shape ``(s1 - s0, world, batch)``; with ``rank``, that rank's
        batches only, shape ``(s1 - s0, 1, batch)``. Only for one batch size in every bucket (else
        :meth:`rows_flat`)."""
        if not self.uniform:
            raise ValueError("This plan has a batch size per bucket: its steps are ragged, read them with "
                             "`rows_flat` (or `plan_epoch_ragged`).")
        flat, _ = self.rows_flat(s0, s1, rank)
        return flat.reshape(s1 - s0 if s1 > s0 else 0, -1, self.batch)

    def usage(self) -> tuple[int, int, int]:
        """``(rows_used, rows_repeated, rows_catch_all)`` of the epoch (closed form, no iteration)."""
        assigned = int(self.index.count.sum())
        full = int((self.full_batches * self.seg_G[:-1]).sum())
        if self.leftover == "fill":
            return assigned, int((self.seg_batches[:-1] * self.seg_G[:-1]).sum() - assigned), 0
        if self.leftover == "catch_all":
            catch = int(self.seg_batches[-1] * self.seg_G[-1])
            return full + catch, 0, catch
        return full, 0, 0

    def batch_per_target(self) -> dict[int, int]:
        """``{target bucket: rows per rank of its batches}`` for the targets that have batches."""
        return {int(t): int(b) for t, b, c in zip(self.seg_target, self.seg_batch, self.seg_batches) if c}


__all__ = ["SyncLayout"]
