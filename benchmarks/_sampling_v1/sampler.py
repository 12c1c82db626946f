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
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from .inputs import aspects, choose_catch_all, default_world, fingerprint, leftover_from, read_input, runtime_world
from .layout import bucket_counts, group_rows
from .plan import Leftover, check_nonneg, check_positive, effective_ids, iter_chunks, make_layout, merge_small_buckets
from .rank import RankBatchSampler
from .report import PlanReport, build_report
from .state import PLAN_VERSION, STATE_FORMAT, as_state_mapping, check_state

logger = logging.getLogger(__name__)


class BucketBatchSampler:
    """Batch sampler for aspect-ratio buckets: every batch is full and of one bucket, every rank gets the same
    number of batches, and (by default) all ranks are in the same bucket at every step.

    A drop-in for diffusers' dreambooth ``BucketBatchSampler(dataset, batch_size, drop_last=False)``: the same call
    works with an annotated dataset (its ``bucket`` column) or the bucket ids, and adds a global plan that keeps
    every rank in the same bucket, weighting by bucket size, exact resume and a report of what was dropped.

    Args:
        bucket_ids: an annotated ``datasets.Dataset`` (its ``bucket`` column; its stored BucketSet gives the
            resolutions) or the bucket id per row, shape ``(n,)`` (``-1`` rows are never sampled).
        batch_size: rows per batch on one rank (with ``split_batches=True``: per step over all ranks).
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
        batch_size: int,
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
    ) -> None:
        ids, self.resolutions = read_input(bucket_ids, buckets)
        self._set_world(num_replicas, rank, batch_size, split_batches)
        self.seed = check_nonneg("seed", seed)
        self.shuffle, self.sync_buckets, self.return_keys = bool(shuffle), bool(sync_buckets), bool(return_keys)
        self.leftover = leftover_from(drop_last, leftover)
        self.drop_last = self.leftover == "drop"
        self.log_report = bool(log_report)
        self._prepare_plan(ids, catch_all_bucket, merge_small)
        self._epoch, self._consumed = 0, 0
        self._restored_epoch: int | None = None  # set by load_state_dict until the next set_epoch/iteration
        self._logged = False
        self._layout_cache: tuple[int, Any] | None = None
        self._steps0 = self._layout(0).num_steps  # constant over epochs when synced
        if self._steps0 == 0:
            raise ValueError(self._zero_batches_message())
        self._warn_if_dropping()

    # ---------------------------------------------------------------- construction steps
    def _set_world(self, num_replicas: int | None, rank: int | None, batch_size: int, split_batches: bool) -> None:
        w, r = default_world()
        self.num_replicas = check_positive("num_replicas", w if num_replicas is None else num_replicas)
        if rank is None:  # this process's rank, when the sampler is built for the running world
            rank = r if self.num_replicas == w else 0
        self.rank = check_nonneg("rank", rank)
        if self.rank >= self.num_replicas:
            raise ValueError(f"`rank` must be < num_replicas ({self.num_replicas}), got {self.rank}.")
        self.split_batches = bool(split_batches)
        batch_size = check_positive("batch_size", batch_size)
        if self.split_batches and batch_size % self.num_replicas:
            raise ValueError(f"With split_batches=True, `batch_size` is the global batch and must be a multiple of "
                             f"num_replicas ({self.num_replicas}), got {batch_size}. Use "
                             f"{-(-batch_size // self.num_replicas) * self.num_replicas}.")
        #: rows per batch of one rank (the plan's batch)
        self.per_rank_batch_size = batch_size // self.num_replicas if self.split_batches else batch_size
        #: rows per yielded batch (read by accelerate's BatchSamplerShard)
        self.batch_size = batch_size

    def _prepare_plan(self, ids: np.ndarray, catch_all_bucket: int | None, merge_small: bool) -> None:
        """Counts, merge map, catch-all bucket, and the O(n) grouping every epoch reuses."""
        n_valid = int(np.count_nonzero(ids >= 0))
        self._rows_total = int(ids.size)
        if n_valid == 0:
            raise ValueError(f"No row has a bucket (got {ids.size} rows, all -1 or none). The sampler needs at least "
                             "one assigned row: check the annotation (`skip_reason` column) or the bucket set.")
        k = int(ids.max()) + 1
        self._counts = bucket_counts(ids, k)  # (k,)
        self._merge_map = None
        if merge_small:
            if self.resolutions is None:
                raise ValueError(
                    "`merge_small=True` needs bucket resolutions to find the nearest bucket in log aspect: "
                    "pass `buckets=BucketSet(...)` (or an annotated dataset)."
                )
            min_rows = self.global_batch_size if self.sync_buckets else self.per_rank_batch_size
            self._merge_map = merge_small_buckets(self._counts, aspects(self.resolutions)[:k], min_rows)
        self.catch_all_bucket = choose_catch_all(self.leftover, catch_all_bucket, self.resolutions, self._counts)
        self._eff, self._k = effective_ids(ids, self._merge_map)
        if self.catch_all_bucket is not None:
            self._k = max(self._k, self.catch_all_bucket + 1)
        self._grouping = group_rows(self._eff, self._k) if self.sync_buckets else None
        self._fingerprint = fingerprint(ids, self._merge_map)
        if self.sync_buckets:  # the grouping is all a synchronised plan needs
            self._eff = None  # type: ignore[assignment]

    def _remedies(self) -> list[str]:
        out = ["a smaller `batch_size`", "fewer buckets"]
        if self.leftover != "fill":
            out.append('`leftover="fill"`' + ("" if self.leftover == "catch_all" else ' or `"catch_all"`'))
        if self._merge_map is None:
            out.append("`merge_small=True` (merge small buckets)")
        return out

    def _zero_batches_message(self) -> str:
        return (
            f"The epoch plan has zero batches: no bucket holds a full global batch of {self.global_batch_size} rows "
            f"(num_replicas {self.num_replicas} × batch_size {self.per_rank_batch_size}); largest bucket has "
            f"{int(self._counts.max())} rows, {int(self._counts.sum())} assigned rows in all. Remedies: "
            + ", ".join(self._remedies()) + "."
        )

    def _warn_if_dropping(self) -> None:
        rep = self.report()
        if rep.dropped_fraction > 0.10:
            warnings.warn(
                f"BucketBatchSampler drops {rep.rows_dropped:,} of {rep.rows_total - rep.rows_unassigned:,} assigned "
                f"rows ({100 * rep.dropped_fraction:.1f}% > 10%) per epoch with global batch "
                f"{self.global_batch_size}. Remedies: " + ", ".join(self._remedies()) + ".",
                UserWarning, stacklevel=3,
            )

    # ---------------------------------------------------------------- properties
    @property
    def global_batch_size(self) -> int:
        """Rows per step over all ranks: ``num_replicas × per-rank batch``."""
        return self.num_replicas * self.per_rank_batch_size

    @property
    def sampler(self) -> BucketBatchSampler:
        """This sampler: accelerate looks for ``set_epoch`` on ``batch_sampler.sampler`` (also behind its
        ``BatchSamplerShard``), so ``prepared_loader.set_epoch(e)`` reaches the plan."""
        return self

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Steps of the current epoch the sampler's iterator has handed out (its resume position)."""
        return self._consumed

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
            lay = make_layout(self._eff, self._k, batch_size=self.per_rank_batch_size, world_size=self.num_replicas,
                              seed=self.seed, epoch=epoch, shuffle=self.shuffle, sync_buckets=self.sync_buckets,
                              leftover=self.leftover, catch_all_bucket=self.catch_all_bucket, grouping=self._grouping)
            self._layout_cache = (epoch, lay)
        return self._layout_cache[1]

    def plan(self, epoch: int | None = None) -> np.ndarray:
        """The whole plan of ``epoch`` (default: current): int64 ``(steps, num_replicas, batch)``, equal to
        :func:`~hf_arb.plan_epoch` with this sampler's arguments."""
        lay = self._layout(self._epoch if epoch is None else check_nonneg("epoch", epoch))
        return lay.rows(0, lay.num_steps)

    def batch_buckets(self, epoch: int | None = None, rank: int | None = None) -> np.ndarray:
        """Target bucket of each step's batch on ``rank`` (default: this sampler's) in ``epoch`` (default:
        current): a read-only int64 view of shape ``(steps,)``."""
        lay = self._layout(self._epoch if epoch is None else check_nonneg("epoch", epoch))
        return lay.targets[:, self.rank if rank is None else rank]

    def locate(self, steps_done: int) -> tuple[int, int]:
        """``(epoch, step in that epoch)`` after ``steps_done`` steps per rank since epoch 0: where a run resumes.

        Example: ``epoch, step = sampler.locate(global_micro_step)``, then ``loader.set_epoch(epoch)`` and
        ``accelerator.skip_first_batches(loader, step)``.
        """
        steps_done = check_nonneg("steps_done", steps_done)
        if self.sync_buckets:
            return divmod(steps_done, self._steps0)
        epoch = 0
        while steps_done >= self._steps_in(epoch):
            steps_done -= self._steps_in(epoch)
            epoch += 1
        return epoch, steps_done

    # ---------------------------------------------------------------- cursor
    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch (accelerate calls this through the prepared loader).

        After :meth:`load_state_dict`, an epoch other than the restored one gets a warning: the loop probably
        forgot ``train_dataloader.set_epoch(epoch)`` (accelerate then counts passes from 0 again).
        """
        epoch = check_nonneg("epoch", epoch)
        if self._restored_epoch is not None and epoch != self._restored_epoch:
            warnings.warn(
                f"set_epoch({epoch}) after the sampler was restored at epoch {self._restored_epoch}: the loader starts "
                f"epoch {epoch}. If that is not what you want, call `train_dataloader.set_epoch(epoch)` with your "
                "loop's epoch before iterating (accelerate otherwise counts passes from 0 in a new process).",
                UserWarning, stacklevel=2,
            )
        self._restored_epoch = None
        self._epoch, self._consumed = epoch, 0

    def _check_world(self) -> None:
        live = runtime_world()
        if live is not None and live[0] != self.num_replicas:
            raise RuntimeError(
                f"BucketBatchSampler was built for num_replicas={self.num_replicas}, but torch.distributed runs "
                f"{live[0]} processes: its global batches would be dealt to the wrong ranks and buckets would not be "
                f"in sync. Build the sampler after creating the Accelerator (the default reads the process group) "
                f"or pass num_replicas=accelerator.num_processes."
            )

    def _steps(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Yield ``(epoch, rows (W, B), targets (W,))`` for each remaining step; moves the cursor as it goes."""
        self._check_world()
        if self.log_report and not self._logged:
            self._logged = True
            logger.info("hf_arb BucketBatchSampler: %s", self.report())
        self._restored_epoch = None
        if self._consumed >= self._steps_in(self._epoch):  # the last pass finished: this one is the next epoch
            self._epoch, self._consumed = self._epoch + 1, 0
        e = self._epoch
        lay = self._layout(e)
        for s0, rows in iter_chunks(lay, self._consumed):
            targets = lay.targets[s0 : s0 + len(rows)]  # (m, W)
            for i in range(len(rows)):
                if self._epoch == e:
                    self._consumed = s0 + i + 1
                yield e, rows[i], targets[i]

    def _keys(self, batch: np.ndarray, target: int, epoch: int) -> list:
        rows = batch.tolist()
        return [(r, target, epoch) for r in rows] if self.return_keys else rows

    def __iter__(self) -> Iterator[list]:
        """The remaining global plan of the epoch, step-major and rank-minor (see the module docstring)."""
        for e, rows, targets in self._steps():
            if self.split_batches:
                yield [x for r in range(self.num_replicas) for x in self._keys(rows[r], int(targets[r]), e)]
            else:
                for r in range(self.num_replicas):
                    yield self._keys(rows[r], int(targets[r]), e)

    def shard(self, rank: int | None = None) -> RankBatchSampler:
        """A batch sampler over rank ``rank``'s batches only (default: this sampler's rank), for plain PyTorch
        DDP without accelerate: ``DataLoader(ds, batch_sampler=sampler.shard())``."""
        return RankBatchSampler(self, self.rank if rank is None else rank)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Small JSON-serialisable state: the iterator's position (epoch, steps handed out) and the plan's inputs
        (seed, batch sizes, options, a fingerprint of the bucket ids)."""
        return {
            "format": STATE_FORMAT,
            "plan_version": PLAN_VERSION,
            "epoch": self._epoch,
            "batches_consumed": self._consumed,
            "steps_per_epoch": self.steps_per_epoch,
            "seed": self.seed,
            "batch_size": self.per_rank_batch_size,
            "num_replicas": self.num_replicas,
            "global_batch_size": self.global_batch_size,
            "options": {"shuffle": self.shuffle, "sync_buckets": self.sync_buckets, "leftover": self.leftover,
                        "catch_all_bucket": self.catch_all_bucket, "merge_small": self._merge_map is not None},
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: Any) -> None:
        """Restore the position in O(1); the next pass continues from it (unless ``set_epoch`` starts an epoch).

        Rejects anything that is not a state of this plan, naming the field. With the same global batch
        (``num_replicas × batch``) the number of processes may change (elastic resume; ``sync_buckets=True``).
        """
        state = as_state_mapping(state)
        epoch, consumed = check_state(state, self.state_dict(), per_rank_plan=not self.sync_buckets)
        steps = self._steps_in(epoch)
        if consumed > steps:
            raise ValueError(f"Sampler state field `batches_consumed` is {consumed}, more than the {steps} steps of "
                             f"epoch {epoch}: the state is corrupt. Pass what `sampler.state_dict()` returned.")
        if consumed == steps:
            epoch, consumed = epoch + 1, 0
        self._epoch, self._consumed, self._restored_epoch = epoch, consumed, epoch

    # ---------------------------------------------------------------- report
    def report(self, epoch: int | None = None) -> PlanReport:
        """Rows used, dropped, repeated, merged and served in catch-all batches in ``epoch`` (default: current)."""
        e = self._epoch if epoch is None else check_nonneg("epoch", epoch)
        return build_report(self._layout(e), epoch=e, counts=self._counts, rows_total=self._rows_total,
                            merge_map=self._merge_map, leftover=self.leftover, sync_buckets=self.sync_buckets)

    def __repr__(self) -> str:
        return (
            f"BucketBatchSampler(rows={self._rows_total}, batch_size={self.batch_size}, "
            f"num_replicas={self.num_replicas}, seed={self.seed}, epoch={self._epoch}, "
            f"batches_consumed={self._consumed}, steps_per_epoch={self.steps_per_epoch}, leftover={self.leftover!r}, "
            f"sync_buckets={self.sync_buckets}, split_batches={self.split_batches})"
        )
