"""Flag checks, phrased in flags: every combination that cannot do what the user meant stops with one line
naming the fix (nothing is silently ignored)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from hf_arb.checks import UsageError, UsageFileError
from hf_arb.families import get_family
from hf_arb.lazy import LazyModule

from ..sources.dataset import bucket_set_from_args
from .caption_flags import check_caption_flags
from .optimizer_flags import check_optimizer_flags
from .prior_flags import check_prior_flags

torch: Any = LazyModule("torch")  # loaded when a function needs it: --help and flag errors answer before torch
logger = logging.getLogger("train_text_to_image_arb")


def check_values(args: argparse.Namespace) -> None:
    """Range checks, phrased in flags."""
    positive = ("train_batch_size", "gradient_accumulation_steps", "resolution", "bucket_step", "bucket_min_side",
                "bucket_max_side", "checkpointing_steps",
                "num_train_epochs", "max_train_steps", "validation_epochs", "repeats", "lr_num_cycles",
                "num_validation_inference_steps", "latent_cache_variants", "checkpoints_total_limit", "rank",
                "resolution_embed_dim", "power_sgd_rank", "max_train_samples", "max_pixels_per_batch")
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}.")
    for name in ("dataloader_num_workers", "lr_warmup_steps", "noise_offset", "input_perturbation",
                 "num_validation_images"):  # 0 validation images: no validation (as upstream passes it)
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0, got {getattr(args, name)}.")
    from hf_arb.checks import check_resolution
    try:
        check_resolution(args.resolution, "--resolution")  # a pixel count (1048576) is refused before any work
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not args.learning_rate > 0:
        raise UsageError(f"--learning_rate must be > 0, got {args.learning_rate}.")
    if args.lr_scheduler not in LR_SCHEDULERS:
        raise UsageError(f"--lr_scheduler {args.lr_scheduler!r} is not one of: {', '.join(LR_SCHEDULERS)}.")
    reports = [r.strip() for r in str(args.report_to).split(",")]
    for r in reports:
        if r not in TRACKERS:
            raise UsageError(f"--report_to {r!r} is not one of: {', '.join(TRACKERS)}.")
    for name, lo, hi in (("proportion_empty_prompts", 0, 1), ("lora_dropout", 0, 1), ("timestep_bias_portion", 0, 1)):
        if not lo <= getattr(args, name) <= hi:
            raise UsageError(f"--{name} must be in [{lo}, {hi}], got {getattr(args, name)}.")
    if args.snr_gamma is not None and args.snr_gamma <= 0:
        raise UsageError(f"--snr_gamma must be > 0, got {args.snr_gamma}.")
    if args.dream_training and args.dream_detail_preservation <= 0:
        raise UsageError(f"--dream_detail_preservation must be > 0, got {args.dream_detail_preservation}.")
    if args.dream_training and args.prediction_type == "v_prediction":
        raise UsageError("--dream_training supports epsilon prediction only: drop --prediction_type v_prediction.")
    if args.timestep_bias_strategy != "none":
        if args.timestep_bias_multiplier <= 0:
            raise UsageError(f"--timestep_bias_multiplier must be > 0, got {args.timestep_bias_multiplier}.")
        if args.timestep_bias_strategy == "range" and not 0 <= args.timestep_bias_begin < args.timestep_bias_end:
            raise UsageError(f"--timestep_bias_begin {args.timestep_bias_begin} must be >= 0 and below "
                             f"--timestep_bias_end {args.timestep_bias_end}.")
    if args.image_interpolation_mode in ("nearest", "nearest_exact"):
        raise UsageError(f"--image_interpolation_mode {args.image_interpolation_mode} is not antialiased and would "
                         "alias every downscaled image: use lanczos (default), bicubic, bilinear, hamming or box.")
    if (args.offload_ema or args.foreach_ema) and not args.use_ema:
        raise UsageError("--offload_ema / --foreach_ema configure the EMA model: add --use_ema or drop them.")
    check_family_flags(args)
    check_streaming_flags(args)
    check_encoded_flags(args)
    check_bucket_flags(args)
    check_packing_flags(args)
    check_reference_flags(args)
    check_dreambooth_flags(args)
    check_optimizer_flags(args)  # --optimizer AdamW | prodigy and the --prodigy_* flags
    check_caption_flags(args)  # --shuffle_caption, --keep_tokens, ..., --caption_extension
    if args.max_pixels_per_batch is not None and (args.no_bucket_sync or args.streaming):
        raise UsageError(f"--max_pixels_per_batch needs every device in the same bucket at each step: drop "
                         f"{'--no_bucket_sync' if args.no_bucket_sync else '--streaming'} or --max_pixels_per_batch.")
    check_flags_apply(args)
    warn_unapplied_flags(args)


#: BucketSet's parameter names in its error messages → this script's flags.
BUCKET_FLAG_NAMES = {"`resolution`": "--resolution", "`step`": "--bucket_step",
                     "`max_aspect_error`": "--max_aspect_error",
                     "`metric`": "--bucket_metric", " (--resolution)": "", "max_side=": "--bucket_max_side ",
                     "resolution=": "--resolution ", "step=": "--bucket_step "}


def check_bucket_flags(args: argparse.Namespace) -> None:
    """--bucket_preset or --aspect_ratio_buckets (not both; default budget), the preset's --bucket_step default, and
    the table itself built once, so that a bad combination fails here, in flags."""
    from hf_arb.buckets.presets import PRESET_INFO
    from hf_arb.flag_parser import in_flags

    if args.aspect_ratio_buckets is not None and args.bucket_preset is not None:
        raise UsageError(f"--aspect_ratio_buckets is a bucket table and --bucket_preset {args.bucket_preset} names "
                         "another: pass only one of them.")
    sides = [f"--bucket_{k}" for k in ("min_side", "max_side") if getattr(args, f"bucket_{k}") is not None]
    if sides and args.bucket_preset != "kohya":
        raise UsageError(f"{sides[0]} is a parameter of --bucket_preset kohya: add --bucket_preset kohya or drop "
                         f"{sides[0]}.")
    from hf_arb.buckets.presets import VIDEO_PRESET_INFO

    video = VIDEO_PRESET_INFO.get(args.bucket_preset or "")  # a clip table (--video_column): sides of its step
    fixed = args.aspect_ratio_buckets is not None or (
        video is None and PRESET_INFO[args.bucket_preset or "budget"].default_step is None)
    if fixed and args.bucket_step is not None:
        table = ("--aspect_ratio_buckets gives every bucket's size" if args.aspect_ratio_buckets is not None else
                 f"--bucket_preset {args.bucket_preset} is a fixed table")
        raise UsageError(f"--bucket_step {args.bucket_step} has no effect: {table}. Drop --bucket_step, or pick a "
                         "table built from a step (--bucket_preset budget, diffusers, onetrainer or kohya).")
    if args.aspect_ratio_buckets is None:
        args.bucket_preset = args.bucket_preset or "budget"
        if args.bucket_step is None:
            args.bucket_step = video.step if video else PRESET_INFO[args.bucket_preset].default_step
    try:
        bucket_set_from_args(args)
    except ValueError as err:
        flag = (
            "--aspect_ratio_buckets"
            if args.aspect_ratio_buckets is not None
            else f"--bucket_preset {args.bucket_preset}"
        )
        raise UsageError(f"{flag}: {in_flags(str(err), BUCKET_FLAG_NAMES).strip()}") from None


def check_family_flags(args: argparse.Namespace) -> None:
    """A flag of the other objective is an error naming the model family (never silently ignored)."""
    family = get_family(args.family)
    for flag, unset in family.refused_flags.items():
        if getattr(args, flag) != unset:
            raise UsageError(
                f"--{flag} applies to {family.refused_flags_for}, but {args.pretrained_model_name_or_path} is "
                f"{family.title}: drop --{flag}{family.refusal_note}")
    family.check_flags(args)


#: flags of diffusers' dreambooth LoRA scripts this script does not support, with their defaults and the reason
UNSUPPORTED_DREAMBOOTH_FLAGS = {
    "do_edm_style_training": (False, "EDM-style training (Playground v2.5) is not supported"),
}


#: the families whose LoRA ``--output_kohya_format`` converts (kohya's names of the SD / SDXL UNet and CLIP encoders)
KOHYA_FAMILIES = ("sd", "sdxl")


#: the dreambooth scripts' defaults of the text encoders' optimizer flags: given without --train_text_encoder, upstream
#: ignores them, and so does this script (any other value is refused: it would configure nothing)
DREAMBOOTH_TEXT_ENCODER_DEFAULTS = {"text_encoder_lr": 5e-6, "adam_weight_decay_text_encoder": 1e-3}


def check_dreambooth_flags(args: argparse.Namespace) -> None:
    """The dreambooth scripts' flags: a folder + one prompt, LoRA blocks and text-encoder options work; the rest
    (EDM) are refused in one line saying why; prior preservation: prior_flags.py."""
    check_prior_flags(args)
    for flag, (default, why) in UNSUPPORTED_DREAMBOOTH_FLAGS.items():
        if getattr(args, flag) != default:
            raise UsageError(f"--{flag} {getattr(args, flag)}: {why}. Drop --{flag}.")
    if args.instance_data_dir is not None and (args.dataset_name or args.train_data_dir):
        raise UsageError(f"--instance_data_dir {args.instance_data_dir} and --"
                         f"{'dataset_name' if args.dataset_name else 'train_data_dir'} both name the training data: "
                         "pass only one.")
    named_captions = getattr(args, "caption_column_given", False)  # --caption_column was on the command line
    if args.instance_data_dir is not None and args.instance_prompt is None and not named_captions and \
            getattr(args, "caption_extension", None) is None:
        raise UsageError(f"--instance_data_dir {args.instance_data_dir} needs --instance_prompt (every image's "
                         "caption) or --caption_column (a caption column of the folder's metadata.jsonl), or "
                         "--caption_extension .txt (a caption file beside each image).")
    if args.streaming and (args.instance_prompt is not None or args.instance_data_dir is not None):
        raise UsageError("--instance_data_dir / --instance_prompt are not supported with --streaming: write the "
                         "captions into the annotated shards and pass them with --train_data_dir.")
    if args.lora_blocks is not None:
        try:
            [int(b) for b in args.lora_blocks.split(",")]
        except ValueError:
            raise UsageError(f"--lora_blocks {args.lora_blocks!r}: expected comma-separated block indices, "
                             "e.g. 0,12.") from None
    if args.output_kohya_format and (not args.lora or args.family not in KOHYA_FAMILIES):
        why = ("this is a full fine-tune: add --rank N" if not args.lora else
               f"{args.pretrained_model_name_or_path} is {get_family(args.family).title}")
        raise UsageError("--output_kohya_format converts a LoRA of SD / SDXL to kohya's key names (as "
                         f"train_dreambooth_lora_sdxl.py); {why}, or drop it.")
    for flag in ("text_encoder_lr", "adam_weight_decay_text_encoder"):
        at_default = getattr(args, flag) == DREAMBOOTH_TEXT_ENCODER_DEFAULTS[flag]  # changes nothing, as upstream
        if getattr(args, flag) is not None and not args.train_text_encoder and not at_default:
            raise UsageError(f"--{flag} configures the text encoders' LoRA: add --train_text_encoder or drop --{flag}.")


def check_streaming_flags(args: argparse.Namespace) -> None:
    """--streaming needs an id column and excludes --cache_latents; the stream_* flags need --streaming."""
    if not args.streaming:
        given = [f for f in ("stream_counts", "stream_key_column") if getattr(args, f) is not None]
        if given:
            raise UsageError(f"--{given[0]} configures streaming: add --streaming or drop --{given[0]}.")
        return
    if args.cache_latents:
        raise UsageError("--cache_latents does not apply to --streaming (a stream is read once per epoch): "
                         "drop one of them.")
    encoded = bool(getattr(args, "encoded_dataset", None))  # its `row` column keys the rows; its rows are chosen
    if args.stream_key_column is None and not encoded:
        raise UsageError("--streaming needs --stream_key_column: an integer id column of the rows (e.g. `id`, "
                         "the row number written with the shards); it seeds each row's crop, flip and caption.")
    if args.stream_buffer_size < 1:
        raise UsageError(f"--stream_buffer_size must be >= 1, got {args.stream_buffer_size}.")
    if args.max_train_samples is not None and not encoded:
        raise UsageError("--max_train_samples is not supported with --streaming: write fewer shards instead.")
    if args.stream_counts is not None and not Path(args.stream_counts).is_file():
        raise UsageFileError(f"--stream_counts {args.stream_counts}: no such file (JSON {{bucket id: rows}}).")


def check_encoded_flags(args: argparse.Namespace) -> None:
    """--encoded_dataset holds the latents and the frozen prompt embeddings of a map-style bucketed run: the latent
    cache, trained text encoders and the other modes do not apply to it."""
    if getattr(args, "encoded_dataset", None) is None:
        return
    refused = [("cache_latents", "the encoded dataset is the latent cache: drop --cache_latents"),
               ("train_text_encoder", "its prompt embeddings are fixed: drop --train_text_encoder, or train from "
                                      "images"),
               ("stream_counts", "the stream counts the encoded dataset's own rows: drop --stream_counts"),
               ("packing", "not supported with --encoded_dataset yet: drop --packing"),
               ("reference_image_column", "not supported with --encoded_dataset yet: drop --reference_image_column"),
               ("dataset_config", "the encoded dataset is the run's data: drop --dataset_config (encode the datasets "
                                  "one by one)"),
               ("with_prior_preservation", "its batches hold no class images: drop --with_prior_preservation"),
               ("masked_loss", "its entries hold no masks yet: drop the mask flags"),
               ("alpha_mask", "its entries hold no masks yet: drop the mask flags"),
               ("mask_column", "its entries hold no masks yet: drop the mask flags"),
               ("mask_dir", "its entries hold no masks yet: drop the mask flags"),
               ("shuffle_caption", "its prompt embeddings are of the captions as written: drop --shuffle_caption"),
               ("caption_tag_dropout_rate", "its prompt embeddings are of the captions as written: drop "
                                            "--caption_tag_dropout_rate")]
    for flag, why in refused:
        if getattr(args, flag, None):
            raise UsageError(f"--{flag} with --encoded_dataset {args.encoded_dataset}: {why}.")
    tiers = getattr(args, "resolutions", None) or [args.resolution]
    if len(tiers) > 1:
        raise UsageError(f"--resolution {','.join(map(str, tiers))} (several tiers) is not supported with "
                         "--encoded_dataset yet: train one --resolution.")


def check_reference_flags(args: argparse.Namespace) -> None:
    """--reference_image_column needs an edit family, distinct columns, and a bucketed map-style run."""
    refs = args.reference_image_column or []
    if not refs:
        if args.reference_policy != "strict":
            raise UsageError(f"--reference_policy {args.reference_policy} has no effect in this run: it says how "
                             "reference images are bucketed: add --reference_image_column COLUMN or drop it.")
        return
    family = get_family(args.family)
    if not getattr(family, "supports_references", False):
        raise UsageError(f"--reference_image_column trains an edit model, but {args.pretrained_model_name_or_path} is "
                         f"{family.title}, which takes no reference image. Use an edit model (e.g. Flux.1 Kontext) or "
                         "drop --reference_image_column.")
    if len(set(refs)) != len(refs) or args.image_column in refs:
        raise UsageError(f"--reference_image_column {' '.join(refs)}: name each reference column once and not the "
                         f"--image_column ({args.image_column}).")
    for flag in ("packing", "streaming"):
        if getattr(args, flag, False):
            raise UsageError(f"--{flag} is not supported with --reference_image_column yet: drop one of them.")
    tiers = getattr(args, "resolutions", None) or [args.resolution]
    if len(tiers) > 1:  # the composite (target, references) ids are per bucket set, not yet per (tier, bucket)
        raise UsageError(f"--reference_image_column is not supported with several tiers (--resolution "
                         f"{','.join(map(str, tiers))}) yet: train an edit model at one --resolution.")


def check_packing_flags(args: argparse.Namespace) -> None:
    """--packing is for the flow transformers (a UNet has no token sequence) and excludes streaming / cached latents;
    --max_tokens needs --packing."""
    if not args.packing:
        if args.max_tokens is not None:
            raise UsageError("--max_tokens is the token budget of --packing: add --packing or drop --max_tokens.")
        return
    if not get_family(args.family).supports_packing:
        raise UsageError(f"--packing packs transformer tokens (SD3 / Flux), but {args.pretrained_model_name_or_path} "
                         f"is {get_family(args.family).title}, a UNet with no token sequence. Its analogue is a pixel "
                         f"budget "
                         "per batch: --max_pixels_per_batch (a per-bucket batch size). Drop --packing.")
    for flag in ("streaming", "cache_latents"):
        if getattr(args, flag):
            raise UsageError(f"--{flag} is not supported with --packing yet: drop one of them.")
    if args.max_pixels_per_batch is not None:
        raise UsageError("--max_pixels_per_batch sizes bucketed batches; --packing sizes packs by --max_tokens: drop "
                         "one of them.")
    if args.max_tokens is None:
        args.max_tokens = (args.resolution // 16) ** 2
    if args.max_tokens < 1:
        raise UsageError(f"--max_tokens must be >= 1, got {args.max_tokens}.")


LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "piecewise_constant")


#: --report_to values and the module each needs.
TRACKERS = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "comet_ml": ("comet_ml",),
            "all": (), "none": ()}


# ------------------------------------------------------------------ flags that a mode would ignore (docs/training.md)
# : build_parser's defaults of the flags checked below: a flag is "given" when its value differs (a test keeps them
# equal)
UNSET: dict[str, Any] = {
    "latent_cache_dir": None, "latent_cache_variants": None, "resolution_embed_dim": 256,
    "dream_detail_preservation": 1.0, "timestep_bias_multiplier": 1.0, "timestep_bias_begin": 0,
    "timestep_bias_end": 1000, "timestep_bias_portion": 0.25, "power_sgd_rank": 1, "stream_buffer_size": 4096,
    "stream_on_overflow": "error", "lora_layers": None, "lora_blocks": None, "hub_model_id": None, "hub_token": None,
    "tracker_project_name": "text2image-fine-tune", "logging_dir": "logs", "debug_loss": False,
    "dataset_config_name": None, "bucket_leftover": "drop", "no_bucket_sync": False, "dataloader_num_workers": 0,
    "image_interpolation_mode": "lanczos", "repeats": 1, "train_batch_size": 16, "lr_warmup_steps": 500,
    "lr_num_cycles": 1, "lr_power": 1.0, "num_validation_inference_steps": 20, "logit_mean": 0.0, "logit_std": 1.0,
    "mode_scale": 1.29,
}


def _given(args: argparse.Namespace, flag: str) -> bool:
    """Whether ``--flag`` was set to something other than its default (``UNSET``)."""
    return getattr(args, flag) != UNSET[flag]


def _shown(args: argparse.Namespace, flag: str) -> str:
    """``--flag VALUE`` as typed (a switch without its value, a token never)."""
    value = getattr(args, flag)
    return f"--{flag}" if isinstance(value, bool) or flag == "hub_token" else f"--{flag} {value}"


def _unapplied_rules(args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """``(flag, applies in this run, what it needs)``: a given flag whose rule says it does not apply is refused."""
    tracked = str(args.report_to).strip() != "none"
    bias = args.timestep_bias_strategy
    one_variant = args.center_crop and not args.random_flip
    stream = "--streaming reads each row once, in the stream's order"
    return [
        ("latent_cache_dir", args.cache_latents, "it sets where --cache_latents keeps latents: add --cache_latents"),
        ("latent_cache_variants", args.cache_latents or bool(getattr(args, "encoded_dataset", None)),
         "it configures --cache_latents: add --cache_latents"),
        ("latent_cache_variants", not one_variant, "--center_crop without --random_flip has one crop/flip variant "
                                                   "per image: add --random_flip"),
        ("resolution_embed_dim", args.resolution_conditioning, "it sizes --resolution_conditioning: add it"),
        ("dream_detail_preservation", args.dream_training, "it configures DREAM: add --dream_training"),
        ("timestep_bias_multiplier", bias != "none", "it weights --timestep_bias_strategy, which is none: pass "
                                                     "--timestep_bias_strategy earlier, later or range"),
        ("timestep_bias_begin", bias == "range", f"it bounds --timestep_bias_strategy range, not {bias}: pass "
                                                 "--timestep_bias_strategy range"),
        ("timestep_bias_end", bias == "range", f"it bounds --timestep_bias_strategy range, not {bias}: pass "
                                               "--timestep_bias_strategy range"),
        ("timestep_bias_portion", bias in ("earlier", "later"), f"it sizes --timestep_bias_strategy earlier/later, "
                                                                f"not {bias}: pass one of them"),
        ("stream_buffer_size", args.streaming, "it configures --streaming: add --streaming"),
        ("stream_on_overflow", args.streaming, "it configures --streaming: add --streaming"),
        ("lora_layers", args.lora, "it picks LoRA targets, and this is a full fine-tune: add --rank N (or --lora)"),
        ("lora_blocks", args.lora, "it picks LoRA targets, and this is a full fine-tune: add --rank N (or --lora)"),
        ("hub_model_id", args.push_to_hub, "it names the Hub repository of --push_to_hub: add --push_to_hub"),
        ("hub_token", args.push_to_hub, "it is the token of --push_to_hub: add --push_to_hub"),
        ("tracker_project_name", tracked,
         "--report_to none starts no tracker: pass --report_to tensorboard (or wandb)"),
        ("logging_dir", tracked, "--report_to none writes no logs: pass --report_to tensorboard"),
        ("debug_loss", tracked, "its losses go to the trackers, and --report_to none has none: pass --report_to "
                                "tensorboard"),
        ("dataset_config_name", args.dataset_name is not None, "it configures a --dataset_name dataset; a folder "
                                                               "(--train_data_dir, --instance_data_dir) has none"),
        ("bucket_leftover", not args.streaming, f"{stream} (a bucket's last rows wait for the next epoch)"),
        ("bucket_leftover", not (args.packing and args.bucket_leftover == "catch_all"),
         "--packing has no buckets to pool leftovers into (its leftover is drop or fill)"),
        ("no_bucket_sync", not args.streaming, f"{stream}, one bucket for every rank per step"),
        ("no_bucket_sync", not args.packing, "--packing trains packs, not buckets"),
        ("dataloader_num_workers", not args.streaming, f"{stream} in the training process (no workers)"),
        ("image_interpolation_mode", not args.streaming, f"{stream} and resizes with lanczos"),
        ("repeats", not args.streaming, f"{stream}: write the rows several times into the shards instead"),
    ]


def check_flags_apply(args: argparse.Namespace) -> None:
    """A flag that this run's mode would ignore stops here, in one line naming the flag and the fix (the table in
    docs/training.md, "Every flag, every mode", lists every flag)."""
    for flag, applies, needs in _unapplied_rules(args):
        if not applies and _given(args, flag):
            raise UsageError(f"{_shown(args, flag)} has no effect in this run: {needs}, or drop --{flag}.")
    if args.non_ema_revision != args.revision and "use_ema" in get_family(args.family).refused_flags:
        raise UsageError(f"--non_ema_revision {args.non_ema_revision} names a UNet revision, but "
                         f"{args.pretrained_model_name_or_path} is {get_family(args.family).title}: pass --revision "
                         "instead.")
    if args.validation_prompt and args.validation_prompts and args.validation_prompt not in args.validation_prompts:
        args.validation_prompts = [args.validation_prompt, *args.validation_prompts]  # both: every prompt validates


def _warn_once(message: str, *values: Any) -> None:
    """A warning from the main process only (parsing runs on every rank)."""
    if int(os.environ.get("RANK", "0") or 0) == 0:
        logger.warning(message, *values)


def warn_unapplied_flags(args: argparse.Namespace) -> None:
    """Flags that upstream diffusers accepts and ignores the same way (its own tests pass some): one warning each,
    naming the flag, instead of a refusal."""
    defaults = getattr(args, "family_defaults", {})
    if not args.validation_prompts:
        idle = [_shown(args, f) for f in ("validation_epochs", "num_validation_images", "validation_steps",
                                          "validation_scheduler")
                if f not in defaults and getattr(args, f)] + [_shown(args, "num_validation_inference_steps")] * _given(
            args, "num_validation_inference_steps")
        if idle:
            _warn_once("%s: no effect, there is no --validation_prompt, so no validation runs (add --validation_prompt "
                       "\"...\" to validate).", ", ".join(idle))
    schedulers = {"lr_warmup_steps": ("constant", "piecewise_constant"), "lr_num_cycles": ("cosine_with_restarts",),
                  "lr_power": ("polynomial",)}
    for flag, uses in schedulers.items():
        ignored = args.lr_scheduler in uses if flag == "lr_warmup_steps" else args.lr_scheduler not in uses
        if ignored and _given(args, flag) and getattr(args, flag) != 0:
            _warn_once("%s: no effect with --lr_scheduler %s%s.", _shown(args, flag), args.lr_scheduler,
                       " (it has no warmup; constant_with_warmup has)" if flag == "lr_warmup_steps" else
                      f" (only {uses[0]} reads it)")
    scheme = args.weighting_scheme or getattr(get_family(args.family), "default_weighting_scheme", None)
    for flag, reader in (("logit_mean", "logit_normal"), ("logit_std", "logit_normal"), ("mode_scale", "mode")):
        if scheme is not None and scheme != reader and _given(args, flag):
            _warn_once("%s: no effect with --weighting_scheme %s (only %s reads it).", _shown(args, flag), scheme,
                       reader)
    if args.instance_prompt is not None and getattr(args, "caption_column_given", False):
        _warn_once("--instance_prompt %r is not a caption here: --caption_column %s gives each image its caption.",
                   args.instance_prompt, args.caption_column)
    table = [f"{f} {getattr(args, f[2:])}" for f in getattr(args, "bucket_flags_given", [])]
    resolution = [] if "resolution" in defaults else [f"--resolution {args.resolution}"]
    encoded = bool(getattr(args, "encoded_dataset", None))  # its fingerprint checks the bucket flags given
    if args.streaming and not encoded and (table or resolution) and len(getattr(args, "resolutions", None) or [0]) < 2:
        # (several tiers: the tiers' tables apply, each row's bucket in a tier derived from its stored size)
        _warn_once("%s: not applied, --streaming trains the shards' own bucket columns (re-annotate the shards to "
                   "change them).", ", ".join([*resolution, *table]))
    elif args.aspect_ratio_buckets is not None and resolution and not args.packing:
        _warn_once("%s: not applied, --aspect_ratio_buckets gives every bucket's size.", resolution[0])
    if args.ddp_comm_hook != "power_sgd" and _given(args, "power_sgd_rank"):  # (tests/test_train.py passes it so)
        _warn_once("--power_sgd_rank %d: no effect with --ddp_comm_hook %s (only power_sgd reads it).",
                   args.power_sgd_rank, args.ddp_comm_hook)
    if args.packing and _given(args, "train_batch_size") and not args.scale_lr:
        _warn_once("--train_batch_size %d: not applied, --packing sizes each step by --max_tokens %s.",
                   args.train_batch_size, args.max_tokens)
