"""Tiny, randomly initialised Stable Diffusion pipelines built offline.

The demo (``make demo``), the tests and the CPU benchmarks need real diffusers pipelines, but there is no Hub
access at run time. These helpers build the same architectures as SD 1.x and SDXL at toy sizes (a few thousand
parameters per block), from configs alone, and save them in the folder layout that
``DiffusionPipeline.from_pretrained`` and the training script read.

Two facts this module encodes:

* the VAE needs **4 down blocks** so that its spatial scale factor is ``2 ** (4 - 1) = 8``, like the real models
  (pipelines derive ``vae_scale_factor`` from ``len(vae.config.block_out_channels)``);
* a CLIP tokenizer can be built without downloading anything: a byte-level alphabet vocabulary (each byte
  character, plain and with the ``</w>`` end-of-word suffix) and no merges.

SD3 and Flux.1 pipelines live in :mod:`hf_arb.testing.tiny_flow` and are importable from here too.

Example:
    ```py
    >>> from hf_arb.testing.tiny import save_tiny_sd
    >>> path = save_tiny_sd("/tmp/tiny-sd")
    >>> from diffusers import StableDiffusionPipeline
    >>> pipe = StableDiffusionPipeline.from_pretrained(path)
    ```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = [
    "tiny_clip_tokenizer",
    "tiny_sd_pipeline",
    "tiny_sdxl_pipeline",
    "save_tiny_sd",
    "save_tiny_sdxl",
    "save_tiny_imagefolder",
    "tiny_t5_tokenizer",
    "tiny_sd3_pipeline",
    "tiny_flux_pipeline",
    "save_tiny_sd3",
    "save_tiny_flux",
]

from .tiny_text import TEXT_HIDDEN, tiny_clip_text_encoder, tiny_clip_tokenizer

_BLOCKS = (32, 64)


def _vae(seed: int) -> Any:
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed)
        return AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,  # 4 blocks -> scale factor 8
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 16, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=64,
        ).eval()


def _unet(seed: int, *, sdxl: bool) -> Any:
    from diffusers import UNet2DConditionModel

    kwargs: dict[str, Any] = dict(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=_BLOCKS,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
        attention_head_dim=(2, 4),
    )
    if sdxl:
        time_dim = 8
        kwargs.update(
            cross_attention_dim=2 * TEXT_HIDDEN,  # both text encoders' hidden states, concatenated
            addition_embed_type="text_time",
            addition_time_embed_dim=time_dim,
            projection_class_embeddings_input_dim=6 * time_dim + TEXT_HIDDEN,  # 6 time ids + pooled text
            use_linear_projection=True,
        )
    else:
        kwargs.update(cross_attention_dim=TEXT_HIDDEN)
    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed)
        return UNet2DConditionModel(**kwargs)


def _scheduler() -> Any:
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        prediction_type="epsilon",
        steps_offset=1,
    )


def tiny_sd_pipeline(seed: int = 0) -> Any:
    """A ``StableDiffusionPipeline`` with the SD 1.x architecture at toy size, random weights.

    Latents are ``(B, 4, H/8, W/8)``; text hidden states ``(B, 77, 32)``. No safety checker.
    """
    from diffusers import StableDiffusionPipeline

    tok = tiny_clip_tokenizer()
    return StableDiffusionPipeline(
        vae=_vae(seed + 1),
        text_encoder=tiny_clip_text_encoder(len(tok), with_projection=False, seed=seed + 2),
        tokenizer=tok,
        unet=_unet(seed + 3, sdxl=False),
        scheduler=_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def tiny_sdxl_pipeline(seed: int = 0) -> Any:
    """A ``StableDiffusionXLPipeline`` with the SDXL architecture at toy size, random weights.

    Two text encoders (the second with a projection giving the pooled embedding, ``(B, 32)``), hidden states
    concatenated to ``(B, 77, 64)``, and the ``text_time`` added embedding for the 6 micro-conditioning ids.
    """
    from diffusers import StableDiffusionXLPipeline

    tok = tiny_clip_tokenizer()
    return StableDiffusionXLPipeline(
        vae=_vae(seed + 1),
        text_encoder=tiny_clip_text_encoder(len(tok), with_projection=False, seed=seed + 2),
        text_encoder_2=tiny_clip_text_encoder(len(tok), with_projection=True, seed=seed + 4),
        tokenizer=tok,
        tokenizer_2=tiny_clip_tokenizer(),
        unet=_unet(seed + 3, sdxl=True),
        scheduler=_scheduler(),
        force_zeros_for_empty_prompt=True,
    )


def save_tiny_sd(path: str | Path, seed: int = 0) -> str:
    """Build :func:`tiny_sd_pipeline` and ``save_pretrained`` it to ``path``; returns the path as a string."""
    path = Path(path)
    tiny_sd_pipeline(seed).save_pretrained(path)
    return str(path)


def save_tiny_sdxl(path: str | Path, seed: int = 0) -> str:
    """Build :func:`tiny_sdxl_pipeline` and ``save_pretrained`` it to ``path``; returns the path as a string."""
    path = Path(path)
    tiny_sdxl_pipeline(seed).save_pretrained(path)
    return str(path)


#: ``(width, height)`` of the tiny imagefolder's images: five aspect ratios, none exactly a bucket's.
TINY_IMAGE_SIZES: tuple[tuple[int, int], ...] = ((100, 97), (122, 72), (70, 118), (150, 49), (47, 146))
_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "hubble_deep_field.jpg")


def save_tiny_imagefolder(path: str | Path, per_size: int = 4, sizes: tuple[tuple[int, int], ...] = TINY_IMAGE_SIZES,
                          image_format: str = "png") -> str:
    """Write an ``imagefolder`` dataset (images + ``metadata.jsonl`` with a ``text`` column) for tests and demos.

    Images are crops of the real photographs shipped with scikit-image (when installed; otherwise smooth
    synthetic gradients), ``per_size`` images for each ``(width, height)`` in ``sizes``, each from a different
    photo region so that every file's content differs. Captions name the photo and the shape.

    Returns:
        ``path`` as a string; load it with ``datasets.load_dataset("imagefolder", data_dir=path)`` or pass it to
        the training script's ``--train_data_dir``.
    """
    import json

    import numpy as np
    from PIL import Image

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    photos: list[tuple[str, Image.Image]] = []
    try:
        import skimage

        folder = Path(skimage.__file__).parent / "data"
        photos = [(p.split(".")[0], Image.open(folder / p).convert("RGB")) for p in _PHOTOS if (folder / p).exists()]
    except ImportError:
        pass
    if not photos:
        yy, xx = np.mgrid[0:256, 0:256]
        photos = [(f"gradient{i}", Image.fromarray(np.stack([(xx + 37 * i) % 256, yy, (xx + yy + 91 * i) % 256],
                                                               -1).astype(np.uint8))) for i in range(3)]
    lines = []
    n = 0
    for w, h in sizes:
        for j in range(per_size):
            name, photo = photos[n % len(photos)]
            pw, ph = photo.size
            scale = min(pw / w, ph / h) * (0.6 + 0.1 * (j % 4))  # a different region size per image
            cw, ch = max(1, int(w * scale)), max(1, int(h * scale))
            x0 = (n * 37) % max(1, pw - cw + 1)
            y0 = (n * 53) % max(1, ph - ch + 1)
            im = photo.crop((x0, y0, x0 + cw, y0 + ch)).resize((w, h), Image.Resampling.LANCZOS)
            fname = f"{n:03d}_{w}x{h}.{image_format}"
            im.save(out / fname)
            shape = "square" if abs(w - h) < 10 else ("landscape" if w > h else "portrait")
            lines.append(json.dumps({"file_name": fname, "text": f"a {shape} photo of {name} number {j}"}))
            n += 1
    (out / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return str(out)


# SD3 / Flux builders live in their own module; re-exported here.
from .tiny_flow import (  # noqa: E402
    save_tiny_flux,
    save_tiny_sd3,
    tiny_flux_pipeline,
    tiny_sd3_pipeline,
    tiny_t5_tokenizer,
)
