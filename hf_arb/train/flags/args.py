"""The training script's command line: every flag of diffusers' text-to-image and dreambooth LoRA scripts (same
name, default and meaning) plus the bucketing flags, parsed and checked before anything heavy loads."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from hf_arb.checks import UsageError
from hf_arb.families import detect_family, get_family
from hf_arb.lazy import LazyModule

from ..environment import check_environment
from ..sources.dataset import BUCKET_TABLE_FLAGS
from ..sources.tiers import check_tier_flags, parse_resolutions, split_resolution
from .arg_checks import LR_SCHEDULERS, check_values
from .caption_flags import add_caption_flags
from .dataset_config import check_dataset_config
from .mask_flags import add_mask_flags, check_mask_flags
from .optimizer_flags import add_optimizer_flags
from .prior_flags import add_prior_flags
from .upstream_flags import add_upstream_flags, check_upstream_flags, resolve_upstream_aliases
from .video_flags import add_video_flags, check_video_flags

torch: Any = LazyModule("torch")  # loaded when a function needs it: --help and flag errors answer before torch
logger = logging.getLogger("train_text_to_image_arb")


#: Without --lora / --rank / --full_finetune, a learning rate at or above this (LoRA's range) warns once.
LORA_LR_THRESHOLD = 5e-5


DEFAULT_RANK = 4  # diffusers' LoRA scripts' --rank default




#: Appended to a help text whose default is explained in words: ArgumentDefaultsHelpFormatter then adds nothing.
NO_DEFAULT = "%(default).0s"


def build_parser() -> argparse.ArgumentParser:
    """Every flag of diffusers' four text-to-image scripts (same name, default, meaning) plus the bucketing flags."""
    from hf_arb.flag_parser import FlagParser  # an unknown hf-arb spelling (--preset) names this script's twin

    p = FlagParser(
        description="Stable Diffusion / SDXL fine-tuning (full or LoRA) with aspect-ratio bucketing. Takes the flags "
                    "of diffusers' train_text_to_image.py, _sdxl.py, _lora.py and _lora_sdxl.py; defaults marked "
                    "'SD | SDXL' follow the detected model family, as upstream's separate scripts do.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    # --- model
    a("--pretrained_model_name_or_path", type=str, default=None, required=True,
      help="Path to pretrained model or model identifier from huggingface.co/models.")
    a("--pretrained_vae_model_name_or_path", type=str, default=None,
      help="Optional VAE to use instead of the model's (e.g. madebyollin/sdxl-vae-fp16-fix for SDXL in fp16).")
    a("--revision", type=str, default=None, help="Revision of pretrained model identifier from huggingface.co/models.")
    a("--variant", type=str, default=None, help="Variant of the model files, e.g. fp16.")
    a("--non_ema_revision", type=str, default=None,
      help="Revision of the non-EMA UNet (deprecated upstream; defaults to --revision).")
    a("--input_perturbation", type=float, default=0, help="The scale of input perturbation. Recommended 0.1.")
    # --- training mode: full fine-tune or LoRA
    a("--lora", action="store_true",
      help="Train LoRA adapters (peft) instead of every UNet weight, as train_text_to_image_lora*.py; writes "
           "pytorch_lora_weights.safetensors. Implied by --rank.")
    a("--full_finetune", action="store_true",
      help="Fine-tune every UNet weight (the default without --rank/--lora); silences the warning a LoRA-range "
           "--learning_rate (>= 5e-5) gives.")
    a("--rank", type=int, default=None,
      help=f"The dimension of the LoRA update matrices; giving it selects LoRA (default in LoRA mode: {DEFAULT_RANK})."
           + NO_DEFAULT)
    a("--lora_alpha", type=float, default=None,
      help="LoRA alpha (scale alpha/rank); default: --rank, as upstream." + NO_DEFAULT)
    a("--lora_dropout", type=float, default=0.0, help="Dropout probability for LoRA layers.")
    a("--train_text_encoder", action="store_true",
      help="LoRA mode: also train LoRA adapters on the text encoder(s) (both for SDXL).")
    # --- data
    a("--dataset_name", type=str, default=None,
      help="Dataset on the Hub, a local dataset folder (save_to_disk or files datasets can read).")
    a("--dataset_config_name", type=str, default=None, help="The config of the Dataset.")
    a("--dataset_config", type=str, default=None, metavar="FILE",
      help="NEW: several datasets in one run, from a TOML or YAML file (hf_arb's [[datasets]] or kohya sd-scripts' "
           "dataset_config.toml): each with its repeats or weight, caption source, resolution and loss weight "
           "(docs/training.md, 'Several datasets'). Replaces --dataset_name / --train_data_dir.")
    a("--train_data_dir", type=str, default=None,
      help="A folder of images (imagefolder layout, metadata.jsonl with captions); with --dataset_name, the "
           "dataset's data_dir, as diffusers' script passes it.")
    a("--image_column", type=str, default="image", help="The column of the dataset containing an image.")
    a("--caption_column", type=str, default="text", help="The column containing a caption or a list of captions.")
    a("--reference_image_column", action="append", default=None, metavar="COLUMN",
      help="An edit model's reference image column (repeatable; e.g. the 'before' image of a before/after pair): "
           "every batch stacks by the composite (target bucket, reference buckets) key. Edit families only "
           "(Flux.1 Kontext).")
    a("--reference_policy", choices=("strict", "own"), default="strict",
      help="strict (default): each reference takes the target's bucket and crop (Flux Kontext); own: its own bucket.")
    a("--max_train_samples", type=int, default=None, help="Truncate the number of training examples to this value.")
    a("--cache_dir", type=str, default=None, help="Where downloaded models and datasets are stored.")
    a("--dataloader_num_workers", type=int, default=0, help="Subprocesses for data loading (0: main process).")
    # --- images and buckets
    a("--resolution", type=parse_resolutions, default=None,
      help="CHANGED MEANING: the pixel budget of the buckets; every bucket has about resolution² pixels (sides "
           "multiples of --bucket_step) instead of every image being resized to a resolution² square. "
           "NEW: several tiers, e.g. 512,1024, each with its own buckets (docs/tiers.md). "
           "Default: SD 512 | SDXL 1024." + NO_DEFAULT)
    a("--resolution_schedule", type=str, default=None,
      help="NEW, with several --resolution tiers: which tier trains when: 'random' (default; a tier per image and "
           "epoch), 'mix:512:1,1024:3', 'curriculum:0-2000:512,2000-:1024' or 'progressive:2000'." + NO_DEFAULT)
    a("--max_upscale", type=float, default=None,
      help="NEW, with several tiers: an image serves a tier only if covering its bucket there needs at most this "
           "upscale (default 1: never upscale)." + NO_DEFAULT)
    a("--center_crop", default=False, action="store_true",
      help="CHANGED: crops inside the bucket, not a square: centre-crop the small excess after resizing to cover "
           "the bucket (default: a random crop inside the bucket).")
    a("--random_flip", action="store_true", help="Randomly flip images horizontally (inside the bucket).")
    a("--image_interpolation_mode", type=str, default="lanczos",
      choices=["bicubic", "bilinear", "box", "hamming", "lanczos", "nearest", "nearest_exact"],
      help="Filter for resizing images (Pillow's; nearest/nearest_exact are refused: not antialiased).")
    from hf_arb.buckets.matching import METRICS
    from hf_arb.buckets.presets import PRESETS, VIDEO_PRESETS

    a("--bucket_preset", type=str, default=None, choices=PRESETS + VIDEO_PRESETS,
      help="Bucket table (all listed in docs/buckets.md): 'budget' (default; OneTrainer aspects scaled to "
           "--resolution²), 'novelai', 'sdxl', the model families' own 'pixart', 'sana' (--resolution picks the "
           "table), 'hunyuan_dit', 'flux_kontext', or the trainers' 'diffusers', 'onetrainer', 'kohya'. Fixed tables "
           "ignore --resolution and say so at start-up." + NO_DEFAULT)
    a("--aspect_ratio_buckets", type=str, default=None, metavar="H,W;H,W",
      help="Explicit buckets in diffusers' dreambooth format, height first, e.g. '1024,1024;768,1360' (instead of "
           "--bucket_preset).")
    a("--bucket_step", type=int, default=None,
      help="Bucket sides are multiples of this (budget, onetrainer, kohya: default 64; diffusers: its divisibility, "
           "default 16; refused with a fixed table or --aspect_ratio_buckets)." + NO_DEFAULT)
    a("--bucket_min_side", type=int, default=None,
      help="kohya: sd-scripts' --min_bucket_reso, the smallest bucket side (default 256)." + NO_DEFAULT)
    a(
        "--bucket_max_side",
        type=int,
        default=None,
        help="kohya: sd-scripts' --max_bucket_reso, the largest bucket side, >= --resolution (default 1024)."
        + NO_DEFAULT,
    )
    a("--bucket_metric", type=str, default="log", choices=(*METRICS, "native"),
      help="How an image finds its bucket: 'log' |log(w/h) - log(bw/bh)| (symmetric), NovelAI's 'linear' |w/h - "
           "bw/bh| (with --bucket_preset novelai: NovelAI's own assignment), 'linear_hw' (on h/w), diffusers' "
           "'cross' |h*bw - w*bh|, or 'native': the preset's source's own rule (PixArt, HunyuanDiT, diffusers, ...).")
    a("--max_aspect_error", type=float, default=None,
      help="Skip images whose aspect error exceeds this, in --bucket_metric units (log: |log aspect - log bucket "
           "aspect|; default: keep all).")
    a("--bucket_leftover", type=str, default="drop", choices=["drop", "fill", "catch_all"],
      help="What the sampler does with a bucket's last, incomplete batch (see docs/training.md).")
    a("--no_bucket_sync", action="store_true",
      help="Let every rank draw its own bucket each step (NovelAI style) instead of one bucket for all ranks.")
    a("--resolution_conditioning", action="store_true",
      help="SD 1.x/2.x: add a zero-initialised size/crop embedding (SDXL's six time ids) to the UNet.")
    a("--resolution_embed_dim", type=int, default=256, help="Sinusoid width per time id for --resolution_conditioning.")
    # --- flow-matching families (SD3 / SD3.5, Flux.1): diffusers' train_dreambooth_(lora_)sd3/flux.py flags
    a("--weighting_scheme", type=str, default=None, choices=["sigma_sqrt", "logit_normal", "mode", "cosmap", "none"],
      help="SD3/Flux: timestep density and loss weighting. Default: SD3 logit_normal | Flux none." + NO_DEFAULT)
    a("--logit_mean", type=float, default=0.0, help="SD3/Flux: mean of the logit_normal weighting scheme.")
    a("--logit_std", type=float, default=1.0, help="SD3/Flux: std of the logit_normal weighting scheme.")
    a("--mode_scale", type=float, default=1.29, help="SD3/Flux: scale of the mode weighting scheme.")
    a("--precondition_outputs", type=int, default=None, choices=[0, 1],
      help="SD3/Flux: 1 trains the output as an x0 prediction (pred * -sigma + noisy), as diffusers' SD3 scripts. "
           "Default: SD3 1 | Flux 0." + NO_DEFAULT)
    a("--guidance_scale", type=float, default=3.5,
      help="Flux: the guidance input of guidance-distilled transformers (Flux.1-dev) during training.")
    a("--max_sequence_length", type=int, default=None,
      help="SD3/Flux: T5 tokens per prompt. Default: SD3 77 | Flux 512." + NO_DEFAULT)
    a("--shift_by_resolution", action="store_const", const=True, default=None,
      help="SD3/Flux: shift each batch's sigmas with the mu of its bucket's token count, as the pipeline does at "
           "inference. Default: on where the base scheduler has use_dynamic_shifting (Flux), else off." + NO_DEFAULT)
    a("--no_shift_by_resolution", dest="shift_by_resolution", action="store_const", const=False,
      help="SD3/Flux: one shift for every bucket (the scheduler's static shift, or none), as diffusers' scripts.")
    a("--lora_layers", type=str, default=None,
      help="SD3/Flux LoRA: comma-separated transformer modules to adapt (default: those of diffusers' "
           "train_dreambooth_lora_sd3/flux.py)." + NO_DEFAULT)
    a("--lora_blocks", type=str, default=None,
      help="SD3/Flux LoRA: comma-separated transformer block indices; only the --lora_layers of "
           "transformer_blocks.<i> are adapted (train_dreambooth_lora_sd3.py's flag).")
    # --- diffusers' dreambooth LoRA scripts (train_dreambooth_lora_sd3/flux/sdxl.py): a folder of images + one prompt
    a("--instance_data_dir", type=str, default=None,
      help="A folder of images (dreambooth): trained with --instance_prompt as every caption, or with the folder's "
           "--caption_column (metadata.jsonl) when that flag is given.")
    a("--instance_prompt", type=str, default=None,
      help="The caption of every image (dreambooth), unless --caption_column is given.")
    a("--repeats", type=int, default=1, help="How many times to repeat the training data.")
    a("--text_encoder_lr", type=float, default=None,
      help="--train_text_encoder: the text encoders' learning rate (default: --learning_rate, as "
           "train_text_to_image_lora_sdxl.py; the dreambooth scripts default to 5e-6)." + NO_DEFAULT)
    a("--adam_weight_decay_text_encoder", type=float, default=None,
      help="--train_text_encoder: the text encoders' weight decay (default: --adam_weight_decay)." + NO_DEFAULT)
    a("--lr_num_cycles", type=int, default=1, help="Number of hard resets of the lr in cosine_with_restarts.")
    a("--lr_power", type=float, default=1.0, help="Power factor of the polynomial scheduler.")
    add_optimizer_flags(a)  # --optimizer AdamW | prodigy, --prodigy_* (train/flags/optimizer_flags.py)
    a("--use_dora", action="store_true",
      help="LoRA: train DoRA adapters (peft use_dora), as the SDXL dreambooth script.")
    a("--upcast_before_saving", action="store_true",
      help="Accepted; always the case here: the adapters train and are saved in float32.")
    a("--do_edm_style_training", action="store_true",
      help="Refused: not supported by this script (the error says why).")
    a("--output_kohya_format", action="store_true",
      help="SD / SDXL LoRA: also write pytorch_lora_weights_kohya.safetensors, kohya's key names (A1111, ComfyUI).")
    add_prior_flags(a)  # --with_prior_preservation and its class flags (hf_arb.train.flags.prior_flags)
    # --- the other dreambooth scripts' flags (issue 35): train_dreambooth{,_lora}.py, _flux2*, _kontext, _qwen_image,
    # _z_image; hf_arb.train.flags.upstream_flags resolves the aliases and refuses, in one line, what cannot work here
    add_upstream_flags(a)
    add_mask_flags(a)  # --masked_loss, --alpha_mask, --mask_column, --mask_dir, --unmasked_weight (issue 36)
    add_video_flags(a)  # --video_column, --frames, --target_fps, --frame_sampling, --short_clips (video_flags.py)
    # --- packing (SD3 / Flux): NaViT packs of images at their own size instead of buckets (docs/packing.md)
    a("--packing", action="store_true",
      help="SD3/Flux: train packs of images at their own size and aspect (no bucket crop) in one token sequence "
           "per device and step, attention masked per image; replaces buckets and --train_batch_size.")
    a("--max_tokens", type=int, default=None,
      help="--packing: latent tokens per pack (per device per step); each image is also capped at "
           "min(this, (--resolution/16)^2) tokens (several tiers: its drawn tier's). Default: (--resolution/16)^2 "
           "(several tiers: the largest)." + NO_DEFAULT)
    # --- streaming (hf_arb.BucketedStream over annotated parquet shards; docs/training.md "Streaming")
    a("--streaming", action="store_true",
      help="Stream the annotated dataset (datasets streaming=True) through hf_arb.BucketedStream: no rank holds it.")
    a("--stream_buffer_size", type=int, default=4096, help="--streaming: rows buffered per rank.")
    a("--stream_on_overflow", choices=("error", "evict"), default="error",
      help="--streaming: when a scheduled bucket gets no batch within the buffer, stop (error) or drop old rows.")
    a("--stream_counts", type=str, default=None,
      help="--streaming: JSON file {bucket id: rows} (default: the Hub dataset card, else one pass over the bucket "
           "column).")
    a("--stream_key_column", type=str, default=None,
      help="--streaming: an integer id column (seeds each row's crop/flip/caption draws); required with --streaming.")
    # --- latent / text caches
    a("--cache_latents", action="store_true",
      help="Encode every (image, bucket, crop, flip) once with the VAE and train from the cache.")
    a("--latent_cache_dir", type=str, default=None, help="Latent cache directory (default: <output_dir>/latent_cache).")
    a("--latent_cache_variants", type=int, default=None,
      help="Cached crop/flip variants per image with random crops or flips (default: min(epochs, 8)); "
           "epoch e trains on variant e %% variants. Centre crops without flip have one.")
    a("--cache_text_embeddings", action="store_true",
      help="Keep the frozen text encoders' outputs per caption in memory instead of re-encoding.")
    add_caption_flags(a)  # --shuffle_caption, --keep_tokens, ..., --caption_extension (train/flags/caption_flags.py)
    a("--encoded_dataset", "--latents_dataset", dest="encoded_dataset", type=str, default=None,
      help="Train from an encoded dataset (a folder or Hub id written by hf-arb encode): stored latents and prompt "
           "embeddings instead of images and text encoders; its fingerprint must match this run (docs/encode.md). "
           "--latents_dataset is the same flag.")
    # --- optimisation
    a("--train_batch_size", type=int, default=16, help="Batch size (per device) for the training dataloader.")
    a("--max_pixels_per_batch", type=int, default=None,
      help="NEW (SD/SDXL): a pixel budget per batch and device instead of one batch size: bucket WxH trains "
           "floor(N / (W*H)) images per batch, capped at --train_batch_size (e.g. 4194304 = four 1024x1024 images "
           "or sixteen 512x512 ones). Every device trains the same bucket at each step; each optimizer step "
           "weights every image equally (docs/training.md). Printed per bucket at startup.")
    a("--num_train_epochs", type=int, default=100)
    a("--max_train_steps", type=int, default=None,
      help="Total number of training steps to perform. If provided, overrides num_train_epochs.")
    a("--gradient_accumulation_steps", type=int, default=1,
      help="Number of updates steps to accumulate before performing a backward/update pass.")
    a("--gradient_checkpointing", action="store_true", help="Trade compute for memory in the UNet's backward pass.")
    a("--learning_rate", type=float, default=1e-4, help="Initial learning rate (after the potential warmup period).")
    a("--scale_lr", action="store_true", default=False,
      help="Scale the learning rate by the number of GPUs, gradient accumulation steps, and batch size.")
    a("--lr_scheduler", type=str, default="constant", help="One of: " + ", ".join(LR_SCHEDULERS) + ".")
    a("--lr_warmup_steps", type=int, default=500, help="Number of steps for the warmup in the lr scheduler.")
    a("--snr_gamma", type=float, default=None, help="SNR weighting gamma (Min-SNR, arXiv:2303.09556). Recommended 5.0.")
    a("--dream_training", action="store_true",
      help="DREAM (arXiv:2312.00210): an extra no-grad UNet pass corrects the noise target (epsilon prediction).")
    a("--dream_detail_preservation", type=float, default=1.0, help="DREAM detail preservation factor p (> 0).")
    a("--timestep_bias_strategy", type=str, default="none", choices=["earlier", "later", "range", "none"],
      help="Sample some timesteps more often: the earliest or latest --timestep_bias_portion, or a range.")
    a("--timestep_bias_multiplier", type=float, default=1.0, help="Weight of the biased timesteps (2.0 doubles it).")
    a("--timestep_bias_begin", type=int, default=0, help="First biased timestep (inclusive) with 'range'.")
    a("--timestep_bias_end", type=int, default=1000, help="Last biased timestep (exclusive) with 'range'.")
    a("--timestep_bias_portion", type=float, default=0.25, help="Portion of timesteps biased with earlier/later.")
    a("--use_8bit_adam", action="store_true", help="Use 8-bit Adam from bitsandbytes.")
    a("--allow_tf32", action="store_true", help="Allow TF32 on Ampere GPUs.")
    a("--cudnn_attention", action="store_true",
      help="Let PyTorch pick its cuDNN attention kernel on CUDA (off by default: on an H200 with torch 2.11 it "
           "faulted on the full-size Flux.1 transformer's training step, see docs/benchmarks.md); flash and "
           "memory-efficient attention stay on.")
    a("--use_ema", action="store_true", help="Whether to use EMA model (full fine-tune only).")
    a("--offload_ema", action="store_true", help="Keep the EMA model on the CPU between updates.")
    a("--foreach_ema", action="store_true", help="Use the faster foreach implementation of EMAModel.")
    a("--adam_beta1", type=float, default=0.9, help="The beta1 parameter for the Adam optimizer.")
    a("--adam_beta2", type=float, default=0.999, help="The beta2 parameter for the Adam optimizer.")
    a("--adam_weight_decay", type=float, default=1e-2, help="Weight decay to use.")
    a("--adam_epsilon", type=float, default=1e-08, help="Epsilon value for the Adam optimizer")
    a("--max_grad_norm", default=1.0, type=float, help="Max gradient norm.")
    a("--prediction_type", type=str, default=None, choices=["epsilon", "v_prediction"],
      help="'epsilon' or 'v_prediction'; default: the scheduler's prediction_type.")
    a("--noise_offset", type=float, default=0, help="The scale of noise offset.")
    a("--proportion_empty_prompts", type=float, default=0,
      help="Proportion of captions replaced by empty strings (SDXL script's flag; 0 keeps all).")
    a("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16"],
      help="Mixed precision; default: the accelerate config's value.")
    a("--enable_xformers_memory_efficient_attention", action="store_true", help="Whether or not to use xformers.")
    a("--enable_npu_flash_attention", action="store_true", help="Use NPU flash attention (needs torch_npu).")
    a("--ddp_comm_hook", type=str, default="no", choices=["no", "fp16", "bf16", "power_sgd"],
      help="PyTorch DDP communication hook for gradient all-reduce (compression for bandwidth-bound multi-node runs).")
    a("--power_sgd_rank", type=int, default=1, help="matrix_approximation_rank of the PowerSGD hook.")
    # --- outputs, checkpoints, logging
    a("--output_dir", type=str, default=None,
      help="Where the model and checkpoints are written. Default: sd-model-finetuned | sdxl-model-finetuned; "
           "LoRA: sd-model-finetuned-lora." + NO_DEFAULT)
    a("--seed", type=int, default=None, help="A seed for reproducible training.")
    a("--checkpointing_steps", type=int, default=500, help="Save the training state every X updates.")
    a("--checkpoints_total_limit", type=int, default=None, help="Max number of checkpoints to store.")
    a("--checkpoint_on_signal", choices=("sigterm", "any", "none"), default="sigterm",
      help="Ctrl-C (SIGINT) or SIGTERM stops every process after the same update and prints the last checkpoint and "
           "the command that resumes from it. This says which signals save a checkpoint first. Default 'sigterm': "
           "what schedulers send before a kill (SLURM, Kubernetes, spot instances), where the work since the last "
           "checkpoint would be lost; Ctrl-C is someone at the terminal who wants the prompt back now.")
    a("--on_bad_image", choices=("replace", "error"), default="replace",
      help="An image that fails to decode while training: 'replace' trains a deterministic row of the same bucket "
           "instead (logged once, listed in <output_dir>/skipped_rows.jsonl); 'error' stops the run.")
    a("--resume_from_checkpoint", type=str, default=None,
      help='A checkpoint folder saved by --checkpointing_steps, or "latest". A missing checkpoint is an error.')
    a("--validation_prompts", type=str, default=None, nargs="+",
      help="CHANGED: each prompt is generated at portrait, square and landscape bucket shapes, every "
           "--validation_epochs.")
    a("--validation_prompt", type=str, default=None, help="A single validation prompt (the other scripts' flag).")
    a("--num_validation_images", type=int, default=None,
      help="Images per prompt and shape. Default: SD 1 (train_text_to_image.py) | SDXL and LoRA 4." + NO_DEFAULT)
    a("--validation_epochs", type=int, default=None,
      help="Run validation every X epochs. Default: SD 5 | SDXL and LoRA 1." + NO_DEFAULT)
    a("--num_validation_inference_steps", type=int, default=20, help="Denoising steps for validation images.")
    a("--report_to", type=str, default="tensorboard",
      help='"tensorboard" (default), "wandb", "comet_ml", "all" or "none".')
    a("--logging_dir", type=str, default="logs", help="TensorBoard log directory, relative to output_dir.")
    a("--tracker_project_name", type=str, default="text2image-fine-tune", help="Project name for the trackers.")
    a("--debug_loss", action="store_true",
      help="CHANGED keys: log each micro-batch's loss under loss_for_row<r> for every dataset row r in it "
           "(upstream keys it by file name).")
    a("--log_batches", action="store_true",
      help="Write every batch this rank trains on (step, bucket, shape, rows, loss) to "
           "<output_dir>/batches/rank<r>.jsonl.")
    a("--push_to_hub", action="store_true", help="Whether or not to push the model to the Hub.")
    a("--hub_token", type=str, default=None, help="The token to use to push to the Model Hub.")
    a("--hub_model_id", type=str, default=None, help="The name of the repository to keep in sync with output_dir.")
    a("--local_rank", type=int, default=-1, help="For distributed training: local_rank")
    return p


def resolve_mode(args: argparse.Namespace) -> None:
    """Set ``args.lora``: LoRA if --lora or --rank, else a full fine-tune, as upstream (a LoRA-range rate without
    --full_finetune warns once, naming --rank)."""
    lora = args.lora or args.rank is not None
    if lora and args.full_finetune:
        raise UsageError("--full_finetune contradicts --lora/--rank: pick one training mode.")
    if not lora and not args.full_finetune and args.learning_rate >= LORA_LR_THRESHOLD:  # upstream's default: 1e-4
        logger.warning("--learning_rate %g with no --rank: a full fine-tune of every weight, as train_text_to_image.py "
                       "(its examples use 1e-05); for LoRA add --rank %d (or --lora).", args.learning_rate,
                       DEFAULT_RANK)
    if not lora:
        for flag, given in (("--train_text_encoder", args.train_text_encoder), ("--lora_alpha", args.lora_alpha),
                            ("--lora_dropout", args.lora_dropout), ("--use_dora", args.use_dora)):
            if given:
                raise UsageError(
                    f"{flag} configures LoRA training: add --rank {DEFAULT_RANK} (or --lora), or drop {flag}."
                )
    args.lora = lora
    if lora:
        args.rank = DEFAULT_RANK if args.rank is None else args.rank
        for flag, bad in (("--use_ema", args.use_ema), ("--resolution_conditioning", args.resolution_conditioning)):
            if bad:
                raise UsageError(f"{flag} is for full fine-tunes (its weights are not LoRA weights): drop {flag} "
                                 "or train with --full_finetune.")
        if args.train_text_encoder and args.cache_text_embeddings:
            raise UsageError("--cache_text_embeddings keeps frozen text-encoder outputs, but --train_text_encoder "
                             "trains the encoders: drop one of them.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate without loading anything heavy; errors (:class:`UsageError`) name the flag and the fix.

    Family-dependent defaults (:meth:`hf_arb.families.Family.defaults`) are filled from the model family
    (:func:`hf_arb.families.detect_family`: a local folder's configs, else the Hub id's name) and the training mode;
    ``args.family`` records the family they were chosen for.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    split_resolution(args)  # --resolution 512,1024: args.resolution is the first tier, args.resolutions all
    given = sys.argv[1:] if argv is None else argv
    args.caption_column_given = any(str(t).split("=")[0] == "--caption_column" for t in given)
    args.bucket_flags_given = [f"--{n}" for n in BUCKET_TABLE_FLAGS if getattr(args, n) != parser.get_default(n)]
    env_local_rank = int(os.environ.get("LOCAL_RANK", -1))
    if env_local_rank != -1 and env_local_rank != args.local_rank:
        args.local_rank = env_local_rank
    if (args.dataset_name is None and args.train_data_dir is None and args.instance_data_dir is None
            and args.dataset_config is None and args.encoded_dataset is None):
        raise UsageError("Need either a dataset name or a training folder: pass --dataset_name or --train_data_dir "
                         "(or --instance_data_dir with --instance_prompt).")
    if args.non_ema_revision is None:
        args.non_ema_revision = args.revision
    if args.validation_prompt and not args.validation_prompts:
        args.validation_prompts = [args.validation_prompt]
    resolve_upstream_aliases(args)  # --caption_dropout, --cond_image_column, --offset_noise, ... (issue 35)
    resolve_mode(args)
    args.family = detect_family(args.pretrained_model_name_or_path)
    args.family_defaults = {}
    for name, value in get_family(args.family).defaults(args.lora).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
            args.family_defaults[name] = value
    if args.num_validation_images == 0:  # upstream's tests turn validation off this way
        args.validation_prompts = None
    check_upstream_flags(args)  # the other dreambooth scripts' flags: family and device checks (issue 35)
    check_tier_flags(args)  # several tiers: what they do not support yet, named before the other flag checks
    check_values(args)
    check_dataset_config(args, parser.get_default("train_batch_size"))  # --dataset_config: the file, parsed
    check_mask_flags(args)  # --masked_loss and its mask source (hf_arb.train.flags.mask_flags)
    check_video_flags(args)  # --video_column: a clip run's flags (hf_arb.train.flags.video_flags)
    return args


def cli_parse(argv: list[str]) -> argparse.Namespace:
    """Parse + environment checks for the command line: a :class:`UsageError` exits with one ``error:`` line."""
    try:
        args = parse_args(argv)
        check_environment(args)
        return args
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
