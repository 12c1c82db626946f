"""What one epoch's plan does with the rows: :class:`PlanReport` (``sampler.report()``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PlanReport:
    """What one epoch's plan does with the rows.

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
        """A JSON-serialisable dict (bucket keys as strings) with ``dropped_fraction``."""
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


def build_report(layout: Any, *, epoch: int, counts: np.ndarray, rows_total: int, merge_map: np.ndarray | None,
                 leftover: str, sync_buckets: bool) -> PlanReport:
    """The report of one epoch's layout.

    Args:
        layout: a :class:`~hf_arb.sampling.planning.layout.SyncLayout` or ``IndependentLayout``.
        epoch: the epoch it plans.
        counts: rows per original bucket, shape ``(k,)``.
        rows_total: rows of the dataset, assigned or not.
        merge_map: the small-bucket merge map, shape ``(k',)`` with ``k' >= k``, or None.
        leftover, sync_buckets: the sampler's options (echoed in the report).
    """
    assigned = int(counts.sum())
    merged = 0
    if merge_map is not None:
        moved = merge_map[: counts.size] != np.arange(counts.size)  # (k,)
        merged = int(counts[moved].sum())
    used, repeated, catch = layout.usage()
    per_step = layout.targets[:, 0]  # (steps,): in a synced plan every rank's column is equal
    tvals, tcounts = np.unique(layout.targets if not sync_buckets else per_step, return_counts=True)
    return PlanReport(
        epoch=epoch, rows_total=rows_total, rows_unassigned=rows_total - assigned, rows_used=used,
        rows_dropped=assigned - used, rows_repeated=repeated, rows_merged=merged, rows_catch_all=catch,
        steps=layout.num_steps, num_replicas=layout.world, batch_size=layout.batch,
        global_batch_size=layout.world * layout.batch, leftover=leftover, sync_buckets=sync_buckets,
        batches_per_bucket={int(t): int(c) for t, c in zip(tvals.tolist(), tcounts.tolist())},
    )
