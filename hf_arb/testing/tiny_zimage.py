"""A tiny, randomly initialised Z-Image pipeline built offline (no Hub), with its tokenizer and chat template.

The same architecture as ``Tongyi-MAI/Z-Image`` at toy size: a Qwen3 text encoder (``Qwen3Model``, the
second-to-last hidden states are the prompt embeddings), Flux's 16-channel ``AutoencoderKL`` (factor 8, its
``scaling_factor`` / ``shift_factor``), ``ZImageTransformer2DModel`` (patch 2) and Z-Image's static-shift scheduler
(``shift`` 3.0). Saved with ``save_pretrained``, it loads with the stock ``ZImagePipeline``; bucket sides are
legal at multiples of 16 pixels.

The tokenizer is :func:`hf_arb.testing.tiny_qwen.tiny_qwen2_tokenizer` with a minimal Qwen3 chat template (the
``<|im_start|>user … <|im_end|>`` turn and the assistant prefix; ``enable_thinking=False`` adds the empty think
block), which ``ZImagePipeline`` applies to every prompt.

Example:
    ```py
    >>> from hf_arb.testing.tiny_zimage import save_tiny_zimage
    >>> path = save_tiny_zimage("/tmp/tiny-zimage")
    >>> from diffusers import ZImagePipeline
    >>> image = ZImagePipeline.from_pretrained(path)("a cat", height=48, width=80, num_inference_steps=1).images[0]
    >>> image.size
    (80, 48)
    ```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .tiny_qwen import tiny_qwen2_tokenizer

__all__ = ["QWEN3_CHAT_TEMPLATE", "save_tiny_zimage", "tiny_zimage_pipeline", "tiny_zimage_tokenizer"]

#: a minimal Qwen3 chat template: what ZImagePipeline's ``apply_chat_template(..., enable_thinking=True)`` needs
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
_HIDDEN = 16  # the text encoder's width = the transformer's cap_feat_dim


def tiny_zimage_tokenizer() -> Any:
    """A working ``Qwen2Tokenizer`` (byte-level BPE, no download) carrying :data:`QWEN3_CHAT_TEMPLATE`."""
    tok = tiny_qwen2_tokenizer(template="<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
                               extra_words=" a the photo of cat dog red fox snow")
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


def tiny_zimage_pipeline(seed: int = 0) -> Any:
    """A ``ZImagePipeline`` with the Z-Image architecture at toy size and Z-Image's scheduler values."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tok = tiny_zimage_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed + 2)
        text_encoder = Qwen3Model(Qwen3Config(
            hidden_size=_HIDDEN, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=8, vocab_size=len(tok), max_position_embeddings=512)).eval()
        torch.random.manual_seed(seed + 1)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
            latent_channels=16, norm_num_groups=4, sample_size=64, use_quant_conv=False, use_post_quant_conv=False,
            scaling_factor=0.3611, shift_factor=0.1159).eval()
        torch.random.manual_seed(seed + 3)
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=_HIDDEN, rope_theta=256.0,
            t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                          transformer=transformer)


def save_tiny_zimage(path: str | Path, seed: int = 0) -> str:
    """Build :func:`tiny_zimage_pipeline` and ``save_pretrained`` it to ``path``; returns the path as a string."""
    tiny_zimage_pipeline(seed).save_pretrained(Path(path))
    return str(path)
