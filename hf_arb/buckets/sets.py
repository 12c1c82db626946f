"""Bucket sets and vectorised bucket assignment.

A :class:`BucketSet` is an immutable, ordered table of bucket resolutions ``(width, height)`` — or
``(width, height, frames)`` for clips, a ``(k, 3)`` table — plus the rule that assigns an image to a bucket: the
aspect-ratio metric, an optional maximum aspect error and an optional range of accepted image aspect ratios. A
bucket's id is its row in :attr:`BucketSet.resolutions`; ``-1`` means "no bucket" (pruned).

Assignment is one pass of numpy over the whole dataset (:mod:`hf_arb.buckets.matching`): the sorted bucket
aspect ratios split the aspect line into intervals (at the midpoints of the chosen metric), and every
image is placed with a lookup table. This is exactly ``argmin |metric(bucket) - metric(image)|``
without materialising an ``(images, buckets)`` matrix. The tables of the named presets, including
every model family's own, live in :mod:`hf_arb.buckets.presets`.

A clip table (``(k, 3)``) matches the frame axis first: a clip of ``N`` frames goes to the largest frame count
``<= N`` of the table, then to the nearest aspect among that frame count's buckets; an image is a 1-frame clip
(:class:`hf_arb.buckets.matching.FrameIndex`). An image table (``(k, 2)``) runs exactly the image code it always ran.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from hf_arb.checks import UsageError

from .assignment import AssignmentSummary, as_size_array, bucket_labels, normalise_resolutions
from .family_tables import parse_buckets_string
from .frames import frame_rule as _frame_rule
from .matching import METRICS as _METRICS
from .matching import SHORT_CLIPS, AspectIndex, FrameIndex, Metric
from .presets import (
    TABLE_PARAMS,
    budget_table,
    frame_budget_table,
    frame_list,
    novelai_table,
    preset_table,
    sdxl_table,
)
from .stored import dataset_configs

_FORMAT_VERSION = 1


class BucketSet:
    """An immutable table of bucket resolutions and the rule that assigns images to them.

    Args:
        resolutions: ``(width, height)`` pairs, or ``(width, height, frames)`` triples for clips (an image bucket of a
            clip set has 1 frame); positive and unique. The order defines bucket ids.
        metric: aspect distance (see :mod:`hf_arb.buckets.matching`): ``"log"`` (default) ``|log(w/h) - log(bw/bh)|``,
            symmetric for tall and wide images; ``"linear"`` NovelAI's ``|bw/bh - w/h|``; ``"linear_hw"`` the same
            on height/width (PixArt, Sana, OneTrainer); ``"cross"`` diffusers' ``|h*bw - w*bh|`` (ties to the last id).
        max_aspect_error: rows whose aspect error exceeds this get bucket ``-1``. ``None`` keeps all.
        aspect_range: ``(min, max)`` of the image's own aspect ratio ``w/h`` to accept (DALL·E kept
            ``(0.5, 2.0)``); others get bucket ``-1``. ``None`` accepts all.
        match_aspects: ``(k,)`` aspect ratios ``w/h`` to match images against instead of the buckets' own
            (PixArt's rounded keys, HunyuanDiT's standard ratios). ``None``: the buckets' own.
        nearest_area: among buckets sharing the nearest matching aspect, take the one whose area is closest to
            the image's (HunyuanDiT); otherwise the lowest id.
        short_clips: clip sets only: a clip shorter than the smallest frame count is skipped (``"skip"``, bucket
            ``-1``, skip reason ``"too_few_frames"``) or looped into the smallest frame count (``"loop"``).

    Example:
        ```py
        >>> bs = BucketSet.novelai()
        >>> len(bs)
        19
        >>> ids, err = bs.assign([1920, 600], [1080, 1800])
        >>> [tuple(bs.resolutions[i]) for i in ids]
        [(704, 512), (384, 1024)]
        ```
    """

    __slots__ = ("_res", "_metric", "_max_err", "_range", "_match", "_nearest_area", "_short", "_index", "_fp")

    def __init__(
        self,
        resolutions: Iterable[Sequence[int]],
        *,
        metric: Metric = "log",
        max_aspect_error: float | None = None,
        aspect_range: tuple[float, float] | None = None,
        match_aspects: Sequence[float] | None = None,
        nearest_area: bool = False,
        short_clips: str = "skip",
    ) -> None:
        if metric not in _METRICS:
            raise ValueError(f"`metric` must be one of {_METRICS}, got {metric!r}.")
        if max_aspect_error is not None and not (math.isfinite(max_aspect_error) and max_aspect_error >= 0):
            raise ValueError(f"`max_aspect_error` must be a finite number >= 0 or None, got {max_aspect_error!r}.")
        if aspect_range is not None:
            lo, hi = (float(x) for x in aspect_range)
            if not (0 < lo <= hi and math.isfinite(hi)):
                raise ValueError(f"`aspect_range` must be (min, max) with 0 < min <= max, got {aspect_range!r}.")
            aspect_range = (lo, hi)
        self._res = normalise_resolutions(resolutions)
        self._metric: Metric = metric
        self._max_err = None if max_aspect_error is None else float(max_aspect_error)
        self._range = aspect_range
        self._match = None
        if match_aspects is not None:
            m = np.asarray(match_aspects, dtype=np.float64)
            if m.shape != (len(self._res),) or not np.all(np.isfinite(m) & (m > 0)):
                raise ValueError(f"`match_aspects` must hold one positive finite w/h per bucket ({len(self._res)}), "
                                 f"got {m.tolist()}.")
            m.flags.writeable = False
            self._match = m
        self._nearest_area = bool(nearest_area)
        if metric == "cross" and (self._match is not None or self._nearest_area):
            raise ValueError("metric='cross' compares the buckets' own sides; it takes no `match_aspects` or "
                             "`nearest_area`. Use metric='linear' or 'linear_hw' with them.")
        if short_clips not in SHORT_CLIPS:
            raise ValueError(f"`short_clips` must be one of {SHORT_CLIPS}, got {short_clips!r}.")
        if short_clips != "skip" and self._res.shape[1] == 2:
            raise ValueError("`short_clips` applies to clip sets, (width, height, frames) buckets; this set has no "
                             "frame axis.")
        self._short = short_clips
        index = AspectIndex if self._res.shape[1] == 2 else FrameIndex
        self._index = index(self._res, metric, self._match, self._nearest_area)
        self._fp = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True,
                                             separators=(",", ":")).encode()).hexdigest()[:16]

    # ----------------------------------------------------------------------------- constructors
    @classmethod
    def novelai(cls, max_area: int = 512 * 768, max_side: int = 1024, step: int = 64, min_side: int = 256,
                extra: Iterable[Sequence[int]] = ((512, 512),), **kwargs: Any) -> BucketSet:
        """NovelAI's published bucket algorithm (blog post "NovelAI Improvements on Stable Diffusion").

        For every width from ``min_side`` to ``max_side`` in ``step`` increments, take the largest height
        (multiple of ``step``, at most ``max_side``) whose area stays within ``max_area``; do the same with
        the roles of width and height swapped; add ``extra`` (512×512). With the defaults this gives their
        19 buckets. Extra keyword arguments (``metric``, ``max_aspect_error``, ...) go to the constructor.
        """
        return cls(novelai_table(max_area, max_side, step, min_side, extra).tolist(), **kwargs)

    @classmethod
    def from_budget(cls, resolution: int = 1024, aspects: Iterable[float] | None = None, step: int = 64,
                    min_area_ratio: float = 0.75, *, frames: Iterable[int] | None = None,
                    max_pixels: int | None = None, frame_rule: Any = None, **kwargs: Any) -> BucketSet:
        """A pixel-budget ladder: each aspect ratio scaled to about ``resolution²`` pixels.

        With ``frames`` (clip buckets, a ``(k, 3)`` set), the budget is in pixels × frames: ``resolution²`` pixels
        per frame at the longest frame count, ``resolution² × max(frames) / F`` pixels per frame at ``F`` frames (at
        most ``max_pixels``, default ``4 × resolution²``: twice the side), so a long low-resolution clip and a short
        high-resolution one cost the same (:func:`hf_arb.buckets.presets.frame_budget_table`). ``frame_rule`` (a
        family name of :data:`hf_arb.buckets.frames.FRAME_RULES` or a ``FrameRule``) refuses frame counts its VAE
        cannot encode. The video families' own: ``BucketSet.preset("wan" | "ltx" | "hunyuan_video")``.

        Every side is a multiple of ``step`` and no bucket exceeds ``resolution²`` pixels. For each aspect
        ``a`` (width / height; default: OneTrainer's 4:1 … 1:1 and their inverses), the bucket is the
        ``step``-aligned shape that is closest to ``a`` in log aspect among the shapes using at least
        ``min_area_ratio`` of the budget (ties: the larger area). Aspects that land on the same shape
        (likely with tiny budgets such as ``resolution=64, step=16``) give one bucket. OneTrainer itself
        rounds to the nearest step instead (``BucketSet.preset("onetrainer")``).

        Example:
            ```py
            >>> bs = BucketSet.from_budget(512, [1.0], step=64, frames=[1, 17, 33])
            >>> bs.labels(), bs.volumes.max() <= 512 * 512 * 33
            (['1024x1024x1', '704x704x17', '512x512x33'], True)
            ```
        """
        if frames is None:
            if max_pixels is not None or frame_rule is not None:
                raise ValueError("`max_pixels` and `frame_rule` apply to clip buckets: pass `frames` too.")
            return cls(budget_table(resolution, aspects, step, min_area_ratio).tolist(), **kwargs)
        counts = cls._frame_counts(frames, frame_rule)
        budget_table(resolution, aspects, step, min_area_ratio)  # the same checks of resolution, step and aspects
        side2 = int(resolution) ** 2
        cap = 4 * side2 if max_pixels is None else int(max_pixels)
        return cls(frame_budget_table(side2 * max(counts), counts, aspects, step, cap, min_area_ratio).tolist(),
                   **kwargs)

    @classmethod
    def fit(cls, sizes: Any, n_buckets: int, *, step: int = 64, max_pixels: int = 1024 * 1024,
            max_crop: float | None = None, frames: Iterable[int] | None = None, frame_rule: Any = None,
            max_frame_pixels: int | None = None, **kwargs: Any) -> BucketSet:
        """The ``n_buckets`` step-aligned shapes at ``max_pixels`` that minimise the mean crop of ``sizes`` (``(n, 2)``
        or ``(widths, heights)``), none cutting more than ``max_crop``: :func:`hf_arb.buckets.fit.fit_table` (other
        kwargs: the constructor).

        With ``frames`` (clip buckets), the fitted aspects repeat at every frame count under a budget in pixels ×
        frames: ``max_pixels`` per frame at the longest count, ``max_pixels × max(frames) / F`` at ``F`` frames (at
        most ``max_frame_pixels``, default ``4 × max_pixels``), each aspect at its step-aligned shape nearest in log
        aspect (:func:`hf_arb.buckets.presets.frame_budget_table`); ``frame_rule`` refuses counts its VAE cannot
        encode. A clip is then matched to the largest frame count ``<=`` its own (:meth:`assign`)."""
        from .fit import FIT_PARAMS, fit_table, split_sizes
        if kwargs.pop("metric", "log") != "log":
            raise ValueError("BucketSet.fit optimises nearest-in-log-aspect assignment: it needs metric='log'.")
        params = {k: kwargs.pop(k) for k in FIT_PARAMS if k in kwargs}  # the rest: constructor arguments
        table = fit_table(*split_sizes(sizes), n_buckets, step=step, max_pixels=max_pixels, max_crop=max_crop,
                          **params).table
        if frames is None:
            if frame_rule is not None or max_frame_pixels is not None:
                raise ValueError("`frame_rule` and `max_frame_pixels` apply to clip buckets: pass `frames` too.")
            return cls(table.tolist(), **kwargs)
        counts = cls._frame_counts(frames, frame_rule)
        cap = 4 * int(max_pixels) if max_frame_pixels is None else int(max_frame_pixels)
        return cls(frame_budget_table(int(max_pixels) * max(counts), counts, (table[:, 0] / table[:, 1]).tolist(),
                                      step, cap, params.get("min_area_ratio", 0.75)).tolist(), **kwargs)

    @staticmethod
    def _frame_counts(frames: Iterable[int], frame_rule: Any) -> list[int]:
        """``frames`` as ints, each allowed by ``frame_rule`` when one is given (else a UsageError naming the nearest
        valid counts)."""
        counts = [int(f) for f in frame_list(frames)]
        if frame_rule is not None:
            rule = _frame_rule(frame_rule)
            bad = [f for f in counts if not rule.is_valid(f)]
            if bad:
                below = rule.floor(bad[0]) if bad[0] >= 1 else 1
                raise UsageError(f"{bad[0]} frames do not fit the {rule.name} rule ({rule.step}k+1 frames): use "
                                 f"{below} or {below + rule.step}.")
        return counts

    @classmethod
    def sdxl(cls, **kwargs: Any) -> BucketSet:
        """The SDXL report's multi-aspect table at about 1024² pixels, both orientations (41 buckets)."""
        return cls(sdxl_table().tolist(), **kwargs)

    @classmethod
    def preset(cls, name: str, resolution: int | None = None, step: int | None = None, *,
               metric: Metric | str = "log", **kwargs: Any) -> BucketSet:
        """Build a named preset (any of :data:`hf_arb.buckets.presets.PRESETS`, or a video family's
        :data:`~hf_arb.buckets.presets.VIDEO_PRESETS`; tables in :mod:`hf_arb.buckets.presets`).

        Args:
            name: ``"budget"``, ``"novelai"``, ``"sdxl"``, ``"pixart"``, ``"sana"``, ``"hunyuan_dit"``,
                ``"flux_kontext"``, ``"diffusers"``, ``"onetrainer"`` or ``"kohya"``; or ``"wan"``, ``"ltx"``,
                ``"hunyuan_video"``: ``(width, height, frames)`` buckets under a pixels × frames budget
                (:func:`hf_arb.buckets.presets.video_preset_table`; table parameters ``frames``, ``max_pixels``,
                ``aspects``, ``min_area_ratio``).
            resolution: pixel budget side, or the model resolution for ``pixart`` (256/512/1024/2048) and
                ``sana`` (512/1024/2048/4096). ``None``: the preset's default. Fixed tables ignore it with a
                ``UserWarning`` saying so (see :func:`hf_arb.buckets.presets.preset_notes`).
            step: side multiple for ``budget``, ``onetrainer``, ``kohya`` (default 64) and ``diffusers``
                (its ``divisibility``, default 16).
            metric: a metric, or ``"native"`` for the source's own matching rule (PixArt's nearest key on h/w,
                HunyuanDiT's ratio-then-area, diffusers' ``|h*bw - w*bh|``, ...), which reproduces its assignment.
            kwargs: the preset's table parameters (:data:`hf_arb.buckets.presets.TABLE_PARAMS`, e.g. ``min_side`` /
                ``max_side`` for ``kohya``); anything else goes to the constructor (``max_aspect_error``, ...).
        """
        params = {k: kwargs.pop(k) for k in TABLE_PARAMS.get(name, ()) if k in kwargs}
        table, native = preset_table(name, resolution, step, **params)
        rule = native if metric == "native" else {"metric": metric}
        return cls(table.tolist(), **rule, **kwargs)

    @classmethod
    def from_string(cls, text: str, *, metric: Metric | str = "native", **kwargs: Any) -> BucketSet:
        """Buckets from diffusers' ``--aspect_ratio_buckets`` string ``"h1,w1;h2,w2"`` (height first!).

        Bucket ids follow the string's order; ``resolutions`` are ``(width, height)`` as everywhere in hf_arb.
        ``metric="native"`` (default) matches images as diffusers' ``find_nearest_bucket`` does
        (``"cross"``); pass ``"log"`` for the symmetric distance.

        Example:
            ```py
            >>> BucketSet.from_string("1024,1024;768,1360").resolutions.tolist()
            [[1024, 1024], [1360, 768]]
            ```
        """
        return cls(parse_buckets_string(text), metric="cross" if metric == "native" else metric, **kwargs)

    def replace(self, **changes: Any) -> BucketSet:
        """A copy with some constructor arguments changed (``metric``, ``max_aspect_error``, ``aspect_range``, ...)."""
        d = self.to_dict()
        d.pop("format")
        d["resolutions"] = [tuple(r) for r in d["resolutions"]]
        if "metric" in changes and "match_aspects" not in changes and changes["metric"] == "cross":
            d.pop("match_aspects", None)
            d.pop("nearest_area", None)
        d.update(changes)
        return type(self)(**d)

    @classmethod
    def from_dataset(cls, ds: Any) -> BucketSet:
        """Restore the BucketSet an annotated dataset was built with (``Dataset``, ``IterableDataset`` or a dict
        of splits): exactly the stored one (same fingerprint) when the ``bucket`` feature carries it, else rebuilt
        from the columns (:mod:`hf_arb.buckets.stored`). Raises ``ValueError`` when neither can tell, or when the
        splits were annotated with different BucketSets."""
        found = {split: cls.from_dict(config) for split, config in dataset_configs(ds).items()}
        first = next(iter(found.values()))
        if any(b != first for b in found.values()):
            raise ValueError(f"The splits were annotated with different BucketSets: "
                             f"{ {s: b.fingerprint for s, b in found.items()} }. Annotate all splits with one "
                             f"BucketSet.")
        return first

    # ----------------------------------------------------------------------------- properties
    @property
    def resolutions(self) -> np.ndarray:
        """Bucket sizes, read-only ``np.ndarray[int64]`` of shape ``(k, 2)``, columns (width, height), or ``(k, 3)``,
        columns (width, height, frames), for a clip set."""
        return self._res

    @property
    def has_frames(self) -> bool:
        """Whether the buckets have a frame axis (``resolutions`` of shape ``(k, 3)``)."""
        return self._res.shape[1] == 3

    @property
    def frames(self) -> np.ndarray:
        """Frames per bucket, int64 of shape ``(k,)``: the third column of a clip set, ``1`` for an image set."""
        return self._res[:, 2] if self.has_frames else np.ones(len(self), np.int64)

    @property
    def frame_counts(self) -> np.ndarray:
        """The distinct frame counts, ascending, int64 of shape ``(g,)`` (``[1]`` for an image set)."""
        return self._index.frame_counts if self.has_frames else np.ones(1, np.int64)

    @property
    def short_clips(self) -> str:
        """What a clip shorter than the smallest frame count gets: ``"skip"`` (bucket ``-1``) or ``"loop"``."""
        return self._short

    @property
    def aspects(self) -> np.ndarray:
        """Bucket aspect ratios ``width / height``, shape ``(k,)``."""
        return self._res[:, 0] / self._res[:, 1]

    @property
    def areas(self) -> np.ndarray:
        """Bucket areas in pixels (of one frame), shape ``(k,)``."""
        return self._res[:, 0] * self._res[:, 1]

    @property
    def volumes(self) -> np.ndarray:
        """Pixels × frames per bucket, int64 of shape ``(k,)``: what a clip costs (``areas`` for an image set)."""
        return self.areas * self._res[:, 2] if self.has_frames else self.areas

    @property
    def metric(self) -> Metric:
        """Aspect distance: ``"log"`` or ``"linear"``."""
        return self._metric

    @property
    def max_aspect_error(self) -> float | None:
        """Rows farther than this from every bucket get ``-1``; ``None`` keeps all."""
        return self._max_err

    @property
    def aspect_range(self) -> tuple[float, float] | None:
        """``(min, max)`` of accepted image aspect ratios ``w / h``; ``None`` accepts all."""
        return self._range

    @property
    def match_aspects(self) -> np.ndarray | None:
        """Aspects ``w/h`` images are matched against instead of the buckets' own, shape ``(k,)``; or ``None``."""
        return self._match

    @property
    def nearest_area(self) -> bool:
        """Whether buckets sharing the nearest matching aspect are told apart by area (HunyuanDiT's rule)."""
        return self._nearest_area

    @property
    def fingerprint(self) -> str:
        """16 hex digits of SHA-256 over the canonical JSON of :meth:`to_dict`; stable across processes."""
        return self._fp

    def index(self, resolution: Sequence[int]) -> int:
        """Bucket id of ``(width, height)`` (``(width, height, frames)`` in a clip set); raises ``ValueError`` naming
        the available sizes if absent."""
        key = tuple(int(x) for x in resolution)
        if len(key) != self._res.shape[1]:
            raise ValueError(f"{'x'.join(map(str, key))}: this set's buckets are "
                             f"{'(width, height, frames)' if self.has_frames else '(width, height)'}; pass "
                             f"{self._res.shape[1]} numbers.")
        hit = np.flatnonzero((self._res == np.asarray(key)).all(axis=1))
        if hit.size == 0:
            raise ValueError(f"{'x'.join(map(str, key))} is not a bucket of this set; buckets are {self.labels()}.")
        return int(hit[0])

    def labels(self) -> list[str]:
        """``"WxH"`` label per bucket id (``"WxHxF"`` in a clip set)."""
        return bucket_labels(self._res)

    def portrait_to_landscape(self) -> np.ndarray:
        """Bucket ids ordered by aspect ratio, tallest first (ties by area), shape ``(k,)``; a clip set by frames
        first."""
        return np.lexsort((self.areas, self.aspects, self.frames))

    # ----------------------------------------------------------------------------- assignment
    def assign(self, widths: Any, heights: Any, frames: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Assign every image (or clip) to its nearest bucket by aspect ratio, vectorised.

        Args:
            widths: image widths, 1-D array-like of shape ``(n,)`` (displayed size).
            heights: image heights, shape ``(n,)``.
            frames: clip sets: each row's frame count, shape ``(n,)`` (``1`` for an image; ``None``: all images). A
                clip goes to the largest frame count ``<=`` its own, then to the nearest aspect among those buckets;
                one shorter than every frame count gets ``-1`` (:meth:`too_short` tells those rows) unless
                ``short_clips="loop"``. An image set takes no frames above 1.

        Returns:
            ``(bucket_ids, aspect_errors)``: ``int32`` of shape ``(n,)`` (``-1`` where pruned by
            ``max_aspect_error`` or ``aspect_range``) and ``float32`` of shape ``(n,)``, the distance to the
            nearest bucket in this set's metric (also reported for pruned rows). Computed in float32: two
            buckets within ~1e-6 of equally near may be told apart either way.

        Raises:
            ValueError: sizes that are not 1-D, of different lengths, zero, negative or NaN; the message
                names the first bad index and its value. Frames above 1 for an image set.
        """
        w = as_size_array(widths, "widths")
        h = as_size_array(heights, "heights")
        if w.shape != h.shape:
            raise ValueError(
                f"`widths` and `heights` must have the same length, got {w.shape[0]} and {h.shape[0]}."
            )
        if self.has_frames:
            f = np.ones(w.shape, np.int64) if frames is None else self._frames_array(frames, w.shape)
            ids, err, x = self._index.assign(w, h, f, self._short == "loop")
        else:
            if frames is not None and (self._frames_array(frames, w.shape) > 1).any():
                raise ValueError("This BucketSet has no frame axis, but clips of more than 1 frame were given. Use a "
                                 "set with (width, height, frames) buckets: BucketSet.preset('wan'), "
                                 "BucketSet.from_budget(..., frames=[...]).")
            ids, err, x = self._index.assign(w, h)  # (n,) int32, float32, float32 (aspect, or log aspect for "log")
        if self._max_err is not None:
            ids[err > self._max_err] = -1
        if self._range is not None:
            ratio = np.exp(x) if self._metric == "log" else x
            ids[(ratio < self._range[0]) | (ratio > self._range[1])] = -1
        return ids, err

    @staticmethod
    def _frames_array(frames: Any, shape: tuple[int, ...]) -> np.ndarray:
        f = as_size_array(frames, "frames")
        if f.shape != shape:
            raise ValueError(f"`frames` must have one entry per row ({shape[0]}), got {f.shape[0]}.")
        return f

    def too_short(self, frames: Any) -> np.ndarray:
        """Rows that :meth:`assign` skips for being shorter than the smallest frame count (skip reason
        :data:`~hf_arb.buckets.matching.SHORT_CLIP_REASON`), bool of shape ``(n,)``; all False for an image set or
        with ``short_clips="loop"``."""
        f = np.asarray(frames)
        if not self.has_frames or self._short == "loop":
            return np.zeros(f.shape, bool)
        return f < self._index.frame_counts[0]

    def summarize(self, bucket_ids: Any, aspect_errors: Any) -> AssignmentSummary:
        """Statistics of an assignment: skipped count, aspect error mean/median/max over kept rows, counts."""
        ids = np.asarray(bucket_ids, dtype=np.int64)
        err = np.asarray(aspect_errors, dtype=np.float64)
        kept = ids >= 0
        counts = np.bincount(ids[kept], minlength=len(self))
        e = err[kept & np.isfinite(err)]
        stats = (float(e.mean()), float(np.median(e)), float(e.max())) if e.size else (math.nan,) * 3
        return AssignmentSummary(int(ids.size), int((~kept).sum()), counts, *stats, resolutions=self._res)

    # ----------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description; ``BucketSet.from_dict(bs.to_dict()) == bs``."""
        return {
            "format": _FORMAT_VERSION,
            "resolutions": self._res.tolist(),
            "metric": self._metric,
            "max_aspect_error": self._max_err,
            "aspect_range": None if self._range is None else list(self._range),
            # Written only when set, so sets without them keep the fingerprints of earlier releases.
            **({} if self._match is None else {"match_aspects": self._match.tolist()}),
            **({"nearest_area": True} if self._nearest_area else {}),
            **({} if self._short == "skip" else {"short_clips": self._short}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BucketSet:
        """Inverse of :meth:`to_dict`. Raises ``ValueError`` naming a missing or unknown field."""
        if not isinstance(d, dict) or "resolutions" not in d:
            raise ValueError(f"A BucketSet dict needs a 'resolutions' field, got {d!r}.")
        fmt = d.get("format", _FORMAT_VERSION)
        if fmt != _FORMAT_VERSION:
            raise ValueError(
                f"BucketSet dict has format {fmt!r}; this hf_arb reads format {_FORMAT_VERSION}. Upgrade hf_arb."
            )
        rng = d.get("aspect_range")
        return cls(
            [tuple(r) for r in d["resolutions"]],
            metric=d.get("metric", "log"),
            max_aspect_error=d.get("max_aspect_error"),
            aspect_range=None if rng is None else (rng[0], rng[1]),
            match_aspects=d.get("match_aspects"),
            nearest_area=bool(d.get("nearest_area", False)),
            short_clips=d.get("short_clips", "skip"),
        )

    def to_json(self) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> BucketSet:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(s))

    def table(self) -> str:
        """The bucket table as text, one line per bucket, portrait to landscape (a clip set: by frames first, with
        its frames and pixels × frames)."""
        clip = self.has_frames
        lines = [f"{'id':>3}  {'width':>5}  {'height':>6}" + (f"  {'frames':>6}" if clip else "")
                 + f"  {'aspect':>6}  {'area':>9}" + (f"  {'area x frames':>13}" if clip else "")]
        for i in self.portrait_to_landscape():
            w, h = self._res[i, :2]
            f = int(self._res[i, 2]) if clip else 1
            lines.append(f"{i:>3}  {w:>5}  {h:>6}" + (f"  {f:>6}" if clip else "") + f"  {w / h:6.3f}  {w * h:>9,}"
                         + (f"  {w * h * f:>13,}" if clip else ""))
        return "\n".join(lines)

    # ----------------------------------------------------------------------------- dunder
    def __len__(self) -> int:
        return int(self._res.shape[0])

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return (tuple(r) for r in self._res.tolist())

    def __getitem__(self, i: int) -> tuple[int, ...]:
        return tuple(self._res[i].tolist())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BucketSet) and self._fp == other._fp

    def __hash__(self) -> int:
        return hash(self._fp)

    def __repr__(self) -> str:
        shown = ", ".join(self.labels()[:6]) + (", …" if len(self) > 6 else "")
        extra = f", max_aspect_error={self._max_err}" if self._max_err is not None else ""
        extra += f", aspect_range={self._range}" if self._range is not None else ""
        extra += ", match_aspects=[…]" if self._match is not None else ""
        extra += ", nearest_area=True" if self._nearest_area else ""
        extra += f", short_clips={self._short!r}" if self._short != "skip" else ""
        return f"BucketSet({len(self)} buckets: {shown}; metric={self._metric!r}{extra})"

