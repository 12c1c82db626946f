"""One pure Arrow-batch function for bucketing, shared by ``datasets.map``, Ray Data and Spark.

:func:`bucket_columns` turns one ``pyarrow.RecordBatch``/``Table`` into the
:data:`~hf_arb.buckets.schema.BUCKET_COLUMNS` (from width/height columns, or from image bytes/paths by reading headers);
:func:`annotate_batch` appends them to the batch and stamps the schema with the ``datasets`` features (the BucketSet
rides in the ``bucket`` feature), so a Parquet file written from the result loads with
``datasets.load_dataset("parquet", ...)`` and ``BucketSet.from_dataset`` returns the exact set. :class:`BatchAnnotator`
is the picklable callable the engines map.

The engine summary is also Arrow-only: :func:`summary_partials` groups each batch (map-side) and the engine merges
the partials with its own ``groupby``, and :func:`summary_from_groups` turns the grouped rows into an
:class:`~hf_arb.annotate.AnnotationSummary` on the driver.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hf_arb.buckets.references import check_policy, check_reference_columns, reference_features
from hf_arb.buckets.schema import BUCKET_COLUMNS, CLIP_BUCKET_COLUMNS, arrow_schema, bucket_features, clip_arrow_schema
from hf_arb.buckets.sets import BucketSet
from hf_arb.images.values import arrow_values, sizes_of

from .clips import check_clip_set, check_frame_sampling, clip_bucket_columns, image_clip_columns, slide_windows
from .core import annotate_sizes, size_column
from .references import annotate_references

#: every column annotation writes (a clip set's too): an old one is replaced, whichever set wrote it
ANNOTATION_COLUMNS = (*BUCKET_COLUMNS, *CLIP_BUCKET_COLUMNS)

#: Width of the aspect-error histogram bins used for the engine summary's median (the median is exact to this).
ERROR_BIN = 2.0 ** -14
#: ``bucket`` of the engine summary's histogram rows (:func:`summary_partials`): rows per ``original_frames`` and per
#: ``original_fps`` value, keyed in ``error_bin`` by :func:`hf_arb.annotate.summary.value_keys`. Below every bucket id
#: and ``-1`` (skipped), so the engines' one ``groupby`` on the three keys merges them with the rest.
FRAMES_ROW, FPS_ROW = -2, -3


@functools.lru_cache(maxsize=16)
def _buckets(config: str) -> BucketSet:
    return BucketSet.from_json(config)


def _table(batch: pa.RecordBatch | pa.Table) -> pa.Table:
    if isinstance(batch, pa.RecordBatch):
        return pa.Table.from_batches([batch])
    if isinstance(batch, pa.Table):
        return batch
    raise TypeError(f"Expected a pyarrow.RecordBatch or pyarrow.Table, got {type(batch).__name__}.")


def _need(table: pa.Table, columns: tuple[str | None, ...]) -> None:
    missing = [c for c in columns if c is not None and c not in table.column_names]
    if missing:
        raise ValueError(f"Column(s) {missing} are not in the batch; its columns are {table.column_names}. Pass the "
                         "right name with image_column=..., video_column=..., width_column=..., height_column=...")


def bucket_columns(batch: pa.RecordBatch | pa.Table, buckets: BucketSet, *, image_column: str | None = "image",
                   width_column: str | None = None, height_column: str | None = None,
                   max_upscale: float | None = None, min_size: int | None = None, verify: bool = False,
                   reference_columns: tuple[str, ...] | list[str] = (), reference_policy: str = "strict",
                   reference_buckets: BucketSet | None = None, video_column: str | None = None,
                   target_fps: float | None = None, frame_sampling: str | None = None) -> pa.Table:
    """The bucket columns of one Arrow batch: the pure function every engine maps.

    Args:
        batch: rows to annotate (a ``RecordBatch`` or ``Table``).
        buckets: the BucketSet to assign to.
        image_column: an image column (``struct<bytes, path>`` as ``datasets`` stores ``Image``, binary bytes, or
            string paths); read only when no width/height columns are given. Only image headers are read.
        width_column, height_column: metadata columns with the displayed size; no image is opened.
        max_upscale, min_size, verify: as in :func:`hf_arb.add_bucket_columns` (``verify`` decodes every image).
        reference_columns, reference_policy, reference_buckets: reference image columns (headers read like the
            target's) and how they are bucketed; see :func:`hf_arb.annotate.references.annotate_references`.
        video_column: a clip column (``datasets.Video`` storage ``struct<bytes, path>``, binary bytes, or string
            paths; an image in it is a 1-frame clip), read instead of ``image_column``: container headers only
            (:func:`hf_arb.video.clip_columns`). Needs a clip set (``buckets.has_frames``).
        target_fps: the model's frame rate for a clip set: the frame plan's stride (:mod:`hf_arb.annotate.clips`).
        frame_sampling: the temporal mode clips train with (``"uniform"`` matches a clip's own frame count; the
            others the frames it holds at ``target_fps``). ``"slide"``'s one row per window is :func:`annotate_batch`'s
            (this function keeps one row per input row).

    Returns:
        A ``pyarrow.Table`` with the :data:`~hf_arb.buckets.schema.BUCKET_COLUMNS` (schema
        :func:`~hf_arb.buckets.schema.arrow_schema`), one row per input row, in order, then the reference columns
        (:mod:`hf_arb.buckets.references`) when ``reference_columns`` is given. Skipped rows have ``bucket = -1`` and a
        ``skip_reason``. A clip set (``buckets.has_frames``) adds the
        :data:`~hf_arb.buckets.schema.CLIP_BUCKET_COLUMNS` after the bucket columns, for clips and images alike.
    """
    check_clip_set(buckets, video_column)
    if video_column is not None:
        from hf_arb.video.arrow_batch import clip_columns

        table = _table(batch)
        _need(table, (video_column,))
        meta = clip_columns(pa.table({video_column: table.column(video_column)}), video_column)
        target = clip_bucket_columns(meta, buckets, target_fps=target_fps, max_upscale=max_upscale, min_size=min_size,
                                     frame_sampling=frame_sampling)
    else:
        target = _target_columns(batch, buckets, image_column=image_column, width_column=width_column,
                                 height_column=height_column, max_upscale=max_upscale, min_size=min_size,
                                 verify=verify)
        if buckets.has_frames:
            target = image_clip_columns(target, buckets)
    if not reference_columns:
        return target
    table = _table(batch)
    _need(table, tuple(reference_columns))
    sizes = {name: sizes_of(arrow_values(table.column(name)), verify) for name in reference_columns}
    return annotate_references(target, sizes, buckets, policy=reference_policy, reference_buckets=reference_buckets,
                               max_upscale=max_upscale, min_size=min_size)


def _target_columns(batch: pa.RecordBatch | pa.Table, buckets: BucketSet, *, image_column: str | None,
                    width_column: str | None, height_column: str | None, max_upscale: float | None,
                    min_size: int | None, verify: bool) -> pa.Table:
    if (width_column is None) != (height_column is None):
        raise ValueError(f"Pass both `width_column` and `height_column` or neither, got width_column={width_column!r}, "
                         f"height_column={height_column!r}.")
    table = _table(batch)
    if width_column is not None:
        _need(table, (width_column, height_column))
        return annotate_sizes(size_column(table.column(width_column), width_column),
                              size_column(table.column(height_column), height_column), buckets,
                              max_upscale=max_upscale, min_size=min_size)
    if image_column is None:
        raise ValueError(
            "Nothing to read sizes from: `image_column` is None and no `width_column`/`height_column` given."
        )
    _need(table, (image_column,))
    w, h, reasons = sizes_of(arrow_values(table.column(image_column)), verify)
    return annotate_sizes(w, h, buckets, reasons=reasons, max_upscale=max_upscale, min_size=min_size)


@functools.lru_cache(maxsize=16)
def bucket_features_json(config: str) -> str:
    """JSON of the bucket columns' ``datasets`` features (imports ``datasets``: done once, on the driver)."""
    return json.dumps(bucket_features(_buckets(config)).to_dict())


@functools.lru_cache(maxsize=256)
def arrow_metadata(input_metadata: bytes | None, features: str | None, bucket_json: str) -> dict[bytes, bytes]:
    """``b"huggingface"`` schema metadata of an annotated batch, built from JSON alone (workers never import datasets).

    Features of the input columns come from the batch's own ``b"huggingface"`` metadata, then from ``features``
    (given by the caller); columns with neither are left to ``datasets`` to infer from their Arrow types on load
    (``Features.from_arrow_schema`` also ignores a stored feature whose Arrow type differs from the column's).
    """
    out: dict[str, Any] = {}
    if input_metadata:
        try:
            out.update(json.loads(input_metadata)["info"]["features"] or {})
        except (ValueError, KeyError, TypeError):
            pass  # not datasets' metadata: infer on load
    if features:
        out.update(json.loads(features))
    added = json.loads(bucket_json)
    for c in (*ANNOTATION_COLUMNS, *added):  # replaced columns move to the end, as in the batch
        out.pop(c, None)
    out.update(added)
    return {b"huggingface": json.dumps({"info": {"features": out}}).encode()}


def added_features_json(buckets: BucketSet, reference_columns: tuple[str, ...] = (), reference_policy: str = "strict",
                        reference_buckets: BucketSet | None = None) -> str:
    """JSON of the ``datasets`` features of every column annotation adds: the bucket columns, then each reference
    column's five (whose ``<name>_bucket`` stores the policy and its BucketSet). Made on the driver."""
    columns = json.loads(bucket_features_json(buckets.to_json()))
    if reference_columns:
        columns.update(reference_features(reference_columns, reference_policy, buckets, reference_buckets).to_dict())
    return json.dumps(columns)


def _input_metadata(schema: pa.Schema) -> bytes | None:
    return (schema.metadata or {}).get(b"huggingface")


def _features_json(features: Any) -> str | None:
    return None if features is None else json.dumps(features.to_dict(), sort_keys=True)


def output_schema(schema: pa.Schema, buckets: BucketSet, features: Any = None) -> pa.Schema:
    """The schema :func:`annotate_batch` returns for an input ``schema``: old bucket columns dropped, the new ones
    appended, and ``datasets`` features (with the BucketSet) in the ``b"huggingface"`` metadata.

    Args:
        schema: the input batch's schema.
        buckets: the BucketSet.
        features: optional ``datasets.Features`` of the input columns (engines drop Arrow metadata on read, so
            pass e.g. ``Features.from_arrow_schema(pyarrow.parquet.read_schema(source))`` to keep ``Image``).
    """
    base = pa.schema([f for f in schema if f.name not in ANNOTATION_COLUMNS], metadata=schema.metadata)
    fields = list(base) + list(clip_arrow_schema() if buckets.has_frames else arrow_schema())
    meta = arrow_metadata(_input_metadata(schema), _features_json(features), bucket_features_json(buckets.to_json()))
    return pa.schema(fields, metadata=meta)


def annotate_batch(batch: pa.RecordBatch | pa.Table, buckets: BucketSet, *, features: Any = None,
                   **kwargs: Any) -> pa.RecordBatch | pa.Table:
    """``batch`` with the bucket columns appended (existing ones replaced), same type as ``batch``.

    Args:
        batch: a ``RecordBatch`` or ``Table``.
        buckets: the BucketSet.
        features: optional ``datasets.Features`` of the input columns, for the metadata (see :func:`output_schema`).
        **kwargs: ``image_column``, ``width_column``, ``height_column``, ``max_upscale``, ``min_size``,
            ``video_column``, ``target_fps``, ``frame_sampling`` of :func:`bucket_columns`, and ``slide_stride``.

    Returns:
        The input columns (minus any old bucket columns) followed by the :data:`~hf_arb.buckets.schema.BUCKET_COLUMNS`;
        the schema metadata holds the ``datasets`` features, so Parquet written from it restores the BucketSet. With
        ``frame_sampling="slide"`` and a clip set, each kept clip is one row per window
        (:func:`~hf_arb.annotate.clips.slide_windows`): the only annotation that changes the row count.
    """
    return _annotate(batch, buckets, _features_json(features), bucket_features_json(buckets.to_json()), kwargs)


def _annotate(batch: pa.RecordBatch | pa.Table, buckets: BucketSet, features: str | None, bucket_json: str,
              kwargs: dict[str, Any]) -> pa.RecordBatch | pa.Table:
    table = _table(batch)
    kwargs = dict(kwargs)
    slide_stride = kwargs.pop("slide_stride", None)
    new = bucket_columns(table, buckets, **kwargs)
    keep = [c for c in table.column_names if c not in new.column_names and c not in ANNOTATION_COLUMNS]
    base = pa.schema([table.schema.field(c) for c in keep], metadata=table.schema.metadata)
    schema = pa.schema(list(base) + list(new.schema),
                       metadata=arrow_metadata(_input_metadata(table.schema), features, bucket_json))
    arrays = [table.column(c) for c in keep] + list(new.columns)
    if kwargs.get("frame_sampling") == "slide" and buckets.has_frames:  # one row per window
        out = slide_windows(pa.Table.from_arrays(arrays, schema=schema), buckets,
                            target_fps=kwargs.get("target_fps"), slide_stride=slide_stride)
        return pa.RecordBatch.from_arrays([c.combine_chunks() for c in out.columns], schema=schema) \
            if isinstance(batch, pa.RecordBatch) else out
    if isinstance(batch, pa.RecordBatch):
        return pa.RecordBatch.from_arrays([a.combine_chunks() for a in arrays], schema=schema)
    return pa.Table.from_arrays(arrays, schema=schema)


@dataclass(frozen=True)
class BatchAnnotator:
    """Picklable ``batch -> annotated batch`` callable for ``map_batches`` / ``mapInArrow`` (holds JSON, not objects).

    Attributes:
        config: ``BucketSet.to_json()``.
        image_column, width_column, height_column, max_upscale, min_size: as in :func:`bucket_columns`.
        features: JSON of the input columns' ``datasets.Features`` (``Features.to_dict()``), or None.
        bucket_features: JSON of the bucket columns' features, made on the driver so workers need no ``datasets``.
    """

    config: str
    image_column: str | None = "image"
    width_column: str | None = None
    height_column: str | None = None
    max_upscale: float | None = None
    min_size: int | None = None
    features: str | None = None
    bucket_features: str = ""
    reference_columns: tuple[str, ...] = ()
    reference_policy: str = "strict"
    reference_config: str | None = None
    video_column: str | None = None
    target_fps: float | None = None
    frame_sampling: str | None = None
    slide_stride: int | None = None

    @classmethod
    def create(cls, buckets: BucketSet, *, features: Any = None, **kwargs: Any) -> BatchAnnotator:
        """Validate the options once on the driver (clear errors before any task starts).

        Args:
            buckets: the BucketSet.
            features: optional ``datasets.Features`` of the input columns (see :func:`output_schema`).
            **kwargs: the other fields.
        """
        if not isinstance(buckets, BucketSet):
            raise TypeError(f"`buckets` must be a hf_arb.BucketSet, got {type(buckets).__name__}. "
                            "Build one with BucketSet.sdxl(), BucketSet.novelai() or BucketSet.from_budget(...).")
        refs = check_reference_columns(kwargs.pop("reference_columns", None), kwargs.get("image_column", "image"))
        policy = check_policy(kwargs.pop("reference_policy", "strict"))
        ref_buckets = kwargs.pop("reference_buckets", None)
        if ref_buckets is not None and not isinstance(ref_buckets, BucketSet):
            raise TypeError(f"`reference_buckets` must be a hf_arb.BucketSet, got {type(ref_buckets).__name__}.")
        if ref_buckets is not None and policy == "strict":
            raise ValueError("`reference_buckets` applies to reference_policy='own' only: under 'strict' every "
                             "reference takes the target's bucket. Pass reference_policy='own' or drop it.")
        columns = added_features_json(buckets, refs, policy, ref_buckets)
        out = cls(buckets.to_json(), **kwargs, features=_features_json(features), bucket_features=columns,
                  reference_columns=refs, reference_policy=policy,
                  reference_config=None if ref_buckets is None else ref_buckets.to_json())
        if (out.width_column is None) != (out.height_column is None):
            raise ValueError(f"Pass both `width_column` and `height_column` or neither, got "
                             f"width_column={out.width_column!r}, height_column={out.height_column!r}.")
        check_clip_set(buckets, out.video_column)
        check_frame_sampling(out.frame_sampling, out.slide_stride)
        if out.target_fps is not None and not out.target_fps > 0:
            raise ValueError(f"`target_fps` must be > 0 frames per second (e.g. 16 for Wan), got {out.target_fps!r}.")
        if out.width_column is None and out.image_column is None and out.video_column is None:
            raise ValueError("Nothing to read sizes from: `image_column` is None and no `width_column`/`height_column` "
                             "given.")
        if out.max_upscale is not None and not out.max_upscale > 0:
            raise ValueError(f"`max_upscale` must be > 0 (e.g. 2.0 allows doubling), got {out.max_upscale!r}.")
        if out.min_size is not None and not out.min_size >= 0:
            raise ValueError(f"`min_size` must be >= 0 pixels, got {out.min_size!r}.")
        return out

    @property
    def buckets(self) -> BucketSet:
        return _buckets(self.config)

    @property
    def input_columns(self) -> list[str]:
        """The columns this annotator reads."""
        if self.video_column is not None:
            return [self.video_column, *self.reference_columns]
        if self.width_column is not None:
            return [self.width_column, str(self.height_column), *self.reference_columns]
        return [str(self.image_column), *self.reference_columns]

    def __call__(self, batch: pa.RecordBatch | pa.Table) -> pa.RecordBatch | pa.Table:
        return _annotate(batch, self.buckets, self.features,
                         self.bucket_features or bucket_features_json(self.config), dict(
            image_column=self.image_column, width_column=self.width_column, height_column=self.height_column,
            max_upscale=self.max_upscale, min_size=self.min_size, reference_columns=self.reference_columns,
            reference_policy=self.reference_policy,
            reference_buckets=None if self.reference_config is None else _buckets(self.reference_config),
            video_column=self.video_column, target_fps=self.target_fps, frame_sampling=self.frame_sampling,
            slide_stride=self.slide_stride))

    def iter_batches(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Generator form (Spark's ``mapInArrow``)."""
        for batch in batches:
            yield self(batch)


# ----------------------------------------------------------------------------------- engine summary
def summary_partials(batch: pa.RecordBatch | pa.Table) -> pa.Table:
    """Partial summary of one annotated batch, grouped inside the batch (map-side combine for the engines).

    Returns:
        One row per group: keys ``bucket`` (int32), ``skip_reason`` (string, ``""`` when kept: engines group null keys
        unevenly), ``error_bin`` (int64: ``floor(aspect_error / ERROR_BIN)`` for kept rows, ``-1`` otherwise); values
        ``count`` (int64), ``error_sum`` and ``error_max`` (float64 over kept rows' ``aspect_error``, null otherwise),
        ``windows`` and ``clips`` (int64: rows with a ``frame_start`` and those at 0, the ``slide`` windows and the
        clips they came from, as :func:`~hf_arb.annotate.clips.slide_counts_of` counts them; 0 without the column).
        Summing ``count``/``error_sum``/``windows``/``clips`` and maxing ``error_max`` over equal keys merges
        partials exactly. Where the batch has a clip set's ``original_frames`` and ``original_fps``, one more row
        per distinct value of each: ``bucket`` :data:`FRAMES_ROW` / :data:`FPS_ROW`, ``error_bin`` the value's key
        (:func:`~hf_arb.annotate.summary.value_keys`), ``count`` its rows: the histograms' partial counts, which add up
        over batches because the bars are drawn only from the summed counts.
    """
    t = _table(batch)
    _need(t, ("bucket", "aspect_error", "skip_reason"))
    start = t.column("frame_start") if "frame_start" in t.column_names else pa.nulls(t.num_rows, pa.int32())
    ids = pc.fill_null(t.column("bucket"), -1).to_numpy().astype(np.int32)  # (n,)
    err = pc.cast(t.column("aspect_error"), pa.float64()).to_numpy(zero_copy_only=False)  # (n,) NaN for null
    kept = (ids >= 0) & np.isfinite(err)
    bins = np.where(kept, np.floor(np.where(kept, err, 0.0) / ERROR_BIN), -1).astype(np.int64)
    keys = pa.table({
        "bucket": pa.array(ids, pa.int32()),
        "skip_reason": pc.fill_null(pc.cast(t.column("skip_reason"), pa.string()), ""),
        "error_bin": pa.array(bins, pa.int64()),
        "aspect_error": pa.array(err, pa.float64(), mask=~kept),
        "window": pc.cast(pc.is_valid(start), pa.int64()),  # a slide window (any frame_start)
        "clip": pc.cast(pc.fill_null(pc.equal(start, 0), False), pa.int64()),  # a clip's first window
    })
    g = keys.group_by(["bucket", "skip_reason", "error_bin"]).aggregate(
        [([], "count_all"), ("aspect_error", "sum"), ("aspect_error", "max"), ("window", "sum"), ("clip", "sum")])
    out = pa.table({"bucket": g.column("bucket"), "skip_reason": g.column("skip_reason"),
                    "error_bin": g.column("error_bin"), "count": g.column("count_all"),
                    "error_sum": g.column("aspect_error_sum"), "error_max": g.column("aspect_error_max"),
                    "windows": g.column("window_sum"), "clips": g.column("clip_sum")})
    if "original_frames" not in t.column_names or "original_fps" not in t.column_names:
        return out
    from .summary import value_keys

    hist = [_histogram_rows(row, value_keys(t.column(c)), out.schema)
            for row, c in ((FRAMES_ROW, "original_frames"), (FPS_ROW, "original_fps"))]
    return pa.concat_tables([out, *hist])


def _histogram_rows(row: int, keys: np.ndarray, schema: pa.Schema) -> pa.Table:
    """One :func:`summary_partials` row per distinct key: ``bucket`` ``row``, ``error_bin`` the key, ``count``."""
    uk, n = np.unique(keys, return_counts=True)  # (u,)
    zeros = pa.array(np.zeros(uk.size, np.int64))
    return pa.table({"bucket": pa.array(np.full(uk.size, row, np.int32)), "skip_reason": pa.array([""] * uk.size),
                     "error_bin": pa.array(uk, pa.int64()), "count": pa.array(n.astype(np.int64)),
                     "error_sum": pa.nulls(uk.size, pa.float64()), "error_max": pa.nulls(uk.size, pa.float64()),
                     "windows": zeros, "clips": zeros}, schema=schema)


def summary_from_groups(bucket: Any, skip_reason: Any, error_bin: Any, count: Any, error_sum: Any, error_max: Any,
                        buckets: BucketSet, windows: Any = None, clips: Any = None) -> Any:
    """:class:`~hf_arb.annotate.AnnotationSummary` from the engine's grouped rows (few; on the driver).

    Args:
        bucket, skip_reason, error_bin: the group keys of :func:`summary_partials`, one entry per group.
        count: rows per group; error_sum, error_max: sum and max of ``aspect_error`` per group (null/NaN if none).
        buckets: the BucketSet the ids refer to.
        windows, clips: ``slide`` windows and clips per group (:func:`summary_partials`' sums; None: not counted):
            the summary's ``slide``, ``(clips, windows)``, where any row has a window.
        A clip set's groups with ``bucket`` :data:`FRAMES_ROW` / :data:`FPS_ROW` give the frames and fps histograms
        (:func:`~hf_arb.annotate.summary.histogram_from_counts`), exactly the datasets path's.

    Returns:
        The summary. Counts, skip reasons, mean and max are exact; the median is read from the ``ERROR_BIN``-wide
        histogram (the midpoint of the bin that holds it, clipped to the max), so it is within ``ERROR_BIN`` of
        ``numpy.median``.
    """
    from hf_arb.buckets.sets import AssignmentSummary

    from .summary import EXAMPLE_REASONS, AnnotationSummary

    ids = np.asarray(bucket, dtype=np.int64)  # (g,)
    reasons = list(skip_reason)
    bins = np.asarray(error_bin, dtype=np.int64)
    n = np.asarray(count, dtype=np.int64)
    s = _floats(error_sum)  # (g,)
    m = _floats(error_max)
    hists = _histograms(ids, bins, n) if buckets.has_frames else {}
    rest = ids >= -1  # the histogram rows set aside
    if not rest.all():
        ids, bins, n, s, m = ids[rest], bins[rest], n[rest], s[rest], m[rest]
        reasons = [r for r, keep in zip(reasons, rest.tolist()) if keep]
        windows = None if windows is None else np.asarray(windows, dtype=np.int64)[rest]
        clips = None if clips is None else np.asarray(clips, dtype=np.int64)[rest]
    if ids.size and ids.max(initial=-1) >= len(buckets):
        raise ValueError(f"Bucket id {int(ids.max())} is out of range for a BucketSet of {len(buckets)} buckets; "
                         "the data was annotated with a different BucketSet.")
    skipped = ids < 0
    by_reason: dict[str, int] = {}
    examples: list[str] = []
    for reason, c in zip(np.asarray(reasons, dtype=object)[skipped].tolist(), n[skipped].tolist()):
        cat = reason.split(":", 1)[0].strip() if reason else "unknown"
        by_reason[cat] = by_reason.get(cat, 0) + int(c)
        if cat in EXAMPLE_REASONS and len(examples) < 5 and reason not in examples:
            examples.append(reason)
    kept = ~skipped
    counts = np.bincount(ids[kept], weights=n[kept], minlength=len(buckets)).astype(np.int64)
    with_err = kept & np.isfinite(s)
    total_kept = int(n[with_err].sum())
    if total_kept:
        mean = float(s[with_err].sum() / total_kept)
        emax = float(np.nanmax(m[with_err]))
        order = np.argsort(bins[with_err], kind="stable")
        b, c = bins[with_err][order], n[with_err][order]
        ub, first = np.unique(b, return_index=True)
        uc = np.add.reduceat(c, first)
        cum = np.cumsum(uc)
        lo = ub[np.searchsorted(cum, (total_kept + 1) // 2)]  # bin of the lower middle element
        hi = ub[np.searchsorted(cum, total_kept // 2 + 1)]  # bin of the upper middle element
        median = min(float((lo + hi + 1) / 2 * ERROR_BIN), emax)
    else:
        mean = median = emax = math.nan
    rows = int(n.sum())
    assignment = AssignmentSummary(rows, int(n[skipped].sum()), counts, mean, median, emax,
                                   resolutions=np.asarray(buckets.resolutions))
    return AnnotationSummary(rows, by_reason, assignment, tuple(examples), slide=_slide(windows, clips), **hists)


def _histograms(ids: np.ndarray, keys: np.ndarray, n: np.ndarray) -> dict[str, Any]:
    """A clip set's ``frames_histogram`` and ``fps_histogram`` from the grouped :data:`FRAMES_ROW` / :data:`FPS_ROW`
    rows (empty where there are none, as the datasets path's for a clip set without values)."""
    from .summary import histogram_from_counts

    return {name: histogram_from_counts(keys[ids == row], n[ids == row], integer=row == FRAMES_ROW)
            for name, row in (("frames_histogram", FRAMES_ROW), ("fps_histogram", FPS_ROW))}


def _slide(windows: Any, clips: Any) -> tuple[int, int] | None:
    """``(clips, windows)`` summed over the groups; None where no row has a window (not a ``slide`` annotation)."""
    total = 0 if windows is None else int(np.asarray(windows, dtype=np.int64).sum())
    return (int(np.asarray(clips, dtype=np.int64).sum()), total) if total else None


def _floats(values: Any) -> np.ndarray:
    """float64 array of shape (g,), NaN for None / NaN / pandas NA."""
    return pa.array(list(values), type=pa.float64(), from_pandas=True).fill_null(np.nan).to_numpy()
