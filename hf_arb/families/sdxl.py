"""Stable Diffusion XL (``StableDiffusionXLPipeline``): two CLIP text encoders (penultimate hidden states
concatenated, the second's pooled embedding) and micro-conditioning time ids ``(original h, original w, crop top,
crop left, bucket h, bucket w)`` per sample, from each row's own fit
(:func:`hf_arb.families.conditioning.sdxl_time_ids`). Detected by ``addition_embed_type == "text_time"`` in
``unet/config.json`` (a Hub id by ``xl`` in its name).
"""

from __future__ import annotations

import argparse
from typing import Any

from hf_arb.checks import UsageError

from .base import Models, builtin_family
from .unet import UNetFamily


@builtin_family
class SDXLFamily(UNetFamily):
    """SDXL, as diffusers' ``train_text_to_image_sdxl.py`` and ``train_text_to_image_lora_sdxl.py`` train it."""

    name = "sdxl"
    pipeline_class_name = "StableDiffusionXLPipeline"
    text_time = True
    hub_name_hints = ("xl",)
    full_defaults = (1024, 1, 4)
    lora_defaults = (1024, 1, 4)
    output_dirs = ("sdxl-model-finetuned", "sd-model-finetuned-lora")  # upstream's LoRA script keeps SD's name
    card_tags = ("stable-diffusion-xl",)

    def check_flags(self, args: argparse.Namespace) -> None:
        if args.resolution_conditioning:
            raise UsageError("--resolution_conditioning is for SD 1.x / 2.x: SDXL UNets already take size/crop time "
                             "ids. Drop the flag.")

    def load_text_encoders(self, path: str, revision: str | None, variant: str | None) -> tuple[list[Any], list[Any]]:
        from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

        tokenizers = [AutoTokenizer.from_pretrained(path, subfolder=f"tokenizer{s}", revision=revision, use_fast=False)
                      for s in ("", "_2")]
        encoders = [CLIPTextModel.from_pretrained(path, subfolder="text_encoder", revision=revision, variant=variant),
                    CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder_2", revision=revision,
                                                                variant=variant)]
        return tokenizers, encoders

    def vae_dtype(self, args: argparse.Namespace, weight_dtype: Any) -> Any:
        """SDXL's own VAE overflows in fp16: float32, unless a replacement VAE (e.g. the fp16 fix) was given."""
        if args.pretrained_vae_model_name_or_path:
            return weight_dtype
        import torch

        return torch.float32

    def encode_text(self, models: Models, encoders: list[Any], captions: list[str], device: Any) -> tuple[Any, Any]:
        """Both encoders' penultimate hidden states, concatenated ``(B, 77, 768 + 1280)``; the second's pooled."""
        import torch

        hidden, pooled = [], None
        for tok, te in zip(models.tokenizers, encoders):
            ids = tok(captions, max_length=tok.model_max_length, padding="max_length", truncation=True,
                      return_tensors="pt").input_ids.to(device)
            out = te(ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            pooled = getattr(out, "text_embeds", None)
        return torch.cat(hidden, dim=-1), pooled

    def forward(self, models: Models, unet: Any, noisy: Any, timesteps: Any, hidden: Any, pooled: Any,
                time_ids: Any) -> Any:
        cond = {"text_embeds": pooled, "time_ids": time_ids.to(hidden.dtype)}
        return unet(noisy, timesteps, hidden, added_cond_kwargs=cond).sample

    def validation_parts(self, models: Models) -> dict[str, Any]:
        return {**super().validation_parts(models), "text_encoder_2": models.text_encoders[1],
                "tokenizer_2": models.tokenizers[1]}
