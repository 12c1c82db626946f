"""Epoch planning and batch sampling, one concept per folder.

Subfolders (each ``__init__`` lists its modules):

- :mod:`~hf_arb.sampling.planning` — the epoch plan as pure functions (:func:`plan_epoch`, the layouts, batch sizes
  per bucket, the row index, :class:`PlanReport`);
- :mod:`~hf_arb.sampling.resume` — the one step cursor every resumable sampler holds, the first pass after a restore,
  and the resume state;
- :mod:`~hf_arb.sampling.streaming` — :class:`BucketedStream`, bucketed batches from a streaming dataset;
- :mod:`~hf_arb.sampling.tiered` — :class:`TieredBatchSampler` and :class:`TieredStream`, several resolution tiers in
  one resumable plan.

Modules here:

- :mod:`~hf_arb.sampling.sampler` — :class:`BucketBatchSampler`, one class around the plan and its cursor;
- :mod:`~hf_arb.sampling.inputs` — what the sampler is given (bucket ids, resolutions, world) read and checked;
- :mod:`~hf_arb.sampling.world` — the sampler's processes and batch sizes;
- :mod:`~hf_arb.sampling.rank` — :class:`RankBatchSampler`, one rank's view (``sampler.shard(rank)``);
- :mod:`~hf_arb.sampling.pairing` — prior preservation's pairing of instance rows with class rows of
  their bucket (pure);
- :mod:`~hf_arb.sampling.composite` — the sampler over the composite (target, reference buckets…) key;
- :mod:`~hf_arb.sampling.accelerate` — optional conveniences around ``accelerator.prepare`` and the resume recipe.

The flat modules of release 0.1 (``hf_arb.sampling.tier_plan``, ``hf_arb.sampling.stream``…) still import, with a
``DeprecationWarning`` naming the new path (:mod:`hf_arb.moved`; docs/api.md, "Moved paths").
``hf_arb.sampling.PackBatchSampler`` (release 0.1) is :class:`hf_arb.packing.PackBatchSampler`, imported on first
use: packing is built on sampling, so sampling never imports it at import time.

May import: the ground floor, :mod:`hf_arb.buckets` and :mod:`hf_arb.images`.
"""

from typing import Any

from .accelerate import prepare_dataloader, resume_dataloader
from .planning.batch_sizes import accumulation_weights, batch_sizes_for_pixels, batch_sizes_from_mapping
from .planning.plan import merge_small_buckets, plan_epoch
from .planning.ragged import RaggedPlan, plan_epoch_ragged
from .planning.report import PlanReport
from .rank import RankBatchSampler
from .sampler import BucketBatchSampler
from .streaming.collate import StreamImageCollate
from .streaming.plan import StreamReport, stream_schedule
from .streaming.stream import BucketedStream, BufferOverflowError, build_stream_loader, shuffle_shards
from .tiered.plan import Tiers, tier_bucket_ids
from .tiered.report import TierReport
from .tiered.sampler import TieredBatchSampler
from .tiered.schedule import (
    TierSchedule,
    curriculum_schedule,
    mix_schedule,
    parse_resolution_schedule,
    progressive_schedule,
    random_schedule,
)
from .tiered.stream import TieredStream, tier_stream_counts

__all__ = ["BucketBatchSampler", "BucketedStream", "BufferOverflowError", "PackBatchSampler", "PlanReport",
           "RaggedPlan", "RankBatchSampler", "StreamImageCollate", "StreamReport", "accumulation_weights",
           "batch_sizes_for_pixels", "batch_sizes_from_mapping", "build_stream_loader", "merge_small_buckets",
           "plan_epoch", "plan_epoch_ragged",
           "prepare_dataloader", "resume_dataloader", "stream_schedule",
           "TierReport", "TierSchedule", "TieredBatchSampler", "TieredStream", "Tiers", "curriculum_schedule",
           "mix_schedule",
           "parse_resolution_schedule", "progressive_schedule", "random_schedule", "shuffle_shards",
           "tier_bucket_ids", "tier_stream_counts"]


def __getattr__(name: str) -> Any:
    if name == "PackBatchSampler":  # a release-0.1 path, kept for one release (docs/api.md, moved paths)
        from hf_arb.packing.sampler import PackBatchSampler

        return PackBatchSampler
    raise AttributeError(f"module 'hf_arb.sampling' has no attribute {name!r}")
