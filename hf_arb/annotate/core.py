"""The vectorised core of annotation: displayed sizes → the bucket columns, for a whole batch at once
(:func:`annotate_sizes`), and the validation of width/height metadata columns (:func:`size_column`). Pure numpy /
pyarrow: :mod:`hf_arb.annotate.arrow_batch` (every engine) and :mod:`hf_arb.annotate` (``datasets``) call it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hf_arb.buckets.schema import arrow_schema
from hf_arb.buckets.sets import BucketSet

# skip_reason codes of the vectorised core (0 = kept). Order = priority: the first that applies wins.
_REASONS: tuple[str | None, ...] = (None, "missing", "invalid_size", "aspect", "too_small", "upscale")
_MISSING, _INVALID, _ASPECT, _TOO_SMALL, _UPSCALE = 1, 2, 3, 4, 5
_INT32_MAX = 2**31 - 1


def annotate_sizes(
    widths: Any,
    heights: Any,
    buckets: BucketSet,
    *,
    reasons: Sequence[str | None] | None = None,
    max_upscale: float | None = None,
    min_size: int | None = None,
    frames: Any = None,
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
        frames: a clip set's frames per row, int array of shape ``(n,)`` (the frames each clip holds at its stride;
            1 for an image), matched with :meth:`BucketSet.assign`'s frame axis; None: images.

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
        ids[good], err[good] = buckets.assign(w[good], h[good], None if frames is None else np.asarray(frames)[good])
    code[good & (ids < 0)] = _ASPECT
    open_ = code == 0
    open_ &= good
    if min_size is not None:
        small = open_ & (np.minimum(w, h) < min_size)
        code[small] = _TOO_SMALL
        open_ &= ~small
    res = buckets.resolutions  # (k, 2), or (k, 3) with frames
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


def size_column(values: Any, column: str) -> np.ndarray:
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
