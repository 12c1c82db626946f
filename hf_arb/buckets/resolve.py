"""The BucketSet a command line describes (a preset or diffusers' bucket string), and the notes to show about the
options it ignores: shared by ``hf-arb buckets`` / ``hf-arb annotate`` and ``train_text_to_image_arb.py``."""

from __future__ import annotations

import warnings

from .presets import preset_notes
from .sets import BucketSet


def resolve_buckets(preset: str | None, buckets_string: str | None = None, *, resolution: int | None = None,
                    step: int | None = None, metric: str = "log", max_aspect_error: float | None = None,
                    **table_params: int) -> tuple[BucketSet, list[str]]:
    """The BucketSet a command line describes, and the notes to show about options it ignores.

    Shared by ``hf-arb buckets`` / ``hf-arb annotate`` and ``train_text_to_image_arb.py``.

    Args:
        preset: a name from :data:`hf_arb.PRESETS` (used when ``buckets_string`` is empty).
        buckets_string: diffusers' ``"h1,w1;h2,w2"`` (``--aspect_ratio_buckets``); replaces the preset.
        resolution, step, metric, max_aspect_error, table_params: as :meth:`BucketSet.preset` takes them.

    Returns:
        ``(buckets, notes)``: ``notes`` are sentences such as "preset 'sdxl' ignores resolution=768: its table is
        fixed (...)" (:func:`hf_arb.buckets.presets.preset_notes`), for the caller to print or log once.

    Raises:
        ValueError: a bad value, named in BucketSet's parameter names (see :func:`in_flags`).
    """
    if buckets_string:
        return BucketSet.from_string(buckets_string, metric=metric, max_aspect_error=max_aspect_error), []
    if preset is None:
        raise ValueError("No bucket table: pass a preset name or a 'height,width;height,width' bucket string.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the same sentences come back as `notes`
        bs = BucketSet.preset(preset, resolution=resolution, step=step, metric=metric,
                              max_aspect_error=max_aspect_error, **table_params)
    return bs, preset_notes(preset, resolution)
