"""``hf-arb stats DATASET --resolution 512,1024``: rows per (tier, bucket) of a multi-resolution run.

The tiers are the ones the training script builds from the same flags (``--resolution 512,1024`` with
``--preset`` / ``--step`` / ``--metric`` / ``--max-aspect-error`` at every resolution, ``--max-upscale``); each row's
bucket in every tier comes vectorised from the stored ``original_width`` / ``original_height``
(:func:`~hf_arb.sampling.tiered.plan.tier_bucket_ids`), exactly as the
:class:`~hf_arb.sampling.tiered.sampler.TieredBatchSampler` derives it. ``--chart PATH`` draws the tier chart
(:func:`~hf_arb.annotate.plot.plot_tier_chart`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.buckets.matching import METRICS
from hf_arb.buckets.presets import PRESET_INFO, PRESETS
from hf_arb.wording import count

from .buckets import UsageError, non_negative_float, positive_int

#: the flags that describe the tiers (all but --resolution need it)
TIER_FLAGS = ("preset", "step", "metric", "max_aspect_error", "max_upscale")


def tier_sides(text: str) -> tuple[int, ...]:
    """argparse type of stats' ``--resolution``: one side or several tiers (``512,1024``), distinct, positive."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a side in pixels or a list of them (e.g. 512,1024), got "
                                         f"{text!r}") from None
    if min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"the tiers must be distinct sides >= 1 (e.g. 512,1024), got {text!r}")
    return values


def _upscale(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be a finite number > 0 (1: never upscale), got 0")
    return value


def add_tier_arguments(p: argparse.ArgumentParser) -> None:
    """The tier options of ``hf-arb stats`` (the training script's, in hf-arb's spelling)."""
    g = p.add_argument_group("tiers (rows per tier and bucket of a multi-resolution run, docs/tiers.md)")
    g.add_argument("--resolution", type=tier_sides, default=None, metavar="R1,R2,...",
                   help="the run's tiers (e.g. 512,1024): print rows per (tier, bucket) instead of the stored "
                        "buckets")
    g.add_argument("--preset", choices=PRESETS, default=None,
                   help="the bucket rule at every tier (default budget); a fixed table (sdxl, novelai) is refused")
    g.add_argument("--step", type=positive_int, default=None, help="side multiple of every tier's buckets")
    g.add_argument("--metric", choices=(*METRICS, "native"), default=None, help="aspect distance (default log)")
    g.add_argument("--max-aspect-error", type=non_negative_float, default=None,
                   help="a row farther than this from every bucket of a tier is not eligible there")
    g.add_argument("--max-upscale", type=_upscale, default=None, metavar="F",
                   help="a row serves a tier only if covering its bucket there needs at most F times upscale "
                        "(default 1: never upscale)")


def tiers_from_stats_args(args: argparse.Namespace) -> Any:
    """The :class:`~hf_arb.sampling.tiered.plan.Tiers` the flags describe; None without ``--resolution`` (then the
    other tier flags are refused, naming the flag)."""
    if args.resolution is None:
        for name in TIER_FLAGS:
            if getattr(args, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} describes the tiers, but no --resolution is given: add the tiers (e.g. "
                                 f"--resolution 512,1024) or drop {flag}.")
        return None
    from hf_arb.buckets.resolve import resolve_buckets
    from hf_arb.sampling.tiered.plan import Tiers  # imports hf_arb.sampling, hence torch: only for tiers

    preset = args.preset or "budget"
    if PRESET_INFO[preset].default_resolution is None:
        raise UsageError(f"--preset {preset} is a fixed table: it cannot be scaled to each tier of --resolution "
                         f"{','.join(map(str, args.resolution))}. Use a preset that follows --resolution (e.g. "
                         "budget).")
    sets = [resolve_buckets(preset, None, resolution=r, step=args.step, metric=args.metric or "log",
                            max_aspect_error=args.max_aspect_error)[0] for r in args.resolution]
    return Tiers(tuple(args.resolution), tuple(sets), 1.0 if args.max_upscale is None else args.max_upscale)


def stored_sizes(part: Any) -> tuple[np.ndarray, np.ndarray]:
    """``original_width``, ``original_height`` of an annotated split as float64 ``(n,)`` (nulls: NaN)."""
    missing = [c for c in ("original_width", "original_height") if c not in part.column_names]
    if missing:
        raise UsageError(f"the dataset has no {' or '.join(missing)} column, which the tiers are derived from: "
                         "annotate it with hf-arb annotate first.")
    t = part.select_columns(["original_width", "original_height"]).with_format("arrow")[:]
    return tuple(t.column(c).to_numpy(zero_copy_only=False).astype(np.float64)  # type: ignore[return-value]
                 for c in ("original_width", "original_height"))


def format_tier_counts(tiers: Any, counts: list[np.ndarray], no_tier: int, rows: int,
                       no_tier_examples: tuple[str, ...] = ()) -> str:
    """The printed table: per tier its eligible rows and buckets, then rows per bucket (portrait → landscape);
    ``no_tier_examples``: lines naming some of the rows in no tier (:func:`no_tier_examples`)."""
    lines = [f"rows: {rows:,}  in no tier: {no_tier:,} (no bucket, or too small for every tier under max upscale "
             f"{float(tiers.max_upscale):g}x); a row counts in every tier it can train at",
             *(f"  {line}" for line in no_tier_examples)]
    if no_tier > len(no_tier_examples) > 0:
        lines.append(f"  ... and {no_tier - len(no_tier_examples):,} more")
    for res, bs, c in zip(tiers.resolutions, tiers.bucket_sets, counts):
        share = f" ({c.sum() / rows:.0%})" if rows else ""
        lines.append(f"tier {res}: {count(int(c.sum()), 'row')}{share} in {int((c > 0).sum())} of "
                     f"{count(len(bs), 'bucket')}")
        labels = bs.labels()
        for b in bs.portrait_to_landscape().tolist():
            if c[b]:
                lines.append(f"  {labels[b]:>11}  {int(c[b]):>8,}")
    return "\n".join(lines)


#: rows in no tier the tier table names
NO_TIER_SHOWN = 5


def no_tier_examples(part: Any, ids: np.ndarray, image_column: str = "image",
                     limit: int = NO_TIER_SHOWN) -> tuple[str, ...]:
    """The first ``limit`` rows of ``part`` that are in no tier (``ids`` ``(T, n)``: ``-1`` in every tier), each as
    ``row 3 (photos/a.jpg): 40x30, too small for every tier`` (the file where the dataset records one) or
    ``...: no size``."""
    from hf_arb.annotate.summary import row_label, row_paths

    rows = np.flatnonzero((ids < 0).all(axis=0))[:limit].tolist()
    if not rows:
        return ()
    w, h = stored_sizes(part)
    paths = row_paths(part, image_column, rows) if image_column in part.column_names else [None] * len(rows)
    return tuple(f"{row_label(r, p)}: " + (f"{int(w[r])}x{int(h[r])}, too small for every tier"
                                             if np.isfinite(w[r]) and np.isfinite(h[r]) and w[r] > 0 and h[r] > 0
                                             else "no size (skipped at annotation)")
                 for r, p in zip(rows, paths))


def run_tier_stats(args: argparse.Namespace, splits: list[tuple[str, Any]], tiers: Any) -> int:
    """Print rows per (tier, bucket) of every split and, with ``--chart``/``--plot``, draw them over all splits."""
    from hf_arb.sampling.tiered.plan import tier_bucket_ids
    from hf_arb.sampling.tiered.report import tier_row_counts

    print(f"tiers {','.join(map(str, tiers.resolutions))}: "
          + "; ".join(f"{r}: {b!r}" for r, b in zip(tiers.resolutions, tiers.bucket_sets)))
    total = [np.zeros(len(b), np.int64) for b in tiers.bucket_sets]
    rows = 0
    for split, part in splits:
        ids = tier_bucket_ids(*stored_sizes(part), tiers)  # (T, n) int16
        counts, no_tier = tier_row_counts(ids, tiers.num_buckets)
        print(f"== {split} ==")
        examples = no_tier_examples(part, ids, getattr(args, "image_column", None) or "image")
        print(format_tier_counts(tiers, counts, no_tier, ids.shape[1], examples))
        total = [a + c for a, c in zip(total, counts)]
        rows += ids.shape[1]
    if args.plot:
        try:
            from hf_arb.annotate.plot import plot_tier_chart

            chart = plot_tier_chart(tiers, total, Path(args.plot), rows_total=rows,
                                    title=f"{args.dataset}: rows per tier and bucket "
                                          f"(max upscale {float(tiers.max_upscale):g}x)")
        except ImportError as e:
            print(f"no chart: {e}", file=sys.stderr)
            return 1
        print(f"chart: {chart}")
    return 0


__all__ = ["NO_TIER_SHOWN", "TIER_FLAGS", "add_tier_arguments", "format_tier_counts", "no_tier_examples",
           "run_tier_stats", "stored_sizes", "tier_sides", "tiers_from_stats_args"]
