"""Map-style sources: a dataset with bucket columns, planned globally by a batch sampler that accelerate deals to
the ranks (:class:`BucketedSource`), with reference images stacked by their composite key
(:class:`ReferenceSource`), or over several ``--resolution`` tiers (:class:`TieredSource`)."""

from __future__ import annotations

from typing import Any

from ..schedule import Schedule
from .base import Source
from .dataset import check_plan, check_upscale, dataset_with_buckets
from .loaders import build_dataloader, make_sampler
from .reports import bucketed_report, tiered_report
from .tiers import make_tier_sampler


class BucketedSource(Source):
    """A map-style dataset with bucket columns (annotated on the fly, or re-assigned to the asked table), one bucket
    per step on every rank (:class:`~hf_arb.BucketBatchSampler`); checkpointed by accelerate with the loader."""

    ds: Any = None
    references: tuple[str, ...] | list[str] = ()  # an edit model's reference columns (ReferenceSource)
    masks: Any = None  # --masked_loss: the MaskSpec of the masked sources (hf_arb.train.sources.masks)

    def load(self, accelerator: Any) -> None:
        self.ds, self.buckets = dataset_with_buckets(self.args, accelerator)
        check_plan(self.args, self.ds, 1 if accelerator is None else accelerator.num_processes)
        check_upscale(self.args, self.ds, self.buckets)

    def start(self, accelerator: Any) -> None:
        self.sampler = make_sampler(self.args, self.ds, self.buckets, accelerator, references=self.references)

    def loader(self, accelerator: Any, models: Any, schedule: Schedule, weight_dtype: Any) -> Any:
        from hf_arb.sampling.accelerate import fill_deepspeed_micro_batch

        dataloader, self.cache_index = build_dataloader(self.args, accelerator, self.ds, self.buckets, models,
                                                        self.sampler, schedule, weight_dtype,
                                                        references=self.references, masks=self.masks)
        fill_deepspeed_micro_batch(accelerator, self.sampler)  # DeepSpeed cannot read a batch sampler's batch size
        return dataloader

    def bucket_rows(self) -> Any:
        """The dataset's ``bucket`` column counted (skipped rows, id -1, left out)."""
        import numpy as np

        ids = np.asarray(self.ds.with_format("numpy")["bucket"])
        return np.bincount(ids[ids >= 0])

    def register(self, accelerator: Any) -> None:
        accelerator.register_for_checkpointing(self.sampler)  # its plan check refuses another dataset's checkpoint

    def report(self, accelerator: Any, schedule: Schedule, models: Any) -> None:
        bucketed_report(accelerator, self, schedule, models)


class ReferenceSource(BucketedSource):
    """``--reference_image_column``: an edit model's target and reference images, each fitted to its own bucket;
    a batch stacks rows of one composite (target, reference buckets) key, and ``buckets`` carry the target's
    (the sampler, the image dataset and the latent cache read the composite key of these columns)."""

    def __init__(self, args: Any, accelerator: Any) -> None:
        self.references = list(args.reference_image_column)
        super().__init__(args, accelerator)


class TieredSource(BucketedSource):
    """Several ``--resolution`` tiers: one :class:`~hf_arb.sampling.tiers.TieredBatchSampler` over every (tier,
    bucket), whose ``--resolution_schedule`` says which tier trains when; ``buckets`` is the run's
    :class:`~hf_arb.train.sources.tiers.TierTable`. Epochs have their own length (each epoch's draw)."""

    varied_epochs = True

    def start(self, accelerator: Any) -> None:
        self.sampler = make_tier_sampler(self.args, self.ds, self.buckets, accelerator)

    def report(self, accelerator: Any, schedule: Schedule, models: Any) -> None:
        tiered_report(accelerator, self, schedule, models)


__all__ = ["BucketedSource", "ReferenceSource", "TieredSource"]
