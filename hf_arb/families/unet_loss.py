"""The UNet objective of diffusers' text-to-image scripts (SD 1.x/2.x and SDXL): epsilon or v-prediction, with
their options (``--snr_gamma``, ``--noise_offset``, ``--input_perturbation``, ``--timestep_bias_*``,
``--dream_training``). The family adapters (:mod:`hf_arb.families.unet`) call :func:`unet_loss` with their own UNet
call (SDXL's added conditioning, SD's resolution class labels).

Every random draw comes from the micro-batch's generator, in a fixed order (posterior sample, noise, offset,
timesteps, perturbation, prompt dropout), so a resumed run draws exactly what the uninterrupted run drew.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hf_arb.checks import UsageError

from .conditioning import sdxl_time_ids
from .flow import batch_device, draw, drop_captions, posterior, sample_latents
from .loss_mask import apply_loss_mask, batch_loss_mask
from .sample_weights import SAMPLE_WEIGHTS, batch_mean

#: ``forward(noisy, timesteps, hidden, pooled, time_ids) -> prediction``: one UNet call with the family's conditioning
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, torch.Tensor], torch.Tensor]


def unet_loss(args: argparse.Namespace, scheduler: Any, vae: Any, batch: dict[str, Any], text: Any,
              gen: torch.Generator, weight_dtype: torch.dtype, forward: Forward) -> torch.Tensor:
    """The diffusers loss for one micro-batch: latents → noise → UNet → (SNR-weighted) MSE.

    Args:
        batch: ``latent_stats`` ``(B, 2, C, h, w)`` (cached posterior) or ``pixel_values`` ``(B, 3, H, W)``, with
            ``captions``, ``original_sizes``, ``crop_top_lefts`` and ``target_sizes`` (each ``(B, 2)``).
        text: captions → ``(hidden, pooled)``.
        forward: the family's UNet call.
    """
    from diffusers.training_utils import compute_snr

    sched, device = scheduler, batch_device(batch)
    mean, std = posterior(batch, vae, device)  # cached (latent_stats) or encoded now
    latents = sample_latents(mean, std, vae.config, gen).to(weight_dtype)
    bsz = latents.shape[0]
    noise = draw("randn", latents.shape, gen, device, latents.dtype)
    if args.noise_offset:
        noise = noise + args.noise_offset * draw("randn", (bsz, latents.shape[1], 1, 1), gen, device, latents.dtype)
    if args.timestep_bias_strategy == "none":
        timesteps = torch.randint(0, sched.config.num_train_timesteps, (bsz,), generator=gen).long().to(device)
    else:
        weights = timestep_bias_weights(args, sched.config.num_train_timesteps).cpu()
        timesteps = torch.multinomial(weights, bsz, replacement=True, generator=gen).long().to(device)
    if args.input_perturbation:
        perturbed = noise + args.input_perturbation * draw("randn", noise.shape, gen, device, noise.dtype)
        noisy = sched.add_noise(latents, perturbed, timesteps)
    else:
        noisy = sched.add_noise(latents, noise, timesteps)
    hidden, pooled = text(drop_captions(batch["captions"], args.proportion_empty_prompts, gen))
    time_ids = sdxl_time_ids(batch["original_sizes"], batch["crop_top_lefts"], batch["target_sizes"], device=device)
    if sched.config.prediction_type == "epsilon":
        target = noise
    elif sched.config.prediction_type == "v_prediction":
        target = sched.get_velocity(latents, noise, timesteps)
    else:
        raise ValueError(f"Unknown prediction type {sched.config.prediction_type}; use epsilon or v_prediction.")
    if args.dream_training:
        noisy, target = dream_adjust(sched, timesteps, noise, noisy, target, args.dream_detail_preservation,
                                     lambda x: forward(x, timesteps, hidden, pooled, time_ids))
    pred = forward(noisy, timesteps, hidden, pooled, time_ids)
    mask = batch_loss_mask(batch, device)  # --masked_loss: each latent cell's weight (hf_arb.families.loss_mask)
    # prior preservation's instance + weight x class, several datasets' loss weights (sample_weights.py)
    sample_weights = batch.get(SAMPLE_WEIGHTS)
    if args.snr_gamma is None and mask is None and sample_weights is None:
        return F.mse_loss(pred.float(), target.float(), reduction="mean")
    error = apply_loss_mask(F.mse_loss(pred.float(), target.float(), reduction="none"), mask)
    if args.snr_gamma is None and sample_weights is None:  # the mean over every element, masked ones as zeros
        return error.mean()
    loss = error.mean(dim=(1, 2, 3))
    if args.snr_gamma is not None:
        snr = compute_snr(sched, timesteps)
        if sched.config.prediction_type == "v_prediction":
            snr = snr + 1
        loss = loss * (torch.clamp(snr, max=args.snr_gamma) / snr)
    return batch_mean(loss, sample_weights)


def timestep_bias_weights(args: argparse.Namespace, num_timesteps: int) -> torch.Tensor:
    """Sampling weights over ``num_timesteps`` for --timestep_bias_* (the SDXL script's options).

    ``earlier`` / ``later`` multiply the first / last ``portion`` of the timesteps by ``multiplier``; ``range``
    multiplies ``[begin, end)``. Returns a ``(num_timesteps,)`` probability vector.
    """
    weights = torch.ones(num_timesteps, dtype=torch.float64)
    count = int(args.timestep_bias_portion * num_timesteps)
    strategy = args.timestep_bias_strategy
    if strategy == "later":
        sel = slice(num_timesteps - count, num_timesteps)
    elif strategy == "earlier":
        sel = slice(0, count)
    elif strategy == "range":
        if args.timestep_bias_end > num_timesteps:
            raise UsageError(f"--timestep_bias_end {args.timestep_bias_end} exceeds the scheduler's "
                             f"{num_timesteps} training timesteps.")
        sel = slice(args.timestep_bias_begin, args.timestep_bias_end)
    else:
        sel = slice(0, 0)
    weights[sel] *= args.timestep_bias_multiplier
    return (weights / weights.sum()).float()


def dream_adjust(sched: Any, timesteps: torch.Tensor, noise: torch.Tensor, noisy: torch.Tensor, target: torch.Tensor,
                 detail_preservation: float, predict: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """DREAM (arXiv:2312.00210, Algorithm 3): shift the noisy input and the target by the model's own error.

    ``predict(noisy)`` is one UNet call (run without gradients); with ``sigma = sqrt(1 - alpha_bar_t)`` and
    ``delta = (noise - prediction) * sigma ** p``, returns ``(noisy + sigma * delta, target + delta)``.
    """
    if sched.config.prediction_type != "epsilon":
        raise UsageError("--dream_training supports epsilon prediction only: drop --prediction_type v_prediction.")
    alpha_bar = sched.alphas_cumprod.to(noisy.device)[timesteps].float()
    sigma = (1.0 - alpha_bar).sqrt().view(-1, *([1] * (noisy.ndim - 1)))
    with torch.no_grad():
        pred = predict(noisy)
    delta = (noise.float() - pred.float()) * sigma ** detail_preservation
    return (noisy.float() + sigma * delta).to(noisy.dtype), (target.float() + delta).to(target.dtype)
