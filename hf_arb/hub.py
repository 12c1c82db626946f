"""Make the bucket configuration travel with the data: restore it anywhere, push it to the Hub.

Where the BucketSet lives, in order of preference:

1. the ``bucket`` column's feature: ``Value("int32", id="hf_arb.buckets:{json}")``. ``datasets`` keeps a
   feature's ``id`` through ``map``/``select``/``save_to_disk``, in Parquet schema metadata
   (``to_parquet`` → ``load_dataset("parquet")``) and in the Hub card's ``dataset_info`` YAML;
2. the dataset card's YAML under the ``hf_arb`` key (written by :func:`push_to_hub`), see
   :func:`buckets_from_card`;
3. the columns themselves: the distinct ``(bucket, bucket_width, bucket_height)`` rows give the
   resolution table, and ``aspect_error`` against ``original_width/height`` tells the metric
   (:func:`buckets_from_columns`).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from huggingface_hub import CommitOperationAdd, DatasetCard, HfApi

from . import __version__
from .annotate import BUCKET_COLUMNS, CONFIG_ID_PREFIX, AnnotationSummary, bucket_features, summarize_annotation
from .buckets import BucketSet

#: Path of the bucket chart inside the Hub repository.
CHART_PATH_IN_REPO = "hf_arb/bucket_chart.png"
#: Key of the dataset card's YAML metadata that holds the bucket configuration.
CARD_KEY = "hf_arb"
_BEGIN = "<!-- hf_arb:begin -->"
_END = "<!-- hf_arb:end -->"


# ----------------------------------------------------------------------------------- restore
def buckets_from_features(features: Any) -> BucketSet | None:
    """The BucketSet stored in the ``bucket`` feature's ``id``, or None when there is none."""
    if not features or "bucket" not in features:
        return None
    fid = getattr(features["bucket"], "id", None)
    if isinstance(fid, str) and fid.startswith(CONFIG_ID_PREFIX):
        return BucketSet.from_json(fid[len(CONFIG_ID_PREFIX):])
    return None


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

    if not isinstance(ds, datasets.Dataset):
        raise TypeError(f"Rebuilding buckets from columns needs a map-style Dataset, got {type(ds).__name__}.")
    need = ["bucket", "bucket_width", "bucket_height"]
    missing = [c for c in need if c not in ds.column_names]
    if missing:
        raise ValueError(f"The dataset has no {missing} column(s) and no stored bucket configuration; annotate it "
                         "with hf_arb.add_bucket_columns (or `hf-arb annotate`) first.")
    extra = [c for c in ("original_width", "original_height", "aspect_error", "skip_reason") if c in ds.column_names]
    t = ds.select_columns(need + extra).with_format("arrow")[:]
    ids = pc.fill_null(t.column("bucket"), -1).to_numpy().astype(np.int64)  # (n,)
    kept = ids >= 0
    if not kept.any():
        raise ValueError("No row has a bucket (all bucket == -1), so the resolution table cannot be rebuilt from the "
                         "columns. Re-annotate with the BucketSet you want.")
    bw = pc.fill_null(t.column("bucket_width"), 0).to_numpy()[kept].astype(np.int64)  # (m,)
    bh = pc.fill_null(t.column("bucket_height"), 0).to_numpy()[kept].astype(np.int64)  # (m,)
    kid = ids[kept]
    uniq, first, inverse = np.unique(kid, return_index=True, return_inverse=True)  # (u,)
    if not (np.array_equal(bw, bw[first][inverse]) and np.array_equal(bh, bh[first][inverse])):
        bad = int(kid[np.flatnonzero((bw != bw[first][inverse]) | (bh != bh[first][inverse]))[0]])
        raise ValueError(f"Bucket id {bad} appears with more than one (bucket_width, bucket_height); the columns are "
                         "inconsistent (datasets annotated with different BucketSets were mixed?). Re-annotate.")
    gaps = np.setdiff1d(np.arange(int(uniq.max()) + 1), uniq)
    if gaps.size:
        raise ValueError(
            f"Bucket ids {gaps.tolist()[:20]} have no rows, so their resolutions cannot be read from the columns. "
            "The exact BucketSet is stored in the `bucket` feature (kept by save_to_disk, to_parquet and "
            "hf_arb.push_to_hub); it was lost on the way here (e.g. via pandas or CSV). Pass the BucketSet explicitly, "
            "or use hf_arb.hub.bucket_table_from_columns(ds) for the partial table."
        )
    resolutions = np.stack([bw[first], bh[first]], 1)  # (k, 2) in id order
    metric = _infer_metric(t, kept, resolutions[kid])
    if "skip_reason" in t.column_names and pc.any(
            pc.equal(pc.cast(t.column("skip_reason"), pa.string()), "aspect")).as_py():
        warnings.warn("Rows were pruned for their aspect ratio, but the threshold (max_aspect_error / aspect_range) "
                      "cannot be recovered from the columns; the restored BucketSet has none.", stacklevel=2)
    return BucketSet([tuple(r) for r in resolutions.tolist()], metric=metric)


def bucket_table_from_columns(ds: Any) -> dict[int, tuple[int, int]]:
    """``{bucket id: (width, height)}`` for every bucket that has at least one row (never raises on gaps)."""
    t = ds.select_columns(["bucket", "bucket_width", "bucket_height"]).with_format("arrow")[:]
    ids = pc.fill_null(t.column("bucket"), -1).to_numpy().astype(np.int64)
    kept = ids >= 0
    uniq, first = np.unique(ids[kept], return_index=True)
    bw = pc.fill_null(t.column("bucket_width"), 0).to_numpy()[kept]
    bh = pc.fill_null(t.column("bucket_height"), 0).to_numpy()[kept]
    return {int(i): (int(bw[j]), int(bh[j])) for i, j in zip(uniq.tolist(), first.tolist())}


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


def buckets_from_card(card: DatasetCard | str | os.PathLike[str]) -> BucketSet:
    """The BucketSet in a dataset card's YAML (``hf_arb.buckets``), from a ``DatasetCard``, its text, or a README path."""
    if not isinstance(card, DatasetCard):
        text = str(card)
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
        "hf_arb.hub.buckets_from_card(DatasetCard.load(repo_id))."
    )


# ----------------------------------------------------------------------------------- card
def _stats(ds: Any, buckets: BucketSet) -> AnnotationSummary | None:
    import datasets

    if isinstance(ds, datasets.Dataset) and all(c in ds.column_names for c in ("bucket", "aspect_error", "skip_reason")):
        return summarize_annotation(ds, buckets)
    return None  # streaming: counting would mean reading the whole dataset


def card_metadata(buckets: BucketSet, stats: dict[str, dict[str, Any]], chart: str | None) -> dict[str, Any]:
    """The ``hf_arb`` YAML block: bucket table, metric, thresholds, fingerprint, counts per split."""
    return {
        "version": __version__,
        "fingerprint": buckets.fingerprint,
        "buckets": buckets.to_dict(),
        "columns": list(BUCKET_COLUMNS),
        "chart": chart,
        "stats": stats,
    }


def card_section(repo_id: str, buckets: BucketSet, stats: dict[str, dict[str, Any]], chart: str | None) -> str:
    """The readable Markdown section: how to load, the bucket table with counts, the chart."""
    splits = [(cfg, split) for cfg, per in stats.items() for split in per]
    header_cells = ["id", "width", "height", "aspect"] + [
        f"rows ({split})" if cfg == "default" else f"rows ({cfg}/{split})" for cfg, split in splits]
    lines = [
        _BEGIN,
        "## Aspect-ratio buckets",
        "",
        f"Every row carries bucket columns written by `hf_arb` {__version__}: "
        + ", ".join(f"`{c}`" for c in BUCKET_COLUMNS) + ". `bucket = -1` marks a skipped row; `skip_reason` says why.",
        "",
        f"- buckets: {len(buckets)}, metric `{buckets.metric}`, max aspect error `{buckets.max_aspect_error}`, "
        f"aspect range `{buckets.aspect_range}`, fingerprint `{buckets.fingerprint}`",
    ]
    for cfg, split in splits:
        s = stats[cfg][split]
        skipped = ", ".join(f"{k} {v:,}" for k, v in s["skipped"].items()) or "none"
        e = s["aspect_error"]
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        lines.append(f"- `{cfg}/{split}`: {s['rows']:,} rows, {s['kept']:,} kept; skipped: {skipped}; aspect error "
                     f"mean {fmt(e['mean'])}, median {fmt(e['median'])}, max {fmt(e['max'])}")
    lines += [
        "",
        "```python",
        "from datasets import load_dataset",
        "from hf_arb import BucketSet",
        "",
        f'ds = load_dataset("{repo_id}", split="train")',
        "buckets = BucketSet.from_dataset(ds)  # the exact bucket configuration below",
        "```",
        "",
        "| " + " | ".join(header_cells) + " |",
        "|" + "---|" * len(header_cells),
    ]
    for i in buckets.portrait_to_landscape().tolist():
        w, h = buckets[i]
        label = f"{w}x{h}"
        counts = " | ".join(f"{stats[c][s]['counts'].get(label, 0):,}" for c, s in splits)
        lines.append(f"| {i} | {w} | {h} | {w / h:.3f} | {counts} |" if splits else f"| {i} | {w} | {h} | {w / h:.3f} |")
    if chart:
        lines += ["", f"![rows per bucket and aspect error]({chart})"]
    lines.append(_END)
    return "\n".join(lines)


def update_card_text(text: str | None, repo_id: str, buckets: BucketSet, stats: dict[str, dict[str, Any]],
                     chart: str | None) -> str:
    """Add (or replace) the ``hf_arb`` YAML key and the readable section in a README's text.

    Stats for other configs/splits already on the card are kept when their fingerprint matches.
    """
    card = DatasetCard(text if text else "---\n{}\n---\n")
    old = card.data.get(CARD_KEY)
    merged: dict[str, dict[str, Any]] = {}
    if isinstance(old, dict) and old.get("fingerprint") == buckets.fingerprint and isinstance(old.get("stats"), dict):
        merged = {c: dict(v) for c, v in old["stats"].items() if isinstance(v, dict)}
    for cfg, per in stats.items():
        merged.setdefault(cfg, {}).update(per)
    card.data[CARD_KEY] = card_metadata(buckets, merged, chart)
    body = card.text or ""
    section = card_section(repo_id, buckets, merged, chart)
    if _BEGIN in body and _END in body:
        pre, rest = body.split(_BEGIN, 1)
        post = rest.split(_END, 1)[1]
        body = pre + section + post
    else:
        body = body.rstrip("\n") + ("\n\n" if body.strip() else "\n") + section + "\n"
    card.text = body
    return str(card)


# ----------------------------------------------------------------------------------- push
def push_to_hub(ds: Any, repo_id: str, buckets: BucketSet | None = None, *, chart: bool = True,
                **kwargs: Any) -> Any:
    """Push an annotated dataset with ``datasets``' own ``push_to_hub``, then write the bucket card.

    The card gets YAML metadata under ``hf_arb`` (bucket table, metric, thresholds, fingerprint, counts per split),
    a readable section with the bucket table and counts, and the bucket chart image (``hf_arb/bucket_chart.png``,
    when matplotlib is installed).

    Args:
        ds: annotated ``Dataset``, ``DatasetDict``, ``IterableDataset`` or ``IterableDatasetDict``.
        repo_id: ``"user/name"``.
        buckets: the BucketSet; default: ``BucketSet.from_dataset(ds)``. When given, it must agree with the one
            stored in the dataset (if any), and it is written into the ``bucket`` feature before pushing.
        chart: draw and upload the chart (skipped with a warning when matplotlib is missing).
        **kwargs: passed to ``ds.push_to_hub`` (``split``, ``config_name``, ``private``, ``token``, ``revision``,
            ``create_pr``, ``max_shard_size``, ``num_proc``, ...).

    Returns:
        The ``huggingface_hub.CommitInfo`` of the card commit.

    Example:
        ```py
        >>> import hf_arb
        >>> hf_arb.push_to_hub(annotated, "me/my-data", private=True)
        >>> # elsewhere
        >>> ds = load_dataset("me/my-data", split="train"); bs = hf_arb.BucketSet.from_dataset(ds)
        ```
    """
    import datasets

    stored_ds = ds
    if buckets is None:
        buckets = buckets_from_dataset(ds)
    else:
        feats = ds[next(iter(ds))].features if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)) else ds.features
        stored = buckets_from_features(feats)
        if stored is not None and stored != buckets:
            raise ValueError(f"`buckets` (fingerprint {buckets.fingerprint}) differs from the BucketSet the dataset was "
                             f"annotated with ({stored.fingerprint}). Re-annotate, or pass buckets=None.")
        if stored is None:
            stored_ds = ds.cast_column("bucket", bucket_features(buckets)["bucket"])
    config_name = kwargs.get("config_name", "default")
    parts = stored_ds.items() if isinstance(stored_ds, (datasets.DatasetDict, datasets.IterableDatasetDict)) else [
        (kwargs.get("split") or (str(stored_ds.split) if stored_ds.split is not None else "train"), stored_ds)]
    stats: dict[str, dict[str, Any]] = {config_name: {}}
    ids_all: list[np.ndarray] = []
    err_all: list[np.ndarray] = []
    for split, part in parts:
        s = _stats(part, buckets)
        if s is not None:
            stats[config_name][str(split)] = s.to_dict()
            t = part.select_columns(["bucket", "aspect_error"]).with_format("arrow")[:]
            ids_all.append(t.column(0).to_numpy())
            err_all.append(pc.cast(t.column(1), pa.float64()).to_numpy(zero_copy_only=False))
    if not stats[config_name]:
        stats = {}

    if isinstance(stored_ds, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        from .annotate import decoding_images

        stored_ds = decoding_images(stored_ds)  # an annotated stream's images are undecoded; the Hub copy decodes
    commit = stored_ds.push_to_hub(repo_id, **kwargs)

    api = HfApi(token=kwargs.get("token"))
    pr_revision = getattr(commit, "pr_revision", None)
    target_revision = pr_revision or kwargs.get("revision")
    read_revision = getattr(commit, "oid", None) or target_revision
    try:
        readme = Path(api.hf_hub_download(repo_id, "README.md", repo_type="dataset", revision=read_revision)).read_text(encoding="utf-8")
    except Exception as e:  # noqa: BLE001 - a missing card is not fatal: we write a fresh one
        if "404" not in str(e) and "EntryNotFound" not in type(e).__name__ and not isinstance(e, FileNotFoundError):
            raise
        readme = None

    operations = []
    chart_path: str | None = None
    with tempfile.TemporaryDirectory() as tmp:
        if chart and ids_all:
            try:
                from .plot import plot_bucket_chart

                png = plot_bucket_chart(buckets, np.concatenate(ids_all), np.concatenate(err_all), Path(tmp) / "chart.png",
                                        title=f"{repo_id}: rows per bucket")
                operations.append(CommitOperationAdd(path_in_repo=CHART_PATH_IN_REPO, path_or_fileobj=png.read_bytes()))
                chart_path = CHART_PATH_IN_REPO
            except ImportError as e:
                warnings.warn(f"No bucket chart on the card: {e}", stacklevel=2)
        text = update_card_text(readme, repo_id, buckets, stats, chart_path)
        operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=text.encode("utf-8")))
        return api.create_commit(
            repo_id, operations=operations, repo_type="dataset", revision=target_revision,
            commit_message="Add the hf_arb bucket configuration to the dataset card",
        )
