"""Nearest-bucket search, vectorised: the rules behind :meth:`hf_arb.BucketSet.assign`.

Metrics (distance between an image of aspect ``a = w/h`` and a bucket matched at aspect ``m``):

- ``"log"``: ``|log a - log m|`` (default; symmetric for tall and wide images).
- ``"linear"``: ``|a - m|`` (NovelAI, sd-scripts, Flux Kontext, HunyuanDiT's ratio step).
- ``"linear_hw"``: ``|1/a - 1/m|``, i.e. on height / width (PixArt, Sana, OneTrainer).
- ``"cross"``: ``|h*bw - w*bh|`` of diffusers' ``find_nearest_bucket``: integer-exact, ties to the *last* bucket.

For the first three the sorted matching aspects split the aspect line into intervals at the metric's midpoints
(geometric, arithmetic, harmonic mean), and an image's interval is found with a lookup table: one multiply, two
gathers and a compare per image. ``nearest_area`` then picks, among buckets sharing the nearest matching aspect,
the one whose area is closest to the image's (HunyuanDiT). ``"cross"`` is not interval-shaped (its distance is
weighted by the bucket width), so it is a chunked ``(rows, buckets)`` integer argmin.

Clips (a ``(k, 3)`` table of ``(width, height, frames)``, :class:`FrameIndex`): the frame axis first, then the aspect.
A clip of ``N`` frames goes to the largest frame count of the table that is ``<= N`` (one ``searchsorted`` over the
few distinct frame counts), then to the nearest aspect among the buckets of that frame count (one
:class:`AspectIndex` per frame count, the same lookup as for images). A clip shorter than the smallest frame count
matches nothing (``short_clips="skip"``, bucket ``-1``), or the smallest frame count when looping is asked
(``short_clips="loop"``: its frames are repeated to fill the bucket). An image is a 1-frame clip. An image-only
table (``(k, 2)``) never reaches this code: it is one :class:`AspectIndex`, as before.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Metric = Literal["log", "linear", "linear_hw", "cross"]
METRICS: tuple[str, ...] = ("log", "linear", "linear_hw", "cross")
#: what a ``(k, 3)`` BucketSet does with a clip shorter than its smallest frame count: ``"skip"`` it (bucket ``-1``,
#: skip reason :data:`SHORT_CLIP_REASON`) or ``"loop"`` it into the smallest frame count
SHORT_CLIPS: tuple[str, ...] = ("skip", "loop")
#: the skip reason of a clip shorter than the smallest frame bucket (``short_clips="skip"``)
SHORT_CLIP_REASON = "too_few_frames"
_MAX_LUT_BINS = 1 << 20
_CHUNK = 1 << 15


class AspectIndex:
    """Precomputed search structure for one bucket table and rule (internal to :class:`~hf_arb.BucketSet`).

    Args:
        resolutions: ``(k, 2)`` int64 ``(width, height)``.
        metric: one of :data:`METRICS`.
        match_aspects: ``(k,)`` aspects (w/h) to match on instead of the buckets' own; ``None``: their own.
        nearest_area: among buckets with the same nearest matching aspect, take the closest area.
    """

    __slots__ = ("metric", "_res", "_uniq", "_uniq_log", "_bounds", "_sorted_ids", "_lut", "_groups")

    def __init__(self, resolutions: np.ndarray, metric: str, match_aspects: np.ndarray | None,
                 nearest_area: bool) -> None:
        self.metric = metric
        self._res = resolutions
        self._lut = None
        self._groups = None
        if metric == "cross":
            return
        match = resolutions[:, 0] / resolutions[:, 1] if match_aspects is None else match_aspects  # (k,)
        uniq, first, inverse = np.unique(match, return_index=True, return_inverse=True)  # (u,) sorted
        self._sorted_ids = first.astype(np.int32)  # (u,) argmin's tie rule: the lowest id wins
        self._uniq_log = np.log(uniq).astype(np.float32)  # (u,)
        self._uniq = uniq.astype(np.float32)  # (u,)
        if metric == "log":
            mids = np.sqrt(uniq[:-1] * uniq[1:])  # (u-1,) geometric midpoints = log-space midpoints
        elif metric == "linear":
            mids = (uniq[:-1] + uniq[1:]) / 2  # (u-1,) arithmetic midpoints
        else:
            mids = 2 * uniq[:-1] * uniq[1:] / (uniq[:-1] + uniq[1:])  # (u-1,) harmonic: midpoints of h/w
        bounds = np.log(mids)  # (u-1,) in log-aspect space, increasing
        self._bounds = bounds.astype(np.float32)
        if nearest_area and uniq.size < match.size:
            sizes = np.bincount(inverse.ravel(), minlength=uniq.size)
            ids = np.full((uniq.size, int(sizes.max())), -1, dtype=np.int32)  # (u, g) members in id order
            col = np.zeros(uniq.size, dtype=np.int64)
            for i, s in enumerate(inverse.ravel().tolist()):  # k rows: the table, not the dataset
                ids[s, col[s]] = i
                col[s] += 1
            areas = np.where(ids >= 0, (resolutions[:, 0] * resolutions[:, 1])[ids].astype(np.float64), np.inf)
            self._groups = (ids, areas)
        self._build_lut(bounds)

    def _build_lut(self, bounds: np.ndarray) -> None:
        """A uniform grid of bins, each narrower than the smallest interval (holds at most one midpoint):
        ``slot = below[bin] + (log_aspect > bound_in[bin])``."""
        if bounds.size == 0:
            return
        lo, hi = float(bounds[0]) - 1.0, float(bounds[-1]) + 1.0
        gap = float(np.diff(bounds).min()) if bounds.size > 1 else hi - lo
        nbins = int(np.ceil(2 * (hi - lo) / gap)) + 1
        if nbins > _MAX_LUT_BINS:  # near-identical aspects: fall back to binary search
            return
        scale = nbins / (hi - lo)
        starts = lo + np.arange(nbins) / scale  # (nbins,) left edge of each bin
        below = np.searchsorted(bounds, starts, side="right").astype(np.int32)  # (nbins,) midpoints <= edge
        within = np.searchsorted(bounds, starts + 1 / scale, side="right") - below  # (nbins,) 0 or 1
        bound_in = np.full(nbins, np.inf, dtype=np.float32)  # (nbins,) the midpoint inside the bin, else +inf
        bound_in[within > 0] = bounds[below[within > 0]]
        self._lut = (np.float32(lo), np.float32(scale), below, bound_in)

    def _slots(self, log_aspect: np.ndarray) -> np.ndarray:
        """Index into the sorted unique matching aspects for each log aspect, shape ``(n,)``."""
        if self._lut is None:
            return np.searchsorted(self._bounds, log_aspect, side="left")
        lo, scale, below, bound_in = self._lut
        pos = np.subtract(log_aspect, lo)  # (n,) float32
        np.multiply(pos, scale, out=pos)
        np.clip(pos, 0, below.size - 1, out=pos)
        b = pos.astype(np.int32)  # (n,) bin per image
        slot = below[b]  # (n,) int32
        slot += log_aspect > bound_in[b]
        return slot

    def assign(self, w: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(bucket_ids int32, errors float32, x float32)``, each of shape ``(n,)``; no pruning.

        ``x`` is the image aspect ``w/h``, or its log for the ``"log"`` metric (computed in place: one array less).
        """
        if self.metric == "cross":
            return self._assign_cross(w, h)
        aspect = np.divide(w, h, dtype=np.float32)  # (n,) float32: half the memory traffic of float64
        log_aspect = np.log(aspect, out=aspect if self.metric == "log" else None)  # (n,)
        slot = self._slots(log_aspect)  # (n,)
        if self.metric == "log":
            err = np.subtract(log_aspect, self._uniq_log[slot])  # (n,)
        elif self.metric == "linear":
            err = np.subtract(aspect, self._uniq[slot])  # (n,) |bucket aspect - image aspect|
        else:
            err = np.subtract(np.divide(h, w, dtype=np.float32), np.float32(1) / self._uniq[slot])  # (n,) on h/w
        np.abs(err, out=err)
        if self._groups is None:
            ids = self._sorted_ids[slot]  # (n,) int32 bucket id
        else:
            gid, garea = self._groups
            area = np.multiply(w, h, dtype=np.float64)  # (n,)
            pick = np.abs(garea[slot] - area[:, None]).argmin(axis=1)  # (n,) first closest area in the group
            ids = gid[slot, pick]
        return ids, err, aspect

    def _assign_cross(self, w: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """diffusers' ``find_nearest_bucket``: minimal ``|h*bw - w*bh|``, ties to the last bucket (its ``<=``)."""
        exact = w.dtype.kind in "iu" and h.dtype.kind in "iu"
        dt = np.int64 if exact else np.float64
        bw, bh = self._res[:, 0].astype(dt)[::-1], self._res[:, 1].astype(dt)[::-1]  # (k,) reversed: argmin → last
        k = bw.size
        ids = np.empty(w.size, dtype=np.int32)
        err = np.empty(w.size, dtype=np.float32)
        for s in range(0, w.size, _CHUNK):
            wc, hc = w[s:s + _CHUNK].astype(dt), h[s:s + _CHUNK].astype(dt)  # (c,)
            d = np.abs(hc[:, None] * bw[None, :] - wc[:, None] * bh[None, :])  # (c, k)
            j = d.argmin(axis=1)  # (c,)
            ids[s:s + _CHUNK] = k - 1 - j
            err[s:s + _CHUNK] = d[np.arange(j.size), j] / (wc * bw[j])  # = |h/w - bh/bw|
        return ids, err, np.divide(w, h, dtype=np.float32)


class FrameIndex:
    """Nearest bucket of a ``(k, 3)`` ``(width, height, frames)`` table: the frame count first, then the aspect.

    Args:
        resolutions: ``(k, 3)`` int64 ``(width, height, frames)``.
        metric, match_aspects, nearest_area: as for :class:`AspectIndex` (``match_aspects`` aligned with the rows).
    """

    __slots__ = ("frame_counts", "_groups")

    def __init__(self, resolutions: np.ndarray, metric: str, match_aspects: np.ndarray | None,
                 nearest_area: bool) -> None:
        frames = resolutions[:, 2]  # (k,)
        self.frame_counts = np.unique(frames)  # (g,) ascending
        self._groups: list[tuple[np.ndarray, AspectIndex]] = []
        for f in self.frame_counts.tolist():  # g groups: the table, not the dataset
            ids = np.flatnonzero(frames == f).astype(np.int32)  # (k_g,) in id order: tie rules keep their meaning
            match = None if match_aspects is None else match_aspects[ids]
            table = np.ascontiguousarray(resolutions[ids, :2])  # (k_g, 2)
            self._groups.append((ids, AspectIndex(table, metric, match, nearest_area)))

    def frame_slots(self, frames: np.ndarray) -> np.ndarray:
        """Index into :attr:`frame_counts` of the largest frame count ``<=`` each clip's frames, ``-1`` where the clip
        is shorter than every frame count; shape ``(n,)`` (int8 for up to 32 frame counts, else int64)."""
        if self.frame_counts.size > 32:
            return np.searchsorted(self.frame_counts, frames, side="right") - 1
        slot = np.full(np.shape(frames), -1, np.int8)  # a few compares beat a binary search per row
        for c in self.frame_counts.tolist():
            slot += frames >= c
        return slot

    def assign(self, w: np.ndarray, h: np.ndarray, frames: np.ndarray,
               loop: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(bucket_ids int32, errors float32, x float32)`` as :meth:`AspectIndex.assign`, ``(n,)`` each.

        A clip shorter than the smallest frame count gets ``-1`` unless ``loop`` (then the smallest frame count);
        its aspect error is measured against the smallest frame count's buckets either way."""
        slot = self.frame_slots(frames)  # (n,)
        short = slot < 0
        np.maximum(slot, 0, out=slot)
        if len(self._groups) == 1:
            gid, index = self._groups[0]
            i, err, x = index.assign(w, h)
            ids = gid[i]
        else:  # rows grouped by frame count with one stable radix sort: one gather and one scatter in all
            order = np.argsort(slot if slot.dtype == np.int8 else slot.astype(np.int64), kind="stable")
            edges = np.concatenate([[0], np.cumsum(np.bincount(slot, minlength=len(self._groups)))])  # (g + 1,)
            ws, hs = w[order], h[order]  # (n,) by frame count
            ids_s = np.empty(w.size, np.int32)
            err_s = np.empty(w.size, np.float32)
            x_s = np.empty(w.size, np.float32)
            for g, (gid, index) in enumerate(self._groups):
                a, b = int(edges[g]), int(edges[g + 1])
                if b > a:
                    i, err_s[a:b], x_s[a:b] = index.assign(ws[a:b], hs[a:b])
                    ids_s[a:b] = gid[i]
            ids, err, x = (np.empty_like(v) for v in (ids_s, err_s, x_s))
            ids[order], err[order], x[order] = ids_s, err_s, x_s
        if not loop:
            ids[short] = -1
        return ids, err, x
