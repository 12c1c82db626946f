"""Size and crop conditioning: SDXL micro-conditioning time ids, and the same signal for SD 1.x / 2.x.

With aspect-ratio bucketing, every training image has its own original size, crop and target (bucket) size.
SDXL was trained to be told these six numbers; this module computes them per sample exactly as
``StableDiffusionXLPipeline._get_add_time_ids`` does at inference:

    time_ids = (original_h, original_w, crop_top, crop_left, target_h, target_w)

SD 1.x / 2.x UNets have no such input. :func:`add_resolution_conditioning` gives them one through diffusers' own
``class_embed_type="projection"`` added embedding, whose last layer is zero-initialised so that the model's output
is *identical* to the base model's until training moves it. The resulting UNet is a stock
``UNet2DConditionModel``; :class:`StableDiffusionResolutionPipeline` (a ``StableDiffusionPipeline`` subclass)
feeds it the six ids at inference.

Sizes here are ``(h, w)`` and crops ``(y, x)``, because that is what diffusers' SDXL pipeline uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .sd_pipeline import StableDiffusionResolutionPipeline

__all__ = [
    "sdxl_time_ids",
    "inference_time_ids",
    "resolution_class_labels",
    "add_resolution_conditioning",
    "has_resolution_conditioning",
    "resolution_embed_dim",
    "StableDiffusionResolutionPipeline",
    "save_custom_pipeline",
]

#: Number of micro-conditioning ids: original (h, w), crop (top, left), target (h, w).
NUM_TIME_IDS = 6


def _as_pairs(x: Any, name: str) -> torch.Tensor:
    """``(B, 2)`` or ``(2,)`` array-like → float tensor of shape ``(B, 2)``."""
    t = torch.as_tensor(x, dtype=torch.float32)
    if t.ndim == 1:
        t = t[None]
    if t.ndim != 2 or t.shape[1] != 2:
        raise ValueError(f"`{name}` must have shape (B, 2) or (2,), got {tuple(t.shape)}.")
    return t


def sdxl_time_ids(
    original_sizes: Any,
    crop_top_lefts: Any,
    target_sizes: Any,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Per-sample SDXL time ids.

    Args:
        original_sizes: ``(B, 2)`` ``(h, w)`` of each image before resizing (displayed size).
        crop_top_lefts: ``(B, 2)`` ``(y, x)`` of the crop in the resized image.
        target_sizes: ``(B, 2)`` ``(h, w)``, the bucket size the image was fitted to.
        dtype, device: of the result (default float32 on CPU).

    Returns:
        ``(B, 6)`` tensor ``(orig_h, orig_w, crop_top, crop_left, target_h, target_w)``, row for row what
        ``StableDiffusionXLPipeline._get_add_time_ids(original_size, crops_coords_top_left, target_size, ...)``
        returns for that sample.
    """
    o = _as_pairs(original_sizes, "original_sizes")
    c = _as_pairs(crop_top_lefts, "crop_top_lefts")
    t = _as_pairs(target_sizes, "target_sizes")
    if not (o.shape[0] == c.shape[0] == t.shape[0]):
        raise ValueError(
            f"original_sizes, crop_top_lefts and target_sizes must have the same batch size, got "
            f"{o.shape[0]}, {c.shape[0]} and {t.shape[0]}."
        )
    ids = torch.cat([o, c, t], dim=1)  # (B, 6)
    return ids.to(device=device, dtype=dtype or torch.float32)


def inference_time_ids(
    height: int,
    width: int,
    original_size: Sequence[int] | None = None,
    crops_coords_top_left: Sequence[int] = (0, 0),
    target_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """The ``(1, 6)`` ids a pipeline uses when generating at ``height`` × ``width`` (SDXL's defaults)."""
    original_size = tuple(original_size or (height, width))
    target_size = tuple(target_size or (height, width))
    return sdxl_time_ids([original_size], [tuple(crops_coords_top_left)], [target_size])


def _sinusoid(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of scalars, as diffusers' ``Timesteps(dim, flip_sin_to_cos=True, shift=0)``.

    ``x``: ``(N,)`` → ``(N, dim)`` with ``[cos, sin]`` halves (``dim`` even).
    """
    if dim % 2:
        raise ValueError(f"The resolution embedding dimension must be even, got {dim}.")
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=x.device) / half  # (half,)
    args = x.float()[:, None] * torch.exp(exponent)[None, :]  # (N, half)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (N, dim)


def resolution_class_labels(time_ids: torch.Tensor, dim: int) -> torch.Tensor:
    """Embed ``(B, 6)`` time ids into the ``(B, 6 * dim)`` vector fed to the UNet's projection class embedding.

    Each id is embedded with the same sinusoid SDXL's ``add_time_proj`` uses, and the six embeddings are
    concatenated (SDXL's layout).
    """
    if time_ids.ndim != 2 or time_ids.shape[1] != NUM_TIME_IDS:
        raise ValueError(f"`time_ids` must have shape (B, {NUM_TIME_IDS}), got {tuple(time_ids.shape)}.")
    b = time_ids.shape[0]
    return _sinusoid(time_ids.reshape(-1), dim).reshape(b, NUM_TIME_IDS * dim)


def has_resolution_conditioning(unet: Any) -> bool:
    """True when ``unet`` carries the SD 1.x resolution embedding added by :func:`add_resolution_conditioning`."""
    cfg = unet.config
    return (
        cfg.get("class_embed_type") == "projection"
        and cfg.get("addition_embed_type") is None
        and (cfg.get("projection_class_embeddings_input_dim") or 0) % NUM_TIME_IDS == 0
    )


def resolution_embed_dim(unet: Any) -> int:
    """Per-id sinusoid width of a resolution-conditioned UNet (``projection_class_embeddings_input_dim / 6``)."""
    if not has_resolution_conditioning(unet):
        raise ValueError(
            "This UNet has no resolution conditioning (class_embed_type must be 'projection' with an input "
            f"dimension divisible by {NUM_TIME_IDS}); got class_embed_type={unet.config.get('class_embed_type')!r}. "
            "Train with --resolution_conditioning or call "
            "hf_arb.families.conditioning.add_resolution_conditioning(unet)."
        )
    return int(unet.config.projection_class_embeddings_input_dim) // NUM_TIME_IDS


def add_resolution_conditioning(unet: Any, embed_dim: int = 256) -> Any:
    """Return a copy of an SD 1.x / 2.x UNet with a zero-initialised size/crop embedding.

    The new UNet has ``class_embed_type="projection"`` and ``projection_class_embeddings_input_dim = 6 *
    embed_dim``; every base weight is copied, and the embedding's output layer is zero, so for any input its
    output equals the base UNet's exactly until training changes that layer.

    Args:
        unet: a ``UNet2DConditionModel`` without class or added embeddings (SDXL UNets already have theirs).
        embed_dim: sinusoid width per id (SDXL uses 256).

    Raises:
        ValueError: the UNet already has a class embedding or an added embedding.
    """
    from diffusers import UNet2DConditionModel

    cfg = dict(unet.config)
    if has_resolution_conditioning(unet):
        return unet
    if (
        cfg.get("class_embed_type") is not None
        or cfg.get("num_class_embeds") is not None
        or cfg.get("addition_embed_type")
    ):
        raise ValueError(
            "--resolution_conditioning is for SD 1.x / 2.x UNets without class or added embeddings, but this UNet has "
            f"class_embed_type={cfg.get('class_embed_type')!r}, num_class_embeds={cfg.get('num_class_embeds')!r}, "
            f"addition_embed_type={cfg.get('addition_embed_type')!r}. SDXL UNets already take size/crop time ids: "
            "drop the flag."
        )
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg.update(class_embed_type="projection", projection_class_embeddings_input_dim=NUM_TIME_IDS * embed_dim)
    new = UNet2DConditionModel(**cfg)
    missing, unexpected = new.load_state_dict(unet.state_dict(), strict=False)
    if unexpected or any(not k.startswith("class_embedding.") for k in missing):
        raise RuntimeError(f"Copying UNet weights failed: missing {missing}, unexpected {unexpected}.")
    with torch.no_grad():
        new.class_embedding.linear_2.weight.zero_()
        new.class_embedding.linear_2.bias.zero_()
    new.to(unet.device)
    return new if unet.dtype == torch.float32 else new.to(dtype=unet.dtype)


#: File name diffusers looks for when ``custom_pipeline`` is a folder or a Hub repository.
CUSTOM_PIPELINE_FILE = "pipeline.py"


def save_custom_pipeline(folder: str | Path) -> Path:
    """Make a saved resolution-conditioned pipeline folder load in plain diffusers, without hf_arb.

    Copies the self-contained :mod:`hf_arb.families.sd_pipeline` into ``folder`` as ``pipeline.py``, diffusers'
    custom-pipeline file, so that ``DiffusionPipeline.from_pretrained(folder, custom_pipeline=folder,
    trust_remote_code=True)`` (for a Hub repository: its id in both places) builds
    :class:`StableDiffusionResolutionPipeline` from the folder's own code. ``model_index.json`` keeps the class
    name, so ``StableDiffusionResolutionPipeline.from_pretrained(folder)`` still works where hf_arb is installed.

    Returns:
        The copied pipeline file.
    """
    import shutil

    from hf_arb.families import sd_pipeline as pipeline_sd_resolution

    target = Path(folder) / CUSTOM_PIPELINE_FILE
    shutil.copyfile(pipeline_sd_resolution.__file__, target)
    return target
