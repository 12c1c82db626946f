"""The flags of diffusers' other dreambooth scripts (issue 35): ``train_dreambooth.py`` / ``_lora.py`` (SD),
``train_dreambooth_lora_flux2{,_klein}{,_img2img}.py``, ``_flux_kontext.py``, ``_qwen_image.py`` and ``_z_image.py``.

Each flag is one of three things (docs/training.md, "Every flag, every mode", has a row for each):

- **accepted with upstream's meaning**: ``--text_encoder_out_layers`` (Flux.2: the text encoder's hidden layers
  stacked into the prompt embeddings), ``--caption_dropout`` (= ``--proportion_empty_prompts``),
  ``--cond_image_column`` (= ``--reference_image_column``: the edit pair's conditioning image), ``--offset_noise``
  (= ``--noise_offset 0.1``), ``--pre_compute_text_embeddings`` (= ``--cache_text_embeddings``), ``--offload``,
  ``--skip_final_inference``, ``--final_validation_prompt``, ``--validation_steps``, ``--validation_scheduler``,
  ``--vae_encode_mode`` (SD3 / Flux.1 / Kontext / Z-Image);
- **accepted because it changes nothing here**: ``--use_aspect_ratio_buckets`` (every run buckets),
  ``--set_grads_to_none`` (the optimizer always sets gradients to ``None``);
- **refused in one line** saying why and what to do, unless given at upstream's default (:data:`REFUSED`).

``--do_fp8_training`` and ``--bnb_quantization_config_path`` (upstream's quantized training) have their own checks:
:mod:`hf_arb.train.flags.quant_flags`. Parse-level: nothing here imports torch unless one of those is given.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from hf_arb.checks import UsageError

from .quant_flags import check_quantization_flags

__all__ = ["FLUX2_FAMILIES", "REFUSED", "VALIDATION_SCHEDULERS", "add_upstream_flags", "check_upstream_flags",
           "final_validation_args", "offload_frozen", "pipeline_call_kwargs", "resolve_upstream_aliases",
           "restore_frozen", "use_validation_scheduler", "validation_due"]

#: the families whose text encoder stacks hidden layers (``--text_encoder_out_layers``)
FLUX2_FAMILIES = ("flux2", "flux2_klein")
#: train_dreambooth.py's ``--validation_scheduler`` choices
VALIDATION_SCHEDULERS = ("DPMSolverMultistepScheduler", "DDPMScheduler")
#: ``--offset_noise``: train_dreambooth.py adds ``0.1 * randn(B, C, 1, 1)``, which is ``--noise_offset 0.1``
OFFSET_NOISE = 0.1

#: the Qwen-Image script's default of its unused HiDream flags
LLAMA = "meta-llama/Meta-Llama-3.1-8B-Instruct"
#: flag → (upstream's default, why it is refused and what to do). A flag unset or at upstream's default changes
#: nothing: accepted.
REFUSED: dict[str, tuple[Any, str]] = {
    "remote_text_encoder": (False, "it computes the prompt embeddings on the Hugging Face Inference API, and this "
                                   "script runs offline with the model's own text encoder. Drop it (add "
                                   "--cache_text_embeddings to encode each caption once)"),
    "fsdp_text_encoder": (False, "the frozen text encoder is not sharded here (FSDP, if configured in accelerate, "
                                 "wraps the trained model). Drop it; --cache_text_embeddings encodes each caption "
                                 "once"),
    "validation_image": (None, "validation here generates from the prompt at bucket shapes, without a reference "
                               "image. Drop it (the trained LoRA loads in the stock edit pipeline, which takes "
                               "image=)"),
    "validation_images": (None, "they are the img2img / upscaler pipelines' validation inputs (DeepFloyd IF); "
                                "validation here is text-to-image. Drop it"),
    "class_labels_conditioning": (None, "it feeds the timesteps as class labels to DeepFloyd IF's upscaler UNet, a "
                                        "model family this script does not train. Drop it"),
    "text_encoder_use_attention_mask": (False, "it masks the T5 encoder of DeepFloyd IF; SD's CLIP encoder is "
                                               "trained without a mask, as the pipelines encode. Drop it"),
    "tokenizer_max_length": (None, "it sets DeepFloyd IF's T5 prompt length; SD's CLIP takes the tokenizer's "
                                   "model_max_length (77), as the pipelines do. Drop it"),
    "tokenizer_name": (None, "the tokenizer is loaded from the model folder (its tokenizer/ subfolder), so the "
                             "pipeline saved with the model encodes as training did. Drop it, or copy that "
                             "tokenizer into <model>/tokenizer"),
    "skip_save_text_encoder": (False, "it drops a fully fine-tuned text encoder from the output; text encoders are "
                                      "never fully fine-tuned here, and the saved pipeline keeps the base encoder so "
                                      "that it loads as one folder. Drop it"),
    "pretrained_text_encoder_4_name_or_path": (LLAMA, "it is HiDream's fourth text encoder; Qwen-Image has one, and "
                                                      "upstream's Qwen-Image script never reads the flag. Drop it"),
    "pretrained_tokenizer_4_name_or_path": (LLAMA, "it is HiDream's fourth tokenizer; Qwen-Image has one, and "
                                                   "upstream's Qwen-Image script never reads the flag. Drop it"),
}


def add_upstream_flags(a: Callable[..., Any]) -> None:
    """Add the flags to the parser (``a`` is its ``add_argument``)."""
    a("--text_encoder_out_layers", type=int, nargs="+", default=None, metavar="LAYER",
      help="Flux.2: the text encoder's hidden layers stacked into the prompt embeddings (default: the pipeline's, "
           "dev 10 20 30 | klein 9 18 27). Validation and the model card pass the same layers to the pipeline.")
    a("--caption_dropout", type=float, default=0.0,
      help="Probability of training a caption as the empty prompt (train_dreambooth_lora_flux2_klein / qwen_image's "
           "name for --proportion_empty_prompts).")
    a("--cond_image_column", type=str, default=None,
      help="Edit mode (Kontext, Flux.2 img2img scripts): the conditioning image column; the same as "
           "--reference_image_column COLUMN.")
    a("--vae_encode_mode", type=str, default=None, choices=["sample", "mode"],
      help="SD3 / Flux.1 / Kontext / Z-Image: train on a sample of the VAE posterior or on its mode (the Kontext "
           "script's default). Default: sample, as the SD3 / Flux scripts." + "%(default).0s")
    a("--use_aspect_ratio_buckets", action="store_true",
      help="Accepted; changes nothing: every run here trains aspect-ratio buckets.")
    a("--offload", action="store_true",
      help="Keep the frozen VAE and text encoders in CPU memory; their weights move to the GPU layer by layer when "
           "they run (accelerate.cpu_offload).")
    a("--skip_final_inference", action="store_true",
      help="Do not generate the final validation images after training (the intermediate ones still run).")
    a("--final_validation_prompt", type=str, default=None,
      help="A prompt generated once after training, when no --validation_prompt is given.")
    a("--validation_steps", type=int, default=None,
      help="Also validate every N optimizer steps (train_dreambooth.py), with --validation_prompt.")
    a("--validation_scheduler", type=str, default=None, choices=VALIDATION_SCHEDULERS,
      help="Validate with this scheduler (from the model's scheduler config) instead of the model's own "
           "(train_dreambooth.py defaults to DPMSolverMultistepScheduler)." + "%(default).0s")
    a("--offset_noise", action="store_true",
      help="train_dreambooth.py's offset noise: the same as --noise_offset 0.1.")
    a("--pre_compute_text_embeddings", action="store_true",
      help="train_dreambooth.py's name for --cache_text_embeddings.")
    a("--set_grads_to_none", action="store_true",
      help="Accepted; changes nothing: the optimizer always sets gradients to None (torch's default).")
    a("--do_fp8_training", action="store_true",
      help="Train the transformer's linear layers with FP8 matmuls (torchao's convert_to_float8_training, upstream's "
           "module filter); a CUDA GPU of compute capability 8.9+, or the CPU. Needs torchao.")
    a("--bnb_quantization_config_path", type=str, default=None, metavar="JSON",
      help='LoRA on a 4/8-bit transformer (QLoRA): a JSON file of diffusers.BitsAndBytesConfig arguments, e.g. '
           '{"load_in_4bit": true, "bnb_4bit_quant_type": "nf4"}. Needs a CUDA GPU and bitsandbytes.')
    for flag in ("remote_text_encoder", "fsdp_text_encoder", "text_encoder_use_attention_mask",
                 "skip_save_text_encoder"):
        a(f"--{flag}", action="store_true", help="Refused: not supported by this script (the error says why).")
    for flag, nargs in (("validation_image", None), ("validation_images", "+"), ("class_labels_conditioning", None),
                        ("tokenizer_name", None), ("pretrained_text_encoder_4_name_or_path", None),
                        ("pretrained_tokenizer_4_name_or_path", None)):
        a(f"--{flag}", type=str, default=None, nargs=nargs, help="Refused unless unset (the error says why).")
    a("--tokenizer_max_length", type=int, default=None, help="Refused unless unset (the error says why).")


def resolve_upstream_aliases(args: argparse.Namespace) -> None:
    """Map upstream's names onto ours before the other checks see them: --caption_dropout, --cond_image_column,
    --offset_noise, --pre_compute_text_embeddings. Contradicting values of an alias and its twin are an error."""
    if args.caption_dropout:
        if args.proportion_empty_prompts not in (0, args.caption_dropout):
            raise UsageError(f"--caption_dropout {args.caption_dropout} and --proportion_empty_prompts "
                             f"{args.proportion_empty_prompts} are the same setting: pass one.")
        args.proportion_empty_prompts = args.caption_dropout
    if args.cond_image_column is not None:
        refs = list(args.reference_image_column or [])
        if refs and refs != [args.cond_image_column]:
            raise UsageError(f"--cond_image_column {args.cond_image_column} and --reference_image_column "
                             f"{' '.join(refs)} both name the edit pair's reference image: pass one.")
        args.reference_image_column = [args.cond_image_column]
    if args.offset_noise:
        if args.noise_offset not in (0, OFFSET_NOISE):
            raise UsageError(f"--offset_noise is --noise_offset {OFFSET_NOISE}, but --noise_offset is "
                             f"{args.noise_offset}: pass one of them.")
        args.noise_offset = OFFSET_NOISE
    if args.pre_compute_text_embeddings:
        args.cache_text_embeddings = True


def check_upstream_flags(args: argparse.Namespace) -> None:
    """The refusals (:data:`REFUSED`), the quantization flags' checks and the flags that apply to some families only."""
    for flag, (default, why) in REFUSED.items():
        value = getattr(args, flag)
        if value not in (default, None, False):
            shown = "" if isinstance(value, bool) else f" {' '.join(value) if isinstance(value, list) else value}"
            raise UsageError(f"--{flag}{shown} is not supported: {why}.")
    check_quantization_flags(args)  # --do_fp8_training, --bnb_quantization_config_path (quant_flags.py)
    if args.text_encoder_out_layers is not None:
        if args.family not in FLUX2_FAMILIES:
            raise UsageError(f"--text_encoder_out_layers picks the hidden layers of Flux.2's text encoder; "
                             f"{args.pretrained_model_name_or_path} is not Flux.2. Drop it.")
        if min(args.text_encoder_out_layers) < 0:
            raise UsageError(f"--text_encoder_out_layers {' '.join(map(str, args.text_encoder_out_layers))}: layer "
                             "indices are >= 0 (0 is the embeddings).")
    if args.vae_encode_mode is not None:
        from hf_arb.families import get_family

        family = get_family(args.family)
        if not getattr(family, "supports_vae_encode_mode", False):
            raise UsageError(f"--vae_encode_mode applies to SD3 / Flux.1 / Kontext / Z-Image; {family.title} "
                             "trains on its family script's fixed choice. Drop it.")
        if args.packing:
            raise UsageError("--vae_encode_mode has no effect with --packing (packs train a posterior sample): "
                             "drop one of them.")
    if args.validation_steps is not None and args.validation_steps < 1:
        raise UsageError(f"--validation_steps must be >= 1, got {args.validation_steps}.")
    if args.skip_final_inference and args.final_validation_prompt is not None:
        raise UsageError("--final_validation_prompt is generated by the final inference, which "
                         "--skip_final_inference skips: drop one of them.")


# ----------------------------------------------------------------------------------- hooks of the training script
def offload_frozen(args: argparse.Namespace, models: Any, device: Any) -> None:
    """``--offload``: the frozen VAE and text encoders keep their weights in CPU memory and stream them to ``device``
    layer by layer when they run (``accelerate.cpu_offload``, diffusers' sequential offload; on a CPU-only run the
    same hooks run, moving nothing). :func:`restore_frozen` puts the weights back."""
    if not args.offload:
        return
    from accelerate import cpu_offload

    for module in _frozen(models):
        cpu_offload(module, execution_device=device)


def restore_frozen(args: argparse.Namespace, models: Any) -> None:
    """Undo :func:`offload_frozen` (``accelerate.hooks.remove_hook_from_module``: the weights back in the modules,
    on the CPU), so that the saved pipeline holds them."""
    if not args.offload:
        return
    from accelerate.hooks import remove_hook_from_module

    for module in _frozen(models):
        remove_hook_from_module(module, recurse=True)


def _frozen(models: Any) -> list[Any]:
    vae = [] if "vae" in models.unloaded else [models.vae]  # an encoded dataset's run: nothing to offload
    return [*models.text_encoders[len(models.trained_text_encoders or []):], *vae]


def validation_due(args: argparse.Namespace, global_step: int) -> bool:
    """``--validation_steps N``: validate after every N-th optimizer step (with a validation prompt)."""
    return bool(args.validation_prompts and args.validation_steps and global_step % args.validation_steps == 0)


def final_validation_args(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments of the final outputs: no validation with ``--skip_final_inference``;
    ``--final_validation_prompt`` where no ``--validation_prompt`` is given; ``offload`` off (after
    :func:`restore_frozen` the frozen modules are plain CPU modules again)."""
    prompts = args.validation_prompts
    if args.skip_final_inference:
        prompts = None
    elif args.final_validation_prompt is not None and not prompts:
        prompts = [args.final_validation_prompt]
    return argparse.Namespace(**{**vars(args), "validation_prompts": prompts, "offload": False})


def use_validation_scheduler(args: argparse.Namespace, pipe: Any) -> None:
    """``--validation_scheduler NAME``: the pipeline samples with that diffusers scheduler, built from its own
    scheduler's config (train_dreambooth.py's ``log_validation``)."""
    name = getattr(args, "validation_scheduler", None)
    if name:
        import diffusers

        pipe.scheduler = getattr(diffusers, name).from_config(pipe.scheduler.config)


def pipeline_call_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """What a validation call passes the pipeline beyond the prompt: ``--text_encoder_out_layers`` (Flux.2), so
    that validation encodes prompts as training did."""
    layers = getattr(args, "text_encoder_out_layers", None)
    return {"text_encoder_out_layers": tuple(layers)} if layers else {}
