"""The flow-matching training step shared by Stable Diffusion 3/3.5 and Flux.1, with a per-bucket resolution shift.

A micro-batch's latents ``x`` (the VAE posterior, sampled, shifted and scaled by the VAE's ``shift_factor`` and
``scaling_factor``) are noised along the straight path ``x_sigma = (1 - sigma) x + sigma * noise``; the transformer
predicts the velocity ``noise - x`` (or, with ``precondition_outputs``, ``x`` itself through ``pred * -sigma +
x_sigma``), and the squared error is weighted with diffusers' SD3 schemes
(``diffusers.training_utils.compute_density_for_timestep_sampling`` draws ``u`` in ``[0, 1)``;
``compute_loss_weighting_for_sd3`` weights the loss).

Where diffusers' own scripts take ``sigma`` from the scheduler's fixed table, this module can shift every batch's
sigmas with ``mu`` computed from that batch's latent token count, exactly as the stock pipeline does at inference
for that height × width (:mod:`hf_arb.families.shift`): ``sigma = time_shift(mu, 1, t)`` where ``t`` is the unshifted
training time. Buckets of different sizes are thus trained at the noise levels they are sampled with.

Every random draw comes from the caller's ``torch.Generator`` (one per micro-batch), in a fixed order: posterior
sample, noise, ``u``. A resumed run therefore draws exactly what the uninterrupted run drew.

Example:
    ```py
    >>> from hf_arb.families.flow import batch_sigmas
    >>> from hf_arb.families.flow_family import training_shift_config
    >>> cfg = training_shift_config(pipe.scheduler.config, by_resolution=True)
    >>> sigmas = batch_sigmas(torch.tensor([0.5]), latent_hw=(6, 10), patch_size=2, config=cfg)  # an 80x48 bucket
    ```
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from .sample_weights import SAMPLE_WEIGHTS, batch_mean
from .shift import ShiftConfig, calculate_mu, check_latent_sizes, shift_sigmas

__all__ = [
    "batch_device",
    "batch_sigmas",
    "check_bucket_sizes",
    "draw",
    "flow_loss",
    "flow_matching_loss",
    "posterior",
    "register_transformer_hooks",
    "sample_latents",
    "shift_report",
    "stock_pipeline",
    "unshifted_times",
]

def unshifted_times(u: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
    """``u`` in ``[0, 1]`` → the unshifted training time ``t = (N - floor(u N)) / N`` in ``(0, 1]``.

    The grid of diffusers' scripts, which index the scheduler's ``N`` training timesteps with ``(u * N).long()``.
    """
    index = (u.double() * num_train_timesteps).long().clamp(0, num_train_timesteps - 1)
    return ((num_train_timesteps - index).double() / num_train_timesteps).float()


def batch_device(batch: Mapping[str, Any]) -> torch.device:
    """Where a micro-batch's tensors are (the training device, after accelerate's loader): of ``latent_stats`` or
    ``pixel_values``, a tensor or a list of them (``--packing``). The losses compute there."""
    first = batch["latent_stats"] if "latent_stats" in batch else batch["pixel_values"]
    return (first[0] if isinstance(first, (list, tuple)) else first).device


def draw(kind: str, shape: Any, generator: torch.Generator, device: Any, dtype: torch.dtype | None = None
         ) -> torch.Tensor:
    """``torch.randn`` (``kind="randn"``) or ``torch.rand`` (``"rand"``) of ``shape`` from the micro-batch's CPU
    ``generator``, moved to ``device`` and cast to ``dtype``: the same numbers on every device type and in every
    precision (drawn in float32 first: ``torch.randn(..., dtype=torch.bfloat16)`` draws other numbers; see
    :func:`hf_arb.train.schedule.micro_step_generator`)."""
    fn = torch.randn if kind == "randn" else torch.rand
    return fn(shape, generator=generator).to(device, dtype)


def batch_sigmas(t: torch.Tensor, latent_hw: tuple[int, int], patch_size: int, config: ShiftConfig) -> torch.Tensor:
    """Shift times ``t`` of one batch whose latents are ``latent_hw`` = (h, w): ``mu`` from its token count.

    ``image_seq_len = (h // patch_size) * (w // patch_size)``, as the SD3 and Flux pipelines count it; ``mu`` and
    the shift are :func:`hf_arb.families.shift.calculate_mu` / :func:`hf_arb.families.shift.shift_sigmas` (float64
    inside).
    """
    h, w = latent_hw
    mu = float(calculate_mu((h // patch_size) * (w // patch_size), config))
    return shift_sigmas(t, mu, config)


def posterior(batch: Mapping[str, Any], vae: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE posterior's ``(mean, std)``, float32 on ``device``: from the cache (``latent_stats`` ``(B, 2, C, h,
    w)``) or by encoding ``pixel_values`` ``(B, 3, H, W)`` without gradients. Shared by every family's loss."""
    if "latent_stats" in batch:
        stats = batch["latent_stats"].to(device, torch.float32)
        return stats[:, 0], stats[:, 1]
    with torch.no_grad():
        dist = vae.encode(batch["pixel_values"].to(device, vae.dtype)).latent_dist
        return dist.mean.float(), dist.std.float()


def sample_latents(mean: torch.Tensor, std: torch.Tensor, vae_config: Mapping[str, Any],
                   generator: torch.Generator) -> torch.Tensor:
    """A posterior sample, normalised for the transformer: ``(mean + std * eps - shift_factor) * scaling_factor``."""
    latents = mean + std * draw("randn", mean.shape, generator, mean.device)
    shift = vae_config.get("shift_factor") or 0.0
    return (latents - shift) * vae_config["scaling_factor"]


def flow_matching_loss(pred: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor, noisy: torch.Tensor,
                       sigmas: torch.Tensor, weighting_scheme: str, precondition_outputs: bool,
                       sample_weights: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted MSE of diffusers' SD3 / Flux scripts (mean over each sample, then over the batch; with
    ``sample_weights`` ``(B,)``, their weighted mean: :mod:`hf_arb.families.sample_weights`); ``mask``
    (``--masked_loss``: ``(B, 1, h, w)`` or the latents' shape) weights each element first
    (:func:`hf_arb.families.loss_mask.apply_loss_mask`)."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    from .loss_mask import apply_loss_mask

    s = sigmas.float().view(-1, *([1] * (latents.ndim - 1)))
    pred = pred.float()
    if precondition_outputs:
        pred = pred * (-s) + noisy.float()
        target = latents.float()
    else:
        target = noise.float() - latents.float()
    weighting = compute_loss_weighting_for_sd3(weighting_scheme, sigmas=s).float()
    error = apply_loss_mask(weighting * (pred - target) ** 2, mask)
    return batch_mean(error.reshape(latents.shape[0], -1).mean(dim=1), sample_weights)


def noise_latents(latents: torch.Tensor, options: Any, generator: torch.Generator,
                  sigmas_of: Callable[[torch.Tensor, tuple[int, int]], torch.Tensor] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One flow-matching draw for ``latents`` ``(B, C, h, w)`` (or a video's ``(B, C, f, h, w)``): the noise, then
    ``u`` (``options.weighting_scheme``'s density), in that order from ``generator``; sigmas shifted for the batch's
    resolution (``sigmas_of(t, (h, w))``, default :func:`batch_sigmas` with ``options.token_patch`` /
    ``options.shift``).

    Returns:
        ``noise`` (the latents' shape), ``sigmas`` ``(B,)`` and ``noisy = (1 - sigma) * latents + sigma * noise``.
    """
    from diffusers.training_utils import compute_density_for_timestep_sampling

    device = latents.device
    noise = draw("randn", latents.shape, generator, device)
    u = compute_density_for_timestep_sampling(options.weighting_scheme, latents.shape[0], logit_mean=options.logit_mean,
                                              logit_std=options.logit_std, mode_scale=options.mode_scale,
                                              device="cpu", generator=generator).to(device)
    t = unshifted_times(u, options.num_train_timesteps)
    size = tuple(latents.shape[-2:])
    sigmas = (sigmas_of(t, size) if sigmas_of else batch_sigmas(t, size, options.token_patch, options.shift)).to(device)
    s = sigmas.view(-1, *([1] * (latents.ndim - 1)))
    return noise, sigmas, (1.0 - s) * latents + s * noise


def drop_captions(captions: Any, proportion: float, generator: torch.Generator) -> list[str]:
    """``--proportion_empty_prompts``: each caption replaced by ``""`` with probability ``proportion`` (one draw per
    caption from ``generator``; no draw when it is 0)."""
    captions = list(captions)
    if proportion:
        drop = torch.rand(len(captions), generator=generator) < proportion
        captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
    return captions


def flow_loss(family: Any, options: Any, transformer: Any, batch: Mapping[str, Any],
              vae: Any, encode: Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]], generator: torch.Generator,
              dtype: torch.dtype, proportion_empty_prompts: float = 0.0, vae_encode_mode: str | None = None
              ) -> torch.Tensor:
    """The loss of one micro-batch: latents → shifted sigmas → noisy latents → transformer → weighted MSE.

    Args:
        batch: ``latent_stats`` ``(B, 2, C, h, w)`` (cached posterior mean/std) or ``pixel_values`` ``(B, 3, H, W)``,
            and ``captions``.
        encode: captions → ``(prompt_embeds, pooled)`` (memoised or not).
        generator: the micro-batch's generator: posterior sample, noise, ``u`` and prompt dropout, in that order.
        vae_encode_mode: ``"mode"`` trains the posterior's mode (its mean; the sample's draw is still taken, so the
            later draws do not move), ``"sample"`` or ``None`` a sample.
    """
    mean, std = posterior(batch, vae, batch_device(batch))
    latents = sample_latents(mean, std * 0 if vae_encode_mode == "mode" else std, vae.config, generator)
    noise, sigmas, noisy = noise_latents(latents, options, generator)
    prompt_embeds, pooled = encode(drop_captions(batch["captions"], proportion_empty_prompts, generator))
    pred = family.predict(transformer, noisy.to(dtype), sigmas, prompt_embeds, pooled, options)
    from .loss_mask import batch_loss_mask

    return flow_matching_loss(pred, latents, noise, noisy, sigmas, options.weighting_scheme,
                              options.precondition_outputs, batch.get(SAMPLE_WEIGHTS),
                              mask=batch_loss_mask(batch, batch_device(batch)))


def check_bucket_sizes(resolutions: Any, vae_scale_factor: int, patch_size: int) -> int:
    """Raise ``ValueError`` unless every bucket side is a multiple of ``vae_scale_factor * patch_size``.

    Returns:
        The needed multiple (16 for SD3 and Flux), for the startup report.
    """
    check_latent_sizes(np.asarray(resolutions), vae_scale_factor, patch_size)
    return vae_scale_factor * patch_size


def shift_report(options: Any, buckets: Any, vae_scale_factor: int) -> str:
    """The startup report's shift section: how training shifts, then each bucket's ``image_seq_len`` and ``mu``."""
    from .shift import shift_table_text

    cfg = options.shift
    head = (f"Resolution shift: per bucket (mu from image_seq_len; {cfg.time_shift_type})" if options.by_resolution
            else f"Resolution shift: off, one static shift {cfg.shift:g} for every bucket "
                 "(--shift_by_resolution shifts each bucket as the pipeline does at its size)")
    return head + "\n" + shift_table_text(buckets, cfg, vae_scale_factor, options.token_patch)


def stock_pipeline(family: Any, options: Any, path: str, transformer: Any, *,
                   components: Mapping[str, Any] | None = None, **from_pretrained: Any) -> Any:
    """The family's stock pipeline around ``transformer``, loaded from ``path`` (``components`` replace parts).

    A static-shift scheduler (SD3) trained with the per-bucket shift gets ``use_dynamic_shifting=True``, so that
    inference shifts each size exactly as training did; ``from_pretrained`` keywords pass through.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = family.pipeline_class().from_pretrained(path, transformer=transformer, **dict(components or {}),
                                                   **from_pretrained)
    if options.by_resolution and not pipe.scheduler.config.get("use_dynamic_shifting", False):
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, use_dynamic_shifting=True)
    return pipe


def register_transformer_hooks(accelerator: Any, transformer_cls: Any, subfolder: str = "transformer",
                               unwrap: Callable[[Any], Any] | None = None) -> None:
    """Save the trained transformer in diffusers format under ``<checkpoint>/transformer`` and load it back.

    Args:
        accelerator: the run's ``accelerate.Accelerator`` (its public save/load state pre-hooks).
        transformer_cls: the diffusers class to load the checkpoint's transformer with.
        unwrap: prepared model → transformer (default ``accelerator.unwrap_model``; ``--packing`` prepares a
            wrapper around the transformer).
    """
    unwrap = unwrap or accelerator.unwrap_model

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        if accelerator.is_main_process:
            for model in models:
                unwrap(model).save_pretrained(os.path.join(output_dir, subfolder))
                weights.pop()

    def load_hook(models: list[Any], input_dir: str) -> None:
        while models:
            model = unwrap(models.pop())
            loaded = transformer_cls.from_pretrained(input_dir, subfolder=subfolder)
            model.load_state_dict(loaded.state_dict())
            del loaded

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
