"""The start-up tables of the map-style and packed sources: buckets and rows, the sampler's report and diffusers'
step arithmetic (the stream's is :func:`hf_arb.train.sources.stream.stream_startup_report`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..schedule import Schedule
from .loaders import packable_rows, packing_report


def batch_size_flags(args: Any) -> str:
    """The flags that gave each bucket its own batch size, as the user typed them (for the run's report)."""
    if getattr(args, "max_pixels_per_batch", None):
        return f"--max_pixels_per_batch {args.max_pixels_per_batch}"
    given = [f"--{k} {getattr(args, k)}" for k in ("video_token_budget", "image_train_batch_size")
             if getattr(args, k, None) is not None]
    return " and ".join(given)


def bucketed_report(accelerator: Any, source: Any, schedule: Schedule, models: Any) -> None:
    """The table users look at first: buckets, rows per bucket, the sampler's report, the step arithmetic."""
    if not accelerator.is_main_process:
        return
    args, buckets, sampler = source.args, source.buckets, source.sampler
    ids = np.asarray(source.ds.with_format("numpy")["bucket"])
    counts = np.bincount(ids[ids >= 0], minlength=len(buckets))
    sizes = getattr(sampler, "batch_sizes", None)  # --max_pixels_per_batch: {bucket: batch size per device}
    clips = np.asarray(buckets.resolutions).shape[1] == 3  # (W, H, F) buckets: a frames column
    lines = [f"{'bucket':>11} {'aspect':>7}" + (f" {'frames':>6}" if clips else "") + f" {'rows':>9}"
             + (f" {'batch':>6}" if sizes else "")]
    for i in buckets.portrait_to_landscape():
        w, h = buckets.resolutions[i][:2]
        lines.append(f"{w:>5} x {h:<5} {w / h:7.3f}" + (f" {buckets.resolutions[i][2]:>6}" if clips else "")
                     + f" {int(counts[i]):>9,}" + (f" {sizes.get(int(i), '-'):>6}" if sizes else ""))
    lines.append(f"skipped: {int((ids < 0).sum()):,} of {len(ids):,} rows")
    print("\n".join(lines), flush=True)
    print(sampler.report(), flush=True)
    per_device = sampler.per_rank_batch_size if sizes else args.train_batch_size
    total = per_device * accelerator.num_processes * args.gradient_accumulation_steps
    if source.family_report:  # the family's own lines (SD3 / Flux: each bucket's shift)
        print(source.family_report, flush=True)
    print(f"***** Running training ({models.family.title}) *****\n"
          f"  Num examples = {int((ids >= 0).sum())}\n  Num Epochs = {schedule.num_train_epochs}\n"
          f"  Instantaneous batch size per device = {per_device}"
          f"{f' (at most; per bucket with {batch_size_flags(args)}: the batch column above)' if sizes else ''}\n"
          f"  Total train batch size (w. parallel, distributed & accumulation) = {total}\n"
          + step_lines(args, schedule), flush=True)


def step_lines(args: Any, schedule: Schedule) -> str:
    """The step arithmetic every mode's start-up report ends with."""
    return (f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}\n"
            f"  Total optimization steps = {schedule.max_train_steps}")


def tiered_report(accelerator: Any, source: Any, schedule: Schedule, models: Any) -> None:
    """Several tiers: rows, batches and steps per tier."""
    if not accelerator.is_main_process:
        return
    args, buckets, sampler = source.args, source.buckets, source.sampler
    report = sampler.report()
    sizes = "\n  ".join(buckets.batch_size_lines(sampler.tier_batch_sizes))
    if source.family_report:
        print(source.family_report, flush=True)
    print(f"{report}\n***** Running training ({models.family.title}, {len(buckets.bucket_sets)} resolution tiers, "
          f"--resolution_schedule {buckets.schedule}) *****\n"
          f"  Num examples = {report.rows_total - report.rows_no_tier}\n  Num Epochs = {schedule.num_train_epochs}"
          f"\n  {sizes}\n"
          + step_lines(args, schedule), flush=True)


def packed_report(accelerator: Any, source: Any, schedule: Schedule, models: Any) -> None:
    """--packing: this epoch's packs, padding and left-out rows, then the step arithmetic."""
    if not accelerator.is_main_process:
        return
    args, sampler = source.args, source.sampler
    print(packing_report(sampler), flush=True)
    print(f"***** Running training ({models.family.title}, packed) *****\n"
          f"  Num examples = {packable_rows(sampler)}\n  Num Epochs = {schedule.num_train_epochs}\n"
          f"  One pack of <= {args.max_tokens} tokens per device and step "
          f"({sampler.report().mean_images_per_pack:.2f} images on average)\n"
          + step_lines(args, schedule), flush=True)


__all__ = ["batch_size_flags", "bucketed_report", "packed_report", "step_lines", "tiered_report"]
