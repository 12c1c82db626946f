"""``BucketBatchSampler``: the epoch plan behind ``DataLoader(batch_sampler=...)`` and ``accelerator.prepare``.

Iterating the sampler yields the **global** plan of the epoch, step-major and rank-minor: at step ``s`` it yields
rank 0's batch, rank 1's batch, …, rank ``W-1``'s batch. That is exactly the order in which accelerate's own
sharding deals batches (``BatchSamplerShard``: batch ``i`` → rank ``i % W``; ``DataLoaderDispatcher``: ``W``
consecutive batches concatenated, then sliced per rank), so a plain ``accelerator.prepare(dataloader)`` hands every
rank its planned batch, with the same bucket on every rank at every step. ``len(sampler)`` is ``steps × W`` before
``prepare`` and ``len(prepared_loader)`` is ``steps`` after it — the arithmetic diffusers' scripts already do.
With ``split_batches=True`` (accelerate's option of the same name) the sampler yields one global batch of
``W × batch`` rows per step and accelerate splits it. Without accelerate, ``sampler.shard(rank)`` yields one rank's
batches.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .batch_sizes import resolve_batch_sizes
from .cursor import StepCursor
from .index import LOW_BITS, build_index, count_blocks, open_index
from .inputs import aspects, check_world, choose_catch_all, fingerprint, leftover_from, read_input
from .plan import Leftover, check_nonneg, effective_ids, iter_chunks, make_layout, merge_small_buckets
from .plan_views import PlanViews
from .ragged import iter_ragged
from .rank import RankBatchSampler, refuse_rank_idiom
from .report import warn_if_dropping, warn_if_repeating, zero_batches_message
from .state import ResumableBatchSampler, as_state_mapping, check_state, sampler_state
from .world import resolve_world

logger = logging.getLogger(__name__)

#: with ``index_dir=None``, grouped row indexes up to this many rows (64 MB) stay in memory; larger ones go to a
#: memory-mapped file shared by the processes of the node
INDEX_IN_MEMORY_ROWS = 1 << 24


class BucketBatchSampler(StepCursor, PlanViews, ResumableBatchSampler):
    """Batch sampler for aspect-ratio buckets: every batch is full and of one bucket, every rank gets the same
    number of batches, and (by default) all ranks are in the same bucket at every step.

    A drop-in for diffusers' dreambooth ``BucketBatchSampler(dataset, batch_size, drop_last=False)``: the same call
    works with an annotated dataset (its ``bucket`` column) or the bucket ids, and adds a global plan that keeps
    every rank in the same bucket, weighting by bucket size, exact resume and a report of what was dropped.

    Args:
        bucket_ids: an annotated ``datasets.Dataset`` (its ``bucket`` column; its stored BucketSet gives the
            resolutions) or the bucket id per row, shape ``(n,)`` (``-1`` rows are never sampled).
        batch_size: rows per batch on one rank (with ``split_batches=True``: per step over all ranks); or a batch
            size per bucket, ``{bucket id or "WxH" label: rows}`` (every bucket with rows needs one); with
            ``max_pixels_per_batch``, the cap on every bucket's batch (None: no cap).
        drop_last: diffusers' flag. ``True`` drops each bucket's incomplete last batch (``leftover="drop"``);
            ``False`` keeps every row by completing it from the same bucket (``leftover="fill"``). Batches are
            always full and of one bucket.
        num_replicas: data-parallel ranks. Default: ``torch.distributed`` when initialised, else the ``WORLD_SIZE``
            set by ``torchrun``/``accelerate launch``, else 1.
        rank: this process's rank (same defaults); used by :meth:`shard` and :meth:`batch_buckets`.
        seed: run seed (>= 0); together with the epoch it fixes the order.
        shuffle: shuffle rows and batch order (``False``: fixed order, for evaluation).
        sync_buckets: same bucket on every rank at every step (default). ``False`` reproduces NovelAI's
            independent per-rank draws (for comparison; no elastic resume).
        leftover: ``"drop"`` (default), ``"fill"`` or ``"catch_all"``; see :func:`~hf_arb.plan_epoch`.
        split_batches: mirror of accelerate's ``split_batches=True``: yield one list of ``batch_size`` rows per step
            (``batch_size`` divisible by ``num_replicas``) for accelerate to split.
        return_keys: yield batches of ``(row, target_bucket, epoch)`` tuples instead of row indices.
        catch_all_bucket: bucket serving catch-all batches. Default: the bucket closest to square (needs
            resolutions), else the most populous bucket.
        merge_small: merge buckets with fewer rows than one global batch into the nearest bucket in log aspect.
        buckets: a ``BucketSet`` or resolutions of shape ``(k, 2)`` as ``(width, height)``; read from the dataset
            when it is annotated.
        log_report: log :meth:`report` once when iteration first starts.
        max_pixels_per_batch: a pixel budget per batch on one rank: bucket ``b`` gets
            ``floor(max_pixels_per_batch / (w_b × h_b))`` rows, capped at ``batch_size``
            (:func:`~hf_arb.sampling.batch_sizes.batch_sizes_for_pixels`; needs resolutions). With batch sizes that
            differ by bucket, every rank still trains the same bucket (so the same batch size) at every step, a
            bucket's steps are its rows over its global batch (weighting by size in rows), ``batch_size`` is None
            (accelerate's convention for batches of varying length) and :meth:`step_batch_sizes` gives each step's.
            Needs ``sync_buckets=True`` and ``split_batches=False``.
        index_dir: where the bucket-grouped row index (4 bytes per assigned row, ``sync_buckets=True``) is kept.
            None (default): in memory below :data:`INDEX_IN_MEMORY_ROWS` rows (16 M rows, 64 MB), above that a
            file in the system's temporary directory. A directory: always a file there, named after the
            fingerprint of the bucket ids, written once (by whichever process gets there first; concurrent
            writers produce identical bytes and rename atomically) and memory-mapped read-only by every process
            of the node, so the node holds it once in its page cache. Use a node-local disk at web scale.

    Example:
        ```py
        >>> sampler = BucketBatchSampler([0] * 6 + [1] * 4, batch_size=2, num_replicas=1, seed=0)
        >>> len(sampler), all(len(b) == 2 for b in sampler)
        (5, True)
        ```
    """

    def __init__(
        self,
        bucket_ids: Any,
        batch_size: int | Mapping[Any, int] | None,
        drop_last: bool | None = None,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        sync_buckets: bool = True,
        leftover: Leftover | None = None,
        split_batches: bool = False,
        return_keys: bool = False,
        catch_all_bucket: int | None = None,
        merge_small: bool = False,
        buckets: Any | None = None,
        log_report: bool = True,
        index_dir: str | os.PathLike | None = None,
        max_pixels_per_batch: int | None = None,
    ) -> None:
        ids, self.resolutions = read_input(bucket_ids, buckets)
        self._batch_arg, self._max_pixels = batch_size, max_pixels_per_batch
        self._sizes: np.ndarray | None = None  # rows per rank of each bucket's batches, when they differ
        per_bucket = max_pixels_per_batch is not None or isinstance(batch_size, Mapping)
        if per_bucket and (split_batches or not sync_buckets):
            raise ValueError("A batch size per bucket needs sync_buckets=True and split_batches=False: accelerate's "
                             "split_batches slices every batch by one fixed size. Use one `batch_size` for those.")
        self.num_replicas, self.rank, self.per_rank_batch_size, self.batch_size = resolve_world(
            num_replicas, rank, 1 if per_bucket else batch_size, split_batches)  # the batches: see world.World
        self.split_batches = bool(split_batches)
        self._rank_given, self.seed = rank is not None, check_nonneg("seed", seed)  # rank=: see refuse_rank_idiom
        self.shuffle, self.sync_buckets, self.return_keys = bool(shuffle), bool(sync_buckets), bool(return_keys)
        self.leftover = leftover_from(drop_last, leftover)
        self.drop_last = self.leftover == "drop"
        self.log_report = bool(log_report)
        self._index_dir = index_dir
        self._prepare_plan(ids, catch_all_bucket, merge_small)
        self._init_cursor()  # epoch, position and where passes start (cursor.py, restore.py)
        self._logged = False
        self._layout_cache: tuple[int, Any] | None = None
        self._steps0 = self._layout(0).num_steps  # constant over epochs when synced
        if self._steps0 == 0:
            raise ValueError(zero_batches_message(self))
        warn_if_dropping(self)
        warn_if_repeating(self)

    # ---------------------------------------------------------------- construction steps
    def _prepare_plan(self, ids: np.ndarray, catch_all_bucket: int | None, merge_small: bool) -> None:
        """Counts, merge map, catch-all bucket, fingerprint, and the grouped row index every epoch reuses.

        Reads ``ids`` in chunks: besides the index (4 bytes per assigned row, shareable, see ``index_dir``) the
        temporaries stay at a few tens of MB whatever the number of rows.
        """
        self._rows_total = int(ids.size)
        k = int(ids.max()) + 1 if ids.size else 0
        blocks = count_blocks(ids, max(k, 0))  # (H, k) rows per (block of 2^32 rows, bucket)
        self._counts = blocks.sum(axis=0)  # (k,)
        if k <= 0 or int(self._counts.sum()) == 0:
            raise ValueError(f"No row has a bucket (got {ids.size} rows, all -1 or none). The sampler needs at least "
                             "one assigned row: check the annotation (`skip_reason` column) or the bucket set.")
        self._resolve_sizes(self._counts > 0)
        self._merge_map = None
        if merge_small:
            if self.resolutions is None:
                raise ValueError("`merge_small=True` needs bucket resolutions to find the nearest bucket in log aspect: "
                                 "pass `buckets=BucketSet(...)` (or an annotated dataset).")
            min_rows = self.global_batch_size if self.sync_buckets else self.per_rank_batch_size
            if self._sizes is not None:
                min_rows = self.num_replicas * self._sizes[:k]
            self._merge_map = merge_small_buckets(self._counts, aspects(self.resolutions)[:k], min_rows)
        self.catch_all_bucket = choose_catch_all(self.leftover, catch_all_bucket, self.resolutions, self._counts)
        self._k = k if self._merge_map is None else max(k, self._merge_map.size)
        if self.catch_all_bucket is not None:
            self._k = max(self._k, self.catch_all_bucket + 1)
            needed = np.zeros(max(self._k, k), bool)
            needed[:k], needed[self.catch_all_bucket] = self._counts > 0, True
            self._resolve_sizes(needed)
        if self._sizes is not None and self._sizes.size < self._k:
            raise ValueError(f"Bucket id {self._k - 1} has no batch size: pass the bucket set (`buckets=`).")
        self._fingerprint = fingerprint(ids, self._merge_map)
        self._eff, self._index = None, None
        if not self.sync_buckets:  # independent per-rank plans read the (merged) id of every row
            self._eff = effective_ids(ids, self._merge_map)[0]
            return
        n_valid = int(self._counts.sum())
        if self._index_dir is None and n_valid <= INDEX_IN_MEMORY_ROWS:
            self._index = build_index(ids, self._merge_map, self._k, blocks)
        else:
            folder = Path(tempfile.gettempdir()) / "hf_arb_index" if self._index_dir is None else Path(self._index_dir)
            name = f"rows-{self._fingerprint}-k{self._k}-b{LOW_BITS}.npy"
            self._index = open_index(ids, self._merge_map, self._k, blocks, folder / name)

    def _resolve_sizes(self, needed: np.ndarray) -> None:
        """Per-bucket batch sizes (a mapping or a pixel budget; :mod:`~hf_arb.sampling.batch_sizes`); one size
        for every needed bucket falls back to the plain fixed-batch plan."""
        if self._max_pixels is None and not isinstance(self._batch_arg, Mapping):
            return
        self._sizes = resolve_batch_sizes(self._batch_arg, max_pixels_per_batch=self._max_pixels,
                                          resolutions=self.resolutions, needed=needed)
        used = self._sizes[: needed.size][needed]
        self.per_rank_batch_size = int(used.max())
        if (used == used[0]).all():  # one size after all: the fixed-batch plan (and its batch_size)
            self._sizes, self.batch_size = None, self.per_rank_batch_size
        else:
            self.batch_size = None  # type: ignore[assignment]  # accelerate: batches of varying length

    # ---------------------------------------------------------------- properties
    @property
    def global_batch_size(self) -> int:
        """Rows per step over all ranks: ``num_replicas × per-rank batch``."""
        return self.num_replicas * self.per_rank_batch_size

    @property
    def batch_sizes(self) -> dict[int, int] | None:
        """``{bucket: rows per rank of its batches}`` when batch sizes differ by bucket, else None."""
        return None if self._sizes is None else dict(enumerate(self._sizes.tolist()))

    @property
    def sampler(self) -> BucketBatchSampler:
        """This sampler: accelerate looks for ``set_epoch`` on ``batch_sampler.sampler`` (also behind its
        ``BatchSamplerShard``), so ``prepared_loader.set_epoch(e)`` reaches the plan."""
        return self

    @property
    def fingerprint(self) -> str:
        """Hash of the bucket ids and the merge map: a saved state must come from the same."""
        return self._fingerprint

    @property
    def merge_small(self) -> bool:
        """Built with ``merge_small=True`` (small buckets merged into their nearest neighbour in log aspect)."""
        return self._merge_map is not None

    @property
    def steps_per_epoch(self) -> int:
        """Batches per rank in the current epoch (``len(prepared_loader)``). With ``sync_buckets=False`` it can
        vary a little from epoch to epoch (the shortest rank sets it)."""
        return self._steps_in(self._epoch)

    def _steps_in(self, epoch: int) -> int:
        return self._steps0 if self.sync_buckets else self._layout(epoch).num_steps

    def __len__(self) -> int:
        """Batches one pass yields: ``steps × num_replicas`` (one per rank per step), or ``steps`` with
        ``split_batches=True``."""
        return self.steps_per_epoch * (1 if self.split_batches else self.num_replicas)

    # ---------------------------------------------------------------- planning
    def _layout(self, epoch: int) -> Any:
        if self._layout_cache is None or self._layout_cache[0] != epoch:
            batch = self.per_rank_batch_size if self._sizes is None else self._sizes
            lay = make_layout(self._eff, self._k, batch_size=batch, world_size=self.num_replicas,
                              seed=self.seed, epoch=epoch, shuffle=self.shuffle, sync_buckets=self.sync_buckets,
                              leftover=self.leftover, catch_all_bucket=self.catch_all_bucket, index=self._index)
            self._layout_cache = (epoch, lay)
        return self._layout_cache[1]

    # ---------------------------------------------------------------- cursor (set_epoch: cursor.StepCursor)
    def _steps(self, rank: int | None = None) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Yield ``(epoch, rows (W, B), targets (W,))`` for each remaining step (with ``rank``: ``(1, B)`` and
        ``(1,)``, that rank's only); moves the cursor as it goes."""
        check_world(self.num_replicas)
        if self.log_report and not self._logged:
            self._logged = True
            logger.info("hf_arb BucketBatchSampler: %s", self.report())
        e, first, start_id = self._begin_steps()
        steps, lay = self._steps_in(e), self._layout(e)
        if self._sizes is not None:  # ragged steps (a batch size per bucket): the targets equal on every rank
            for s, rows in iter_ragged(lay, first, rank=rank):
                self._handed_out(e, s, steps, start_id)
                yield e, rows, lay.step_targets(s, s + 1)[0, : len(rows)]
            return
        for s0, rows in iter_chunks(lay, first, rank=rank):
            targets = lay.step_targets(s0, s0 + len(rows))  # (m, W)
            if rank is not None:
                targets = targets[:, rank : rank + 1]
            for i in range(len(rows)):
                self._handed_out(e, s0 + i, steps, start_id)
                yield e, rows[i], targets[i]

    def _keys(self, batch: np.ndarray, target: int, epoch: int) -> list:
        rows = batch.tolist()
        return [(r, target, epoch) for r in rows] if self.return_keys else rows

    def __iter__(self) -> Iterator[list]:
        """The remaining global plan of the epoch, step-major and rank-minor (module docstring; refuse_rank_idiom;
        after a restore, where an accelerate pass starts: :mod:`~hf_arb.sampling.restore`)."""
        refuse_rank_idiom(self.num_replicas, self.rank, self._rank_given)
        skip = self._pass_skip(1 if self.split_batches else self.num_replicas)  # after a restore (cursor.py)
        for e, rows, targets in self._steps():
            if self.split_batches:
                yield [x for r in range(self.num_replicas) for x in self._keys(rows[r], int(targets[r]), e)]
            else:
                for r in range(skip, self.num_replicas):
                    yield self._keys(rows[r], int(targets[r]), e)
                skip = 0

    def rank_batches(self, rank: int) -> Iterator[list]:
        """Rank ``rank``'s remaining batches of the epoch, moving the cursor (what ``shard(rank)`` iterates)."""
        for e, rows, targets in self._steps(rank):
            yield self._keys(rows[0], int(targets[0]), e)

    def shard(self, rank: int | None = None) -> RankBatchSampler:
        """A batch sampler over rank ``rank``'s batches only (default: this sampler's rank), for plain PyTorch
        DDP without accelerate: ``DataLoader(ds, batch_sampler=sampler.shard())``."""
        return RankBatchSampler(self, self.rank if rank is None else rank)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Small JSON-serialisable state: the iterator's position (epoch, steps handed out) and the plan's inputs
        (seed, batch sizes, options, a fingerprint of the bucket ids)."""
        return sampler_state(self)

    def load_state_dict(self, state: Any) -> None:
        """Restore the position in O(1); the next pass continues from it (unless ``set_epoch`` starts an epoch),
        and so does any pass begun after it until one hands out the rest of that epoch.

        Rejects anything that is not a state of this plan, naming the field. With the same global batch
        (``num_replicas × batch``) the number of processes may change (elastic resume; ``sync_buckets=True``).
        """
        state = as_state_mapping(state)
        self._restore_position(*check_state(state, self.state_dict(), per_rank_plan=not self.sync_buckets))

    def __repr__(self) -> str:
        return (f"BucketBatchSampler(rows={self._rows_total}, batch_size={self.batch_size}, "
                f"num_replicas={self.num_replicas}, seed={self.seed}, epoch={self._epoch}, batches_consumed="
                f"{self._consumed}, steps_per_epoch={self.steps_per_epoch}, leftover={self.leftover!r}, "
                f"sync_buckets={self.sync_buckets}, split_batches={self.split_batches})")
