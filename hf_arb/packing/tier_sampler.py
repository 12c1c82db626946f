"""``TieredPackBatchSampler``: NaViT packs over several resolution tiers, a pack mixing tiers (docs/tiers.md).

A pack already holds every image at its own size; a tier there is a **size cap**: at tier ``R`` an image trains at
its own aspect with at most ``(R / (vae_scale_factor × patch_size))²`` latent tokens (what ``--packing`` gives one
``--resolution``), never upscaled. Which tiers a row may train at is decided exactly as for bucketed tiers
(:func:`~hf_arb.sampling.tiered.plan.tier_bucket_ids`: it has a bucket in the tier's set and covers it within
``max_upscale``), so ``hf-arb stats --resolution ...`` counts the same rows.

Two designs, by schedule:

* ``random`` (OneTrainer's rule): every epoch each row draws one of its eligible tiers with the counter-based hash
  of ``(seed, epoch, row)`` (:func:`~hf_arb.sampling.tiered.plan.random_tier_ids`), takes that tier's fitted size,
  and the epoch is planned by :func:`~hf_arb.packing.plan_packs` over those token counts: **a pack mixes tiers**,
  every row trains once per epoch at one tier.
* step schedules (``mix``, ``curriculum``, ``progressive``: the schedule gives every step a tier): **one pack
  stream per tier**, as the bucketed step schedules keep one stream of passes per tier. Pass ``q`` of tier ``t`` is
  ``plan_packs`` over the rows eligible there at that tier's sizes (epoch key ``q·(T+1)+t``); global step ``g``
  trains the tier the schedule gives it at the next step of that tier's stream
  (:func:`~hf_arb.sampling.tiered.schedule.stream_positions`). So **every pack of a step, on every rank, is of one
  tier** (a pack does not mix tiers), and a tier that comes back continues where it stopped. A sampler epoch is
  ``steps_per_epoch`` global steps (default: the first pass of the longest tier). Finding the pass of a stream
  position plans that tier's earlier passes once (their lengths differ a little), then keeps their lengths.

Everything else (global plan step-major rank-minor, accelerate's prepare and ``skip_first_batches`` resume,
``state_dict``) is :class:`PackBatchSampler`'s.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from hf_arb.sampling.tiered.plan import Tiers, random_tier_ids, tier_bucket_ids
from hf_arb.sampling.tiered.schedule import TierSchedule, parse_resolution_schedule, stream_positions

from .layout import FittedSizes
from .plan import PackPlan, PackReport, plan_packs
from .sampler import PackBatchSampler, pack_sizes

__all__ = ["TieredPackBatchSampler", "tier_token_caps"]


def tier_token_caps(tiers: Tiers, max_tokens: int, *, vae_scale_factor: int = 8, patch_size: int = 2) -> list[int]:
    """Each tier's token cap per image: ``min(max_tokens, (R // step)²)`` with ``step = vae × patch``, ``(T,)``."""
    step = int(vae_scale_factor) * int(patch_size)
    return [min(int(max_tokens), max(1, (int(r) // step) ** 2)) for r in tiers.resolutions]


class TieredPackBatchSampler(PackBatchSampler):
    """Packs over several tiers: under ``random`` each row trains once per epoch at a drawn tier (packs mix tiers);
    under a step schedule every step trains one tier, from that tier's own pack stream.

    Args:
        source: an annotated ``datasets.Dataset`` (its ``original_width`` / ``original_height``) or
            ``(widths, heights)`` arrays ``(n,)`` (NaN or ``<= 0``: no size, eligible nowhere).
        tiers: the :class:`~hf_arb.sampling.tiered.plan.Tiers` (which tiers a row may draw; ``max_upscale``).
        max_tokens: latent tokens per pack; every tier's cap is at most this.
        schedule: ``"random"``, or a step schedule (a :class:`~hf_arb.sampling.tiered.schedule.TierSchedule` or its
            ``--resolution_schedule`` text, e.g. ``"0-2000:512,2000-:1024"``): see the module docstring.
        steps_per_epoch: step schedules: global steps per sampler epoch (default: the longest first pass of a tier
            in use); ``random`` sets it by the draw.
        **kwargs: :class:`PackBatchSampler`'s (``num_replicas``, ``rank``, ``seed``, ``leftover``, ``window``,
            ``vae_scale_factor``, ``patch_size``, ``return_keys``, ``log_report``, ``shuffle``).

    Attributes:
        sizes: one :class:`~hf_arb.packing.layout.FittedSizes` ``(n,)`` per tier (rows not eligible in a tier: all
            zero there); :class:`~hf_arb.packing.dataset.PackedImageDataset` takes them as they are.
        tier_ids: int16 ``(T, n)``, each row's bucket per tier, ``-1``: the row may not draw that tier.
    """

    def __init__(self, source: Any, tiers: Tiers, max_tokens: int, *, schedule: str | TierSchedule = "random",
                 steps_per_epoch: int | None = None, **kwargs: Any) -> None:
        sched = parse_resolution_schedule(schedule, tiers.resolutions) if isinstance(schedule, str) else schedule
        self.tier_schedule = sched.validate(tiers.num_tiers)
        if sched.per_row and steps_per_epoch is not None:
            raise ValueError("`steps_per_epoch` is set by the draw under the `random` schedule (every row once per "
                             "epoch): leave it None, or use a step schedule (mix, curriculum, progressive).")
        self._steps_arg = steps_per_epoch
        self._tier_plans: dict[tuple[int, int], PackPlan] = {}
        self._pass_lens: dict[int, list[int]] = {}
        for name in ("upscale", "max_image_tokens"):
            if name in kwargs:
                raise TypeError(f"TieredPackBatchSampler takes no `{name}`: each tier's resolution caps its images "
                                "(never upscaled).")
        #: the schedule as stored in the state (its text, or the TierSchedule's dict as JSON)
        self.tiers, self.schedule = tiers, schedule if isinstance(schedule, str) else json.dumps(sched.to_dict())
        if hasattr(source, "column_names"):
            t = source.select_columns(["original_width", "original_height"]).with_format("arrow")[:]
            w, h = (t.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
                    for c in ("original_width", "original_height"))
        else:
            w, h = (np.asarray(a, dtype=np.float64).reshape(-1) for a in source)
        self._n = w.size
        self._L: int | None = None
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
        extra = () if self._steps_arg is None else (self._steps_arg,)  # (random runs keep their fingerprint)
        h.update(repr((self.tiers.fingerprint(), float(self.tiers.max_upscale), self.schedule, *extra)).encode())
        return h.hexdigest()[:16]

    # ---------------------------------------------------------------- step schedules: one pack stream per tier
    def tier_plan(self, tier: int, q: int) -> PackPlan:
        """Pass ``q`` of tier ``tier``'s pack stream (step schedules): ``plan_packs`` over its sizes there."""
        T = self.tiers.num_tiers
        if (tier, q) not in self._tier_plans:
            if len(self._tier_plans) >= 2 * T + 2:
                self._tier_plans.pop(next(iter(self._tier_plans)))
            self._tier_plans[(tier, q)] = plan_packs(self.sizes[tier].tokens, self.max_tokens, self.num_replicas,
                                                     seed=self.seed, epoch=q * (T + 1) + tier, window=self.window,
                                                     shuffle=self.shuffle, leftover=self.leftover)
        return self._tier_plans[(tier, q)]

    def _stream_step(self, tier: int, i: int) -> tuple[int, int]:
        """``(pass, step)`` of position ``i`` of tier ``tier``'s stream (the pass lengths are kept once known)."""
        lens, q = self._pass_lens.setdefault(tier, []), 0
        while True:
            if q == len(lens):
                lens.append(self.tier_plan(tier, q).num_steps)
                if lens[q] == 0:
                    raise ValueError(f"Tier {tier} ({self.tiers.resolutions[tier]}) makes no pack per rank: its "
                                     f"eligible rows fill fewer than {self.num_replicas} packs of {self.max_tokens} "
                                     "tokens. Use a smaller `max_tokens`, a larger max_upscale, or a schedule "
                                     "without it.")
            if i < lens[q]:
                return q, i
            i, q = i - lens[q], q + 1

    def _step_plan(self, e: int) -> PackPlan:
        """Sampler epoch ``e`` of a step schedule: global steps ``[e·L, (e+1)·L)``, each rank's pack of step ``g``
        from its tier's stream; rows encoded ``tier · n + row`` (:meth:`keys` decodes them)."""
        if self._L is None:
            used = self.tier_schedule.tiers_used(self.tiers.num_tiers)
            for t in used:
                self._stream_step(t, 0)  # plans each tier's first pass (and refuses a tier without a pack per rank)
            self._L = (int(self._steps_arg) if self._steps_arg is not None
                       else max(self._pass_lens[t][0] for t in used))
        L, W, n = self._L, self.num_replicas, self._n
        tiers, pos = stream_positions(self.tier_schedule, self.seed, e * L + np.arange(L, dtype=np.int64))
        packs = []
        for t, i in zip(tiers.tolist(), pos.tolist()):
            q, s = self._stream_step(t, i)
            plan = self.tier_plan(t, q)
            packs += [plan.pack(s, r) + t * n for r in range(W)]
        rows = np.concatenate(packs) if packs else np.empty(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum([p.size for p in packs])]).astype(np.int64)
        tier, row = np.divmod(rows, n)
        tokens = np.stack([s.tokens for s in self.sizes])[tier, row]  # (total,)
        packed = np.unique(row).size
        no_tier = int((self.tier_ids < 0).all(axis=0).sum())
        report = PackReport(rows_total=n, rows_packed=packed, rows_skipped=no_tier, rows_oversize=0,
                            rows_leftover=0, packs=L * W, steps=L, rows_repeated=int(rows.size - np.unique(rows).size),
                            tokens_real=int(tokens.sum()), tokens_total=L * W * self.max_tokens,
                            padding_fraction=1 - float(tokens.sum()) / max(1, L * W * self.max_tokens),
                            mean_images_per_pack=rows.size / max(1, L * W))
        empty = np.empty(0, np.int64)
        return PackPlan(rows, offsets, W, L, self.max_tokens, empty, empty, report)

    # ---------------------------------------------------------------- the draw
    def draw(self, epoch: int) -> np.ndarray:
        """Each row's tier in ``epoch``: int64 ``(n,)``, ``-1`` where it is eligible in no tier (step schedules:
        the tier of its first pack in the epoch, ``-1`` where it is in none)."""
        e = int(epoch)
        if e not in self._draws and not self.tier_schedule.per_row:
            tier, row = np.divmod(self.plan(e).rows, self._n)
            first = np.full(self._n, -1, np.int64)
            first[row[::-1]] = tier[::-1]  # the first occurrence wins
            self._draws[e] = first
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
        """Rows that draw each tier in ``epoch`` (default: current), ``(T,)`` (step schedules: distinct rows trained
        at each tier)."""
        e = self.epoch if epoch is None else epoch
        if not self.tier_schedule.per_row:
            tier, row = np.divmod(np.unique(self.plan(e).rows), self._n)
            return np.bincount(tier, minlength=self.tiers.num_tiers).tolist()
        tier = self.draw(e)
        return np.bincount(tier[tier >= 0], minlength=self.tiers.num_tiers).tolist()

    # ---------------------------------------------------------------- the parent's hooks
    def plan(self, epoch: int | None = None) -> PackPlan:
        """The epoch's :class:`~hf_arb.packing.PackPlan` over the rows' drawn sizes."""
        e = self.epoch if epoch is None else int(epoch)
        if e not in self._plans:
            if len(self._plans) >= 2:
                self._plans.pop(next(iter(self._plans)))
            self._plans[e] = (self._step_plan(e) if not self.tier_schedule.per_row else
                              plan_packs(self.epoch_sizes(e).tokens, self.max_tokens, self.num_replicas,
                                         seed=self.seed, epoch=e, window=self.window, shuffle=self.shuffle,
                                         leftover=self.leftover))
            self._steps_cache[e] = self._plans[e].num_steps
        return self._plans[e]

    def keys(self, rows: np.ndarray, epoch: int) -> list:
        """``(row, width, height, epoch)`` at each row's drawn tier (or row indices); step schedules: ``rows`` are
        encoded ``tier · n + row``."""
        if not self.tier_schedule.per_row:
            tier, rows = np.divmod(rows, self._n)
        else:
            tier = self.draw(epoch)[rows] if self.return_keys else None
        if not self.return_keys:
            return rows.tolist()
        w = [int(self.sizes[t].width[r]) for t, r in zip(tier.tolist(), rows.tolist())]
        h = [int(self.sizes[t].height[r]) for t, r in zip(tier.tolist(), rows.tolist())]
        return [(r, a, b, epoch) for r, a, b in zip(rows.tolist(), w, h)]

    def state_dict(self) -> dict[str, Any]:
        """:meth:`PackBatchSampler.state_dict` plus the tiers and the schedule (the fingerprint covers them)."""
        return {**super().state_dict(), "tiers": list(self.tiers.resolutions), "schedule": self.schedule}

    def mean_crop_fraction(self) -> float:
        """Mean share cropped to the patch grid over the rows packable in the current epoch."""
        s = self.epoch_sizes(self.epoch)
        ok = s.tokens > 0
        return float(s.crop_fraction[ok].mean()) if ok.any() else 0.0

    def __repr__(self) -> str:
        return (f"TieredPackBatchSampler(rows={self._n}, tiers={list(self.tiers.resolutions)}, "
                f"max_tokens={self.max_tokens}, num_replicas={self.num_replicas}, seed={self.seed}, "
                f"epoch={self.epoch}, batches_consumed={self.batches_consumed}, "
                f"steps_per_epoch={self.steps_per_epoch})")
