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

__all__ = ["QWEN_EDIT_TEMPLATE", "QWEN_TEMPLATE", "VISION_TOKENS", "save_tiny_qwenimage", "save_tiny_qwenimage_edit",
           "tiny_qwen2_5_vl", "tiny_qwen2_tokenizer", "tiny_qwen_vae", "load_qwen2_vl_processor",
           "tiny_qwenimage_edit_pipeline", "tiny_qwenimage_pipeline"]

#: ``QwenImagePipeline.prompt_template_encode`` (the tokenizer is trained on its words)
QWEN_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                 "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                 "<|im_end|>\n<|im_start|>assistant\n")
#: Qwen2-VL's vision placeholders, in the order of their ids (image, video, start, end)
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
_HIDDEN = 16  # the text encoder's width = the transformer's joint_attention_dim
_LATENT_CHANNELS = 16


def tiny_qwen2_tokenizer(template: str = QWEN_TEMPLATE, extra_words: str = "", vision: bool = False) -> Any:
    """A working ``Qwen2Tokenizer``: byte-level BPE trained on ``template``'s words (+ ``extra_words``), no download.

    ``<|endoftext|>`` (padding, end and unknown), ``<|im_start|>`` and ``<|im_end|>`` are special tokens; with
    ``vision``, so are Qwen2-VL's :data:`VISION_TOKENS` (the image placeholders the processor expands).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bytes_only = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = bytes_only.backend_tokenizer.pre_tokenizer  # Qwen2's split + byte-level mapping
    text = template.replace("<|im_start|>", "\n").replace("<|im_end|>", "\n").format("") + extra_words
    for special in VISION_TOKENS:
        text = text.replace(special, "")
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=2000, initial_alphabet=alphabet,
                                                        show_progress=False))
    model = json.loads(bpe.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>",
                                                          *(VISION_TOKENS if vision else ())]})
    return tok


def tiny_qwen2_5_vl(vocab_size: int, seed: int = 0, hidden: int = _HIDDEN, tokenizer: Any = None) -> Any:
    """A 2-layer ``Qwen2_5_VLForConditionalGeneration`` (text width ``hidden``) with random weights and a 1-block
    vision tower (14-pixel patches, 2×2 merge).

    Its vision token ids are ``tokenizer``'s :data:`VISION_TOKENS` (a ``vision`` tokenizer), else the three ids past
    ``vocab_size`` (never produced by the tokenizer).
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    image, video, start, end = ([tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS] if tokenizer is not None
                                else [vocab_size, vocab_size + 1, vocab_size + 2, vocab_size + 2])

    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": hidden, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "vocab_size": vocab_size + 3,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                     "rope_theta": 1000000.0},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": hidden},
        hidden_size=hidden, vocab_size=vocab_size + 3, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end,
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


#: ``QwenImageEditPipeline.prompt_template_encode`` (the edit tokenizer is trained on its words)
QWEN_EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                      "objects, background), then explain how the user's text instruction should alter or modify the "
                      "image. Generate a new image that meets the user's requirements while maintaining consistency "
                      "with the original input where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
                      "<|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")


def load_qwen2_vl_processor(path: str | Path) -> Any:
    """:func:`~hf_arb.families.qwenimage_edit.qwen2_vl_processor` of a saved edit pipeline's ``processor`` folder
    (tokenizer + image processor)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    from hf_arb.families.qwenimage_edit import qwen2_vl_processor

    folder = Path(path) / "processor"
    return qwen2_vl_processor(AutoTokenizer.from_pretrained(folder), Qwen2VLImageProcessorPil.from_pretrained(folder))


def tiny_qwenimage_edit_pipeline(seed: int = 0, max_pixels: int = 112 * 112, plus: bool = False) -> Any:
    """A ``QwenImageEditPipeline``: :func:`tiny_qwenimage_pipeline`'s parts, the text encoder's vision tower wired to
    an edit tokenizer (its template's system prefix is the 64 tokens the pipeline drops), and a processor whose
    ``Qwen2VLImageProcessorPil`` (PIL only: no torchvision) resizes images to at most ``max_pixels`` pixels (112²:
    at most 16 merged vision tokens per image). ``plus``: a ``QwenImageEditPlusPipeline`` (several input images)."""
    import diffusers
    from transformers import Qwen2VLImageProcessorPil

    base = tiny_qwenimage_pipeline(seed)
    tok = tiny_qwen2_tokenizer(QWEN_EDIT_TEMPLATE, vision=True)
    from hf_arb.families.qwenimage_edit import qwen2_vl_processor

    processor = qwen2_vl_processor(tok, Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels))
    cls = diffusers.QwenImageEditPlusPipeline if plus else diffusers.QwenImageEditPipeline
    return cls(scheduler=base.scheduler, vae=base.vae, tokenizer=tok, processor=processor,
               text_encoder=tiny_qwen2_5_vl(len(tok), seed + 2, tokenizer=tok), transformer=base.transformer)


def save_tiny_qwenimage_edit(path: str | Path, seed: int = 0, plus: bool = False) -> str:
    """Build :func:`tiny_qwenimage_edit_pipeline` and save it as ``save_pretrained`` would; returns the path.

    The processor folder (tokenizer + ``preprocessor_config.json``) and its ``model_index.json`` entry are written
    directly where transformers cannot save a ``Qwen2VLProcessor`` (no torchvision:
    :func:`~hf_arb.families.qwenimage_edit.save_edit_pipeline`).
    In this environment load it with ``QwenImageEditPipeline.from_pretrained(path,
    processor=load_qwen2_vl_processor(path))``.
    """
    from hf_arb.families.qwenimage_edit import save_edit_pipeline

    save_edit_pipeline(tiny_qwenimage_edit_pipeline(seed, plus=plus), path)
    return str(path)


def save_tiny_qwenimage(path: str | Path, seed: int = 0) -> str:
    """Build :func:`tiny_qwenimage_pipeline` and ``save_pretrained`` it to ``path``; returns the path as a string."""
    tiny_qwenimage_pipeline(seed).save_pretrained(Path(path))
    return str(path)
