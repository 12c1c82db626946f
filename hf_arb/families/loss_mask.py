"""The masked loss (``--masked_loss``): the per-element squared error weighted by the batch's loss mask, in one place
for every family.

A batch may carry ``loss_mask``: each latent cell's loss weight, ``(B, 1, h, w)`` float on the latent grid (or, in a
pack, a list of ``(1, h_i, w_i)``), built by the data side (:mod:`hf_arb.images.masks`: the mask fitted with its
image's exact crop, area-averaged to the latent grid, floored at ``--unmasked_weight``). The loss functions
(:func:`hf_arb.families.unet_loss.unet_loss`, :func:`hf_arb.families.flow.flow_matching_loss`,
:func:`hf_arb.packing.loss.packed_flow_loss`) multiply their per-element error by it with :func:`apply_loss_mask`
*before* their own reduction, which is unchanged: the mean over every element (masked-out ones count as zeros),
then the batch — what sd-scripts does (``apply_masked_loss`` then ``loss.mean([1, 2, 3])``). A batch without the key
trains exactly as before (the error tensor is returned as it is), and an all-ones mask gives the same loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LOSS_MASK", "apply_loss_mask", "batch_loss_mask"]

#: the batch key of the loss weights per latent cell
LOSS_MASK = "loss_mask"


def batch_loss_mask(batch: Mapping[str, Any], device: Any) -> torch.Tensor | None:
    """The batch's ``loss_mask`` as float32 on ``device`` (``(B, 1, h, w)``), or ``None`` when it has none (a list,
    a pack's masks, comes back as a list of tensors)."""
    mask = batch.get(LOSS_MASK)
    if mask is None:
        return None
    if isinstance(mask, (list, tuple)):
        return [m.to(device, torch.float32) for m in mask]  # type: ignore[return-value]
    return mask.to(device, torch.float32)


def apply_loss_mask(error: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``error * mask`` (the per-element loss weighted by the mask), or ``error`` itself when ``mask`` is None.

    Args:
        error: the per-element loss, e.g. ``(B, C, h, w)``.
        mask: weights broadcastable to ``error`` without growing it (``(B, 1, h, w)``, or the error's own shape).

    Raises:
        ValueError: a mask of another shape (another latent grid), naming both shapes.
    """
    if mask is None:
        return error
    if mask.ndim != error.ndim or any(m not in (1, e) for m, e in zip(mask.shape, error.shape)) or (
            mask.shape[0] != error.shape[0]) or mask.shape[2:] != error.shape[2:]:
        raise ValueError(f"The loss mask {tuple(mask.shape)} does not fit the loss {tuple(error.shape)}: it must be on "
                         "the same latent grid, one weight per latent cell (or per element).")
    return error * mask
