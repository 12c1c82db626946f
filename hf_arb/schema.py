"""The bucket schema of a dataset: the only code that writes and reads the bucket columns and the stored
:class:`~hf_arb.buckets.BucketSet`.

Columns (added by :func:`hf_arb.add_bucket_columns`, in this order): see :data:`BUCKET_COLUMNS`.

Where the BucketSet lives, in order of preference:

1. the ``bucket`` column's feature: ``Value("int32", id="hf_arb.buckets:{json}")``. ``datasets`` keeps a
   feature's ``id`` through ``map``/``select``/``save_to_disk``, in Parquet schema metadata
   (``to_parquet`` → ``load_dataset("parquet")``) and in the Hub card's ``dataset_info`` YAML;
2. the dataset card's YAML under the ``hf_arb`` key (written by :func:`hf_arb.hub.push_to_hub`), see
   :func:`buckets_from_card`;
3. the columns themselves: the distinct ``(bucket, bucket_width, bucket_height)`` rows give the resolution
   table, and ``aspect_error`` against ``original_width/height`` tells the metric (:func:`buckets_from_columns`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .buckets import BucketSet

#: The columns :func:`hf_arb.add_bucket_columns` adds, in order.
BUCKET_COLUMNS: tuple[str, ...] = (
    "bucket", "bucket_width", "bucket_height", "original_width", "original_height", "aspect_error", "skip_reason",
)
#: Prefix of the ``bucket`` feature's ``id`` that carries ``BucketSet.to_json()``.
CONFIG_ID_PREFIX = "hf_arb.buckets:"
#: Key of the dataset card's YAML metadata that holds the bucket configuration.
CARD_KEY = "hf_arb"


# ----------------------------------------------------------------------------------- write
def bucket_features(buckets: BucketSet) -> Any:
    """``datasets.Features`` of the bucket columns; the ``bucket`` feature's ``id`` carries the BucketSet."""
    from datasets import Features, Value

    return Features({
        "bucket": Value("int32", id=CONFIG_ID_PREFIX + buckets.to_json()),
        "bucket_width": Value("int32"),
        "bucket_height": Value("int32"),
        "original_width": Value("int32"),
        "original_height": Value("int32"),
        "aspect_error": Value("float32"),
        "skip_reason": Value("string"),
    })


def arrow_schema() -> pa.Schema:
    """The Arrow schema of the bucket columns (what the pure annotation core returns)."""
    return pa.schema([
        ("bucket", pa.int32()), ("bucket_width", pa.int32()), ("bucket_height", pa.int32()),
        ("original_width", pa.int32()), ("original_height", pa.int32()), ("aspect_error", pa.float32()),
        ("skip_reason", pa.string()),
    ])


def with_stored_buckets(ds: Any, buckets: BucketSet) -> Any:
    """``ds`` with ``buckets`` stored in its ``bucket`` feature (a cast: no data is rewritten)."""
    return ds.cast_column("bucket", bucket_features(buckets)["bucket"])


# ----------------------------------------------------------------------------------- checks
def require_split(ds: Any, what: str) -> None:
    """Raise a clear error when ``ds`` is a ``DatasetDict`` where one split is needed."""
    if isinstance(ds, dict):  # DatasetDict and IterableDatasetDict are dicts of splits
        splits = list(ds.keys())
        first = splits[0] if splits else "train"
        raise TypeError(f"{what} needs one split, got a {type(ds).__name__} with splits {splits}; pick one: "
                        f"ds[{first!r}].")


def require_columns(ds: Any, columns: list[str], what: str) -> None:
    """Raise when ``ds`` lacks any of ``columns``, naming them, the columns it has, and how to annotate."""
    require_split(ds, what)
    names = list(getattr(ds, "column_names", None) or [])
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(
            f"{what} needs the bucket column(s) {missing}, but the dataset has {names}. Annotate it first with "
            "`hf_arb.add_bucket_columns(ds, buckets)` (or `hf-arb annotate`), or pass the bucket ids as an array."
        )


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


def _column_table(ds: Any, need: list[str], extra: list[str]) -> pa.Table:
    require_columns(ds, need, "Rebuilding the bucket table")
    extra = [c for c in extra if c in ds.column_names]
    return ds.select_columns(need + extra).with_format("arrow")[:]


def _kept_sizes(t: pa.Table, column: str = "bucket") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kept rows' ids ``(m,)`` and bucket ``(width, height)`` ``(m, 2)``, plus the kept mask ``(n,)``."""
    ids = pc.fill_null(t.column(column), -1).to_numpy().astype(np.int64)  # (n,)
    kept = ids >= 0
    bw = pc.fill_null(t.column("bucket_width"), 0).to_numpy()[kept].astype(np.int64)  # (m,)
    bh = pc.fill_null(t.column("bucket_height"), 0).to_numpy()[kept].astype(np.int64)  # (m,)
    return ids[kept], np.stack([bw, bh], 1), kept


def bucket_table_from_columns(ds: Any, column: str = "bucket") -> dict[int, tuple[int, int]]:
    """``{bucket id: (width, height)}`` for every bucket that has at least one row (never raises on gaps)."""
    kid, wh, _ = _kept_sizes(_column_table(ds, [column, "bucket_width", "bucket_height"], []), column)
    uniq, first = np.unique(kid, return_index=True)
    return {int(i): (int(wh[j, 0]), int(wh[j, 1])) for i, j in zip(uniq.tolist(), first.tolist())}


def _infer_metric(t: pa.Table, kept: np.ndarray, res: np.ndarray) -> str:
    """Which metric produced ``aspect_error``: compare it with both metrics on the kept rows."""
    if not {"original_width", "original_height", "aspect_error"} <= set(t.column_names):
        return "log"
    ow = pc.cast(t.column("original_width"), pa.float64()).to_numpy(zero_copy_only=False)[kept]  # (m,)
    oh = pc.cast(t.column("original_height"), pa.float64()).to_numpy(zero_copy_only=False)[kept]
    err = pc.cast(t.column("aspect_error"), pa.float64()).to_numpy(zero_copy_only=False)[kept]
    a = ow / oh
    b = res[:, 0] / res[:, 1]
    ok = np.isfinite(a) & np.isfinite(err)
    log_dev = np.abs(np.abs(np.log(a / b)) - err)[ok]
    lin_dev = np.abs(np.abs(b - a) - err)[ok]
    if log_dev.size and lin_dev.max() < 1e-4 < log_dev.max():
        return "linear"
    return "log"


def buckets_from_columns(ds: Any) -> BucketSet:
    """Rebuild the BucketSet from the bucket columns alone (vectorised over the whole dataset).

    The resolution table comes from the distinct ``(bucket, bucket_width, bucket_height)`` triples; the metric
    from ``aspect_error`` compared with ``original_width/height`` (``"log"`` when the data cannot tell).
    Thresholds (``max_aspect_error``, ``aspect_range``) are not recoverable this way: a warning says so when rows
    were pruned for their aspect ratio.

    Raises:
        ValueError: the columns are missing, one id maps to two resolutions, or some bucket ids have no row, so
            their resolution is unknown (the message lists them and says how to keep the metadata).
    """
    import datasets

    require_split(ds, "Rebuilding the bucket table")
    if not isinstance(ds, datasets.Dataset):
        raise TypeError(f"Rebuilding buckets from columns needs a map-style Dataset, got {type(ds).__name__}.")
    t = _column_table(ds, ["bucket", "bucket_width", "bucket_height"],
                      ["original_width", "original_height", "aspect_error", "skip_reason"])
    kid, wh, kept = _kept_sizes(t)
    if kid.size == 0:
        raise ValueError("No row has a bucket (all bucket == -1), so the resolution table cannot be rebuilt from the "
                         "columns. Re-annotate with the BucketSet you want.")
    uniq, first, inverse = np.unique(kid, return_index=True, return_inverse=True)  # (u,)
    bad_rows = np.flatnonzero((wh != wh[first][inverse]).any(axis=1))
    if bad_rows.size:
        raise ValueError(f"Bucket id {int(kid[bad_rows[0]])} appears with more than one (bucket_width, bucket_height); "
                         "the columns are inconsistent (datasets annotated with different BucketSets were mixed?). "
                         "Re-annotate.")
    gaps = np.setdiff1d(np.arange(int(uniq.max()) + 1), uniq)
    if gaps.size:
        raise ValueError(
            f"Bucket ids {gaps.tolist()[:20]} have no rows, so their resolutions cannot be read from the columns. "
            "The exact BucketSet is stored in the `bucket` feature (kept by save_to_disk, to_parquet and "
            "hf_arb.push_to_hub); it was lost on the way here (e.g. via pandas or CSV). Pass the BucketSet explicitly, "
            "or use hf_arb.schema.bucket_table_from_columns(ds) for the partial table."
        )
    resolutions = wh[first]  # (k, 2) in id order
    metric = _infer_metric(t, kept, resolutions[kid])
    if "skip_reason" in t.column_names and pc.any(
            pc.equal(pc.cast(t.column("skip_reason"), pa.string()), "aspect")).as_py():
        warnings.warn("Rows were pruned for their aspect ratio, but the threshold (max_aspect_error / aspect_range) "
                      "cannot be recovered from the columns; the restored BucketSet has none.", stacklevel=2)
    return BucketSet([tuple(r) for r in resolutions.tolist()], metric=metric)


# ----------------------------------------------------------------------------------- read: stored set
def buckets_from_features(features: Any) -> BucketSet | None:
    """The BucketSet stored in the ``bucket`` feature's ``id``, or None when there is none."""
    if not features or "bucket" not in features:
        return None
    fid = getattr(features["bucket"], "id", None)
    if isinstance(fid, str) and fid.startswith(CONFIG_ID_PREFIX):
        return BucketSet.from_json(fid[len(CONFIG_ID_PREFIX):])
    return None


def buckets_from_card(card: Any) -> BucketSet:
    """The BucketSet in a dataset card's YAML (``hf_arb.buckets``), from a ``DatasetCard``, its text, or a README path."""
    from huggingface_hub import DatasetCard

    if not isinstance(card, DatasetCard):
        text = os.fspath(card) if isinstance(card, os.PathLike) else str(card)
        if not text.lstrip().startswith("---") and Path(text).is_file():
            text = Path(text).read_text(encoding="utf-8")
        card = DatasetCard(text)
    meta = card.data.get(CARD_KEY)
    if not isinstance(meta, dict) or "buckets" not in meta:
        raise ValueError(f"The dataset card has no `{CARD_KEY}.buckets` YAML metadata; it was not pushed with "
                         "hf_arb.push_to_hub. Use BucketSet.from_dataset(ds) on the loaded dataset instead.")
    return BucketSet.from_dict(meta["buckets"])


def buckets_from_dataset(ds: Any) -> BucketSet:
    """Restore the BucketSet an annotated dataset was built with (what ``BucketSet.from_dataset`` calls).

    Args:
        ds: ``Dataset``, ``IterableDataset``, ``DatasetDict`` or ``IterableDatasetDict`` with the bucket columns.

    Returns:
        The exact BucketSet (same fingerprint) when the ``bucket`` feature carries it — after ``save_to_disk`` /
        ``load_from_disk``, ``to_parquet`` / ``load_dataset("parquet")`` and a Hub push / ``load_dataset(repo)``.
        Otherwise it is rebuilt from the columns (:func:`buckets_from_columns`).

    Raises:
        ValueError: neither the metadata nor the columns can tell (the message says why).
    """
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if not ds:
            raise ValueError("The DatasetDict is empty.")
        found = {split: buckets_from_dataset(d) for split, d in ds.items()}
        first = next(iter(found.values()))
        if any(b != first for b in found.values()):
            raise ValueError(f"The splits were annotated with different BucketSets: "
                             f"{ {s: b.fingerprint for s, b in found.items()} }. Annotate all splits with one BucketSet.")
        return first
    stored = buckets_from_features(getattr(ds, "features", None))
    if stored is not None:
        return stored
    if isinstance(ds, datasets.Dataset):
        return buckets_from_columns(ds)
    raise ValueError(
        f"No bucket configuration found on this {type(ds).__name__}: its `bucket` feature carries none and a streaming "
        "dataset cannot be scanned for its columns. Load it map-style, or read the card: "
        "hf_arb.schema.buckets_from_card(DatasetCard.load(repo_id))."
    )


def read_resolutions(ds: Any, buckets: Any = None, column: str = "bucket") -> np.ndarray:
    """The ``(width, height)`` of every bucket id an annotated dataset uses: int64, shape ``(k, 2)``.

    Args:
        ds: an annotated map-style ``datasets.Dataset``.
        buckets: a ``BucketSet`` or ``(k, 2)`` resolutions to use as given; default: the stored BucketSet, else
            the table rebuilt from the columns (ids without rows are ``(0, 0)`` there).
        column: the bucket id column.

    Raises:
        ValueError: ``buckets`` has the wrong shape or non-positive sizes, or the dataset carries no bucket table.
    """
    if buckets is not None:
        table = np.asarray(getattr(buckets, "resolutions", buckets), dtype=np.int64)
        if table.ndim != 2 or table.shape[1] != 2 or (table <= 0).any():
            raise ValueError(f"`buckets` must be a BucketSet or (width, height) pairs, got an array of shape "
                             f"{table.shape}.")
        return table
    stored = buckets_from_features(getattr(ds, "features", None))
    if stored is not None:
        return np.asarray(stored.resolutions, dtype=np.int64)
    partial = bucket_table_from_columns(ds, column)
    if not partial:
        raise ValueError("Every row has bucket -1 (skipped); the dataset carries no bucket table and nothing to train "
                         "on. Check the annotation's `skip_reason` column or the bucket set.")
    table = np.zeros((max(partial) + 1, 2), dtype=np.int64)
    for i, wh in partial.items():
        table[i] = wh
    kid, wh, _ = _kept_sizes(_column_table(ds, [column, "bucket_width", "bucket_height"], []), column)
    if not np.array_equal(table[kid], wh):
        bad = int(kid[np.flatnonzero((table[kid] != wh).any(axis=1))[0]])
        raise ValueError(f"Bucket {bad} has more than one size in the bucket_width/bucket_height columns; re-annotate.")
    return table
