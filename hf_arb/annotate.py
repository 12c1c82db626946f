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
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .buckets import BucketSet
from .annotation_summary import AnnotationSummary, summarize_annotation, summarize_columns  # noqa: F401  (re-exported)
from .image_values import arrow_values, decoding_images, sizes_of  # noqa: F401  (decoding_images re-exported)
from .schema import BUCKET_COLUMNS, CONFIG_ID_PREFIX, arrow_schema, bucket_features  # noqa: F401  (re-exported)

# skip_reason codes of the vectorised core (0 = kept). Order = priority: the first that applies wins.
_REASONS: tuple[str | None, ...] = (None, "missing", "invalid_size", "aspect", "too_small", "upscale")
_MISSING, _INVALID, _ASPECT, _TOO_SMALL, _UPSCALE = 1, 2, 3, 4, 5
_INT32_MAX = 2**31 - 1


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
    unknown = np.isnan(w) | np.isnan(h)  # (n,) null / NaN: missing; ±inf is an invalid size
    code[unknown & ~has_pre] = _MISSING
    with np.errstate(invalid="ignore"):
        rw, rh = np.rint(w), np.rint(h)  # (n,) what the int32 original_* columns would hold
        # >= 1 pixel and representable in int32 (a 2**31 width would wrap to -2147483648)
        good = finite & (rw >= 1) & (rh >= 1) & (rw <= _INT32_MAX) & (rh <= _INT32_MAX) & ~has_pre  # (n,)
    code[~unknown & ~good & ~has_pre] = _INVALID

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
    ow = np.where(good, rw, 0).astype(np.int32)
    oh = np.where(good, rh, 0).astype(np.int32)
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


def _size_column(values: Any, column: str) -> np.ndarray:
    """A width or height metadata column → float64 array of shape (n,), NaN for null; names ``column`` on bad input.

    Numeric columns (any int/float/decimal width) are taken as they are: out-of-range values become
    ``invalid_size`` rows later. A string column is parsed when every value is a number (``"512"``, ``"512.0"``);
    otherwise, and for any other type, the error names the column, the row and the first value that is not a number.
    """
    if not isinstance(values, (pa.Array, pa.ChunkedArray)):
        try:
            values = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            values = pa.array([None if v is None else str(v) for v in values], pa.string())
    t = values.type
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_null(t):
        return pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        try:
            return pc.cast(pc.utf8_trim_whitespace(values), pa.float64()).to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    for i, v in enumerate(values.to_pylist()):  # error path only: find the first offender
        if v is None:
            continue
        try:
            float(v)
        except (TypeError, ValueError):
            raise ValueError(
                f"Size column {column!r} must hold numbers (pixels), but row {i} holds {v!r} ({t}). Clean or cast the "
                f"column (e.g. ds.map to turn bad values into None, which become skip_reason 'missing'), or annotate "
                f"from the images with image_column=... instead."
            ) from None
    raise ValueError(f"Size column {column!r} must be numeric (pixels), got type {t}. Cast it to an integer type.")


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


def _image_batch(values: Any, *, config: str, max_upscale: float | None, min_size: int | None,
                 as_dict: bool, verify: bool = False) -> Any:
    """``map`` function for the image path: header sizes → bucket columns for one batch.

    ``values`` is a Python list (streaming) or an Arrow column (map-style, read zero-copy).
    """
    if isinstance(values, (pa.ChunkedArray, pa.Array)):
        values = arrow_values(values)
    w, h, reasons = sizes_of(values, verify)
    table = annotate_sizes(w, h, _buckets_from_json(config), reasons=reasons, max_upscale=max_upscale, min_size=min_size)
    return table.to_pydict() if as_dict else table


def _size_batch(widths: list[Any], heights: list[Any], *, config: str, max_upscale: float | None,
                min_size: int | None, as_dict: bool, columns: tuple[str, str] = ("width", "height")) -> Any:
    """``map`` function for the metadata path (streaming): width/height values → bucket columns."""
    table = annotate_sizes(_size_column(widths, columns[0]), _size_column(heights, columns[1]),
                           _buckets_from_json(config), max_upscale=max_upscale, min_size=min_size)
    return table.to_pydict() if as_dict else table


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
    verify: bool = False,
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
            lazy — call :func:`summarize_annotation` after iterating if you want one). An annotated stream yields its
            ``Image`` columns undecoded (``{"bytes", "path"}``), so a broken image cannot end the iteration;
            :class:`~hf_arb.BucketedImageDataset` and :func:`~hf_arb.fit_to_bucket` take such values directly.
        load_from_cache_file: passed to ``Dataset.map``.
        verify: also decode every image whose header reads (in the same parallel ``map``; JPEGs at 1/8 scale), and
            skip those whose body is broken with ``skip_reason`` ``"truncated: …"`` (an interrupted download) or
            ``"undecodable: …"``. Costs a decode per image (see docs/benchmarks.md); without it such rows are kept
            and training replaces them (``--on_bad_image``). Ignored on the metadata path (no image is opened).

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
                  batch_size=batch_size, max_upscale=max_upscale, min_size=min_size, desc=desc, verify=verify,
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
                      load_from_cache_file: bool | None, verify: bool = False) -> Any:
    import datasets

    base = ds.remove_columns([c for c in BUCKET_COLUMNS if c in ds.column_names])
    features = bucket_features(buckets)
    if width_column is not None:
        _check_columns(base.column_names, (width_column, height_column))
        cols = base.select_columns([width_column, height_column]).with_format("arrow")[:]  # pa.Table, indices applied
        table = annotate_sizes(_size_column(cols.column(0), width_column), _size_column(cols.column(1), height_column),
                               buckets, max_upscale=max_upscale, min_size=min_size)
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
            fn_kwargs=dict(config=buckets.to_json(), max_upscale=max_upscale, min_size=min_size, as_dict=False,
                           verify=verify),
            load_from_cache_file=load_from_cache_file,
        ).with_format(None)
    out = datasets.concatenate_datasets([base, new], axis=1)
    if show_summary:
        print((f"== {out.split} ==\n" if out.split is not None else "") + str(summarize_annotation(out, buckets)))
    return out


def _annotate_iterable(ds: Any, buckets: BucketSet, *, image_column: str | None, width_column: str | None,
                       height_column: str | None, num_proc: int | None, batch_size: int, max_upscale: float | None,
                       min_size: int | None, desc: str | None, show_summary: bool,
                       load_from_cache_file: bool | None, verify: bool = False) -> Any:
    import datasets

    names = ds.column_names
    existing = [c for c in BUCKET_COLUMNS if names is not None and c in names]
    base = ds.remove_columns(existing) if existing else ds
    features = None
    if base.features is not None:
        # Image columns stay encoded ({"bytes", "path"}) in the annotated stream: a broken image (skipped with its
        # reason) must not end the iteration, which decoding on the fly would. The loader decodes what it trains on.
        kept = {k: datasets.Image(decode=False) if isinstance(v, datasets.Image) else v for k, v in base.features.items()}
        features = datasets.Features({**kept, **bucket_features(buckets)})
    fn_kwargs = dict(config=buckets.to_json(), max_upscale=max_upscale, min_size=min_size, as_dict=True)
    image_kwargs = {**fn_kwargs, "verify": verify}
    if width_column is not None:
        _check_columns(names, (width_column, height_column))
        out = base.map(_size_batch, batched=True, batch_size=batch_size, input_columns=[width_column, height_column],
                       fn_kwargs={**fn_kwargs, "columns": (width_column, height_column)})
    else:
        _check_columns(names, (image_column,))
        decoding_image = base.features is not None and isinstance(base.features.get(image_column), datasets.Image)
        src = base.cast_column(image_column, datasets.Image(decode=False)) if decoding_image else base
        # The final cast below types the new columns (and keeps the image column undecoded).
        out = src.map(_image_batch, batched=True, batch_size=batch_size, input_columns=[image_column],
                      fn_kwargs=image_kwargs)
    return out.cast(features) if features is not None else out
