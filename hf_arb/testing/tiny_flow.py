"""Tiny, randomly initialised Stable Diffusion 3 and Flux.1 pipelines built offline.

The same architectures as SD3/SD3.5 (two CLIP text encoders with projection + T5, ``SD3Transformer2DModel``,
16-channel VAE, patch size 2) and Flux.1 (CLIP + T5, ``FluxTransformer2DModel`` on 2×2-packed latents with a
guidance input) at toy sizes, from configs alone; saved with ``save_pretrained`` they load with the stock
``StableDiffusion3Pipeline`` / ``FluxPipeline``. Latent sides are legal at multiples of 16 pixels (VAE factor 8 ×
patch 2), like the real models. Also importable from :mod:`hf_arb.testing.tiny`.

The T5 tokenizer is built offline too: transformers' ``T5Tokenizer`` (the ``tokenizers``-backed one) accepts a
Unigram vocabulary as ``(piece, score)`` pairs; printable ASCII characters, alone and with the ``▁`` word-start
marker, tokenise any English prompt character by character.

Example:
    ```py
    >>> from hf_arb.testing.tiny import save_tiny_flux
    >>> path = save_tiny_flux("/tmp/tiny-flux")
    >>> from diffusers import FluxPipeline
    >>> image = FluxPipeline.from_pretrained(path)("a cat", height=48, width=80, num_inference_steps=1).images[0]
    >>> image.size
    (80, 48)
    ```
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

__all__ = ["tiny_t5_tokenizer", "tiny_sd3_pipeline", "tiny_flux_pipeline", "tiny_flux_kontext_pipeline",
           "save_tiny_sd3", "save_tiny_flux", "save_tiny_flux_kontext"]

_T5_DIM = 64  # T5 d_model = the transformers' joint_attention_dim; also 2 × the CLIP width (SD3 pads CLIP to it)
_LATENT_CHANNELS = 16


def tiny_t5_tokenizer(model_max_length: int = 512) -> Any:
    """A working T5 tokenizer (Unigram over printable ASCII characters, no download), ``<pad>`` = 0, ``</s>`` = 1."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    chars = [c for c in string.printable if not c.isspace()]
    vocab += [(c, -3.0) for c in chars] + [("▁" + c, -2.5) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def _t5_encoder(vocab_size: int, seed: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=vocab_size, d_model=_T5_DIM, d_kv=8, d_ff=48, num_layers=1, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, is_encoder_decoder=False)
    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed)
        return T5EncoderModel(config).eval()


def _flow_vae(seed: int, scaling_factor: float, shift_factor: float) -> Any:
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed)
        return AutoencoderKL(
            in_channels=3, out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,  # 4 blocks -> scale factor 8
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=_LATENT_CHANNELS,
            norm_num_groups=4, sample_size=64, use_quant_conv=False, use_post_quant_conv=False,
            scaling_factor=scaling_factor, shift_factor=shift_factor,
        ).eval()


def _flow_scheduler(dynamic_shifting: bool) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    if dynamic_shifting:  # Flux.1's scheduler values
        return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                               base_image_seq_len=256, max_image_seq_len=4096)
    return FlowMatchEulerDiscreteScheduler(shift=3.0)  # SD3 / SD3.5


def tiny_sd3_pipeline(seed: int = 0, dynamic_shifting: bool = False) -> Any:
    """A ``StableDiffusion3Pipeline`` with the SD3 architecture at toy size, random weights.

    Args:
        seed: weights seed (the caller's global RNG is left untouched).
        dynamic_shifting: give the scheduler Flux-style resolution-dependent shifting (``use_dynamic_shifting``);
            off by default, like SD3/SD3.5's static ``shift=3.0``.
    """
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    from .tiny_text import tiny_clip_text_encoder, tiny_clip_tokenizer

    tok = tiny_clip_tokenizer()
    t5 = tiny_t5_tokenizer(256)
    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed + 3)
        transformer = SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=_LATENT_CHANNELS, out_channels=_LATENT_CHANNELS, num_layers=2,
            attention_head_dim=8, num_attention_heads=4, joint_attention_dim=_T5_DIM, caption_projection_dim=32,
            pooled_projection_dim=64, pos_embed_max_size=64,
        )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=_flow_scheduler(dynamic_shifting),
        vae=_flow_vae(seed + 1, scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=tiny_clip_text_encoder(len(tok), with_projection=True, seed=seed + 2),
        tokenizer=tok,
        text_encoder_2=tiny_clip_text_encoder(len(tok), with_projection=True, seed=seed + 4),
        tokenizer_2=tiny_clip_tokenizer(),
        text_encoder_3=_t5_encoder(len(t5), seed + 5),
        tokenizer_3=t5,
    )


def tiny_flux_pipeline(seed: int = 0) -> Any:
    """A ``FluxPipeline`` with the Flux.1-dev architecture at toy size (guidance-distilled input), random weights.

    The scheduler uses Flux.1's resolution-dependent shift (``use_dynamic_shifting=True``).
    """
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from .tiny_text import tiny_clip_text_encoder, tiny_clip_tokenizer

    tok = tiny_clip_tokenizer()
    t5 = tiny_t5_tokenizer(512)
    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed + 3)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * _LATENT_CHANNELS, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=_T5_DIM, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 4, 8),
        )
    return FluxPipeline(
        scheduler=_flow_scheduler(True),
        vae=_flow_vae(seed + 1, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=tiny_clip_text_encoder(len(tok), with_projection=False, seed=seed + 2),
        tokenizer=tok,
        text_encoder_2=_t5_encoder(len(t5), seed + 5),
        tokenizer_2=t5,
        transformer=transformer,
    )


def tiny_flux_kontext_pipeline(seed: int = 0) -> Any:
    """:func:`tiny_flux_pipeline`'s parts as a ``FluxKontextPipeline`` (Flux.1 Kontext has Flux.1's architecture)."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**tiny_flux_pipeline(seed).components)


def save_tiny_flux_kontext(path: str | Path, seed: int = 0) -> str:
    """Build :func:`tiny_flux_kontext_pipeline` and ``save_pretrained`` it to ``path``; returns the path."""
    tiny_flux_kontext_pipeline(seed).save_pretrained(Path(path))
    return str(path)


def save_tiny_sd3(path: str | Path, seed: int = 0, dynamic_shifting: bool = False) -> str:
    """Build :func:`tiny_sd3_pipeline` and ``save_pretrained`` it to ``path``; returns the path as a string."""
    tiny_sd3_pipeline(seed, dynamic_shifting).save_pretrained(Path(path))
    return str(path)


def save_tiny_flux(path: str | Path, seed: int = 0) -> str:
    """Build :func:`tiny_flux_pipeline` and ``save_pretrained`` it to ``path``; returns the path as a string."""
    tiny_flux_pipeline(seed).save_pretrained(Path(path))
    return str(path)
