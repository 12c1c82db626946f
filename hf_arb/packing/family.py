"""The flow-matching training step on a pack (``--packing``): :func:`~hf_arb.families.flow.flow_loss` for images at
their own sizes in one sequence.

A pack's images (:func:`hf_arb.packing.dataset.collate_packs`: a list of pixel tensors and their token grids) are
encoded one by one by the VAE, each gets its own noise and its own timestep ``u`` from the weighting scheme's
density, and ``u`` is shifted with the ``mu`` of **that image's** token count (the per-image analogue of the
per-bucket shift; :func:`hf_arb.packing.layout.pack_meta`); :class:`hf_arb.packing.loss.PackedFlowModel` runs the
packed forward and the masked loss. Random draws come from the micro-step's generator in a fixed order — each
image's posterior sample, each image's noise, the ``u`` of all images, prompt dropout — so a resumed run draws
exactly what the uninterrupted run drew.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from hf_arb.families.flow import batch_device, draw, sample_latents, unshifted_times
from hf_arb.families.flow_family import FlowFamily, FlowOptions

from .layout import pack_meta

__all__ = ["packed_flow_step"]


def packed_flow_step(family: FlowFamily, options: FlowOptions, model: Any, batch: Mapping[str, Any], vae: Any,
                     encode: Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]], generator: torch.Generator,
                     dtype: torch.dtype, max_tokens: int, proportion_empty_prompts: float = 0.0) -> torch.Tensor:
    """The loss of one pack: the packed counterpart of :func:`~hf_arb.families.flow.flow_loss`.

    Args:
        family, options: the run's family adapter and flow-matching options (its weighting scheme, shift, guidance).
        model: a :class:`~hf_arb.packing.loss.PackedFlowModel` (after ``accelerator.prepare``).
        batch: a pack: ``pixel_values`` (list of ``(3, H_i, W_i)``), ``grids`` ``(m, 2)`` and ``captions``.
        encode: captions → ``(prompt_embeds (m, S, D), pooled (m, P))``.
        generator: the micro-step's generator.
        max_tokens: the pack's image-token slots (``--max_tokens``).

    Returns:
        The scalar loss (the mean over the pack's images of each image's weighted MSE).
    """
    from diffusers.training_utils import compute_density_for_timestep_sampling

    device = batch_device(batch)
    pixels = list(batch["pixel_values"])
    m = len(pixels)
    stats = []
    with torch.no_grad():
        for px in pixels:
            dist = vae.encode(px[None].to(device, vae.dtype)).latent_dist
            stats.append((dist.mean.float()[0], dist.std.float()[0]))
    latents = [sample_latents(mean, std, vae.config, generator) for mean, std in stats]
    noise = [draw("randn", x.shape, generator, device) for x in latents]
    u = compute_density_for_timestep_sampling(options.weighting_scheme, m, logit_mean=options.logit_mean,
                                              logit_std=options.logit_std, mode_scale=options.mode_scale,
                                              device="cpu", generator=generator).to(device)
    t = unshifted_times(u, options.num_train_timesteps)
    captions = list(batch["captions"])
    if proportion_empty_prompts:
        drop = torch.rand(m, generator=generator) < proportion_empty_prompts
        captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
    prompt_embeds, pooled = encode(captions)
    grids = np.asarray(torch.as_tensor(batch["grids"]).cpu(), dtype=np.int64).reshape(-1, 2)  # on the GPU there
    meta = pack_meta(grids, max_tokens, text_lens=[prompt_embeds.shape[1]] * m,
                     t=t.double().cpu().numpy(), shift_config=options.shift)
    sigmas = torch.as_tensor(meta.sigmas, dtype=torch.float32, device=device)
    guidance = family.guidance(options, m, device)
    from hf_arb.families.loss_mask import batch_loss_mask

    masks = batch_loss_mask(batch, device)  # --masked_loss: one (1, H_i, W_i) per image, tokenised by the loss
    loss, _ = model(latents, noise, list(prompt_embeds), pooled, sigmas, guidance=guidance, meta=meta,
                    weighting_scheme=options.weighting_scheme, precondition_outputs=options.precondition_outputs,
                    num_train_timesteps=options.num_train_timesteps, dtype=dtype,
                    **({} if masks is None else {"masks": masks}))
    return loss
