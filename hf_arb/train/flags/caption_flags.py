"""The caption flags, with kohya/sd-scripts' names and meanings: ``--shuffle_caption``, ``--keep_tokens N``,
``--caption_separator``, ``--caption_dropout_rate``, ``--caption_tag_dropout_rate`` and ``--caption_extension``
(captions in ``.txt`` files beside a folder's images), plus ``--caption_variants K`` (diffusion-pipe's
``cache_shuffle_num``: K tag variants per caption, what ``--cache_text_embeddings`` caches). What they do lives in
:mod:`hf_arb.train.captions`; this module parses and checks them, phrased in flags.

Parse-level: nothing here imports torch.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Callable

from hf_arb.checks import UsageError

from ..captions import CaptionAugmenter, CaptionOptions

__all__ = ["CACHED_VARIANTS", "CAPTION_FLAGS", "add_caption_flags", "caption_augmenter", "caption_options",
           "caption_variant_count", "check_caption_flags"]

logger = logging.getLogger("train_text_to_image_arb")

#: flag → its default (unset)
CAPTION_FLAGS: dict[str, Any] = {"shuffle_caption": False, "keep_tokens": 0, "caption_separator": ",",
                                 "caption_dropout_rate": 0.0, "caption_tag_dropout_rate": 0.0,
                                 "caption_variants": None, "caption_extension": None}


def add_caption_flags(a: Callable[..., Any]) -> None:
    """Add the flags to the parser (``a`` is its ``add_argument``)."""
    a("--shuffle_caption", action="store_true",
      help="Shuffle each caption's tags (the parts between --caption_separator) every epoch, as kohya's "
           "sd-scripts; the tags are joined with ', '.")
    a("--keep_tokens", type=int, default=0,
      help="With --shuffle_caption / --caption_tag_dropout_rate: the first N tags stay in place and are never "
           "dropped (e.g. a trigger word).")
    a("--caption_separator", type=str, default=",", help="What separates a caption's tags.")
    a("--caption_dropout_rate", type=float, default=0.0,
      help="Probability that a caption trains as the empty prompt (per image and epoch; kohya's flag). Upstream's "
           "--proportion_empty_prompts / --caption_dropout draw the same per micro-batch: pass one of them.")
    a("--caption_tag_dropout_rate", type=float, default=0.0,
      help="Probability that each tag (after the first --keep_tokens) is left out, per image and epoch.")
    a("--caption_variants", type=int, default=None,
      help="Tag variants per caption (diffusion-pipe's cache_shuffle_num): epoch e trains the tags of variant "
           "e %% K, so --cache_text_embeddings keeps at most K prompt embeddings per caption. Default: a new "
           "variant every epoch; with --cache_text_embeddings, min(epochs, 8)." + "%(default).0s")
    a("--caption_extension", type=str, default=None,
      help="Read each image's caption from the file beside it with this extension (kohya's habit: "
           "--caption_extension .txt reads photo.txt for photo.png) instead of the folder's metadata.jsonl. An "
           "image without one keeps --instance_prompt, else its metadata.jsonl caption, else '' (counted and named "
           "in one warning).")


def caption_options(args: argparse.Namespace) -> CaptionOptions:
    """The run's :class:`~hf_arb.train.captions.CaptionOptions` (one dataset: every row's)."""
    return CaptionOptions(**{f: getattr(args, f, CAPTION_FLAGS[f]) for f in CaptionOptions.__dataclass_fields__})


def check_caption_flags(args: argparse.Namespace) -> None:
    """Ranges; flags that configure tag variation without any; whole-caption dropout given twice; caption files
    where there is no folder."""
    for flag in ("caption_dropout_rate", "caption_tag_dropout_rate"):
        if not 0.0 <= getattr(args, flag) <= 1.0:
            raise UsageError(f"--{flag} must be in [0, 1], got {getattr(args, flag)}.")
    if args.keep_tokens < 0:
        raise UsageError(f"--keep_tokens must be >= 0, got {args.keep_tokens}.")
    if args.caption_variants is not None and args.caption_variants < 1:
        raise UsageError(f"--caption_variants must be >= 1, got {args.caption_variants}.")
    if not args.caption_separator:
        raise UsageError("--caption_separator must not be empty (kohya's default is ',').")
    varies = args.shuffle_caption or args.caption_tag_dropout_rate > 0
    for flag in ("keep_tokens", "caption_separator", "caption_variants"):
        if getattr(args, flag) != CAPTION_FLAGS[flag] and not varies:
            raise UsageError(f"--{flag} {getattr(args, flag)} has no effect in this run: it configures "
                             "--shuffle_caption and --caption_tag_dropout_rate. Add one of them, or drop "
                             f"--{flag}.")
    if args.caption_dropout_rate > 0 and args.proportion_empty_prompts > 0:
        raise UsageError(f"--caption_dropout_rate {args.caption_dropout_rate} and --proportion_empty_prompts "
                         f"{args.proportion_empty_prompts} (upstream's --caption_dropout) both train whole captions "
                         "as the empty prompt and would drop twice: pass one of them.")
    ext = args.caption_extension
    if ext is None:
        return
    if not ext.startswith(".") or len(ext) < 2 or "/" in ext:
        raise UsageError(f"--caption_extension {ext!r}: kohya appends it to the image's name without its "
                         f"extension (photo.png → photo{ext}); pass it with its dot, e.g. --caption_extension "
                         f".{ext.lstrip('.') or 'txt'}.")
    if args.dataset_name is not None or args.streaming:
        what = ("--streaming reads parquet shards" if args.streaming else
                f"--dataset_name {args.dataset_name} is a dataset")
        raise UsageError(f"--caption_extension {ext} reads caption files beside the images of a folder, and {what}: "
                         "pass the folder as --train_data_dir (or --instance_data_dir), or drop --caption_extension.")


#: --caption_variants' default with --cache_text_embeddings, as --latent_cache_variants': min(epochs, this)
CACHED_VARIANTS = 8


def caption_variant_count(args: argparse.Namespace, num_train_epochs: int) -> int | None:
    """``--caption_variants``; unset, with ``--cache_text_embeddings`` and varying tags ``min(epochs, 8)`` (each
    caption then has a bounded number of cached prompt embeddings); else None (new tags every epoch)."""
    if getattr(args, "caption_variants", None) is not None:
        return int(args.caption_variants)
    if getattr(args, "cache_text_embeddings", False) and caption_options(args).varies_tags:
        return max(1, min(int(num_train_epochs), CACHED_VARIANTS))
    return None


def caption_augmenter(args: argparse.Namespace, num_train_epochs: int) -> CaptionAugmenter:
    """The run's :class:`~hf_arb.train.captions.CaptionAugmenter`: ``augment(batch, epoch)`` in the training loop. The
    default number of variants of a cached run is said once."""
    variants = caption_variant_count(args, num_train_epochs)
    main = int(os.environ.get("RANK", "0") or 0) == 0
    if variants is not None and getattr(args, "caption_variants", None) is None and main:
        logger.info("--cache_text_embeddings with varying tags: %d tag variants per caption (epoch e trains variant "
                    "e %% %d; set --caption_variants to change it).", variants, variants)
    return CaptionAugmenter(caption_options(args), seed=args.seed, variants=variants)
