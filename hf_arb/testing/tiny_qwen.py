"""A tiny, randomly initialised Qwen-Image pipeline built offline (no Hub), and its tokenizer.

The same architecture as ``Qwen/Qwen-Image`` at toy size: a Qwen2.5-VL text encoder, the video VAE
``AutoencoderKLQwenImage`` (spatial factor 8, 16 latent channels, one frame axis), ``QwenImageTransformer2DModel``
on 2×2-packed latents, and Qwen-Image's scheduler (dynamic shift, ``max_image_seq_len`` 8192). Saved with
``save_pretrained``, it loads with the stock ``QwenImagePipeline``. Bucket sides are legal at multiples of 16
pixels (VAE factor 8 × packing 2), like the real model.

The tokenizer is a byte-level BPE trained (with the ``tokenizers`` library) on the words of the pipeline's prompt
template, wrapped in transformers' ``Qwen2Tokenizer``: the template's system prefix is exactly the 34 tokens the
pipeline drops (``prompt_template_encode_start_idx``), as with the real tokenizer; a caption falls back to bytes.

Example:
    ```py
    >>> from hf_arb.testing.tiny_qwen import save_tiny_qwenimage
    >>> path = save_tiny_qwenimage("/tmp/tiny-qwen")
    >>> from diffusers import QwenImagePipeline
    >>> image = QwenImagePipeline.from_pretrained(path)("a cat", height=48, width=80, num_inference_steps=1).images[0]
    >>> image.size
    (80, 48)
    ```
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["QWEN_TEMPLATE", "save_tiny_qwenimage", "tiny_qwen2_tokenizer", "tiny_qwen2_5_vl", "tiny_qwenimage_pipeline"]

#: ``QwenImagePipeline.prompt_template_encode`` (the tokenizer is trained on its words)
QWEN_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                 "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                 "<|im_end|>\n<|im_start|>assistant\n")
_HIDDEN = 16  # the text encoder's width = the transformer's joint_attention_dim
_LATENT_CHANNELS = 16


def tiny_qwen2_tokenizer(template: str = QWEN_TEMPLATE, extra_words: str = "") -> Any:
    """A working ``Qwen2Tokenizer``: byte-level BPE trained on ``template``'s words (+ ``extra_words``), no download.

    ``<|endoftext|>`` (padding, end and unknown), ``<|im_start|>`` and ``<|im_end|>`` are special tokens.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bytes_only = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = bytes_only.backend_tokenizer.pre_tokenizer  # Qwen2's split + byte-level mapping
    text = template.replace("<|im_start|>", "\n").replace("<|im_end|>", "\n").format("") + extra_words
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=2000, initial_alphabet=alphabet,
                                                        show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def tiny_qwen2_5_vl(vocab_size: int, seed: int = 0, hidden: int = _HIDDEN) -> Any:
    """A 2-layer ``Qwen2_5_VLForConditionalGeneration`` (text width ``hidden``) with random weights.

    Its vision token ids are the three ids past ``vocab_size`` (never produced by the tokenizer).
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": hidden, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "vocab_size": vocab_size + 3,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     "rope_theta": 1000000.0},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": hidden},
        hidden_size=hidden, vocab_size=vocab_size + 3, image_token_id=vocab_size, video_token_id=vocab_size + 1,
        vision_start_token_id=vocab_size + 2, vision_end_token_id=vocab_size + 2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed)
        return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_qwen_vae(seed: int = 0) -> Any:
    """``AutoencoderKLQwenImage`` at toy width: spatial factor 8 (three downsamples), 16 latent channels."""
    from diffusers import AutoencoderKLQwenImage

    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed)
        return AutoencoderKLQwenImage(
            base_dim=8, z_dim=_LATENT_CHANNELS, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[round(0.05 * (i - 8), 3) for i in range(_LATENT_CHANNELS)],
            latents_std=[round(1.0 + 0.1 * i, 3) for i in range(_LATENT_CHANNELS)],
        ).eval()


def tiny_qwenimage_pipeline(seed: int = 0) -> Any:
    """A ``QwenImagePipeline`` with the Qwen-Image architecture at toy size and Qwen-Image's scheduler values."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    tok = tiny_qwen2_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.random.manual_seed(seed + 3)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * _LATENT_CHANNELS, out_channels=_LATENT_CHANNELS, num_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=_HIDDEN, guidance_embeds=False,
            axes_dims_rope=(8, 4, 4),
        )
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image's scheduler_config.json
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, num_train_timesteps=1000,
        shift=1.0, shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True)
    return QwenImagePipeline(scheduler=scheduler, vae=tiny_qwen_vae(seed + 1),
                             text_encoder=tiny_qwen2_5_vl(len(tok), seed + 2), tokenizer=tok,
                             transformer=transformer)


def save_tiny_qwenimage(path: str | Path, seed: int = 0) -> str:
    """Build :func:`tiny_qwenimage_pipeline` and ``save_pretrained`` it to ``path``; returns the path as a string."""
    tiny_qwenimage_pipeline(seed).save_pretrained(Path(path))
    return str(path)
