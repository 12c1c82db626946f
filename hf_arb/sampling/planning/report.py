"""What one epoch's plan does with the rows: :class:`PlanReport` (``sampler.report()``)."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hf_arb.wording import count


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
        steps: batches per rank; global_batch_size: rows per step over all ranks (the largest, with a batch size
            per bucket).
        batches_per_bucket: ``{target bucket: global batches}``.
        batch_size_per_bucket: ``{target bucket: rows per rank of its batches}`` when batch sizes differ by bucket
            (a pixel budget), else empty.
        rows_per_bucket: ``{bucket: assigned rows}`` for every bucket with rows (with a composite key,
            :mod:`hf_arb.sampling.composite`, the rows per composite bucket).
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
    batch_size_per_bucket: dict[int, int] = field(default_factory=dict)
    rows_per_bucket: dict[int, int] = field(default_factory=dict)

    @property
    def dropped_fraction(self) -> float:
        """Dropped rows over assigned rows."""
        assigned = self.rows_total - self.rows_unassigned
        return self.rows_dropped / assigned if assigned else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (bucket keys as strings) with ``dropped_fraction``."""
        d = asdict(self)
        d["batches_per_bucket"] = {str(b): c for b, c in self.batches_per_bucket.items()}
        d["batch_size_per_bucket"] = {str(b): c for b, c in self.batch_size_per_bucket.items()}
        d["rows_per_bucket"] = {str(b): c for b, c in self.rows_per_bucket.items()}
        d["dropped_fraction"] = self.dropped_fraction
        return d

    def __str__(self) -> str:
        batch = (f"batch per bucket {self.batch_size_per_bucket}" if self.batch_size_per_bucket
                 else f"batch {self.batch_size}")
        return (
            f"epoch {self.epoch}: {self.steps:,} steps/rank × {count(self.num_replicas, 'rank')} × {batch}; "
            f"rows: {self.rows_total:,} total, {self.rows_used:,} used, {self.rows_dropped:,} dropped "
            f"({100 * self.dropped_fraction:.1f}%), {self.rows_repeated:,} repeated, {self.rows_merged:,} merged, "
            f"{self.rows_catch_all:,} in catch-all batches, {self.rows_unassigned:,} unassigned (bucket -1); "
            f"leftover={self.leftover!r}, sync_buckets={self.sync_buckets}"
        )


def build_report(layout: Any, *, epoch: int, counts: np.ndarray, rows_total: int, merge_map: np.ndarray | None,
                 leftover: str, sync_buckets: bool) -> PlanReport:
    """The report of one epoch's layout.

    Args:
        layout: a :class:`~hf_arb.sampling.planning.sync.SyncLayout` or ``IndependentLayout`` (closed-form counts: no
            pass over the epoch's steps).
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
    return PlanReport(
        epoch=epoch, rows_total=rows_total, rows_unassigned=rows_total - assigned, rows_used=used,
        rows_dropped=assigned - used, rows_repeated=repeated, rows_merged=merged, rows_catch_all=catch,
        steps=layout.num_steps, num_replicas=layout.world, batch_size=layout.batch,
        global_batch_size=layout.world * layout.batch, leftover=leftover, sync_buckets=sync_buckets,
        batches_per_bucket=layout.batches_per_target(),
        batch_size_per_bucket={} if getattr(layout, "uniform", True) else layout.batch_per_target(),
        rows_per_bucket={int(b): int(counts[b]) for b in np.flatnonzero(counts)},
    )


def repeat_remedies(sampler: Any) -> list[str]:
    """What a user can change when ``leftover="fill"`` repeats many rows to complete batches."""
    out = ["a smaller `batch_size`" if sampler.batch_size is not None else "a smaller batch per bucket",
           "fewer buckets", '`leftover="drop"` or `"catch_all"` (no repeats)']
    if not sampler.merge_small:
        out.append("`merge_small=True` (merge small buckets)")
    return out


def remedies(sampler: Any) -> list[str]:
    """What a user can change when the plan drops too much or has no batch."""
    out = ["a smaller `batch_size`" if sampler.batch_size is not None else "a smaller batch per bucket",
           "fewer buckets"]
    if sampler.leftover != "fill":
        out.append('`leftover="fill"`' + ("" if sampler.leftover == "catch_all" else ' or `"catch_all"`'))
    if not sampler.merge_small:
        out.append("`merge_small=True` (merge small buckets)")
    return out


def zero_batches_message(sampler: Any) -> str:
    """The error of a plan without a single step."""
    sizes = sampler.batch_sizes
    need = (f"num_replicas {sampler.num_replicas} × batch_size {sampler.per_rank_batch_size}" if sizes is None
            else f"num_replicas {sampler.num_replicas} × its batch size {sizes}")
    return (
        f"The epoch plan has zero batches: no bucket holds a full global batch ({need}); largest bucket has "
        f"{int(sampler.bucket_counts.max())} rows, {int(sampler.bucket_counts.sum())} assigned rows in all. Remedies: "
        + ", ".join(remedies(sampler)) + "."
    )


def warn_if_dropping(sampler: Any) -> None:
    """A UserWarning when the plan drops more than 10 % of the assigned rows per epoch."""
    rep = sampler.report()
    if rep.dropped_fraction > 0.10:
        warnings.warn(
            f"BucketBatchSampler drops {rep.rows_dropped:,} of {rep.rows_total - rep.rows_unassigned:,} assigned "
            f"rows ({100 * rep.dropped_fraction:.1f}% > 10%) per epoch with global batch "
            f"{sampler.global_batch_size}. Remedies: " + ", ".join(remedies(sampler)) + ".",
            UserWarning, stacklevel=3,
        )


def warn_if_repeating(sampler: Any) -> None:
    """A UserWarning when ``leftover="fill"`` repeats more than half as many samples as there are assigned rows per
    epoch: a batch far larger than the buckets (39 rows in 10 buckets at global batch 64 train 640 samples, 601 of
    them repeats), where a few rows weigh many times the others. Completing each bucket's last batch with a few
    copies (under 50 %) is what ``"fill"`` is for, and stays silent."""
    rep = sampler.report()
    assigned = rep.rows_total - rep.rows_unassigned
    if assigned and rep.rows_repeated > 0.5 * assigned:
        warnings.warn(
            f"BucketBatchSampler repeats {rep.rows_repeated:,} rows per epoch ({assigned:,} assigned "
            f"{'row' if assigned == 1 else 'rows'}, {100 * rep.rows_repeated / assigned:.0f}% > 50%) to complete "
            f'batches of global batch {sampler.global_batch_size} with leftover="fill". Remedies: '
            + ", ".join(repeat_remedies(sampler)) + ".",
            UserWarning, stacklevel=3,
        )
