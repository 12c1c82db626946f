"""``--with_prior_preservation``: the map-style source whose batches carry instance rows and as many class images of
the same bucket (:class:`PriorSource`), and the dataset that pairs them (:class:`PriorPairs`).

The instance rows are planned exactly as :class:`~hf_arb.train.sources.bucketed.BucketedSource` plans them (the same
sampler, resume and checkpoints). Each item of a step is paired with a class row by
:func:`hf_arb.sampling.pairing.paired_class_rows`, a pure function of (seed, epoch, the step's rows); the class image
is fitted to the instance batch's bucket. A batch is ``n`` instance rows then ``n`` class rows, with
``sample_weights`` (:func:`hf_arb.families.sample_weights.prior_sample_weights`) so that every family's loss is
``mean(instance) + --prior_loss_weight * mean(class)``.

A regularization dataset can feed the same pairing: :func:`prior_pairs` takes any class-image dataset (an image and
a caption column; bucket columns are added when missing).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hf_arb.lazy import LazyModule

from ...schedule import Schedule
from ..bucketed import BucketedSource
from ..dataset import image_dataset
from .class_images import ClassImageCounts, folder_class_dataset, generate_class_images

torch: Any = LazyModule("torch")
logger = logging.getLogger("train_text_to_image_arb")


class PriorPairs:
    """A map-style dataset over the sampler's ``(row, bucket, epoch)`` keys: the instance item and its paired class
    item, each fitted to the key's bucket; :meth:`collate` stacks the instance items, then the class items.

    Args:
        instances: the instance images (a :class:`~hf_arb.BucketedImageDataset` or one like it).
        classes: the class images, a :class:`~hf_arb.BucketedImageDataset` over the same bucket table.
        instance_buckets / class_buckets: their bucket columns (-1: skipped).
        resolutions: the bucket table's ``(width, height)``.
        seed: the run's seed; prior_loss_weight: the class loss's weight.
    """

    def __init__(self, instances: Any, classes: Any, instance_buckets: np.ndarray, class_buckets: np.ndarray,
                 resolutions: np.ndarray, *, seed: int, prior_loss_weight: float) -> None:
        from hf_arb.sampling.pairing import class_pools, instance_ranks

        self.instances, self.classes = instances, classes
        self.seed, self.prior_loss_weight = int(seed), float(prior_loss_weight)
        self.pools = class_pools(class_buckets, resolutions)
        self.ranks = instance_ranks(instance_buckets)

    def __len__(self) -> int:
        return len(self.instances)

    def class_row(self, row: int, bucket: int, epoch: int) -> int:
        """The class row paired with instance ``row`` training in ``bucket`` in ``epoch``."""
        from hf_arb.sampling.pairing import paired_class_rows

        return int(paired_class_rows(np.array([row]), np.array([bucket]), epoch=epoch, seed=self.seed,
                                     ranks=self.ranks, pools=self.pools)[0])

    def __getitem__(self, key: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        row, bucket, epoch = (int(k) for k in key)
        return self.instances[key], self.classes[(self.class_row(row, bucket, epoch), bucket, epoch)]

    def collate(self, samples: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
        from hf_arb.families.sample_weights import SAMPLE_WEIGHTS, prior_sample_weights

        batch = self.instances.collate([s[0] for s in samples] + [s[1] for s in samples])
        batch[SAMPLE_WEIGHTS] = prior_sample_weights(len(samples), len(samples), self.prior_loss_weight)
        return batch


def prior_pairs(args: Any, instances: Any, class_ds: Any, instance_buckets: np.ndarray, buckets: Any) -> PriorPairs:
    """Pair ``instances`` with ``class_ds`` (a class-image dataset with ``--image_column`` and ``--caption_column``,
    e.g. :func:`~hf_arb.train.sources.prior.class_images.folder_class_dataset` or a regularization dataset),
    bucketed with the run's table ``buckets`` (header-only reads) unless it carries bucket columns of that table."""
    from hf_arb import BucketSet, add_bucket_columns
    from hf_arb.checks import UsageError

    if "bucket" not in class_ds.column_names or BucketSet.from_dataset(class_ds) != buckets:
        class_ds = add_bucket_columns(class_ds, buckets, image_column=args.image_column, show_summary=False)
    class_ids = np.asarray(class_ds.with_format("numpy")["bucket"])
    if not (class_ids >= 0).any():
        raise UsageError(f"--with_prior_preservation: none of the {len(class_ids)} class images fits a bucket of the "
                         "table (all skipped at annotation): check --class_data_dir, or loosen --max_aspect_error.")
    classes = image_dataset(args, class_ds, buckets)
    return PriorPairs(instances, classes, instance_buckets, class_ids, np.asarray(buckets.resolutions),
                      seed=args.seed, prior_loss_weight=args.prior_loss_weight)


class PriorSource(BucketedSource):
    """``--with_prior_preservation``: a :class:`BucketedSource` whose loader pairs each instance row with a class
    image of its bucket (generated first where ``--class_data_dir`` holds fewer than ``--num_class_images``)."""

    pairs: PriorPairs | None = None
    class_counts: ClassImageCounts | None = None

    def loader(self, accelerator: Any, models: Any, schedule: Schedule, weight_dtype: Any) -> Any:
        from hf_arb.sampling.accelerate import fill_deepspeed_micro_batch
        from hf_arb.train.signals import ignore_stop_signals_in_worker

        instance_ids = np.asarray(self.ds.with_format("numpy")["bucket"])
        class_ds = self.class_dataset(accelerator, models, instance_ids)
        self.pairs = prior_pairs(self.args, image_dataset(self.args, self.ds, self.buckets), class_ds,
                                 instance_ids, self.buckets)
        loader = torch.utils.data.DataLoader(self.pairs, batch_sampler=self.sampler, collate_fn=self.pairs.collate,
                                             num_workers=self.args.dataloader_num_workers,
                                             worker_init_fn=ignore_stop_signals_in_worker)
        fill_deepspeed_micro_batch(accelerator, self.sampler)
        return loader

    def class_dataset(self, accelerator: Any, models: Any, instance_ids: np.ndarray) -> Any:
        """The class images to pair with: ``--class_data_dir``, completed by generation first (every process its
        share). A source whose class images are a regularization dataset answers with that dataset instead (an image
        and a caption column, as :func:`prior_pairs` takes)."""
        self.class_counts = generate_class_images(self.args, accelerator, models, self.buckets, instance_ids)
        class_ds = folder_class_dataset(self.args)
        self.class_counts.used = len(class_ds)
        return class_ds

    def report(self, accelerator: Any, schedule: Schedule, models: Any) -> None:
        super().report(accelerator, schedule, models)
        if accelerator.is_main_process:
            print(prior_report(self.args, self.buckets, self.ds, self.pairs, self.class_counts), flush=True)

    def stats(self, micro_step: int) -> dict[str, Any]:
        counts = self.class_counts or ClassImageCounts()
        pools = self.pairs.pools if self.pairs is not None else None
        borrowed = [] if pools is None else [int(b) for b in np.flatnonzero((pools.counts == 0) & (pools.source >= 0))]
        return {**super().stats(micro_step), "class_images_generated": counts.generated,
                "class_images_reused": counts.reused, "class_images_used": counts.used,
                "class_buckets_borrowed": borrowed}


def prior_report(args: Any, buckets: Any, ds: Any, pairs: PriorPairs | None, counts: ClassImageCounts | None) -> str:
    """The start-up lines of prior preservation: the class images (reused, generated, used), their buckets, and the
    trained buckets that borrow the nearest bucket's class images."""
    counts = counts or ClassImageCounts()
    origin = (f"{args.class_data_dir} ({counts.reused} found, {counts.generated} generated), \"{args.class_prompt}\""
              if args.class_data_dir else "the --dataset_config file's regularization datasets, with their captions")
    lines = [f"Prior preservation: {counts.used} class images from {origin}, --prior_loss_weight "
             f"{args.prior_loss_weight:g}; every batch trains --train_batch_size instance + as many class images of "
             "its bucket"]
    if pairs is None:
        return lines[0]
    ids = np.asarray(ds.with_format("numpy")["bucket"])
    trained = np.flatnonzero(np.bincount(ids[ids >= 0], minlength=len(buckets)))
    labels = buckets.labels()
    lines.append("class images per trained bucket: " + ", ".join(
        f"{labels[b]}: {int(pairs.pools.counts[b])}" for b in trained))
    borrowed = [b for b in trained if pairs.pools.counts[b] == 0]
    if borrowed:
        lines.append(f"{len(borrowed)} trained bucket(s) have no class image of their own and borrow the nearest "
                     "bucket's, fitted into theirs: " + ", ".join(
                         f"{labels[b]} <- {labels[int(pairs.pools.source[b])]}" for b in borrowed))
    return "\n".join(lines)


__all__ = ["PriorPairs", "PriorSource", "prior_pairs", "prior_report"]
