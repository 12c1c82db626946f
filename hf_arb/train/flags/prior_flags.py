"""Prior preservation's flags, as diffusers' dreambooth scripts define them: ``--with_prior_preservation``,
``--class_data_dir``, ``--class_prompt``, ``--num_class_images`` (default 100), ``--prior_loss_weight`` (1.0),
``--sample_batch_size`` (4) and ``--prior_generation_precision`` (``no``, ``fp32``, ``fp16``, ``bf16``; default:
fp16 on a GPU, else fp32). The mode itself is a data source (:mod:`hf_arb.train.sources.prior`).

Checked before any model loads; a mistake is one line naming the flag and the fix. Upstream refuses a missing
``--class_data_dir`` / ``--class_prompt`` the same way, and warns when a class flag is given without
``--with_prior_preservation``, as this module does.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any, Callable

from hf_arb.checks import UsageError

__all__ = ["PRIOR_DEFAULTS", "PRIOR_GENERATION_PRECISIONS", "add_prior_flags", "check_prior_flags"]

logger = logging.getLogger("train_text_to_image_arb")

#: upstream's choices of --prior_generation_precision ("no": the default, fp16 on a GPU and fp32 on a CPU)
PRIOR_GENERATION_PRECISIONS = ("no", "fp32", "fp16", "bf16")
#: the class flags and upstream's defaults: given without --with_prior_preservation they change nothing (warned)
PRIOR_DEFAULTS: dict[str, Any] = {"class_data_dir": None, "class_prompt": None, "num_class_images": 100,
                                  "prior_loss_weight": 1.0, "sample_batch_size": 4,
                                  "prior_generation_precision": None}
#: modes prior preservation does not combine with yet: flag -> what to say
NOT_WITH_PRIOR = {
    "streaming": "a stream has no map-style rows to pair class images with",
    "packing": "packs mix sizes in one sequence, and class images pair by bucket",
    "cache_latents": "the class images' latents are not cached yet",
    "reference_image_column": "edit pairs carry reference images that class images do not have",
}


def add_prior_flags(a: Callable[..., Any]) -> None:
    """Add the flags to the parser (``a`` is its ``add_argument``); names, types and defaults are upstream's."""
    a("--with_prior_preservation", action="store_true",
      help="Prior preservation (diffusers' dreambooth scripts): every batch also trains as many class images of its "
           "bucket, and the loss is instance loss + --prior_loss_weight x class loss (docs/training.md, 'Prior "
           "preservation').")
    a("--class_data_dir", type=str, default=None,
      help="--with_prior_preservation: the folder of class images; missing ones (up to --num_class_images) are "
           "generated into it first, with the model's pipeline from --class_prompt.")
    a("--class_prompt", type=str, default=None,
      help="--with_prior_preservation: the caption of every class image (and the prompt that generates them).")
    a("--num_class_images", type=int, default=100,
      help="--with_prior_preservation: class images to train with; fewer in --class_data_dir are completed by "
           "generation (resumable; existing images are kept).")
    a("--prior_loss_weight", type=float, default=1.0, help="--with_prior_preservation: the weight of the class loss.")
    a("--sample_batch_size", type=int, default=4,
      help="--with_prior_preservation: images per pipeline call when generating class images (per process).")
    a("--prior_generation_precision", type=str, default=None, choices=PRIOR_GENERATION_PRECISIONS,
      help="--with_prior_preservation: the precision class images are generated in (default: fp16 on a GPU, fp32 "
           "on a CPU)." + "%(default).0s")


def check_prior_flags(args: argparse.Namespace) -> None:
    """Refuse what cannot work (one line each) and warn about class flags that change nothing."""
    if not args.with_prior_preservation:
        given = [f"--{f}" for f, d in PRIOR_DEFAULTS.items() if getattr(args, f) != d]
        if given and int(os.environ.get("RANK", "0") or 0) == 0:  # upstream warns too; once, from the main process
            logger.warning("%s: no effect without --with_prior_preservation (add it to train with class images).",
                           ", ".join(given))
        return
    if args.class_data_dir is None:
        raise UsageError("--with_prior_preservation needs --class_data_dir: the folder of class images (missing ones "
                         "are generated into it).")
    if args.class_prompt is None:
        raise UsageError("--with_prior_preservation needs --class_prompt: the caption of the class images (e.g. "
                         "\"a photo of a dog\").")
    if Path(args.class_data_dir).exists() and not Path(args.class_data_dir).is_dir():
        raise UsageError(f"--class_data_dir {args.class_data_dir} is a file: pass a folder (created if missing).")
    if args.num_class_images < 1:
        raise UsageError(f"--num_class_images must be >= 1, got {args.num_class_images}.")
    if args.sample_batch_size < 1:
        raise UsageError(f"--sample_batch_size must be >= 1, got {args.sample_batch_size}.")
    if args.prior_loss_weight < 0:
        raise UsageError(f"--prior_loss_weight must be >= 0, got {args.prior_loss_weight}.")
    for flag, why in NOT_WITH_PRIOR.items():
        if getattr(args, flag, None):
            raise UsageError(f"--with_prior_preservation does not combine with --{flag} yet: {why}. Drop one of them.")
    tiers = getattr(args, "resolutions", None) or [args.resolution]
    if len(tiers) > 1:
        raise UsageError(f"--with_prior_preservation does not combine with several tiers (--resolution "
                         f"{','.join(map(str, tiers))}) yet: train at one --resolution.")
