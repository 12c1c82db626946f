"""Stable Diffusion 1.x / 2.x (``StableDiffusionPipeline``): one CLIP text encoder, a UNet without added
conditioning. With ``--resolution_conditioning`` (full fine-tunes) the UNet learns SDXL-style size/crop
conditioning through a zero-initialised class embedding (:mod:`hf_arb.families.conditioning`), and the output
folder carries its pipeline code, so stock diffusers loads it with ``custom_pipeline``.

The fallback family: a checkpoint no other family recognises trains as SD.
"""

from __future__ import annotations

import argparse
from typing import Any

from .base import Models, builtin_family
from .unet import UNetFamily


@builtin_family
class SDFamily(UNetFamily):
    """SD 1.x / 2.x, as diffusers' ``train_text_to_image.py`` and ``train_text_to_image_lora.py`` train it."""

    name = "sd"
    pipeline_class_name = "StableDiffusionPipeline"
    full_defaults = (512, 5, 1)  # train_text_to_image.py generates one image per validation prompt
    lora_defaults = (512, 1, 4)
    output_dirs = ("sd-model-finetuned", "sd-model-finetuned-lora")
    card_tags = ("stable-diffusion",)

    @classmethod
    def detect(cls, path: str) -> bool:
        return True  # the fallback: asked last

    def load_text_encoders(self, path: str, revision: str | None, variant: str | None) -> tuple[list[Any], list[Any]]:
        from transformers import AutoTokenizer, CLIPTextModel

        return ([AutoTokenizer.from_pretrained(path, subfolder="tokenizer", revision=revision, use_fast=False)],
                [CLIPTextModel.from_pretrained(path, subfolder="text_encoder", revision=revision, variant=variant)])

    def adapt_unet(self, args: argparse.Namespace, unet: Any) -> Any:
        if not args.resolution_conditioning:
            return unet
        from .conditioning import add_resolution_conditioning

        return add_resolution_conditioning(unet, embed_dim=args.resolution_embed_dim)

    def prepare_denoiser(self, args: argparse.Namespace, models: Models, denoiser: Any) -> None:
        if args.resolution_conditioning:
            from .conditioning import resolution_embed_dim

            models.extra["resolution_dim"] = resolution_embed_dim(denoiser)

    def encode_text(self, models: Models, encoders: list[Any], captions: list[str], device: Any) -> tuple[Any, Any]:
        """CLIP's last hidden states ``(B, 77, D)``; no pooled embedding."""
        tok, te = models.tokenizers[0], encoders[0]
        ids = tok(captions, max_length=tok.model_max_length, padding="max_length", truncation=True,
                  return_tensors="pt").input_ids.to(device)
        return te(ids)[0], None

    def forward(self, models: Models, unet: Any, noisy: Any, timesteps: Any, hidden: Any, pooled: Any,
                time_ids: Any) -> Any:
        dim = models.extra.get("resolution_dim")
        if dim is None:
            return unet(noisy, timesteps, hidden).sample
        from .conditioning import resolution_class_labels

        return unet(noisy, timesteps, hidden,
                    class_labels=resolution_class_labels(time_ids, dim).to(hidden.dtype)).sample

    def validation_parts(self, models: Models) -> dict[str, Any]:
        return {**super().validation_parts(models), "safety_checker": None, "feature_extractor": None,
                "requires_safety_checker": False}

    def pipeline_class(self, args: argparse.Namespace | None = None) -> Any:
        if args is not None and args.resolution_conditioning:
            from .conditioning import StableDiffusionResolutionPipeline

            return StableDiffusionResolutionPipeline
        return super().pipeline_class(args)

    def save_pipeline(self, args: argparse.Namespace, pipe: Any, output_dir: str) -> None:
        super().save_pipeline(args, pipe, output_dir)
        if args.resolution_conditioning:  # loadable without hf_arb: the pipeline code goes along
            from .conditioning import save_custom_pipeline

            save_custom_pipeline(output_dir)

    def card_lines(self, args: argparse.Namespace) -> list[str]:
        if not args.resolution_conditioning or getattr(args, "lora", False):
            return []
        return ["The UNet takes SDXL-style size/crop conditioning. The folder carries its pipeline "
                "(`pipeline.py`), which plain diffusers loads with `custom_pipeline` and `trust_remote_code`.", ""]

    def usage(self, args: argparse.Namespace, repo_id: str) -> tuple[str, list[str]]:
        if args.resolution_conditioning and not getattr(args, "lora", False):  # the folder's own pipeline.py
            return "DiffusionPipeline", [f'pipe = DiffusionPipeline.from_pretrained("{repo_id}", '
                                         f'custom_pipeline="{repo_id}", trust_remote_code=True)']
        return super().usage(args, repo_id)
