"""The masked-loss flags (``--masked_loss``, issue 36): sd-scripts' ``--masked_loss`` / ``--alpha_mask``, a mask column
or a folder of masks named like the images (sd-scripts' ``conditioning_data_dir``), OneTrainer's
``--unmasked_weight``; parsed here and checked before anything loads, each mistake in one line naming the fix.
The run's data source reads them (:mod:`hf_arb.train.sources.masks`); the loop never does."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Callable

from hf_arb.checks import UsageError, UsageFileError


def add_mask_flags(a: Callable[..., Any]) -> None:
    """Add the masked-loss flags with ``a`` (the parser's ``add_argument``)."""
    a("--masked_loss", action="store_true",
      help="sd-scripts' flag: weight each latent cell's loss by the image's mask (fitted with the image's own crop, "
           "averaged over the cell's pixels); needs a mask source: --alpha_mask, --mask_column or --mask_dir "
           "(each implies it).")
    a("--alpha_mask", action="store_true",
      help="sd-scripts' flag: the image's alpha channel is its loss mask (opaque: trained; transparent: not); an "
           "image without one is trained everywhere. Implies --masked_loss.")
    a("--mask_column", type=str, default=None,
      help="NEW: a dataset column of mask images, one per row (white: trained, black: not; the R channel). "
           "Implies --masked_loss.")
    a("--mask_dir", type=str, default=None,
      help="NEW (sd-scripts' conditioning_data_dir): a folder of mask images named like the training images "
           "(same file name, or same stem with another image extension). Implies --masked_loss.")
    a("--unmasked_weight", type=float, default=0.0,
      help="OneTrainer's flag: the loss weight outside the mask, 0..1 (each cell's weight is max(mask, this)).")


def check_mask_flags(args: argparse.Namespace) -> None:
    """One mask source at most; a source turns ``args.masked_loss`` on; the combinations not supported yet and a
    folder that cannot serve as a mask folder are refused naming the fix."""
    sources = [flag for flag, given in (("--alpha_mask", args.alpha_mask), ("--mask_column", args.mask_column),
                                        ("--mask_dir", args.mask_dir)) if given]
    if len(sources) > 1:
        raise UsageError(f"{' and '.join(sources)} are two mask sources: keep one (the alpha channel, a mask column "
                         "or a mask folder).")
    if args.masked_loss and not sources:
        raise UsageError("--masked_loss needs masks: add --alpha_mask (the images' transparency), --mask_column "
                         "COLUMN (a column of mask images) or --mask_dir DIR (mask files named like the images).")
    args.masked_loss = bool(sources)  # a source implies it, as sd-scripts' --alpha_mask does
    if not 0.0 <= args.unmasked_weight <= 1.0:
        raise UsageError(f"--unmasked_weight {args.unmasked_weight:g}: the loss weight outside the mask must be "
                         "in [0, 1] (0: only the mask trains; 1: no masking).")
    if not args.masked_loss:
        if args.unmasked_weight != 0.0:
            raise UsageError(f"--unmasked_weight {args.unmasked_weight:g} has no effect in this run: it weights the "
                             "loss outside a mask: add --alpha_mask, --mask_column or --mask_dir, or drop it.")
        return
    what = sources[0]
    unsupported = [("--streaming", getattr(args, "streaming", False)),
                   ("--reference_image_column", getattr(args, "reference_image_column", None)),
                   (f"--resolution {','.join(map(str, getattr(args, 'resolutions', None) or []))}",
                    len(getattr(args, "resolutions", None) or []) > 1)]
    for flag, given in unsupported:
        if given:
            raise UsageError(f"{what} (masked loss) is not supported with {flag} yet: drop one of them.")
    if args.mask_dir is not None:
        folder = Path(args.mask_dir)
        if not folder.is_dir():
            raise UsageFileError(f"--mask_dir {args.mask_dir}: no such folder (mask images named like the training "
                                 "images).")
        data = args.train_data_dir if args.dataset_name is None else None
        data = data or getattr(args, "instance_data_dir", None)
        if data is not None and Path(data).is_dir():
            inside = os.path.commonpath([folder.resolve(), Path(data).resolve()]) == str(Path(data).resolve())
            if inside:
                raise UsageError(f"--mask_dir {args.mask_dir} is inside the image folder {data}: the image folder "
                                 "loader would train the masks as images. Move the masks to a folder of their own.")
