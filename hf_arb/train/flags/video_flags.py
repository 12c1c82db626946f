"""The clip flags (issues 37/38): ``--video_column`` turns a run into a clip run (:class:`~hf_arb.train.sources.clips.
ClipSource`), ``--frames`` gives a 2-D table a frame axis (or picks a video preset's frame ladder), ``--target_fps``
resamples clips to the model's frame rate, ``--frame_sampling`` picks which instants train (musubi-tuner's
``frame_extraction``), ``--short_clips`` loops or skips clips shorter than the smallest frame bucket,
``--video_token_budget`` and ``--image_train_batch_size`` give each bucket its batch size (diffusion-pipe's per-bucket
micro batches). The names are ``hf-arb annotate``'s (``--video-column``, ``--frames``, ``--target-fps``,
``--short-clips``) in the script's underscore spelling. Parsed here and checked before anything loads; the clip
source reads them, the loop never does."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from hf_arb.checks import UsageError

#: the temporal modes the clip source trains (``slide``: one clip into several rows, one per window)
TRAIN_FRAME_MODES = ("head", "uniform", "random", "slide")


def frame_counts(text: str) -> list[int]:
    """argparse type: ``1,9,17``: distinct positive frame counts, ascending (as ``hf-arb annotate --frames``)."""
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected frame counts like 1,9,17, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"frame counts must be >= 1 (1: stills), got {text!r}")
    return values


def add_video_flags(a: Callable[..., Any]) -> None:
    """Add the clip flags with ``a`` (the parser's ``add_argument``)."""
    a("--video_column", type=str, default=None,
      help="NEW: train on clips: the dataset column of clips (a datasets.Video feature, file paths or bytes; an image "
           "in it is a 1-frame still). With --train_data_dir, every clip (.mp4, .webm, .mov, .mkv, ...) and image of "
           "the folder fills this column. Batches are (W, H, F) buckets: --bucket_preset wan (or --frames).")
    a("--frames", type=frame_counts, default=None, metavar="F1,F2,...",
      help="NEW (hf-arb annotate --frames; musubi-tuner's target_frames): the frame buckets, e.g. 1,17,33 (1: "
           "stills). With a video preset (--bucket_preset wan) its frame ladder; with an image preset every "
           "(width, height) bucket at each count.")
    a("--target_fps", type=float, default=None,
      help="NEW (hf-arb annotate --target-fps): the model's frame rate (16 for Wan): clips are resampled to it by "
           "timestamps; default: each clip's own rate.")
    a("--frame_sampling", type=str, default="head", choices=("head", "uniform", "slide", "random"),
      help="NEW (musubi-tuner's frame_extraction): which instants of a clip train: 'head' (the first F frames, "
           "default), 'random' (a window drawn per epoch), 'uniform' (F frames spread over the whole clip), 'slide' "
           "(each clip cut into windows of F frames, one row each; hf-arb annotate --frame-sampling slide).")
    a("--slide_stride", type=int, default=None, metavar="F",
      help="NEW (musubi-tuner's frame_stride; hf-arb annotate --slide-stride): with --frame_sampling slide, target "
           "frames between window starts (default: the bucket's frame count, windows that do not overlap).")
    a("--short_clips", type=str, default="skip", choices=("skip", "loop"),
      help="NEW (hf-arb annotate --short-clips): a clip shorter than the smallest frame bucket is skipped (named in "
           "the summary) or played again to fill it.")
    a("--video_token_budget", type=int, default=None, metavar="TOKENS",
      help="NEW (diffusion-pipe's per-bucket micro batches): latent tokens per batch per device; each (W, H, F) "
           "bucket trains floor(TOKENS / its tokens) rows, its tokens (W/s)(H/s)((F-1)/t+1) read from the model's VAE "
           "and patch (Wan 2.1: s=16, t=4), at most --train_batch_size. A rare long or large bucket gets a batch "
           "that fits instead of running out of memory.")
    a("--image_train_batch_size", type=int, default=None,
      help="NEW (diffusion-pipe's image_micro_batch_size_per_gpu): rows per batch per device of the 1-frame (still) "
           "buckets; the clip buckets keep --train_batch_size (or the --video_token_budget).")


def check_video_flags(args: argparse.Namespace) -> None:
    """A clip run's flags, each mistake in one line naming the fix; the clip flags without ``--video_column``."""
    from hf_arb.buckets.presets import VIDEO_PRESETS
    from hf_arb.families import get_family

    video = getattr(args, "video_column", None)
    preset_is_video = args.bucket_preset in VIDEO_PRESETS
    if not video:
        given = [f for f, v in (("--frames", args.frames), ("--target_fps", args.target_fps),
                                ("--frame_sampling", args.frame_sampling != "head"),
                                ("--slide_stride", getattr(args, "slide_stride", None) is not None),
                                ("--short_clips", args.short_clips != "skip"),
                                ("--video_token_budget", getattr(args, "video_token_budget", None) is not None),
                                ("--image_train_batch_size", getattr(args, "image_train_batch_size", None) is not None),
                                (f"--bucket_preset {args.bucket_preset}", preset_is_video)) if v]
        if given:
            raise UsageError(f"{given[0]} applies to clips: add --video_column COLUMN (with --train_data_dir: "
                             "--video_column video), or drop it.")
        return
    stride = getattr(args, "slide_stride", None)
    if stride is not None and (args.frame_sampling != "slide" or stride < 1):
        raise UsageError(f"--slide_stride {stride}: " + ("a positive number of target frames between window starts "
                         "(e.g. 17)" if stride < 1 else "applies to --frame_sampling slide; add it or drop "
                         "--slide_stride") + ".")
    check_batch_flags(args)
    if args.target_fps is not None and not args.target_fps > 0:
        raise UsageError(f"--target_fps {args.target_fps:g}: the model's frame rate must be > 0 (16 for Wan).")
    if args.aspect_ratio_buckets is not None and not args.frames:
        raise UsageError("--aspect_ratio_buckets gives (height, width) buckets: add --frames 1,17,33 for the clips' "
                         "frame counts.")
    family = get_family(args.family)
    if not getattr(family, "frame_rule_name", ""):
        raise UsageError(f"--video_column {video}: the {args.family} family trains images only; clips train a video "
                         "family (Wan: --pretrained_model_name_or_path a WanPipeline checkpoint).")
    refused = [("--streaming", getattr(args, "streaming", False), "clips are planned map-style"),
               ("--packing", getattr(args, "packing", False), "packs are of images"),
               ("--dataset_config", getattr(args, "dataset_config", None), "one clip dataset per run"),
               ("--encoded_dataset", getattr(args, "encoded_dataset", None), "encoded datasets hold image latents"),
               ("--reference_image_column", getattr(args, "reference_image_column", None), "edit models take images"),
               ("--masked_loss", getattr(args, "masked_loss", False), "masks are per image"),
               ("--with_prior_preservation", getattr(args, "with_prior_preservation", False), "class images: stills"),
               (f"--resolution {args.resolution}", len(getattr(args, "resolutions", None) or []) > 1,
                "several tiers are of images")]
    for flag, given, why in refused:
        if given:
            raise UsageError(f"{flag} with --video_column: not with clips yet ({why}); drop {flag.split()[0]}.")


def check_batch_flags(args: argparse.Namespace) -> None:
    """``--video_token_budget`` and ``--image_train_batch_size``: positive, and not with ``--max_pixels_per_batch``
    (two rules for one batch's size)."""
    for flag in ("video_token_budget", "image_train_batch_size"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise UsageError(f"--{flag} must be >= 1, got {value}.")
    if getattr(args, "video_token_budget", None) is not None and getattr(args, "max_pixels_per_batch", None):
        raise UsageError(f"--video_token_budget {args.video_token_budget} with --max_pixels_per_batch "
                         f"{args.max_pixels_per_batch}: two budgets for one batch; pass one (latent tokens count "
                         "what the transformer attends over).")
    if getattr(args, "image_train_batch_size", None) is not None and getattr(args, "max_pixels_per_batch", None):
        raise UsageError(f"--image_train_batch_size with --max_pixels_per_batch {args.max_pixels_per_batch}: the "
                         "pixel budget sizes the stills' batches too; for a batch size of their own use "
                         "--video_token_budget instead of --max_pixels_per_batch.")


__all__ = ["TRAIN_FRAME_MODES", "add_video_flags", "check_batch_flags", "check_video_flags", "frame_counts"]
