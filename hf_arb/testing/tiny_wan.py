"""A tiny, randomly initialised Wan 2.1 text-to-video pipeline built offline (no Hub).

The same architecture as ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` at toy size: a UMT5 text encoder
(``UMT5EncoderModel``), the causal video VAE ``AutoencoderKLWan`` (spatial factor 8, temporal factor 4: clips of
``4k+1`` frames, 16 latent channels with per-channel ``latents_mean`` / ``latents_std``),
``WanTransformer3DModel`` (patch ``(1, 2, 2)``) and Wan's scheduler (``UniPCMultistepScheduler`` on flow sigmas with
the fixed ``flow_shift`` 3.0 of the 480p checkpoints). Saved with ``save_pretrained``, it loads with the stock
``WanPipeline``. Bucket sides are legal at multiples of 16 pixels (VAE factor 8 × patch 2), like the real model.

The tokenizer is :func:`hf_arb.testing.tiny_flow.tiny_t5_tokenizer` (a Unigram T5 tokenizer over printable ASCII,
no download): Wan's UMT5 tokenizer is a T5 SentencePiece tokenizer with a larger vocabulary.

Example:
    ```py
    >>> from hf_arb.testing.tiny_wan import save_tiny_wan
    >>> path = save_tiny_wan("/tmp/tiny-wan")
    >>> from diffusers import WanPipeline
    >>> video = WanPipeline.from_pretrained(path)("a cat", height=32, width=48, num_frames=9,
    ...                                           num_inference_steps=2, output_type="np").frames[0]
    >>> video.shape
    (9, 32, 48, 3)
    ```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .tiny_flow import tiny_t5_tokenizer

__all__ = ["save_tiny_wan", "tiny_wan_pipeline", "tiny_wan_vae"]

_TEXT_DIM = 32  # UMT5 d_model = the transformer's text_dim
_LATENT_CHANNELS = 16


def tiny_wan_vae(seed: int = 0) -> Any:
    """``AutoencoderKLWan`` at toy width: spatial factor 8 (three downsamples), temporal factor 4 (two), 16 latent
    channels, with per-channel ``latents_mean`` / ``latents_std`` unlike the identity (so that a loss that forgot the
    normalisation differs)."""
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed)
        return AutoencoderKLWan(
            base_dim=4, z_dim=_LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[round(0.05 * (i - 8), 3) for i in range(_LATENT_CHANNELS)],
            latents_std=[round(1.0 + 0.1 * i, 3) for i in range(_LATENT_CHANNELS)],
        ).eval()


def tiny_wan_pipeline(seed: int = 0, flow_shift: float = 3.0) -> Any:
    """A ``WanPipeline`` with the Wan 2.1 text-to-video architecture at toy size, random weights.

    Args:
        seed: weights seed (the caller's global RNG is left untouched).
        flow_shift: the scheduler's fixed shift (Wan 2.1's 480p checkpoints: 3.0; 720p: 5.0).
    """
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tok = tiny_t5_tokenizer(512)
    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed + 2)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tok), d_model=_TEXT_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, is_encoder_decoder=False)).eval()
        torch.random.manual_seed(seed + 3)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=_LATENT_CHANNELS,
            out_channels=_LATENT_CHANNELS, text_dim=_TEXT_DIM, freq_dim=32, ffn_dim=32, num_layers=2,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=flow_shift)
    return WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=tiny_wan_vae(seed + 1), scheduler=scheduler,
                       transformer=transformer)


def save_tiny_wan(path: str | Path, seed: int = 0, flow_shift: float = 3.0) -> str:
    """Build :func:`tiny_wan_pipeline` and ``save_pretrained`` it to ``path``; returns the path as a string."""
    tiny_wan_pipeline(seed, flow_shift).save_pretrained(Path(path))
    return str(path)
