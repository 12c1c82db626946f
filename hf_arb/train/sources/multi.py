"""``--dataset_config FILE``: several datasets in one global plan (:class:`MultiSource`).

Each dataset of the file (:class:`~hf_arb.train.flags.dataset_config.DatasetSpec`) is loaded as ``--dataset_name`` /
``--train_data_dir`` would load it, with its own caption source (a column, ``.txt`` files beside the images, or a
fixed prompt), annotated at its own bucket table (its ``resolution`` / ``bucket_preset``, else the run's), and the
rows of all of them are concatenated under one table (the union of the datasets' buckets). Its share of every
epoch is a number of *slots* (:mod:`hf_arb.sampling.planning.shares`): ``repeats`` trains every row N times,
``weight`` gives the dataset that share of the epoch. The training dataset is the concatenation seen through the
slot row map (``Dataset.select``: an index, no bytes copied), so one :class:`~hf_arb.BucketBatchSampler` plans it as
it plans one dataset: the same bucket on every rank, every resume idiom, elastic resume. A dataset's
``loss_weight`` reaches the loss as the batch's ``sample_weights`` (:mod:`hf_arb.families.sample_weights`,
the reduction prior preservation uses too; absent when every weight is 1).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.checks import UsageError
from hf_arb.families.sample_weights import SAMPLE_WEIGHTS
from hf_arb.lazy import LazyModule

from ..flags.dataset_config import DatasetSpec
from ..schedule import Schedule
from .bucketed import BucketedSource
from .dataset import check_plan, check_upscale, dataset_with_buckets, load_raw_dataset
from .loaders import build_dataloader
from .prior import PriorSource
from .reports import bucketed_report

torch: Any = LazyModule("torch")
logger = logging.getLogger("train_text_to_image_arb")

#: image file extensions a caption-file folder lists (those Pillow opens; as datasets' imagefolder)
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


# ==================================================================================================== captions
def read_sidecar_captions(image_paths: list[str], extension: str, fallback: str | None) -> tuple[list[str], int]:
    """Every image's caption from the file beside it (``a.png`` → ``a.txt`` for ``extension=".txt"``), read as
    ``--caption_extension`` reads it (:func:`hf_arb.train.captions.read_sidecar_captions`: the first line, stripped);
    images without one take ``fallback`` (kohya's ``class_tokens``). Returns ``(captions, missing)``."""
    from hf_arb.train.captions import read_sidecar_captions as read_files

    found = read_files(image_paths, extension)
    fill = fallback if fallback is not None else ""
    return [fill if c is None else c for c in found.captions], len(found.missing)


def caption_folder(spec: DatasetSpec, image_column: str, caption_column: str) -> Any:
    """A folder of images with caption files beside them, as a ``datasets.Dataset`` (image paths and captions)."""
    import datasets

    folder = Path(spec.train_data_dir or "")
    if not folder.is_dir():
        raise UsageError(f"{spec.where}: train_data_dir {folder} is not a folder.")
    # the images directly in the folder, as kohya reads image_dir
    files = sorted(str(p) for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    if not files:
        raise UsageError(f"{spec.where}: {folder} holds no image ({', '.join(IMAGE_EXTENSIONS)}).")
    captions, missing = read_sidecar_captions(files, spec.caption_extension or ".txt", spec.prompt)
    if missing and spec.prompt is None:
        first = next(f for f in files if not Path(f).with_suffix(spec.caption_extension or ".txt").is_file())
        raise UsageError(f"{spec.where}: {missing} of {len(files)} images have no {spec.caption_extension} caption "
                         f"file (e.g. {first}): write them, or give prompt = '...' (kohya: class_tokens) for those.")
    if missing:
        logger.info("%s: %d of %d images have no %s file and take the prompt %r.", spec.name, missing, len(files),
                    spec.caption_extension, spec.prompt)
    ds = datasets.Dataset.from_dict({image_column: files, caption_column: captions})
    return ds.cast_column(image_column, datasets.Image())


def entry_args(args: argparse.Namespace, spec: DatasetSpec) -> argparse.Namespace:
    """The run's flags as this dataset's own ``--dataset_name``/``--train_data_dir`` run would read them."""
    ns = argparse.Namespace(**vars(args))
    ns.dataset_name, ns.dataset_config_name, ns.train_data_dir = (spec.dataset_name, spec.dataset_config_name,
                                                                  spec.train_data_dir)
    ns.instance_data_dir, ns.repeats = None, 1
    ns.image_column = spec.image_column or args.image_column
    ns.caption_column = spec.caption_column or args.caption_column
    ns.instance_prompt = spec.prompt if spec.caption_extension is None else None
    ns.caption_column_given = spec.caption_column is not None
    if spec.resolution is not None:
        ns.resolution, ns.resolutions = spec.resolution, [spec.resolution]
        ns.family_defaults = {k: v for k, v in getattr(args, "family_defaults", {}).items() if k != "resolution"}
    if spec.bucket_preset is not None:
        ns.bucket_preset, ns.aspect_ratio_buckets = spec.bucket_preset, None
        ns.bucket_flags_given = sorted({*getattr(args, "bucket_flags_given", []), "--bucket_preset"})
    return ns


def entry_loader(spec: DatasetSpec) -> Any:
    """``load(ns)`` for :func:`~hf_arb.train.sources.dataset.dataset_with_buckets`: caption files, or the flags' way."""
    if spec.caption_extension is None:
        return load_raw_dataset
    return lambda ns: caption_folder(spec, ns.image_column, ns.caption_column)


def dataset_caption_options(args: argparse.Namespace, specs: list[DatasetSpec]) -> list[Any]:
    """One :class:`~hf_arb.train.captions.CaptionOptions` per dataset: the run's caption flags, overridden by the
    dataset's own keys (kohya's ``shuffle_caption``, ``keep_tokens``, ...)."""
    import dataclasses

    from hf_arb.train.captions import CaptionOptions
    from hf_arb.train.flags.caption_flags import caption_options

    base = dataclasses.asdict(caption_options(args))
    return [CaptionOptions(**{**base, **s.caption_options}) for s in specs]


def regularization_dataset(args: argparse.Namespace, spec: DatasetSpec, accelerator: Any) -> Any:
    """A regularization dataset's images and captions in the run's column names (bucketed later with the run's table,
    as ``--class_data_dir``'s images are)."""
    ns = entry_args(args, spec)
    ds, _ = dataset_with_buckets(ns, accelerator, load=entry_loader(spec))
    ds = ds.select_columns([ns.image_column, ns.caption_column])
    if ns.image_column != args.image_column:
        ds = ds.rename_column(ns.image_column, args.image_column)
    if ns.caption_column != args.caption_column:
        ds = ds.rename_column(ns.caption_column, args.caption_column)
    return ds


# ==================================================================================================== one table
def union_buckets(tables: list[Any], metric: str) -> tuple[Any, list[np.ndarray]]:
    """One BucketSet over every dataset's table (each resolution once, in first-seen order) and, per dataset, the
    map from its bucket ids to the union's."""
    from hf_arb import BucketSet

    if all(t == tables[0] for t in tables):
        return tables[0], [np.arange(len(t)) for t in tables]
    seen: dict[tuple[int, int], int] = {}
    for t in tables:
        for wh in map(tuple, t.resolutions.tolist()):
            seen.setdefault(wh, len(seen))
    union = BucketSet(list(seen), metric=metric)
    return union, [np.array([seen[tuple(wh)] for wh in t.resolutions.tolist()], np.int64) for t in tables]


def remapped_columns(table: Any, *, lut: list[int]) -> Any:
    """``map`` function (the whole table at once): the bucket columns with ids moved to the union table's."""
    import pyarrow as pa

    ids = table.column("bucket").to_numpy(zero_copy_only=False).astype(np.int64)
    new = np.where(ids >= 0, np.asarray(lut, np.int64)[np.maximum(ids, 0)], -1).astype(np.int32)
    return table.set_column(table.schema.get_field_index("bucket"), "bucket", pa.array(new, pa.int32()))


def normalised(ds: Any, ns: argparse.Namespace, args: argparse.Namespace, union: Any, lut: np.ndarray,
               same: bool) -> Any:
    """The run's image and caption column names, the bucket columns in the union table: what concatenates."""
    import datasets

    from hf_arb.buckets.schema import BUCKET_COLUMNS, bucket_features

    ds = ds.select_columns([ns.image_column, ns.caption_column, *BUCKET_COLUMNS])
    if ns.image_column != args.image_column:
        ds = ds.rename_column(ns.image_column, args.image_column)
    if ns.caption_column != args.caption_column:
        ds = ds.rename_column(ns.caption_column, args.caption_column)
    if not isinstance(ds.features[args.image_column], datasets.Image) or not ds.features[args.image_column].decode:
        ds = ds.cast_column(args.image_column, datasets.Image())
    if same:
        return ds
    cols = ds.select_columns(list(BUCKET_COLUMNS)).with_format("arrow")
    new = cols.map(remapped_columns, batched=True, batch_size=None, keep_in_memory=True,
                   features=bucket_features(union), fn_kwargs=dict(lut=lut.tolist()),
                   desc="Bucket ids in the run's table").with_format(None)
    return datasets.concatenate_datasets([ds.remove_columns(list(BUCKET_COLUMNS)), new], axis=1)


@dataclass(frozen=True)
class DatasetMix:
    """What the datasets of a ``--dataset_config`` run contribute (the report, the statistics, the card).

    Attributes:
        names: each dataset's label; rows: its rows; trainable: those with a bucket; repeats / weights: its share
            as given (None where not); slots: rows trained per epoch; loss_weights: the factor on its loss.
        slot_dataset: every slot's dataset, int32 ``(slots.sum(),)``.
    """

    names: list[str]
    rows: np.ndarray
    trainable: np.ndarray
    repeats: list[int | None]
    weights: list[float | None]
    slots: np.ndarray
    loss_weights: np.ndarray
    slot_dataset: np.ndarray

    def table(self, trained: np.ndarray | None = None) -> list[dict[str, Any]]:
        """One dict per dataset: rows, trainable, repeats, weight, slots, share (and ``trained`` in a plan)."""
        total = max(int(self.slots.sum()), 1)
        out = []
        for d, name in enumerate(self.names):
            row = {"name": name, "rows": int(self.rows[d]), "trainable": int(self.trainable[d]),
                   "repeats": self.repeats[d], "weight": self.weights[d], "slots": int(self.slots[d]),
                   "share": round(int(self.slots[d]) / total, 6), "loss_weight": float(self.loss_weights[d])}
            if trained is not None:
                row["trained_per_epoch"] = int(trained[d])
            out.append(row)
        return out


def mix_lines(table: list[dict[str, Any]]) -> list[str]:
    """The start-up report's table of datasets."""
    lines = [f"{'dataset':<24} {'rows':>8} {'kept':>8} {'repeats':>7} {'weight':>7} {'slots':>8} {'share':>7} "
             f"{'trained':>8} {'loss w':>6}"]
    for r in table:
        lines.append(f"{r['name'][:24]:<24} {r['rows']:>8,} {r['trainable']:>8,} {r['repeats'] or '-':>7} "
                     f"{'-' if r['weight'] is None else format(r['weight'], 'g'):>7} {r['slots']:>8,} "
                     f"{100 * r['share']:>6.2f}% {r.get('trained_per_epoch', '-'):>8} {r['loss_weight']:>6g}")
    return lines


def mix_card_lines(stats: dict[str, Any] | None) -> list[str]:
    """The model card's lines about several datasets (none for one dataset)."""
    table = (stats or {}).get("datasets")
    if not table:
        return []
    return ["* datasets (rows trained per epoch, share of the epoch):"] + [
        f"  * {r['name']}: {r['rows']:,} rows ({r['trainable']:,} kept), "
        + (f"repeats {r['repeats']}" if r["repeats"] is not None else f"weight {r['weight']:g}")
        + f", {r['slots']:,} per epoch ({100 * r['share']:.2f}%)"
        + (f", loss weight {r['loss_weight']:g}" if r["loss_weight"] != 1.0 else "") for r in table]


# ==================================================================================================== the batch
class MixCollate:
    """The image (or cached-latent) dataset's collate, plus each row's dataset's loss weight as ``sample_weights``
    (float32 ``(B,)``, only where some dataset's weight is not 1). Captions are augmented in the training loop with
    each row's dataset's options (:meth:`MultiSource.caption_augmenter`)."""

    def __init__(self, inner: Any, slot_dataset: np.ndarray, loss_weights: np.ndarray) -> None:
        self.inner, self.slot_dataset = inner, np.asarray(slot_dataset)
        self.loss_weights = np.asarray(loss_weights, np.float32)
        self.weighted = bool((self.loss_weights != 1.0).any())

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        datasets_of = self.slot_dataset[np.asarray([s["row"] for s in samples], np.int64)]
        batch = self.inner(samples)
        if self.weighted:
            batch[SAMPLE_WEIGHTS] = torch.from_numpy(self.loss_weights[datasets_of])
        return batch


# ==================================================================================================== the source
class MultiSource(BucketedSource):
    """``--dataset_config``: several datasets under one bucket table, one global plan over their slots."""

    mix: DatasetMix | None = None
    specs: list[DatasetSpec] = []

    def load(self, accelerator: Any) -> None:
        import datasets

        args = self.args
        self.specs = [s for s in args.dataset_specs if not s.regularization]  # the rows the plan trains
        self.regularization = [regularization_dataset(args, s, accelerator) for s in args.dataset_specs
                               if s.regularization]  # class images, paired with the batches (MultiPriorSource)
        parts, tables, entries = [], [], []
        for spec in self.specs:
            ns = entry_args(args, spec)
            ds, table = dataset_with_buckets(ns, accelerator, load=entry_loader(spec))
            parts.append(ds)
            tables.append(table)
            entries.append(ns)
        union, luts = union_buckets(tables, args.bucket_metric)
        same = all(t == union for t in tables)
        try:
            parts = [normalised(ds, ns, args, union, lut, same) for ds, ns, lut in zip(parts, entries, luts)]
            full = datasets.concatenate_datasets(parts)
        except ValueError as e:
            kinds = "; ".join(f"{s.name}: {p.features.get(args.caption_column)}" for s, p in zip(self.specs, parts))
            raise UsageError(f"--dataset_config: the datasets' captions do not concatenate ({kinds}): give every "
                             f"dataset string captions (a column of strings, caption files or a prompt). {e}") from None
        lengths = np.array([len(p) for p in parts], np.int64)
        row_dataset = np.repeat(np.arange(len(parts)), lengths)
        ids = np.asarray(full.with_format("numpy")["bucket"], np.int64)
        weights = [s.weight for s in self.specs]
        repeats = [s.repeats or 1 for s in self.specs] if weights[0] is None else [None] * len(self.specs)
        from hf_arb.sampling.planning.shares import plan_slots

        row_map, slots, trainable = plan_slots(row_dataset, ids, len(parts), seed=args.seed,
                                               repeats=None if repeats[0] is None else np.array(repeats),
                                               weights=None if weights[0] is None else np.array(weights))
        empty = [s.name for s, n in zip(self.specs, slots.tolist()) if n == 0]
        if empty:
            raise UsageError(f"--dataset_config: dataset {empty[0]!r} trains no row per epoch (no trainable image, or "
                             "its weight rounds to 0 rows): check its images and resolution, or raise its weight.")
        self.ds = full.select(row_map)  # an index over the concatenation: no image bytes copied
        self.buckets = union
        self.mix = DatasetMix([s.name for s in self.specs], lengths, trainable, repeats, weights, slots,
                              np.array([s.loss_weight for s in self.specs], np.float64),
                              row_dataset[row_map].astype(np.int32))
        check_plan(args, self.ds, 1 if accelerator is None else accelerator.num_processes)
        check_upscale(args, self.ds, self.buckets)

    def loader(self, accelerator: Any, models: Any, schedule: Schedule, weight_dtype: Any) -> Any:
        from hf_arb.sampling.accelerate import fill_deepspeed_micro_batch

        mix = self.mix

        def wrap(inner: Any) -> MixCollate:
            return MixCollate(inner, mix.slot_dataset, mix.loss_weights)

        dataloader, self.cache_index = build_dataloader(self.args, accelerator, self.ds, self.buckets, models,
                                                        self.sampler, schedule, weight_dtype, collate_wrap=wrap)
        fill_deepspeed_micro_batch(accelerator, self.sampler)
        return dataloader

    def caption_augmenter(self, schedule: Schedule) -> Any:
        """Each row's caption through its dataset's options: the run's caption flags, overridden by the dataset's
        own keys (kohya's ``shuffle_caption``, ``keep_tokens``, ...); the rows of the plan's slots know their
        dataset (``DatasetMix.slot_dataset``)."""
        from hf_arb.train.captions import CaptionAugmenter
        from hf_arb.train.flags.caption_flags import CACHED_VARIANTS

        options = dataset_caption_options(self.args, self.specs)
        variants = getattr(self.args, "caption_variants", None)
        if variants is None and getattr(self.args, "cache_text_embeddings", False) and any(
                o.varies_tags for o in options):  # as caption_variant_count: a bounded text-embedding cache
            variants = max(1, min(int(schedule.num_train_epochs), CACHED_VARIANTS))
        return CaptionAugmenter(options, seed=self.args.seed, variants=variants, dataset_of_row=self.mix.slot_dataset)

    def trained_per_dataset(self, epoch: int | None = None) -> np.ndarray:
        """Rows each dataset trains in ``epoch``'s plan (what the leftover policy drops or repeats included)."""
        from hf_arb.sampling.planning.shares import dataset_counts

        plan = self.sampler.plan(epoch)
        rows = plan.rows if hasattr(plan, "rows") else plan
        return dataset_counts(np.asarray(rows), self.mix.slot_dataset, len(self.mix.names))

    def report(self, accelerator: Any, schedule: Schedule, models: Any) -> None:
        if accelerator.is_main_process:
            print("\n".join(mix_lines(self.mix.table(self.trained_per_dataset()))), flush=True)
        bucketed_report(accelerator, self, schedule, models)

    def stats(self, micro_step: int) -> dict[str, Any]:
        return {**super().stats(micro_step), "datasets": self.mix.table(self.trained_per_dataset(0))}


__all__ = ["DatasetMix", "MixCollate", "MultiPriorSource", "MultiSource", "PairedCaptions", "mix_card_lines",
           "mix_lines", "read_sidecar_captions", "regularization_dataset"]


class MultiPriorSource(PriorSource, MultiSource):
    """``--dataset_config`` with regularization datasets (kohya's ``is_reg``): the instance datasets planned as
    :class:`MultiSource` plans them, each batch paired with class images of its bucket from the regularization
    datasets, as :class:`~hf_arb.train.sources.prior.PriorSource` pairs ``--class_data_dir``'s (nothing generated)."""

    def class_dataset(self, accelerator: Any, models: Any, instance_ids: np.ndarray) -> Any:
        import datasets

        from .prior.class_images import ClassImageCounts

        parts = self.regularization
        class_ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        self.class_counts = ClassImageCounts(reused=len(class_ds), used=len(class_ds))
        return class_ds

    def caption_augmenter(self, schedule: Schedule) -> Any:
        """The instance half of each paired batch with its datasets' caption options (:meth:`MultiSource.
        caption_augmenter`), the class half with its regularization datasets' (kohya's ``is_reg`` subsets keep their
        ``keep_tokens``, ``shuffle_caption``, ...)."""
        from hf_arb.train.captions import CaptionAugmenter

        instances = MultiSource.caption_augmenter(self, schedule)
        regs = [s for s in self.args.dataset_specs if s.regularization]
        lengths = [len(ds) for ds in self.regularization]
        classes = CaptionAugmenter(dataset_caption_options(self.args, regs),
                                   seed=self.args.seed, variants=instances.variants,
                                   dataset_of_row=np.repeat(np.arange(len(regs)), lengths))
        return PairedCaptions(instances, classes)


class PairedCaptions:
    """``augment(batch, epoch)`` of a prior-preservation batch (``n`` instance rows, then ``n`` class rows:
    :class:`~hf_arb.train.sources.prior.PriorPairs`): each half through its own augmenter, by its own rows."""

    def __init__(self, instances: Any, classes: Any) -> None:
        self.instances, self.classes = instances, classes

    def __call__(self, batch: dict[str, Any], epoch: int) -> dict[str, Any]:
        if not (self.instances.active or self.classes.active):
            return batch
        rows = batch["rows"].tolist() if hasattr(batch["rows"], "tolist") else list(batch["rows"])
        captions, n = list(batch["captions"]), len(rows) // 2
        return {**batch, "captions": self.instances.captions(captions[:n], rows[:n], epoch)
                + self.classes.captions(captions[n:], rows[n:], epoch)}
