"""Z-Image: loading, prompt encoding and the transformer call, for :mod:`hf_arb.families.flow`, as one adapter.

``ZImagePipeline`` wraps each caption in the tokenizer's chat template (Qwen3's, ``enable_thinking=True``),
pads to ``max_sequence_length`` and takes the text encoder's second-to-last hidden states of the caption's tokens:
a list of variable-length embeddings. :func:`encode_zimage_prompts` keeps them padded ``(B, L, D)`` with the mask
``(B, L)`` in the ``pooled`` slot, so that ``--cache_text_embeddings`` memoises one entry per caption; the
transformer call hands each caption's own tokens to the transformer, as the pipeline does.

``ZImageTransformer2DModel`` takes lists: latents as ``(C, 1, h, w)`` per sample, the time as ``1 - sigma``
(``(1000 - t) / 1000`` in the pipeline), and it predicts ``x - noise``: the pipeline negates it into the velocity
``noise - x`` that the flow-matching loss trains (as diffusers' ``train_dreambooth_lora_z_image.py``). Latents are
Flux's VAE's (``shift_factor``, ``scaling_factor``), patched 2×2: bucket sides are multiples of 16 pixels, and
``mu`` is ``calculate_shift`` on ``(h/2)(w/2)`` tokens. Z-Image's scheduler shifts statically (``shift`` 3.0):
training uses that shift by default; ``--shift_by_resolution`` shifts each bucket by its ``mu`` and saves a
scheduler that does the same at inference.

Example:
    ```py
    >>> from hf_arb.families import get_family
    >>> family = get_family("zimage")
    >>> parts = family.load("Tongyi-MAI/Z-Image-Turbo")
    >>> embeds, mask = family.encode_prompts(parts.tokenizers, parts.text_encoders, ["a cat"], "cpu", 512)
    ```
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from hf_arb.checks import UsageError
from hf_arb.lazy import LazyModule

from .base import builtin_family
from .flow_family import FlowFamily, FlowOptions, FlowParts

torch: Any = LazyModule("torch")  # family detection must not import torch

__all__ = ["ZIMAGE_LORA_TARGET_MODULES", "ZImageFamily", "encode_zimage_prompts"]

#: diffusers' ``train_dreambooth_lora_z_image.py`` default LoRA targets (every attention's projections)
ZIMAGE_LORA_TARGET_MODULES: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")


def encode_zimage_prompts(tokenizer: Any, text_encoder: Any, captions: list[str], device: Any,
                          max_sequence_length: int) -> tuple[Any, Any]:
    """Z-Image prompt embeddings as ``ZImagePipeline.encode_prompt`` computes them, kept padded.

    Returns:
        ``embeds (B, max_sequence_length, D)`` (zeros off the caption) and ``mask (B, max_sequence_length)``
        int64; ``embeds[i][mask[i].bool()]`` is the pipeline's ``prompt_embeds[i]``.
    """
    txt = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True) for c in captions]
    tokens = tokenizer(txt, padding="max_length", max_length=max_sequence_length, truncation=True,
                       return_tensors="pt")
    mask = tokens.attention_mask.to(device).bool()
    hidden = text_encoder(input_ids=tokens.input_ids.to(device), attention_mask=mask,
                          output_hidden_states=True).hidden_states[-2]
    return torch.where(mask[..., None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device)), \
        mask.long()


@builtin_family
class ZImageFamily(FlowFamily):
    """Z-Image (``ZImagePipeline``, ``ZImageTransformer2DModel``, Qwen3 text encoder, Flux's VAE)."""

    name = "zimage"
    class_prefixes = ("ZImagePipeline", "ZImageTransformer2DModel")
    hub_name_hints = ("z-image",)
    hub_name_excludes = ("edit",)  # the edit models are families of their own
    card_tags = ("z-image", "z-image-diffusers")
    pipeline_class_name = "ZImagePipeline"
    transformer_class_name = "ZImageTransformer2DModel"
    lora_target_modules = ZIMAGE_LORA_TARGET_MODULES
    lora_text_encoder_count = 0
    default_weighting_scheme = "none"
    default_precondition_outputs = False
    default_max_sequence_length = 512
    supports_packing = False  # --packing's block-diagonal step is written for SD3 / Flux's transformers

    @property
    def title(self) -> str:  # type: ignore[override]
        return "Z-Image"

    def check_flags(self, args: argparse.Namespace) -> None:
        super().check_flags(args)
        if getattr(args, "train_text_encoder", False):
            raise UsageError("--train_text_encoder: Z-Image trains the transformer only (its Qwen3 encoder stays "
                             "frozen, as in diffusers' train_dreambooth_lora_z_image.py): drop it.")

    def load(self, path: str, revision: str | None = None, variant: str | None = None,
             transformer_kw: Mapping[str, Any] | None = None) -> FlowParts:
        """Scheduler, Qwen2 tokenizer (Qwen3's chat template), Qwen3 encoder, VAE and transformer."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
        from transformers import AutoModel, AutoTokenizer

        kw = {"revision": revision}
        return FlowParts(
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kw),
            tokenizers=[AutoTokenizer.from_pretrained(path, subfolder="tokenizer", **kw)],
            text_encoders=[AutoModel.from_pretrained(path, subfolder="text_encoder", variant=variant, **kw)],
            vae=AutoencoderKL.from_pretrained(path, subfolder="vae", variant=variant, **kw),
            transformer=ZImageTransformer2DModel.from_pretrained(path, subfolder="transformer", variant=variant, **kw,
                                                                 **(transformer_kw or {})),
        )

    def token_patch(self, transformer: Any) -> int:
        """2: the pipeline calls the transformer with ``patch_size=2`` (its ``all_patch_size`` default)."""
        return 2

    def encode_prompts(self, tokenizers: list[Any], text_encoders: list[Any], captions: list[str],
                       device: Any, max_sequence_length: int) -> tuple[Any, Any]:
        """See :func:`encode_zimage_prompts`: ``(embeds (B, L, D), mask (B, L))``; the mask takes the pooled slot."""
        return encode_zimage_prompts(tokenizers[0], text_encoders[0], captions, device, max_sequence_length)

    def predict(self, transformer: Any, noisy: Any, sigmas: Any, prompt_embeds: Any, pooled: Any,
                options: FlowOptions) -> Any:
        """Each sample as ``(C, 1, h, w)`` with its caption's own tokens at time ``1 - sigma``; returns the
        velocity ``-output`` ``(B, C, h, w)``.

        ``pooled`` is the text mask ``(B, L)`` (any dtype; nonzero = token).
        """
        mask = pooled.to(prompt_embeds.device) > 0.5
        captions = [prompt_embeds[i][mask[i]] for i in range(prompt_embeds.shape[0])]
        t = 1.0 - sigmas.to(noisy.device, torch.float32)
        out = transformer(list(noisy.unsqueeze(2).unbind(0)), t, captions, patch_size=self.token_patch(transformer),
                          return_dict=False)[0]
        return -torch.stack(out, dim=0).squeeze(2)
