#!/usr/bin/env python
"""Fine-tune Stable Diffusion 1.x / 2.x or SDXL with aspect-ratio bucketing (drop-in for diffusers' example).

This script takes the command line of diffusers' ``examples/text_to_image/train_text_to_image.py`` (same flag
names, defaults and meanings) and trains every image at close to its own aspect ratio instead of a centre-cropped
square: ``--resolution`` becomes the *pixel budget* of the buckets (about ``resolution²`` pixels per image),
every batch holds one bucket shape, and all processes take the same bucket at the same step.

SD 1.x / 2.x and SDXL are detected from the UNet config (``addition_embed_type == "text_time"`` means SDXL):
SDXL gets both text encoders, the pooled embedding and per-sample micro-conditioning time ids
``(original h, original w, crop top, crop left, bucket h, bucket w)``; SD 1.x / 2.x can get the same signal with
``--resolution_conditioning`` (zero-initialised, so step 0 equals the base model).

Launch (real commands; every flag is documented in docs/training.md):

    # one GPU
    accelerate launch train_text_to_image_arb.py \\
      --pretrained_model_name_or_path stable-diffusion-v1-5/stable-diffusion-v1-5 \\
      --dataset_name lambdalabs/naruto-blip-captions --resolution 512 --train_batch_size 4 \\
      --gradient_accumulation_steps 4 --max_train_steps 15000 --learning_rate 1e-05 \\
      --mixed_precision fp16 --output_dir sd-naruto-arb

    # 8 GPUs on one machine, SDXL, latents cached once and reused
    accelerate launch --multi_gpu --num_processes 8 train_text_to_image_arb.py \\
      --pretrained_model_name_or_path stabilityai/stable-diffusion-xl-base-1.0 \\
      --pretrained_vae_model_name_or_path madebyollin/sdxl-vae-fp16-fix \\
      --dataset_name my-org/my-annotated-dataset --bucket_preset sdxl --resolution 1024 \\
      --train_batch_size 4 --cache_latents --mixed_precision bf16 --output_dir sdxl-arb

    # 2 nodes x 8 GPUs (run on each node with its --machine_rank), PowerSGD gradient compression
    accelerate launch --multi_gpu --num_machines 2 --num_processes 16 --machine_rank 0 \\
      --main_process_ip 10.0.0.1 --main_process_port 29500 train_text_to_image_arb.py \\
      --pretrained_model_name_or_path stable-diffusion-v1-5/stable-diffusion-v1-5 \\
      --train_data_dir ./images --ddp_comm_hook power_sgd --output_dir sd-arb

    # resume an interrupted run exactly where it stopped (same batches, crops and noise)
    accelerate launch train_text_to_image_arb.py ... --resume_from_checkpoint latest

    # CPU, two processes (tests, demo): torchrun starts real gloo DDP processes
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 train_text_to_image_arb.py ... --report_to none

Nothing here imports torchvision: images go through :mod:`hf_arb.imaging` (Pillow).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger("train_text_to_image_arb")

STATE_FILE = "hf_arb_state.json"  # our part of a checkpoint: step counters and the seed
BUCKETS_FILE = "hf_arb_buckets.json"  # the BucketSet the run trained with, saved next to the pipeline
SKIPPED_ROWS_FILE = "skipped_rows.jsonl"  # images that failed to decode while training, one JSON line per row
STATS_FILE = "hf_arb_run.json"  # what the run did (steps, cache hits), for scripts and tests


# ============================================================================================ arguments
def build_parser() -> argparse.ArgumentParser:
    """Every flag of diffusers' train_text_to_image.py (same name, default, meaning) plus the bucketing flags."""
    p = argparse.ArgumentParser(description="Stable Diffusion / SDXL fine-tuning with aspect-ratio bucketing.")
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
    # --- data
    a("--dataset_name", type=str, default=None,
      help="Dataset on the Hub, a local dataset folder (save_to_disk or files datasets can read).")
    a("--dataset_config_name", type=str, default=None, help="The config of the Dataset.")
    a("--train_data_dir", type=str, default=None,
      help="A folder of images (imagefolder layout, metadata.jsonl with captions). Ignored if --dataset_name is set.")
    a("--image_column", type=str, default="image", help="The column of the dataset containing an image.")
    a("--caption_column", type=str, default="text", help="The column containing a caption or a list of captions.")
    a("--max_train_samples", type=int, default=None, help="Truncate the number of training examples to this value.")
    a("--cache_dir", type=str, default=None, help="Where downloaded models and datasets are stored.")
    a("--dataloader_num_workers", type=int, default=0, help="Subprocesses for data loading (0: main process).")
    # --- images and buckets
    a("--resolution", type=int, default=512,
      help="Pixel budget of the buckets: every bucket has about resolution² pixels (sides multiples of --bucket_step).")
    a("--center_crop", default=False, action="store_true",
      help="Centre-crop the excess after resizing to cover the bucket (default: random crop inside the bucket).")
    a("--random_flip", action="store_true", help="Randomly flip images horizontally (inside the bucket).")
    a("--bucket_preset", type=str, default="budget", choices=["budget", "novelai", "sdxl"],
      help="Bucket table: 'budget' (OneTrainer aspects scaled to --resolution²), 'novelai' or 'sdxl'.")
    a("--bucket_step", type=int, default=64, help="Bucket sides are multiples of this (budget preset).")
    a("--max_aspect_error", type=float, default=None,
      help="Skip images whose |log aspect - log bucket aspect| exceeds this (default: keep all).")
    a("--bucket_leftover", type=str, default="drop", choices=["drop", "fill", "catch_all"],
      help="What the sampler does with a bucket's last, incomplete batch (see docs/training.md).")
    a("--no_bucket_sync", action="store_true",
      help="Let every rank draw its own bucket each step (NovelAI style) instead of one bucket for all ranks.")
    a("--resolution_conditioning", action="store_true",
      help="SD 1.x/2.x: add a zero-initialised size/crop embedding (SDXL's six time ids) to the UNet.")
    a("--resolution_embed_dim", type=int, default=256, help="Sinusoid width per time id for --resolution_conditioning.")
    # --- latent / text caches
    a("--cache_latents", action="store_true",
      help="Encode every (image, bucket, crop, flip) once with the VAE and train from the cache.")
    a("--latent_cache_dir", type=str, default=None, help="Latent cache directory (default: <output_dir>/latent_cache).")
    a("--latent_cache_variants", type=int, default=None,
      help="Cached crop/flip variants per image with random crops or flips (default: min(epochs, 8)); "
           "epoch e trains on variant e %% variants. Centre crops without flip have one.")
    a("--cache_text_embeddings", action="store_true",
      help="Keep the frozen text encoders' outputs per caption in memory instead of re-encoding.")
    # --- optimisation
    a("--train_batch_size", type=int, default=16, help="Batch size (per device) for the training dataloader.")
    a("--num_train_epochs", type=int, default=100)
    a("--max_train_steps", type=int, default=None,
      help="Total number of training steps to perform. If provided, overrides num_train_epochs.")
    a("--gradient_accumulation_steps", type=int, default=1,
      help="Number of updates steps to accumulate before performing a backward/update pass.")
    a("--gradient_checkpointing", action="store_true", help="Trade compute for memory in the UNet's backward pass.")
    a("--learning_rate", type=float, default=1e-4, help="Initial learning rate (after the potential warmup period).")
    a("--scale_lr", action="store_true", default=False,
      help="Scale the learning rate by the number of GPUs, gradient accumulation steps, and batch size.")
    a("--lr_scheduler", type=str, default="constant",
      help='One of "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup".')
    a("--lr_warmup_steps", type=int, default=500, help="Number of steps for the warmup in the lr scheduler.")
    a("--snr_gamma", type=float, default=None, help="SNR weighting gamma (Min-SNR, arXiv:2303.09556). Recommended 5.0.")
    a("--use_8bit_adam", action="store_true", help="Use 8-bit Adam from bitsandbytes.")
    a("--allow_tf32", action="store_true", help="Allow TF32 on Ampere GPUs.")
    a("--use_ema", action="store_true", help="Whether to use EMA model.")
    a("--adam_beta1", type=float, default=0.9, help="The beta1 parameter for the Adam optimizer.")
    a("--adam_beta2", type=float, default=0.999, help="The beta2 parameter for the Adam optimizer.")
    a("--adam_weight_decay", type=float, default=1e-2, help="Weight decay to use.")
    a("--adam_epsilon", type=float, default=1e-08, help="Epsilon value for the Adam optimizer")
    a("--max_grad_norm", default=1.0, type=float, help="Max gradient norm.")
    a("--prediction_type", type=str, default=None,
      help="'epsilon' or 'v_prediction'; default: the scheduler's prediction_type.")
    a("--noise_offset", type=float, default=0, help="The scale of noise offset.")
    a("--proportion_empty_prompts", type=float, default=0,
      help="Proportion of captions replaced by empty strings (SDXL script's flag; 0 keeps all).")
    a("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16"],
      help="Mixed precision; default: the accelerate config's value.")
    a("--enable_xformers_memory_efficient_attention", action="store_true", help="Whether or not to use xformers.")
    a("--ddp_comm_hook", type=str, default="no", choices=["no", "fp16", "bf16", "power_sgd"],
      help="PyTorch DDP communication hook for gradient all-reduce (compression for bandwidth-bound multi-node runs).")
    a("--power_sgd_rank", type=int, default=1, help="matrix_approximation_rank of the PowerSGD hook.")
    # --- outputs, checkpoints, logging
    a("--output_dir", type=str, default="sd-model-finetuned", help="Where the model and checkpoints are written.")
    a("--seed", type=int, default=None, help="A seed for reproducible training.")
    a("--checkpointing_steps", type=int, default=500, help="Save the training state every X updates.")
    a("--checkpoints_total_limit", type=int, default=None, help="Max number of checkpoints to store.")
    a("--on_bad_image", choices=("replace", "error"), default="replace",
      help="An image that fails to decode while training: 'replace' trains a deterministic row of the same bucket "
           "instead (logged once, listed in <output_dir>/skipped_rows.jsonl); 'error' stops the run.")
    a("--resume_from_checkpoint", type=str, default=None,
      help='A checkpoint folder saved by --checkpointing_steps, or "latest". A missing checkpoint is an error.')
    a("--validation_prompts", type=str, default=None, nargs="+",
      help="Prompts evaluated every --validation_epochs at portrait, square and landscape bucket shapes.")
    a("--validation_prompt", type=str, default=None, help="A single validation prompt (SDXL script's flag).")
    a("--num_validation_images", type=int, default=1, help="Images per prompt and shape.")
    a("--validation_epochs", type=int, default=5, help="Run validation every X epochs.")
    a("--num_validation_inference_steps", type=int, default=20, help="Denoising steps for validation images.")
    a("--report_to", type=str, default="tensorboard",
      help='"tensorboard" (default), "wandb", "comet_ml", "all" or "none".')
    a("--logging_dir", type=str, default="logs", help="TensorBoard log directory, relative to output_dir.")
    a("--tracker_project_name", type=str, default="text2image-fine-tune", help="Project name for the trackers.")
    a("--log_batches", action="store_true",
      help="Write every batch this rank trains on (step, bucket, shape, rows, loss) to <output_dir>/batches/rank<r>.jsonl.")
    a("--push_to_hub", action="store_true", help="Whether or not to push the model to the Hub.")
    a("--hub_token", type=str, default=None, help="The token to use to push to the Model Hub.")
    a("--hub_model_id", type=str, default=None, help="The name of the repository to keep in sync with output_dir.")
    a("--local_rank", type=int, default=-1, help="For distributed training: local_rank")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; errors name the flag, the value and the fix."""
    args = build_parser().parse_args(argv)
    env_local_rank = int(os.environ.get("LOCAL_RANK", -1))
    if env_local_rank != -1 and env_local_rank != args.local_rank:
        args.local_rank = env_local_rank
    if args.dataset_name is None and args.train_data_dir is None:
        raise ValueError("Need either a dataset name or a training folder: pass --dataset_name or --train_data_dir.")
    if args.non_ema_revision is None:
        args.non_ema_revision = args.revision
    if args.validation_prompt and not args.validation_prompts:
        args.validation_prompts = [args.validation_prompt]
    for name in ("train_batch_size", "gradient_accumulation_steps", "resolution", "bucket_step", "checkpointing_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}.")
    if args.latent_cache_variants is not None and args.latent_cache_variants < 1:
        raise ValueError(f"--latent_cache_variants must be >= 1, got {args.latent_cache_variants}.")
    if not 0 <= args.proportion_empty_prompts <= 1:
        raise ValueError(f"--proportion_empty_prompts must be in [0, 1], got {args.proportion_empty_prompts}.")
    return args


# ========================================================================================= accelerator
def make_accelerator(args: argparse.Namespace) -> Any:
    """Accelerator with the project layout of diffusers' script and the optional DDP communication hook."""
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, ProjectConfiguration

    kwargs_handlers = []
    if args.ddp_comm_hook != "no":
        state = {"matrix_approximation_rank": args.power_sgd_rank} if args.ddp_comm_hook == "power_sgd" else {}
        kwargs_handlers.append(
            DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType(args.ddp_comm_hook), comm_state_option=state)
        )
    report_to = None if args.report_to in (None, "none", "") else args.report_to
    project = ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, args.logging_dir))
    return Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=report_to,
        project_config=project,
        kwargs_handlers=kwargs_handlers,
    )


def setup_logging(accelerator: Any) -> None:
    import datasets
    import diffusers
    import transformers

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    if not accelerator.is_local_main_process:
        logger.setLevel(logging.WARNING)
    for lib in (datasets, transformers, diffusers):
        lib.utils.logging.set_verbosity_warning() if accelerator.is_local_main_process else lib.utils.logging.set_verbosity_error()


def agree_on_seed(args: argparse.Namespace, accelerator: Any, resume_dir: Path | None) -> int:
    """One seed for every rank: --seed, else the checkpoint's, else a random one broadcast from rank 0."""
    if resume_dir is not None:
        saved = json.loads((resume_dir / STATE_FILE).read_text())["seed"]
        if args.seed is not None and args.seed != saved:
            raise ValueError(
                f"--seed {args.seed} differs from the seed of the checkpoint being resumed ({saved}); an exact "
                f"resume needs the same seed. Pass --seed {saved} or drop --seed."
            )
        return int(saved)
    if args.seed is not None:
        return int(args.seed)
    from accelerate.utils import broadcast_object_list

    box = [int.from_bytes(os.urandom(4), "little")]
    if accelerator.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    return int(box[0])


def resolve_run_args(args: argparse.Namespace, accelerator: Any, resume_dir: Path | None) -> argparse.Namespace:
    """The run's settings: a copy of the parsed ``args`` (never mutated) with the agreed seed and the learning
    rate after ``--scale_lr``."""
    seed = agree_on_seed(args, accelerator, resume_dir)
    lr = args.learning_rate
    if args.scale_lr:
        lr *= args.gradient_accumulation_steps * args.train_batch_size * accelerator.num_processes
    return argparse.Namespace(**{**vars(args), "seed": seed, "learning_rate": lr})


# ============================================================================================ models
@dataclass
class Models:
    """Everything loaded from the pretrained folder. ``sdxl`` is read from the UNet config."""

    noise_scheduler: Any
    tokenizers: list[Any]
    text_encoders: list[Any]
    vae: Any
    unet: Any
    sdxl: bool
    ema_unet: Any = None


def load_models(args: argparse.Namespace) -> Models:
    """Load scheduler, tokenizer(s), text encoder(s), VAE and UNet; freeze all but the UNet."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

    path, rev, var = args.pretrained_model_name_or_path, args.revision, args.variant
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", revision=args.non_ema_revision, variant=var)
    sdxl = unet.config.get("addition_embed_type") == "text_time"
    noise_scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler")
    if args.prediction_type is not None:
        noise_scheduler.register_to_config(prediction_type=args.prediction_type)
    tokenizers = [AutoTokenizer.from_pretrained(path, subfolder="tokenizer", revision=rev, use_fast=False)]
    text_encoders = [CLIPTextModel.from_pretrained(path, subfolder="text_encoder", revision=rev, variant=var)]
    if sdxl:
        tokenizers.append(AutoTokenizer.from_pretrained(path, subfolder="tokenizer_2", revision=rev, use_fast=False))
        text_encoders.append(
            CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder_2", revision=rev, variant=var)
        )
    if args.pretrained_vae_model_name_or_path:
        vae = AutoencoderKL.from_pretrained(args.pretrained_vae_model_name_or_path, revision=rev, variant=var)
    else:
        vae = AutoencoderKL.from_pretrained(path, subfolder="vae", revision=rev, variant=var)
    if args.resolution_conditioning:
        from hf_arb.conditioning import add_resolution_conditioning

        unet = add_resolution_conditioning(unet, embed_dim=args.resolution_embed_dim)
    vae.requires_grad_(False)
    for te in text_encoders:
        te.requires_grad_(False)
    unet.train()
    models = Models(noise_scheduler, tokenizers, text_encoders, vae, unet, sdxl)
    if args.use_ema:
        from diffusers.training_utils import EMAModel

        ema_src = UNet2DConditionModel.from_pretrained(path, subfolder="unet", revision=rev, variant=var)
        if args.resolution_conditioning:
            ema_src = add_resolution_conditioning(ema_src, embed_dim=args.resolution_embed_dim)
        models.ema_unet = EMAModel(ema_src.parameters(), model_cls=UNet2DConditionModel, model_config=ema_src.config)
    if args.enable_xformers_memory_efficient_attention:
        from diffusers.utils.import_utils import is_xformers_available

        if not is_xformers_available():
            raise ValueError("xformers is not available. Install it or drop --enable_xformers_memory_efficient_attention.")
        unet.enable_xformers_memory_efficient_attention()
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    return models


def register_checkpoint_hooks(accelerator: Any, models: Models) -> None:
    """Save the UNet (and EMA) in diffusers format inside accelerate checkpoints, and load them back."""
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


def make_optimizer(args: argparse.Namespace, unet: Any) -> torch.optim.Optimizer:
    if args.use_8bit_adam:
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise ImportError("--use_8bit_adam needs bitsandbytes: `pip install bitsandbytes`.") from e
        cls: Any = bnb.optim.AdamW8bit
    else:
        cls = torch.optim.AdamW
    return cls(unet.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
               weight_decay=args.adam_weight_decay, eps=args.adam_epsilon)


# ============================================================================================== data
def load_raw_dataset(args: argparse.Namespace) -> Any:
    """The train split, loaded the way diffusers' script does (plus local ``save_to_disk`` folders)."""
    import datasets

    if args.dataset_name is not None:
        local = Path(args.dataset_name)
        if local.is_dir() and ((local / "state.json").exists() or (local / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(str(local))
        else:
            ds = datasets.load_dataset(args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir,
                                       data_dir=args.train_data_dir)
    else:
        ds = datasets.load_dataset("imagefolder", data_files={"train": os.path.join(args.train_data_dir, "**")},
                                   cache_dir=args.cache_dir)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"The dataset has no 'train' split; its splits are {list(ds)}.")
        ds = ds["train"]
    return ds


def check_columns(ds: Any, args: argparse.Namespace) -> None:
    for flag in ("image_column", "caption_column"):
        value = getattr(args, flag)
        if value not in ds.column_names:
            raise ValueError(f"--{flag} value '{value}' needs to be one of: {', '.join(ds.column_names)}")


def bucket_set_from_args(args: argparse.Namespace) -> Any:
    from hf_arb import BucketSet

    kw = {} if args.max_aspect_error is None else {"max_aspect_error": args.max_aspect_error}
    return BucketSet.preset(args.bucket_preset, resolution=args.resolution, step=args.bucket_step, **kw)


def dataset_with_buckets(args: argparse.Namespace, accelerator: Any) -> tuple[Any, Any]:
    """Load, truncate, annotate (unless already annotated) and check that some rows are trainable.

    Returns ``(ds, buckets)``; ``ds`` keeps every row (``bucket == -1`` marks skipped ones, the sampler ignores
    them) so row indices stay those of the dataset.
    """
    from hf_arb import BucketSet, add_bucket_columns

    with accelerator.main_process_first():
        ds = load_raw_dataset(args)
        check_columns(ds, args)
        if args.max_train_samples is not None:
            ds = ds.shuffle(seed=args.seed).select(range(min(args.max_train_samples, len(ds))))
        if "bucket" in ds.column_names:
            buckets = BucketSet.from_dataset(ds)
            logger.info("Dataset already carries bucket columns: using its %d buckets as they are.", len(buckets))
        else:
            buckets = bucket_set_from_args(args)
            ds = add_bucket_columns(ds, buckets, image_column=args.image_column)
    ids = np.asarray(ds.with_format("numpy")["bucket"])
    if len(ds) == 0 or not (ids >= 0).any():
        reasons = {}
        if "skip_reason" in ds.column_names and len(ds):
            for r in ds["skip_reason"]:
                reasons[r] = reasons.get(r, 0) + 1
        raise ValueError(
            f"No trainable images: {len(ds)} rows, 0 assigned to a bucket (skip reasons: {reasons or 'none'}). "
            f"Loosen --max_aspect_error (now {args.max_aspect_error}), pick another --bucket_preset, or check the "
            "--image_column."
        )
    return ds, buckets


def make_sampler(args: argparse.Namespace, ds: Any, buckets: Any, accelerator: Any) -> Any:
    """The global epoch plan over all ranks; a plain ``accelerator.prepare`` deals each rank its batches."""
    from hf_arb import BucketBatchSampler

    return BucketBatchSampler(
        ds, args.train_batch_size, num_replicas=accelerator.num_processes, rank=accelerator.process_index,
        seed=args.seed, shuffle=True, sync_buckets=not args.no_bucket_sync, leftover=args.bucket_leftover,
        return_keys=True, buckets=buckets,
    )


def image_dataset(args: argparse.Namespace, ds: Any, buckets: Any) -> Any:
    from hf_arb import BucketedImageDataset

    return BucketedImageDataset(ds, buckets, image_column=args.image_column, caption_column=args.caption_column,
                                tokenizer=None, seed=args.seed, center_crop=args.center_crop,
                                random_flip=args.random_flip, on_bad_image=args.on_bad_image,
                                bad_image_log=Path(args.output_dir) / SKIPPED_ROWS_FILE)


def build_dataloader(args: argparse.Namespace, accelerator: Any, ds: Any, buckets: Any, models: Models, sampler: Any,
                     schedule: Schedule, weight_dtype: torch.dtype) -> tuple[Any, Any]:
    """DataLoader over images (fitted to the batch's bucket) or, with --cache_latents, over cached latents.

    Returns ``(dataloader, cache index or None)``; the loader still has to go through ``accelerator.prepare``.
    """
    if args.cache_latents:
        from hf_arb.latent_dataset import CachedLatentDataset

        cache, index, repair = build_latent_cache(args, accelerator, ds, buckets, models, sampler, schedule,
                                                  weight_dtype)
        captions = ds.select_columns([args.caption_column])[args.caption_column]
        # re-encoding in a loader worker needs the VAE there: fine on CPU, not for a CUDA VAE in a forked worker
        in_process = args.dataloader_num_workers == 0 or accelerator.device.type == "cpu"
        dataset: Any = CachedLatentDataset(cache, index, captions, seed=args.seed, repair=repair if in_process else None)
        collate = CachedLatentDataset.collate
    else:
        index = None
        dataset = image_dataset(args, ds, buckets)
        collate = dataset.collate
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                         num_workers=args.dataloader_num_workers)
    return loader, index


# =================================================================================== steps and schedule
@dataclass(frozen=True)
class Schedule:
    """Step counts, computed the way diffusers' script does for the same global batch."""

    batches_per_epoch: int  # per rank
    update_steps_per_epoch: int
    max_train_steps: int
    num_train_epochs: int
    scheduler_warmup_steps: int  # what get_scheduler receives (x num_processes, as upstream)
    scheduler_training_steps: int


def compute_schedule(batches_per_epoch: int, *, gradient_accumulation_steps: int, num_train_epochs: int,
                     max_train_steps: int | None, lr_warmup_steps: int, num_processes: int) -> Schedule:
    """diffusers' step arithmetic: updates/epoch = ceil(batches/accum); epochs from max steps if given."""
    if batches_per_epoch < 1:
        raise ValueError(
            "The sampler yields no full batch per rank: fewer trainable images per bucket than "
            "--train_batch_size x processes. Lower --train_batch_size, use --bucket_leftover fill, or add images."
        )
    per_epoch = math.ceil(batches_per_epoch / gradient_accumulation_steps)
    steps = max_train_steps if max_train_steps is not None else num_train_epochs * per_epoch
    epochs = math.ceil(steps / per_epoch)
    return Schedule(batches_per_epoch, per_epoch, steps, epochs, lr_warmup_steps * num_processes, steps * num_processes)


def micro_step_generator(seed: int, micro_step: int, rank: int, device: torch.device) -> torch.Generator:
    """A generator for one micro-batch's randomness (posterior sample, noise, timesteps, prompt dropout).

    A pure function of (seed, micro step, rank), so a resumed run draws exactly what the uninterrupted run drew,
    and cached and on-the-fly latents see the same noise.
    """
    state = np.random.SeedSequence([seed, micro_step, rank]).generate_state(2, dtype=np.uint32)
    g = torch.Generator(device=device)
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g


# ============================================================================================ caches
def build_latent_cache(args: argparse.Namespace, accelerator: Any, ds: Any, buckets: Any, models: Models,
                       sampler: Any, schedule: Schedule, weight_dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """Encode this rank's share of the missing (image, bucket, crop, flip) entries; return (cache, index, repair)."""
    from accelerate.utils import gather_object

    from hf_arb import latents as lat

    cache = lat.LatentCache(args.latent_cache_dir or os.path.join(args.output_dir, "latent_cache"))
    vae = models.vae.to(accelerator.device, dtype=torch.float32)
    vae_id = lat.vae_fingerprint(vae)
    ids = np.asarray(ds.with_format("numpy")["bucket"])
    rows = np.flatnonzero(ids >= 0)
    share = rows[lat.plan_share(len(rows), accelerator.process_index, accelerator.num_processes)]
    mine = dict(zip(share.tolist(), lat.content_hashes(ds, args.image_column, share.tolist())))
    hashes_by_row: dict[int, str] = {}
    for part in gather_object([mine]) if accelerator.num_processes > 1 else [mine]:
        hashes_by_row.update(part)
    hashes = [hashes_by_row.get(i, "") for i in range(len(ds))]
    pairs = {(int(r), int(ids[r])) for r in rows}
    if args.bucket_leftover != "drop":  # leftovers may be trained at another bucket: read the all-ranks plan
        for epoch in range(schedule.num_train_epochs):
            plan = sampler.plan(epoch)  # (steps, world, batch): every rank's rows
            for r in range(plan.shape[1]):
                targets = sampler.batch_buckets(epoch, rank=r)  # (steps,)
                pairs.update(zip(plan[:, r].ravel().tolist(), np.repeat(targets, plan.shape[2]).tolist()))
    if args.center_crop and not args.random_flip:
        variants = 1  # every epoch fits an image the same way
    else:
        variants = args.latent_cache_variants or min(schedule.num_train_epochs, 8)
    images = image_dataset(args, ds, buckets)
    index = lat.build_index(sorted(pairs), hashes, lambda row, b, v: images.fit_row(row, b, v).key(),
                            variants=variants, vae_id=vae_id)

    def load_batch(keys: list[tuple[int, int, int]]) -> dict[str, Any]:
        return images.collate([images[k] for k in keys])

    @torch.no_grad()
    def encode(pixels: torch.Tensor) -> torch.Tensor:
        dist = vae.encode(pixels.to(accelerator.device, torch.float32)).latent_dist
        return torch.stack([dist.mean, dist.std], dim=1)  # (B, 2, C, h, w)

    t0 = time.perf_counter()
    lat.fill_cache(cache, index, rank=accelerator.process_index, world=accelerator.num_processes,
                   load_batch=load_batch, encode=encode, batch_size=args.train_batch_size)
    accelerator.wait_for_everyone()
    mine = [(index.encoded, index.reused, index.repaired)]
    counts = gather_object(mine) if accelerator.num_processes > 1 else mine
    index.encoded, index.reused, index.repaired = (sum(c[i] for c in counts) for i in range(3))
    logger.info("Latent cache %s: encoded %d (%d of them damaged entries), reused %d entries (%d variant(s) per "
                "image) in %.1f s.", cache.root, index.encoded, index.repaired, index.reused, index.variants,
                time.perf_counter() - t0)
    models.vae.to(dtype=weight_dtype)
    return cache, index, latent_repair(cache, index, load_batch, models.vae)


def latent_repair(cache: Any, index: Any, load_batch: Any, vae: Any) -> Any:
    """``(row, bucket, epoch)`` → encode that cache entry again (an entry damaged while training; see hf_arb.latents)."""

    @torch.no_grad()
    def repair(row: int, bucket: int, epoch: int) -> None:
        batch = load_batch([(row, bucket, epoch % index.variants)])
        dist = vae.encode(batch["pixel_values"].to(vae.device, vae.dtype)).latent_dist
        stats = torch.stack([dist.mean, dist.std], dim=1)[0].float().cpu().numpy()  # (2, C, h, w)
        cache.write(index.key(row, bucket, epoch), stats, {
            "original_size": batch["original_sizes"][0].tolist(), "crop_top_left": batch["crop_top_lefts"][0].tolist(),
            "target_size": batch["target_sizes"][0].tolist()})

    return repair


class TextEncoder:
    """Captions → (hidden states ``(B, 77, D)``, pooled ``(B, P)`` or None); optionally memoised per caption."""

    def __init__(self, models: Models, device: torch.device, dtype: torch.dtype, cache: bool) -> None:
        self.models, self.device, self.dtype = models, device, dtype
        self.memo: dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None = {} if cache else None

    @torch.no_grad()
    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, pooled = [], None
        for tok, te in zip(self.models.tokenizers, self.models.text_encoders):
            ids = tok(captions, max_length=tok.model_max_length, padding="max_length", truncation=True,
                      return_tensors="pt").input_ids.to(self.device)
            if self.models.sdxl:
                out = te(ids, output_hidden_states=True)
                hidden.append(out.hidden_states[-2])
                pooled = getattr(out, "text_embeds", None)
            else:
                hidden.append(te(ids)[0])
        return torch.cat(hidden, dim=-1).to(self.dtype), None if pooled is None else pooled.to(self.dtype)

    def __call__(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.memo is None:
            return self._encode(captions)
        todo = sorted({c for c in captions if c not in self.memo})
        if todo:
            h, p = self._encode(todo)
            for i, c in enumerate(todo):
                self.memo[c] = (h[i].cpu(), None if p is None else p[i].cpu())
        hidden = torch.stack([self.memo[c][0] for c in captions]).to(self.device)
        pooled = None if self.models.sdxl is False else torch.stack([self.memo[c][1] for c in captions]).to(self.device)
        return hidden, pooled


# ============================================================================================ training
@dataclass
class Progress:
    """Counters saved with every checkpoint (``hf_arb_state.json``): optimizer steps, micro-batches trained
    (per rank; where the data resumes, via ``hf_arb.resume_dataloader``, and the noise stream's key) and the seed."""

    global_step: int = 0
    seed: int = 0
    micro_step: int = 0


def resolve_resume_dir(args: argparse.Namespace) -> Path | None:
    """The checkpoint folder to resume from, or None; a missing or damaged one is an error (never a silent fresh
    start). ``latest`` skips incomplete or damaged checkpoints (with a warning naming them) for the newest complete one.
    """
    from hf_arb.checkpointing import checkpoint_problems, find_resumable, list_checkpoints

    if not args.resume_from_checkpoint:
        return None
    out = Path(args.output_dir)
    model_dirs = ("unet", "unet_ema") if args.use_ema else ("unet",)
    if args.resume_from_checkpoint == "latest":
        path, skipped = find_resumable(out, STATE_FILE, model_dirs)
        if skipped:
            logger.warning("--resume_from_checkpoint latest: skipping incomplete or damaged checkpoint(s): %s",
                           "; ".join(skipped))
        if path is None:
            raise FileNotFoundError(
                f"--resume_from_checkpoint latest: no checkpoint-* folder in {out} can be resumed from"
                + (f" (skipped: {'; '.join(skipped)})" if skipped else "")
                + ". Drop the flag to start a new run, or point --output_dir at the run to resume."
            )
        return path
    path = Path(args.resume_from_checkpoint)
    if not path.is_dir():
        path = out / path.name
    if not path.is_dir() or not (path / STATE_FILE).exists():
        raise FileNotFoundError(
            f"--resume_from_checkpoint {args.resume_from_checkpoint!r}: {path} is not a checkpoint of this script "
            f"(missing folder or {STATE_FILE}). Available: {[d.name for d in list_checkpoints(out)] or 'none'}."
        )
    problems = checkpoint_problems(path, STATE_FILE, model_dirs)
    if problems:
        raise ValueError(
            f"Checkpoint {path} is damaged: {problems[0]}{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}"
            ". Resume from another checkpoint, or pass --resume_from_checkpoint latest to take the newest complete one."
        )
    return path


def restore(accelerator: Any, resume_dir: Path | None, seed: int) -> Progress:
    """Load accelerate's state (UNet, optimizer, scheduler, sampler cursor, RNG) and our counters, if resuming."""
    if resume_dir is None:
        return Progress(seed=seed)
    accelerator.print(f"Resuming from checkpoint {resume_dir}")
    accelerator.load_state(str(resume_dir))
    return Progress(**json.loads((resume_dir / STATE_FILE).read_text()))


def check_resumed_step(args: argparse.Namespace, accelerator: Any, progress: Progress, sampler: Any, optimizer: Any,
                       resume_dir: Path | None) -> None:
    """The checkpoint's global_step must agree with its micro-batch counter and the optimizer's step count."""
    from hf_arb.checkpointing import expected_global_step

    if resume_dir is None:
        return
    epoch, position = sampler.locate(progress.micro_step)  # where the saved micro-batch counter resumes
    expected = expected_global_step({"steps_per_epoch": sampler.steps_per_epoch, "epoch": epoch,
                                     "batches_consumed": position}, args.gradient_accumulation_steps)
    try:  # plain torch layout; wrappers (DeepSpeed, 8-bit) that differ are checked through the sampler only
        state = optimizer.state_dict().get("state", {})
        steps = {float(v["step"]) for v in state.values() if isinstance(v, dict) and "step" in v}
    except (AttributeError, TypeError, ValueError, RuntimeError):
        steps = set()
    opt_step = int(max(steps)) if steps else None
    # fp16 loss scaling skips optimizer steps on overflow: there the optimizer may only lag behind
    opt_ok = opt_step is None or opt_step == progress.global_step or (
        args.mixed_precision == "fp16" and opt_step <= progress.global_step)
    if expected != progress.global_step or not opt_ok:
        raise ValueError(
            f"Checkpoint {resume_dir} is inconsistent: {STATE_FILE} says global_step {progress.global_step}, but its "
            f"micro_step {progress.micro_step} is at update {expected} (with --gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps}) and the optimizer at step {opt_step}. The file was edited or the "
            "flags differ from the run that saved it; resume with the same flags or from another checkpoint."
        )


def save_checkpoint(args: argparse.Namespace, accelerator: Any, progress: Progress) -> Path:
    """accelerate's state (UNet, optimizer, LR scheduler, sampler, RNG) + our counters, written to a temporary
    folder, renamed into place once complete, and only then are old checkpoints pruned (see hf_arb.checkpointing)."""
    from hf_arb.checkpointing import publish_checkpoint, tmp_checkpoint_dir

    tmp = tmp_checkpoint_dir(args.output_dir, progress.global_step)
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)  # left by a killed run
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(progress.__dict__, indent=1))
    accelerator.wait_for_everyone()
    path = Path(args.output_dir) / f"checkpoint-{progress.global_step}"
    if accelerator.is_main_process:
        path = publish_checkpoint(tmp, args.checkpoints_total_limit)
    accelerator.wait_for_everyone()
    return path


def unet_forward(models: Models, unet: Any, noisy: torch.Tensor, timesteps: torch.Tensor, hidden: torch.Tensor,
                 pooled: torch.Tensor | None, time_ids: torch.Tensor, resolution_dim: int | None) -> torch.Tensor:
    """One UNet call with the right conditioning for SDXL, resolution-conditioned SD, or stock SD."""
    if models.sdxl:
        cond = {"text_embeds": pooled, "time_ids": time_ids.to(hidden.dtype)}
        return unet(noisy, timesteps, hidden, added_cond_kwargs=cond).sample
    if resolution_dim is not None:
        from hf_arb.conditioning import resolution_class_labels

        labels = resolution_class_labels(time_ids, resolution_dim).to(hidden.dtype)
        return unet(noisy, timesteps, hidden, class_labels=labels).sample
    return unet(noisy, timesteps, hidden).sample


def diffusion_loss(args: argparse.Namespace, models: Models, unet: Any, batch: dict[str, Any], text: TextEncoder,
                   gen: torch.Generator, weight_dtype: torch.dtype, resolution_dim: int | None) -> torch.Tensor:
    """The diffusers loss for one micro-batch: latents → noise → UNet → (SNR-weighted) MSE."""
    from diffusers.training_utils import compute_snr

    from hf_arb.conditioning import sdxl_time_ids

    device, sched, vae = gen.device, models.noise_scheduler, models.vae
    if "latent_stats" in batch:  # cached posterior: (B, 2, C, h, w)
        stats = batch["latent_stats"].to(device, torch.float32)
        mean, std = stats[:, 0], stats[:, 1]
    else:
        with torch.no_grad():
            dist = vae.encode(batch["pixel_values"].to(device, vae.dtype)).latent_dist
            mean, std = dist.mean.float(), dist.std.float()
    latents = mean + std * torch.randn(mean.shape, generator=gen, device=device)
    shift = vae.config.get("shift_factor") or 0.0
    latents = ((latents - shift) * vae.config.scaling_factor).to(weight_dtype)
    bsz = latents.shape[0]
    noise = torch.randn(latents.shape, generator=gen, device=device, dtype=latents.dtype)
    if args.noise_offset:
        noise = noise + args.noise_offset * torch.randn((bsz, latents.shape[1], 1, 1), generator=gen, device=device,
                                                          dtype=latents.dtype)
    timesteps = torch.randint(0, sched.config.num_train_timesteps, (bsz,), generator=gen, device=device).long()
    if args.input_perturbation:
        perturbed = noise + args.input_perturbation * torch.randn(noise.shape, generator=gen, device=device,
                                                                  dtype=noise.dtype)
        noisy = sched.add_noise(latents, perturbed, timesteps)
    else:
        noisy = sched.add_noise(latents, noise, timesteps)
    captions = list(batch["captions"])
    if args.proportion_empty_prompts:
        drop = torch.rand(bsz, generator=gen, device=device) < args.proportion_empty_prompts
        captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
    hidden, pooled = text(captions)
    time_ids = sdxl_time_ids(batch["original_sizes"], batch["crop_top_lefts"], batch["target_sizes"], device=device)
    if sched.config.prediction_type == "epsilon":
        target = noise
    elif sched.config.prediction_type == "v_prediction":
        target = sched.get_velocity(latents, noise, timesteps)
    else:
        raise ValueError(f"Unknown prediction type {sched.config.prediction_type}; use epsilon or v_prediction.")
    pred = unet_forward(models, unet, noisy, timesteps, hidden, pooled, time_ids, resolution_dim)
    if args.snr_gamma is None:
        return F.mse_loss(pred.float(), target.float(), reduction="mean")
    snr = compute_snr(sched, timesteps)
    if sched.config.prediction_type == "v_prediction":
        snr = snr + 1
    weights = torch.clamp(snr, max=args.snr_gamma) / snr
    loss = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3)) * weights
    return loss.mean()


def batch_captions(batch: dict[str, Any]) -> dict[str, Any]:
    """Check the data pipeline's batch carries ``captions`` (a list of strings, one per sample)."""
    if "captions" not in batch:
        raise KeyError(f"The data pipeline's batch has no captions; keys are {sorted(batch)}.")
    return batch


# ========================================================================================= validation
def validation_shapes(buckets: Any) -> list[tuple[int, int]]:
    """Portrait, square and landscape bucket ``(w, h)``: the buckets closest to 2:3, 1:1 and 3:2 in log aspect."""
    res = np.asarray(buckets.resolutions)
    log_aspect = np.log(res[:, 0] / res[:, 1])
    out: list[tuple[int, int]] = []
    for target in (np.log(2 / 3), 0.0, np.log(3 / 2)):
        i = int(np.lexsort((-res[:, 0] * res[:, 1], np.round(np.abs(log_aspect - target), 9)))[0])
        wh = (int(res[i, 0]), int(res[i, 1]))
        if wh not in out:
            out.append(wh)
    return out


def image_grid(rows: list[list[Any]]) -> Any:
    """Paste PIL images of different sizes into one grid (one row per prompt, one column per shape)."""
    from PIL import Image

    cols = max(len(r) for r in rows)
    cw = [max(r[c].width for r in rows if c < len(r)) for c in range(cols)]
    rh = [max(im.height for im in r) for r in rows]
    grid = Image.new("RGB", (sum(cw), sum(rh)), "white")
    y = 0
    for r, h in zip(rows, rh):
        x = 0
        for c, im in enumerate(r):
            grid.paste(im, (x, y))
            x += cw[c]
        y += h
    return grid


def pipeline_class(models: Models, args: argparse.Namespace) -> Any:
    if models.sdxl:
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline
    if args.resolution_conditioning:
        from hf_arb.conditioning import StableDiffusionResolutionPipeline

        return StableDiffusionResolutionPipeline
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline


def build_pipeline(args: argparse.Namespace, models: Models, unet: Any, dtype: torch.dtype, *,
                   final: bool = False) -> Any:
    """The inference pipeline around the trained UNet.

    For validation it reuses the loaded (frozen) components and drops the safety checker, as diffusers' script
    does; the ``final`` pipeline loads the frozen components fresh in float32 (keeping the base model's safety
    checker), plus the replacement VAE if one was given.
    """
    cls = pipeline_class(models, args)
    parts: dict[str, Any] = {"unet": unet}
    if not final:
        parts.update(vae=models.vae, text_encoder=models.text_encoders[0], tokenizer=models.tokenizers[0])
        if models.sdxl:
            parts.update(text_encoder_2=models.text_encoders[1], tokenizer_2=models.tokenizers[1])
        else:
            parts.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    elif args.pretrained_vae_model_name_or_path:
        parts["vae"] = models.vae.to(torch.float32)
    return cls.from_pretrained(args.pretrained_model_name_or_path, revision=args.revision, variant=args.variant,
                               dtype=dtype, **parts)


def log_validation(args: argparse.Namespace, accelerator: Any, models: Models, unet: Any, buckets: Any,
                   step: int, dtype: torch.dtype) -> Path | None:
    """Generate every prompt at portrait / square / landscape buckets, save one grid PNG, log it to trackers."""
    if not args.validation_prompts or not accelerator.is_main_process:
        return None
    pipe = build_pipeline(args, models, unet, dtype).to(accelerator.device)
    pipe.set_progress_bar_config(disable=True)
    shapes = validation_shapes(buckets)
    rows = []
    for i, prompt in enumerate(args.validation_prompts):
        row = []
        for w, h in shapes:
            for j in range(args.num_validation_images):
                g = torch.Generator(device=accelerator.device).manual_seed(args.seed + 1000 * i + j)
                row.append(pipe(prompt, height=h, width=w, num_inference_steps=args.num_validation_inference_steps,
                                generator=g).images[0])
        rows.append(row)
    grid = image_grid(rows)
    path = Path(args.output_dir) / "validation" / f"step-{step:06d}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_image("validation", np.asarray(grid), step, dataformats="HWC")
        elif tracker.name == "wandb":
            import wandb

            tracker.log({"validation": [wandb.Image(grid, caption=" | ".join(args.validation_prompts))]})
    logger.info("Validation grid (%s at %s) saved to %s", args.validation_prompts, shapes, path)
    del pipe
    return path


# ============================================================================================ outputs
def save_model_card(args: argparse.Namespace, repo_id: str, buckets: Any, *, sdxl: bool,
                    images: list[str] | None = None, stats: dict[str, Any] | None = None) -> Path:
    """Write ``README.md`` in output_dir: works with or without validation images and trackers."""
    base = args.pretrained_model_name_or_path
    tags = ["stable-diffusion-xl" if sdxl else "stable-diffusion", "text-to-image", "diffusers",
            "diffusers-training", "aspect-ratio-bucketing", "hf_arb"]
    front = ["---", "license: creativeml-openrail-m", f"base_model: {base}", "library_name: diffusers", "tags:"]
    front += [f"- {t}" for t in tags] + ["inference: true", "---", ""]
    labels = buckets.labels()
    body = [
        f"# {repo_id}", "",
        f"Fine-tuned from **{base}** with aspect-ratio bucketing (hf_arb's `train_text_to_image_arb.py`): each "
        "image was trained at close to its own aspect ratio, and every batch held one bucket shape.", "",
        f"* buckets: {len(labels)} ({', '.join(labels[:12])}{', ...' if len(labels) > 12 else ''}), "
        f"pixel budget about {args.resolution}² (`--bucket_preset {args.bucket_preset}`)",
        f"* steps: {stats.get('global_step') if stats else args.max_train_steps}, batch size {args.train_batch_size} "
        f"per device, gradient accumulation {args.gradient_accumulation_steps}, learning rate {args.learning_rate}",
        f"* mixed precision: {args.mixed_precision}; dataset: {args.dataset_name or args.train_data_dir}", "",
    ]
    if args.resolution_conditioning and not sdxl:
        body += ["The UNet takes SDXL-style size/crop conditioning; load it with "
                 "`hf_arb.conditioning.StableDiffusionResolutionPipeline`.", ""]
    body += ["## Use", "", "```python", "import torch",
             f"from diffusers import {'StableDiffusionXLPipeline' if sdxl else 'StableDiffusionPipeline'} as Pipeline",
             f'pipe = Pipeline.from_pretrained("{repo_id}", torch_dtype=torch.float16).to("cuda")',
             'image = pipe("a photo", height=768, width=512).images[0]', "```", ""]
    if args.validation_prompts:
        body += ["## Validation", "", "Prompts: " + "; ".join(f"`{p}`" for p in args.validation_prompts), ""]
        body += [f"![validation]({Path(p).relative_to(args.output_dir).as_posix()})" for p in images or []]
        body += [""]
    if args.report_to not in (None, "none", ""):
        body += [f"Training curves were logged to {args.report_to} (project `{args.tracker_project_name}`).", ""]
    path = Path(args.output_dir) / "README.md"
    path.write_text("\n".join(front + body))
    return path


def save_final(args: argparse.Namespace, accelerator: Any, models: Models, unet: Any, buckets: Any,
               progress: Progress, validation_images: list[str], stats: dict[str, Any]) -> None:
    """Save the pipeline (stock diffusers class unless --resolution_conditioning), buckets, card, push."""
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    unet = accelerator.unwrap_model(unet)
    if models.ema_unet is not None:
        models.ema_unet.copy_to(unet.parameters())
    pipe = build_pipeline(args, models, unet, torch.float32, final=True)
    if args.prediction_type is not None:  # sample with the objective the UNet was trained on
        pipe.scheduler.register_to_config(prediction_type=args.prediction_type)
    pipe.save_pretrained(args.output_dir)
    (Path(args.output_dir) / BUCKETS_FILE).write_text(json.dumps(buckets.to_dict(), indent=1))
    done = Path(args.output_dir) / "validation" / f"step-{progress.global_step:06d}.png"
    if not done.exists():  # the last epoch's validation may already show these weights
        last = log_validation(args, accelerator, models, unet, buckets, progress.global_step, torch.float32)
        if last is not None:
            validation_images.append(str(last))
    if args.push_to_hub:
        from huggingface_hub import create_repo, upload_folder

        repo_id = create_repo(repo_id=args.hub_model_id or Path(args.output_dir).name, exist_ok=True,
                              token=args.hub_token).repo_id
        save_model_card(args, repo_id, buckets, sdxl=models.sdxl, images=validation_images, stats=stats)
        upload_folder(repo_id=repo_id, folder_path=args.output_dir, commit_message="End of training",
                      ignore_patterns=["step_*", "epoch_*", "checkpoint-*", "latent_cache/*", "batches/*"],
                      token=args.hub_token)


def startup_report(accelerator: Any, ds: Any, buckets: Any, sampler: Any, schedule: Schedule,
                   args: argparse.Namespace, models: Models) -> None:
    """The table users look at first: buckets, rows per bucket, the sampler's report, the step arithmetic."""
    if not accelerator.is_main_process:
        return
    ids = np.asarray(ds.with_format("numpy")["bucket"])
    counts = np.bincount(ids[ids >= 0], minlength=len(buckets))
    lines = [f"{'bucket':>11} {'aspect':>7} {'rows':>9}"]
    for i in buckets.portrait_to_landscape():
        w, h = buckets.resolutions[i]
        lines.append(f"{w:>5} x {h:<5} {w / h:7.3f} {int(counts[i]):>9,}")
    lines.append(f"skipped: {int((ids < 0).sum()):,} of {len(ids):,} rows")
    print("\n".join(lines), flush=True)
    report = getattr(sampler, "report", None)
    if callable(report):
        print(report(), flush=True)
    total = args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    print(f"***** Running training ({'SDXL' if models.sdxl else 'SD'}) *****\n"
          f"  Num examples = {int((ids >= 0).sum())}\n  Num Epochs = {schedule.num_train_epochs}\n"
          f"  Instantaneous batch size per device = {args.train_batch_size}\n"
          f"  Total train batch size (w. parallel, distributed & accumulation) = {total}\n"
          f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}\n"
          f"  Total optimization steps = {schedule.max_train_steps}", flush=True)


# =============================================================================================== main
def count_calls(obj: Any, name: str) -> list[int]:
    """Wrap ``obj.name`` to count its calls (the run statistics report how often the VAE encoder ran)."""
    counter = [0]
    original = getattr(obj, name)

    def wrapped(*a: Any, **kw: Any) -> Any:
        counter[0] += 1
        return original(*a, **kw)

    setattr(obj, name, wrapped)
    return counter


def weight_dtype_of(accelerator: Any) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run a training; returns the run statistics (also written to ``<output_dir>/hf_arb_run.json``)."""
    from accelerate.utils import set_seed
    from diffusers.optimization import get_scheduler
    from tqdm.auto import tqdm

    args = parse_args(argv)
    accelerator = make_accelerator(args)
    setup_logging(accelerator)
    resume_dir = resolve_resume_dir(args)
    args = resolve_run_args(args, accelerator, resume_dir)
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)

    ds, buckets = dataset_with_buckets(args, accelerator)
    models = load_models(args)
    encode_calls = count_calls(models.vae, "encode")
    register_checkpoint_hooks(accelerator, models)
    if args.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    optimizer = make_optimizer(args, models.unet)
    weight_dtype = weight_dtype_of(accelerator)

    sampler = make_sampler(args, ds, buckets, accelerator)
    schedule = compute_schedule(sampler.steps_per_epoch, gradient_accumulation_steps=args.gradient_accumulation_steps,
                                num_train_epochs=args.num_train_epochs, max_train_steps=args.max_train_steps,
                                lr_warmup_steps=args.lr_warmup_steps, num_processes=accelerator.num_processes)
    dataloader, index = build_dataloader(args, accelerator, ds, buckets, models, sampler, schedule, weight_dtype)
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=schedule.scheduler_warmup_steps,
                                 num_training_steps=schedule.scheduler_training_steps)
    # as diffusers' scripts: one plain prepare call; the sampler's global plan is dealt to the ranks by accelerate
    from hf_arb.sampling.accelerate import fill_deepspeed_micro_batch

    fill_deepspeed_micro_batch(accelerator, sampler)  # DeepSpeed cannot read a batch sampler's batch size
    unet, optimizer, dataloader, lr_scheduler = accelerator.prepare(models.unet, optimizer, dataloader, lr_scheduler)
    accelerator.register_for_checkpointing(sampler)  # its plan check refuses a checkpoint of another dataset/seed
    if models.ema_unet is not None:
        models.ema_unet.to(accelerator.device)
    for te in models.text_encoders:
        te.to(accelerator.device, dtype=weight_dtype)
    models.vae.to(accelerator.device, dtype=torch.float32 if models.sdxl and not args.pretrained_vae_model_name_or_path
                  else weight_dtype)
    if accelerator.is_main_process and accelerator.trackers == [] and args.report_to not in (None, "none", ""):
        config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers(args.tracker_project_name, config)
    startup_report(accelerator, ds, buckets, sampler, schedule, args, models)

    progress = restore(accelerator, resume_dir, args.seed)
    check_resumed_step(args, accelerator, progress, sampler, optimizer, resume_dir)
    resolution_dim = None
    if args.resolution_conditioning and not models.sdxl:
        from hf_arb.conditioning import resolution_embed_dim

        resolution_dim = resolution_embed_dim(accelerator.unwrap_model(unet))
    stats = train_loop(args, accelerator, models, unet, optimizer, lr_scheduler, dataloader, sampler, buckets,
                       schedule, progress, weight_dtype, resolution_dim, tqdm)
    stats.update(vae_encode_calls=encode_calls[0], latents_encoded=index.encoded if index else None,
                 latents_reused=index.reused if index else None,
                 latents_repaired=index.repaired if index else None,
                 bad_images=report_bad_images(args, accelerator), num_processes=accelerator.num_processes, sdxl=models.sdxl, seed=args.seed,
                 schedule=schedule.__dict__)
    save_final(args, accelerator, models, unet, buckets, progress, stats.setdefault("validation_images", []), stats)
    if accelerator.is_main_process:
        (Path(args.output_dir) / STATS_FILE).write_text(json.dumps(stats, indent=1, default=str))
    accelerator.end_training()
    return stats


def report_bad_images(args: argparse.Namespace, accelerator: Any) -> int:
    """Rows whose image failed to decode during the run (and were replaced), from skipped_rows.jsonl; warns once."""
    from hf_arb.bad_images import read_bad_rows

    accelerator.wait_for_everyone()
    path = Path(args.output_dir) / SKIPPED_ROWS_FILE
    rows = read_bad_rows(path)
    if rows and accelerator.is_main_process:
        logger.warning("%d row(s) had images that could not be decoded and were replaced by rows of the same bucket; "
                       "see %s. Re-annotate with `hf-arb annotate ... --verify` to skip them up front.", len(rows), path)
    return len(rows)


def train_loop(args: argparse.Namespace, accelerator: Any, models: Models, unet: Any, optimizer: Any,
               lr_scheduler: Any, dataloader: Any, sampler: Any, buckets: Any, schedule: Schedule,
               progress: Progress, weight_dtype: torch.dtype, resolution_dim: int | None, tqdm: Any) -> dict[str, Any]:
    """Epochs of bucketed batches; checkpoints mid-epoch resume with the same batches, crops and noise."""
    text = TextEncoder(models, accelerator.device, weight_dtype, cache=args.cache_text_embeddings)
    labels = buckets.labels()
    trace = None
    if args.log_batches:
        trace_path = Path(args.output_dir) / "batches" / f"rank{accelerator.process_index}.jsonl"
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        trace = trace_path.open("a" if progress.global_step else "w")
    bar = tqdm(range(schedule.max_train_steps), initial=progress.global_step, desc="Steps",
               disable=not accelerator.is_local_main_process)
    validation_images: list[str] = []
    losses: list[float] = []
    train_loss, bucket_losses = 0.0, {}
    images_seen, t_start = 0, time.perf_counter()
    from hf_arb import resume_dataloader

    first_loader, first_epoch = resume_dataloader(accelerator, dataloader, progress.micro_step)
    for epoch in range(first_epoch, schedule.num_train_epochs):  # a resumed run continues mid-epoch
        if progress.global_step >= schedule.max_train_steps:
            break
        if epoch == first_epoch:
            loader = first_loader
        else:
            dataloader.set_epoch(epoch)
            loader = dataloader
        for batch in loader:
            micro = progress.micro_step  # this batch's index since the start of training (per rank)
            progress.micro_step += 1
            gen = micro_step_generator(args.seed, micro, accelerator.process_index, accelerator.device)
            batch = batch_captions(batch)
            bucket = int(batch["buckets"][0])
            with accelerator.accumulate(unet):
                loss = diffusion_loss(args, models, unet, batch, text, gen, weight_dtype, resolution_dim)
                avg = accelerator.gather(loss.detach().repeat(args.train_batch_size)).mean()
                train_loss += avg.item() / args.gradient_accumulation_steps
                # (bucket, loss) of every rank: with --no_bucket_sync the ranks train different buckets
                pairs = accelerator.gather(torch.stack([torch.tensor(float(bucket), device=loss.device),
                                                        loss.detach().float()])[None])  # (world, 2)
                for b, value in pairs.tolist():
                    bucket_losses.setdefault(int(b), []).append(value)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(unet.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            images_seen += len(batch["captions"]) * accelerator.num_processes
            if trace is not None:
                tensor = batch["latent_stats"] if "latent_stats" in batch else batch["pixel_values"]
                trace.write(json.dumps({"step": progress.global_step, "micro": micro, "epoch": epoch,
                                        "bucket": bucket, "label": labels[bucket], "shape": list(tensor.shape),
                                        "rows": [int(r) for r in batch["rows"]], "loss": float(loss.detach()),
                                        "time_ids_first": batch["original_sizes"][0].tolist()
                                        + batch["crop_top_lefts"][0].tolist() + batch["target_sizes"][0].tolist()})
                            + "\n")
                trace.flush()
            if not accelerator.sync_gradients:
                continue
            if models.ema_unet is not None:
                models.ema_unet.step(unet.parameters())
            progress.global_step += 1
            bar.update(1)
            losses.append(train_loss)
            logs = {"train_loss": train_loss, "lr": lr_scheduler.get_last_lr()[0]}
            for b, values in bucket_losses.items():
                logs[f"loss/{labels[b]}"] = sum(values) / len(values)
            accelerator.log(logs, step=progress.global_step)
            bar.set_postfix(loss=f"{train_loss:.4f}", bucket=labels[bucket])
            train_loss, bucket_losses = 0.0, {}
            if progress.global_step % args.checkpointing_steps == 0:
                save_checkpoint(args, accelerator, progress)
            if progress.global_step >= schedule.max_train_steps:
                break
        if args.validation_prompts and (epoch + 1) % args.validation_epochs == 0:
            if models.ema_unet is not None:
                models.ema_unet.store(unet.parameters())
                models.ema_unet.copy_to(unet.parameters())
            path = log_validation(args, accelerator, models, accelerator.unwrap_model(unet), buckets,
                                  progress.global_step, weight_dtype)
            if path:
                validation_images.append(str(path))
            if models.ema_unet is not None:
                models.ema_unet.restore(unet.parameters())
    bar.close()
    if trace is not None:
        trace.close()
    seconds = time.perf_counter() - t_start
    return {"global_step": progress.global_step, "losses": losses, "validation_images": validation_images,
            "train_seconds": seconds, "train_images": images_seen,
            "images_per_second": images_seen / seconds if seconds > 0 else None}


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as err:  # argument/data errors: one clear line, no traceback noise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
