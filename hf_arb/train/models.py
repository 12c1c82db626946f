"""The models of a run, through the family adapter: loading, the optimizer, LoRA adapters and their checkpoint
hooks, and moving frozen parts to the device."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from hf_arb.families import Models, detect_family, get_family
from hf_arb.families.base import FROZEN_PARTS
from hf_arb.lazy import LazyModule

torch: Any = LazyModule("torch")  # loaded when a function needs it: --help and flag errors answer before torch
logger = logging.getLogger("train_text_to_image_arb")


def make_optimizer(args: argparse.Namespace, params: Any) -> torch.optim.Optimizer:
    """AdamW (or bitsandbytes' 8-bit AdamW), or Prodigy with --optimizer prodigy, over ``params``: the UNet's
    weights, or the LoRA parameters (with --train_text_encoder: parameter groups)."""
    if str(getattr(args, "optimizer", "AdamW")).lower() == "prodigy":
        return prodigy_optimizer(args, params)
    if args.use_8bit_adam:
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise ImportError("--use_8bit_adam needs bitsandbytes: `pip install bitsandbytes`.") from e
        cls: Any = bnb.optim.AdamW8bit
    else:
        cls = torch.optim.AdamW
    return cls(params, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
               weight_decay=args.adam_weight_decay, eps=args.adam_epsilon)


def prodigy_optimizer(args: argparse.Namespace, params: Any) -> torch.optim.Optimizer:
    """``--optimizer prodigy`` as diffusers' dreambooth LoRA scripts build it: ``prodigyopt.Prodigy`` with the Adam
    betas, epsilon and weight decay, ``--prodigy_beta3``, ``--prodigy_decouple``, ``--prodigy_use_bias_correction``
    and ``--prodigy_safeguard_warmup``; every parameter group (the text encoders' too) at ``--learning_rate``, as
    upstream. Its state (the step-size estimate ``d`` and its sums live in the parameter groups) is in
    ``state_dict()``, so accelerate's checkpoints resume it exactly."""
    try:
        import prodigyopt
    except ImportError:
        from hf_arb.checks import UsageError
        from hf_arb.train.flags.optimizer_flags import PRODIGY_INSTALL

        raise UsageError(f"--optimizer prodigy needs the prodigyopt package: {PRODIGY_INSTALL}.") from None
    if params and isinstance(params[0], dict):  # upstream: params_to_optimize[1]["lr"] = args.learning_rate
        params = [{**group, "lr": args.learning_rate} for group in params]
    return prodigyopt.Prodigy(params, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                              beta3=args.prodigy_beta3, weight_decay=args.adam_weight_decay, eps=args.adam_epsilon,
                              decouple=args.prodigy_decouple, use_bias_correction=args.prodigy_use_bias_correction,
                              safeguard_warmup=args.prodigy_safeguard_warmup)


def setup_lora(args: argparse.Namespace, models: Models, weight_dtype: torch.dtype) -> list[Any]:
    """Add LoRA adapters to the UNet (and, with --train_text_encoder, the text encoders of
    :meth:`~hf_arb.families.Family.lora_text_encoders`); frozen base weights go to the mixed-precision dtype, the
    adapters stay float32. Returns the trainable parameters (with --train_text_encoder: optimizer parameter groups, the
    encoders' with --text_encoder_lr / --adam_weight_decay_text_encoder where given)."""
    from hf_arb.train.lora import TEXT_ENCODER_TARGET_MODULES, add_lora

    kw = {"rank": args.rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout, "dtype": weight_dtype,
          "use_dora": args.use_dora}
    params = add_lora(models.unet, target_modules=models.family.lora_targets(args), **kw)
    if args.train_text_encoder:
        groups: list[Any] = [{"params": params}]  # the encoders' group: --learning_rate (scaled) unless told
        options = {k: v for k, v in (("lr", args.text_encoder_lr),
                                     ("weight_decay", args.adam_weight_decay_text_encoder)) if v is not None}
        for te in models.family.lora_text_encoders(models):
            groups.append({"params": add_lora(te, target_modules=TEXT_ENCODER_TARGET_MODULES, **kw), **options})
        return groups
    return params


def register_lora_checkpoint_hooks(accelerator: Any, models: Models, args: argparse.Namespace) -> None:
    """Checkpoints hold only the adapters, as ``pytorch_lora_weights.safetensors`` (loadable by diffusers too);
    accelerate saves the optimizer, scheduler, sampler and RNG next to it. The prepared models arrive in the order
    they were prepared: the UNet, then the trained text encoders."""
    from hf_arb.train.lora import load_lora, save_lora

    cls, denoiser = models.family.lora_file_class(args), models.family.denoiser_name

    def save_hook(hook_models: list[Any], weights: list[Any], output_dir: str) -> None:
        if accelerator.is_main_process:
            unwrapped = [unwrap(accelerator, m) for m in hook_models]
            save_lora(cls, output_dir, unwrapped[0], unwrapped[1:] or None, denoiser=denoiser)
        weights.clear()  # the frozen base weights are not part of the checkpoint

    def load_hook(hook_models: list[Any], input_dir: str) -> None:
        unwrapped = [unwrap(accelerator, m) for m in hook_models]
        hook_models.clear()
        load_lora(cls, input_dir, unwrapped[0], unwrapped[1:] or None, denoiser=denoiser)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def count_calls(obj: Any, name: str) -> list[int]:
    """Wrap ``obj.name`` to count its calls (the run statistics report how often the VAE encoder ran)."""
    counter = [0]
    original = getattr(obj, name)

    def wrapped(*a: Any, **kw: Any) -> Any:
        counter[0] += 1
        return original(*a, **kw)

    setattr(obj, name, wrapped)
    return counter


def complete_models(args: argparse.Namespace, models: Models, device: Any, weight_dtype: Any) -> None:
    """Load the frozen parts the run left unloaded (:meth:`hf_arb.families.Family.complete_models`: an encoded
    dataset's run loads no VAE or text encoder to train) and place them as :func:`main` places the loaded ones:
    validation and the saved pipeline need them. Nothing happens when every part is loaded."""
    family = models.family
    for module in family.complete_models(args, models):
        place(module, device, family.vae_dtype(args, weight_dtype) if module is models.vae else weight_dtype)


def weight_dtype_of(accelerator: Any) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)


def place(module: Any, device: Any = None, dtype: torch.dtype | None = None) -> Any:
    """``module.to(device)``, and ``.to(dtype)`` only when the dtype changes (diffusers warns on every dtype cast,
    even a no-op one)."""
    if device is not None:
        module.to(device)
    if dtype is not None and module.dtype != dtype:
        module.to(dtype=dtype)
    return module


def unwrap(accelerator: Any, model: Any) -> Any:
    """The trained denoiser behind a prepared model (through a --packing wrapper)."""
    from hf_arb.packing.loss import denoiser

    return denoiser(accelerator.unwrap_model(model))


def load_models(args: argparse.Namespace, parts: frozenset[str] = FROZEN_PARTS,
                weight_dtype: torch.dtype | None = None) -> Models:
    """The run's models, loaded by its family adapter (:meth:`hf_arb.families.Family.load_models`): the denoiser and
    the frozen ``parts`` the run's data needs (:meth:`hf_arb.train.sources.base.Source.frozen_parts`); the
    transformer quantized where the flags ask (:mod:`hf_arb.train.quantization`, ``weight_dtype``: the run's).

    A Hub id's family was guessed from its name when the flags were checked; here its configs are read (a few
    KB), and a family other than the guessed one warns, naming the defaults that were chosen for the guess.
    ``--bnb_quantization_config_path`` / ``--do_fp8_training``: the transformer is loaded quantized or converted to
    FP8 (:mod:`hf_arb.train.quantization`; ``weight_dtype``: the mixed-precision dtype, bitsandbytes' compute dtype).
    """
    found = args.family
    if not Path(args.pretrained_model_name_or_path).is_dir():
        try:
            from huggingface_hub import snapshot_download

            configs = snapshot_download(args.pretrained_model_name_or_path, revision=args.revision,
                                        allow_patterns=["model_index.json", "*/config.json"])
            found = detect_family(configs)
        except Exception as err:  # noqa: BLE001  (offline, gated...: loading below says what is wrong)
            logger.debug("Could not read the configs of %s (%s); keeping family %s.",
                         args.pretrained_model_name_or_path, err, args.family)
    if found != args.family and args.family_defaults:
        logger.warning("Defaults %s were chosen for %s, but the model is %s: pass these flags explicitly.",
                       ", ".join(f"--{k} {v}" for k, v in args.family_defaults.items()), args.family, found)
    from hf_arb.train.quantization import quantize_transformer, transformer_load_kwargs

    family = get_family(found)
    load_kw = transformer_load_kwargs(args, weight_dtype)  # the flow families only (checked with the flags)
    # a plugin family written before parts existed takes (args) only: asked so where every part loads
    if load_kw:
        models = family.load_models(args, parts, transformer_kw=load_kw)
    else:
        models = family.load_models(args) if parts == FROZEN_PARTS else family.load_models(args, parts)
    quantize_transformer(args, models.unet)
    return models


def batch_loss(args: argparse.Namespace, models: Models, denoiser: Any, batch: dict[str, Any], text: Any,
               generator: Any, dtype: Any) -> Any:
    """One micro-batch's loss: the family's (:meth:`~hf_arb.families.Family.training_loss`); a pack of images at
    their own sizes (``--packing``, a batch with ``grids``) takes the packed flow-matching step."""
    if "grids" in batch:
        from hf_arb.packing.family import packed_flow_step

        return packed_flow_step(models.family, models.options, denoiser, batch, models.vae, text, generator, dtype,
                                args.max_tokens, args.proportion_empty_prompts)
    return models.family.training_loss(args, models, denoiser, batch, text, generator, dtype)
