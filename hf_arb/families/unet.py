"""The UNet families (SD 1.x/2.x and SDXL) as the training script sees them: :class:`UNetFamily`.

What the two share lives here: loading (a DDPM scheduler, CLIP encoders, the VAE, the UNet and its EMA copy), the
objective of diffusers' text-to-image scripts (:mod:`hf_arb.families.unet_loss`), the checkpoint hooks (``unet/``
and ``unet_ema/``) and the pipeline around the trained UNet. :class:`~hf_arb.families.sd.SDFamily` and
:class:`~hf_arb.families.sdxl.SDXLFamily` say what differs: the text encoders, the UNet's conditioning and the
pipeline class. Nothing here imports torch at import time.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from hf_arb.checks import UsageError

from .base import FROZEN_PARTS, Family, Models, read_class_name

#: flags of the flow-matching (SD3 / Flux) objective, and their defaults: refused for UNet families
FLOW_ONLY_FLAGS: dict[str, Any] = {
    "weighting_scheme": None, "logit_mean": 0.0, "logit_std": 1.0, "mode_scale": 1.29, "precondition_outputs": None,
    "guidance_scale": 3.5, "max_sequence_length": None, "shift_by_resolution": None, "lora_layers": None,
    "lora_blocks": None}
#: the attention projections diffusers' text-to-image LoRA scripts adapt in the UNet
UNET_TARGET_MODULES: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")


class UNetFamily(Family):
    """SD 1.x/2.x and SDXL: a UNet trained with epsilon or v-prediction, as diffusers' text-to-image scripts."""

    objective = "noise"
    denoiser_name = "unet"
    refused_flags = FLOW_ONLY_FLAGS
    refused_flags_for = "SD3 / Flux (flow matching)"
    refusal_note = "."
    card_license = "creativeml-openrail-m"
    #: ``addition_embed_type == "text_time"`` in ``unet/config.json`` (SDXL's micro-conditioning)
    text_time: bool = False

    @classmethod
    def detect(cls, path: str) -> bool:
        """A local folder by its ``unet/config.json`` (SDXL: ``addition_embed_type == "text_time"``), with a
        flow-matching or unknown pipeline class ruled out; a Hub id by its name (``xl``)."""
        from pathlib import Path

        root = Path(path)
        config = root / "unet" / "config.json"
        if config.is_file():
            import json

            try:
                text_time = json.loads(config.read_text()).get("addition_embed_type") == "text_time"
            except (OSError, ValueError) as e:
                raise UsageError(f"--pretrained_model_name_or_path {path}: cannot read {config} ({e}).") from None
            return text_time == cls.text_time
        if root.is_dir() and read_class_name(root / "model_index.json"):
            return False
        return any(hint in root.name.lower() for hint in cls.hub_name_hints) == bool(cls.hub_name_hints)

    @property
    def title(self) -> str:  # type: ignore[override]
        return self.name.upper()

    def checkpoint_dirs(self, args: argparse.Namespace) -> tuple[str, ...]:
        return ("unet", "unet_ema") if args.use_ema else ("unet",)

    # ------------------------------------------------------------------------------------------ models
    def adapt_unet(self, args: argparse.Namespace, unet: Any) -> Any:
        """The UNet the run trains, from the pretrained one (SD: ``--resolution_conditioning`` adds an embedding)."""
        return unet

    def load_models(self, args: argparse.Namespace, parts: frozenset[str] = FROZEN_PARTS) -> Models:
        """Scheduler, UNet (+ its EMA copy) and the frozen ``parts`` (:meth:`~Family.load_frozen`: tokenizer(s),
        text encoder(s), VAE); all but the UNet frozen."""
        from diffusers import DDPMScheduler, UNet2DConditionModel

        path, rev, var = args.pretrained_model_name_or_path, args.revision, args.variant
        unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", revision=args.non_ema_revision, variant=var)
        noise_scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler")
        if args.prediction_type is not None:
            noise_scheduler.register_to_config(prediction_type=args.prediction_type)
        parts = frozenset(parts) | self.loss_reads
        tokenizers, text_encoders, vae = self.load_frozen(args, parts)
        unet = self.adapt_unet(args, unet)
        unet.train()
        models = Models(self, noise_scheduler, tokenizers, text_encoders, vae, unet, unloaded=FROZEN_PARTS - parts)
        if args.use_ema:
            from diffusers.training_utils import EMAModel

            ema_src = self.adapt_unet(args, UNet2DConditionModel.from_pretrained(path, subfolder="unet", revision=rev,
                                                                                 variant=var))
            models.ema_unet = EMAModel(ema_src.parameters(), model_cls=UNet2DConditionModel,
                                       model_config=ema_src.config, foreach=args.foreach_ema)
        if args.enable_xformers_memory_efficient_attention:
            from diffusers.utils.import_utils import is_xformers_available

            if not is_xformers_available():
                raise UsageError("xformers is not available. Install it or drop "
                                 "--enable_xformers_memory_efficient_attention.")
            unet.enable_xformers_memory_efficient_attention()
        if args.enable_npu_flash_attention:
            unet.enable_npu_flash_attention()
        if args.gradient_checkpointing:
            unet.enable_gradient_checkpointing()
        return models

    # ------------------------------------------------------------------------------------------ training
    def forward(self, models: Models, unet: Any, noisy: Any, timesteps: Any, hidden: Any, pooled: Any,
                time_ids: Any) -> Any:
        """One UNet call with the family's conditioning (SD: none; SDXL: time ids and the pooled embedding)."""
        return unet(noisy, timesteps, hidden).sample

    def training_loss(self, args: argparse.Namespace, models: Models, denoiser: Any, batch: dict[str, Any],
                      text: Any, generator: Any, dtype: Any) -> Any:
        """:func:`hf_arb.families.unet_loss.unet_loss` with this family's UNet call."""
        from .unet_loss import unet_loss

        def forward(noisy: Any, timesteps: Any, hidden: Any, pooled: Any, time_ids: Any) -> Any:
            return self.forward(models, denoiser, noisy, timesteps, hidden, pooled, time_ids)

        return unet_loss(args, models.noise_scheduler, models.vae, batch, text, generator, dtype, forward)

    def lora_targets(self, args: argparse.Namespace) -> list[str]:
        return list(UNET_TARGET_MODULES)

    # ------------------------------------------------------------------------------------------ outputs
    def register_checkpoint_hooks(self, accelerator: Any, models: Models, unwrap: Any) -> None:
        """``unet/`` (and ``unet_ema/`` with ``--use_ema``) in diffusers format inside each checkpoint."""
        from diffusers import UNet2DConditionModel

        def save_hook(hook_models: list[Any], weights: list[Any], output_dir: str) -> None:
            if accelerator.is_main_process:
                if models.ema_unet is not None:
                    models.ema_unet.save_pretrained(os.path.join(output_dir, "unet_ema"))
                for model in hook_models:
                    model.save_pretrained(os.path.join(output_dir, "unet"))
                    weights.pop()

        def load_hook(hook_models: list[Any], input_dir: str) -> None:
            if models.ema_unet is not None:
                from diffusers.training_utils import EMAModel

                loaded = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DConditionModel)
                models.ema_unet.load_state_dict(loaded.state_dict())
                models.ema_unet.to(accelerator.device)
            while hook_models:
                model = hook_models.pop()
                loaded = UNet2DConditionModel.from_pretrained(input_dir, subfolder="unet")
                model.register_to_config(**loaded.config)
                model.load_state_dict(loaded.state_dict())

        accelerator.register_save_state_pre_hook(save_hook)
        accelerator.register_load_state_pre_hook(load_hook)

    def validation_parts(self, models: Models) -> dict[str, Any]:
        """The loaded (frozen) components a validation pipeline reuses."""
        return {"vae": models.vae, "text_encoder": models.text_encoders[0], "tokenizer": models.tokenizers[0]}

    def build_pipeline(self, args: argparse.Namespace, models: Models, denoiser: Any, dtype: Any, *,
                       final: bool = False) -> Any:
        """Validation reuses the loaded parts (no safety checker, as diffusers' script); the ``final`` pipeline
        loads them fresh in float32 (keeping the base model's safety checker), plus the replacement VAE."""
        import torch

        parts: dict[str, Any] = {"unet": denoiser}
        if not final:
            parts.update(self.validation_parts(models))
        elif args.pretrained_vae_model_name_or_path:
            parts["vae"] = models.vae.to(torch.float32)
        return self.pipeline_class(args).from_pretrained(args.pretrained_model_name_or_path, revision=args.revision,
                                                         variant=args.variant, dtype=dtype, **parts)

    def save_pipeline(self, args: argparse.Namespace, pipe: Any, output_dir: str) -> None:
        """The pipeline, sampling with the objective the UNet was trained on (``--prediction_type``)."""
        if args.prediction_type is not None:
            pipe.scheduler.register_to_config(prediction_type=args.prediction_type)
        pipe.save_pretrained(output_dir)
