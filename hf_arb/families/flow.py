"""The flow-matching training step shared by Stable Diffusion 3/3.5 and Flux.1, with a per-bucket resolution shift.

A micro-batch's latents ``x`` (the VAE posterior, sampled, shifted and scaled by the VAE's ``shift_factor`` and
``scaling_factor``) are noised along the straight path ``x_sigma = (1 - sigma) x + sigma * noise``; the transformer
predicts the velocity ``noise - x`` (or, with ``precondition_outputs``, ``x`` itself through ``pred * -sigma +
x_sigma``), and the squared error is weighted with diffusers' SD3 schemes
(``diffusers.training_utils.compute_density_for_timestep_sampling`` draws ``u`` in ``[0, 1)``;
``compute_loss_weighting_for_sd3`` weights the loss).

Where diffusers' own scripts take ``sigma`` from the scheduler's fixed table, this module can shift every batch's
sigmas with ``mu`` computed from that batch's latent token count, exactly as the stock pipeline does at inference
for that height × width (:mod:`hf_arb.shift`): ``sigma = time_shift(mu, 1, t)`` where ``t`` is the unshifted
training time. Buckets of different sizes are thus trained at the noise levels they are sampled with.

Every random draw comes from the caller's ``torch.Generator`` (one per micro-batch), in a fixed order: posterior
sample, noise, ``u``. A resumed run therefore draws exactly what the uninterrupted run drew.

Example:
    ```py
    >>> from hf_arb.families.flow import training_shift_config, batch_sigmas
    >>> cfg = training_shift_config(pipe.scheduler.config, by_resolution=True)
    >>> sigmas = batch_sigmas(torch.tensor([0.5]), latent_hw=(6, 10), patch_size=2, config=cfg)  # an 80x48 bucket
    ```
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..shift import ShiftConfig, calculate_mu, check_latent_sizes, shift_sigmas

__all__ = [
    "WEIGHTING_SCHEMES",
    "FlowFamily",
    "FlowOptions",
    "FlowParts",
    "batch_sigmas",
    "check_bucket_sizes",
    "flow_loss",
    "flow_matching_loss",
    "posterior",
    "register_transformer_hooks",
    "sample_latents",
    "shift_report",
    "stock_pipeline",
    "training_shift_config",
    "unshifted_times",
]

#: ``--weighting_scheme`` values of diffusers' SD3 / Flux training scripts.
WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none")


@dataclass
class FlowParts:
    """The pieces of an SD3 / Flux checkpoint the trainer uses (frozen except the transformer).

    Attributes:
        scheduler: the checkpoint's ``FlowMatchEulerDiscreteScheduler``.
        tokenizers, text_encoders: in pipeline order (SD3: CLIP-L, CLIP-G, T5; Flux: CLIP-L, T5). A missing
            T5 (SD3 saved without ``text_encoder_3``) is ``None``.
        vae: the ``AutoencoderKL`` (16 latent channels).
        transformer: ``SD3Transformer2DModel`` or ``FluxTransformer2DModel``.
    """

    scheduler: Any
    tokenizers: list[Any]
    text_encoders: list[Any]
    vae: Any
    transformer: Any


@dataclass(frozen=True)
class FlowOptions:
    """The flow-matching flags of one run (``--weighting_scheme`` … ``--guidance_scale``), resolved per family.

    Attributes:
        weighting_scheme: one of :data:`WEIGHTING_SCHEMES` (timestep density and loss weighting).
        logit_mean, logit_std: the ``logit_normal`` density's parameters.
        mode_scale: the ``mode`` density's scale.
        precondition_outputs: predict the clean latents (``pred * -sigma + x_sigma``) instead of the velocity.
        shift: the training :class:`~hf_arb.shift.ShiftConfig` (:func:`training_shift_config`).
        guidance_scale: the guidance input of guidance-distilled transformers (Flux.1-dev); ignored otherwise.
        max_sequence_length: T5 tokens per prompt.
        num_train_timesteps: the scheduler's training steps (the grid ``u`` is read on).
        token_patch: latent pixels per token side (:meth:`FlowFamily.token_patch`), for ``image_seq_len``.
        guidance_embeds: the transformer takes a guidance input (its config's ``guidance_embeds``).
    """

    weighting_scheme: str = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    precondition_outputs: bool = False
    shift: ShiftConfig = dataclasses.field(default_factory=ShiftConfig)
    guidance_scale: float = 3.5
    max_sequence_length: int = 512
    num_train_timesteps: int = 1000
    token_patch: int = 2
    guidance_embeds: bool = False

    @property
    def by_resolution(self) -> bool:
        """Whether sigmas are shifted per batch from its token count."""
        return self.shift.use_dynamic_shifting


class FlowFamily:
    """One flow-matching model family: how to load it, encode prompts and call its transformer.

    Subclasses (:class:`~hf_arb.families.sd3.SD3Family`, :class:`~hf_arb.families.flux.FluxFamily`) fill in the
    class attributes and the three methods; everything else (noise, shift, loss) is shared in this module.
    """

    name: str = ""
    pipeline_class_name: str = ""
    transformer_class_name: str = ""
    #: LoRA targets of diffusers' ``train_dreambooth_lora_<family>.py`` (its ``--lora_layers`` default).
    lora_target_modules: tuple[str, ...] = ()
    #: --train_text_encoder: how many of the leading (CLIP) text encoders get LoRA, as diffusers' scripts
    lora_text_encoders: int = 1
    default_weighting_scheme: str = "none"
    default_precondition_outputs: bool = False
    default_max_sequence_length: int = 512

    def pipeline_class(self) -> Any:
        """The stock diffusers pipeline class (``StableDiffusion3Pipeline`` / ``FluxPipeline``)."""
        import diffusers

        return getattr(diffusers, self.pipeline_class_name)

    def transformer_class(self) -> Any:
        """The diffusers transformer class of the family."""
        import diffusers

        return getattr(diffusers, self.transformer_class_name)

    def options(self, scheduler_config: Mapping[str, Any], transformer: Any, *, weighting_scheme: str | None = None,
                logit_mean: float = 0.0, logit_std: float = 1.0, mode_scale: float = 1.29,
                precondition_outputs: bool | None = None, shift_by_resolution: bool | None = None,
                guidance_scale: float = 3.5, max_sequence_length: int | None = None) -> FlowOptions:
        """Resolve the run's :class:`FlowOptions`: ``None`` takes the family's default (diffusers' script's).

        Args:
            scheduler_config: the base checkpoint's scheduler config (its shift values).
            transformer: the (unwrapped) transformer: its patch size and ``guidance_embeds``.
            shift_by_resolution: see :func:`training_shift_config`.
        """
        scheme = self.default_weighting_scheme if weighting_scheme is None else weighting_scheme
        if scheme not in WEIGHTING_SCHEMES:
            raise ValueError(f"weighting_scheme {scheme!r} is not one of {', '.join(WEIGHTING_SCHEMES)}.")
        return FlowOptions(
            weighting_scheme=scheme, logit_mean=float(logit_mean), logit_std=float(logit_std),
            mode_scale=float(mode_scale),
            precondition_outputs=bool(self.default_precondition_outputs if precondition_outputs is None
                                      else precondition_outputs),
            shift=training_shift_config(scheduler_config, shift_by_resolution), guidance_scale=float(guidance_scale),
            max_sequence_length=int(max_sequence_length or self.default_max_sequence_length),
            num_train_timesteps=int(scheduler_config.get("num_train_timesteps", 1000)),
            token_patch=self.token_patch(transformer),
            guidance_embeds=bool(transformer.config.get("guidance_embeds", False)),
        )

    def load(self, path: str, revision: str | None = None, variant: str | None = None) -> FlowParts:
        """Load scheduler, tokenizers, text encoders, VAE and transformer from a diffusers folder or Hub id."""
        raise NotImplementedError

    def token_patch(self, transformer: Any) -> int:
        """Latent pixels per token side (SD3: the transformer's ``patch_size``; Flux: the 2×2 packing)."""
        raise NotImplementedError

    def encode_prompts(self, tokenizers: list[Any], text_encoders: list[Any], captions: list[str],
                       device: torch.device, max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Captions → ``(prompt_embeds (B, S, D), pooled_prompt_embeds (B, P))`` as the family's pipeline builds them."""
        raise NotImplementedError

    def predict(self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, prompt_embeds: torch.Tensor,
                pooled: torch.Tensor, options: FlowOptions) -> torch.Tensor:
        """One transformer call on latents ``noisy (B, C, h, w)`` at ``sigmas (B,)``; returns ``(B, C, h, w)``."""
        raise NotImplementedError


def training_shift_config(scheduler_config: Mapping[str, Any], by_resolution: bool | None) -> ShiftConfig:
    """The shift training applies, from the base scheduler's config.

    Args:
        scheduler_config: the checkpoint's ``FlowMatchEulerDiscreteScheduler`` config.
        by_resolution: shift each batch by its token count (``--shift_by_resolution``); ``None``: only where the
            scheduler itself shifts dynamically (``use_dynamic_shifting``), as the pipeline does at inference.

    Returns:
        With ``by_resolution``: the scheduler's ``base/max_image_seq_len`` and ``base/max_shift`` with
        ``use_dynamic_shifting=True``. Without: the scheduler's static ``shift`` where it has no dynamic
        shifting (SD3/SD3.5's 3.0, as diffusers' scripts train), else no shift at all (diffusers' Flux scripts).
    """
    base = ShiftConfig.from_scheduler_config(scheduler_config)
    dynamic = bool(scheduler_config.get("use_dynamic_shifting", False))
    if by_resolution is None:
        by_resolution = dynamic
    if by_resolution:
        return dataclasses.replace(base, use_dynamic_shifting=True)
    return dataclasses.replace(base, use_dynamic_shifting=False, shift=1.0 if dynamic else base.shift)


def unshifted_times(u: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
    """``u`` in ``[0, 1]`` → the unshifted training time ``t = (N - floor(u N)) / N`` in ``(0, 1]``.

    The grid of diffusers' scripts, which index the scheduler's ``N`` training timesteps with ``(u * N).long()``.
    """
    index = (u.double() * num_train_timesteps).long().clamp(0, num_train_timesteps - 1)
    return ((num_train_timesteps - index).double() / num_train_timesteps).float()


def batch_sigmas(t: torch.Tensor, latent_hw: tuple[int, int], patch_size: int, config: ShiftConfig) -> torch.Tensor:
    """Shift times ``t`` of one batch whose latents are ``latent_hw`` = (h, w): ``mu`` from its token count.

    ``image_seq_len = (h // patch_size) * (w // patch_size)``, as the SD3 and Flux pipelines count it; ``mu`` and
    the shift are :func:`hf_arb.shift.calculate_mu` / :func:`hf_arb.shift.shift_sigmas` (float64 inside).
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
    latents = mean + std * torch.randn(mean.shape, generator=generator, device=mean.device)
    shift = vae_config.get("shift_factor") or 0.0
    return (latents - shift) * vae_config["scaling_factor"]


def flow_matching_loss(pred: torch.Tensor, latents: torch.Tensor, noise: torch.Tensor, noisy: torch.Tensor,
                       sigmas: torch.Tensor, weighting_scheme: str, precondition_outputs: bool) -> torch.Tensor:
    """The weighted MSE of diffusers' SD3 / Flux scripts (mean over each sample, then over the batch)."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    s = sigmas.float().view(-1, *([1] * (latents.ndim - 1)))
    pred = pred.float()
    if precondition_outputs:
        pred = pred * (-s) + noisy.float()
        target = latents.float()
    else:
        target = noise.float() - latents.float()
    weighting = compute_loss_weighting_for_sd3(weighting_scheme, sigmas=s).float()
    return (weighting * (pred - target) ** 2).reshape(latents.shape[0], -1).mean(dim=1).mean()


def flow_loss(family: FlowFamily, options: FlowOptions, transformer: Any, batch: Mapping[str, Any],
              vae: Any, encode: Callable[[list[str]], tuple[torch.Tensor, torch.Tensor]], generator: torch.Generator,
              dtype: torch.dtype, proportion_empty_prompts: float = 0.0) -> torch.Tensor:
    """The loss of one micro-batch: latents → shifted sigmas → noisy latents → transformer → weighted MSE.

    Args:
        batch: ``latent_stats`` ``(B, 2, C, h, w)`` (cached posterior mean/std) or ``pixel_values`` ``(B, 3, H, W)``,
            and ``captions``.
        encode: captions → ``(prompt_embeds, pooled)`` (memoised or not).
        generator: the micro-batch's generator: posterior sample, noise, ``u`` and prompt dropout, in that order.
    """
    from diffusers.training_utils import compute_density_for_timestep_sampling

    device = generator.device
    mean, std = posterior(batch, vae, device)
    latents = sample_latents(mean, std, vae.config, generator)
    bsz = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator, device=device)
    u = compute_density_for_timestep_sampling(options.weighting_scheme, bsz, logit_mean=options.logit_mean,
                                              logit_std=options.logit_std, mode_scale=options.mode_scale,
                                              device=device, generator=generator)
    t = unshifted_times(u, options.num_train_timesteps)
    sigmas = batch_sigmas(t, tuple(latents.shape[-2:]), options.token_patch, options.shift).to(device)
    s = sigmas.view(-1, 1, 1, 1)
    noisy = (1.0 - s) * latents + s * noise
    captions = list(batch["captions"])
    if proportion_empty_prompts:
        drop = torch.rand(bsz, generator=generator, device=device) < proportion_empty_prompts
        captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
    prompt_embeds, pooled = encode(captions)
    pred = family.predict(transformer, noisy.to(dtype), sigmas, prompt_embeds, pooled, options)
    return flow_matching_loss(pred, latents, noise, noisy, sigmas, options.weighting_scheme,
                              options.precondition_outputs)


def check_bucket_sizes(resolutions: Any, vae_scale_factor: int, patch_size: int) -> int:
    """Raise ``ValueError`` unless every bucket side is a multiple of ``vae_scale_factor * patch_size``.

    Returns:
        The needed multiple (16 for SD3 and Flux), for the startup report.
    """
    check_latent_sizes(np.asarray(resolutions), vae_scale_factor, patch_size)
    return vae_scale_factor * patch_size


def shift_report(options: FlowOptions, buckets: Any, vae_scale_factor: int) -> str:
    """The startup report's shift section: how training shifts, then each bucket's ``image_seq_len`` and ``mu``."""
    from ..shift import shift_table_text

    cfg = options.shift
    head = (f"Resolution shift: per bucket (mu from image_seq_len; {cfg.time_shift_type})" if options.by_resolution
            else f"Resolution shift: off, one static shift {cfg.shift:g} for every bucket "
                 "(--shift_by_resolution shifts each bucket as the pipeline does at its size)")
    return head + "\n" + shift_table_text(buckets, cfg, vae_scale_factor, options.token_patch)


def stock_pipeline(family: FlowFamily, options: FlowOptions, path: str, transformer: Any, *,
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
