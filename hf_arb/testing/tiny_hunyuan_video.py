"""A tiny, randomly initialised HunyuanVideo 1.5 text-to-video pipeline built offline (no Hub).

The same architecture as ``hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v`` at toy size, built from diffusers'
and transformers' own classes (the sizes of diffusers' ``tests/pipelines/hunyuan_video1_5`` where they fit):

- a Qwen2.5-VL text model (``Qwen2_5_VLTextModel``, 3 layers: the pipeline reads the third hidden state from the
  end) with a chat-template ``Qwen2Tokenizer`` whose system prefix is exactly the 108 tokens the pipeline crops
  (``prompt_template_encode_start_idx``), as with the real tokenizer (a byte-level BPE trained, with the
  ``tokenizers`` library, on the words of the pipeline's own system message: :func:`~hf_arb.testing.tiny_qwen.
  tiny_qwen2_tokenizer`);
- the ByT5 glyph encoder (``T5EncoderModel``, ``ByT5Tokenizer``: bytes, no vocabulary file);
- ``AutoencoderKLHunyuanVideo15`` with the real model's compression: spatial factor 16, temporal factor 4 (clips
  of ``4k+1`` frames), 4 latent channels, ``scaling_factor`` 1.03682;
- ``HunyuanVideo15Transformer3DModel`` (patch 1, text-to-video: ``in_channels = 2 × 4 + 1``, the latents, the zero
  condition latents and the zero mask), ``FlowMatchEulerDiscreteScheduler`` with a fixed ``shift`` (5.0 unless
  given) and the ``ClassifierFreeGuidance`` guider.

Saved with ``save_pretrained``, it loads with the stock ``HunyuanVideo15Pipeline``. Bucket sides are legal at
multiples of 16 pixels (VAE factor 16 × patch 1), like the real model.

Example:
    ```py
    >>> from hf_arb.testing.tiny_hunyuan_video import save_tiny_hunyuan_video
    >>> path = save_tiny_hunyuan_video("/tmp/tiny-hyv")
    >>> from diffusers import HunyuanVideo15Pipeline
    >>> video = HunyuanVideo15Pipeline.from_pretrained(path)("a cat", height=32, width=48, num_frames=5,
    ...                                                     num_inference_steps=2, output_type="np").frames[0]
    >>> video.shape
    (5, 32, 48, 3)
    ```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .tiny_qwen import tiny_qwen2_tokenizer

__all__ = ["QWEN_CHAT_TEMPLATE", "hunyuan_video_tokenizer", "save_tiny_hunyuan_video", "tiny_hunyuan_video_pipeline",
           "tiny_hunyuan_video_vae"]

#: Qwen2.5-VL's chat template for text messages (system, user, then the assistant's generation prompt)
QWEN_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_TEXT_DIM = 16  # the Qwen2.5-VL text width = the transformer's text_embed_dim
_GLYPH_DIM = 32  # ByT5's d_model = the transformer's text_embed_2_dim
_LATENT_CHANNELS = 4


def tiny_hunyuan_video_vae(seed: int = 0) -> Any:
    """``AutoencoderKLHunyuanVideo15`` at toy width with the real compression: four spatial downsamples (16), the
    last two also temporal (4), 4 latent channels."""
    from diffusers import AutoencoderKLHunyuanVideo15

    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed)
        return AutoencoderKLHunyuanVideo15(
            in_channels=3, out_channels=3, latent_channels=_LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8),
            layers_per_block=1, spatial_compression_ratio=16, temporal_compression_ratio=4,
            downsample_match_channel=False, upsample_match_channel=False).eval()


def hunyuan_video_tokenizer(vae: Any) -> Any:
    """A chat-template ``Qwen2Tokenizer`` trained on ``HunyuanVideo15Pipeline``'s system message: its prefix
    (``<|im_start|>system`` … ``<|im_start|>user``) tokenises to the 108 tokens the pipeline crops. ``vae``: the
    pipeline's VAE (its constructor reads the VAE's config; the message is the constructed pipeline's)."""
    from diffusers import HunyuanVideo15Pipeline

    bare = HunyuanVideo15Pipeline(text_encoder=None, tokenizer=None, transformer=None, vae=vae, scheduler=None,
                                  text_encoder_2=None, tokenizer_2=None, guider=None)
    template = ("<|im_start|>system\n" + bare.system_message + "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                "<|im_start|>assistant\n")
    tok = tiny_qwen2_tokenizer(template)
    tok.chat_template = QWEN_CHAT_TEMPLATE
    return tok


def tiny_hunyuan_video_pipeline(seed: int = 0, shift: float = 5.0) -> Any:
    """A ``HunyuanVideo15Pipeline`` (text to video) with the HunyuanVideo 1.5 architecture at toy size, random
    weights; ``shift``: the scheduler's fixed shift. The caller's global RNG is left untouched."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    vae = tiny_hunyuan_video_vae(seed + 1)
    tok = hunyuan_video_tokenizer(vae)
    glyph_tok = ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed + 2)
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            hidden_size=_TEXT_DIM, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=len(tok), bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            rope_theta=1000000.0)).eval()
        torch.random.manual_seed(seed + 3)
        glyph_encoder = T5EncoderModel(T5Config(
            vocab_size=len(glyph_tok), d_model=_GLYPH_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
        torch.random.manual_seed(seed + 4)
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=2 * _LATENT_CHANNELS + 1, out_channels=_LATENT_CHANNELS, num_attention_heads=2,
            attention_head_dim=8, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
            text_embed_dim=_TEXT_DIM, text_embed_2_dim=_GLYPH_DIM, image_embed_dim=12, rope_axes_dim=(2, 2, 4),
            target_size=32, task_type="t2v")
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    return HunyuanVideo15Pipeline(text_encoder=text_encoder, tokenizer=tok, transformer=transformer,
                                  vae=vae, scheduler=scheduler,
                                  text_encoder_2=glyph_encoder, tokenizer_2=glyph_tok,
                                  guider=ClassifierFreeGuidance(guidance_scale=6.0))


def save_tiny_hunyuan_video(path: str | Path, seed: int = 0, shift: float = 5.0) -> str:
    """Build :func:`tiny_hunyuan_video_pipeline` and ``save_pretrained`` it to ``path``; returns the path."""
    tiny_hunyuan_video_pipeline(seed, shift).save_pretrained(Path(path))
    return str(path)
