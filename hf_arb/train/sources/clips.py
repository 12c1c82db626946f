"""``--video_column``: clips (and stills) in (width, height, frames) buckets, :class:`ClipSource`.

The dataset is annotated with a clip set through :func:`hf_arb.add_bucket_columns` (container headers only: no frame
decoded), the sampler is the map-style sources' :class:`~hf_arb.BucketBatchSampler` over those bucket ids (the same
(W, H, F) bucket on every rank at every step; exact resume from its cursor), and each batch decodes only its rows'
planned frames (:class:`~hf_arb.video.dataset.BucketedClipDataset`). A still is a 1-frame row through the image path;
stills and clips never share a batch (a batch is one bucket)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from hf_arb.checks import UsageError

from ..files import SKIPPED_ROWS_FILE
from ..schedule import Schedule, image_loss_weights
from .bucketed import BucketedSource
from .dataset import annotation_note, bucket_table_from_args, check_plan, instance_captions, load_raw_dataset
from .loaders import make_sampler

logger = logging.getLogger("train_text_to_image_arb")

#: the files of a --train_data_dir clip folder: clips (PyAV reads them) and stills (1-frame rows)
CLIP_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v", ".gif")
STILL_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")


def clip_folder_dataset(args: argparse.Namespace) -> Any:
    """``--train_data_dir`` with ``--video_column``: every clip and still of the folder (recursively, sorted) in the
    video column; captions from the folder's ``metadata.jsonl`` (imagefolder's ``file_name`` convention) where it has
    one, else ``""`` (``--instance_prompt`` then fills them, as for images)."""
    import datasets

    folder = Path(args.train_data_dir if args.instance_data_dir is None else args.instance_data_dir)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in CLIP_EXTENSIONS +
                   STILL_EXTENSIONS)
    if not files:
        raise UsageError(f"--train_data_dir {folder}: no clip ({', '.join(CLIP_EXTENSIONS)}) or still image in it.")
    captions: dict[str, str] = {}
    meta = folder / "metadata.jsonl"
    if meta.exists():
        for line in meta.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                captions[str((folder / record.get("file_name", "")).resolve())] = record.get(args.caption_column, "")
    ds = datasets.Dataset.from_dict({args.video_column: [str(p) for p in files],
                                     args.caption_column: [captions.get(str(p.resolve()), "") for p in files]})
    return instance_captions(args, ds)


def clip_bucket_table(args: argparse.Namespace) -> Any:
    """The run's clip set: a video preset (``--bucket_preset wan``; ``--frames`` its frame ladder), or the image
    table of the bucket flags with every bucket at each ``--frames`` count; ``--short_clips loop`` set on it."""
    from hf_arb.buckets.presets import VIDEO_PRESETS
    from hf_arb.buckets.resolve import resolve_buckets

    if args.bucket_preset in VIDEO_PRESETS and args.aspect_ratio_buckets is None:
        extra = {"frames": args.frames} if args.frames else {}
        try:
            bs = resolve_buckets(args.bucket_preset, resolution=args.resolution, step=args.bucket_step,
                                 metric=args.bucket_metric, max_aspect_error=args.max_aspect_error, **extra)[0]
        except ValueError as e:
            raise UsageError(f"--bucket_preset {args.bucket_preset}: {e}") from None
    elif not args.frames:
        raise UsageError(f"--video_column {args.video_column}: the dataset has no clip bucket columns, and clips train "
                         f"in (width, height, frames) buckets: pass a video preset (--bucket_preset "
                         f"{' / '.join(VIDEO_PRESETS)}) or frame counts (--frames 1,17,33), or annotate it first "
                         "(hf-arb annotate DATA --frames 1,17,33 --output-dir DIR).")
    else:
        flat = bucket_table_from_args(args)[0]
        bs = flat.replace(resolutions=[(w, h, f) for f in args.frames for (w, h) in flat])
    return bs.replace(short_clips=args.short_clips)


def clip_dataset_with_buckets(args: argparse.Namespace, accelerator: Any) -> tuple[Any, Any]:
    """Load the clip dataset (a folder, a Hub id or a ``save_to_disk`` folder) and annotate it with the run's clip
    set (a dataset annotated with one keeps its own). Returns ``(ds, buckets)``; skipped rows keep ``bucket -1``."""
    from hf_arb import BucketSet, add_bucket_columns

    main = accelerator is None or accelerator.is_main_process
    with accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext():
        ds = clip_folder_dataset(args) if args.dataset_name is None else load_raw_dataset(args)
        for flag in ("video_column", "caption_column"):
            if getattr(args, flag) not in ds.column_names:
                raise UsageError(f"--{flag} value '{getattr(args, flag)}' needs to be one of: "
                                 f"{', '.join(ds.column_names)}")
        if args.max_train_samples is not None:
            ds = ds.shuffle(seed=args.seed).select(range(min(args.max_train_samples, len(ds))))
        if "bucket" in ds.column_names and "bucket_frames" in ds.column_names:  # hf-arb annotate --video-column
            buckets = BucketSet.from_dataset(ds)
            args.buckets_from_dataset = True
            given = [f for f in getattr(args, "bucket_flags_given", []) if f != "--resolution"]
            if args.frames:
                given.append("--frames")
            if getattr(args, "slide_stride", None) is not None:
                given.append("--slide_stride")
            if main:  # a flag that is not applied is named (clip rows are not re-assigned from sizes alone)
                logger.log(logging.WARNING if given else logging.INFO, "Dataset already carries clip bucket columns: "
                           "using its %d buckets as they are%s.", len(buckets),
                           f" ({', '.join(given)} not applied: re-annotate to change them)" if given else "")
            check_strides(args, ds)
            check_windows(args, ds)
        else:
            buckets = clip_bucket_table(args)
            ds = add_bucket_columns(ds, buckets, video_column=args.video_column, target_fps=args.target_fps,
                                    frame_sampling=args.frame_sampling, show_summary=False,
                                    slide_stride=getattr(args, "slide_stride", None))
            if main:
                print(annotation_note(ds, buckets, args.video_column), flush=True)
    ids = np.asarray(ds.with_format("numpy")["bucket"])
    if not (ids >= 0).any():
        reasons: dict[str, int] = {}
        for r in ds["skip_reason"]:
            reasons[r] = reasons.get(r, 0) + 1
        raise UsageError(f"No trainable clips: {len(ds)} rows, 0 assigned to a bucket (skip reasons: {reasons}). "
                         "Add frame buckets that fit them (--frames), --short_clips loop, or another --bucket_preset.")
    return ds, buckets


def check_strides(args: argparse.Namespace, ds: Any) -> None:
    """An annotated clip dataset matched each clip's frames at its ``frame_stride`` (from the annotation's target
    frame rate): a ``--target_fps`` that gives other strides would train other windows than those its buckets were
    matched to (too short ones replaced as bad rows). Refused naming the rows, vectorised over the columns."""
    from hf_arb.annotate.clips import strides

    if "frame_stride" not in ds.column_names:
        return
    cols = ds.select_columns(["bucket", "original_fps", "frame_stride"]).with_format("numpy")[:]
    kept = (np.asarray(cols["bucket"]) >= 0) & (np.nan_to_num(np.asarray(cols["original_fps"], np.float64)) > 0)
    stored = np.nan_to_num(np.asarray(cols["frame_stride"], np.float64))  # (n,)
    wanted = strides(np.nan_to_num(np.asarray(cols["original_fps"], np.float64)), args.target_fps)  # (n,)
    differ = np.flatnonzero(kept & ~np.isclose(stored, wanted, rtol=1e-6, atol=0))
    if differ.size:
        r = int(differ[0])
        given = f"--target_fps {args.target_fps:g}" if args.target_fps else "no --target_fps (each clip's own rate)"
        raise UsageError(f"{given}: the dataset was annotated at another frame rate ({differ.size} clips' frame "
                         f"strides differ, e.g. row {r}: stride {stored[r]:g} annotated, {wanted[r]:g} here). Pass the "
                         "--target_fps it was annotated with (hf-arb annotate --target-fps), or annotate it again.")


def clip_batch_sizes(args: argparse.Namespace, ds: Any, buckets: Any, family: Any) -> dict[int, int] | None:
    """``{bucket: rows per device}`` from ``--video_token_budget`` (each bucket's latent tokens, from the family's
    :meth:`~hf_arb.families.Family.latent_patch`; at most ``--train_batch_size``) and ``--image_train_batch_size``
    (the 1-frame buckets'); None when neither is given (one ``--train_batch_size`` for every bucket)."""
    from hf_arb.sampling.planning.batch_sizes import batch_sizes_for_tokens

    budget, images = args.video_token_budget, args.image_train_batch_size
    if budget is None and images is None:
        return None
    res = np.asarray(buckets.resolutions, dtype=np.int64)
    if budget is None:
        sizes = np.where(res[:, 2] == 1, images, args.train_batch_size)
    else:
        ids = np.asarray(ds.with_format("numpy")["bucket"])
        needed = np.bincount(ids[ids >= 0], minlength=len(res))[: len(res)] > 0  # buckets with rows must fit one
        spatial, frame_step, patch_t = family.latent_patch(args)
        try:
            sizes = batch_sizes_for_tokens(res, budget, spatial=spatial, frame_step=frame_step, patch_t=patch_t,
                                           image_batch_size=images, max_batch_size=args.train_batch_size,
                                           needed=needed)
        except ValueError as e:
            raise UsageError(f"--video_token_budget {budget}: "
                             + str(e).replace(f"max_tokens_per_batch={budget:,}", "it")
                             .replace("Raise it", "Raise --video_token_budget")) from None
    return {b: int(n) for b, n in enumerate(sizes.tolist())}


def check_windows(args: argparse.Namespace, ds: Any) -> None:
    """An annotated clip dataset's rows are ``slide`` windows (a ``frame_start``) or whole clips; ``--frame_sampling``
    must say the same, else the run would train other frames than the rows were annotated for. Refused in one line
    naming the fix (vectorised over the column)."""
    from hf_arb.video.dataset import window_starts

    windows = int((window_starts(ds) >= 0).sum())
    if windows and args.frame_sampling != "slide":
        raise UsageError(f"--frame_sampling {args.frame_sampling}: the dataset was annotated with --frame-sampling "
                         f"slide ({windows} rows are clip windows, each with its frame_start): pass --frame_sampling "
                         "slide, or annotate the clips again without it.")
    if not windows and args.frame_sampling == "slide":
        raise UsageError("--frame_sampling slide: the dataset was annotated with one row per clip (no frame_start): "
                         "annotate it with hf-arb annotate --frame-sampling slide, or train the raw clips "
                         "(--dataset_name/--train_data_dir before annotation) with --frame_sampling slide.")


def kind_losses(bucket_losses: dict[int, list[float]], frames: np.ndarray) -> dict[str, float]:
    """``{"loss/stills": ..., "loss/clips": ...}``: the mean of the losses of 1-frame buckets and of the others;
    ``frames``: each bucket's frame count (``(k,)``). A kind without a loss has no key."""
    out: dict[str, list[float]] = {}
    for b, values in bucket_losses.items():
        if b >= 0:
            out.setdefault("loss/stills" if int(frames[b]) == 1 else "loss/clips", []).extend(values)
    return {k: sum(v) / len(v) for k, v in out.items()}


class ClipSource(BucketedSource):
    """``--video_column``: clips and stills in (W, H, F) buckets; a batch is ``(B, C, F, H, W)`` clips or
    ``(B, C, H, W)`` stills with ``kind`` telling which (:class:`~hf_arb.video.dataset.BucketedClipDataset`)."""

    def load(self, accelerator: Any) -> None:
        import datasets

        self.ds, self.buckets = clip_dataset_with_buckets(self.args, accelerator)
        column = self.args.video_column
        if isinstance(self.ds.features[column], datasets.Video):  # raw {"bytes", "path"}: PyAV reads, hashes see
            self.ds = self.ds.cast_column(column, datasets.Video(decode=False))
        if self.args.video_token_budget is None and self.args.image_train_batch_size is None:
            check_plan(self.args, self.ds, 1 if accelerator is None else accelerator.num_processes)

    def start(self, accelerator: Any) -> None:
        """The sampler over the (W, H, F) buckets, each with its batch size where ``--video_token_budget`` or
        ``--image_train_batch_size`` gives one (every rank trains the same bucket, so the same size, at each step)."""
        from hf_arb.families import get_family

        sizes = clip_batch_sizes(self.args, self.ds, self.buckets, get_family(self.args.family))
        self.sampler = make_sampler(self.args, self.ds, self.buckets, accelerator, batch_sizes=sizes)

    def loss_weights(self) -> Any:
        """With a batch size per bucket, each micro-batch's loss weighted so every sample of an optimizer step
        weighs the same (:func:`~hf_arb.train.schedule.image_loss_weights`)."""
        per_bucket = self.args.video_token_budget is not None or self.args.image_train_batch_size is not None
        return image_loss_weights(self.args, self.sampler, per_bucket=per_bucket)

    def kind_losses(self, bucket_losses: dict[int, list[float]]) -> dict[str, float]:
        """``loss/stills`` and ``loss/clips``: the mean loss of the update's 1-frame and multi-frame buckets (a key
        only for a kind the update trained)."""
        return kind_losses(bucket_losses, np.asarray(self.buckets.resolutions)[:, 2])

    def dataset(self) -> Any:
        """The torch dataset of the run's rows: each (row, bucket, epoch) key decoded and fitted."""
        from hf_arb.video.dataset import BucketedClipDataset

        a = self.args
        return BucketedClipDataset(self.ds, self.buckets, video_column=a.video_column, target_fps=a.target_fps,
                                   mode=a.frame_sampling, loop=a.short_clips == "loop",
                                   caption_column=a.caption_column, seed=a.seed, center_crop=a.center_crop,
                                   random_flip=a.random_flip, resample=a.image_interpolation_mode,
                                   on_bad_image=a.on_bad_image, bad_image_log=Path(a.output_dir) / SKIPPED_ROWS_FILE)

    def loader(self, accelerator: Any, models: Any, schedule: Schedule, weight_dtype: Any) -> Any:
        import torch

        from hf_arb.sampling.accelerate import fill_deepspeed_micro_batch
        from hf_arb.train.signals import ignore_stop_signals_in_worker

        data: Any = self.dataset()
        collate = data.collate
        if self.args.cache_latents:  # keyed by the content, the crop and the frame plan (ClipPlan.key)
            from hf_arb.train.cache.caches import build_latent_cache
            from hf_arb.train.cache.latent_dataset import CachedLatentDataset

            a = self.args
            cache, self.cache_index, repair = build_latent_cache(a, accelerator, self.ds, self.buckets, models,
                                                                 self.sampler, schedule, weight_dtype, images=data,
                                                                 column=a.video_column)
            in_process = a.dataloader_num_workers == 0 or accelerator.device.type == "cpu"
            data = CachedLatentDataset(cache, self.cache_index, self.ds[a.caption_column], seed=a.seed,
                                       repair=repair if in_process else None)
            collate = CachedLatentDataset.collate
        loader = torch.utils.data.DataLoader(data, batch_sampler=self.sampler, collate_fn=collate,
                                             num_workers=self.args.dataloader_num_workers,
                                             worker_init_fn=ignore_stop_signals_in_worker,
                                             pin_memory=accelerator.device.type == "cuda")
        fill_deepspeed_micro_batch(accelerator, self.sampler)
        return loader


__all__ = ["ClipSource", "check_strides", "check_windows", "clip_batch_sizes", "clip_bucket_table",
           "clip_dataset_with_buckets", "clip_folder_dataset", "kind_losses"]
