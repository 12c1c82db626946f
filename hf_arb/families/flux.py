"""Flux.1: loading, prompt encoding, 2×2 latent packing and the transformer call, for :mod:`hf_arb.families.flow`.

``FluxTransformer2DModel`` takes latents as a sequence of 2×2 patches: ``(B, C, h, w)`` becomes
``(B, (h/2)(w/2), 4C)`` with each token's ``(0, row, column)`` position id for the rotary embedding; text tokens
get zero ids. The prompt is encoded as ``FluxPipeline`` does: CLIP's pooled output and T5's last hidden states.
Guidance-distilled checkpoints (Flux.1-dev: ``guidance_embeds``) take the guidance scale as an input.

Example:
    ```py
    >>> from hf_arb.families.flux import pack_latents, unpack_latents
    >>> x = torch.randn(2, 16, 6, 10)
    >>> packed = pack_latents(x)            # (2, 15, 64)
    >>> torch.equal(unpack_latents(packed, 6, 10), x)
    True
    ```
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_arb.lazy import LazyModule

from .base import builtin_family
from .flow_family import FlowFamily, FlowOptions, FlowParts
from .flux2 import FLUX2_HUB_NAME

torch: Any = LazyModule("torch")  # family detection must not import torch

__all__ = [
    "FLUX_LORA_TARGET_MODULES",
    "FluxFamily",
    "encode_flux_prompts",
    "latent_image_ids",
    "pack_latents",
    "unpack_latents",
]

#: The layers diffusers' ``train_dreambooth_lora_flux.py`` adapts by default: attention of both streams and the
#: feed-forward layers.
FLUX_LORA_TARGET_MODULES: tuple[str, ...] = (
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, h, w)`` → ``(B, (h/2)(w/2), 4C)``: row-major 2×2 patches, channels then patch rows then columns."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"Flux packs 2x2 latent patches; latent size {h}x{w} is not even (bucket sides must be "
                         "multiples of 16 pixels).")
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of :func:`pack_latents` for latents of ``height`` × ``width``."""
    b, _, d = packed.shape
    x = packed.reshape(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def latent_image_ids(height: int, width: int, device: torch.device | str = "cpu",
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """Position ids ``(0, row, column)`` of the packed tokens of ``height`` × ``width`` latents: ``((h/2)(w/2), 3)``."""
    rows = torch.arange(height // 2, device=device).repeat_interleave(width // 2)
    cols = torch.arange(width // 2, device=device).repeat(height // 2)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1).to(torch.float32 if dtype is None else dtype)


def encode_flux_prompts(tokenizers: list[Any], text_encoders: list[Any], captions: list[str], device: torch.device,
                        max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flux prompt embeddings: T5 hidden states ``(B, max_sequence_length, D)`` and CLIP pooled ``(B, P)``."""
    clip_tok, t5_tok = tokenizers
    clip, t5 = text_encoders
    ids = clip_tok(captions, padding="max_length", max_length=clip_tok.model_max_length, truncation=True,
                   return_tensors="pt").input_ids.to(device)
    pooled = clip(ids, output_hidden_states=False).pooler_output
    ids = t5_tok(captions, padding="max_length", max_length=max_sequence_length, truncation=True,
                 return_tensors="pt").input_ids.to(device)
    return t5(ids, output_hidden_states=False)[0], pooled


@builtin_family
class FluxFamily(FlowFamily):
    """Flux.1 (``FluxPipeline``, ``FluxTransformer2DModel``). Defaults follow diffusers'
    ``train_dreambooth_lora_flux.py``: no loss weighting, velocity target, 512 T5 tokens, guidance 3.5."""

    name = "flux"
    #: Flux.1's pipelines and transformer, never a Flux.2 class ("Flux2Pipeline" also starts with "Flux")
    class_prefixes = ("FluxPipeline", "FluxTransformer2DModel", "FluxImg2Img", "FluxInpaint", "FluxControl",
                      "FluxFill", "FluxKontext", "FluxPrior")
    hub_name_hints = ("flux",)
    card_tags = ("flux", "flux-diffusers")
    pipeline_class_name = "FluxPipeline"
    transformer_class_name = "FluxTransformer2DModel"
    lora_target_modules = FLUX_LORA_TARGET_MODULES
    lora_text_encoder_count = 1  # CLIP; T5 stays frozen (train_dreambooth_lora_flux.py)
    default_weighting_scheme = "none"
    default_precondition_outputs = False
    default_max_sequence_length = 512

    @classmethod
    def detect(cls, path: str) -> bool:
        """A Flux.1 folder (:attr:`class_prefixes`) or a Hub name with "flux" but not a Flux.2 one ("FLUX.2-dev")."""
        if not Path(path).is_dir() and FLUX2_HUB_NAME.search(Path(path).name.lower()):
            return False
        return super().detect(path)

    def load(self, path: str, revision: str | None = None, variant: str | None = None,
             transformer_kw: Mapping[str, Any] | None = None) -> FlowParts:
        """Scheduler, CLIP + T5 tokenizers and encoders, VAE and transformer."""
        from diffusers import (
            AutoencoderKL,
            FlowMatchEulerDiscreteScheduler,
            FluxTransformer2DModel,
        )
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        kw = {"revision": revision}
        return FlowParts(
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kw),
            tokenizers=[AutoTokenizer.from_pretrained(path, subfolder="tokenizer", **kw),
                        AutoTokenizer.from_pretrained(path, subfolder="tokenizer_2", **kw)],
            text_encoders=[CLIPTextModel.from_pretrained(path, subfolder="text_encoder", variant=variant, **kw),
                           T5EncoderModel.from_pretrained(path, subfolder="text_encoder_2", variant=variant, **kw)],
            vae=AutoencoderKL.from_pretrained(path, subfolder="vae", variant=variant, **kw),
            transformer=FluxTransformer2DModel.from_pretrained(path, subfolder="transformer", variant=variant, **kw,
                                                               **(transformer_kw or {})),
        )

    def token_patch(self, transformer: Any) -> int:
        """2: the pipeline packs 2×2 latent patches into one token."""
        return 2

    def encode_prompts(self, tokenizers: list[Any], text_encoders: list[Any], captions: list[str],
                       device: torch.device, max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`encode_flux_prompts`."""
        return encode_flux_prompts(tokenizers, text_encoders, captions, device, max_sequence_length)

    def predict(self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, prompt_embeds: torch.Tensor,
                pooled: torch.Tensor, options: FlowOptions) -> torch.Tensor:
        """Pack, call the transformer (timestep ``sigma``, guidance where the model takes it), unpack."""
        b, _, h, w = noisy.shape
        device = noisy.device
        guidance = self.guidance(options, b, device)
        timesteps = sigmas.to(device, torch.float32) * options.num_train_timesteps
        out = transformer(hidden_states=pack_latents(noisy), timestep=timesteps / options.num_train_timesteps,
                          guidance=guidance, pooled_projections=pooled, encoder_hidden_states=prompt_embeds,
                          txt_ids=torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=prompt_embeds.dtype),
                          img_ids=latent_image_ids(h, w, device, prompt_embeds.dtype), return_dict=False)[0]
        return unpack_latents(out, h, w)
