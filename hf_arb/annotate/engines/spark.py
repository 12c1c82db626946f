"""Bucket annotation on Spark: ``mapInArrow`` of the pure Arrow function, summary by Spark's ``groupBy``.

Spark's own Parquet writer drops Arrow schema metadata, so :func:`write_parquet` writes through a small Python
data source (Spark's public ``DataSourceArrowWriter``, with task commit/abort) that stamps every file with the
``datasets`` features: ``datasets.load_dataset("parquet", ...)`` and ``BucketSet.from_dataset`` then read the exact
BucketSet back.

Example:
    ```py
    >>> from pyspark.sql import SparkSession
    >>> from hf_arb import BucketSet
    >>> from hf_arb.annotate.engines.spark import add_bucket_columns, summarize, write_parquet
    >>> spark = SparkSession.builder.getOrCreate()
    >>> df = spark.read.parquet("s3a://bucket/laion/")
    >>> out = add_bucket_columns(df, BucketSet.sdxl(), width_column="WIDTH", height_column="HEIGHT")
    >>> write_parquet(out, "s3://bucket/laion-buckets/", BucketSet.sdxl())
    >>> print(summarize(out, BucketSet.sdxl()))
    ```
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from hf_arb.annotate.arrow_batch import (
    ERROR_BIN,
    FPS_ROW,
    FRAMES_ROW,
    BatchAnnotator,
    added_features_json,
    arrow_metadata,
    summary_from_groups,
)
from hf_arb.annotate.map import AnnotationSummary
from hf_arb.annotate.summary import HIST_SCALE
from hf_arb.buckets.references import check_policy, check_reference_columns, reference_arrow_fields
from hf_arb.buckets.schema import BUCKET_COLUMNS, CLIP_BUCKET_COLUMNS
from hf_arb.buckets.sets import BucketSet

try:
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage
except ImportError:  # pragma: no cover - exercised only without the extra
    DataSource = DataSourceArrowWriter = WriterCommitMessage = object  # type: ignore[misc,assignment]

#: Name under which :func:`write_parquet` registers its data source.
FORMAT = "hf_arb_parquet"


def _require_spark() -> Any:
    try:
        import pyspark.sql
    except ImportError as e:  # pragma: no cover
        raise ImportError('PySpark is not installed; install it with `pip install "hf_arb[spark]"` (needs a Java '
                          "runtime: `apt-get install default-jre-headless`).") from e
    return pyspark.sql


def _bucket_struct_fields(clips: bool = False) -> list[Any]:
    from pyspark.sql.types import BooleanType, DoubleType, FloatType, IntegerType, StringType, StructField

    types = {"bucket": IntegerType(), "bucket_width": IntegerType(), "bucket_height": IntegerType(),
             "original_width": IntegerType(), "original_height": IntegerType(), "aspect_error": FloatType(),
             "skip_reason": StringType(), "bucket_frames": IntegerType(), "original_frames": IntegerType(),
             "original_fps": FloatType(), "frames_exact": BooleanType(), "frame_stride": DoubleType(),
             "frame_start": IntegerType()}
    return [StructField(c, types[c], True) for c in (*BUCKET_COLUMNS, *(CLIP_BUCKET_COLUMNS if clips else ()))]


def _reference_struct_fields(names: Sequence[str]) -> list[Any]:
    from pyspark.sql.types import IntegerType, StructField

    return [StructField(f.name, IntegerType(), True) for f in reference_arrow_fields(names)]


def add_bucket_columns(df: Any, buckets: BucketSet, image_column: str | None = "image",
                       width_column: str | None = None, height_column: str | None = None, *,
                       max_upscale: float | None = None, min_size: int | None = None,
                       reference_columns: Sequence[str] | None = None, reference_policy: str = "strict",
                       reference_buckets: BucketSet | None = None, video_column: str | None = None,
                       target_fps: float | None = None, frame_sampling: str | None = None,
                       slide_stride: int | None = None) -> Any:
    """Add the bucket columns to a Spark ``DataFrame`` (lazy, like every Spark transformation).

    Args:
        df: a ``pyspark.sql.DataFrame``.
        buckets: the BucketSet.
        image_column: image column (``struct<bytes, path>``, binary bytes or paths), read when no width/height
            columns are given; only headers are read.
        width_column, height_column: metadata size columns (no image is opened).
        max_upscale, min_size: as in :func:`hf_arb.add_bucket_columns`.
        reference_columns, reference_policy, reference_buckets: reference image columns of an edit dataset and
            how they are bucketed, as in :func:`hf_arb.add_bucket_columns` (a broken reference skips its row with
            ``skip_reason`` ``"reference <name>: ..."``). Pass the same three to :func:`write_parquet`.
        video_column, target_fps: a clip column (``datasets.Video`` storage, paths or bytes; headers only) and the
            model's frame rate, with a clip set, as in :func:`hf_arb.add_bucket_columns`.
        frame_sampling, slide_stride: as in :func:`hf_arb.add_bucket_columns`; ``"slide"`` turns each kept clip into
            one row per window (the only annotation that changes the row count).

    Returns:
        A ``DataFrame`` with the :data:`~hf_arb.buckets.schema.BUCKET_COLUMNS` appended (old ones replaced), then each
        reference's five int columns (:mod:`hf_arb.buckets.references`). Write it with :func:`write_parquet` to keep
        the BucketSet (and each reference's policy and BucketSet) in the files.
    """
    _require_spark()
    from pyspark.sql.types import StructType

    fn = BatchAnnotator.create(buckets, image_column=image_column, width_column=width_column,
                               height_column=height_column, max_upscale=max_upscale, min_size=min_size,
                               reference_columns=reference_columns, reference_policy=reference_policy,
                               reference_buckets=reference_buckets, video_column=video_column,
                               target_fps=target_fps, frame_sampling=frame_sampling, slide_stride=slide_stride)
    missing = [c for c in fn.input_columns if c not in df.columns]
    if missing:
        raise ValueError(f"Column(s) {missing} are not in the DataFrame; its columns are {df.columns}. Pass the right "
                         "name with image_column=..., video_column=..., width_column=..., height_column=..., "
                         "reference_columns=...")
    added = _bucket_struct_fields(buckets.has_frames) + _reference_struct_fields(fn.reference_columns)
    names = {f.name for f in added}
    schema = StructType([f for f in df.schema.fields if f.name not in names] + added)
    return df.mapInArrow(fn.iter_batches, schema)


def summarize(df: Any, buckets: BucketSet) -> AnnotationSummary:
    """Counts per bucket, skips by reason and aspect-error statistics, aggregated with Spark's ``groupBy``.

    Runs as native Spark expressions (no Python workers) over one scan of ``df``; only the grouped rows reach the
    driver. Everything is exact but the median, which is within ``hf_arb.annotate.arrow_batch.ERROR_BIN``. A clip
    set's ``frame_start`` is summed in the same pass: a ``slide`` annotation's clips and windows (``slide``); and its
    rows per ``original_frames`` / ``original_fps`` value (each row exploded into its bucket entry and two histogram
    entries, into the same ``groupBy``), the frames and fps histograms, equal to the datasets path's (bars drawn
    from the summed counts).
    """
    from pyspark.sql import functions as F

    err = F.col("aspect_error").cast("double")
    bucket = F.coalesce(F.col("bucket"), F.lit(-1))
    kept = (bucket >= 0) & err.isNotNull() & ~F.isnan(err)
    main = F.struct(bucket.cast("long").alias("bucket"),
                    F.coalesce(F.col("skip_reason"), F.lit("")).alias("skip_reason"),
                    F.when(kept, F.floor(err / F.lit(ERROR_BIN))).otherwise(F.lit(-1)).cast("long").alias("error_bin"),
                    F.when(kept, err).alias("aspect_error"),
                    *([F.col("frame_start").cast("long").alias("frame_start")] if buckets.has_frames else []))
    if buckets.has_frames:  # rows per frames / fps value, exploded from the same scan into the same groupBy
        entries = [main, *(_histogram_entry(F, row, name) for row, name in ((FRAMES_ROW, "original_frames"),
                                                                           (FPS_ROW, "original_fps")))]
        rows = df.select(F.explode(F.array(*entries)).alias("r")).where(F.col("r").isNotNull()).select("r.*")
    else:
        rows = df.select(main.alias("r")).select("r.*")
    grouped = rows.groupBy("bucket", "skip_reason", "error_bin").agg(
        F.count(F.lit(1)).alias("count"), F.sum("aspect_error").alias("error_sum"),
        F.max("aspect_error").alias("error_max"),
        # a slide window: any frame_start; a clip: its first window (hf_arb.annotate.clips.slide_counts_of)
        *([F.count("frame_start").alias("windows"),
           F.count(F.when(F.col("frame_start") == 0, 1)).alias("clips")] if buckets.has_frames else []))
    t = grouped.toArrow()
    slide = {k: t.column(k).to_numpy(zero_copy_only=False) for k in ("windows", "clips")} if buckets.has_frames else {}
    return summary_from_groups(t.column("bucket").to_numpy(), t.column("skip_reason").to_pylist(),
                               t.column("error_bin").to_numpy(), t.column("count").to_numpy(),
                               t.column("error_sum").to_pylist(), t.column("error_max").to_pylist(), buckets,
                               **slide)


def _histogram_entry(F: Any, row: int, name: str) -> Any:
    """A row's histogram entry of ``name`` (:func:`~hf_arb.annotate.arrow_batch.summary_partials`' ``bucket``
    ``row``, ``error_bin`` the value's key ``rint(v * HIST_SCALE)``, as :func:`~hf_arb.annotate.summary.value_keys`
    computes it in numpy), null for nulls, NaN and out-of-range keys: the same struct as the bucket entry."""
    key = F.rint(F.col(name).cast("double") * F.lit(float(HIST_SCALE)))
    return F.when(key.isNotNull() & ~F.isnan(key) & (F.abs(key) < F.lit(2.0 ** 62)), F.struct(
        F.lit(row).cast("long").alias("bucket"), F.lit("").alias("skip_reason"), key.cast("long").alias("error_bin"),
        F.lit(None).cast("double").alias("aspect_error"), F.lit(None).cast("long").alias("frame_start")))


# ----------------------------------------------------------------------------------- parquet with metadata
def write_parquet(df: Any, path: str, buckets: BucketSet, *, features: Any = None, mode: str = "overwrite",
                  compression: str = "snappy", reference_columns: Sequence[str] | None = None,
                  reference_policy: str = "strict", reference_buckets: BucketSet | None = None) -> None:
    """Write an annotated DataFrame to Parquet files whose schema metadata carries the ``datasets`` features.

    Args:
        df: the output of :func:`add_bucket_columns`.
        path: a folder (local, or any URI ``pyarrow.fs`` opens: ``s3://``, ``gs://``, ``hdfs://``).
        buckets: the BucketSet the ``bucket`` column refers to.
        features: ``datasets.Features`` of the input columns (e.g. ``Features.from_arrow_schema`` of the source
            Parquet schema, so an ``Image`` column stays an ``Image``); default: inferred from Spark's types.
        mode: ``"overwrite"`` (replace the folder's ``part-*.parquet``) or ``"append"``.
        compression: Parquet codec.
        reference_columns, reference_policy, reference_buckets: as given to :func:`add_bucket_columns`; each
            ``<name>_bucket`` feature then stores the policy and its BucketSet, so ``hf-arb stats`` and
            :func:`hf_arb.sampling.composite.composite_sampler` find the references in the files.

    Each task writes ``_temporary/<job>/part-<partition>-<attempt>.parquet``; the driver's commit renames them to
    ``part-<partition>-<job>.parquet`` (an aborted job leaves nothing). One file per partition.
    """
    spark = df.sparkSession
    spark.dataSource.register(_ParquetSource)
    if mode not in ("overwrite", "append"):
        raise ValueError(f"`mode` must be 'overwrite' or 'append', got {mode!r}.")
    refs = check_reference_columns(reference_columns, None)
    added = added_features_json(buckets, refs, check_policy(reference_policy), reference_buckets)
    fixed = None
    if features is not None:
        import datasets

        new = datasets.Features.from_dict(json.loads(added))
        full = datasets.Features({k: v for k, v in features.items() if k not in BUCKET_COLUMNS and k not in new})
        full.update(new)
        fixed = full.arrow_schema.serialize().to_pybytes().hex()
    # The metadata is made here, on the driver, so the writing tasks never import datasets.
    metadata = arrow_metadata(None, None, added)[b"huggingface"].decode()
    (df.write.format(FORMAT).mode(mode).option("path", path).option("metadata", metadata)
     .option("schema", fixed or "").option("compression", compression).save())


@dataclass(frozen=True)
class _Written(WriterCommitMessage):  # type: ignore[misc]
    temporary: str | None
    final: str | None
    rows: int


class _ParquetWriter(DataSourceArrowWriter):  # type: ignore[misc]
    def __init__(self, options: dict[str, str], overwrite: bool) -> None:
        self.path = options["path"].rstrip("/")
        self.metadata = options["metadata"]
        self.schema_hex = options.get("schema") or ""
        self.compression = options.get("compression", "snappy")
        self.overwrite = overwrite
        self.job = uuid.uuid4().hex[:12]  # made on the driver, pickled to the tasks

    def _fs(self) -> tuple[Any, str]:
        from pyarrow import fs

        return fs.FileSystem.from_uri(self.path) if "://" in self.path else (fs.LocalFileSystem(), self.path)

    def write(self, iterator: Any) -> _Written:
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        ctx = TaskContext.get()
        part, attempt = (ctx.partitionId(), ctx.attemptNumber()) if ctx is not None else (0, 0)
        filesystem, root = self._fs()
        temporary = f"{root}/_temporary/{self.job}/part-{part:05d}-{attempt}.parquet"
        fixed = pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(self.schema_hex))) if self.schema_hex else None
        writer, rows = None, 0
        try:
            for batch in iterator:
                if writer is None:
                    schema = fixed or batch.schema.with_metadata({b"huggingface": self.metadata.encode()})
                    filesystem.create_dir(f"{root}/_temporary/{self.job}", recursive=True)
                    writer = pq.ParquetWriter(temporary, schema, filesystem=filesystem, compression=self.compression)
                writer.write_table(pa.Table.from_batches([batch]).cast(schema))
                rows += batch.num_rows
        finally:
            if writer is not None:
                writer.close()
        if writer is None:
            return _Written(None, None, 0)
        return _Written(temporary, f"{root}/part-{part:05d}-{self.job}.parquet", rows)

    def commit(self, messages: list[Any]) -> None:
        from pyarrow import fs

        filesystem, root = self._fs()
        if self.overwrite:
            for info in filesystem.get_file_info(fs.FileSelector(root, allow_not_found=True)):
                if info.type == fs.FileType.File and info.base_name.startswith("part-") and \
                        info.base_name.endswith(".parquet"):
                    filesystem.delete_file(info.path)
        for m in messages:
            if isinstance(m, _Written) and m.temporary is not None:
                filesystem.move(m.temporary, m.final)
        filesystem.create_dir(root, recursive=True)  # an empty result still leaves its folder
        _remove_dir(filesystem, f"{root}/_temporary/{self.job}")
        if not filesystem.get_file_info(fs.FileSelector(f"{root}/_temporary", allow_not_found=True)):
            _remove_dir(filesystem, f"{root}/_temporary")

    def abort(self, messages: list[Any]) -> None:
        filesystem, root = self._fs()
        _remove_dir(filesystem, f"{root}/_temporary/{self.job}")


def _remove_dir(filesystem: Any, path: str) -> None:
    from pyarrow import fs

    if filesystem.get_file_info(path).type == fs.FileType.Directory:
        filesystem.delete_dir(path)


class _ParquetSource(DataSource):  # type: ignore[misc]
    """Write-only Python data source ``hf_arb_parquet`` used by :func:`write_parquet`."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def writer(self, schema: Any, overwrite: bool) -> _ParquetWriter:
        return _ParquetWriter(dict(self.options), overwrite)

