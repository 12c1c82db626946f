"""``TieredPackBatchSampler``: NaViT packs over several resolution tiers, a pack mixing tiers (docs/tiers.md).

A pack already holds every image at its own size; a tier there is a **size cap**: at tier ``R`` an image trains at
its own aspect with at most ``(R / (vae_scale_factor × patch_size))²`` latent tokens (what ``--packing`` gives one
``--resolution``), never upscaled. Which tiers a row may train at is decided exactly as for bucketed tiers
(:func:`~hf_arb.sampling.tier_plan.tier_bucket_ids`: it has a bucket in the tier's set and covers it within
``max_upscale``), so ``hf-arb stats --resolution ...`` counts the same rows.

The schedule is ``random`` (OneTrainer's rule): every epoch each row draws one of its eligible tiers with the
counter-based hash of ``(seed, epoch, row)`` (:func:`~hf_arb.sampling.tier_plan.random_tier_ids`), takes that
tier's fitted size, and the epoch is planned by :func:`~hf_arb.packing.plan_packs` over those token counts: a pack
mixes tiers, every row trains once per epoch at one tier. Everything else (global plan step-major rank-minor,
accelerate's prepare and ``skip_first_batches`` resume, ``state_dict``) is :class:`PackBatchSampler`'s. A step
schedule (``mix``, ``curriculum``, ``progressive``: one tier per step) would need one pack stream per tier; it is
refused.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from hf_arb.sampling.tier_plan import Tiers, random_tier_ids, tier_bucket_ids
from .layout import FittedSizes
from .plan import PackPlan, plan_packs
from .sampler import PackBatchSampler, pack_sizes

__all__ = ["TieredPackBatchSampler", "tier_token_caps"]


def tier_token_caps(tiers: Tiers, max_tokens: int, *, vae_scale_factor: int = 8, patch_size: int = 2) -> list[int]:
    """Each tier's token cap per image: ``min(max_tokens, (R // step)²)`` with ``step = vae × patch``, ``(T,)``."""
    step = int(vae_scale_factor) * int(patch_size)
    return [min(int(max_tokens), max(1, (int(r) // step) ** 2)) for r in tiers.resolutions]


class TieredPackBatchSampler(PackBatchSampler):
    """Packs over several tiers under the ``random`` schedule: each row trains once per epoch at a drawn tier.

    Args:
        source: an annotated ``datasets.Dataset`` (its ``original_width`` / ``original_height``) or
            ``(widths, heights)`` arrays ``(n,)`` (NaN or ``<= 0``: no size, eligible nowhere).
        tiers: the :class:`~hf_arb.sampling.tier_plan.Tiers` (which tiers a row may draw; ``max_upscale``).
        max_tokens: latent tokens per pack; every tier's cap is at most this.
        schedule: ``"random"`` (the only one: see the module docstring).
        **kwargs: :class:`PackBatchSampler`'s (``num_replicas``, ``rank``, ``seed``, ``leftover``, ``window``,
            ``vae_scale_factor``, ``patch_size``, ``return_keys``, ``log_report``, ``shuffle``).

    Attributes:
        sizes: one :class:`~hf_arb.packing.layout.FittedSizes` ``(n,)`` per tier (rows not eligible in a tier: all
            zero there); :class:`~hf_arb.packing.dataset.PackedImageDataset` takes them as they are.
        tier_ids: int16 ``(T, n)``, each row's bucket per tier, ``-1``: the row may not draw that tier.
    """

    def __init__(self, source: Any, tiers: Tiers, max_tokens: int, *, schedule: str = "random",
                 **kwargs: Any) -> None:
        if schedule != "random":
            raise ValueError(f"Packing over several tiers takes the `random` schedule (each row draws its tier per "
                             f"epoch; a pack mixes tiers), got {schedule!r}: a step schedule would need one pack "
                             "stream per tier. Use schedule='random', or bucketed batches for that schedule.")
        for name in ("upscale", "max_image_tokens"):
            if name in kwargs:
                raise TypeError(f"TieredPackBatchSampler takes no `{name}`: each tier's resolution caps its images "
                                "(never upscaled).")
        self.tiers, self.schedule = tiers, schedule
        if hasattr(source, "column_names"):
            t = source.select_columns(["original_width", "original_height"]).with_format("arrow")[:]
            w, h = (t.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
                    for c in ("original_width", "original_height"))
        else:
            w, h = (np.asarray(a, dtype=np.float64).reshape(-1) for a in source)
        self._n = w.size
        super().__init__((w, h), max_tokens, **kwargs)

    def _fit(self, source: Any) -> tuple[FittedSizes, ...]:
        """One FittedSizes per tier at its token cap, zero where the row may not draw the tier (``source``: the
        ``(widths, heights)`` float arrays ``(n,)``)."""
        w, h = source
        self.tier_ids = tier_bucket_ids(w, h, self.tiers)  # (T, n)
        good = np.isfinite(w) & np.isfinite(h) & (w > 0) & (h > 0)
        wi, hi = (np.where(good, a, 0).astype(np.int64) for a in (w, h))
        caps = tier_token_caps(self.tiers, self.max_tokens, vae_scale_factor=self.vae_scale_factor,
                               patch_size=self.patch_size)
        self.max_image_tokens = max(caps)
        self._draws: dict[int, np.ndarray] = {}
        return tuple(pack_sizes((np.where(self.tier_ids[t] >= 0, wi, 0), np.where(self.tier_ids[t] >= 0, hi, 0)),
                                cap, vae_scale_factor=self.vae_scale_factor, patch_size=self.patch_size)
                     for t, cap in enumerate(caps))

    def _make_fingerprint(self) -> str:
        h = hashlib.sha256()
        for s in self.sizes:
            h.update(np.ascontiguousarray(np.stack([s.tokens, s.width, s.height]), dtype="<i8").tobytes())
        h.update(repr((self.tiers.fingerprint(), float(self.tiers.max_upscale), self.schedule)).encode())
        return h.hexdigest()[:16]

    # ---------------------------------------------------------------- the draw
    def draw(self, epoch: int) -> np.ndarray:
        """Each row's tier in ``epoch``: int64 ``(n,)``, ``-1`` where it is eligible in no tier."""
        e = int(epoch)
        if e not in self._draws:
            if len(self._draws) >= 2:
                self._draws.pop(next(iter(self._draws)))
            comb = random_tier_ids(self.tier_ids, self.tiers.offsets, self.seed, e).astype(np.int64)  # (n,)
            tier = np.searchsorted(self.tiers.offsets, comb, side="right") - 1
            self._draws[e] = np.where(comb >= 0, tier, -1)
        return self._draws[e]

    def epoch_sizes(self, epoch: int) -> FittedSizes:
        """The fitted size every row trains at in ``epoch`` (its drawn tier's), ``(n,)``; no tier: zeros."""
        tier = self.draw(epoch)
        stacked = [np.stack([getattr(s, f) for s in self.sizes]) for f in FittedSizes.__dataclass_fields__]
        cols = np.arange(tier.size)
        return FittedSizes(*(np.where(tier >= 0, a[np.maximum(tier, 0), cols], 0).astype(a.dtype) for a in stacked))

    def tier_rows(self, epoch: int | None = None) -> list[int]:
        """Rows that draw each tier in ``epoch`` (default: current), ``(T,)``."""
        tier = self.draw(self._epoch if epoch is None else epoch)
        return np.bincount(tier[tier >= 0], minlength=self.tiers.num_tiers).tolist()

    # ---------------------------------------------------------------- the parent's hooks
    def plan(self, epoch: int | None = None) -> PackPlan:
        """The epoch's :class:`~hf_arb.packing.PackPlan` over the rows' drawn sizes."""
        e = self._epoch if epoch is None else int(epoch)
        if e not in self._plans:
            if len(self._plans) >= 2:
                self._plans.pop(next(iter(self._plans)))
            self._plans[e] = plan_packs(self.epoch_sizes(e).tokens, self.max_tokens, self.num_replicas,
                                        seed=self.seed, epoch=e, window=self.window, shuffle=self.shuffle,
                                        leftover=self.leftover)
            self._steps_cache[e] = self._plans[e].num_steps
        return self._plans[e]

    def keys(self, rows: np.ndarray, epoch: int) -> list:
        """``(row, width, height, epoch)`` at each row's drawn tier (or row indices)."""
        if not self.return_keys:
            return rows.tolist()
        tier = self.draw(epoch)[rows]
        w = [int(self.sizes[t].width[r]) for t, r in zip(tier.tolist(), rows.tolist())]
        h = [int(self.sizes[t].height[r]) for t, r in zip(tier.tolist(), rows.tolist())]
        return [(r, a, b, epoch) for r, a, b in zip(rows.tolist(), w, h)]

    def state_dict(self) -> dict[str, Any]:
        """:meth:`PackBatchSampler.state_dict` plus the tiers and the schedule (the fingerprint covers them)."""
        return {**super().state_dict(), "tiers": list(self.tiers.resolutions), "schedule": self.schedule}

    def mean_crop_fraction(self) -> float:
        """Mean share cropped to the patch grid over the rows packable in the current epoch."""
        s = self.epoch_sizes(self._epoch)
        ok = s.tokens > 0
        return float(s.crop_fraction[ok].mean()) if ok.any() else 0.0

    def __repr__(self) -> str:
        return (f"TieredPackBatchSampler(rows={self._n}, tiers={list(self.tiers.resolutions)}, "
                f"max_tokens={self.max_tokens}, num_replicas={self.num_replicas}, seed={self.seed}, "
                f"epoch={self._epoch}, batches_consumed={self._consumed}, steps_per_epoch={self.steps_per_epoch})")
