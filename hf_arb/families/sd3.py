"""Stable Diffusion 3 / 3.5: loading, prompt encoding and the transformer call, for :mod:`hf_arb.families.flow`.

The prompt encoding is the one ``StableDiffusion3Pipeline`` uses, written with public transformers APIs: both CLIP
encoders' penultimate hidden states are concatenated along the feature axis and zero-padded to T5's width, then
concatenated with T5's last hidden states along the sequence axis; the pooled embedding concatenates both CLIP
``text_embeds``. A checkpoint without T5 (``text_encoder_3`` absent) gets zeros in its place, as the pipeline.

Example:
    ```py
    >>> from hf_arb.families.sd3 import SD3Family
    >>> family = SD3Family()
    >>> parts = family.load("stabilityai/stable-diffusion-3.5-medium")
    >>> embeds, pooled = family.encode_prompts(parts.tokenizers, parts.text_encoders, ["a cat"], "cpu", 77)
    ```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_arb.lazy import LazyModule

from .base import builtin_family
from .flow_family import FlowFamily, FlowOptions, FlowParts

torch: Any = LazyModule("torch")  # family detection must not import torch

__all__ = ["SD3_LORA_TARGET_MODULES", "SD3Family", "encode_sd3_prompts"]

#: The attention projections diffusers' ``train_dreambooth_lora_sd3.py`` adapts by default (image and text streams).
SD3_LORA_TARGET_MODULES: tuple[str, ...] = (
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
)


def _ids(tokenizer: Any, captions: list[str], max_length: int, device: torch.device) -> torch.Tensor:
    return tokenizer(captions, padding="max_length", max_length=max_length, truncation=True,
                     add_special_tokens=True, return_tensors="pt").input_ids.to(device)


def encode_sd3_prompts(tokenizers: list[Any], text_encoders: list[Any], captions: list[str], device: torch.device,
                       max_sequence_length: int, joint_attention_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SD3 prompt embeddings ``(B, 77 + max_sequence_length, joint_attention_dim)`` and pooled ``(B, P1 + P2)``.

    Args:
        tokenizers, text_encoders: ``[CLIP-L, CLIP-G, T5]`` (T5 may be ``None``).
        joint_attention_dim: the transformer's text width (the zeros standing in for a missing T5).
    """
    hidden, pooled = [], []
    for tok, te in zip(tokenizers[:2], text_encoders[:2]):
        out = te(_ids(tok, captions, tok.model_max_length, device), output_hidden_states=True)
        pooled.append(out.text_embeds)
        hidden.append(out.hidden_states[-2])
    clip = torch.cat(hidden, dim=-1)
    t5_tok = tokenizers[2] if len(tokenizers) > 2 else None
    t5 = text_encoders[2] if len(text_encoders) > 2 else None
    if t5 is None or t5_tok is None:
        t5_embeds = torch.zeros(len(captions), tokenizers[0].model_max_length, joint_attention_dim, device=device,
                                dtype=clip.dtype)
    else:
        t5_embeds = t5(_ids(t5_tok, captions, max_sequence_length, device))[0]
    clip = torch.nn.functional.pad(clip, (0, t5_embeds.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5_embeds.to(clip.dtype)], dim=-2), torch.cat(pooled, dim=-1)


@builtin_family
class SD3Family(FlowFamily):
    """Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``, ``SD3Transformer2DModel``).

    Defaults follow diffusers' ``train_dreambooth_lora_sd3.py``: ``logit_normal`` weighting, preconditioned
    outputs, 77 T5 tokens.
    """

    name = "sd3"
    class_prefixes = ("StableDiffusion3", "SD3Transformer2DModel")
    hub_name_hints = ("stable-diffusion-3", "sd3")
    card_tags = ("sd3", "sd3-diffusers")
    pipeline_class_name = "StableDiffusion3Pipeline"
    transformer_class_name = "SD3Transformer2DModel"
    lora_target_modules = SD3_LORA_TARGET_MODULES
    lora_text_encoder_count = 2  # CLIP-L and CLIP-G; T5 stays frozen (train_dreambooth_lora_sd3.py)
    default_weighting_scheme = "logit_normal"
    default_precondition_outputs = True
    default_max_sequence_length = 77

    def load(self, path: str, revision: str | None = None, variant: str | None = None,
             transformer_kw: Mapping[str, Any] | None = None) -> FlowParts:
        """Scheduler, CLIP-L/CLIP-G/T5 tokenizers and encoders, VAE and transformer (T5 ``None`` if absent)."""
        from diffusers import (
            AutoencoderKL,
            FlowMatchEulerDiscreteScheduler,
            SD3Transformer2DModel,
        )
        from transformers import (
            AutoTokenizer,
            CLIPTextModelWithProjection,
            T5EncoderModel,
        )

        kw = {"revision": revision}
        tokenizers = [AutoTokenizer.from_pretrained(path, subfolder=f"tokenizer{s}", **kw) for s in ("", "_2")]
        encoders = [CLIPTextModelWithProjection.from_pretrained(path, subfolder=f"text_encoder{s}", variant=variant,
                                                                **kw) for s in ("", "_2")]
        try:
            tokenizers.append(AutoTokenizer.from_pretrained(path, subfolder="tokenizer_3", **kw))
            encoders.append(T5EncoderModel.from_pretrained(path, subfolder="text_encoder_3", variant=variant, **kw))
        except (OSError, ValueError):  # SD3 saved without T5: the pipeline feeds zeros instead
            tokenizers, encoders = tokenizers[:2], encoders[:2]
        return FlowParts(
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kw),
            tokenizers=tokenizers, text_encoders=encoders,
            vae=AutoencoderKL.from_pretrained(path, subfolder="vae", variant=variant, **kw),
            transformer=SD3Transformer2DModel.from_pretrained(path, subfolder="transformer", variant=variant, **kw,
                                                              **(transformer_kw or {})),
        )

    def token_patch(self, transformer: Any) -> int:
        """The transformer's ``patch_size`` (2 for every released SD3 / SD3.5)."""
        return int(transformer.config.patch_size)

    def encode_prompts(self, tokenizers: list[Any], text_encoders: list[Any], captions: list[str],
                       device: torch.device, max_sequence_length: int,
                       joint_attention_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`encode_sd3_prompts` (``joint_attention_dim`` defaults to T5's width, or 4096)."""
        if joint_attention_dim is None:
            t5 = text_encoders[2] if len(text_encoders) > 2 else None
            joint_attention_dim = int(t5.config.d_model) if t5 is not None else 4096
        return encode_sd3_prompts(tokenizers, text_encoders, captions, device, max_sequence_length,
                                  joint_attention_dim)

    def predict(self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, prompt_embeds: torch.Tensor,
                pooled: torch.Tensor, options: FlowOptions) -> torch.Tensor:
        """``transformer(latents, timestep = sigma * N, prompt_embeds, pooled)``, as the pipeline calls it."""
        timesteps = sigmas.to(noisy.device, torch.float32) * options.num_train_timesteps
        return transformer(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=prompt_embeds,
                           pooled_projections=pooled, return_dict=False)[0]
