"""Flux.1 Kontext (``FluxKontextPipeline``): Flux.1 trained on a target image plus reference images.

At inference ``FluxKontextPipeline`` encodes the input image with the VAE (the posterior's mode, shifted and scaled
like the target latents), packs it into 2×2 tokens whose position ids are ``(1, row, column)`` (the target's are
``(0, row, column)``), appends those tokens to the target's along the sequence, and keeps only the first
``target tokens`` of the transformer's output. The resolution shift ``mu`` comes from the target's token count
alone. :class:`FluxKontextFamily` trains exactly that: each reference column of the batch
(``reference_pixel_values``, one ``(B, 3, H_j, W_j)`` tensor per column, from
:class:`~hf_arb.images.references.BucketedReferenceDataset`) becomes tokens appended to the noisy target's; the
loss is the shared flow-matching loss on the target tokens (:func:`hf_arb.families.flow.flow_loss`).

Example:
    ```py
    >>> tokens, ids = reference_tokens(vae, [before_pixels], device="cpu", dtype=torch.float32)
    >>> tokens.shape, ids[:, 0].unique()         # (B, (h/2)(w/2), 4C), tensor([1.])
    ```
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from hf_arb.lazy import LazyModule

from .base import Models, builtin_family
from .flow_family import FlowOptions
from .flux import FluxFamily, latent_image_ids, pack_latents, unpack_latents

torch: Any = LazyModule("torch")  # family detection must not import torch

__all__ = ["FluxKontextFamily", "pack_references", "reference_tokens"]


def reference_tokens(vae: Any, references: Sequence[Any], device: Any, dtype: Any) -> tuple[Any, Any]:
    """The reference images as Kontext's conditioning tokens, as ``FluxKontextPipeline.prepare_latents`` builds them.

    Args:
        vae: the frozen ``AutoencoderKL``.
        references: one ``(B, 3, H_j, W_j)`` tensor in ``[-1, 1]`` per reference column.
        device, dtype: where and in which dtype the tokens go.

    Returns:
        ``(tokens, ids)``: ``tokens`` ``(B, sum_j (H_j/16)(W_j/16), 4C)`` (the VAE posterior's mode, minus
        ``shift_factor``, times ``scaling_factor``, packed 2×2), ``ids`` ``(sum_j (H_j/16)(W_j/16), 3)`` with first
        coordinate 1.
    """
    with torch.no_grad():
        modes = [vae.encode(pixels.to(device, vae.dtype)).latent_dist.mode() for pixels in references]
    return pack_references(vae.config, modes, device, dtype)


def pack_references(vae_config: Any, modes: Sequence[Any], device: Any, dtype: Any) -> tuple[Any, Any]:
    """:func:`reference_tokens` from the posterior modes ``(B, C, h_j, w_j)`` of the references (encoded now, or the
    means of ``--cache_latents``' ``reference_latent_stats``: a diagonal Gaussian's mode is its mean)."""
    tokens, ids = [], []
    for mode in modes:
        latents = (mode.to(device) - vae_config.shift_factor) * vae_config.scaling_factor  # (B, C, h, w)
        h, w = latents.shape[-2:]
        tokens.append(pack_latents(latents.to(dtype)))
        pos = latent_image_ids(h, w, device, dtype)
        pos[:, 0] = 1
        ids.append(pos)
    return torch.cat(tokens, dim=1), torch.cat(ids, dim=0)


class _WithReferences:
    """The family as :func:`~hf_arb.families.flow.flow_loss` sees it, with this batch's reference tokens bound."""

    def __init__(self, family: FluxKontextFamily, tokens: Any, ids: Any) -> None:
        self.family, self.tokens, self.ids = family, tokens, ids

    def predict(self, transformer: Any, noisy: Any, sigmas: Any, prompt_embeds: Any, pooled: Any,
                options: FlowOptions) -> Any:
        return self.family.predict(transformer, noisy, sigmas, prompt_embeds, pooled, options,
                                   references=(self.tokens, self.ids))


@builtin_family
class FluxKontextFamily(FluxFamily):
    """Flux.1 Kontext (``FluxKontextPipeline``, the Flux transformer with reference tokens). Defaults follow
    diffusers' ``train_dreambooth_lora_flux_kontext.py`` (those of Flux.1)."""

    name = "flux-kontext"
    class_prefixes = ("FluxKontext",)
    hub_name_hints = ("kontext",)
    card_tags = ("flux", "flux-kontext", "flux-diffusers", "image-editing")
    pipeline_class_name = "FluxKontextPipeline"
    supports_packing = False
    #: the training script's ``--reference_image_column`` applies
    supports_references = True
    image_argument = "one"

    @property
    def title(self) -> str:  # type: ignore[override]
        return "Flux.1 Kontext"

    def generation_args(self, args: argparse.Namespace, shape: tuple[int, int]) -> list[str]:
        """Also ``max_area=width*height``: stock ``FluxKontextPipeline`` rescales the output to ``max_area``
        (default 1024²) at the requested aspect, so without it a trained bucket comes out at about a megapixel."""
        return [*super().generation_args(args, shape), f"max_area={shape[0] * shape[1]}"]

    def predict(self, transformer: Any, noisy: Any, sigmas: Any, prompt_embeds: Any, pooled: Any,
                options: FlowOptions, references: tuple[Any, Any] | None = None) -> Any:
        """Flux's transformer call with the reference tokens appended (ids ``(1, row, column)``); the output keeps
        the target's tokens only, as the pipeline does."""
        if references is None:
            return super().predict(transformer, noisy, sigmas, prompt_embeds, pooled, options)
        ref_tokens, ref_ids = references
        b, _, h, w = noisy.shape
        device = noisy.device
        target = pack_latents(noisy)  # (B, T, 4C)
        guidance = self.guidance(options, b, device)
        timesteps = sigmas.to(device, torch.float32) * options.num_train_timesteps  # as FluxFamily.predict
        out = transformer(hidden_states=torch.cat([target, ref_tokens.to(target.dtype)], dim=1),
                          timestep=timesteps / options.num_train_timesteps, guidance=guidance,
                          pooled_projections=pooled,
                          encoder_hidden_states=prompt_embeds,
                          txt_ids=torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=prompt_embeds.dtype),
                          img_ids=torch.cat([latent_image_ids(h, w, device, prompt_embeds.dtype),
                                             ref_ids.to(device, prompt_embeds.dtype)], dim=0),
                          return_dict=False)[0]
        return unpack_latents(out[:, : target.shape[1]], h, w)

    def training_loss(self, args: argparse.Namespace, models: Models, denoiser: Any, batch: dict[str, Any],
                      text: Any, generator: Any, dtype: Any) -> Any:
        """The flow-matching loss of the target, its tokens followed by the batch's reference tokens."""
        from .flow import batch_device, flow_loss

        refs = batch.get("reference_pixel_values")
        cached = batch.get("reference_latent_stats")  # --cache_latents: (B, 2, C, h_j, w_j) per reference
        if not refs and not cached:
            return super().training_loss(args, models, denoiser, batch, text, generator, dtype)
        if cached:
            tokens, ids = pack_references(models.vae.config, [s[:, 0] for s in cached], batch_device(batch), dtype)
        else:
            tokens, ids = reference_tokens(models.vae, refs, batch_device(batch), dtype)
        return flow_loss(_WithReferences(self, tokens, ids), models.options, denoiser, batch, models.vae, text,
                         generator, dtype, args.proportion_empty_prompts, getattr(args, "vae_encode_mode", None))
