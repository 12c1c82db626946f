"""Add bucket columns to any image dataset: header-only sizes, vectorised assignment.

:func:`add_bucket_columns` works on ``datasets.Dataset`` (with ``num_proc``), ``IterableDataset``
(streaming, lazily) and their ``DatasetDict`` containers. It never decodes pixels: sizes come
from image headers (:func:`hf_arb.read_image_size`) or, with ``width_column``/``height_column``,
from metadata with no image IO at all. Every row is kept; rows that cannot be bucketed get
``bucket = -1`` and a ``skip_reason``.

The pure core is :func:`annotate_sizes` (numpy/pyarrow over whole arrays); the datasets glue
only feeds it batches. The BucketSet travels in the ``bucket`` column's feature metadata
(``Value("int32", id="hf_arb.buckets:{json}")``), which ``save_to_disk``, Parquet schema
metadata and the Hub card's ``dataset_info`` all keep; see :func:`hf_arb.schema.buckets_from_dataset`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .buckets import AssignmentSummary, BucketSet
from .schema import BUCKET_COLUMNS, CONFIG_ID_PREFIX, arrow_schema, bucket_features  # noqa: F401  (re-exported)
from .sizes import ImageSizeError, _size_of_open, read_image_size

# skip_reason codes of the vectorised core (0 = kept). Order = priority: the first that applies wins.
_REASONS: tuple[str | None, ...] = (None, "missing", "invalid_size", "aspect", "too_small", "upscale")
_MISSING, _INVALID, _ASPECT, _TOO_SMALL, _UPSCALE = 1, 2, 3, 4, 5


# ----------------------------------------------------------------------------------- pure core
def annotate_sizes(
    widths: Any,
    heights: Any,
    buckets: BucketSet,
    *,
    reasons: Sequence[str | None] | None = None,
    max_upscale: float | None = None,
    min_size: int | None = None,
) -> pa.Table:
    """Bucket columns for known (or unknown) image sizes, vectorised; the core of :func:`add_bucket_columns`.

    Args:
        widths: displayed widths, array-like of shape ``(n,)``; NaN or None where unknown.
        heights: displayed heights, shape ``(n,)``.
        buckets: the BucketSet (its metric, ``max_aspect_error`` and ``aspect_range`` apply).
        reasons: optional per-row skip reasons decided before sizing (e.g. ``"unreadable: not an image"``),
            length ``n``; a non-None entry skips the row with that reason.
        max_upscale: skip (``"upscale"``) rows whose cover scale ``max(bucket_w / w, bucket_h / h)`` exceeds this.
        min_size: skip (``"too_small"``) rows whose shorter side is below this many pixels.

    Returns:
        A ``pyarrow.Table`` with the :data:`BUCKET_COLUMNS`, ``n`` rows. ``bucket`` is ``-1`` for every skipped row;
        ``bucket_width``/``bucket_height`` are null there. ``original_*`` and ``aspect_error`` are null where the size
        is unknown or invalid; ``aspect_error`` is also given for rows pruned by the BucketSet.
        ``skip_reason`` priority: earlier reason, ``missing``, ``invalid_size``, ``aspect``, ``too_small``, ``upscale``.
    """
    w = _float_array(widths)  # (n,)
    h = _float_array(heights)  # (n,)
    if w.shape != h.shape:
        raise ValueError(f"`widths` and `heights` must have the same length, got {w.shape[0]} and {h.shape[0]}.")
    if max_upscale is not None and not (max_upscale > 0):
        raise ValueError(f"`max_upscale` must be > 0 (e.g. 2.0 allows doubling), got {max_upscale!r}.")
    if min_size is not None and not (min_size >= 0):
        raise ValueError(f"`min_size` must be >= 0 pixels, got {min_size!r}.")
    n = w.shape[0]
    code = np.zeros(n, dtype=np.int8)  # (n,) index into _REASONS; 0 = kept
    pre = None
    if reasons is not None:
        if len(reasons) != n:
            raise ValueError(f"`reasons` must have one entry per row ({n}), got {len(reasons)}.")
        pre = np.asarray(reasons, dtype=object)  # (n,)
        has_pre = pre != None  # noqa: E711 - elementwise comparison
    else:
        has_pre = np.zeros(n, dtype=bool)
    finite = np.isfinite(w) & np.isfinite(h)  # (n,)
    code[~finite & ~has_pre] = _MISSING
    good = finite & (w > 0) & (h > 0) & ~has_pre  # (n,) sizes usable for assignment
    code[finite & ~good & ~has_pre] = _INVALID

    ids = np.full(n, -1, dtype=np.int64)  # (n,)
    err = np.full(n, np.nan, dtype=np.float64)  # (n,)
    if good.any():
        ids[good], err[good] = buckets.assign(w[good], h[good])
    code[good & (ids < 0)] = _ASPECT
    open_ = code == 0
    open_ &= good
    if min_size is not None:
        small = open_ & (np.minimum(w, h) < min_size)
        code[small] = _TOO_SMALL
        open_ &= ~small
    res = buckets.resolutions  # (k, 2)
    safe = np.where(ids >= 0, ids, 0)  # (n,) valid index for gathering
    if max_upscale is not None:
        with np.errstate(invalid="ignore", divide="ignore"):
            scale = np.maximum(res[safe, 0] / w, res[safe, 1] / h)  # (n,) cover scale
        up = open_ & (scale > max_upscale)
        code[up] = _UPSCALE
        open_ &= ~up
    kept = open_ & (code == 0)  # (n,)

    bucket = np.where(kept, ids, -1).astype(np.int32)
    bw = res[safe, 0].astype(np.int32)
    bh = res[safe, 1].astype(np.int32)
    ow = np.rint(np.where(good, w, 0)).astype(np.int32)
    oh = np.rint(np.where(good, h, 0)).astype(np.int32)
    arrays = [
        pa.array(bucket, type=pa.int32()),
        pa.array(bw, type=pa.int32(), mask=~kept),
        pa.array(bh, type=pa.int32(), mask=~kept),
        pa.array(ow, type=pa.int32(), mask=~good),
        pa.array(oh, type=pa.int32(), mask=~good),
        pa.array(err.astype(np.float32), type=pa.float32(), mask=~good),
        _reason_array(code, pre, has_pre),
    ]
    return pa.Table.from_arrays(arrays, schema=arrow_schema())


def _float_array(values: Any) -> np.ndarray:
    """Sizes → float64 array of shape (n,), NaN for None/null."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False)
    arr = np.asarray(values)
    if arr.dtype == object:
        arr = np.asarray([np.nan if v is None else v for v in arr.tolist()], dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"Sizes must be 1-D, got shape {arr.shape}.")
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"Sizes must be numeric, got dtype {arr.dtype}. Cast the width/height columns to integers.")
    return arr.astype(np.float64, copy=False)


def _reason_array(code: np.ndarray, pre: np.ndarray | None, has_pre: np.ndarray) -> pa.Array:
    """skip_reason strings from codes (dictionary-decoded, no per-row Python) plus earlier reasons."""
    dictionary = pa.array([r or "" for r in _REASONS], type=pa.string())
    idx = pa.array(code, type=pa.int8(), mask=code == 0)
    out = pc.cast(pa.DictionaryArray.from_arrays(idx, dictionary), pa.string())
    if pre is not None and has_pre.any():
        pre_arr = pa.array(pre.tolist(), type=pa.string())
        out = pc.if_else(pa.array(has_pre), pre_arr, out)
    return out


# ----------------------------------------------------------------------------------- datasets glue
@functools.lru_cache(maxsize=16)
def _buckets_from_json(config: str) -> BucketSet:
    return BucketSet.from_json(config)


def _sizes_of(values: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    """Read header sizes of a batch of image values; the only per-row Python loop (it opens files)."""
    n = len(values)
    w = np.full(n, np.nan)  # (n,)
    h = np.full(n, np.nan)  # (n,)
    reasons: list[str | None] = [None] * n
    for i, v in enumerate(values):
        if v is None:
            continue  # null image → "missing"
        try:
            w[i], h[i] = v.size() if isinstance(v, _ArrowImage) else read_image_size(v)
        except ImageSizeError as e:
            reasons[i] = f"unreadable: {e.reason}"
        except Exception as e:  # noqa: BLE001 - nothing may raise mid-map; record the reason instead
            reasons[i] = f"unreadable: {type(e).__name__}: {e}"[:200]
    return w, h, reasons


class _ArrowImage:
    """An encoded image held in an Arrow buffer (zero-copy), with the path it came from for error messages."""

    __slots__ = ("buffer", "path")

    def __init__(self, buffer: pa.Buffer, path: str | None) -> None:
        self.buffer = buffer
        self.path = path

    def size(self) -> tuple[int, int]:
        source = f"<bytes: {self.buffer.size}>" + (f" ({self.path!r})" if self.path else "")
        if self.buffer.size == 0:
            raise ImageSizeError(source, "empty (0 bytes)")
        return _size_of_open(pa.BufferReader(self.buffer), source)


def _arrow_values(column: pa.ChunkedArray | pa.Array) -> list[Any]:
    """Image values of one Arrow column without copying encoded bytes into Python objects.

    ``Image`` storage (``struct<bytes, path>``) gives an :class:`_ArrowImage` where bytes are present, else the
    path; a string column gives paths; a binary column gives buffers; null gives None. Shape: one per row.
    """
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    out: list[Any] = []
    for chunk in chunks:
        t = chunk.type
        if pa.types.is_struct(t):
            fields = dict(zip([f.name for f in t], chunk.flatten()))  # offsets and parent nulls applied
            data, paths = fields.get("bytes"), fields.get("path")
            path_list = paths.to_pylist() if paths is not None else [None] * len(chunk)
            has_bytes = data.is_valid().to_numpy(zero_copy_only=False) if data is not None else np.zeros(len(chunk), bool)
            valid = chunk.is_valid().to_numpy(zero_copy_only=False)
            for i in range(len(chunk)):
                if not valid[i]:
                    out.append(None)
                elif has_bytes[i]:
                    out.append(_ArrowImage(data[i].as_buffer(), path_list[i]))
                else:
                    out.append({"bytes": None, "path": path_list[i]})
        elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
            valid = chunk.is_valid().to_numpy(zero_copy_only=False)
            out.extend(_ArrowImage(chunk[i].as_buffer(), None) if valid[i] else None for i in range(len(chunk)))
        else:
            out.extend(chunk.to_pylist())  # paths (strings) or anything read_image_size accepts
    return out


def _image_batch(values: Any, *, config: str, max_upscale: float | None, min_size: int | None,
                 as_dict: bool) -> Any:
    """``map`` function for the image path: header sizes → bucket columns for one batch.

    ``values`` is a Python list (streaming) or an Arrow column (map-style, read zero-copy).
    """
    if isinstance(values, (pa.ChunkedArray, pa.Array)):  # map-style: the engines' Arrow-batch function
        from .arrow_batch import bucket_columns

        table = bucket_columns(pa.table({"image": values}), _buckets_from_json(config), image_column="image",
                               max_upscale=max_upscale, min_size=min_size)
        return table.to_pydict() if as_dict else table
    w, h, reasons = _sizes_of(values)
    table = annotate_sizes(w, h, _buckets_from_json(config), reasons=reasons, max_upscale=max_upscale, min_size=min_size)
    return table.to_pydict() if as_dict else table


def _size_batch(widths: list[Any], heights: list[Any], *, config: str, max_upscale: float | None,
                min_size: int | None, as_dict: bool) -> Any:
    """``map`` function for the metadata path (streaming): width/height values → bucket columns."""
    from .arrow_batch import bucket_columns

    table = bucket_columns(pa.table({"w": _none_to_nan(widths), "h": _none_to_nan(heights)}), _buckets_from_json(config),
                           width_column="w", height_column="h", max_upscale=max_upscale, min_size=min_size)
    return table.to_pydict() if as_dict else table


def _none_to_nan(values: Any) -> Any:
    if isinstance(values, (pa.Array, pa.ChunkedArray, np.ndarray)):
        return values
    return pa.array(values)  # nulls stay nulls; _float_array turns them into NaN


def add_bucket_columns(
    ds: Any,
    buckets: BucketSet,
    image_column: str | None = "image",
    width_column: str | None = None,
    height_column: str | None = None,
    num_proc: int | None = None,
    batch_size: int = 1000,
    *,
    max_upscale: float | None = None,
    min_size: int | None = None,
    desc: str | None = None,
    show_summary: bool = True,
    load_from_cache_file: bool | None = None,
) -> Any:
    """Add the bucket columns to an image dataset, reading only image headers (or no images at all).

    Args:
        ds: a ``datasets.Dataset``, ``IterableDataset``, ``DatasetDict`` or ``IterableDatasetDict``.
        buckets: the :class:`~hf_arb.BucketSet` to assign to (its metric and thresholds apply).
        image_column: the image column: an ``Image`` feature (read internally with ``Image(decode=False)``; the
            returned dataset still decodes it) or a column of file paths / encoded bytes. May be ``None`` when
            ``width_column`` and ``height_column`` are given.
        width_column, height_column: metadata columns with the *displayed* size (e.g. LAION's ``WIDTH``/``HEIGHT``).
            When given, no image is opened: the whole column is assigned in one vectorised pass.
        num_proc: worker processes for ``Dataset.map`` on the image path (ignored for streaming and for the
            metadata path, which is already vectorised). Results are identical for any ``num_proc``.
        batch_size: rows per ``map`` batch.
        max_upscale: skip (``skip_reason="upscale"``) images that need more than this upscale factor to cover
            their bucket, e.g. ``2.0``.
        min_size: skip (``"too_small"``) images whose shorter side is below this many pixels.
        desc: progress-bar text (default ``"Reading image sizes"``).
        show_summary: print a NovelAI-style summary when done (map-style datasets only; a streaming dataset is
            lazy — call :func:`summarize_annotation` after iterating if you want one).
        load_from_cache_file: passed to ``Dataset.map``.

    Returns:
        The same kind of object as ``ds`` with :data:`BUCKET_COLUMNS` appended (existing bucket columns are
        replaced): ``bucket`` (int32, ``-1`` = skipped), ``bucket_width``, ``bucket_height``, ``original_width``,
        ``original_height`` (int32; the displayed size), ``aspect_error`` (float32), ``skip_reason`` (string, null
        when kept; ``"unreadable: <reason>"``, ``"missing"``, ``"invalid_size"``, ``"aspect"``, ``"too_small"``,
        ``"upscale"``). No row is removed and nothing raises mid-map. The ``bucket`` feature carries the BucketSet,
        so ``BucketSet.from_dataset(result)`` restores it.

    Example:
        ```py
        >>> from datasets import load_dataset
        >>> from hf_arb import BucketSet, add_bucket_columns
        >>> ds = load_dataset("imagefolder", data_dir="my_images", split="train")
        >>> ds = add_bucket_columns(ds, BucketSet.sdxl(), num_proc=4)
        >>> ds[0]["bucket_width"], ds[0]["bucket_height"]
        (832, 1216)
        ```
    """
    import datasets

    if not isinstance(buckets, BucketSet):
        raise TypeError(f"`buckets` must be a hf_arb.BucketSet, got {type(buckets).__name__}. "
                        "Build one with BucketSet.sdxl(), BucketSet.novelai() or BucketSet.from_budget(...).")
    if (width_column is None) != (height_column is None):
        raise ValueError(f"Pass both `width_column` and `height_column` or neither, got width_column={width_column!r}, "
                         f"height_column={height_column!r}.")
    if width_column is None and image_column is None:
        raise ValueError("Nothing to read sizes from: `image_column` is None and no `width_column`/`height_column` given.")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}.")
    kwargs = dict(image_column=image_column, width_column=width_column, height_column=height_column, num_proc=num_proc,
                  batch_size=batch_size, max_upscale=max_upscale, min_size=min_size, desc=desc,
                  show_summary=show_summary, load_from_cache_file=load_from_cache_file)
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return type(ds)({split: add_bucket_columns(d, buckets, **kwargs) for split, d in ds.items()})  # type: ignore[arg-type]
    if isinstance(ds, datasets.IterableDataset):
        return _annotate_iterable(ds, buckets, **kwargs)
    if isinstance(ds, datasets.Dataset):
        return _annotate_dataset(ds, buckets, **kwargs)
    raise TypeError(f"`ds` must be a datasets Dataset, IterableDataset or their Dict, got {type(ds).__name__}.")


def _check_columns(names: Sequence[str] | None, wanted: Sequence[str | None]) -> None:
    if names is None:
        return  # streaming dataset with unknown features: checked on first batch by datasets
    for c in wanted:
        if c is not None and c not in names:
            raise ValueError(f"Column {c!r} is not in the dataset; its columns are {list(names)}. "
                             "Pass the right name with image_column=..., width_column=..., height_column=...")


def _fingerprint(*parts: Any) -> str:
    from datasets.fingerprint import Hasher

    return Hasher.hash(["hf_arb.add_bucket_columns", *parts])


def _annotate_dataset(ds: Any, buckets: BucketSet, *, image_column: str | None, width_column: str | None,
                      height_column: str | None, num_proc: int | None, batch_size: int, max_upscale: float | None,
                      min_size: int | None, desc: str | None, show_summary: bool,
                      load_from_cache_file: bool | None) -> Any:
    import datasets

    base = ds.remove_columns([c for c in BUCKET_COLUMNS if c in ds.column_names])
    features = bucket_features(buckets)
    if width_column is not None:
        _check_columns(base.column_names, (width_column, height_column))
        cols = base.select_columns([width_column, height_column]).with_format("arrow")[:]  # pa.Table, indices applied
        from .arrow_batch import bucket_columns

        table = bucket_columns(cols, buckets, width_column=width_column, height_column=height_column,
                               max_upscale=max_upscale, min_size=min_size)
        fp = _fingerprint(base._fingerprint, buckets.fingerprint, width_column, height_column, max_upscale, min_size)
        new = datasets.Dataset(table.cast(features.arrow_schema), info=datasets.DatasetInfo(features=features),
                               fingerprint=fp)
    else:
        _check_columns(base.column_names, (image_column,))
        src = base.select_columns([image_column])
        if isinstance(src.features[image_column], datasets.Image):
            src = src.cast_column(image_column, datasets.Image(decode=False))
        new = src.with_format("arrow").map(
            _image_batch, batched=True, batch_size=batch_size, num_proc=num_proc, input_columns=[image_column],
            remove_columns=[image_column], features=features, desc=desc or "Reading image sizes",
            fn_kwargs=dict(config=buckets.to_json(), max_upscale=max_upscale, min_size=min_size, as_dict=False),
            load_from_cache_file=load_from_cache_file,
        ).with_format(None)
    out = datasets.concatenate_datasets([base, new], axis=1)
    if show_summary:
        print((f"== {out.split} ==\n" if out.split is not None else "") + str(summarize_annotation(out, buckets)))
    return out


def _annotate_iterable(ds: Any, buckets: BucketSet, *, image_column: str | None, width_column: str | None,
                       height_column: str | None, num_proc: int | None, batch_size: int, max_upscale: float | None,
                       min_size: int | None, desc: str | None, show_summary: bool,
                       load_from_cache_file: bool | None) -> Any:
    import datasets

    names = ds.column_names
    existing = [c for c in BUCKET_COLUMNS if names is not None and c in names]
    base = ds.remove_columns(existing) if existing else ds
    features = None
    if base.features is not None:
        features = datasets.Features({**base.features, **bucket_features(buckets)})
    fn_kwargs = dict(config=buckets.to_json(), max_upscale=max_upscale, min_size=min_size, as_dict=True)
    if width_column is not None:
        _check_columns(names, (width_column, height_column))
        out = base.map(_size_batch, batched=True, batch_size=batch_size, input_columns=[width_column, height_column],
                       fn_kwargs=fn_kwargs)
    else:
        _check_columns(names, (image_column,))
        decoding_image = base.features is not None and isinstance(base.features.get(image_column), datasets.Image)
        src = base.cast_column(image_column, datasets.Image(decode=False)) if decoding_image else base
        # No `features=` here: a typed map output would skip decoding later; the final cast below restores
        # the original image feature (so it decodes again) and types the new columns.
        out = src.map(_image_batch, batched=True, batch_size=batch_size, input_columns=[image_column],
                      fn_kwargs=fn_kwargs)
    return out.cast(features) if features is not None else out


# ----------------------------------------------------------------------------------- summary
@dataclass(frozen=True)
class AnnotationSummary:
    """What :func:`add_bucket_columns` did, in the shape of NovelAI's printout.

    Attributes:
        rows: rows in the dataset.
        skipped_by_reason: skipped rows per reason category (the part of ``skip_reason`` before ``":"``).
        assignment: the :class:`~hf_arb.AssignmentSummary` (rows per bucket, aspect error over kept rows).
        unreadable_examples: up to 5 distinct full ``"unreadable: …"`` reasons, to show what went wrong.
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
        if cat == "unreadable" and len(examples) < 5:
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
        _check_columns(ds.column_names, cols)
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
