"""Bucket annotation on Ray Data: ``map_batches`` of the pure Arrow function, summary by Ray's ``groupby``.

Example:
    ```py
    >>> import ray
    >>> from hf_arb import BucketSet
    >>> from hf_arb.annotate.engines.ray import add_bucket_columns, summarize
    >>> ds = ray.data.read_parquet("s3://bucket/laion/")                        # WIDTH/HEIGHT columns
    >>> out = add_bucket_columns(ds, BucketSet.sdxl(), width_column="WIDTH", height_column="HEIGHT")
    >>> out.write_parquet("s3://bucket/laion-buckets/")                    # BucketSet in the schema metadata
    >>> print(summarize(out, BucketSet.sdxl()))
    ```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hf_arb.annotate.arrow_batch import BatchAnnotator, summary_from_groups, summary_partials
from hf_arb.annotate.map import AnnotationSummary
from hf_arb.buckets.sets import BucketSet


def _require_ray() -> Any:
    try:
        import ray.data
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError('Ray Data is not installed; install it with `pip install "hf_arb[ray]"`.') from e
    return ray.data


def add_bucket_columns(ds: Any, buckets: BucketSet, image_column: str | None = "image",
                       width_column: str | None = None, height_column: str | None = None, *,
                       max_upscale: float | None = None, min_size: int | None = None,
                       features: Any = None, batch_size: int | None = None,
                       reference_columns: Sequence[str] | None = None, reference_policy: str = "strict",
                       reference_buckets: BucketSet | None = None, video_column: str | None = None,
                       target_fps: float | None = None, frame_sampling: str | None = None,
                       slide_stride: int | None = None, **map_batches_kwargs: Any) -> Any:
    """Add the bucket columns to a ``ray.data.Dataset`` (lazy, like every Ray transform).

    Args:
        ds: a ``ray.data.Dataset`` (e.g. from ``ray.data.read_parquet``).
        buckets: the BucketSet.
        image_column: image column (``struct<bytes, path>``, binary bytes or paths) read when no width/height
            columns are given; only headers are read.
        width_column, height_column: metadata size columns (no image is opened).
        max_upscale, min_size: as in :func:`hf_arb.add_bucket_columns`.
        features: ``datasets.Features`` of the input columns, written into the output schema metadata (Ray drops a
            Parquet file's metadata on read; pass ``Features.from_arrow_schema(pyarrow.parquet.read_schema(f))``
            to keep an ``Image`` column an ``Image``). Default: inferred from the Arrow types.
        reference_columns, reference_policy, reference_buckets: reference image columns of an edit dataset and
            how they are bucketed, as in :func:`hf_arb.add_bucket_columns`: each adds ``<name>_width``, ...,
            ``<name>_bucket_height`` (:mod:`hf_arb.buckets.references`), and a broken reference skips its row with
            ``skip_reason`` ``"reference <name>: ..."``, exactly as the ``datasets`` path does.
        batch_size: rows per batch for ``map_batches`` (``None``: whole blocks, fastest for width/height columns).
        video_column, target_fps: a clip column (``datasets.Video`` storage, paths or bytes; headers only) and the
            model's frame rate, with a clip set, as in :func:`hf_arb.add_bucket_columns`.
        frame_sampling, slide_stride: as in :func:`hf_arb.add_bucket_columns`; ``"slide"`` turns each kept clip into
            one row per window (the only annotation that changes the row count).
        **map_batches_kwargs: passed to ``Dataset.map_batches`` (e.g. ``num_cpus``, ``concurrency``).

    Returns:
        A ``ray.data.Dataset`` with the :data:`~hf_arb.buckets.schema.BUCKET_COLUMNS` appended (old ones replaced); its
        blocks carry the ``datasets`` features in the schema metadata, so ``ds.write_parquet(path)`` writes files
        that ``datasets.load_dataset("parquet", ...)`` and ``BucketSet.from_dataset`` read back exactly.
    """
    _require_ray()
    fn = BatchAnnotator.create(buckets, image_column=image_column, width_column=width_column,
                               height_column=height_column, max_upscale=max_upscale, min_size=min_size,
                               features=features, reference_columns=reference_columns,
                               reference_policy=reference_policy, reference_buckets=reference_buckets,
                               video_column=video_column, target_fps=target_fps,
                               frame_sampling=frame_sampling, slide_stride=slide_stride)
    schema = ds.schema(fetch_if_missing=False)  # known without running anything (e.g. read_parquet); else checked
    names = list(schema.names) if schema is not None else None  # in the tasks with the same message
    missing = [c for c in fn.input_columns if names is not None and c not in names]
    if missing:
        raise ValueError(f"Column(s) {missing} are not in the Ray dataset; its columns are {names}. Pass the "
                         "right name with image_column=..., video_column=..., width_column=..., height_column=..., "
                         "reference_columns=...")
    return ds.map_batches(fn, batch_format="pyarrow", batch_size=batch_size, zero_copy_batch=True,
                          **map_batches_kwargs)


def summarize(ds: Any, buckets: BucketSet, *, num_partitions: int = 8) -> AnnotationSummary:
    """Counts per bucket, skips by reason and aspect-error statistics, aggregated with Ray's ``groupby``.

    Each block is grouped where it lies (:func:`~hf_arb.annotate.arrow_batch.summary_partials`); Ray's ``groupby``
    merges the partials over ``num_partitions`` reducers, and only the merged groups (one per bucket and error bin, one
    per distinct skip reason) reach the driver. Everything is exact but the median, which is within
    ``hf_arb.annotate.arrow_batch.ERROR_BIN`` (see :func:`~hf_arb.annotate.arrow_batch.summary_from_groups`).
    A clip set's ``frame_start`` is summed in the same pass: a ``slide`` annotation's clips and windows (``slide``);
    and its rows per ``original_frames`` / ``original_fps`` value, the frames and fps histograms, equal to the
    datasets path's (bars drawn from the summed counts, :func:`~hf_arb.annotate.summary.histogram_from_counts`).
    """
    _require_ray()
    from ray.data.aggregate import Max, Sum

    clip = ["frame_start", "original_frames", "original_fps"] if buckets.has_frames else []
    columns = ["bucket", "aspect_error", "skip_reason"] + clip
    partials = ds.select_columns(columns).map_batches(
        summary_partials, batch_format="pyarrow", batch_size=None, zero_copy_batch=True)
    grouped = partials.groupby(["bucket", "skip_reason", "error_bin"], num_partitions=num_partitions).aggregate(
        Sum("count", alias_name="count"), Sum("error_sum", alias_name="error_sum"),
        Max("error_max", alias_name="error_max"), Sum("windows", alias_name="windows"),
        Sum("clips", alias_name="clips"))
    rows = grouped.take_all()
    return summary_from_groups(*([r[c] for r in rows] for c in ("bucket", "skip_reason", "error_bin", "count",
                                                                 "error_sum", "error_max")), buckets,
                               windows=[r["windows"] for r in rows], clips=[r["clips"] for r in rows])
