"""Epoch layouts: one epoch's plan, materialised lazily, behind one interface.

A layout answers three questions about an epoch of ``steps`` steps on ``world`` ranks with ``batch`` rows each:

* ``layout.num_steps`` — steps in the epoch (equal on every rank);
* ``layout.rows(s0, s1)`` — ``int64`` array of shape ``(s1 - s0, world, batch)``: the rows of steps ``[s0, s1)``,
  rank ``r``'s batch at step ``s`` being ``[s - s0, r]``;
* ``layout.targets`` — ``int64`` array of shape ``(steps, world)``: the bucket every batch is served at;
* ``layout.usage()`` — ``(rows_used, rows_repeated, rows_catch_all)`` for the epoch's report.

:class:`SyncLayout` plans global batches of one bucket (every rank in the same bucket at each step).
:class:`IndependentLayout` reproduces NovelAI's independent per-rank draws, for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hf_arb.rng import PLAN_BUCKET, PLAN_ORDER, PLAN_POOL, PLAN_RANK, PLAN_SHARD, generator

_BLOCK = 32768  # mean rows per block of a bucket's lazily computed random order


@dataclass
class Grouping:
    """Rows grouped by effective bucket (computed once per sampler, O(n)).

    Attributes:
        rows: int64, shape ``(n_valid,)``, row indices grouped by bucket, ascending inside a group.
        start: int64, shape ``(k,)``, first position of each bucket in ``rows``.
        count: int64, shape ``(k,)``, rows per bucket.
    """

    rows: np.ndarray
    start: np.ndarray
    count: np.ndarray


def bucket_counts(ids: np.ndarray, k: int) -> np.ndarray:
    """Rows per bucket, int64 shape ``(k,)`` (``ids``: shape ``(n,)``, ``-1`` rows not counted)."""
    if k <= 64:  # k compares: no int64 copy of ids
        return np.array([np.count_nonzero(ids == b) for b in range(k)], dtype=np.int64)
    return np.bincount(ids[ids >= 0], minlength=k).astype(np.int64)[:k]


def group_rows(eff_ids: np.ndarray, k: int) -> Grouping:
    """Group valid rows (``eff_ids >= 0``, shape ``(n,)``) by bucket id in ``[0, k)``."""
    count = bucket_counts(eff_ids, k)
    start = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    index_dtype = np.int32 if eff_ids.size < 2**31 - 1 else np.int64
    if k <= 64:  # k passes of a compare: less memory than an argsort of all rows
        rows = np.empty(int(count.sum()), dtype=index_dtype)
        for b in np.flatnonzero(count):
            rows[start[b] : start[b] + count[b]] = np.flatnonzero(eff_ids == b)
        return Grouping(rows=rows, start=start, count=count)
    keys = eff_ids.astype(np.int16)  # (n,); -1 rows are moved past every bucket
    keys[eff_ids < 0] = k
    order = np.argsort(keys, kind="stable")  # radix sort for int16 keys: O(n)
    del keys
    return Grouping(rows=order[: int(count.sum())].astype(index_dtype), start=start, count=count)


class BucketPermutation:
    """One bucket's uniformly random row order for one epoch, computable block by block.

    Every row draws an i.i.d. block label in ``[0, m)`` (``m ≈ n / _BLOCK``); the order is the concatenation of
    the blocks, each uniformly shuffled with its own stream. Sorting by i.i.d. uniform keys gives a uniform
    permutation, and "label, then a uniform order inside the label" *is* sorting by the key ``label + U``: the
    result is an exactly uniform shuffle. Its use: the rows at a few positions (the first batch after a resume,
    a bucket's leftovers) cost one ``O(n)`` label draw and one small shuffle instead of a full shuffle.

    Args:
        rows: the bucket's rows in ascending order, shape ``(n,)``.
        out: a view of shape ``(n,)`` that receives the order.
        key: entropy prefix ``(seed, epoch)`` of the epoch.
        bucket: the bucket id (part of the stream's entropy).
        shuffle: ``False`` keeps ascending order.
    """

    def __init__(self, rows: np.ndarray, out: np.ndarray, key: tuple[int, int], bucket: int, shuffle: bool) -> None:
        self.rows, self.out, self.shuffle = rows, out, shuffle
        self.key = (*key, PLAN_BUCKET, bucket)
        n = rows.size
        m = max(1, -(-n // _BLOCK)) if shuffle else 1
        self.labels: np.ndarray | None = None
        if m > 1:
            self.labels = generator(*self.key).integers(0, m, size=n, dtype=np.uint16)  # (n,)
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
            generator(*self.key, block).shuffle(members)
        self.out[self.starts[block] : self.ends[block]] = members
        self.ready[block] = True


class SyncLayout:
    """One epoch of a synchronised plan: every step is one *global* batch of ``world × batch`` rows of one bucket.

    Segments are the ``k`` buckets plus (for ``leftover="catch_all"``) one pool segment ``k``. Global batch ``j``
    belongs to segment ``seg_of_batch[j]``; step ``s`` serves global batch ``order[s]``. Rows of a segment come
    from ``buffer`` (each bucket's random order, computed block by block on first use, then the pool), position
    ``p`` of segment ``b`` being ``buffer[start[b] + p % count[b]]`` (the modulo realises ``"fill"``'s repeats).
    Rank ``r`` takes columns ``[r * batch, (r + 1) * batch)`` of a global batch.
    """

    def __init__(self, grouping: Grouping, world: int, batch: int, seed: int, epoch: int, shuffle: bool,
                 leftover: str, catch_all_bucket: int | None) -> None:
        self.g, self.world, self.batch = grouping, world, batch
        G = self.G = world * batch
        self.key, self.shuffle, self.leftover = (seed, epoch), shuffle, leftover
        k = self.k = grouping.count.size
        n = grouping.count  # (k,)
        nb = -(-n // G) if leftover == "fill" else n // G  # (k,) global batches per bucket
        self.full_batches = n // G  # (k,)
        self.pool_rows = int((n % G).sum()) if leftover == "catch_all" else 0
        pool_batches = self.pool_rows // G
        self.seg_batches = np.concatenate([nb, [pool_batches]]).astype(np.int64)  # (k + 1,)
        batch_offset = np.concatenate([[0], np.cumsum(self.seg_batches)[:-1]]).astype(np.int64)  # (k + 1,)
        self.num_steps = int(self.seg_batches.sum())
        pool_target = catch_all_bucket if catch_all_bucket is not None else -1
        self.seg_target = np.concatenate([np.arange(k), [pool_target]]).astype(np.int64)  # (k + 1,)
        seg_of_batch = np.repeat(np.arange(k + 1, dtype=np.int64), self.seg_batches)  # (steps,)
        if shuffle:
            order = generator(seed, epoch, PLAN_ORDER).permutation(self.num_steps)  # (steps,)
        else:
            order = np.arange(self.num_steps, dtype=np.int64)
        self.step_seg = seg_of_batch[order]  # (steps,) segment served at each step
        self.step_local = order - batch_offset[self.step_seg]  # (steps,) batch index inside that segment
        del seg_of_batch, order
        self.seg_start = np.concatenate([grouping.start, [grouping.rows.size]]).astype(np.int64)  # (k + 1,)
        self.seg_count = np.concatenate([n, [pool_batches * G]]).astype(np.int64)  # (k + 1,)
        self.buffer = np.empty(grouping.rows.size + self.pool_rows, dtype=grouping.rows.dtype)
        self.perms: dict[int, BucketPermutation] = {}
        self.pool_ready = False
        self._targets: np.ndarray | None = None

    @property
    def targets(self) -> np.ndarray:
        """Target bucket of every batch, int64 shape ``(steps, world)``, read-only (equal along axis 1)."""
        if self._targets is None:
            per_step = self.seg_target[self.step_seg]  # (steps,)
            self._targets = np.broadcast_to(per_step[:, None], (self.num_steps, self.world))
        return self._targets

    def _perm(self, b: int) -> BucketPermutation:
        perm = self.perms.get(b)
        if perm is None:
            a, c = int(self.g.start[b]), int(self.g.count[b])
            perm = BucketPermutation(self.g.rows[a : a + c], self.buffer[a : a + c], self.key, b, self.shuffle)
            self.perms[b] = perm
        return perm

    def _ensure(self, seg: np.ndarray, p: np.ndarray) -> None:
        """Make the rows at positions ``p`` (shape ``(m, width)``) of segments ``seg`` (shape ``(m,)``) final."""
        for s in np.unique(seg).tolist():
            if s == self.k:
                self._fill_pool()
            else:
                self._perm(s).ensure_positions(p[seg == s])

    def _fill_pool(self) -> None:
        if self.pool_ready or self.pool_rows == 0:
            self.pool_ready = True
            return
        n, G = self.g.count, self.G
        parts = []  # leftovers = the tail of each bucket's order beyond its full global batches
        for b in np.flatnonzero(n % G).tolist():
            tail = np.arange(self.full_batches[b] * G, n[b])
            self._perm(b).ensure_positions(tail)
            parts.append(self.buffer[self.g.start[b] + tail])
        pool = np.concatenate(parts)
        if self.shuffle:
            generator(*self.key, PLAN_POOL).shuffle(pool)
        self.buffer[self.g.rows.size :] = pool
        self.pool_ready = True

    def rows(self, s0: int, s1: int) -> np.ndarray:
        """Rows of steps ``[s0, s1)``: int64 of shape ``(s1 - s0, world, batch)``."""
        seg, loc = self.step_seg[s0:s1], self.step_local[s0:s1]  # (m,), (m,)
        p = loc[:, None] * self.G + np.arange(self.G, dtype=np.int64)[None, :]  # (m, G) position in the segment
        if self.leftover == "fill":
            p %= self.seg_count[seg][:, None]
        self._ensure(seg, p)
        idx = self.seg_start[seg][:, None] + p  # (m, G)
        return self.buffer[idx].astype(np.int64).reshape(-1, self.world, self.batch)

    def usage(self) -> tuple[int, int, int]:
        """``(rows_used, rows_repeated, rows_catch_all)`` of the epoch (closed form, no iteration)."""
        assigned = int(self.g.count.sum())
        full = int((self.full_batches * self.G).sum())
        if self.leftover == "fill":
            return assigned, int(self.seg_batches[:-1].sum() * self.G - assigned), 0
        if self.leftover == "catch_all":
            catch = int(self.seg_batches[-1] * self.G)
            return full + catch, 0, catch
        return full, 0, 0


class IndependentLayout:
    """NovelAI's behaviour, for comparison: each rank shards the rows, batches its own buckets and draws its own
    bucket order; ``num_steps`` is the smallest per-rank batch count (the other ranks' extra batches are dropped so
    that no rank hangs). The whole epoch is materialised: ``plan`` int64 ``(steps, world, batch)``."""

    def __init__(self, eff_ids: np.ndarray, k: int, world: int, batch: int, seed: int, epoch: int, shuffle: bool,
                 leftover: str, catch_all_bucket: int | None) -> None:
        self.world, self.batch, self.leftover, self.catch_all_bucket = world, batch, leftover, catch_all_bucket
        valid = np.flatnonzero(eff_ids >= 0)
        if shuffle:
            valid = generator(seed, epoch, PLAN_SHARD).permutation(valid)
        per_rank = [self._rank_batches(valid[r::world], eff_ids, k, r, seed, epoch, shuffle) for r in range(world)]
        steps = min(len(t) for _, t in per_rank)
        self.num_steps = steps
        if steps:
            self.plan = np.stack([bt[:steps] for bt, _ in per_rank], axis=1)  # (steps, world, batch)
            self._targets = np.stack([tg[:steps] for _, tg in per_rank], axis=1)  # (steps, world)
        else:
            self.plan = np.empty((0, world, batch), np.int64)
            self._targets = np.empty((0, world), np.int64)
        self._targets.flags.writeable = False

    def _rank_batches(self, rows_r: np.ndarray, eff_ids: np.ndarray, k: int, r: int, seed: int, epoch: int,
                      shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
        """One rank's batches ``(m, batch)`` and their buckets ``(m,)``."""
        B, keys = self.batch, eff_ids[rows_r]
        batches, targets, pool = [], [], []
        for b in range(k):
            rb = rows_r[keys == b]
            if rb.size == 0:
                continue
            if self.leftover == "fill":
                L = -(-rb.size // B) * B
                batches.append(rb[np.arange(L) % rb.size].reshape(-1, B))
                targets.append(np.full(L // B, b))
                continue
            full = rb.size // B
            batches.append(rb[: full * B].reshape(full, B))
            targets.append(np.full(full, b))
            if self.leftover == "catch_all":
                pool.append(rb[full * B :])
        if pool:
            p = np.concatenate(pool)
            if shuffle:
                p = generator(seed, epoch, PLAN_POOL, r).permutation(p)
            c = p.size // B
            batches.append(p[: c * B].reshape(c, B))
            targets.append(np.full(c, self.catch_all_bucket))
        bt = np.concatenate(batches) if batches else np.empty((0, B), dtype=np.int64)
        tg = np.concatenate(targets) if targets else np.empty(0, dtype=np.int64)
        if shuffle:
            o = generator(seed, epoch, PLAN_RANK, r).permutation(len(bt))
            bt, tg = bt[o], tg[o]
        return bt.astype(np.int64), tg.astype(np.int64)

    @property
    def targets(self) -> np.ndarray:
        """Target bucket of every batch, int64 shape ``(steps, world)``, read-only."""
        return self._targets

    def rows(self, s0: int, s1: int) -> np.ndarray:
        """Rows of steps ``[s0, s1)``: int64 of shape ``(s1 - s0, world, batch)``."""
        return self.plan[s0:s1]

    def usage(self) -> tuple[int, int, int]:
        """``(rows_used, rows_repeated, rows_catch_all)`` of the epoch."""
        used = int(np.unique(self.plan).size)
        catch = 0
        if self.leftover == "catch_all":
            catch = int((self._targets == self.catch_all_bucket).sum() * self.batch)
        return used, int(self.plan.size - used), catch
