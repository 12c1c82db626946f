"""Frozen copy of ``hf_arb.sampling`` at commit 99d2062 (``plan_version`` 1: all rows grouped per rank and
block-lazy bucket permutations), kept only as the baseline of ``benchmarks/bench_plan_scale.py``. Not part of the
package and not maintained; imports point at ``hf_arb.rng`` and ``hf_arb.buckets.schema``."""

from .plan import plan_epoch
from .sampler import BucketBatchSampler

__all__ = ["BucketBatchSampler", "plan_epoch"]
