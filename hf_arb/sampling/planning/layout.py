"""Epoch layouts: one epoch's plan, materialised lazily, behind one interface.

A layout answers three questions about an epoch of ``steps`` steps on ``world`` ranks with ``batch`` rows each:

* ``layout.num_steps`` — steps in the epoch (equal on every rank);
* ``layout.rows(s0, s1)`` — ``int64`` array of shape ``(s1 - s0, world, batch)``: the rows of steps ``[s0, s1)``,
  rank ``r``'s batch at step ``s`` being ``[s - s0, r]``;
* ``layout.step_targets(s0, s1)`` — ``int64`` ``(s1 - s0, world)``: the bucket each batch of those steps is
  served at (``layout.targets``: all steps, materialised);
* ``layout.batches_per_target()`` and ``layout.usage()`` — ``{target: batches}`` and
  ``(rows_used, rows_repeated, rows_catch_all)`` for the epoch's report.

:class:`~hf_arb.sampling.planning.sync.SyncLayout` plans global batches of one bucket (every rank in the same bucket at
each step) with ``O(buckets)`` state (module :mod:`~hf_arb.sampling.planning.sync`). :class:`IndependentLayout`
reproduces NovelAI's independent per-rank draws, for comparison; it materialises its epoch (``O(n)``).
"""

from __future__ import annotations

import numpy as np

from hf_arb.rng import PLAN_POOL, PLAN_RANK, PLAN_SHARD, generator

from .index import count_blocks


def bucket_counts(ids: np.ndarray, k: int) -> np.ndarray:
    """Rows per bucket, int64 shape ``(k,)`` (``ids``: shape ``(n,)``, any integer dtype, ``-1`` rows not counted;
    read in chunks, so no ``O(n)`` temporary)."""
    return count_blocks(ids, k, low_bits=62).sum(axis=0)


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

    def rows(self, s0: int, s1: int, rank: int | None = None) -> np.ndarray:
        """Rows of steps ``[s0, s1)``: int64 ``(s1 - s0, world, batch)`` (with ``rank``: ``(s1 - s0, 1, batch)``)."""
        return self.plan[s0:s1] if rank is None else self.plan[s0:s1, rank : rank + 1]

    def step_targets(self, s0: int, s1: int) -> np.ndarray:
        """Target buckets of steps ``[s0, s1)``: int64 ``(s1 - s0, world)``."""
        return self._targets[s0:s1]

    def batches_per_target(self) -> dict[int, int]:
        """``{target bucket: batches over all ranks}`` of the epoch."""
        vals, counts = np.unique(self._targets, return_counts=True)
        return {int(v): int(c) for v, c in zip(vals.tolist(), counts.tolist())}

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

    def usage(self) -> tuple[int, int, int]:
        """``(rows_used, rows_repeated, rows_catch_all)`` of the epoch."""
        used = int(np.unique(self.plan).size)
        catch = 0
        if self.leftover == "catch_all":
            catch = int((self._targets == self.catch_all_bucket).sum() * self.batch)
        return used, int(self.plan.size - used), catch


__all__ = ["IndependentLayout", "bucket_counts"]
