"""Floor 6, ``packing/``: NaViT-style packs — several images at their own size in one sequence.

- :mod:`~hf_arb.packing.layout` — each row's fitted size and token count (pure numpy);
- :mod:`~hf_arb.packing.plan` — :func:`plan_packs`, first-fit-decreasing packs per rank (pure numpy);
- :mod:`~hf_arb.packing.sampler` — :class:`PackBatchSampler`, the resumable sampler around the plan;
  :mod:`~hf_arb.packing.tier_sampler` — :class:`TieredPackBatchSampler`, packs over several resolution tiers;
- :mod:`~hf_arb.packing.dataset` — :class:`PackedImageDataset`, a pack's images fitted at their own size;
- :mod:`~hf_arb.packing.attention`, :mod:`~hf_arb.packing.model` — block-diagonal attention and the packed
  SD3/Flux forwards; :mod:`~hf_arb.packing.loss` — the per-image flow-matching loss of a pack;
- :mod:`~hf_arb.packing.family` — what a flow family adapter needs to train packs.

May import: the ground floor, :mod:`hf_arb.buckets`, :mod:`hf_arb.images`, :mod:`hf_arb.sampling`,
:mod:`hf_arb.families`.
"""

from typing import Any

from .layout import FittedSizes, PackMeta, fit_sizes, pack_meta
from .plan import DEFAULT_WINDOW, PackLeftover, PackPlan, PackReport, first_fit_decreasing, plan_packs

__all__ = ["DEFAULT_WINDOW", "FittedSizes", "PackBatchSampler", "PackLeftover", "PackMeta", "PackPlan", "PackReport",
           "first_fit_decreasing", "fit_sizes", "pack_meta", "plan_packs"]


def __getattr__(name: str) -> Any:
    """``hf_arb.packing.PackBatchSampler``, imported on first use (it loads torch; the plan functions do not)."""
    if name == "PackBatchSampler":
        from .sampler import PackBatchSampler

        return PackBatchSampler
    raise AttributeError(f"module 'hf_arb.packing' has no attribute {name!r}")
