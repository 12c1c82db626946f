"""Read-only views of a :class:`~hf_arb.sampling.sampler.BucketBatchSampler`'s plan: the whole plan of an epoch,
its buckets and batch sizes per step, where a step counter falls, and the report. A base class of the sampler; the
cursor, the passes and the resume state are in :mod:`~hf_arb.sampling.sampler`."""

from __future__ import annotations

from typing import Any

import numpy as np

from .plan import check_nonneg
from .ragged import RaggedPlan, materialise
from .report import PlanReport, build_report


class PlanViews:
    """The plan's views, for a sampler that provides ``_layout(epoch)``, ``_steps_in(epoch)`` and the plan's inputs
    (:class:`~hf_arb.sampling.sampler.BucketBatchSampler`)."""

    _epoch: int
    _sizes: np.ndarray | None
    _steps0: int
    _counts: np.ndarray
    _rows_total: int
    _merge_map: np.ndarray | None
    rank: int
    per_rank_batch_size: int
    sync_buckets: bool
    leftover: str

    def _layout(self, epoch: int) -> Any:  # the sampler's
        raise NotImplementedError

    def _steps_in(self, epoch: int) -> int:  # the sampler's
        raise NotImplementedError

    @property
    def bucket_counts(self) -> np.ndarray:
        """Rows assigned to each bucket (this sampler's ids, before merging), int64 of shape ``(k,)``."""
        return self._counts

    def step_batch_sizes(self, epoch: int | None = None) -> np.ndarray:
        """Rows per rank of every step of ``epoch`` (default: current), int64 ``(steps,)`` (for the loss weights
        of :func:`~hf_arb.sampling.batch_sizes.accumulation_weights`)."""
        lay = self._layout(self._epoch if epoch is None else check_nonneg("epoch", epoch))
        if self._sizes is None:
            return np.full(lay.num_steps, self.per_rank_batch_size, np.int64)
        return lay.step_batch(0, lay.num_steps)

    def plan(self, epoch: int | None = None) -> np.ndarray | RaggedPlan:
        """The whole plan of ``epoch`` (default: current): int64 ``(steps, num_replicas, batch)``, equal to
        :func:`~hf_arb.plan_epoch` with this sampler's arguments; with batch sizes per bucket the
        :class:`~hf_arb.sampling.ragged.RaggedPlan` of :func:`~hf_arb.sampling.ragged.plan_epoch_ragged`."""
        lay = self._layout(self._epoch if epoch is None else check_nonneg("epoch", epoch))
        return lay.rows(0, lay.num_steps) if self._sizes is None else materialise(lay)

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

    def report(self, epoch: int | None = None) -> PlanReport:
        """Rows used, dropped, repeated, merged and served in catch-all batches in ``epoch`` (default: current)."""
        e = self._epoch if epoch is None else check_nonneg("epoch", epoch)
        return build_report(self._layout(e), epoch=e, counts=self._counts, rows_total=self._rows_total,
                            merge_map=self._merge_map, leftover=self.leftover, sync_buckets=self.sync_buckets)
