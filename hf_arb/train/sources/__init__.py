"""``train/sources/``: the run's data, one *source* object per mode, built once by :func:`build_source` from the flags.

A source answers the few questions the training loop asks of its data, the same way in every mode
(:class:`~hf_arb.train.sources.base.Source`): the loader to prepare (and the object accelerate checkpoints with
it), the batch's bucket, its state for checkpoints (a stream writes per-rank files beside accelerate's), its
start-up report and run statistics, the step schedule (epochs of fixed or of their own length), where an epoch
starts and how a resumed run continues. :func:`source_class` is the only place outside argument validation
(``train/args.py``, ``train/arg_checks.py``) that reads the mode flags (``--streaming``, ``--packing``, several
``--resolution`` tiers, ``--reference_image_column``, ``--dataset_config``, ``--with_prior_preservation``,
``--video_column``); adding a mode adds a class here.

Modules:

- :mod:`~hf_arb.train.sources.base` — :class:`Source`, the questions and their shared answers;
- :mod:`~hf_arb.train.sources.bucketed` — map-style sources: bucketed, with reference images, tiered;
- :mod:`~hf_arb.train.sources.packed` — ``--packing``: packs of images at their own size (one tier or several);
- :mod:`~hf_arb.train.sources.prior` — ``--with_prior_preservation``: instance batches paired with class
  images of their bucket, and the class images (a subfolder: ``pairs``, ``class_images``);
- :mod:`~hf_arb.train.sources.streamed` — ``--streaming``: a bucketed stream (one tier or several);
- :mod:`~hf_arb.train.sources.clips` — ``--video_column``: clips and stills in (width, height, frames) buckets;
- :mod:`~hf_arb.train.sources.encoded` — ``--encoded_dataset``: stored latents and prompt embeddings;
- :mod:`~hf_arb.train.sources.encoded_stream` — ``--encoded_dataset --streaming``: the same, streamed;
- :mod:`~hf_arb.train.sources.reports` — the start-up tables of the map-style and packed sources;
- :mod:`~hf_arb.train.sources.dataset` — the map-style dataset, its bucket columns and the pre-model checks;
- :mod:`~hf_arb.train.sources.loaders` — samplers and DataLoaders of the map-style and packed sources;
- :mod:`~hf_arb.train.sources.stream` — the streamed dataset, its counts, loader and per-rank resume files;
- :mod:`~hf_arb.train.sources.tiers` — several ``--resolution`` tiers: flags, the combined bucket table, images;
- :mod:`~hf_arb.train.sources.multi` — ``--dataset_config``: several datasets, their shares, one global plan;
- :mod:`~hf_arb.train.sources.masks` — ``--masked_loss``: the map-style and packed sources with a loss mask per image
  (a subfolder: ``data``, the mask flags read, rows with masks, packed and cached masks);

The path of one batch through a source: docs/code_map.md. Part of floor 7 (``train/``): imports the floors below
and ``train/``'s own modules, never the script.
"""

from __future__ import annotations

import argparse
from typing import Any


def source_class(args: argparse.Namespace) -> type:
    """The :class:`~hf_arb.train.sources.base.Source` subclass of the run's mode flags (the allowed combinations:
    ``train/arg_checks.py`` refuses the others before this is asked); with a loss mask (``--masked_loss``), its
    masked counterpart (:func:`hf_arb.train.sources.masks.masked_class`)."""
    cls = mode_class(args)
    if getattr(args, "masked_loss", False):
        from .masks import masked_class

        cls = masked_class(args, cls)
    return cls


def mode_class(args: argparse.Namespace) -> type:
    """:func:`source_class` before masks: the class of ``--streaming``, ``--packing``, the tiers and references."""
    tiered = len(getattr(args, "resolutions", None) or []) > 1
    if getattr(args, "encoded_dataset", None):  # the flag checks refuse it with the other modes
        from .encoded import EncodedSource
        from .encoded_stream import EncodedStreamSource

        return EncodedStreamSource if getattr(args, "streaming", False) else EncodedSource
    if getattr(args, "video_column", None):  # clips in (W, H, F) buckets (the flag checks refuse the other modes)
        from .clips import ClipSource

        return ClipSource
    if getattr(args, "dataset_config", None):  # several datasets (the flag checks refuse the other modes with it)
        from .multi import MultiPriorSource, MultiSource

        # regularization datasets (kohya's is_reg): their images pair with the batches (prior preservation)
        specs = getattr(args, "dataset_specs", None) or []  # parsed by the flag checks
        return MultiPriorSource if any(s.regularization for s in specs) else MultiSource
    if getattr(args, "streaming", False):
        from .streamed import StreamSource, TieredStreamSource

        return TieredStreamSource if tiered else StreamSource
    if getattr(args, "packing", False):
        from .packed import PackedSource, TieredPackedSource

        return TieredPackedSource if tiered else PackedSource
    from .bucketed import BucketedSource, ReferenceSource, TieredSource

    if tiered:
        return TieredSource
    if getattr(args, "with_prior_preservation", False):  # instance batches paired with class images (prior.py)
        from .prior import PriorSource

        return PriorSource
    return ReferenceSource if getattr(args, "reference_image_column", None) else BucketedSource


def build_source(args: argparse.Namespace, accelerator: Any) -> Any:
    """The run's data source: its data loaded and checked (the plan, the upscale). ``accelerator`` None: one
    process, before torch, accelerate or any model is loaded (so data mistakes answer in seconds)."""
    return source_class(args)(args, accelerator)


__all__ = ["build_source", "source_class"]
