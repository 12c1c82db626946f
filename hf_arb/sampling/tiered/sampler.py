"""``TieredBatchSampler``: multi-resolution training in one resumable plan, every rank in the same (tier, bucket).

The rows of each tier (:mod:`~hf_arb.sampling.tiered.plan`) are planned by the synchronised layout of the single-tier
sampler (:class:`~hf_arb.sampling.planning.sync.SyncLayout`): global batches of ``world × batch`` rows of one bucket, a
batch size per (tier, bucket) from one pixel budget. The schedule (:mod:`~hf_arb.sampling.tiered.schedule`) decides the
tier:

* step schedules (``mix``, ``curriculum``, ``progressive``): sampler epoch ``e`` is global steps
  ``[e·L, (e+1)·L)`` (``L = steps_per_epoch``); global step ``g`` trains tier ``t`` at position ``i`` of that tier's
  stream, i.e. step ``i mod S_t`` of the tier's pass ``i // S_t`` (``S_t``: steps of one pass over its rows).
  Every quantity is computed from ``(seed, epoch, step)``: state ``O(buckets × tiers)``, any step in ``O(batch)``.
* ``random``: each epoch draws a tier per row (OneTrainer) in ``O(groups)`` (:mod:`~hf_arb.sampling.tiered.draw`:
  per group of rows with the same buckets, multinomial counts per tier and a keyed permutation) and plans one
  synchronised epoch over all (tier, bucket) pairs, so a pair is drawn in proportion to its remaining batches.

Iteration mirrors :class:`~hf_arb.sampling.sampler.BucketBatchSampler`: the global plan step-major and rank-minor
(what accelerate's sharding deals out), ``shard(rank)`` for plain DDP, ``set_epoch``, ``state_dict`` /
``load_state_dict`` (exact mid-epoch, across a tier switch, and elastic: only global batches enter the plan).
With ``return_keys=True`` every index is a ``(row, tier, bucket, epoch)`` tuple, so the dataset knows the
resolution to fit each row to; :meth:`TieredBatchSampler.step_tiers` gives every step's (tier, bucket).
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.checks import check_nonneg, check_positive

from ..inputs import check_world, default_world
from ..planning.index import CHUNK, RowIndex, build_index, count_blocks, open_index
from ..planning.plan import check_leftover
from ..planning.sync import SyncLayout
from ..resume.cursor import StepCursor, locate
from ..resume.state import ResumableBatchSampler, as_state_mapping
from ..sampler import INDEX_IN_MEMORY_ROWS
from .draw import RandomEpochIndex
from .files import random_groups, shared_tier_columns
from .plan import Tiers, sizes_fingerprint, tier_batch_sizes, tier_bucket_ids
from .report import TierReport, bucket_table
from .schedule import TierSchedule, parse_resolution_schedule, stream_positions
from .state import check_tier_state, tier_state

MAX_CHUNK = 4096  # steps materialised at a time while iterating


class TieredBatchSampler(ResumableBatchSampler):
    """Batch sampler over several resolution tiers; at every step all ranks train the same (tier, bucket).

    Args:
        widths, heights: every row's stored size, shape ``(n,)`` (``original_width`` / ``original_height``);
            :meth:`from_dataset` reads them from an annotated dataset.
        tiers: the :class:`~hf_arb.sampling.tiered.plan.Tiers` (bucket set per resolution, ``max_upscale``).
        schedule: a :class:`~hf_arb.sampling.tiered.schedule.TierSchedule` or its ``--resolution_schedule`` string.
        batch_size: rows per rank of a batch: an int, one per tier (int or ``(k_t,)``), or with
            ``max_pixels_per_batch`` the cap on every batch.
        max_pixels_per_batch: one pixel budget per rank and step for every (tier, bucket).
        num_replicas, rank: as :class:`~hf_arb.sampling.sampler.BucketBatchSampler` (default: the running world).
        seed: the run's seed; shuffle: ``False`` for a fixed order.
        leftover: ``"drop"`` (a bucket's rows that fill no last global batch wait for the next pass) or
            ``"fill"`` (completed by repeats from the same bucket).
        steps_per_epoch: step schedules: steps per sampler epoch (default: the longest pass of a tier in use).
        return_keys: yield ``(row, tier, bucket, epoch)`` tuples instead of row ids.
        index_dir: where the tier columns and bucket-grouped indexes are kept as memory-mapped ``.npy`` files
            shared by a node's ranks. None: in memory up to 16 M rows, else in the system's temporary directory.
    """

    def __init__(self, widths: Any, heights: Any, tiers: Tiers, schedule: TierSchedule | str = "random", *,
                 batch_size: Any = None, max_pixels_per_batch: int | None = None, num_replicas: int | None = None,
                 rank: int | None = None, seed: int = 0, shuffle: bool = True, leftover: str = "drop",
                 steps_per_epoch: int | None = None, return_keys: bool = False,
                 index_dir: str | os.PathLike | None = None) -> None:
        self.tiers, T = tiers, tiers.num_tiers
        if isinstance(schedule, str):
            schedule = parse_resolution_schedule(schedule, tiers.resolutions)
        self.schedule = schedule.validate(T)
        w, r = default_world()
        self.num_replicas = check_positive("num_replicas", w if num_replicas is None else num_replicas)
        self.rank = check_nonneg("rank", (r if self.num_replicas == w else 0) if rank is None else rank)
        self._rank_given = rank is not None  # see __iter__
        if self.rank >= self.num_replicas:
            raise ValueError(f"`rank` must be < num_replicas ({self.num_replicas}), got {self.rank}.")
        self.seed, self.shuffle, self.return_keys = check_nonneg("seed", seed), bool(shuffle), bool(return_keys)
        self.leftover = check_leftover(leftover)
        if self.leftover == "catch_all":
            raise ValueError('TieredBatchSampler takes leftover="drop" or "fill": a catch-all batch would mix '
                             "buckets of a tier. Use one of those two.")
        widths, heights = np.asarray(widths), np.asarray(heights)
        self._rows_total = int(widths.size)
        self._fingerprint = sizes_fingerprint(widths, heights, tiers)
        self._dir = None if index_dir is None else Path(index_dir)
        if self._dir is None and self._rows_total > INDEX_IN_MEMORY_ROWS:
            self._dir = Path(tempfile.gettempdir()) / "hf_arb_index"
        ids = (tier_bucket_ids(widths, heights, tiers) if self._dir is None else
               shared_tier_columns(widths, heights, tiers, self._dir / f"tiers-{self._fingerprint}.npy"))
        k = tiers.num_buckets
        blocks = [count_blocks(ids[t], int(k[t])) for t in range(T)]  # (H, k_t) each
        self._counts = [b.sum(axis=0) for b in blocks]  # (k_t,) eligible rows per bucket of each tier
        self._no_tier = sum(int((np.asarray(ids[:, c : c + CHUNK]) < 0).all(axis=0).sum())
                            for c in range(0, self._rows_total, CHUNK))
        self._sizes = tier_batch_sizes(tiers, batch_size=batch_size, max_pixels_per_batch=max_pixels_per_batch,
                                       needed=[c > 0 for c in self._counts])
        self._used = self.schedule.tiers_used(T)
        self._layouts: OrderedDict[tuple[int, int], SyncLayout] = OrderedDict()
        self._index: dict[int, RowIndex] = {}
        self._steps: list[int] = [0] * T
        if self.schedule.per_row:
            if steps_per_epoch is not None:
                raise ValueError("`steps_per_epoch` is set by the draw under the `random` schedule (every row once "
                                 "per epoch): leave it None, or use a step schedule (mix, curriculum, progressive).")
            if not any(c.sum() for c in self._counts):
                raise ValueError("No row is eligible in any tier: lower the resolutions or raise `max_upscale`.")
            self._comb_sizes = np.concatenate(self._sizes)  # (K,)
            self._groups = random_groups(ids, tiers, self._dir, self._fingerprint)
            self._L = None
        else:
            for t in self._used:
                path = None if self._dir is None else self._dir / f"tier{t}-{self._fingerprint}-k{int(k[t])}.npy"
                self._index[t] = (build_index(ids[t], None, int(k[t]), blocks[t]) if path is None
                                  else open_index(ids[t], None, int(k[t]), blocks[t], path))
                self._steps[t] = self._layout(t, 0).num_steps
                if self._steps[t] == 0:
                    raise ValueError(
                        f"Tier {t} ({tiers.resolutions[t]}) has no full global batch (largest bucket "
                        f"{int(self._counts[t].max(initial=0))} rows, {int(self._counts[t].sum())} eligible rows; "
                        f"global batch num_replicas {self.num_replicas} × its batch size). Use smaller batches, "
                        f"leftover='fill', a larger `max_upscale`, or a schedule without this tier.")
            self._L = check_positive("steps_per_epoch", steps_per_epoch) if steps_per_epoch is not None else \
                max(self._steps[t] for t in self._used)
        self.cursor = StepCursor(self, self.steps_in)  # epoch, position, where passes start (resume/cursor.py)

    @classmethod
    def from_dataset(cls, ds: Any, tiers: Tiers, schedule: TierSchedule | str = "random",
                     **kwargs: Any) -> TieredBatchSampler:
        """Read ``original_width`` / ``original_height`` of an annotated ``datasets.Dataset`` (nulls: eligible
        nowhere) and build the sampler."""
        t = ds.select_columns(["original_width", "original_height"]).with_format("arrow")[:]
        w, h = (t.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
                for c in ("original_width", "original_height"))
        return cls(w, h, tiers, schedule, **kwargs)

    # ---------------------------------------------------------------- construction helpers
    def _layout(self, t: int, q: int) -> SyncLayout:
        """Pass ``q`` of tier ``t`` (step schedules), or epoch ``q`` over all (tier, bucket) pairs (``t = T``,
        ``random``); a few are cached."""
        T = self.tiers.num_tiers
        lay = self._layouts.get((t, q))
        if lay is None:
            if t == T:
                lay = SyncLayout(RandomEpochIndex(self._groups, self.seed, q), self.num_replicas, self._comb_sizes,
                                 self.seed, q * (T + 1) + T,
                                 self.shuffle, self.leftover, None)
            else:
                lay = SyncLayout(self._index[t], self.num_replicas, self._sizes[t], self.seed, q * (T + 1) + t,
                                 self.shuffle, self.leftover, None)
            self._layouts[(t, q)] = lay
            while len(self._layouts) > 2 * T + 2:
                self._layouts.popitem(last=False)
        return lay

    # ---------------------------------------------------------------- properties
    #: one batch per rank per step (accelerate's ``split_batches=True`` is not supported: batch sizes vary)
    split_batches = False

    @property
    def drop_last(self) -> bool:
        """``leftover == "drop"`` (read by accelerate's ``BatchSamplerShard``; every batch is full either way)."""
        return self.leftover == "drop"

    @property
    def per_rank_batch_size(self) -> int:
        """The largest rows per rank of any (tier, bucket) batch."""
        return int(max(s.max() for s in self._sizes))

    @property
    def batch_size(self) -> int | None:
        """Rows per batch when every (tier, bucket) has the same; None otherwise (accelerate's convention)."""
        used = np.concatenate([s[c > 0] for s, c in zip(self._sizes, self._counts)])
        return int(used[0]) if used.size and (used == used[0]).all() else None

    @property
    def fingerprint(self) -> str:
        """Hash of the rows' sizes and the tiers: a state from other data is refused with it."""
        return self._fingerprint

    @property
    def planned_steps(self) -> int | None:
        """Steps per epoch fixed by a step schedule (``mix``, ``curriculum``, ``progressive``); None for ``random``,
        whose epochs are as long as their draw."""
        return self._L

    @property
    def tier_batch_sizes(self) -> list[np.ndarray]:
        """Per-rank batch size of every (tier, bucket): one ``(k_t,)`` array per tier."""
        return self._sizes

    @property
    def steps_per_epoch(self) -> int:
        """Steps per rank of the current epoch (``len(prepared_loader)``). Right after a restore that is the restored
        epoch's, which the next pass (accelerate's ``skip_first_batches``) serves the rest of, also when the
        read-ahead had handed all of it out (``random``: the next epoch has another length)."""
        return self.cursor.pass_steps()

    def steps_in(self, epoch: int) -> int:
        """Steps per rank of ``epoch`` (``random``: that epoch's draw)."""
        return self._L if self._L is not None else self._layout(self.tiers.num_tiers, epoch).num_steps

    def __len__(self) -> int:
        """Batches one pass yields: steps × num_replicas."""
        return self.steps_per_epoch * self.num_replicas

    def locate(self, steps_done: int) -> tuple[int, int]:
        """``(epoch, step)`` after ``steps_done`` steps per rank since epoch 0 (``random``: walks the epochs, each
        an ``O(groups)`` draw)."""
        return locate(steps_done, self.steps_in, self._L)

    # ---------------------------------------------------------------- the plan
    def step_items(self, epoch: int, s0: int, s1: int, rank: int | None = None,
                   rows: bool = True) -> list[tuple[int, int, np.ndarray | None]]:
        """``(tier, bucket, rows)`` of steps ``[s0, s1)`` of ``epoch``; ``rows`` int64 ``(num_replicas, b)`` (with
        ``rank``: ``(1, b)``), ``b`` that (tier, bucket)'s batch size; None with ``rows=False`` (targets only)."""
        T, W = self.tiers.num_tiers, (self.num_replicas if rank is None else 1)
        if self.schedule.per_row:
            lay = self._layout(T, epoch)
            comb = lay.step_targets(s0, s1)[:, 0]  # (m,)
            tier = np.searchsorted(self.tiers.offsets, comb, side="right") - 1
            bucket = comb - self.tiers.offsets[tier]
            if not rows:
                return [(int(t), int(b), None) for t, b in zip(tier, bucket)]
            flat, off = lay.rows_flat(s0, s1, rank)
            return [(int(tier[i]), int(bucket[i]), flat[off[i] : off[i + 1]].reshape(W, -1)) for i in range(s1 - s0)]
        g = epoch * self._L + np.arange(s0, s1, dtype=np.int64)  # (m,) global steps
        tiers, pos = stream_positions(self.schedule, self.seed, g)
        out: list[Any] = [None] * g.size
        for t in np.unique(tiers).tolist():
            sel = np.flatnonzero(tiers == t)  # its stream positions are consecutive: pos[sel] = p0, p0 + 1, ...
            q, loc = np.divmod(pos[sel], self._steps[t])
            for qq in np.unique(q).tolist():
                part, lq = sel[q == qq], loc[q == qq]
                lay = self._layout(t, qq)
                tg = lay.step_targets(int(lq[0]), int(lq[-1]) + 1)[:, 0]
                if not rows:
                    for j, i in enumerate(part.tolist()):
                        out[i] = (t, int(tg[j]), None)
                    continue
                flat, off = lay.rows_flat(int(lq[0]), int(lq[-1]) + 1, rank)
                for j, i in enumerate(part.tolist()):
                    out[i] = (t, int(tg[j]), flat[off[j] : off[j + 1]].reshape(W, -1))
        return out

    def step_tiers(self, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(tier, bucket)`` of every step of ``epoch`` (default: current): int64 ``(steps,)`` each (``O(steps)``)."""
        e = self.epoch if epoch is None else check_nonneg("epoch", epoch)
        items = [it for s0 in range(0, self.steps_in(e), MAX_CHUNK)
                 for it in self.step_items(e, s0, min(self.steps_in(e), s0 + MAX_CHUNK), rows=False)]
        return (np.array([t for t, _, _ in items], np.int64), np.array([b for _, b, _ in items], np.int64))

    def step_batch_sizes(self, epoch: int | None = None) -> np.ndarray:
        """Rows per rank of every step of ``epoch``: int64 ``(steps,)`` (for
        :func:`~hf_arb.sampling.planning.batch_sizes.accumulation_weights`)."""
        tiers, buckets = self.step_tiers(epoch)
        return np.array([self._sizes[t][b] for t, b in zip(tiers.tolist(), buckets.tolist())], np.int64)

    # ---------------------------------------------------------------- cursor and iteration
    def _iter_steps(self, rank: int | None = None) -> Iterator[tuple[int, int, int, np.ndarray]]:
        """Yield ``(epoch, tier, bucket, rows)`` for the remaining steps of the epoch, moving the cursor."""
        check_world(self.num_replicas)
        e, s0, start_id = self.cursor.begin()
        steps, size = self.steps_in(e), 1
        while s0 < steps:
            s1 = min(steps, s0 + size)
            size = min(size * 8, MAX_CHUNK)
            for i, (t, b, rows) in enumerate(self.step_items(e, s0, s1, rank)):
                self.cursor.handed_out(e, s0 + i, steps, start_id)
                yield e, t, b, rows
            s0 = s1

    def _keys(self, rows: np.ndarray, tier: int, bucket: int, epoch: int) -> list:
        ids = rows.tolist()
        return [(r, tier, bucket, epoch) for r in ids] if self.return_keys else ids

    def __iter__(self) -> Iterator[list]:
        """The remaining global plan of the epoch: at each step rank 0's batch, rank 1's, … (what accelerate deals
        out). A sampler built with ``rank=`` for several ranks is refused here: that is the plain-DDP habit, which
        would give this rank every rank's batches; it wants :meth:`shard`. After a restore, an accelerate pass
        starts as :class:`~hf_arb.sampling.resume.cursor.StepCursor` says (``skip_first_batches`` exact, a plain pass
        mid-epoch refused)."""
        if self._rank_given and self.num_replicas > 1:
            raise RuntimeError(f"TieredBatchSampler(num_replicas={self.num_replicas}, rank={self.rank}) iterated "
                               f"directly serves every rank's batches: for plain DDP use `sampler.shard()`; under "
                               f"accelerator.prepare build the sampler without `rank=`.")
        skip = self.cursor.pass_skip(self.num_replicas)
        for e, t, b, rows in self._iter_steps():
            for r in range(skip, self.num_replicas):
                yield self._keys(rows[r], t, b, e)
            skip = 0

    def shard(self, rank: int | None = None) -> TierRankSampler:
        """Rank ``rank``'s batches only, for plain DDP: ``DataLoader(ds, batch_sampler=sampler.shard())``."""
        return TierRankSampler(self, self.rank if rank is None else rank)

    # ---------------------------------------------------------------- state and report
    def state_dict(self) -> dict[str, Any]:
        """Small JSON-serialisable state: position, schedule, tiers, global batches, options, fingerprint."""
        return tier_state(self, self.epoch, self.batches_consumed)

    def load_state_dict(self, state: Any) -> None:
        """Restore the position (``O(1)`` for step schedules; ``random`` redraws that epoch, ``O(groups)``).
        Refuses a state of another plan, naming the field; a different ``num_replicas`` with the same global
        batches continues the same global sequence (elastic). The next accelerate pass is placed as for
        :class:`~hf_arb.sampling.sampler.BucketBatchSampler` (:mod:`~hf_arb.sampling.resume.restore`)."""
        self.cursor.restore(*check_tier_state(as_state_mapping(state), tier_state(self, 0, 0)))

    def report(self, epoch: int | None = None) -> TierReport:
        """Rows, batches, repeats and drops per tier and bucket in ``epoch`` (default: current; ``O(steps)``)."""
        e = self.epoch if epoch is None else check_nonneg("epoch", epoch)
        tiers, _ = self.step_tiers(e)
        T, rows = self.tiers.num_tiers, []
        if self.schedule.per_row:
            comb = self._layout(T, e).index.count  # (K,) rows drawn per (tier, bucket) this epoch
            counts = [comb[a:b] for a, b in zip(self.tiers.offsets[:-1], self.tiers.offsets[1:])]
        else:
            counts = self._counts
        for t in range(T):
            n_steps = int((tiers == t).sum())
            table = bucket_table(counts[t], self._sizes[t], self.num_replicas, self.leftover)
            per_pass = sum(v["batches"] for v in table.values())
            rows.append({"tier": t, "resolution": self.tiers.resolutions[t], "rows": int(counts[t].sum()),
                         "steps": n_steps, "passes": n_steps / per_pass if per_pass else 0.0, "buckets": table})
        return TierReport(epoch=e, schedule=self.schedule.kind, rows_total=self._rows_total,
                          rows_no_tier=self._no_tier, steps=int(tiers.size), num_replicas=self.num_replicas,
                          leftover=self.leftover, tiers=rows)


class TierRankSampler:
    """One rank's view of a :class:`TieredBatchSampler` (``sampler.shard(rank)``); cursor and state are the
    parent's."""

    def __init__(self, parent: TieredBatchSampler, rank: int) -> None:
        if not 0 <= int(rank) < parent.num_replicas:
            raise ValueError(f"`rank` must be in [0, {parent.num_replicas}), got {rank}.")
        self.parent, self.rank, self.batch_size = parent, int(rank), parent.batch_size

    def __len__(self) -> int:
        return self.parent.steps_per_epoch

    def __iter__(self) -> Iterator[list]:
        for e, t, b, rows in self.parent._iter_steps(self.rank):
            yield self.parent._keys(rows[0], t, b, e)

    def set_epoch(self, epoch: int) -> None:
        self.parent.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.parent.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.parent.load_state_dict(state)


__all__ = ["TierRankSampler", "TieredBatchSampler"]
