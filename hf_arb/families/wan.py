"""Wan 2.1 / 2.2 text-to-video (``WanPipeline``): loading, UMT5 prompts, the video VAE and the flow-matching loss on
clip latents, as one adapter.

What ``WanPipeline`` does, and the trainer follows:

- **prompts**: UMT5's last hidden states of each caption's tokens (``_get_t5_prompt_embeds``: the caption cleaned,
  tokenised to ``max_sequence_length``), zeros past the caption's own tokens, and *no* mask: the transformer
  cross-attends to all ``max_sequence_length`` rows, zeros included. :func:`encode_wan_prompts` calls the pipeline's
  own public ``encode_prompt`` (on a pipeline around the tokenizer and encoder only), so the embeddings are the
  pipeline's exactly; each caption's row is independent of the batch, which ``--cache_text_embeddings`` memoises.
  The default length is ``WanPipeline.__call__``'s, 512.
- **clips**: a batch's ``pixel_values`` are **(B, C, F, H, W)** in ``[-1, 1]`` — the layout ``AutoencoderKLWan``
  encodes and diffusers' ``VideoProcessor.preprocess_video`` returns — or ``(B, C, H, W)`` for stills, trained as
  1-frame clips (:func:`clip_pixels`). ``F`` follows the VAE's frame rule (``4k+1``: the first frame alone, then
  each group of ``scale_factor_temporal`` frames as one latent frame). The latents are ``(B, C, F', H', W')`` with
  ``F' = (F - 1) // 4 + 1``; cached ``latent_stats`` are ``(B, 2, C, F', H', W')`` for clips, ``(B, 2, C, H', W')``
  for stills (:class:`ClipVAE` encodes a still as one frame and drops the frame axis, so the image paths — latent
  cache, encoded datasets — see image latents).
- **VAE normalisation**: per channel, ``(z - latents_mean) / latents_std`` with the VAE config's lists — the inverse
  of the pipeline's ``latents / (1 / latents_std) + latents_mean`` before decoding.
- **timestep shift**: fixed. Wan's scheduler (``UniPCMultistepScheduler`` with flow sigmas; ``flow_shift`` 3.0 for
  the 480p checkpoints, 5.0 for 720p) shifts every size and length the same way, and the pipeline never passes a
  resolution ``mu``; training draws ``t`` on the scheduler's grid and shifts it with that ``flow_shift``
  (``shift * t / (1 + (shift - 1) t)``, the scheduler's formula). ``--shift_by_resolution`` is refused.
- **the transformer** (``WanTransformer3DModel``, patch ``(1, 2, 2)``) takes the 5-D latents, the timestep
  ``sigma * num_train_timesteps`` (per token with Wan 2.2 TI2V's ``expand_timesteps``) and the prompt embeddings; it
  predicts the velocity ``noise - x``.
- **sizes**: bucket sides are multiples of ``vae.config.scale_factor_spatial`` × the transformer's spatial patch (16
  for Wan 2.1; 32 for Wan 2.2 TI2V-5B), which ``WanPipeline.check_inputs`` and its patchification demand; frames
  follow :meth:`WanFamily.frame_rule`.

LoRA adapts every block's attention projections (self and cross: ``to_q``, ``to_k``, ``to_v``, ``to_out.0``) and
feed-forward (``ffn.net.0.proj``, ``ffn.net.2``): the modules of the original Wan LoRA formats that diffusers'
``WanLoraLoaderMixin`` converts, saved in diffusers' keys for ``WanPipeline.load_lora_weights``. The UMT5 encoder
stays frozen. Wan 2.2 A14B (two experts, ``transformer_2`` and ``boundary_ratio``) is refused before any weight loads.

Example:
    ```py
    >>> from hf_arb.families import get_family
    >>> family = get_family("wan")
    >>> parts = family.load("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    >>> embeds, _ = family.encode_prompts(parts.tokenizers, parts.text_encoders, ["a cat"], "cpu", 512)
    ```
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hf_arb.checks import UsageError
from hf_arb.lazy import LazyModule

from .base import FROZEN_PARTS, Models, builtin_family
from .flow_family import FlowOptions
from .sample_weights import SAMPLE_WEIGHTS
from .video_family import VideoFamily

torch: Any = LazyModule("torch")  # family detection must not import torch

__all__ = ["WAN_HUB_NAMES", "WAN_LORA_TARGET_MODULES", "ClipVAE", "WanFamily", "clip_pixels", "encode_wan_prompts",
           "normalize_latents", "wan_scheduler_shift"]

#: the transformer's attention (self and cross) and feed-forward linears, in every block
WAN_LORA_TARGET_MODULES: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
#: Hub names of Wan's text-to-video checkpoints (lower case): Wan 2.1 T2V, Wan 2.2 T2V and TI2V
WAN_HUB_NAMES: tuple[str, ...] = ("wan2.1-t2v", "wan2.2-t2v", "wan2.2-ti2v")


def clip_pixels(pixels: Any) -> Any:
    """A batch's pixels as clips ``(B, C, F, H, W)``: 5-D passes through, a batch of stills ``(B, C, H, W)`` becomes
    1-frame clips ``(B, C, 1, H, W)``.

    Raises:
        ValueError: any other number of dimensions, or a clip whose axis 2 holds the 3 channels ((B, F, C, H, W)),
            naming the layouts taken.
    """
    if pixels.ndim == 4:
        return pixels.unsqueeze(2)
    if pixels.ndim == 5 and not (pixels.shape[1] != 3 and pixels.shape[2] == 3):
        return pixels
    raise ValueError(f"pixel_values of shape {tuple(pixels.shape)}: Wan takes clips (B, C, F, H, W) with C = 3 "
                     "channels (not (B, F, C, H, W): permute(0, 2, 1, 3, 4) first) or stills (B, C, H, W).")


class ClipVAE:
    """``AutoencoderKLWan`` that also takes stills: ``encode`` of clips ``(B, C, F, H, W)`` gives latents
    ``(B, z, F', h, w)``; of stills ``(B, C, H, W)``, each encoded as a 1-frame clip, image latents ``(B, z, h, w)``
    (the frame axis dropped), so the image paths (latent cache, encoded datasets) work unchanged.

    Everything else (``config``, ``dtype``, ``device``, ``decode``…) is the wrapped VAE's; ``to`` moves the wrapped
    VAE and returns the wrapper. ``vae`` is the diffusers model, for pipelines.
    """

    def __init__(self, vae: Any) -> None:
        self.vae = vae

    def encode(self, pixels: Any) -> SimpleNamespace:
        dist = self.vae.encode(clip_pixels(pixels)).latent_dist
        mean, std = (dist.mean[:, :, 0], dist.std[:, :, 0]) if pixels.ndim == 4 else (dist.mean, dist.std)
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=mean, std=std))

    def to(self, *args: Any, **kwargs: Any) -> ClipVAE:
        self.vae.to(*args, **kwargs)
        return self

    def __getattr__(self, name: str) -> Any:
        if name == "vae":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.vae, name)


def inner_vae(vae: Any) -> Any:
    """The diffusers VAE behind a :class:`ClipVAE` (or ``vae`` itself)."""
    return vae.vae if isinstance(vae, ClipVAE) else vae


def wan_scheduler_shift(scheduler_config: Mapping[str, Any]) -> dict[str, Any]:
    """The shift Wan's scheduler applies, as a flow-matching scheduler config (:class:`~hf_arb.families.shift.
    ShiftConfig`'s names): ``shift`` = its ``flow_shift`` (``UniPCMultistepScheduler``, Wan's own) or its ``shift``
    (``FlowMatchEulerDiscreteScheduler``), never dynamic (``WanPipeline`` passes no ``mu``), and its
    ``num_train_timesteps``."""
    shift = scheduler_config.get("flow_shift", scheduler_config.get("shift", 1.0))
    return {"shift": float(shift if shift is not None else 1.0), "use_dynamic_shifting": False,
            "num_train_timesteps": int(scheduler_config.get("num_train_timesteps", 1000))}


def encode_wan_prompts(tokenizer: Any, text_encoder: Any, captions: list[str], device: Any,
                       max_sequence_length: int) -> Any:
    """``WanPipeline.encode_prompt``'s prompt embeddings ``(B, max_sequence_length, D)`` (zeros past each caption's
    tokens), through a pipeline that holds only ``tokenizer`` and ``text_encoder``."""
    from diffusers import WanPipeline

    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=None, scheduler=None)
    embeds, _ = pipe.encode_prompt(list(captions), do_classifier_free_guidance=False,
                                   max_sequence_length=max_sequence_length, device=device)
    return embeds


def normalize_latents(latents: Any, vae_config: Mapping[str, Any]) -> Any:
    """``(z - latents_mean) / latents_std`` per channel of ``(B, C, F', h, w)`` latents: the inverse of what
    ``WanPipeline`` undoes before decoding."""
    view = (1, len(vae_config["latents_mean"]), 1, 1, 1)
    mean = torch.tensor(vae_config["latents_mean"], device=latents.device, dtype=torch.float32).view(view)
    std = torch.tensor(vae_config["latents_std"], device=latents.device, dtype=torch.float32).view(view)
    return (latents - mean) / std


def read_pipeline_config(path: str, revision: str | None = None) -> dict[str, Any]:
    """The folder's (or Hub id's) ``model_index.json`` as a dict (``{}`` where there is none: a bare transformer)."""
    local = Path(path) / "model_index.json"
    if Path(path).is_dir():
        return json.loads(local.read_text()) if local.is_file() else {}
    from diffusers import WanPipeline

    return dict(WanPipeline.load_config(path, revision=revision))


@builtin_family
class WanFamily(VideoFamily):
    """Wan 2.1 / 2.2 text-to-video (``WanPipeline``, ``WanTransformer3DModel``, ``AutoencoderKLWan``, UMT5)."""

    name = "wan"
    #: the text-to-video pipeline only: not ``WanImageToVideoPipeline``, ``WanVACEPipeline``, ``WanAnimatePipeline``
    class_prefixes = ("WanPipeline", "WanTransformer3DModel")
    hub_name_hints = WAN_HUB_NAMES
    card_tags = ("wan", "wan-diffusers", "text-to-video")
    pipeline_class_name = "WanPipeline"
    transformer_class_name = "WanTransformer3DModel"
    lora_target_modules = WAN_LORA_TARGET_MODULES
    lora_text_encoder_count = 0
    default_weighting_scheme = "none"
    default_precondition_outputs = False
    default_max_sequence_length = 512  # WanPipeline.__call__'s default
    supports_packing = False  # --packing's block-diagonal step is written for SD3 / Flux's transformers
    supports_vae_encode_mode = False  # its own loss (not flow_loss): --vae_encode_mode is refused
    frame_rule_name = "wan"
    video_fps = 16  # Wan's frame rate (its model cards' export_to_video): the validation MP4s and the card's code
    # WanPipeline's default height (480 x 832 at 81 frames); one validation video per shape
    full_defaults = (480, 1, 1)
    lora_defaults = (480, 1, 1)

    @property
    def title(self) -> str:  # type: ignore[override]
        return "Wan"

    def check_flags(self, args: argparse.Namespace) -> None:
        super().check_flags(args)
        if getattr(args, "train_text_encoder", False):
            raise UsageError("--train_text_encoder: Wan trains the transformer only (its UMT5 encoder stays frozen): "
                             "drop it.")
        if getattr(args, "pretrained_vae_model_name_or_path", None):
            raise UsageError("--pretrained_vae_model_name_or_path replaces an AutoencoderKL; Wan's VAE is its own "
                             "video VAE (AutoencoderKLWan): drop the flag.")
        if getattr(args, "with_prior_preservation", False):
            raise UsageError("--with_prior_preservation: generating class images with WanPipeline (it returns "
                             "frames, not images) is not supported yet: drop it.")
        if getattr(args, "shift_by_resolution", None):
            raise UsageError("--shift_by_resolution: WanPipeline samples every size and length with its scheduler's "
                             "fixed flow_shift, which training uses too; a per-bucket shift would train noise levels "
                             "inference never uses. Drop it.")

    # ------------------------------------------------------------------------------------------ loading
    vae_class_name = "AutoencoderKLWan"

    def load_scheduler(self, path: str, revision: str | None = None) -> Any:
        """The folder's scheduler class (``UniPCMultistepScheduler`` for Wan's checkpoints): any scheduler class
        reads ``scheduler_config.json``, whose ``_class_name`` says which one the folder holds."""
        import diffusers

        config = diffusers.FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler", revision=revision)
        return getattr(diffusers, config["_class_name"]).from_pretrained(path, subfolder="scheduler",
                                                                         revision=revision)

    def load_text_encoders(self, path: str, revision: str | None, variant: str | None) -> tuple[list[Any], list[Any]]:
        """The UMT5 tokenizer and encoder."""
        from transformers import AutoTokenizer, UMT5EncoderModel

        return ([AutoTokenizer.from_pretrained(path, subfolder="tokenizer", revision=revision)],
                [UMT5EncoderModel.from_pretrained(path, subfolder="text_encoder", variant=variant, revision=revision)])

    def load_vae(self, args: argparse.Namespace) -> Any:
        """The checkpoint's ``AutoencoderKLWan``, as :class:`ClipVAE` (clips and stills through one encode)."""
        return ClipVAE(super().load_vae(args))

    def load_models(self, args: argparse.Namespace, parts: frozenset[str] = FROZEN_PARTS,
                    transformer_kw: Mapping[str, Any] | None = None) -> Models:
        """Refuse a two-expert checkpoint (Wan 2.2 A14B) before any weight loads, then :meth:`FlowFamily.load_models`;
        ``models.extra["expand_timesteps"]``: the pipeline's per-token timesteps (Wan 2.2 TI2V)."""
        config = read_pipeline_config(args.pretrained_model_name_or_path, args.revision)
        second = config.get("transformer_2") or [None, None]
        if second[0] is not None or config.get("boundary_ratio") is not None:
            raise UsageError(
                f"{args.pretrained_model_name_or_path} has two experts (transformer and transformer_2, boundary_ratio "
                f"{config.get('boundary_ratio')}): training one expert on its noise range is not supported yet. Use "
                "a single-transformer Wan checkpoint (Wan 2.1 T2V, Wan 2.2 TI2V-5B).")
        models = super().load_models(args, parts, transformer_kw)
        models.extra["expand_timesteps"] = bool(config.get("expand_timesteps", False))
        return models

    def options(self, scheduler_config: Mapping[str, Any], transformer: Any, **kwargs: Any) -> FlowOptions:
        """:meth:`FlowFamily.options` with the scheduler's fixed shift (:func:`wan_scheduler_shift`)."""
        return super().options(wan_scheduler_shift(scheduler_config), transformer, **kwargs)

    @staticmethod
    def vae_scale_factor(vae: Any) -> int:
        """``vae.config.scale_factor_spatial`` (8; 16 for Wan 2.2's VAE): ``WanPipeline.vae_scale_factor_spatial``."""
        return int(vae.config.scale_factor_spatial)

    def token_patch(self, transformer: Any) -> int:
        """The transformer's spatial patch (``patch_size`` ``(1, 2, 2)``: 2)."""
        _, ph, pw = transformer.config.patch_size
        if ph != pw:
            raise ValueError(f"Wan transformer patch {tuple(transformer.config.patch_size)}: the bucket check assumes "
                             "a square spatial patch.")
        return int(ph)

    def spatial_multiple(self, models: Models) -> int:
        """What every bucket side must be a multiple of: ``vae_scale_factor_spatial`` × the spatial patch (16 for Wan
        2.1), as ``WanPipeline`` patchifies (``check_inputs`` itself demands 16)."""
        return self.vae_scale_factor(models.vae) * self.token_patch(models.unet)

    def frame_rule(self, models: Models | None = None) -> Any:
        """``4k+1`` frames: :data:`~hf_arb.video.frames.FRAME_RULES` ``["wan"]``, its step read from the loaded VAE's
        ``scale_factor_temporal`` where ``models`` is given (``WanPipeline.vae_scale_factor_temporal``)."""
        from hf_arb.video.frames import FrameRule, frame_rule

        rule = frame_rule(self.frame_rule_name)
        if models is None:
            return rule
        return FrameRule(rule.name, int(models.vae.config.scale_factor_temporal), rule.pipelines)

    def latent_patch(self, args: argparse.Namespace) -> tuple[int, int, int]:
        """``(scale_factor_spatial x patch, scale_factor_temporal, patch_t)`` from the checkpoint's VAE and
        transformer configs (16, 4, 1 for Wan 2.1), as the pipeline patchifies; no weight loads."""
        import diffusers

        path, rev = args.pretrained_model_name_or_path, args.revision
        vae = diffusers.AutoencoderKLWan.load_config(path, subfolder="vae", revision=rev)
        patch_t, ph, pw = diffusers.WanTransformer3DModel.load_config(path, subfolder="transformer",
                                                                      revision=rev)["patch_size"]
        return int(vae["scale_factor_spatial"]) * int(ph), int(vae["scale_factor_temporal"]), int(patch_t)

    def startup_lines(self, models: Models, buckets: Any) -> str:
        rule = self.frame_rule(models)
        return (f"Timestep shift: fixed flow_shift {models.options.shift.shift:g} from the scheduler, every bucket "
                f"(WanPipeline samples every size and length with it); clips of {rule.step}k+1 frames (stills are "
                f"1-frame clips), sides multiples of {self.spatial_multiple(models)}")

    # ------------------------------------------------------------------------------------------ training
    def encode_prompts(self, tokenizers: list[Any], text_encoders: list[Any], captions: list[str],
                       device: Any, max_sequence_length: int) -> tuple[Any, Any]:
        """See :func:`encode_wan_prompts`: ``(embeds (B, L, D), None)`` (the pipeline passes no mask)."""
        return encode_wan_prompts(tokenizers[0], text_encoders[0], captions, device, max_sequence_length), None

    def sigmas(self, options: FlowOptions, t: Any) -> Any:
        """Training sigmas of unshifted times ``t`` in ``(0, 1]``: the scheduler's fixed shift, ``shift * t / (1 +
        (shift - 1) t)``, whatever the bucket's size and frames (as ``UniPCMultistepScheduler.set_timesteps`` shifts
        flow sigmas)."""
        from .shift import shift_sigmas

        return shift_sigmas(t, 0.0, options.shift)

    def predict(self, transformer: Any, noisy: Any, sigmas: Any, prompt_embeds: Any, pooled: Any,
                options: FlowOptions, expand_timesteps: bool = False) -> Any:
        """The velocity ``(B, C, F', h, w)`` at ``sigmas (B,)``: the transformer at timestep ``sigma *
        num_train_timesteps`` (the scheduler's), one per token where the pipeline ``expand_timesteps`` (Wan 2.2
        TI2V: ``F' (h/2) (w/2)`` tokens); ``pooled`` is unused (None)."""
        t = sigmas.to(noisy.device, torch.float32) * options.num_train_timesteps
        if expand_timesteps:  # WanPipeline: (mask[0][0][:, ::2, ::2] * t).flatten() per sample
            f, h, w = noisy.shape[2:]
            t = t[:, None].expand(-1, f * ((h + 1) // 2) * ((w + 1) // 2))
        return transformer(hidden_states=noisy, timestep=t, encoder_hidden_states=prompt_embeds.to(noisy.dtype),
                           return_dict=False)[0]

    def training_loss(self, args: argparse.Namespace, models: Models, denoiser: Any, batch: dict[str, Any],
                      text: Any, generator: Any, dtype: Any) -> Any:
        """Flow matching on normalised clip latents ``(B, C, F', h, w)`` (:func:`normalize_latents`) with the
        scheduler's fixed shift; stills train as 1-frame clips. Draws, in order: posterior sample, noise, ``u``,
        prompt dropout."""
        from .flow import batch_device, draw, drop_captions, flow_matching_loss, noise_latents, posterior
        from .loss_mask import batch_loss_mask

        options, device = models.options, batch_device(batch)
        mean, std = posterior(batch, models.vae, device)
        if mean.ndim == 4:  # stills (encoded or cached as image latents): 1-frame clips
            mean, std = mean.unsqueeze(2), std.unsqueeze(2)
        latents = normalize_latents(mean + std * draw("randn", mean.shape, generator, device), models.vae.config)
        noise, sigmas, noisy = noise_latents(latents, options, generator,
                                             sigmas_of=lambda t, _: self.sigmas(options, t))
        captions = drop_captions(batch["captions"], args.proportion_empty_prompts, generator)
        embeds, _ = text(captions)
        pred = self.predict(denoiser, noisy.to(dtype), sigmas, embeds, None, options,
                            models.extra.get("expand_timesteps", False))
        mask = batch_loss_mask(batch, device)
        if mask is not None and mask.ndim == 4:  # a still's (B, 1, h, w) mask on its one latent frame
            mask = mask.unsqueeze(2)
        return flow_matching_loss(pred, latents, noise, noisy, sigmas, options.weighting_scheme,
                                  options.precondition_outputs, batch.get(SAMPLE_WEIGHTS), mask=mask)

    def lora_targets(self, args: argparse.Namespace) -> list[str]:
        """:data:`WAN_LORA_TARGET_MODULES`, or ``--lora_layers``; ``--lora_blocks``: those of these blocks only
        (Wan's blocks are ``blocks.<i>``)."""
        targets = ([m.strip() for m in args.lora_layers.split(",")] if args.lora_layers
                   else list(self.lora_target_modules))
        if args.lora_blocks is not None:
            targets = [f"blocks.{int(b)}.{m}" for b in args.lora_blocks.split(",") for m in targets]
        return targets

    # ------------------------------------------------------------------------------------------ outputs
    def build_pipeline(self, args: argparse.Namespace, models: Models, denoiser: Any, dtype: Any, *,
                       final: bool = False) -> Any:
        """The stock ``WanPipeline`` around the trained transformer (validation reuses the loaded parts)."""
        from .flow import stock_pipeline

        parts: dict[str, Any] = {}
        if not final:
            parts = {"vae": inner_vae(models.vae), "text_encoder": models.text_encoders[0],
                     "tokenizer": models.tokenizers[0]}
        return stock_pipeline(self, models.options, args.pretrained_model_name_or_path, denoiser,
                              components=parts, revision=args.revision, variant=args.variant, dtype=dtype)

    def card_lines(self, args: argparse.Namespace) -> list[str]:
        lines = ["Wan trains on clips of 4k+1 frames (stills as 1-frame clips) with its scheduler's fixed "
                 "`flow_shift`, as `WanPipeline` samples every size and length.", ""]
        if getattr(args, "family_report", None):
            lines += ["```", args.family_report, "```", ""]
        return lines
