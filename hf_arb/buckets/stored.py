"""Reading a stored bucket configuration back, as the plain dict of :meth:`BucketSet.to_dict`.

Where it lives, in order of preference: the ``bucket`` feature's ``id`` (:data:`CONFIG_ID_PREFIX`), the dataset
card's YAML (:data:`CARD_KEY`), or the columns themselves. This module returns dicts and never builds a
``BucketSet``, so :mod:`hf_arb.buckets.sets` can read a dataset (``BucketSet.from_dataset``) without an import
circle; :mod:`hf_arb.buckets.schema` turns the dicts into ``BucketSet`` objects for everyone else.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.lazy import LazyModule

# pyarrow loads when a column is read: BucketSet (which reads a stored set through here) stays light to import
pa: Any = LazyModule("pyarrow")
pc: Any = LazyModule("pyarrow.compute")

#: Prefix of the ``bucket`` feature's ``id`` that carries ``BucketSet.to_json()``.
CONFIG_ID_PREFIX = "hf_arb.buckets:"
#: Key of the dataset card's YAML metadata that holds the bucket configuration.
CARD_KEY = "hf_arb"
#: The column of a clip dataset's bucket frame counts (beside ``bucket_width`` / ``bucket_height``): when present,
#: the table rebuilt from the columns is ``(k, 3)`` ``(width, height, frames)``.
FRAMES_COLUMN = "bucket_frames"


def size_columns(names: Any) -> list[str]:
    """The bucket size columns a dataset with these column names has: width, height, and frames for clips."""
    return ["bucket_width", "bucket_height"] + ([FRAMES_COLUMN] if FRAMES_COLUMN in (names or ()) else [])


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
def column_table(ds: Any, need: list[str], extra: list[str]) -> pa.Table:
    require_columns(ds, need, "Rebuilding the bucket table")
    extra = [c for c in extra if c in ds.column_names]
    return ds.select_columns(need + extra).with_format("arrow")[:]


def kept_sizes(t: pa.Table, column: str = "bucket") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kept rows' ids ``(m,)`` and bucket sizes ``(m, D)`` (``(width, height)``, plus ``frames`` when the table has
    :data:`FRAMES_COLUMN`), plus the kept mask ``(n,)``."""
    ids = pc.fill_null(t.column(column), -1).to_numpy().astype(np.int64)  # (n,)
    kept = ids >= 0
    cols = [pc.fill_null(t.column(c), 0).to_numpy()[kept].astype(np.int64)  # (m,) each
            for c in size_columns(t.column_names)]
    return ids[kept], np.stack(cols, 1), kept


def bucket_table_from_columns(ds: Any, column: str = "bucket") -> dict[int, tuple[int, ...]]:
    """``{bucket id: (width, height)}`` (``(width, height, frames)`` for clips) for every bucket that has at least one
    row (never raises on gaps)."""
    kid, wh, _ = kept_sizes(column_table(ds, [column, *size_columns(ds.column_names)], []), column)
    uniq, first = np.unique(kid, return_index=True)
    return {int(i): tuple(int(v) for v in wh[j]) for i, j in zip(uniq.tolist(), first.tolist())}


def infer_metric(t: pa.Table, kept: np.ndarray, res: np.ndarray) -> str:
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


def config_from_columns(ds: Any) -> dict[str, Any]:
    """The BucketSet dict (:meth:`BucketSet.to_dict` form) rebuilt from the bucket columns alone (vectorised over the
    whole dataset).

    The resolution table comes from the distinct ``(bucket, bucket_width, bucket_height)`` triples (with
    ``bucket_frames`` for clips: a ``(k, 3)`` table); the metric
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
    t = column_table(ds, ["bucket", *size_columns(ds.column_names)],
                      ["original_width", "original_height", "aspect_error", "skip_reason"])
    kid, wh, kept = kept_sizes(t)
    if kid.size == 0:
        raise ValueError("No row has a bucket (all bucket == -1), so the resolution table cannot be rebuilt from the "
                         "columns. Re-annotate with the BucketSet you want.")
    uniq, first, inverse = np.unique(kid, return_index=True, return_inverse=True)  # (u,)
    bad_rows = np.flatnonzero((wh != wh[first][inverse]).any(axis=1))
    if bad_rows.size:
        raise ValueError(f"Bucket id {int(kid[bad_rows[0]])} appears with more than one bucket size; "
                         "the columns are inconsistent (datasets annotated with different BucketSets were mixed?). "
                         "Re-annotate.")
    gaps = np.setdiff1d(np.arange(int(uniq.max()) + 1), uniq)
    if gaps.size:
        raise ValueError(
            f"Bucket ids {gaps.tolist()[:20]} have no rows, so their resolutions cannot be read from the columns. "
            "The exact BucketSet is stored in the `bucket` feature (kept by save_to_disk, to_parquet and "
            "hf_arb.push_to_hub); it was lost on the way here (e.g. via pandas or CSV). Pass the BucketSet explicitly, "
            "or use hf_arb.buckets.schema.bucket_table_from_columns(ds) for the partial table."
        )
    resolutions = wh[first]  # (k, D) in id order
    metric = infer_metric(t, kept, resolutions[kid])
    if "skip_reason" in t.column_names and pc.any(
            pc.equal(pc.cast(t.column("skip_reason"), pa.string()), "aspect")).as_py():
        warnings.warn("Rows were pruned for their aspect ratio, but the threshold (max_aspect_error / aspect_range) "
                      "cannot be recovered from the columns; the restored BucketSet has none.", stacklevel=2)
    return {"resolutions": resolutions.tolist(), "metric": metric}


# ----------------------------------------------------------------------------------- read: stored set
def config_from_features(features: Any) -> dict[str, Any] | None:
    """The BucketSet dict stored in the ``bucket`` feature's ``id``, or None when there is none."""
    if not features or "bucket" not in features:
        return None
    fid = getattr(features["bucket"], "id", None)
    if isinstance(fid, str) and fid.startswith(CONFIG_ID_PREFIX):
        return json.loads(fid[len(CONFIG_ID_PREFIX):])
    return None


def config_from_card(card: Any) -> dict[str, Any]:
    """The BucketSet dict in a dataset card's YAML (``hf_arb.buckets``), from a ``DatasetCard``, its text, or a README
    path."""
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
    return meta["buckets"]


def dataset_configs(ds: Any) -> dict[str, dict[str, Any]]:
    """The stored BucketSet dict of each split (``{"": dict}`` for one dataset): what ``BucketSet.from_dataset`` reads.

    Each comes from the ``bucket`` feature when it carries one — after ``save_to_disk`` / ``load_from_disk``,
    ``to_parquet`` / ``load_dataset("parquet")`` and a Hub push / ``load_dataset(repo)`` — else from the columns
    (:func:`config_from_columns`).

    Raises:
        ValueError: neither the metadata nor the columns can tell (the message says why).
    """
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if not ds:
            raise ValueError("The DatasetDict is empty.")
        return {split: dataset_configs(d)[""] for split, d in ds.items()}
    stored = config_from_features(getattr(ds, "features", None))
    if stored is not None:
        return {"": stored}
    if isinstance(ds, datasets.Dataset):
        return {"": config_from_columns(ds)}
    raise ValueError(
        f"No bucket configuration found on this {type(ds).__name__}: its `bucket` feature carries none and a streaming "
        "dataset cannot be scanned for its columns. Load it map-style, or read the card: "
        "hf_arb.buckets.schema.buckets_from_card(DatasetCard.load(repo_id))."
    )
