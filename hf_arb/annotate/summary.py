"""What an annotation did: :class:`AnnotationSummary` (rows per bucket, skips by reason, aspect errors, outliers), from
the bucket columns of a dataset (:func:`summarize_annotation`) or of arrays (:func:`summarize_columns`).

Outliers are kept rows a user probably does not want to train on as they are: an aspect error above
:data:`WARN_ASPECT_ERROR` (a 2000×100 banner cropped to a 4:1 bucket) or a cover upscale above :data:`WARN_UPSCALE`
(a 32×48 thumbnail blown up to 512×768). The summary counts them, shows the worst few and names the option that
skips them (``--max-aspect-error`` / ``--max-upscale`` / ``--min-size``, recorded in ``skip_reason``).

A clip set's summary (``BucketSet.has_frames``) has rows per (width, height, frames) bucket and the histograms of the
clips' frame counts and frame rates (:func:`value_histogram`, from ``original_frames`` / ``original_fps``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hf_arb.buckets.assignment import bucket_labels
from hf_arb.buckets.schema import require_columns
from hf_arb.buckets.sets import AssignmentSummary, BucketSet
from hf_arb.wording import count

#: default threshold of the aspect-error warning, in the BucketSet's metric units (``log``: 0.25 crops ~22 %)
WARN_ASPECT_ERROR = 0.25
#: default threshold of the upscale warning: kept rows that must be enlarged more than this to cover their bucket
WARN_UPSCALE = 2.0
_EXAMPLES = 3
#: skip reason categories whose full reasons the summary shows as examples (the datasets path's and the engines')
EXAMPLE_REASONS = ("unreadable", "truncated", "undecodable", "too_few_frames")
#: most bars of a frames / fps histogram (distinct values are shown as they are up to this many)
HIST_BINS = 12


#: a histogram value's key: the value in thousandths, ``rint(v * HIST_SCALE)`` (numpy's ``round(v, 3)`` before its
#: division), the grain the bars show. Rows per key add up over batches: the engines' partial sums (ray, spark).
HIST_SCALE = 1000
#: keys at or beyond this magnitude (values beyond ~4.6e15) are left out with NaN and nulls: they would overflow int64
_KEY_LIMIT = 2.0 ** 62


def value_keys(values: Any) -> np.ndarray:
    """Int64 keys, shape ``(m,)``, of the finite ``values`` (nulls and NaN left out): ``rint(v * HIST_SCALE)``."""
    v = pc.cast(_chunked(values), pa.float64()).to_numpy(zero_copy_only=False)  # (n,) NaN for null
    y = np.rint(v * HIST_SCALE)
    return y[np.abs(y) < _KEY_LIMIT].astype(np.int64)  # NaN / inf compare False: left out


def histogram_from_counts(keys: Any, counts: Any, *, integer: bool,
                          bins: int = HIST_BINS) -> tuple[tuple[str, int], ...]:
    """:func:`value_histogram` from rows per key (:func:`value_keys`): ``keys`` and ``counts`` of shape ``(g,)``, a key
    may repeat (partials of several batches are summed). The bars depend only on the summed counts, so any grouping of
    the rows gives the same histogram."""
    k = np.asarray(keys, dtype=np.int64)  # (g,)
    c = np.asarray(counts, dtype=np.int64)
    uk, inverse = np.unique(k, return_inverse=True)
    n = np.bincount(inverse, weights=c, minlength=uk.size).astype(np.int64)  # (u,) rows per distinct key
    keep = n > 0
    uk, n = uk[keep], n[keep]
    if uk.size == 0:
        return ()
    uniq = uk / HIST_SCALE  # (u,) == numpy.round(v, 3), the bars' values
    fmt = (lambda x: f"{int(round(x))}") if integer else (lambda x: f"{x:.3g}")
    if uniq.size <= bins:
        return tuple((fmt(u), int(m)) for u, m in zip(uniq.tolist(), n.tolist()))
    weighted, edges = np.histogram(uniq, bins=bins, weights=n)
    if integer:
        lo, hi = np.ceil(edges[:-1]), np.floor(edges[1:]) - np.r_[np.ones(bins - 1), 0]
        labels = [f"{int(a)}-{int(b)}" for a, b in zip(lo.tolist(), np.maximum(lo, hi).tolist())]
    else:
        labels = [f"{a:.3g}-{b:.3g}" for a, b in zip(edges[:-1].tolist(), edges[1:].tolist())]
    return tuple((lab, int(m)) for lab, m in zip(labels, np.rint(weighted).astype(np.int64).tolist()))


def value_histogram(values: Any, *, integer: bool, bins: int = HIST_BINS) -> tuple[tuple[str, int], ...]:
    """``(label, rows)`` per bar of a histogram of ``values`` (nulls and NaN left out), ascending: one bar per
    distinct value (to 3 decimals) when there are at most ``bins`` of them (``"81"``, ``"29.97"``), else ``bins``
    equal ranges between the smallest and largest such value (``"17-32"``), each counting the values that round into
    it. Vectorised; empty for no value. Built from rows per value (:func:`histogram_from_counts`), which is what lets
    Ray and Spark, which only see partial counts, give the same bars."""
    keys, counts = np.unique(value_keys(values), return_counts=True)
    return histogram_from_counts(keys, counts, integer=integer, bins=bins)


@dataclass(frozen=True)
class Outliers:
    """Kept rows beyond a warning threshold.

    Attributes:
        kind: ``"aspect_error"`` or ``"upscale"``.
        threshold: the warning threshold.
        count: kept rows above it.
        worst: the largest value among them.
        examples: up to 3 of the worst, as ``(row, width, height, bucket_width, bucket_height, value)``.
        paths: the examples' image file names where the dataset records them (an imagefolder does), else empty or
            ``None`` per example; the printout names the file before the row.
    """

    kind: str
    threshold: float
    count: int
    worst: float
    examples: tuple[tuple[int, int, int, int, int, float], ...]
    paths: tuple[str | None, ...] = ()

    def __str__(self) -> str:
        t = f"{self.threshold:g}"
        if self.kind == "aspect_error":
            head = (f"warning: {count(self.count, 'kept row')} {'has' if self.count == 1 else 'have'} an aspect error "
                    f"above {t} (worst {self.worst:.3f}): cropped far from {'its' if self.count == 1 else 'their'} "
                    "shape")
            fix = f"  skip them with --max-aspect-error {t} (Python: max_aspect_error={t} in the BucketSet)"
            fmt = "aspect error {:.3f}"
        else:
            head = (f"warning: {count(self.count, 'kept row')} must be upscaled more than {t}x to cover "
                    f"{'its' if self.count == 1 else 'their'} bucket (worst {self.worst:.1f}x)")
            fix = (f"  skip them with --max-upscale {t} or --min-size PX (Python: add_bucket_columns(..., "
                   f"max_upscale={t}, min_size=PX))")
            fmt = "{:.1f}x"
        paths = self.paths or (None,) * len(self.examples)
        rows = [f"  e.g. {row_label(r, p)}: {w}x{h} -> bucket {bw}x{bh} ({fmt.format(v)})"
                for (r, w, h, bw, bh, v), p in zip(self.examples, paths)]
        return "\n".join([head, *rows, fix])


def row_label(row: int, path: str | None) -> str:
    """How a printout names a row: with its file (``row 3 (photos/IMG_0042.jpg)``) where the dataset records one,
    else ``row 3``."""
    return f"row {row} ({path})" if path else f"row {row}"


@dataclass(frozen=True)
class AnnotationSummary:
    """What :func:`add_bucket_columns` did, in the shape of NovelAI's printout.

    Attributes:
        rows: rows in the dataset.
        skipped_by_reason: skipped rows per reason category (the part of ``skip_reason`` before ``":"``).
        assignment: the :class:`~hf_arb.AssignmentSummary` (rows per bucket, aspect error over kept rows).
        unreadable_examples: up to 5 distinct full ``"unreadable: …"`` / ``"truncated: …"`` / ``"undecodable: …"``
            reasons, to show what went wrong.
        outliers: kept rows beyond the warning thresholds (:class:`Outliers`, one per kind that has any).
        skipped_files: the first :data:`SKIPPED_SHOWN` skipped rows as ``(row, path, skip_reason)`` (path: the image's
            file name where the image column records one, else ``None``); :func:`skipped_files` lists them all.
        frames_histogram, fps_histogram: a clip set's rows (read ones, kept or not) per frame count and per frame rate
            (:func:`value_histogram`; images count as 1 frame at fps 0); empty for an image set.
        slide: ``(clips, windows)`` of a dataset annotated with ``frame_sampling="slide"``: the clips cut into windows
            and the rows they became (from the ``frame_start`` column); None otherwise.
    """

    rows: int
    skipped_by_reason: dict[str, int]
    assignment: AssignmentSummary
    unreadable_examples: tuple[str, ...] = ()
    outliers: tuple[Outliers, ...] = ()
    skipped_files: tuple[tuple[int, str | None, str], ...] = ()
    frames_histogram: tuple[tuple[str, int], ...] = ()
    fps_histogram: tuple[tuple[str, int], ...] = ()
    slide: tuple[int, int] | None = None

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
            "counts": dict(zip(bucket_labels(a.resolutions), (int(c) for c in a.counts.tolist()))),
            **({"frames": dict(self.frames_histogram), "fps": dict(self.fps_histogram)} if self.frames_histogram
               else {}),
            **({"slide": {"clips": self.slide[0], "rows": self.slide[1]}} if self.slide else {}),
        }

    def __str__(self) -> str:
        a = self.assignment
        lines = [f"rows: {self.rows:,}  kept: {self.kept:,}  skipped: {self.skipped:,}"]
        if self.slide:
            clips, windows = self.slide
            lines.append(f"slide: {count(clips, 'clip')} -> {count(windows, 'row')} ({windows - clips:,} added by "
                         "windows)")
        if self.skipped_by_reason:
            lines.append(
                "skipped by reason: " + ", ".join(f"{k} {v:,}" for k, v in sorted(self.skipped_by_reason.items()))
            )
        for row, path, reason in self.skipped_files:
            lines.append(f"  {row_label(row, path)}: {reason}")
        if self.skipped > len(self.skipped_files) and self.skipped_files:
            lines.append(f"  ... and {self.skipped - len(self.skipped_files):,} more: "
                         "hf_arb.annotate.summary.skipped_files(ds) lists every one")
        if not self.skipped_files:
            lines.extend(f"  e.g. {ex}" for ex in self.unreadable_examples)
        lines.append(f"aspect error: mean {a.error_mean:.4f}  median {a.error_median:.4f}  max {a.error_max:.4f}")
        res = a.resolutions
        clip = res.shape[1] > 2
        lines.append("rows per bucket (width x height" + (" x frames" if clip else "")
                     + ", aspect), " + ("by frames, then " if clip else "") + "portrait to landscape:")
        frames = res[:, 2] if clip else np.ones(len(res), np.int64)
        order = np.lexsort((res[:, 0] * res[:, 1], res[:, 0] / res[:, 1], frames))
        for i in order:
            w, h = res[i, :2]
            f = f" x {int(res[i, 2]):<4}" if clip else ""
            lines.append(f"  {w:>5} x {h:<5}{f} {w / h:6.3f}  {int(a.counts[i]):>10,}")
        for name, hist in (("frames", self.frames_histogram), ("fps", self.fps_histogram)):
            if hist:
                lines.append(f"rows per {name} ({'clip length' if name == 'frames' else 'frame rate'}; images: "
                             f"{'1' if name == 'frames' else '0'}): " + ", ".join(f"{k}: {v:,}" for k, v in hist))
        lines.extend(str(o) for o in self.outliers)
        return "\n".join(lines)


def summarize_columns(bucket: Any, aspect_error: Any, skip_reason: Any, buckets: BucketSet, *,
                      sizes: tuple[Any, Any] | None = None, warn_aspect_error: float | None = WARN_ASPECT_ERROR,
                      warn_upscale: float | None = WARN_UPSCALE,
                      clips: tuple[Any, Any] | None = None, frame_start: Any = None) -> AnnotationSummary:
    """:class:`AnnotationSummary` from the three columns (arrays or pyarrow arrays), vectorised.

    Args:
        bucket: bucket ids, shape ``(n,)``, ``-1`` = skipped.
        aspect_error: shape ``(n,)``; nulls allowed.
        skip_reason: strings or nulls, shape ``(n,)``.
        buckets: the BucketSet the ids refer to.
        sizes: the ``original_width`` and ``original_height`` columns, shape ``(n,)`` each; needed for the upscale
            warning and for the sizes in the examples.
        warn_aspect_error: report kept rows whose aspect error exceeds this (``None``: no warning; also none when the
            BucketSet already prunes with ``max_aspect_error``).
        warn_upscale: report kept rows whose cover scale ``max(bucket_w / w, bucket_h / h)`` exceeds this (``None``:
            no warning, e.g. when ``max_upscale`` already skipped them).
        clips: a clip set's ``original_frames`` and ``original_fps`` columns, shape ``(n,)`` each: the histograms.
        frame_start: a clip set's ``frame_start`` column, shape ``(n,)``: the ``slide`` windows counted.
    """
    ids = pc.cast(_chunked(bucket), pa.int64()).to_numpy()  # (n,)
    err = pc.cast(_chunked(aspect_error), pa.float64()).to_numpy()  # (n,) NaN for null
    reasons = _chunked(skip_reason)
    by_reason: dict[str, int] = {}
    examples: list[str] = []
    counts = (
        pc.value_counts(reasons.drop_null())
        if len(reasons)
        else pa.array([], pa.struct([("values", pa.string()), ("counts", pa.int64())]))
    )
    for item in counts.to_pylist():  # one entry per distinct reason string (few)
        full, c = item["values"], item["counts"]
        cat = full.split(":", 1)[0].strip()
        by_reason[cat] = by_reason.get(cat, 0) + int(c)
        if cat in EXAMPLE_REASONS and len(examples) < 5:
            examples.append(full)
    if ids.size and ids.max(initial=-1) >= len(buckets):
        raise ValueError(f"Bucket id {int(ids.max())} is out of range for a BucketSet of {len(buckets)} buckets; "
                         "the dataset was annotated with a different BucketSet. Use BucketSet.from_dataset(ds).")
    # rows with bucket -1 but no reason (should not happen) are counted as "unknown"
    missing_reason = int((ids < 0).sum()) - sum(by_reason.values())
    if missing_reason > 0:
        by_reason["unknown"] = missing_reason
    if buckets.max_aspect_error is not None:
        warn_aspect_error = None  # the BucketSet prunes by its own threshold: every kept row is within it
    outliers = _outliers(ids, err, sizes, buckets, warn_aspect_error, warn_upscale)
    hists: dict[str, Any] = {} if clips is None else {"frames_histogram": value_histogram(clips[0], integer=True),
                                      "fps_histogram": value_histogram(clips[1], integer=False)}
    if frame_start is not None:
        from .clips import slide_counts_of

        hists["slide"] = slide_counts_of(_chunked(frame_start))
    return AnnotationSummary(int(ids.size), by_reason, buckets.summarize(ids, err), tuple(examples), outliers,
                             **hists)


def cover_scales(ids: Any, widths: Any, heights: Any, buckets: BucketSet) -> np.ndarray:
    """Each kept row's cover scale ``max(bucket_w / w, bucket_h / h)``, shape ``(n,)``; NaN for skipped rows (id -1)
    and missing sizes. Above 1: the row is upscaled to cover its bucket."""
    ids = np.asarray(ids, dtype=np.int64)  # (n,)
    w, h = (pc.cast(_chunked(c), pa.float64()).to_numpy(zero_copy_only=False) for c in (widths, heights))  # (n,)
    res = buckets.resolutions.astype(np.float64)  # (k, 2)
    kept = ids >= 0
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = np.maximum(res[np.where(kept, ids, 0), 0] / w, res[np.where(kept, ids, 0), 1] / h)  # (n,)
    return np.where(kept & (w > 0) & (h > 0), scale, np.nan)


def _outliers(ids: np.ndarray, err: np.ndarray, sizes: tuple[Any, Any] | None, buckets: BucketSet,
              warn_aspect_error: float | None, warn_upscale: float | None) -> tuple[Outliers, ...]:
    """Kept rows above the warning thresholds, vectorised; the worst :data:`_EXAMPLES` of each kind as examples."""
    kept = ids >= 0  # (n,)
    res = buckets.resolutions  # (k, 2), or (k, 3) with frames
    bw, bh = (res[np.where(kept, ids, 0), j] for j in (0, 1))  # (n,) each
    if sizes is not None:
        w, h = (pc.cast(_chunked(c), pa.float64()).to_numpy(zero_copy_only=False) for c in sizes)  # (n,) NaN = null
    else:
        w = h = np.full(ids.shape, np.nan)
    values: list[tuple[str, float | None, np.ndarray]] = [("aspect_error", warn_aspect_error, err)]
    if sizes is not None:
        values.append(("upscale", warn_upscale, cover_scales(ids, *sizes, buckets)))  # (n,) cover scale
    out = []
    for kind, threshold, v in values:
        if threshold is None:
            continue
        over = np.flatnonzero(kept & (np.nan_to_num(v, nan=-np.inf) > threshold))  # row indices, ascending
        if over.size == 0:
            continue
        worst = over[np.argsort(-v[over], kind="stable")[:_EXAMPLES]]
        ex = tuple((int(r), *(int(x) if np.isfinite(x) else 0 for x in (w[r], h[r], bw[r], bh[r])), float(v[r]))
                   for r in worst)
        out.append(Outliers(kind, float(threshold), int(over.size), float(v[worst[0]]), ex))  # type: ignore[arg-type]
    return tuple(out)


def _chunked(values: Any) -> pa.ChunkedArray:
    if isinstance(values, pa.ChunkedArray):
        return values
    if isinstance(values, pa.Array):
        return pa.chunked_array([values])
    return pa.chunked_array([pa.array(values)])


def summarize_annotation(ds: Any, buckets: BucketSet | None = None, *,
                         warn_aspect_error: float | None = WARN_ASPECT_ERROR,
                         warn_upscale: float | None = WARN_UPSCALE, image_column: str = "image") -> AnnotationSummary:
    """Summary of an annotated ``Dataset`` (vectorised over its columns) or ``IterableDataset`` (iterates once).

    Args:
        ds: a dataset with the :data:`BUCKET_COLUMNS`.
        buckets: the BucketSet; default: restored from the dataset with ``BucketSet.from_dataset``.
        warn_aspect_error, warn_upscale: thresholds of the outlier warnings (see :func:`summarize_columns`).
        image_column: where the skipped rows' file names are read (``Dataset`` only; no image is decoded).
    """
    import dataclasses

    import datasets

    if buckets is None:
        buckets = BucketSet.from_dataset(ds)
    cols = ["bucket", "aspect_error", "skip_reason"]
    names = getattr(ds, "column_names", None) or []
    size_cols = [c for c in ("original_width", "original_height") if c in names]
    clip_cols = [c for c in ("original_frames", "original_fps", "frame_start") if c in names] \
        if buckets.has_frames else []
    warn: dict[str, Any] = {"warn_aspect_error": warn_aspect_error, "warn_upscale": warn_upscale}
    if isinstance(ds, datasets.Dataset):
        require_columns(ds, cols, "Summarising the annotation")
        t = ds.select_columns(cols + size_cols + clip_cols).with_format("arrow")[:]
        sizes = (t.column("original_width"), t.column("original_height")) if len(size_cols) == 2 else None
        if len(clip_cols) >= 2:
            warn["clips"] = (t.column("original_frames"), t.column("original_fps"))
        if "frame_start" in clip_cols:
            warn["frame_start"] = t.column("frame_start")
        summary = summarize_columns(t.column(0), t.column(1), t.column(2), buckets, sizes=sizes, **warn)
        shown = skipped_files(ds, image_column, limit=SKIPPED_SHOWN) if summary.skipped else []
        outliers = tuple(dataclasses.replace(o, paths=tuple(row_paths(ds, image_column, [e[0] for e in o.examples])))
                         for o in summary.outliers)
        return dataclasses.replace(summary, skipped_files=tuple(shown), outliers=outliers)
    if isinstance(ds, datasets.IterableDataset):
        parts: dict[str, list[Any]] = {c: [] for c in cols + size_cols + clip_cols}
        for batch in ds.select_columns(cols + size_cols + clip_cols).iter(batch_size=10_000):
            for c, values in parts.items():
                values.extend(batch[c])
        sizes = (pa.array(parts["original_width"], pa.int64()), pa.array(parts["original_height"], pa.int64())) \
            if len(size_cols) == 2 else None
        if len(clip_cols) >= 2:
            warn["clips"] = (pa.array(parts["original_frames"], pa.int64()), pa.array(parts["original_fps"],
                                                                                       pa.float64()))
        if "frame_start" in clip_cols:
            warn["frame_start"] = pa.array(parts["frame_start"], pa.int64())
        return summarize_columns(pa.array(parts["bucket"], pa.int64()), pa.array(parts["aspect_error"], pa.float64()),
                                 pa.array(parts["skip_reason"], pa.string()), buckets, sizes=sizes, **warn)
    raise TypeError(f"`ds` must be a datasets Dataset or IterableDataset, got {type(ds).__name__}.")


#: Skipped rows the printed summary names (row, file, reason); :func:`skipped_files` returns all of them.
SKIPPED_SHOWN = 10


def skipped_files(ds: Any, image_column: str = "image", limit: int | None = None) -> list[tuple[int, str | None, str]]:
    """The rows annotation skipped, as ``(row, path, skip_reason)``, in row order; nothing is decoded.

    ``ds`` is an annotated ``datasets.Dataset``. ``path`` is the image's file name where ``image_column`` is an
    ``Image`` column that records one (an imagefolder does), else ``None``. Reads the ``bucket`` column and, for the
    skipped rows only, the reason and the image's path field (``ds.filter(lambda r: r["bucket"] < 0)`` would decode
    every image, including the broken ones it is looking for).
    """
    require_columns(ds, ["bucket", "skip_reason"], "Listing the skipped files")
    ids = pc.cast(_chunked(ds.select_columns(["bucket"]).with_format("arrow")[:].column(0)), pa.int64()).to_numpy()
    rows = np.flatnonzero(ids < 0)[:limit]  # (s,) row indices, ascending
    if rows.size == 0:
        return []
    reasons = ds.select_columns(["skip_reason"]).with_format("arrow")[rows.tolist()].column(0).to_pylist()
    paths = row_paths(ds, image_column, rows.tolist())
    return [(int(r), p, reason or "unknown") for r, p, reason in zip(rows.tolist(), paths, reasons)]


def row_paths(ds: Any, image_column: str, rows: list[int]) -> list[str | None]:
    """The image file names of ``rows`` of a ``datasets.Dataset`` where ``image_column`` is an ``Image`` column that
    records one (an imagefolder does; only the path field is read, nothing is decoded), else ``None`` each."""
    import datasets

    feature = getattr(ds, "features", {}).get(image_column)
    if rows and feature is not None and getattr(feature, "dtype", None) == "string":  # a column of file paths
        return ds.select_columns([image_column]).with_format("arrow")[list(rows)].column(0).to_pylist()
    if not rows or not isinstance(feature, (datasets.Image, datasets.Video)):  # {bytes, path}: read the path field
        return [None] * len(rows)
    raw = ds.select_columns([image_column]).with_format("arrow")[list(rows)].column(0).combine_chunks()
    return raw.field("path").to_pylist()
