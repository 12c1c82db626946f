"""A bucket table fitted to a dataset's sizes: :func:`fit_table`, behind :meth:`hf_arb.BucketSet.fit`.

The problem. An image of aspect ``r = w/h`` trained in a bucket of aspect ``q`` (scaled to cover it, the excess cut
off) loses the share ``1 - min(r, q) / max(r, q) = 1 - exp(-|log r - log q|)`` of its area. With the ``"log"``
metric every image goes to the bucket nearest in log aspect, which is also the bucket that crops it least. So a
bucket table of ``K`` shapes is a set of ``K`` points on the log-aspect line, and the mean crop is a 1-D
``K``-median problem with the cost ``1 - exp(-|x - a|)``.

The method, vectorised:

1. **Candidates.** Every ``step``-aligned shape near the pixel budget: both sides multiples of ``step`` in
   ``[min_side, max_side]``, area in ``[min_area_ratio × max_pixels, max_pixels]`` (at least each width's largest
   height); one shape per :data:`CANDIDATE_SPACING` of log aspect (the larger area).
2. **Histogram.** The data's log aspects in bins of ``bin_width`` (one ``bincount`` each for the row count,
   ``Σ exp(x)`` and ``Σ exp(-x)``, plus the exact minimum and maximum per bin). The cost of serving any run of bins
   from one bucket is then two prefix-sum lookups: ``Σ (1 - exp(x - a)) = n - exp(-a) Σ exp(x)`` left of ``a``,
   ``n - exp(a) Σ exp(-x)`` right of it.
3. **Exact selection.** In 1-D the nearest-bucket cells are contiguous, so the best ``K`` of the ``C`` candidates is
   a dynamic program over (buckets used, last bucket): ``K`` steps of a ``(C, C)`` min-plus product. It is exact on
   the histogram (no greedy or local-search error), deterministic (ties: the lower-aspect candidate), and the worst
   crop bound enters as infinite cost for any cell whose farthest row is more than ``-log(1 - max_crop)`` from its
   bucket (using the bins' exact extreme rows).
4. **Verification.** The result is assigned to the real sizes (one vectorised pass) and the worst crop checked
   against ``max_crop``; buckets that receive no row are dropped.

Cost: three ``bincount`` passes and one assignment over the ``n`` sizes, plus ``O(K C²)`` on the candidates
(``C`` is about 50 at ``step=64`` and 1024², a few hundred at ``step=8``). docs/benchmarks.md has the time at 10⁷
sizes (benchmarks/bench_fit.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .assignment import as_size_array

#: default histogram bin width in log aspect (0.2 % of aspect): the objective's resolution
BIN_WIDTH = 0.002
_MAX_BINS = 1 << 16
_MAX_CANDIDATES = 1 << 22
#: candidates closer than this in log aspect count as one (the one with the larger area is kept)
CANDIDATE_SPACING = 0.004
#: keyword arguments of :func:`fit_table` that :meth:`hf_arb.BucketSet.fit` passes through
FIT_PARAMS = ("min_side", "max_side", "min_area_ratio", "bin_width")


@dataclass(frozen=True)
class FitResult:
    """What :func:`fit_table` chose and what it costs on the sizes it was fitted to.

    Attributes:
        table: ``(k, 2)`` int64 ``(width, height)``, portrait → landscape.
        mean_crop: mean share of area cropped over the sizes (exact, from the real sizes).
        worst_crop: the largest share cropped.
        candidates: how many step-aligned shapes were considered.
        fewer: why the table has fewer than the ``n_buckets`` asked for (too few candidate shapes, more buckets
            would not lower the mean crop, or chosen shapes got no row), one sentence; empty when it has them all.
    """

    table: np.ndarray
    mean_crop: float
    worst_crop: float
    candidates: int
    fewer: str = ""


def split_sizes(sizes: Any) -> tuple[np.ndarray, np.ndarray]:
    """Sizes → two validated ``(n,)`` arrays (widths, heights). Accepted: ``(n, 2)`` (width, height) rows (an array or
    a list of pairs), a ``(widths, heights)`` tuple of two arrays, or an annotated ``datasets.Dataset`` (the
    ``original_width``/``original_height`` of its kept rows: those with a bucket)."""
    if hasattr(sizes, "column_names"):  # a datasets.Dataset
        import pyarrow.compute as pc

        cols = ["original_width", "original_height"]
        if not set(cols) <= set(sizes.column_names or ()):
            raise ValueError("A dataset passed as `sizes` must be annotated (original_width/original_height columns): "
                             "annotate it with hf_arb.add_bucket_columns first, or pass its sizes as (n, 2) rows.")
        keep = ["bucket"] if "bucket" in sizes.column_names else []
        t = sizes.select_columns(cols + keep).with_format("arrow")[:]
        w, h = (pc.fill_null(t.column(c), 0).to_numpy().astype(np.int64) for c in cols)
        ok = (w > 0) & (h > 0)  # rows without a (valid) size are null
        if keep:  # and rows skipped at annotation (skip_reason) do not train: fit what will
            ok &= pc.fill_null(t.column("bucket"), -1).to_numpy() >= 0
        w, h = w[ok], h[ok]
    elif isinstance(sizes, tuple) and len(sizes) == 2 and not all(
            isinstance(x, (tuple, list)) and len(x) == 2 for x in sizes):  # two pairs read as rows
        w, h = sizes
    else:
        arr = np.asarray(sizes)
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise ValueError(f"`sizes` must be (width, height) rows of shape (n, 2) or a (widths, heights) tuple, "
                             f"got an array of shape {arr.shape}.")
        w, h = arr[:, 0], arr[:, 1]
    w, h = as_size_array(w, "widths"), as_size_array(h, "heights")
    if w.shape != h.shape:
        raise ValueError(f"`widths` and `heights` must have the same length, got {w.shape[0]} and {h.shape[0]}.")
    if w.size == 0:
        raise ValueError("`sizes` is empty: fitting buckets needs at least one (width, height).")
    return w, h


def candidate_shapes(step: int, max_pixels: int, min_side: int, max_side: int, min_area_ratio: float = 0.75,
                     resolution: float = CANDIDATE_SPACING) -> np.ndarray:
    """The step-aligned shapes with both sides in ``[min_side, max_side]`` and an area in
    ``[min_area_ratio × max_pixels, max_pixels]`` (at least the largest height of each width), at most one per
    ``resolution`` of log aspect (the larger area, then the nearer the cell's middle): ``(C, 2)`` sorted by aspect."""
    widths = np.arange(-(-min_side // step) * step, max_side + 1, step, dtype=np.int64)  # (m,)
    top = np.minimum(max_side // step * step, (max_pixels // np.maximum(widths, 1)) // step * step)  # (m,)
    floor_h = np.maximum(-(-min_side // step) * step,
                         -(-np.ceil(min_area_ratio * max_pixels / widths).astype(np.int64) // step) * step)  # (m,)
    low = np.minimum(floor_h, top)  # (m,) at least the largest height
    span = np.maximum(top - low, -step) // step + 1  # (m,) heights per width
    ok = (top >= min_side) & (span > 0)
    widths, top, span = widths[ok], top[ok], span[ok]
    if widths.size == 0:
        raise ValueError(f"No {step}-pixel-aligned shape has both sides in [min_side={min_side}, max_side={max_side}] "
                         f"within max_pixels={max_pixels}. Raise `max_pixels` or `max_side`, or lower `min_side`.")
    if int(span.sum()) > _MAX_CANDIDATES:
        raise ValueError(f"{int(span.sum()):,} candidate shapes at step {step} for max_pixels={max_pixels:,}: too many "
                         f"to choose from (at most {_MAX_CANDIDATES:,}). Use a larger `step` (max_pixels is a pixel "
                         f"count: 1024 * 1024 for about 1 MP), or a narrower `min_side`/`max_side`.")
    w = np.repeat(widths, span)  # (c,)
    first = np.repeat(np.cumsum(span) - span, span)
    h = np.repeat(top, span) - step * (np.arange(w.size) - first)  # (c,) heights from the top down
    x = np.log(w / h)
    cell = np.floor(x / resolution).astype(np.int64)  # (c,)
    off = np.abs(x - (cell + 0.5) * resolution)
    order = np.lexsort((off, -(w * h), cell))  # per cell: larger area, then nearer the middle
    keep = order[np.concatenate([[True], np.diff(cell[order]) > 0])]
    cand = np.stack([w[keep], h[keep]], 1)
    return cand[np.argsort(cand[:, 0] / cand[:, 1], kind="stable")]


def fit_table(widths: Any, heights: Any, n_buckets: int, *, step: int = 64, max_pixels: int = 1024 * 1024,
              max_crop: float | None = None, min_side: int | None = None, max_side: int | None = None,
              min_area_ratio: float = 0.75, bin_width: float = BIN_WIDTH) -> FitResult:
    """The ``n_buckets`` step-aligned shapes at the pixel budget that minimise the mean crop of the given sizes.

    Args:
        widths, heights: displayed sizes, shape ``(n,)`` each.
        n_buckets: most buckets to use (fewer when fewer candidates exist or some would get no row).
        step: every side is a multiple of this (the model family's: 8 for SD's VAE, 16 for SD3/Flux's VAE × patch,
            64 by convention for SDXL).
        max_pixels: pixel budget per bucket (``resolution²``).
        max_crop: largest share of an image's area any row may lose, in ``[0, 1)``; ``None``: no bound.
        min_side, max_side: side limits; default half and twice ``sqrt(max_pixels)`` (aspects 1:4 … 4:1, the
            SDXL table's range), aligned to ``step``.
        min_area_ratio: candidates use at least this share of ``max_pixels`` (as the ``budget`` preset), or the
            largest height their width allows.
        bin_width: histogram bin width in log aspect.

    Example:
        ```py
        >>> from hf_arb import BucketSet
        >>> sizes = [(4000, 3000)] * 6 + [(3000, 4000)] * 3 + [(1080, 1920)]
        >>> BucketSet.fit(sizes, 3).labels()   # 4:3, 3:4 and 9:16 at about 1024² pixels
        ['768x1344', '768x1024', '1024x768']
        ```

    Raises:
        ValueError: bad parameters, or a ``max_crop`` no table of ``n_buckets`` candidates meets; the message says
            how many buckets would meet it, or which limit keeps the extreme rows out of reach.
    """
    w, h = as_size_array(widths, "widths"), as_size_array(heights, "heights")
    if w.shape != h.shape:
        raise ValueError(f"`widths` and `heights` must have the same length, got {w.shape[0]} and {h.shape[0]}.")
    if w.size == 0:
        raise ValueError("No sizes to fit buckets to: `sizes` is empty.")
    for name, v in (("n_buckets", n_buckets), ("step", step), ("max_pixels", max_pixels)):
        if isinstance(v, bool) or int(v) != v or v < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {v!r}.")
    if max_crop is not None and not (0 <= max_crop < 1):
        raise ValueError(f"`max_crop` must be a share of the area in [0, 1) (e.g. 0.2 = at most 20% cut off), "
                         f"got {max_crop!r}.")
    if not (bin_width > 0):
        raise ValueError(f"`bin_width` must be > 0, got {bin_width!r}.")
    side = math.isqrt(int(max_pixels))
    if step > side:
        raise ValueError(f"`step` ({step}) exceeds sqrt(max_pixels) ({side}): no square bucket fits the budget. "
                         f"Lower `step` or raise `max_pixels`.")
    min_side = max(step, (side // 2) // step * step) if min_side is None else int(min_side)
    max_side = (2 * side) // step * step if max_side is None else int(max_side)
    if not (0 < min_area_ratio <= 1):
        raise ValueError(f"`min_area_ratio` must be in (0, 1], got {min_area_ratio!r}.")
    cand = candidate_shapes(int(step), int(max_pixels), min_side, max_side, min_area_ratio)  # (C, 2)
    a = np.log(cand[:, 0] / cand[:, 1])  # (C,) increasing

    x = np.log(np.divide(w, h, dtype=np.float64))  # (n,)
    lo, hi = float(x.min()), float(x.max())
    nb = int(min(_MAX_BINS, max(1, math.ceil((hi - lo) / bin_width))))
    bw = max((hi - lo) / nb, 1e-12)
    idx = np.minimum(((x - lo) / bw).astype(np.int64), nb - 1)  # (n,)
    cnt = np.bincount(idx, minlength=nb).astype(np.float64)  # (nb,)
    ex = np.exp(x)
    sp = np.bincount(idx, weights=ex, minlength=nb)  # (nb,) Σ exp(x)
    sm = np.bincount(idx, weights=np.reciprocal(ex, out=ex), minlength=nb)  # (nb,) Σ exp(-x)
    bmin = np.full(nb, np.inf)
    bmax = np.full(nb, -np.inf)
    np.minimum.at(bmin, idx, x)
    np.maximum.at(bmax, idx, x)
    del ex, idx
    centers = lo + (np.arange(nb) + 0.5) * bw  # (nb,) increasing; a non-empty bin's: the middle of its rows
    centers[cnt > 0] = (bmin[cnt > 0] + bmax[cnt > 0]) / 2

    N, P, M = (np.concatenate([[0.0], np.cumsum(v)]) for v in (cnt, sp, sm))  # (nb + 1,) prefix sums
    nz = cnt > 0
    ar = np.arange(nb)
    last_nz = np.maximum.accumulate(np.where(nz, ar, -1))  # (nb,) last non-empty bin <= i
    last_before = np.concatenate([[-1], last_nz])  # (nb + 1,) last non-empty bin < i
    first_nz = np.minimum.accumulate(np.where(nz, ar, nb)[::-1])[::-1]  # (nb,) first non-empty bin >= i
    first_from = np.concatenate([first_nz, [nb]])  # (nb + 1,)
    d = math.inf if max_crop is None else -math.log1p(-max_crop) + 1e-12

    C = a.size
    pos = np.searchsorted(centers, a)  # (C,) bins left of each candidate
    ea, ena = np.exp(a), np.exp(-a)

    def left_cost(c: np.ndarray, i0: np.ndarray, i1: np.ndarray) -> np.ndarray:
        return (N[i1] - N[i0]) - ena[c] * (P[i1] - P[i0])

    def right_cost(c: np.ndarray, i0: np.ndarray, i1: np.ndarray) -> np.ndarray:
        return (N[i1] - N[i0]) - ea[c] * (M[i1] - M[i0])

    cs = np.arange(C)
    zero = np.zeros(C, np.int64)
    start = left_cost(cs, zero, pos)  # (C,) the first bucket serves every bin left of it
    f0 = first_from[0]
    start[(f0 < pos) & (a - bmin[min(f0, nb - 1)] > d)] = np.inf
    end = right_cost(cs, pos, np.full(C, nb))  # (C,) the last bucket serves every bin right of it
    l0 = last_nz[-1]
    end[(l0 >= pos) & (bmax[max(l0, 0)] - a > d)] = np.inf

    c1, c2 = np.meshgrid(cs, cs, indexing="ij")  # (C, C)
    s = np.searchsorted(centers, (a[c1] + a[c2]) / 2)  # (C, C) first bin served by c2
    s = np.clip(s, pos[c1], pos[c2])
    pair = right_cost(c1, pos[c1], s) + left_cost(c2, s, pos[c2])  # (C, C) bins between c1 and c2
    j1 = last_before[s]  # farthest row served by c1 on its right
    j2 = first_from[s]  # farthest row served by c2 on its left
    bad = (j1 >= pos[c1]) & (bmax[np.clip(j1, 0, nb - 1)] - a[c1] > d)
    bad |= (j2 < pos[c2]) & (a[c2] - bmin[np.clip(j2, 0, nb - 1)] > d)
    pair[bad | (c1 >= c2)] = np.inf

    k_max = min(int(n_buckets), C)
    fs, back = [start], []  # fs[k-1]: best cost of k buckets ending at each candidate (before the right end)
    total = [float(np.min(start + end))]
    while len(fs) < C and (len(fs) < k_max or (max_crop is not None and not math.isfinite(min(total)))):
        g = fs[-1][:, None] + pair  # (C, C)
        arg = np.argmin(g, axis=0)  # (C,) best previous bucket; ties: the lower aspect
        fs.append(g[arg, cs])
        back.append(arg)
        total.append(float(np.min(fs[-1] + end)))
    best_k = int(np.argmin(total[:k_max])) + 1  # ties: fewer buckets
    if not math.isfinite(total[best_k - 1]):
        feasible = [k + 1 for k, t in enumerate(total) if math.isfinite(t)]
        if feasible:
            need = f"{feasible[0]} buckets meet it: pass n_buckets={feasible[0]} or a larger `max_crop`"
        else:
            need = (f"even all {C} candidate shapes ({cand[0, 0]}x{cand[0, 1]} to {cand[-1, 0]}x{cand[-1, 1]}) leave "
                    f"rows farther than that from every bucket (sizes from {math.exp(lo):.3f} to {math.exp(hi):.3f} "
                    "w/h): use a smaller `step`, widen `min_side`/`max_side`, raise `max_crop`, or leave the extreme "
                    "rows out (`aspect_range`)")
        raise ValueError(f"max_crop={max_crop} cannot be met with n_buckets={n_buckets} buckets of step {step} at "
                         f"max_pixels={max_pixels}; {need}.")
    last = int(np.argmin(fs[best_k - 1] + end))
    chosen = [last]
    for k in range(best_k - 1, 0, -1):  # back[k - 1] leads from k + 1 buckets to k
        last = int(back[k - 1][last])
        chosen.append(last)
    table = cand[sorted(chosen)]

    # verify on the real sizes, drop buckets without rows
    ta = np.log(table[:, 0] / table[:, 1])  # (k,)
    mids = (ta[:-1] + ta[1:]) / 2
    slot = np.searchsorted(mids, x)  # (n,) nearest bucket in log aspect
    used = np.bincount(slot, minlength=ta.size) > 0
    crop = -np.expm1(-np.abs(x - ta[slot]))  # (n,)
    worst = float(crop.max())
    if max_crop is not None and worst > max_crop + 1e-9:  # pragma: no cover - the program's bound is conservative
        raise AssertionError(f"fit_table broke its own worst-crop bound: {worst} > {max_crop}")
    fewer = fewer_reason(x, n_buckets, best_k, int(used.sum()), C, f"step {step}, max_pixels={max_pixels}, sides "
                         f"{min_side} to {max_side}")
    return FitResult(table=table[used], mean_crop=float(crop.mean()), worst_crop=worst, candidates=int(C),
                     fewer=fewer)


def fewer_reason(x: np.ndarray, n_buckets: int, chosen: int, used: int, candidates: int, limits: str) -> str:
    """Why a fitted table has fewer than ``n_buckets`` buckets, one sentence (empty when it has them all).

    Args:
        x: the sizes' log aspects, ``(n,)``.
        n_buckets: buckets asked for; chosen: buckets the fit chose; used: those of them that got a row.
        candidates: step-aligned shapes there were to choose from; limits: the shape limits, as words.
    """
    if used >= n_buckets:
        return ""
    why = []
    if candidates < n_buckets:
        why.append(f"only {candidates} step-aligned {'shape fits' if candidates == 1 else 'shapes fit'} ({limits})")
    if chosen < min(n_buckets, candidates):
        aspects = np.unique(np.round(np.exp(x), 3))  # distinct w/h, to the printed precision
        spread = (f"all {x.size:,} sizes have one aspect ratio, {aspects[0]:.3f} w/h" if aspects.size == 1 else
                  f"the {x.size:,} sizes have {aspects.size:,} distinct aspect ratios, {aspects[0]:.3f} to "
                  f"{aspects[-1]:.3f} w/h")
        why.append(f"more buckets would not lower the mean crop ({spread})")
    if used < chosen:
        why.append(f"{chosen - used} of the {chosen} chosen shapes would get no row")
    return f"{used} {'bucket' if used == 1 else 'buckets'}, not {n_buckets}: " + "; ".join(why) + "."


__all__ = ["BIN_WIDTH", "CANDIDATE_SPACING", "FIT_PARAMS", "FitResult", "candidate_shapes", "fewer_reason", "fit_table",
           "split_sizes"]
