"""What every bucketed batch holds, written once: the caption a row trains with, and the stacking of the
fields that image batches (:class:`hf_arb.images.dataset.BucketedImageDataset`) and cached-latent batches
(:class:`hf_arb.train.cache.latent_dataset.CachedLatentDataset`) share.

A batch dict has ``original_sizes``, ``crop_top_lefts``, ``target_sizes`` (``long (B, 2)``, as ``(h, w)`` /
``(y, x)``: what diffusers' SDXL pipeline computes), ``captions`` (``list[str]`` of length ``B``), ``rows`` and
``buckets`` (``long (B,)``), plus the pixels or latents of its kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hf_arb.rng import ROW_CAPTION, row_rng


def choose_caption(caption: Any, *, seed: int, epoch: int, row: int, column: str | None = None) -> str:
    """The caption row ``row`` trains with in ``epoch``: the string itself, ``""`` for None, or one of a list of
    strings drawn from the row's own stream (``rng.ROW_CAPTION``), so every worker, rank and resumed run agrees.

    Raises:
        ValueError: anything else, naming the row and the column.
    """
    if caption is None:
        return ""
    if isinstance(caption, str):
        return caption
    if isinstance(caption, (list, tuple, np.ndarray)) and len(caption) > 0 and all(isinstance(c, str) for c in caption):
        return str(caption[int(row_rng(seed, epoch, row, ROW_CAPTION).integers(len(caption)))])
    where = f"caption column {column!r}" if column else "the caption"
    raise ValueError(f"Row {row}: {where} must hold a string or a non-empty list of strings, got "
                     f"{type(caption).__name__}: {caption!r}.")


def collate_common(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack the fields every sample has (``original_size``, ``crop_top_left``, ``target_size``, ``caption``,
    ``row``, ``bucket``) into the batch keys of the module docstring."""
    import torch

    return {
        "original_sizes": torch.tensor([s["original_size"] for s in samples], dtype=torch.long),  # (B, 2) h, w
        "crop_top_lefts": torch.tensor([s["crop_top_left"] for s in samples], dtype=torch.long),  # (B, 2) y, x
        "target_sizes": torch.tensor([s["target_size"] for s in samples], dtype=torch.long),  # (B, 2) h, w
        "captions": [s["caption"] for s in samples],
        "rows": torch.tensor([s["row"] for s in samples], dtype=torch.long),  # (B,)
        "buckets": torch.tensor([s["bucket"] for s in samples], dtype=torch.long),  # (B,)
    }


def collate_buckets(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack samples of one bucket into the batch dict (keys in the module docstring).

    Raises:
        ValueError: the samples have different image sizes (the batch mixes buckets). Drive the DataLoader
            with ``BucketBatchSampler``, whose batches are one bucket each.
    """
    if len(samples) == 0:
        raise ValueError("Cannot collate an empty batch.")
    shapes = {tuple(s["pixel_values"].shape) for s in samples}
    if len(shapes) > 1:
        raise ValueError(
            f"A batch must hold one bucket size, got {sorted(shapes)} for rows {[s['row'] for s in samples]}. "
            "Use BucketBatchSampler as the DataLoader's batch_sampler."
        )
    batch: dict[str, Any] = {
        "pixel_values": torch.stack([s["pixel_values"] for s in samples]),  # (B, 3, H, W)
        **collate_common(samples),
        "flipped": torch.tensor([s["flipped"] for s in samples], dtype=torch.bool),  # (B,)
    }
    for key in sorted(k for k in samples[0] if k.startswith("input_ids")):
        batch[key] = torch.stack([s[key] for s in samples])  # (B, L)
    return batch
