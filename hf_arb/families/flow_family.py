"""The flow-matching families (SD3 / SD3.5, Flux.1) as the training script sees them: :class:`FlowFamily`.

Each subclass (:class:`~hf_arb.families.sd3.SD3Family`, :class:`~hf_arb.families.flux.FluxFamily`) says how to
load its checkpoint, encode prompts and call its transformer; this class answers the script's questions
(:class:`~hf_arb.families.base.Family`) for all of them, and the shared flow-matching step (noise, per-bucket
shift, loss) lives in :mod:`hf_arb.families.flow`. Nothing here imports torch at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_arb.checks import UsageError

from .base import FROZEN_PARTS, Family, Models
from .shift import ShiftConfig

if TYPE_CHECKING:  # annotations only: torch loads when a method runs
    import torch

#: flags of the UNet (epsilon / v-prediction) objective, and their "not given" values: refused for flow families
UNET_ONLY_FLAGS: dict[str, Any] = {
    "snr_gamma": None, "dream_training": False, "prediction_type": None, "input_perturbation": 0, "noise_offset": 0,
    "timestep_bias_strategy": "none", "resolution_conditioning": False, "use_ema": False}

#: ``--weighting_scheme`` values of diffusers' SD3 / Flux training scripts.
WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none")



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
        shift: the training :class:`~hf_arb.families.shift.ShiftConfig` (:func:`training_shift_config`).
        guidance_scale: the guidance input of guidance-distilled transformers (Flux.1-dev); ignored otherwise.
        max_sequence_length: T5 tokens per prompt.
        num_train_timesteps: the scheduler's training steps (the grid ``u`` is read on).
        token_patch: latent pixels per token side (:meth:`FlowFamily.token_patch`), for ``image_seq_len``.
        guidance_embeds: the transformer takes a guidance input (its config's ``guidance_embeds``).
        text_layers: Flux.2: the text encoder's hidden layers stacked into the prompt embeddings
            (``--text_encoder_out_layers``; ``None``: the family's default).
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
    text_layers: tuple[int, ...] | None = None

    @property
    def by_resolution(self) -> bool:
        """Whether sigmas are shifted per batch from its token count."""
        return self.shift.use_dynamic_shifting


class FlowFamily(Family):
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
    lora_text_encoder_count: int = 1
    default_weighting_scheme: str = "none"
    default_precondition_outputs: bool = False
    default_max_sequence_length: int = 512
    #: flow transformers run in bfloat16 on a GPU (their activations overflow float16)
    inference_dtype: str = "bfloat16"

    def pipeline_class(self, args: argparse.Namespace | None = None) -> Any:
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

    def guidance(self, options: FlowOptions, count: int, device: Any) -> torch.Tensor | None:
        """``guidance_scale`` for each image where the transformer is guidance-distilled (``guidance_embeds``:
        Flux.1-dev, Flux.2 [dev]), else None (SD3, Flux.1-schnell, klein: no guidance input)."""
        if not options.guidance_embeds:
            return None
        import torch

        return torch.full((count,), float(options.guidance_scale), device=device, dtype=torch.float32)

    def load(self, path: str, revision: str | None = None, variant: str | None = None,
             transformer_kw: Mapping[str, Any] | None = None) -> FlowParts:
        """Load scheduler, tokenizers, text encoders (:meth:`load_text_encoders`), VAE (:meth:`load_vae`) and
        transformer from a diffusers folder or Hub id; ``transformer_kw``: more ``from_pretrained`` keywords of the
        transformer (a quantization config)."""
        args = argparse.Namespace(pretrained_model_name_or_path=path, revision=revision, variant=variant)
        tokenizers, encoders, vae = self.load_frozen(args, FROZEN_PARTS)
        return FlowParts(self.load_scheduler(path, revision), tokenizers, encoders, vae,
                         self.load_transformer(path, revision, variant, transformer_kw))

    def load_scheduler(self, path: str, revision: str | None = None) -> Any:
        """The checkpoint's ``FlowMatchEulerDiscreteScheduler``."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", revision=revision)

    def load_transformer(self, path: str, revision: str | None = None, variant: str | None = None,
                         transformer_kw: Mapping[str, Any] | None = None) -> Any:
        """The checkpoint's transformer (:meth:`transformer_class`); ``transformer_kw``: more ``from_pretrained``
        keywords (a quantization config, :mod:`hf_arb.train.quantization`)."""
        return self.transformer_class().from_pretrained(path, subfolder="transformer", revision=revision,
                                                        variant=variant, **(transformer_kw or {}))

    def token_patch(self, transformer: Any) -> int:
        """Latent pixels per token side (SD3: the transformer's ``patch_size``; Flux: the 2×2 packing)."""
        raise NotImplementedError

    def encode_prompts(self, tokenizers: list[Any], text_encoders: list[Any], captions: list[str],
                       device: torch.device, max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Captions → ``(prompt_embeds (B, S, D), pooled_prompt_embeds (B, P))`` as the family's pipeline builds
        them."""
        raise NotImplementedError

    def predict(self, transformer: Any, noisy: torch.Tensor, sigmas: torch.Tensor, prompt_embeds: torch.Tensor,
                pooled: torch.Tensor, options: FlowOptions) -> torch.Tensor:
        """One transformer call on latents ``noisy (B, C, h, w)`` at ``sigmas (B,)``; returns ``(B, C, h, w)``."""
        raise NotImplementedError


    # ------------------------------------------------------------------ the training script's questions
    objective = "flow"
    denoiser_name = "transformer"
    denoiser_title = "transformer"
    full_defaults = (1024, 1, 4)  # SD3 / Flux take SDXL's (1024-pixel) defaults
    lora_defaults = (1024, 1, 4)
    refused_flags = UNET_ONLY_FLAGS
    refused_flags_for = "SD 1.x/2.x/SDXL UNets"
    refusal_note = " (SD3/Flux train with --weighting_scheme and --shift_by_resolution instead)."
    supports_packing = True
    card_license = "other"
    #: ``--vae_encode_mode``: the loss is :func:`hf_arb.families.flow.flow_loss` (SD3, Flux.1, Kontext)
    supports_vae_encode_mode = True

    @property
    def output_dirs(self) -> tuple[str, str]:  # type: ignore[override]
        return f"{self.name}-model-finetuned", f"{self.name}-model-finetuned-lora"

    @property
    def title(self) -> str:  # type: ignore[override]
        return self.name.upper()

    def check_flags(self, args: argparse.Namespace) -> None:
        if args.max_sequence_length is not None and args.max_sequence_length < 1:
            raise UsageError(f"--max_sequence_length must be >= 1, got {args.max_sequence_length}.")

    def load_models(self, args: argparse.Namespace, parts: frozenset[str] = FROZEN_PARTS,
                    transformer_kw: Mapping[str, Any] | None = None) -> Models:
        """The scheduler, the transformer (``transformer_kw``: more ``from_pretrained`` keywords, a quantization
        config) and the frozen ``parts`` (:meth:`~Family.load_frozen`), the run's :class:`FlowOptions`; everything
        but the transformer frozen."""
        path = args.pretrained_model_name_or_path
        parts = frozenset(parts) | self.loss_reads
        tokenizers, encoders, vae = self.load_frozen(args, parts)
        loaded = FlowParts(self.load_scheduler(path, args.revision), tokenizers, encoders, vae,
                           self.load_transformer(path, args.revision, args.variant, transformer_kw))
        options = self.options(loaded.scheduler.config, loaded.transformer, weighting_scheme=args.weighting_scheme,
                               logit_mean=args.logit_mean, logit_std=args.logit_std, mode_scale=args.mode_scale,
                               precondition_outputs=None if args.precondition_outputs is None
                               else bool(args.precondition_outputs), shift_by_resolution=args.shift_by_resolution,
                               guidance_scale=args.guidance_scale, max_sequence_length=args.max_sequence_length)
        if args.guidance_scale != 3.5 and not options.guidance_embeds:  # the flag was given: nothing would read it
            raise UsageError(
                f"--guidance_scale {args.guidance_scale}: {args.pretrained_model_name_or_path}'s transformer "
                "takes no guidance input (guidance_embeds is false: SD3, Flux.1-schnell), so the flag "
                "would be ignored. Drop --guidance_scale."
            )
        transformer = loaded.transformer
        transformer.train()
        if args.enable_xformers_memory_efficient_attention:
            transformer.enable_xformers_memory_efficient_attention()
        if args.enable_npu_flash_attention:
            transformer.enable_npu_flash_attention()
        if args.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        return Models(self, loaded.scheduler, loaded.tokenizers, loaded.text_encoders, loaded.vae, transformer,
                      options=options, unloaded=FROZEN_PARTS - parts)

    @staticmethod
    def vae_scale_factor(vae: Any) -> int:
        return 2 ** (len(vae.config.block_out_channels) - 1)

    def check_buckets(self, models: Models, buckets: Any) -> None:
        """Every bucket side must be a multiple of VAE factor x token patch (16), else a UsageError in flags."""
        from .flow import check_bucket_sizes

        factor = self.vae_scale_factor(models.vae)
        try:
            check_bucket_sizes(buckets.resolutions, factor, models.options.token_patch)
        except ValueError as err:
            raise UsageError(f"{err} For this {self.title} model: --bucket_step "
                             f"{factor * models.options.token_patch} (or a multiple of it).") from None

    def startup_lines(self, models: Models, buckets: Any) -> str:
        """Each bucket's image_seq_len and mu, and the shift training applies
        (:func:`~hf_arb.families.flow.shift_report`)."""
        from .flow import shift_report

        return shift_report(models.options, buckets, self.vae_scale_factor(models.vae))

    def encode_text(self, models: Models, encoders: list[Any], captions: list[str], device: Any) -> tuple[Any, Any]:
        return self.encode_prompts(models.tokenizers, encoders, captions, device, models.options.max_sequence_length)

    def training_loss(self, args: argparse.Namespace, models: Models, denoiser: Any, batch: dict[str, Any],
                      text: Any, generator: Any, dtype: Any) -> Any:
        """:func:`hf_arb.families.flow.flow_loss` with the batch's resolution shift."""
        from .flow import flow_loss

        return flow_loss(self, models.options, denoiser, batch, models.vae, text, generator, dtype,
                         args.proportion_empty_prompts, getattr(args, "vae_encode_mode", None))

    def lora_targets(self, args: argparse.Namespace) -> list[str]:
        """diffusers' dreambooth_lora_sd3/flux targets, or ``--lora_layers``; ``--lora_blocks``: those blocks only."""
        targets = (
            [m.strip() for m in args.lora_layers.split(",")] if args.lora_layers else list(self.lora_target_modules)
        )
        if args.lora_blocks is not None:  # train_dreambooth_lora_sd3.py: those modules of these blocks only
            targets = [f"transformer_blocks.{int(b)}.{m}" for b in args.lora_blocks.split(",") for m in targets]
        return targets

    def lora_text_encoders(self, models: Models) -> list[Any]:
        """SD3 its two CLIPs, Flux its CLIP (not T5), as diffusers' dreambooth LoRA scripts."""
        return list(models.text_encoders[:self.lora_text_encoder_count])

    def register_checkpoint_hooks(self, accelerator: Any, models: Models, unwrap: Any) -> None:
        from .flow import register_transformer_hooks

        register_transformer_hooks(accelerator, self.transformer_class(), unwrap=unwrap)

    def build_pipeline(self, args: argparse.Namespace, models: Models, denoiser: Any, dtype: Any, *,
                       final: bool = False) -> Any:
        """The stock pipeline around the trained transformer (:func:`hf_arb.families.flow.stock_pipeline`)."""
        import torch

        from .flow import stock_pipeline

        parts: dict[str, Any] = {}
        if not final:
            names = ("", "_2", "_3")
            parts.update(vae=models.vae, **{f"text_encoder{n}": te for n, te in zip(names, models.text_encoders)},
                         **{f"tokenizer{n}": tok for n, tok in zip(names, models.tokenizers)})
        elif args.pretrained_vae_model_name_or_path:
            parts["vae"] = models.vae.to(torch.float32)
        return stock_pipeline(self, models.options, args.pretrained_model_name_or_path, denoiser,
                              components=parts, revision=args.revision, variant=args.variant, dtype=dtype)

    def card_lines(self, args: argparse.Namespace) -> list[str]:
        if not getattr(args, "family_report", None):
            return []
        return ["Per-bucket resolution shift (`mu` from each bucket's latent token count, as the pipeline "
                "computes at inference):", "", "```", args.family_report, "```", ""]
