"""Epoch planning and batch sampling, one concern per module.

- :mod:`~hf_arb.sampling.plan` — :func:`plan_epoch`, the pure function (and input validation, merging);
- :mod:`~hf_arb.sampling.layout` — the epoch layouts (synchronised and independent) behind one interface;
- :mod:`~hf_arb.sampling.sync` — the synchronised layout, every step computed directly (``O(buckets)`` state);
- :mod:`~hf_arb.sampling.batch_sizes` — a batch size per bucket (pixel budget, mapping) and the loss weights;
  :mod:`~hf_arb.sampling.ragged` — the plan with them (:func:`plan_epoch_ragged`);
- :mod:`~hf_arb.sampling.feistel` — counter-based keyed permutations of ``[0, n)``;
- :mod:`~hf_arb.sampling.index` — the bucket-grouped row index (4 bytes per row, shareable memory-mapped file);
- :mod:`~hf_arb.sampling.inputs` — what the sampler is built from (bucket ids, the world, the plan's fingerprint);
- :mod:`~hf_arb.sampling.report` — :class:`PlanReport`;
- :mod:`~hf_arb.sampling.composite` — the sampler over the composite (target, reference buckets…) key;
- :mod:`~hf_arb.sampling.state` — the resume state and its validation;
- :mod:`~hf_arb.sampling.sampler` — :class:`BucketBatchSampler`, a thin class around the plan
  (:mod:`~hf_arb.sampling.plan_views` its read-only views of the plan, :mod:`~hf_arb.sampling.world` its processes
  and batch sizes, :mod:`~hf_arb.sampling.restore` what its first accelerate pass after a restore does);
- :mod:`~hf_arb.sampling.accelerate` — optional conveniences around ``accelerator.prepare``;
  :mod:`~hf_arb.sampling.rank` — one rank's view of the plan, for plain DDP without accelerate;
- :mod:`~hf_arb.sampling.stream` — :class:`BucketedStream`, bucketed batches from a streaming dataset;
  :mod:`~hf_arb.sampling.stream_collate` fits streamed image rows to their bucket
  (:mod:`~hf_arb.sampling.stream_plan` its pure schedule, :mod:`~hf_arb.sampling.stream_buffer` one rank's buffer);
- :mod:`~hf_arb.sampling.tiers` — :class:`TieredBatchSampler`, several resolution tiers in one resumable plan
  (:mod:`~hf_arb.sampling.tier_plan` the tier columns, :mod:`~hf_arb.sampling.tier_schedule` the schedules,
  :mod:`~hf_arb.sampling.tier_random` the ``random`` schedule's per-group draw, :mod:`~hf_arb.sampling.tier_state`
  its state, :mod:`~hf_arb.sampling.tier_report` :class:`TierReport`;
  :mod:`~hf_arb.sampling.tier_files` its node-shared files;
  :mod:`~hf_arb.sampling.tier_stream` :class:`TieredStream`, the same from a streaming dataset, and
  :mod:`~hf_arb.sampling.tier_stream_random` its ``random`` schedule;
  :mod:`~hf_arb.sampling.cursor` the position and restore rules both samplers share).

``hf_arb.sampling.PackBatchSampler`` (release 0.1) is :class:`hf_arb.packing.PackBatchSampler`, imported on first
use: packing is built on sampling, so sampling never imports it at import time.

May import: the ground floor, :mod:`hf_arb.buckets` and :mod:`hf_arb.images`.
"""

from typing import Any

from .accelerate import prepare_dataloader, resume_dataloader
from .batch_sizes import accumulation_weights, batch_sizes_for_pixels, batch_sizes_from_mapping
from .plan import merge_small_buckets, plan_epoch
from .ragged import RaggedPlan, plan_epoch_ragged
from .report import PlanReport
from .rank import RankBatchSampler
from .sampler import BucketBatchSampler
from .stream import BucketedStream, BufferOverflowError, build_stream_loader, shuffle_shards
from .stream_collate import StreamImageCollate
from .stream_plan import StreamReport, stream_schedule
from .tier_plan import Tiers, tier_bucket_ids
from .tier_report import TierReport
from .tier_schedule import (TierSchedule, curriculum_schedule, mix_schedule, parse_resolution_schedule,
                            progressive_schedule, random_schedule)
from .tier_stream import TieredStream, tier_stream_counts
from .tiers import TieredBatchSampler

__all__ = ["BucketBatchSampler", "BucketedStream", "BufferOverflowError", "PackBatchSampler", "PlanReport",
           "RaggedPlan", "RankBatchSampler", "StreamImageCollate", "StreamReport", "accumulation_weights",
           "batch_sizes_for_pixels", "batch_sizes_from_mapping", "build_stream_loader", "merge_small_buckets",
           "plan_epoch", "plan_epoch_ragged",
           "prepare_dataloader", "resume_dataloader", "stream_schedule",
           "TierReport", "TierSchedule", "TieredBatchSampler", "TieredStream", "Tiers", "curriculum_schedule", "mix_schedule",
           "parse_resolution_schedule", "progressive_schedule", "random_schedule", "shuffle_shards",
           "tier_bucket_ids", "tier_stream_counts"]


def __getattr__(name: str) -> Any:
    if name == "PackBatchSampler":  # a release-0.1 path, kept for one release (docs/api.md, moved paths)
        from hf_arb.packing.sampler import PackBatchSampler

        return PackBatchSampler
    raise AttributeError(f"module 'hf_arb.sampling' has no attribute {name!r}")
