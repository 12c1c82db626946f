"""Multi-resolution training in the script: ``--resolution 512,1024`` trains several *tiers*, each with the bucket
set the same preset rule builds at its resolution, in one :class:`~hf_arb.sampling.tiers.TieredBatchSampler`
whose ``--resolution_schedule`` says which tier trains when (docs/tiers.md, "In the training script").

A single ``--resolution`` keeps the single-tier path exactly; nothing here runs then. With several tiers:

* :func:`tiers_from_args` builds the :class:`~hf_arb.sampling.tier_plan.Tiers` (``--bucket_preset`` /
  ``--bucket_step`` / ``--bucket_metric`` / ``--max_aspect_error`` at every resolution, ``--max_upscale``);
* :class:`TierTable` is the run's bucket table over every (tier, bucket) pair: combined id
  ``offsets[tier] + bucket``, a ``(K, 2)`` ``resolutions`` table and labels ``"WxH@R"``. It stands where the
  script keeps a BucketSet (the loss per bucket, the batch traces, the family's bucket checks and flow shift table,
  the validation shapes, ``buckets.json`` and the model card);
* :class:`TieredImages` turns the sampler's ``(row, tier, bucket, epoch)`` keys into the image dataset's
  ``(row, combined id, epoch)`` keys: each row is fitted to its batch's bucket *in that tier*, and the batch's
  ``buckets`` carry the combined ids.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from hf_arb.checks import UsageError

#: the single-tier features a run with several tiers does not support yet, with the reason (refused by name)
UNSUPPORTED = {"no_bucket_sync": "every rank trains the same (tier, bucket) at each step",
               "aspect_ratio_buckets": "an explicit table cannot be scaled to each tier's resolution"}


def parse_resolutions(text: str) -> tuple[int, ...]:
    """``--resolution``'s value: one side (``512``) or several tiers (``512,1024``), unique positive ints."""
    try:
        values = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a side in pixels or a list of them (e.g. 512 or "
                                         "512,1024)") from None
    if len(set(values)) != len(values) or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the tiers must be distinct sides >= 1 (e.g. 512,1024)")
    return values


def split_resolution(args: argparse.Namespace) -> None:
    """After parsing: ``args.resolution`` is the first tier (what the single-tier code reads: the annotation's
    table, the family defaults) and ``args.resolutions`` every tier (None until the family default is known)."""
    value = args.resolution
    args.resolutions = list(value) if value is not None else None
    args.resolution = value[0] if value is not None else None


def check_tier_flags(args: argparse.Namespace) -> None:
    """Refuse, in one line naming the flag, what a run with several tiers does not do (and the tier flags without
    tiers). Sets ``args.resolutions`` (one tier: ``[--resolution]``) and ``args.resolution_schedule``."""
    if args.resolutions is None:
        args.resolutions = [args.resolution]
    if len(args.resolutions) == 1:
        for flag, value in (("resolution_schedule", args.resolution_schedule), ("max_upscale", args.max_upscale)):
            if value is not None:
                raise UsageError(f"--{flag} {value} needs several tiers, but --resolution is {args.resolution}: "
                                 f"give several (e.g. --resolution {args.resolution},{2 * args.resolution}) or drop "
                                 f"--{flag}.")
        return
    res = ",".join(map(str, args.resolutions))
    from hf_arb.checks import check_resolution

    for side in args.resolutions:  # a pixel count among the tiers (the first one is checked with the other flags)
        try:
            check_resolution(side, "--resolution")
        except ValueError as e:
            raise UsageError(str(e)) from None
    for flag, why in UNSUPPORTED.items():
        if getattr(args, flag):
            raise UsageError(f"--{flag} is not supported with several tiers (--resolution {res}) yet: {why}. Drop "
                             f"--{flag} or train one tier.")
    if args.bucket_leftover == "catch_all":
        raise UsageError(f"--bucket_leftover catch_all is not supported with several tiers (--resolution {res}): a "
                         "catch-all batch would mix the buckets of a tier. Use --bucket_leftover drop or fill.")
    if args.max_upscale is not None and not (args.max_upscale > 0 and np.isfinite(args.max_upscale)):
        raise UsageError(f"--max_upscale must be a number > 0 (1: never upscale), got {args.max_upscale}.")
    if args.bucket_preset is not None:
        from hf_arb.buckets.presets import PRESET_INFO

        if PRESET_INFO[args.bucket_preset].default_resolution is None:
            raise UsageError(f"--bucket_preset {args.bucket_preset} is a fixed table: it cannot be scaled to each "
                             f"tier of --resolution {res}. Use a preset that follows --resolution (e.g. budget).")
    from hf_arb.sampling.tiered.schedule import parse_resolution_schedule

    args.resolution_schedule = args.resolution_schedule or "random"
    try:
        parse_resolution_schedule(args.resolution_schedule, args.resolutions)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.packing:  # a pack holds every image at its own size: a tier is a token cap (random: drawn per row and
        # epoch, a pack mixes tiers; a step schedule: one pack stream per tier, every step of one tier)
        if args.max_tokens is None:  # one image of the largest tier, as one --resolution gives
            args.max_tokens = (max(args.resolutions) // 16) ** 2


def tiers_from_args(args: argparse.Namespace) -> Any:
    """The run's :class:`~hf_arb.sampling.tier_plan.Tiers`: at every ``--resolution`` tier the table that
    ``--bucket_preset`` / ``--bucket_step`` / ``--bucket_metric`` / ``--max_aspect_error`` build there (the first
    one is the table the dataset is annotated with), and ``--max_upscale`` (default 1: never upscale)."""
    from hf_arb.buckets.resolve import resolve_buckets
    from hf_arb.sampling.tiered.plan import Tiers

    sides = {k: v for k in ("min_side", "max_side") if (v := getattr(args, f"bucket_{k}", None)) is not None}
    sets = [resolve_buckets(args.bucket_preset, None, resolution=r, step=args.bucket_step, metric=args.bucket_metric,
                            max_aspect_error=args.max_aspect_error, **sides)[0] for r in args.resolutions]
    return Tiers(tuple(args.resolutions), tuple(sets), 1.0 if args.max_upscale is None else float(args.max_upscale))


class TierTable:
    """Every (tier, bucket) pair of a run as one table: combined id ``offsets[t] + b``.

    Attributes:
        tiers: the :class:`~hf_arb.sampling.tier_plan.Tiers`.
        schedule: the ``--resolution_schedule`` text.
        offsets: first combined id of each tier, int64 ``(T + 1,)``.
        resolutions: ``(width, height)`` of every combined id, int64 ``(K, 2)``.
    """

    def __init__(self, tiers: Any, schedule: str) -> None:
        self.tiers, self.schedule = tiers, schedule
        self.offsets = tiers.offsets
        self.resolutions = np.concatenate([np.asarray(b.resolutions) for b in tiers.bucket_sets]).astype(np.int64)
        self.bucket_sets = tiers.bucket_sets

    def __len__(self) -> int:
        return int(self.resolutions.shape[0])

    def combined(self, tier: int, bucket: int) -> int:
        """The combined id of ``bucket`` of ``tier``."""
        return int(self.offsets[tier]) + int(bucket)

    def tier_of(self, combined: int) -> int:
        """The tier of a combined id."""
        return int(np.searchsorted(self.offsets, combined, side="right") - 1)

    def labels(self) -> list[str]:
        """``"WxH@R"`` per combined id (``R`` the tier's resolution): unique over the tiers."""
        return [f"{w}x{h}@{self.tiers.resolutions[self.tier_of(i)]}"
                for i, (w, h) in enumerate(self.resolutions.tolist())]

    def portrait_to_landscape(self) -> np.ndarray:
        """Combined ids tier by tier, each tier's buckets tallest first: int64 ``(K,)``."""
        return np.concatenate([self.offsets[t] + b.portrait_to_landscape() for t, b in enumerate(self.bucket_sets)])

    def to_dict(self) -> dict[str, Any]:
        """``buckets.json`` of a tiered run: the schedule, ``max_upscale`` and every tier's BucketSet."""
        return {"schedule": self.schedule, "max_upscale": self.tiers.max_upscale,
                "tiers": [{"resolution": r, "buckets": b.to_dict()}
                          for r, b in zip(self.tiers.resolutions, self.bucket_sets)]}

    def batch_size_lines(self, sizes: list[np.ndarray], shown: int = 4) -> list[str]:
        """The startup report's batch sizes, readable: one line when every bucket of every tier has the same one,
        else a line per tier grouping its buckets by batch size, largest first (``shown`` bucket labels per group).

        Args:
            sizes: per-rank batch size of every (tier, bucket), one ``(k_t,)`` int array per tier (the sampler's
                ``tier_batch_sizes``).
        """
        distinct = np.unique(np.concatenate([np.asarray(s).ravel() for s in sizes]))
        if distinct.size == 1:
            return [f"Batch size per device = {int(distinct[0])} (every bucket of every tier)"]
        lines = ["Batch size per device, by tier and bucket:"]
        for r, b, s in zip(self.tiers.resolutions, self.bucket_sets, sizes):
            labels, order = b.labels(), b.portrait_to_landscape().tolist()
            groups = []
            for size in sorted({int(s[i]) for i in order}, reverse=True):
                names = [labels[i] for i in order if int(s[i]) == size]
                more = f" and {len(names) - shown} more" if len(names) > shown else ""
                groups.append(f"{size} in {', '.join(names[:shown])}{more}")
            lines.append(f"  tier {r}: " + "; ".join(groups))
        return lines

    def card_lines(self) -> list[str]:
        """The model card's lines on the tiers and the schedule."""
        lines = [f"* resolution tiers: {', '.join(map(str, self.tiers.resolutions))} "
                 f"(`--resolution_schedule {self.schedule}`, upscale at most {self.tiers.max_upscale:g}x)"]
        for r, b in zip(self.tiers.resolutions, self.bucket_sets):
            labels = b.labels()
            lines.append(f"  * tier {r}: {len(labels)} buckets ({', '.join(labels[:8])}"
                         f"{', ...' if len(labels) > 8 else ''})")
        return lines


def tier_table(args: argparse.Namespace) -> TierTable | None:
    """The run's :class:`TierTable`, or None for a single-tier run."""
    if len(getattr(args, "resolutions", None) or []) < 2:
        return None
    return TierTable(tiers_from_args(args), args.resolution_schedule)


def make_tier_pack_sampler(args: argparse.Namespace, ds: Any, table: TierTable, accelerator: Any) -> Any:
    """--packing on several tiers: each image trains at its own size capped at ``(tier // 16)²`` tokens, in packs of
    ``--max_tokens``; ``random``: each image draws a tier per epoch and packs mix tiers; a step schedule: one pack
    stream per tier, every step of the schedule's tier (docs/tiers.md, "With packing")."""
    from hf_arb.packing.tier_sampler import TieredPackBatchSampler

    try:
        return TieredPackBatchSampler(ds, table.tiers, args.max_tokens, num_replicas=accelerator.num_processes,
                                      rank=accelerator.process_index, seed=args.seed, schedule=table.schedule,
                                      leftover="fill" if args.bucket_leftover == "fill" else "drop",
                                      log_report=False)
    except ValueError as err:
        raise UsageError(f"--packing --max_tokens {args.max_tokens} --resolution "
                         f"{','.join(map(str, table.tiers.resolutions))}: {err}") from None


def make_tier_sampler(args: argparse.Namespace, ds: Any, table: TierTable, accelerator: Any) -> Any:
    """The tiered global plan from the annotated dataset's stored sizes, prepared by accelerate as the
    single-tier sampler is (no ``rank=``: ``accelerator.prepare`` deals the plan)."""
    from hf_arb.sampling.tiered.sampler import TieredBatchSampler

    try:
        return TieredBatchSampler.from_dataset(
            ds, table.tiers, args.resolution_schedule, batch_size=args.train_batch_size,
            max_pixels_per_batch=args.max_pixels_per_batch, num_replicas=accelerator.num_processes, seed=args.seed,
            leftover=args.bucket_leftover, return_keys=True)
    except ValueError as e:  # no full batch in a tier, a budget below a bucket: in flags
        raise UsageError(f"--resolution {','.join(map(str, table.tiers.resolutions))} "
                         f"--resolution_schedule {args.resolution_schedule}: {e}") from None


class TieredImages:
    """The dataset of a tiered run: key ``(row, tier, bucket, epoch)`` → the sample of ``images`` at the combined
    id, i.e. the row fitted to that bucket's size in that tier. ``images``: a
    :class:`~hf_arb.images.dataset.BucketedImageDataset` over the :class:`TierTable`'s resolutions, or the
    ``CachedLatentDataset`` of a cache built over combined ids (``--cache_latents``)."""

    def __init__(self, images: Any, table: TierTable) -> None:
        self.images, self.table = images, table
        self.collate = images.collate

    def __len__(self) -> int:
        return len(self.images)

    def key(self, key: Any) -> tuple[int, int, int]:
        """``(row, tier, bucket, epoch)`` → ``(row, combined id, epoch)``."""
        row, tier, bucket, epoch = (int(k) for k in key)
        return row, self.table.combined(tier, bucket), epoch

    def __getitem__(self, key: Any) -> dict[str, Any]:
        return self.images[self.key(key)]

    def fit_row(self, row: int, tier: int, bucket: int, epoch: int) -> Any:
        """The fit plan of ``row`` in ``bucket`` of ``tier`` (its ``target_size`` is that bucket's size)."""
        return self.images.fit_row(*self.key((row, tier, bucket, epoch)))


def tier_pairs(ds: Any, table: TierTable) -> set[tuple[int, int]]:
    """``(row, combined id)`` of every (tier, bucket) a row is eligible for: what ``--cache_latents`` encodes (each
    image once per tier it can train at; the schedule picks among them)."""
    from hf_arb.sampling.tiered.plan import tier_bucket_ids

    t = ds.select_columns(["original_width", "original_height"]).with_format("arrow")[:]
    w, h = (t.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
            for c in ("original_width", "original_height"))
    ids = tier_bucket_ids(w, h, table.tiers)  # (T, n) int16, -1: not eligible
    pairs: set[tuple[int, int]] = set()
    for tier in range(ids.shape[0]):
        rows = np.flatnonzero(ids[tier] >= 0)
        pairs.update(zip(rows.tolist(), (ids[tier, rows].astype(np.int64) + table.offsets[tier]).tolist()))
    return pairs


__all__ = ["TierTable", "TieredImages", "UNSUPPORTED", "check_tier_flags", "make_tier_pack_sampler",
           "make_tier_sampler", "parse_resolutions",
           "split_resolution", "tier_pairs", "tier_table", "tiers_from_args"]
