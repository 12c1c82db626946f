"""What an annotation did: :class:`AnnotationSummary` (rows per bucket, skips by reason, aspect errors), from
the bucket columns of a dataset (:func:`summarize_annotation`) or of arrays (:func:`summarize_columns`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .buckets import AssignmentSummary, BucketSet
from .schema import require_columns


@dataclass(frozen=True)
class AnnotationSummary:
    """What :func:`add_bucket_columns` did, in the shape of NovelAI's printout.

    Attributes:
        rows: rows in the dataset.
        skipped_by_reason: skipped rows per reason category (the part of ``skip_reason`` before ``":"``).
        assignment: the :class:`~hf_arb.AssignmentSummary` (rows per bucket, aspect error over kept rows).
        unreadable_examples: up to 5 distinct full ``"unreadable: …"`` / ``"truncated: …"`` / ``"undecodable: …"``
            reasons, to show what went wrong.
    """

    rows: int
    skipped_by_reason: dict[str, int]
    assignment: AssignmentSummary
    unreadable_examples: tuple[str, ...] = ()

    @property
    def skipped(self) -> int:
        return sum(self.skipped_by_reason.values())

    @property
    def kept(self) -> int:
        return self.rows - self.skipped

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-friendly form (used in dataset cards)."""
        a = self.assignment
        err = {k: (None if math.isnan(v) else round(v, 6)) for k, v in
               (("mean", a.error_mean), ("median", a.error_median), ("max", a.error_max))}
        return {
            "rows": self.rows, "kept": self.kept, "skipped": dict(sorted(self.skipped_by_reason.items())),
            "aspect_error": err,
            "counts": {f"{w}x{h}": int(c) for (w, h), c in zip(a.resolutions.tolist(), a.counts.tolist())},
        }

    def __str__(self) -> str:
        a = self.assignment
        lines = [f"rows: {self.rows:,}  kept: {self.kept:,}  skipped: {self.skipped:,}"]
        if self.skipped_by_reason:
            lines.append("skipped by reason: " + ", ".join(f"{k} {v:,}" for k, v in sorted(self.skipped_by_reason.items())))
        for ex in self.unreadable_examples:
            lines.append(f"  e.g. {ex}")
        lines.append(f"aspect error: mean {a.error_mean:.4f}  median {a.error_median:.4f}  max {a.error_max:.4f}")
        lines.append("rows per bucket (width x height, aspect), portrait to landscape:")
        res = a.resolutions
        order = np.lexsort((res[:, 0] * res[:, 1], res[:, 0] / res[:, 1]))
        for i in order:
            w, h = res[i]
            lines.append(f"  {w:>5} x {h:<5} {w / h:6.3f}  {int(a.counts[i]):>10,}")
        return "\n".join(lines)


def summarize_columns(bucket: Any, aspect_error: Any, skip_reason: Any, buckets: BucketSet) -> AnnotationSummary:
    """:class:`AnnotationSummary` from the three columns (arrays or pyarrow arrays), vectorised.

    Args:
        bucket: bucket ids, shape ``(n,)``, ``-1`` = skipped.
        aspect_error: shape ``(n,)``; nulls allowed.
        skip_reason: strings or nulls, shape ``(n,)``.
        buckets: the BucketSet the ids refer to.
    """
    ids = pc.cast(_chunked(bucket), pa.int64()).to_numpy()  # (n,)
    err = pc.cast(_chunked(aspect_error), pa.float64()).to_numpy()  # (n,) NaN for null
    reasons = _chunked(skip_reason)
    by_reason: dict[str, int] = {}
    examples: list[str] = []
    counts = pc.value_counts(reasons.drop_null()) if len(reasons) else pa.array([], pa.struct([("values", pa.string()), ("counts", pa.int64())]))
    for item in counts.to_pylist():  # one entry per distinct reason string (few)
        full, c = item["values"], item["counts"]
        cat = full.split(":", 1)[0].strip()
        by_reason[cat] = by_reason.get(cat, 0) + int(c)
        if cat in ("unreadable", "truncated", "undecodable") and len(examples) < 5:
            examples.append(full)
    if ids.size and ids.max(initial=-1) >= len(buckets):
        raise ValueError(f"Bucket id {int(ids.max())} is out of range for a BucketSet of {len(buckets)} buckets; "
                         "the dataset was annotated with a different BucketSet. Use BucketSet.from_dataset(ds).")
    # rows with bucket -1 but no reason (should not happen) are counted as "unknown"
    missing_reason = int((ids < 0).sum()) - sum(by_reason.values())
    if missing_reason > 0:
        by_reason["unknown"] = missing_reason
    return AnnotationSummary(int(ids.size), by_reason, buckets.summarize(ids, err), tuple(examples))


def _chunked(values: Any) -> pa.ChunkedArray:
    if isinstance(values, pa.ChunkedArray):
        return values
    if isinstance(values, pa.Array):
        return pa.chunked_array([values])
    return pa.chunked_array([pa.array(values)])


def summarize_annotation(ds: Any, buckets: BucketSet | None = None) -> AnnotationSummary:
    """Summary of an annotated ``Dataset`` (vectorised over its columns) or ``IterableDataset`` (iterates once).

    Args:
        ds: a dataset with the :data:`BUCKET_COLUMNS`.
        buckets: the BucketSet; default: restored from the dataset with ``BucketSet.from_dataset``.
    """
    import datasets

    if buckets is None:
        buckets = BucketSet.from_dataset(ds)
    cols = ["bucket", "aspect_error", "skip_reason"]
    if isinstance(ds, datasets.Dataset):
        require_columns(ds, cols, "Summarising the annotation")
        t = ds.select_columns(cols).with_format("arrow")[:]
        return summarize_columns(t.column(0), t.column(1), t.column(2), buckets)
    if isinstance(ds, datasets.IterableDataset):
        parts: dict[str, list[Any]] = {c: [] for c in cols}
        for batch in ds.select_columns(cols).iter(batch_size=10_000):
            for c in cols:
                parts[c].extend(batch[c])
        return summarize_columns(pa.array(parts["bucket"], pa.int64()), pa.array(parts["aspect_error"], pa.float64()),
                                 pa.array(parts["skip_reason"], pa.string()), buckets)
    raise TypeError(f"`ds` must be a datasets Dataset or IterableDataset, got {type(ds).__name__}.")
