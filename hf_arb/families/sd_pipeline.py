"""Stable Diffusion pipeline for UNets with size/crop conditioning (``--resolution_conditioning`` models).

This file is **self-contained** (it imports only torch and diffusers): the training script copies it into every
resolution-conditioned model folder as ``pipeline.py``, so that plain diffusers, without hf_arb installed, loads
the folder through its custom-pipeline mechanism:

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained("folder", custom_pipeline="folder", trust_remote_code=True)
    image = pipe("a lighthouse", height=768, width=512).images[0]

The UNet is a stock ``UNet2DConditionModel`` with ``class_embed_type="projection"`` and
``projection_class_embeddings_input_dim = 6 * dim``: its class label is the six SDXL micro-conditioning ids
``(original h, original w, crop top, crop left, target h, target w)``, each embedded with a ``dim``-wide sinusoid
(SDXL's ``add_time_proj`` layout). ``hf_arb.families.conditioning`` computes the same labels for training.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from diffusers import StableDiffusionPipeline

NUM_TIME_IDS = 6


def embed_time_ids(time_ids: torch.Tensor, dim: int) -> torch.Tensor:
    """``(B, 6)`` ids → ``(B, 6 * dim)``: per id ``[cos, sin]`` halves of ``x * 10000 ** (-k / (dim / 2))``."""
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=time_ids.device) / half
    args = time_ids.reshape(-1).float()[:, None] * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).reshape(time_ids.shape[0], NUM_TIME_IDS * dim)


def conditioning_dim(unet: Any) -> int | None:
    """Per-id sinusoid width of a resolution-conditioned UNet, or None for a stock SD UNet."""
    cfg = unet.config
    width = cfg.get("projection_class_embeddings_input_dim") or 0
    if cfg.get("class_embed_type") != "projection" or cfg.get("addition_embed_type") is not None:
        return None
    return width // NUM_TIME_IDS if width and width % NUM_TIME_IDS == 0 else None


class StableDiffusionResolutionPipeline(StableDiffusionPipeline):
    """``StableDiffusionPipeline`` that feeds size/crop ids to a resolution-conditioned SD 1.x / 2.x UNet.

    Takes SDXL's ``original_size``, ``crops_coords_top_left`` and ``target_size`` (``(h, w)``, ``(top, left)``,
    ``(h, w)``; defaults: the output size, ``(0, 0)``, the output size). With a stock UNet it is exactly its parent.
    """

    def __call__(  # type: ignore[override]
        self,
        *args: Any,
        original_size: Sequence[int] | None = None,
        crops_coords_top_left: Sequence[int] = (0, 0),
        target_size: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> Any:
        dim = conditioning_dim(self.unet)
        if dim is None:
            return super().__call__(*args, **kwargs)
        factor = self.vae_scale_factor
        height = kwargs.get("height") or self.unet.config.sample_size * factor
        width = kwargs.get("width") or self.unet.config.sample_size * factor
        ids = [*(original_size or (height, width)), *crops_coords_top_left, *(target_size or (height, width))]
        labels = embed_time_ids(torch.tensor([ids], dtype=torch.float32), dim)  # (1, 6 * dim)

        def inject(module: Any, a: tuple, kw: dict) -> tuple[tuple, dict]:
            sample = a[0] if a else kw["sample"]
            kw["class_labels"] = labels.to(sample.device, sample.dtype).expand(sample.shape[0], -1)
            return a, kw

        handle = self.unet.register_forward_pre_hook(inject, with_kwargs=True)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            handle.remove()
