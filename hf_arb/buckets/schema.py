"""The bucket schema of a dataset: the only code that writes and reads the bucket columns and the stored
:class:`~hf_arb.buckets.BucketSet`.

Columns (added by :func:`hf_arb.add_bucket_columns`, in this order): see :data:`BUCKET_COLUMNS`.

Where the BucketSet lives, in order of preference:

1. the ``bucket`` column's feature: ``Value("int32", id="hf_arb.buckets:{json}")``. ``datasets`` keeps a
   feature's ``id`` through ``map``/``select``/``save_to_disk``, in Parquet schema metadata
   (``to_parquet`` → ``load_dataset("parquet")``) and in the Hub card's ``dataset_info`` YAML;
2. the dataset card's YAML under the ``hf_arb`` key (written by :func:`hf_arb.annotate.hub.push_to_hub`), see
   :func:`buckets_from_card`;
3. the columns themselves: the distinct ``(bucket, bucket_width, bucket_height)`` rows give the resolution
   table, and ``aspect_error`` against ``original_width/height`` tells the metric (:func:`buckets_from_columns`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .sets import BucketSet
from .stored import (
    CONFIG_ID_PREFIX,
    bucket_table_from_columns,
    column_table,
    config_from_card,
    config_from_columns,
    config_from_features,
    kept_sizes,
    require_columns,
    size_columns,
)

#: The columns :func:`hf_arb.add_bucket_columns` adds, in order.
BUCKET_COLUMNS: tuple[str, ...] = (
    "bucket", "bucket_width", "bucket_height", "original_width", "original_height", "aspect_error", "skip_reason",
)
#: The columns a clip set (``BucketSet.has_frames``) adds after :data:`BUCKET_COLUMNS`: the bucket's frame count, the
#: clip's frames and frame rate from its header (an image is 1 frame at fps 0), whether the count is the container's
#: own (``False``: duration x fps), and the frame plan (:func:`hf_arb.video.temporal.plan_frames`, the one rule):
#: ``frame_stride``, source frames per trained frame (``fps / target_fps``, float64 as the plan uses it) and
#: ``frame_start``, a ``slide`` window's first source frame (null where the run's sampling mode picks the start:
#: ``head`` at 0, ``random`` drawn per epoch); the plan's count is ``bucket_frames``.
CLIP_BUCKET_COLUMNS: tuple[str, ...] = ("bucket_frames", "original_frames", "original_fps", "frames_exact",
                                        "frame_stride", "frame_start")


# ----------------------------------------------------------------------------------- write
def bucket_features(buckets: BucketSet) -> Any:
    """``datasets.Features`` of the bucket columns; the ``bucket`` feature's ``id`` carries the BucketSet (with its
    frame axis); a clip set's :data:`CLIP_BUCKET_COLUMNS` follow."""
    from datasets import Features, Value

    clip = {"bucket_frames": Value("int32"), "original_frames": Value("int32"), "original_fps": Value("float32"),
            "frames_exact": Value("bool"), "frame_stride": Value("float64"),
            "frame_start": Value("int32")} if buckets.has_frames else {}
    return Features({
        "bucket": Value("int32", id=CONFIG_ID_PREFIX + buckets.to_json()),
        "bucket_width": Value("int32"),
        "bucket_height": Value("int32"),
        "original_width": Value("int32"),
        "original_height": Value("int32"),
        "aspect_error": Value("float32"),
        "skip_reason": Value("string"),
        **clip,
    })


def arrow_schema() -> pa.Schema:
    """The Arrow schema of the bucket columns (what the pure annotation core returns)."""
    return pa.schema([
        ("bucket", pa.int32()), ("bucket_width", pa.int32()), ("bucket_height", pa.int32()),
        ("original_width", pa.int32()), ("original_height", pa.int32()), ("aspect_error", pa.float32()),
        ("skip_reason", pa.string()),
    ])


def clip_arrow_schema() -> pa.Schema:
    """The Arrow schema of a clip set's bucket columns: :func:`arrow_schema`, then :data:`CLIP_BUCKET_COLUMNS`."""
    return pa.schema(list(arrow_schema()) + [
        ("bucket_frames", pa.int32()), ("original_frames", pa.int32()), ("original_fps", pa.float32()),
        ("frames_exact", pa.bool_()), ("frame_stride", pa.float64()), ("frame_start", pa.int32())])


def with_stored_buckets(ds: Any, buckets: BucketSet) -> Any:
    """``ds`` with ``buckets`` stored in its ``bucket`` feature (a cast: no data is rewritten)."""
    return ds.cast_column("bucket", bucket_features(buckets)["bucket"])


# ----------------------------------------------------------------------------------- read: columns
def read_bucket_ids(ds: Any, column: str = "bucket") -> np.ndarray:
    """The bucket id of every row of a map-style dataset: int64, shape ``(n,)`` (``-1`` = skipped; nulls too)."""
    require_columns(ds, [column], "Reading bucket ids")
    col = ds.select_columns([column]).with_format("arrow")[:].column(column)
    return pc.fill_null(col, -1).to_numpy().astype(np.int64)


def read_ids_and_errors(ds: Any) -> tuple[np.ndarray, np.ndarray]:
    """``bucket`` (int64, ``-1`` for nulls) and ``aspect_error`` (float64, NaN for nulls), each of shape ``(n,)``."""
    require_columns(ds, ["bucket", "aspect_error"], "Reading the annotation")
    t = ds.select_columns(["bucket", "aspect_error"]).with_format("arrow")[:]
    ids = pc.fill_null(t.column("bucket"), -1).to_numpy().astype(np.int64)
    return ids, pc.cast(t.column("aspect_error"), pa.float64()).to_numpy(zero_copy_only=False)


def read_original_sizes(ds: Any, column: str = "bucket") -> tuple[np.ndarray, np.ndarray]:
    """Displayed ``(width, height)`` of every row from the annotation (``original_width``/``original_height``),
    int64 ``(n,)`` each; ``0`` where the row was skipped at annotation (bucket ``-1``) or a size is null."""
    require_columns(ds, [column, "original_width", "original_height"], "Reading the original sizes")
    t = ds.select_columns([column, "original_width", "original_height"]).with_format("arrow")[:]
    kept = pc.fill_null(t.column(column), -1).to_numpy() >= 0
    w, h = (pc.fill_null(t.column(c), 0).to_numpy().astype(np.int64) for c in ("original_width", "original_height"))
    ok = kept & (w > 0) & (h > 0)
    return np.where(ok, w, 0), np.where(ok, h, 0)


def buckets_from_columns(ds: Any) -> BucketSet:
    """Rebuild the BucketSet from the bucket columns alone: :func:`hf_arb.buckets.stored.config_from_columns`."""
    return BucketSet.from_dict(config_from_columns(ds))


def buckets_from_features(features: Any) -> BucketSet | None:
    """The BucketSet stored in the ``bucket`` feature's ``id``, or None when there is none."""
    config = config_from_features(features)
    return None if config is None else BucketSet.from_dict(config)


def buckets_from_card(card: Any) -> BucketSet:
    """The BucketSet in a dataset card's YAML (``hf_arb.buckets``), from a ``DatasetCard``, its text, or a README
    path."""
    return BucketSet.from_dict(config_from_card(card))


def buckets_from_dataset(ds: Any) -> BucketSet:
    """Restore the BucketSet an annotated dataset was built with: ``BucketSet.from_dataset(ds)``."""
    return BucketSet.from_dataset(ds)


def read_resolutions(ds: Any, buckets: Any = None, column: str = "bucket") -> np.ndarray:
    """The ``(width, height)`` of every bucket id an annotated dataset uses: int64, shape ``(k, 2)``; ``(k, 3)``
    ``(width, height, frames)`` for clips.

    Args:
        ds: an annotated map-style ``datasets.Dataset``.
        buckets: a ``BucketSet`` or ``(k, 2)`` / ``(k, 3)`` resolutions to use as given; default: the stored BucketSet,
            else the table rebuilt from the columns (ids without rows are ``(0, 0)`` there).
        column: the bucket id column.

    Raises:
        ValueError: ``buckets`` has the wrong shape or non-positive sizes, or the dataset carries no bucket table.
    """
    if buckets is not None:
        table = np.asarray(getattr(buckets, "resolutions", buckets), dtype=np.int64)
        if table.ndim != 2 or table.shape[1] not in (2, 3) or (table <= 0).any():
            raise ValueError(f"`buckets` must be a BucketSet, (width, height) pairs or (width, height, frames) "
                             f"triples, got an array of shape {table.shape}.")
        return table
    stored = buckets_from_features(getattr(ds, "features", None))
    if stored is not None:
        return np.asarray(stored.resolutions, dtype=np.int64)
    partial = bucket_table_from_columns(ds, column)
    if not partial:
        raise ValueError("Every row has bucket -1 (skipped); the dataset carries no bucket table and nothing to train "
                         "on. Check the annotation's `skip_reason` column or the bucket set.")
    table = np.zeros((max(partial) + 1, len(next(iter(partial.values())))), dtype=np.int64)
    for i, wh in partial.items():
        table[i] = wh
    kid, wh, _ = kept_sizes(column_table(ds, [column, *size_columns(ds.column_names)], []), column)
    if not np.array_equal(table[kid], wh):
        bad = int(kid[np.flatnonzero((table[kid] != wh).any(axis=1))[0]])
        raise ValueError(f"Bucket {bad} has more than one size in the bucket_width/bucket_height columns; re-annotate.")
    return table
