"""The training data: the dataset the flags name, its bucket columns (annotated on the fly, or re-assigned to the
requested table), and the checks of the plan and the upscale before any model loads."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.checks import UsageError
from hf_arb.lazy import LazyModule

from ..captions import with_sidecar_captions
from ..files import SKIPPED_ROWS_FILE
from .tiers import TieredImages, TierTable, tier_table

torch: Any = LazyModule("torch")  # loaded when a function needs it: --help and flag errors answer before torch
logger = logging.getLogger("train_text_to_image_arb")


def load_raw_dataset(args: argparse.Namespace) -> Any:
    """The train split, loaded the way diffusers' script does (plus local ``save_to_disk`` folders)."""
    import datasets

    if args.dataset_name is not None:
        local = Path(args.dataset_name)
        if local.is_dir() and ((local / "state.json").exists() or (local / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(local))
        else:
            ds = datasets.load_dataset(args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir,
                                       data_dir=args.train_data_dir)
    else:
        folder = args.train_data_dir if args.instance_data_dir is None else args.instance_data_dir
        ds = datasets.load_dataset("imagefolder", data_files={"train": os.path.join(folder, "**")},
                                   cache_dir=args.cache_dir)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UsageError(f"The dataset has no 'train' split; its splits are {list(ds)}.")
        ds = ds["train"]
    return instance_captions(args, with_sidecar_captions(args, ds))  # --caption_extension .txt: caption files


def instance_captions(args: argparse.Namespace, ds: Any) -> Any:
    """The dreambooth scripts' data flags: ``--instance_prompt`` (without ``--caption_column``) is every image's
    caption; ``--repeats N`` repeats the rows N times (logged)."""
    import datasets
    import pyarrow as pa

    if args.instance_prompt is not None and not getattr(args, "caption_column_given", False) and not getattr(
            args, "caption_extension", None):  # with caption files it fills the rows without one (train/captions.py)
        if args.caption_column in ds.column_names:
            ds = ds.remove_columns(args.caption_column)
        ds = ds.add_column(args.caption_column, pa.repeat(pa.scalar(args.instance_prompt), len(ds)))
        logger.info("--instance_prompt: every image's caption is %r.", args.instance_prompt)
    if args.repeats > 1:
        logger.info("--repeats %d: %d rows trained as %d.", args.repeats, len(ds), len(ds) * args.repeats)
        ds = datasets.concatenate_datasets([ds] * args.repeats)
    return ds


def check_columns(ds: Any, args: argparse.Namespace) -> None:
    for flag in ("image_column", "caption_column"):
        value = getattr(args, flag)
        if value not in ds.column_names:
            raise UsageError(f"--{flag} value '{value}' needs to be one of: {', '.join(ds.column_names)}")
    for value in getattr(args, "reference_image_column", None) or []:
        if value not in ds.column_names:
            raise UsageError(f"--reference_image_column value '{value}' needs to be one of: "
                             f"{', '.join(ds.column_names)}")


def bucket_set_from_args(args: argparse.Namespace) -> Any:
    """The BucketSet of --bucket_preset / --aspect_ratio_buckets, --resolution, --bucket_step, --bucket_metric and
    --max_aspect_error."""
    return bucket_table_from_args(args)[0]


def bucket_table_from_args(args: argparse.Namespace) -> tuple[Any, list[str]]:
    """``(BucketSet, notes)``, built as ``hf-arb buckets`` builds it; ``notes`` say which flags the table ignores."""
    from hf_arb.buckets.resolve import resolve_buckets

    sides = {k: v for k in ("min_side", "max_side") if (v := getattr(args, f"bucket_{k}", None)) is not None}
    return resolve_buckets(args.bucket_preset, args.aspect_ratio_buckets, resolution=args.resolution,
                           step=args.bucket_step, metric=args.bucket_metric, max_aspect_error=args.max_aspect_error,
                           **sides)


def log_bucket_notes(args: argparse.Namespace, notes: list[str]) -> None:
    """Say once that the preset ignores --resolution: a warning if it was given, else (a family default) info."""
    given = "resolution" not in getattr(args, "family_defaults", {})
    for note in notes:
        logger.log(logging.WARNING if given else logging.INFO, "--bucket_preset: %s", note)


def bucket_origin(args: argparse.Namespace) -> str:
    """Where the run's bucket table came from, for the model card."""
    if getattr(args, "dataset_specs", None):  # --dataset_config: each dataset at its own table
        return "each dataset's table (--dataset_config): " + ", ".join(
            f"{s.name} at {s.bucket_preset or args.bucket_preset} {s.resolution or args.resolution}"
            for s in args.dataset_specs)
    if getattr(args, "buckets_from_dataset", False):
        return "the dataset's own bucket columns (the table it was annotated with)"
    if args.aspect_ratio_buckets is not None:
        return f"`--aspect_ratio_buckets {args.aspect_ratio_buckets}`"
    from hf_arb.buckets.presets import PRESET_INFO

    if args.bucket_preset in PRESET_INFO and PRESET_INFO[args.bucket_preset].default_resolution is None:
        return f"`--bucket_preset {args.bucket_preset}`, a fixed table"
    return f"`--bucket_preset {args.bucket_preset}` at `--resolution {args.resolution}`"


#: the flags that choose the bucket table (besides --resolution)
BUCKET_TABLE_FLAGS = ("bucket_preset", "aspect_ratio_buckets", "bucket_step", "bucket_metric", "max_aspect_error",
                      "bucket_min_side", "bucket_max_side")


#: skip reasons that depend on the bucket table (re-decided when rows are re-assigned; others are kept)
TABLE_SKIP_REASONS = ("aspect", "upscale")


def reassigned_columns(table: Any, *, config: str) -> Any:
    """``map`` function (the whole table at once): the bucket columns of an annotated dataset's sizes in another
    table; rows skipped for a reason of their own (unreadable, missing, ...) stay skipped with it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from hf_arb import BucketSet
    from hf_arb.annotate.core import annotate_sizes

    reason = table.column("skip_reason")
    keep = pc.if_else(pc.is_in(reason, value_set=pa.array(TABLE_SKIP_REASONS)), pa.scalar(None, pa.string()), reason)
    return annotate_sizes(table.column("original_width").to_numpy(zero_copy_only=False),
                          table.column("original_height").to_numpy(zero_copy_only=False), BucketSet.from_json(config),
                          reasons=keep.to_numpy(zero_copy_only=False))


def annotated_dataset_buckets(args: argparse.Namespace, ds: Any, own: Any, main: bool) -> tuple[Any, Any]:
    """A dataset that carries bucket columns keeps them, unless bucket-table flags were passed and ask for another
    table: then its rows are re-assigned from their original_width/original_height (vectorised, no image opened).
    A flag that is not applied is named once (never silently ignored); ``args.buckets_from_dataset`` tells the card."""
    import datasets

    from hf_arb.buckets.schema import BUCKET_COLUMNS, bucket_features

    given = list(getattr(args, "bucket_flags_given", []))
    if "resolution" not in getattr(args, "family_defaults", {"resolution": None}):
        given.append("--resolution")
    args.buckets_from_dataset = True
    wanted = bucket_table_from_args(args)[0] if given else own
    if wanted == own:
        logger.info("Dataset already carries bucket columns: using its %d buckets as they are.", len(own))
        return ds, own
    if given == ["--resolution"]:  # no table flag: the dataset's own table wins, and the user hears it
        if main and len(getattr(args, "resolutions", None) or [0]) == 1:  # (tiers: dataset_with_buckets says the fix)
            logger.warning("--resolution %s is not applied: the dataset carries bucket columns (%d buckets, %s, ...) "
                           "and this run trains on them. To re-assign its rows at --resolution %s, also pass the "
                           "table, e.g. --bucket_preset budget.", args.resolution, len(own),
                           ", ".join(own.labels()[:3]), args.resolution)
        return ds, own
    sizes = ds.select_columns(["original_width", "original_height", "skip_reason"]).with_format("arrow")
    new = sizes.map(reassigned_columns, batched=True, batch_size=None, keep_in_memory=True,
                    features=bucket_features(wanted), remove_columns=sizes.column_names,
                    desc="Re-assigning buckets", fn_kwargs=dict(config=wanted.to_json())).with_format(None)
    ds = datasets.concatenate_datasets([ds.remove_columns(list(BUCKET_COLUMNS)), new], axis=1)
    args.buckets_from_dataset = False
    if main:
        kept = int((np.asarray(new.with_format("numpy")["bucket"]) >= 0).sum())
        logger.warning("The dataset's bucket columns (%d buckets) are not the table of %s (%d buckets): re-assigned "
                       "its %d rows from original_width/original_height (no image opened; %d kept).%s", len(own),
                       " ".join(f"{f} {getattr(args, f[2:])}" for f in given), len(wanted), len(ds), kept,
                       "" if len(getattr(args, "resolutions", None) or [0]) > 1  # tiers: each tier needs its table
                       else " Drop those flags to train on the dataset's own buckets.")
    return ds, wanted


def annotation_note(ds: Any, buckets: Any, image_column: str = "image") -> str:
    """The annotation summary without its bucket table (the start-up report prints that, with the plan), its advice
    in this script's flags; rows named with their files from ``image_column`` where it records them."""
    from hf_arb.annotate.map import summarize_annotation

    summary = summarize_annotation(ds, buckets, image_column=image_column)
    lines = [str(summary).split("\nrows per bucket", 1)[0]]
    for o in summary.outliers:
        t = f"{o.threshold:g}"
        fix = (f"  skip them with --max_aspect_error {t}" if o.kind == "aspect_error" else
               f"  skip them by annotating first: hf-arb annotate DATA --max-upscale {t} --output-dir DIR, then "
               "train with --dataset_name DIR")
        lines += [*str(o).splitlines()[:-1], fix]
    return "\n".join(lines)


def dataset_with_buckets(args: argparse.Namespace, accelerator: Any, load: Any = None) -> tuple[Any, Any]:
    """Load, truncate, annotate (unless already annotated) and check that some rows are trainable.

    Returns ``(ds, buckets)``; ``ds`` keeps every row (``bucket == -1`` marks skipped ones, the sampler ignores
    them) so row indices stay those of the dataset. With several ``--resolution`` tiers ``buckets`` is the run's
    :class:`~hf_arb.train.sources.tiers.TierTable` (its first tier: the table ``ds`` is annotated with).
    ``load``: what loads the raw rows (default :func:`load_raw_dataset`; several datasets: each one's caption source).
    """
    from hf_arb import BucketSet, add_bucket_columns
    from hf_arb.buckets.references import reference_info

    with accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext():
        ds = (load or load_raw_dataset)(args)
        check_columns(ds, args)
        if args.max_train_samples is not None:
            ds = ds.shuffle(seed=args.seed).select(range(min(args.max_train_samples, len(ds))))
        refs = getattr(args, "reference_image_column", None) or []
        if "bucket" in ds.column_names and any(f"{r}_bucket" not in ds.column_names for r in refs):
            raise UsageError(f"--reference_image_column {' '.join(refs)}: the dataset is annotated without these "
                             "reference columns. Annotate it with them: hf-arb annotate SOURCE --output-dir DIR "
                             + " ".join(f"--reference-column {r}" for r in refs) + ", or train on the raw dataset.")
        if "bucket" in ds.column_names:
            ds, buckets = annotated_dataset_buckets(args, ds, BucketSet.from_dataset(ds),
                                                    accelerator is None or accelerator.is_main_process)
            stored = {p for r in refs if (p := (reference_info(ds.features, r) or ("strict",))[0])}
            if refs and args.reference_policy == "own" and stored != {"own"}:
                raise UsageError(f"--reference_policy own: the dataset's reference columns were annotated under "
                                 f"{', '.join(sorted(stored))} and train that way. Re-annotate with hf-arb annotate "
                                 "--reference-policy own, or drop --reference_policy.")
            if refs and not args.buckets_from_dataset:  # re-assigned targets: the references' buckets are stale
                raise UsageError("The bucket-table flags ask for another table than the edit dataset was annotated "
                                 "with, and its reference columns cannot be re-assigned from sizes alone: drop those "
                                 "flags, or re-annotate with hf-arb annotate --reference-column at that table.")
        else:
            buckets, notes = bucket_table_from_args(args)
            if accelerator is None or accelerator.is_main_process:
                log_bucket_notes(args, notes)
            ds = add_bucket_columns(ds, buckets, image_column=args.image_column, show_summary=False,
                                    reference_columns=refs or None,
                                    reference_policy=getattr(args, "reference_policy", "strict"))
            if accelerator is None or accelerator.is_main_process:  # once; startup_report prints the table
                print(annotation_note(ds, buckets, args.image_column), flush=True)
    ids = np.asarray(ds.with_format("numpy")["bucket"])
    if len(ds) == 0 or not (ids >= 0).any():
        reasons = {}
        if "skip_reason" in ds.column_names and len(ds):
            for r in ds["skip_reason"]:
                reasons[r] = reasons.get(r, 0) + 1
        raise UsageError(
            f"No trainable images: {len(ds)} rows, 0 assigned to a bucket (skip reasons: {reasons or 'none'}). "
            f"Loosen --max_aspect_error (now {args.max_aspect_error}), pick another --bucket_preset, or check the "
            "--image_column."
        )
    table = tier_table(args)
    if table is not None and table.bucket_sets[0] != buckets:
        raise UsageError(f"The dataset's bucket columns ({len(buckets)} buckets) are not the first tier's table "
                         f"(--resolution {args.resolution}, {len(table.bucket_sets[0])} buckets): add --bucket_preset "
                         f"{args.bucket_preset} to re-assign its rows at every tier from their stored sizes (no image "
                         "is opened).")
    return ds, buckets if table is None else table


def check_plan(args: argparse.Namespace, ds: Any, num_processes: int) -> None:
    """With --bucket_leftover drop, some bucket must hold a full (global) batch, or the epoch has no step (a pixel
    budget and --packing: their samplers check their own plans)."""
    if args.bucket_leftover != "drop" or args.max_pixels_per_batch is not None or args.packing:
        return
    if len(getattr(args, "resolutions", None) or []) > 1:  # TieredBatchSampler checks every tier's plan itself
        return
    ids = np.asarray(ds.with_format("numpy")["bucket"])
    largest = int(np.bincount(ids[ids >= 0]).max()) if (ids >= 0).any() else 0
    need = args.train_batch_size * (1 if args.no_bucket_sync else num_processes)
    if largest < need:
        raise UsageError(
            f"The sampler yields no full batch per rank: the largest bucket has {largest} images, a step needs {need} "
            f"(--train_batch_size {args.train_batch_size} x {num_processes} processes). Lower --train_batch_size, "
            "use --bucket_leftover fill (or catch_all), or add images."
        )


#: the sampler's advice (hf_arb.sampling.report.remedies) in the script's flags
SAMPLER_FLAG_NAMES = {"BucketBatchSampler drops": "The epoch plan drops",
                      "BucketBatchSampler repeats": "The epoch plan repeats",
                      'with leftover="fill". Remedies': "with --bucket_leftover fill. Remedies",
                      "`leftover=\"drop\"` or `\"catch_all\"`": "--bucket_leftover drop (or catch_all)",
                      "`leftover=\"fill\"` or `\"catch_all\"`": "--bucket_leftover fill (or catch_all)",
                      "`leftover=\"fill\"`": "--bucket_leftover fill",
                      "a smaller `batch_size`": "a smaller --train_batch_size",
                      "a smaller batch per bucket": "a smaller --max_pixels_per_batch",
                      "fewer buckets": "fewer buckets (--bucket_preset, --aspect_ratio_buckets)",
                      ", `merge_small=True` (merge small buckets)": "",
                      "num_replicas ": "processes ", "× batch_size": "× --train_batch_size"}


#: A resolution that needs more than this upscale for at least half of the kept images is refused before training.
MAX_TYPICAL_UPSCALE = 8.0


def check_upscale(args: argparse.Namespace, ds: Any, buckets: Any) -> None:
    """Refuse a --resolution far above the images (the median kept image upscaled more than MAX_TYPICAL_UPSCALE x):
    each image would be enlarged that much in memory and the run would end blaming the images."""
    if not {"original_width", "original_height"} <= set(ds.column_names):
        return
    from hf_arb.annotate.summary import cover_scales

    cols = ds.select_columns(["bucket", "original_width", "original_height"]).with_format("arrow")[:]  # no decoding
    ids = cols.column("bucket").to_numpy()
    scale = cover_scales(ids, cols.column("original_width"), cols.column("original_height"), buckets)  # (n,)
    scale = scale[np.isfinite(scale)]
    if scale.size and float(np.median(scale)) > MAX_TYPICAL_UPSCALE:
        res = buckets.resolutions
        typical = int(np.median(np.sqrt(res[ids[ids >= 0], 0] * res[ids[ids >= 0], 1]) / np.median(scale)))
        side = max(args.bucket_step or 64, typical // (args.bucket_step or 64) * (args.bucket_step or 64))
        raise UsageError(
            f"--resolution {args.resolution}: the median image would be upscaled {np.median(scale):.0f}x to cover its "
            f"bucket ({int((scale > MAX_TYPICAL_UPSCALE).sum())} of {scale.size} kept images more than "
            f"{MAX_TYPICAL_UPSCALE:g}x, the most {scale.max():.0f}x); the resolution is too large for these images. "
            f"Pass a smaller --resolution, e.g. {side} (about their median side).")


def image_dataset(args: argparse.Namespace, ds: Any, buckets: Any, references: list[str] | None = None,
                  masks: Any = None) -> Any:
    """The images fitted to each batch's bucket (several tiers: to that bucket of the batch's tier). ``references``:
    an edit model's reference columns (the sampler's keys carry composite ids: each reference at its own bucket);
    ``masks``: a :class:`~hf_arb.images.masks.MaskSpec` (``--masked_loss``: each sample carries its ``loss_mask``)."""
    from hf_arb import BucketedImageDataset

    if isinstance(buckets, TierTable):
        return TieredImages(image_dataset(args, ds, buckets.resolutions), buckets)
    cls: Any = BucketedImageDataset
    extra: dict[str, Any] = {}
    if masks is not None:
        from hf_arb.images.masks import MaskedImageDataset

        cls, extra = MaskedImageDataset, {"masks": masks}
    if references:  # an edit model: keys carry composite ids (make_sampler)
        from hf_arb.buckets.references import read_composite
        from hf_arb.images.references import BucketedReferenceDataset

        cls = BucketedReferenceDataset
        extra = dict(reference_columns=list(references), composite=read_composite(ds, references)[1])
    return cls(ds, buckets, image_column=args.image_column, caption_column=args.caption_column, **extra,
                                tokenizer=None, seed=args.seed, center_crop=args.center_crop,
                                random_flip=args.random_flip, resample=args.image_interpolation_mode,
                                on_bad_image=args.on_bad_image, bad_image_log=Path(args.output_dir) / SKIPPED_ROWS_FILE)
