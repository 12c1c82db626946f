"""A tiny, randomly initialised LTX-Video text-to-video pipeline built offline (no Hub).

The same architecture as ``Lightricks/LTX-Video`` at toy size: a T5 text encoder (``T5EncoderModel``), the causal
video VAE ``AutoencoderKLLTXVideo`` with the real model's compression (patch 4, three spatio-temporal downsamples:
spatial factor 32, temporal factor 8, so clips of ``8k+1`` frames) and per-channel ``latents_mean`` /
``latents_std`` buffers unlike the identity, ``LTXVideoTransformer3DModel`` (patch 1 x 1, as the released
checkpoints) and the released scheduler's config (``FlowMatchEulerDiscreteScheduler`` with ``use_dynamic_shifting``,
``base_image_seq_len`` 1024, ``max_image_seq_len`` 4096, ``base_shift`` 0.95, ``max_shift`` 2.05). Saved with
``save_pretrained``, it loads with the stock ``LTXPipeline``. Bucket sides are legal at multiples of 32 pixels, as
``LTXPipeline.check_inputs`` demands of the real model.

The configs follow diffusers' own LTX pipeline tests (``tests/pipelines/ltx/test_ltx.py``: channels 8, one layer per
block, no timestep conditioning in the decoder), with the real model's patch and downsampling so the frame rule and
the spatial multiple are the real ones. The tokenizer is :func:`hf_arb.testing.tiny_flow.tiny_t5_tokenizer`.

Example:
    ```py
    >>> from hf_arb.testing.tiny_ltx import save_tiny_ltx
    >>> path = save_tiny_ltx("/tmp/tiny-ltx")
    >>> from diffusers import LTXPipeline
    >>> video = LTXPipeline.from_pretrained(path)("a cat", height=32, width=64, num_frames=9,
    ...                                           num_inference_steps=2, output_type="np").frames[0]
    >>> video.shape
    (9, 32, 64, 3)
    ```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .tiny_flow import tiny_t5_tokenizer

__all__ = ["save_tiny_ltx", "tiny_ltx_pipeline", "tiny_ltx_vae"]

_TEXT_DIM = 32  # T5 d_model = the transformer's caption_channels
_LATENT_CHANNELS = 8


def tiny_ltx_vae(seed: int = 0) -> Any:
    """``AutoencoderKLLTXVideo`` at toy width with the real compression (spatial 32, temporal 8), 8 latent channels and
    per-channel ``latents_mean`` / ``latents_std`` buffers unlike the identity (so that a loss that forgot the
    normalisation differs)."""
    from diffusers import AutoencoderKLLTXVideo

    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed)
        vae = AutoencoderKLLTXVideo(
            in_channels=3, out_channels=3, latent_channels=_LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, True, False),
            decoder_spatio_temporal_scaling=(True, True, True, False),
            decoder_inject_noise=(False, False, False, False, False), upsample_residual=(False, False, False, False),
            upsample_factor=(1, 1, 1, 1), timestep_conditioning=False, patch_size=4, patch_size_t=1,
            encoder_causal=True, decoder_causal=False)
    with torch.no_grad():
        vae.latents_mean.copy_(torch.tensor([round(0.05 * (i - 4), 3) for i in range(_LATENT_CHANNELS)]))
        vae.latents_std.copy_(torch.tensor([round(1.0 + 0.1 * i, 3) for i in range(_LATENT_CHANNELS)]))
    return vae.eval()


def tiny_ltx_pipeline(seed: int = 0) -> Any:
    """An ``LTXPipeline`` with the LTX-Video architecture at toy size, random weights (the caller's global RNG is left
    untouched)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    tok = tiny_t5_tokenizer(128)
    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed + 2)
        text_encoder = T5EncoderModel(T5Config(
            vocab_size=len(tok), d_model=_TEXT_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, is_encoder_decoder=False)).eval()
        torch.random.manual_seed(seed + 3)
        transformer = LTXVideoTransformer3DModel(
            in_channels=_LATENT_CHANNELS, out_channels=_LATENT_CHANNELS, patch_size=1, patch_size_t=1,
            num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, num_layers=2,
            caption_channels=_TEXT_DIM)
    # Lightricks/LTX-Video's scheduler_config.json (its inference-only shift_terminal stretch left out)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                                base_image_seq_len=1024, max_image_seq_len=4096, base_shift=0.95,
                                                max_shift=2.05)
    return LTXPipeline(tokenizer=tok, text_encoder=text_encoder, vae=tiny_ltx_vae(seed + 1), scheduler=scheduler,
                       transformer=transformer)


def save_tiny_ltx(path: str | Path, seed: int = 0) -> str:
    """Build :func:`tiny_ltx_pipeline` and ``save_pretrained`` it to ``path``; returns the path as a string."""
    tiny_ltx_pipeline(seed).save_pretrained(Path(path))
    return str(path)
