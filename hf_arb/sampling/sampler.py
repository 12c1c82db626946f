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

The module is one class over pure functions: :func:`prepare_plan` turns the inputs into a :class:`BucketPlan` once,
the epoch's layout is :func:`~hf_arb.sampling.planning.plan.make_layout` of it, and the position is the
:class:`~hf_arb.sampling.resume.cursor.StepCursor` every resumable sampler holds.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .inputs import aspects, check_world, choose_catch_all, fingerprint, frame_groups, leftover_from, read_input
from .planning.batch_sizes import resolve_batch_sizes
from .planning.index import LOW_BITS, build_index, count_blocks, open_index
from .planning.plan import Leftover, check_nonneg, effective_ids, iter_chunks, make_layout, merge_small_buckets
from .planning.ragged import RaggedPlan, iter_ragged, materialise
from .planning.report import PlanReport, build_report, warn_if_dropping, warn_if_repeating, zero_batches_message
from .rank import RankBatchSampler, refuse_rank_idiom
from .resume.cursor import StepCursor, locate
from .resume.state import ResumableBatchSampler, as_state_mapping, check_state, sampler_state
from .world import resolve_world

logger = logging.getLogger(__name__)

#: with ``index_dir=None``, grouped row indexes up to this many rows (64 MB) stay in memory; larger ones go to a
#: memory-mapped file shared by the processes of the node
INDEX_IN_MEMORY_ROWS = 1 << 24


# ==================================================================================================== pure functions
@dataclass(frozen=True)
class BucketPlan:
    """What every epoch of a :class:`BucketBatchSampler`'s plan is built from (:func:`prepare_plan`).

    Attributes:
        counts: rows assigned to each bucket (before merging), int64 ``(k,)``.
        rows_total: rows given (assigned or not).
        num_buckets: buckets the plan addresses (after merging, and the catch-all bucket).
        merge_map: bucket -> the bucket it was merged into (``merge_small=True``), or None.
        catch_all_bucket: the bucket serving catch-all batches (``leftover="catch_all"``), or None.
        sizes: rows per rank of each bucket's batches when they differ by bucket, else None.
        per_rank_batch_size: rows per rank of a batch (with ``sizes``: the largest).
        fingerprint: hash of the bucket ids and the merge map (a saved state must come from the same).
        effective_ids: every row's (merged) bucket, for independent per-rank plans (``sync_buckets=False``).
        index: the bucket-grouped row index (``sync_buckets=True``).
    """

    counts: np.ndarray
    rows_total: int
    num_buckets: int
    merge_map: np.ndarray | None
    catch_all_bucket: int | None
    sizes: np.ndarray | None
    per_rank_batch_size: int
    fingerprint: str
    effective_ids: np.ndarray | None
    index: Any


def bucket_batch_sizes(batch_size: int | Mapping[Any, int] | None, max_pixels_per_batch: int | None,
                       resolutions: np.ndarray | None, needed: np.ndarray) -> tuple[np.ndarray | None, int]:
    """Rows per rank of every bucket's batches and the largest of them, from a mapping or a pixel budget
    (:mod:`~hf_arb.sampling.planning.batch_sizes`): ``(sizes, largest)``, the sizes None when one size serves every
    ``needed`` bucket (the fixed-batch plan)."""
    sizes = resolve_batch_sizes(batch_size, max_pixels_per_batch=max_pixels_per_batch, resolutions=resolutions,
                                needed=needed)
    used = sizes[: needed.size][needed]
    return (None if (used == used[0]).all() else sizes), int(used.max())


def prepare_plan(ids: np.ndarray, resolutions: np.ndarray | None, *, batch_size: int | Mapping[Any, int] | None,
                 max_pixels_per_batch: int | None, per_rank_batch_size: int, num_replicas: int, sync_buckets: bool,
                 leftover: str, catch_all_bucket: int | None, merge_small: bool,
                 index_dir: str | os.PathLike | None) -> BucketPlan:
    """Counts, batch sizes, merge map, catch-all bucket, fingerprint, and the grouped row index every epoch reuses.

    Reads ``ids`` in chunks: besides the index (4 bytes per assigned row, shareable, see ``index_dir``) the
    temporaries stay at a few tens of MB whatever the number of rows. ``per_rank_batch_size`` is the world's (used
    unless ``batch_size`` is a mapping or ``max_pixels_per_batch`` is set).

    Raises:
        ValueError: no row has a bucket, ``merge_small`` without resolutions, or a bucket without a batch size.
    """
    per_bucket = max_pixels_per_batch is not None or isinstance(batch_size, Mapping)
    k = int(ids.max()) + 1 if ids.size else 0
    blocks = count_blocks(ids, max(k, 0))  # (H, k) rows per (block of 2^32 rows, bucket)
    counts = blocks.sum(axis=0)  # (k,)
    if k <= 0 or int(counts.sum()) == 0:
        raise ValueError(f"No row has a bucket (got {ids.size} rows, all -1 or none). The sampler needs at least "
                         "one assigned row: check the annotation (`skip_reason` column) or the bucket set.")
    sizes, per_rank = None, per_rank_batch_size
    if per_bucket:
        sizes, per_rank = bucket_batch_sizes(batch_size, max_pixels_per_batch, resolutions, counts > 0)
    merge_map = None
    if merge_small:
        if resolutions is None:
            raise ValueError("`merge_small=True` needs bucket resolutions to find the nearest bucket in log aspect: "
                             "pass `buckets=BucketSet(...)` (or an annotated dataset).")
        min_rows = num_replicas * (per_rank if sizes is None else sizes[:k]) if sync_buckets else per_rank
        merge_map = merge_small_buckets(counts, aspects(resolutions)[:k], min_rows, frame_groups(resolutions)[:k])
    catch_all = choose_catch_all(leftover, catch_all_bucket, resolutions, counts)
    n = k if merge_map is None else max(k, merge_map.size)
    if catch_all is not None:
        n = max(n, catch_all + 1)
        if per_bucket:
            needed = np.zeros(n, bool)
            needed[:k], needed[catch_all] = counts > 0, True
            sizes, per_rank = bucket_batch_sizes(batch_size, max_pixels_per_batch, resolutions, needed)
    if sizes is not None and sizes.size < n:
        raise ValueError(f"Bucket id {n - 1} has no batch size: pass the bucket set (`buckets=`).")
    fp = fingerprint(ids, merge_map)
    eff = index = None
    if not sync_buckets:  # independent per-rank plans read the (merged) id of every row
        eff = effective_ids(ids, merge_map)[0]
    elif index_dir is None and int(counts.sum()) <= INDEX_IN_MEMORY_ROWS:
        index = build_index(ids, merge_map, n, blocks)
    else:
        folder = Path(tempfile.gettempdir()) / "hf_arb_index" if index_dir is None else Path(index_dir)
        index = open_index(ids, merge_map, n, blocks, folder / f"rows-{fp}-k{n}-b{LOW_BITS}.npy")
    return BucketPlan(counts, int(ids.size), n, merge_map, catch_all, sizes, per_rank, fp, eff, index)


# ==================================================================================================== the class
class BucketBatchSampler(ResumableBatchSampler):
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
            (:func:`~hf_arb.sampling.planning.batch_sizes.batch_sizes_for_pixels`; needs resolutions). With batch
            sizes that differ by bucket, every rank still trains the same bucket (so the same batch size) at every step,
            a bucket's steps are its rows over its global batch (weighting by size in rows), ``batch_size`` is None
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
        self._plan = prepare_plan(
            ids, self.resolutions, batch_size=batch_size, max_pixels_per_batch=max_pixels_per_batch,
            per_rank_batch_size=self.per_rank_batch_size, num_replicas=self.num_replicas,
            sync_buckets=self.sync_buckets, leftover=self.leftover, catch_all_bucket=catch_all_bucket,
            merge_small=merge_small, index_dir=index_dir)
        self.catch_all_bucket = self._plan.catch_all_bucket
        if per_bucket:  # sizes differ by bucket: batch_size None, accelerate's batches of varying length
            self.per_rank_batch_size = self._plan.per_rank_batch_size
            self.batch_size = None if self._plan.sizes is not None else self.per_rank_batch_size  # type: ignore
        self.cursor = StepCursor(self, self._steps_in)  # epoch, position, where passes start (resume/cursor.py)
        self._logged = False
        self._layout_cache: tuple[int, Any] | None = None
        self._steps0 = self._layout(0).num_steps  # constant over epochs when synced
        if self._steps0 == 0:
            raise ValueError(zero_batches_message(self))
        warn_if_dropping(self)
        warn_if_repeating(self)

    # ---------------------------------------------------------------- properties
    @property
    def global_batch_size(self) -> int:
        """Rows per step over all ranks: ``num_replicas × per-rank batch``."""
        return self.num_replicas * self.per_rank_batch_size

    @property
    def batch_sizes(self) -> dict[int, int] | None:
        """``{bucket: rows per rank of its batches}`` when batch sizes differ by bucket, else None."""
        return None if self._plan.sizes is None else dict(enumerate(self._plan.sizes.tolist()))

    @property
    def fingerprint(self) -> str:
        """Hash of the bucket ids and the merge map: a saved state must come from the same."""
        return self._plan.fingerprint

    @property
    def merge_small(self) -> bool:
        """Built with ``merge_small=True`` (small buckets merged into their nearest neighbour in log aspect)."""
        return self._plan.merge_map is not None

    @property
    def bucket_counts(self) -> np.ndarray:
        """Rows assigned to each bucket (this sampler's ids, before merging), int64 of shape ``(k,)``."""
        return self._plan.counts

    @property
    def steps_per_epoch(self) -> int:
        """Batches per rank in the current epoch (``len(prepared_loader)``). With ``sync_buckets=False`` it can
        vary a little from epoch to epoch (the shortest rank sets it)."""
        return self._steps_in(self.epoch)

    def _steps_in(self, epoch: int) -> int:
        return self._steps0 if self.sync_buckets else self._layout(epoch).num_steps

    def __len__(self) -> int:
        """Batches one pass yields: ``steps × num_replicas`` (one per rank per step), or ``steps`` with
        ``split_batches=True``."""
        return self.steps_per_epoch * (1 if self.split_batches else self.num_replicas)

    # ---------------------------------------------------------------- the plan and its views
    def _layout(self, epoch: int) -> Any:
        if self._layout_cache is None or self._layout_cache[0] != epoch:
            plan = self._plan
            batch = self.per_rank_batch_size if plan.sizes is None else plan.sizes
            lay = make_layout(plan.effective_ids, plan.num_buckets, batch_size=batch, world_size=self.num_replicas,
                              seed=self.seed, epoch=epoch, shuffle=self.shuffle, sync_buckets=self.sync_buckets,
                              leftover=self.leftover, catch_all_bucket=self.catch_all_bucket, index=plan.index)
            self._layout_cache = (epoch, lay)
        return self._layout_cache[1]

    def _epoch_layout(self, epoch: int | None) -> Any:
        return self._layout(self.epoch if epoch is None else check_nonneg("epoch", epoch))

    def step_batch_sizes(self, epoch: int | None = None) -> np.ndarray:
        """Rows per rank of every step of ``epoch`` (default: current), int64 ``(steps,)`` (for the loss weights
        of :func:`~hf_arb.sampling.planning.batch_sizes.accumulation_weights`)."""
        lay = self._epoch_layout(epoch)
        if self._plan.sizes is None:
            return np.full(lay.num_steps, self.per_rank_batch_size, np.int64)
        return lay.step_batch(0, lay.num_steps)

    def plan(self, epoch: int | None = None) -> np.ndarray | RaggedPlan:
        """The whole plan of ``epoch`` (default: current): int64 ``(steps, num_replicas, batch)``, equal to
        :func:`~hf_arb.plan_epoch` with this sampler's arguments; with batch sizes per bucket the
        :class:`~hf_arb.sampling.planning.ragged.RaggedPlan` of
        :func:`~hf_arb.sampling.planning.ragged.plan_epoch_ragged`."""
        lay = self._epoch_layout(epoch)
        return lay.rows(0, lay.num_steps) if self._plan.sizes is None else materialise(lay)

    def batch_buckets(self, epoch: int | None = None, rank: int | None = None) -> np.ndarray:
        """Target bucket of each step's batch on ``rank`` (default: this sampler's) in ``epoch`` (default:
        current): a read-only int64 view of shape ``(steps,)``."""
        return self._epoch_layout(epoch).targets[:, self.rank if rank is None else rank]

    def locate(self, steps_done: int) -> tuple[int, int]:
        """``(epoch, step in that epoch)`` after ``steps_done`` steps per rank since epoch 0: where a run resumes.

        Example: ``epoch, step = sampler.locate(global_micro_step)``, then ``loader.set_epoch(epoch)`` and
        ``accelerator.skip_first_batches(loader, step)``.
        """
        return locate(steps_done, self._steps_in, self._steps0 if self.sync_buckets else None)

    def report(self, epoch: int | None = None) -> PlanReport:
        """Rows used, dropped, repeated, merged and served in catch-all batches in ``epoch`` (default: current)."""
        e = self.epoch if epoch is None else check_nonneg("epoch", epoch)
        plan = self._plan
        return build_report(self._layout(e), epoch=e, counts=plan.counts, rows_total=plan.rows_total,
                            merge_map=plan.merge_map, leftover=self.leftover, sync_buckets=self.sync_buckets)

    # ---------------------------------------------------------------- passes (the position: self.cursor)
    def _steps(self, rank: int | None = None) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Yield ``(epoch, rows (W, B), targets (W,))`` for each remaining step (with ``rank``: ``(1, B)`` and
        ``(1,)``, that rank's only); moves the cursor as it goes."""
        check_world(self.num_replicas)
        if self.log_report and not self._logged:
            self._logged = True
            logger.info("hf_arb BucketBatchSampler: %s", self.report())
        e, first, start_id = self.cursor.begin()
        steps, lay = self._steps_in(e), self._layout(e)
        if self._plan.sizes is not None:  # ragged steps (a batch size per bucket): the targets equal on every rank
            for s, rows in iter_ragged(lay, first, rank=rank):
                self.cursor.handed_out(e, s, steps, start_id)
                yield e, rows, lay.step_targets(s, s + 1)[0, : len(rows)]
            return
        for s0, rows in iter_chunks(lay, first, rank=rank):
            targets = lay.step_targets(s0, s0 + len(rows))  # (m, W)
            if rank is not None:
                targets = targets[:, rank : rank + 1]
            for i in range(len(rows)):
                self.cursor.handed_out(e, s0 + i, steps, start_id)
                yield e, rows[i], targets[i]

    def _keys(self, batch: np.ndarray, target: int, epoch: int) -> list:
        rows = batch.tolist()
        return [(r, target, epoch) for r in rows] if self.return_keys else rows

    def __iter__(self) -> Iterator[list]:
        """The remaining global plan of the epoch, step-major and rank-minor (module docstring; refuse_rank_idiom;
        after a restore, where an accelerate pass starts: :mod:`~hf_arb.sampling.resume.restore`)."""
        refuse_rank_idiom(self.num_replicas, self.rank, self._rank_given)
        skip = self.cursor.pass_skip(1 if self.split_batches else self.num_replicas)  # after a restore
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
        self.cursor.restore(*check_state(state, self.state_dict(), per_rank_plan=not self.sync_buckets))

    def __repr__(self) -> str:
        return (f"BucketBatchSampler(rows={self._plan.rows_total}, batch_size={self.batch_size}, "
                f"num_replicas={self.num_replicas}, seed={self.seed}, epoch={self.epoch}, batches_consumed="
                f"{self.batches_consumed}, steps_per_epoch={self.steps_per_epoch}, leftover={self.leftover!r}, "
                f"sync_buckets={self.sync_buckets}, split_batches={self.split_batches})")
