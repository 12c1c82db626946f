"""What assigning images to buckets works on and produces: validated size arrays and the
:class:`AssignmentSummary` (NovelAI's printout: rows per bucket, aspect errors).

A bucket table is ``(k, D)``: ``D = 2`` columns ``(width, height)`` for images, ``D = 3`` columns
``(width, height, frames)`` for clips (an image in a clip table is a 1-frame clip)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def as_size_array(values: Any, name: str) -> np.ndarray:
    """Check widths or heights: a 1-D numeric array of positive finite values (dtype kept)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be 1-D, got shape {arr.shape}. Pass a flat list or array of sizes.")
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"`{name}` must be numeric, got dtype {arr.dtype}. Convert the column to integers first.")
    if arr.dtype.kind == "b":
        arr = arr.astype(np.int64)
    if arr.size == 0:
        return arr
    # Fast path: two reductions, no temporaries. NaN makes min() NaN, which fails `> 0`.
    if arr.min() > 0 and (arr.dtype.kind != "f" or np.isfinite(arr.max())):
        return arr
    bad = ~(arr > 0) | ~np.isfinite(arr)  # (n,) bool
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(
        f"`{name}` must hold positive finite sizes, but {name}[{i}] = {arr[i].item()!r} "
        f"({int(bad.sum())} bad value(s) in all). Drop or fix those rows before assigning buckets "
        "(`add_bucket_columns` records them with a skip_reason instead of raising)."
    )
    return arr


@dataclass(frozen=True)
class AssignmentSummary:
    """What an assignment did, in the shape of NovelAI's printout.

    Attributes:
        total: rows assigned.
        skipped: rows with bucket ``-1``.
        counts: rows per bucket, shape ``(k,)``, aligned with ``BucketSet.resolutions``.
        error_mean, error_median, error_max: aspect error over the kept rows (NaN when none kept).
        resolutions: the bucket table, shape ``(k, 2)`` or ``(k, 3)`` (with frames).
    """

    total: int
    skipped: int
    counts: np.ndarray
    error_mean: float
    error_median: float
    error_max: float
    resolutions: np.ndarray = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (used by dataset cards and benchmarks)."""
        return {
            "total": self.total,
            "skipped": self.skipped,
            "error_mean": self.error_mean,
            "error_median": self.error_median,
            "error_max": self.error_max,
            "counts": dict(zip(bucket_labels(self.resolutions), self.counts.tolist())),
        }

    def __str__(self) -> str:
        lines = [
            f"rows: {self.total:,}  kept: {self.total - self.skipped:,}  skipped: {self.skipped:,}",
            f"aspect error: mean {self.error_mean:.4f}  median {self.error_median:.4f}  max {self.error_max:.4f}",
            "rows per bucket (width x height" + (" x frames" if self.resolutions.shape[1] > 2 else "") + ", aspect):",
        ]
        res = self.resolutions
        order = np.argsort(res[:, 0] / res[:, 1], kind="stable")
        if res.shape[1] > 2:  # clips: by frames, then aspect
            order = order[np.argsort(res[order, 2], kind="stable")]
        for i in order:
            w, h = res[i, :2]
            f = f" x {res[i, 2]:<4}" if res.shape[1] > 2 else ""
            lines.append(f"  {w:>5} x {h:<5}{f} {w / h:6.3f}  {int(self.counts[i]):>10,}")
        return "\n".join(lines)


def bucket_labels(resolutions: np.ndarray) -> list[str]:
    """``"WxH"`` per bucket of a ``(k, 2)`` table, ``"WxHxF"`` of a ``(k, 3)`` one."""
    return ["x".join(map(str, r)) for r in np.asarray(resolutions).tolist()]


def normalise_resolutions(resolutions: Iterable[Sequence[int]]) -> np.ndarray:
    """Validate an explicit resolution list → read-only int64 array of shape ``(k, 2)`` (width, height) or ``(k, 3)``
    (width, height, frames)."""
    res = np.asarray(list(resolutions))
    if res.size == 0:
        raise ValueError(
            "A BucketSet needs at least one resolution, got an empty list. "
            "Pass [(width, height), ...] or use BucketSet.novelai(), BucketSet.sdxl() or BucketSet.from_budget(...)."
        )
    if res.ndim != 2 or res.shape[1] not in (2, 3):
        raise ValueError(f"Resolutions must be (width, height) pairs, or (width, height, frames) triples for clips, "
                         f"got an array of shape {res.shape}.")
    if res.dtype.kind == "f" and not np.all(np.isfinite(res) & (res == np.round(res))):
        raise ValueError(f"Resolutions must be whole pixels, got {res.tolist()}.")
    res = res.astype(np.int64)
    bad = np.flatnonzero((res <= 0).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"Resolutions must be positive, but resolution {i} is {tuple(res[i].tolist())}.")
    _, first, counts = np.unique(res, axis=0, return_index=True, return_counts=True)
    if (counts > 1).any():
        dup = res[first[counts > 1][0]]
        raise ValueError(
            f"Resolutions must be unique, but {tuple(dup.tolist())} appears more than once. Remove the duplicates."
        )
    res.flags.writeable = False
    return res
