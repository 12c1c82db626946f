#!/usr/bin/env python
"""Fine-tune Stable Diffusion 1.x / 2.x, SDXL, SD3 / SD3.5 or Flux.1, in full or with LoRA, with aspect-ratio bucketing.

This script takes the command line of diffusers' four ``examples/text_to_image`` scripts
(``train_text_to_image.py``, ``_sdxl.py``, ``_lora.py``, ``_lora_sdxl.py``: same flag names, defaults and
meanings) and trains every image at close to its own aspect ratio instead of a centre-cropped square: ``--resolution`` becomes the *pixel budget* of the buckets (about ``resolution²`` pixels per image),
every batch holds one bucket shape, and all processes take the same bucket at the same step.

SD 1.x / 2.x and SDXL are detected from the UNet config (``addition_embed_type == "text_time"`` means SDXL):
SDXL gets both text encoders, the pooled embedding and per-sample micro-conditioning time ids
``(original h, original w, crop top, crop left, bucket h, bucket w)``; SD 1.x / 2.x can get the same signal with
``--resolution_conditioning`` (zero-initialised, so step 0 equals the base model).

SD3 / SD3.5 and Flux.1 are detected from ``model_index.json`` (or the ``transformer`` subfolder) and train with the
flow-matching objective of diffusers' SD3 / Flux scripts (``--weighting_scheme``, ``--precondition_outputs``,
Flux's ``--guidance_scale``); their code lives in :mod:`hf_arb.families`. With ``--shift_by_resolution`` (the
default where the scheduler shifts dynamically, as Flux's does) every batch's sigmas are shifted with the ``mu``
the stock pipeline uses for that bucket's height x width.

``--rank N`` (or ``--lora``) trains LoRA adapters with peft instead of the whole UNet and writes
``pytorch_lora_weights.safetensors``; without them it is a full fine-tune, as upstream (a learning rate of 5e-5 or
more warns once unless ``--full_finetune`` says so; see docs/training.md, "LoRA"). Every output folder loads in plain
diffusers.

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
      --train_batch_size 4 --learning_rate 1e-06 --cache_latents --mixed_precision bf16 --output_dir sdxl-arb

    # 2 nodes x 8 GPUs (run on each node with its --machine_rank), PowerSGD gradient compression
    accelerate launch --multi_gpu --num_machines 2 --num_processes 16 --machine_rank 0 \\
      --main_process_ip 10.0.0.1 --main_process_port 29500 train_text_to_image_arb.py \\
      --pretrained_model_name_or_path stable-diffusion-v1-5/stable-diffusion-v1-5 \\
      --train_data_dir ./images --learning_rate 1e-05 --ddp_comm_hook power_sgd --output_dir sd-arb

    # LoRA, rank 16 (diffusers' LoRA README commands run unchanged with train_text_to_image_lora_arb.py)
    accelerate launch train_text_to_image_arb.py ... --rank 16 --learning_rate 1e-4 --output_dir sd-lora-arb

    # resume an interrupted run exactly where it stopped (same batches, crops and noise)
    accelerate launch train_text_to_image_arb.py ... --resume_from_checkpoint latest

    # CPU, two processes (tests, demo): torchrun starts real gloo DDP processes
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 train_text_to_image_arb.py ... --report_to none

Nothing here imports torchvision: images go through :mod:`hf_arb.images.fitting` (Pillow).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("train_text_to_image_arb")


class _LazyModule:
    """A module imported on first attribute access: ``--help``, argument errors and (single-process) data errors
    answer before torch is loaded, which takes seconds."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)


torch: Any = _LazyModule("torch")
F: Any = _LazyModule("torch.nn.functional")

STATE_FILE = "hf_arb_state.json"  # our part of a checkpoint: step counters and the seed
BUCKETS_FILE = "hf_arb_buckets.json"  # the BucketSet the run trained with, saved next to the pipeline
SKIPPED_ROWS_FILE = "skipped_rows.jsonl"  # images that failed to decode while training, one JSON line per row
STATS_FILE = "hf_arb_run.json"  # what the run did (steps, cache hits), for scripts and tests


# ============================================================================================ arguments
class UsageError(ValueError):
    """A mistake in the command line or the data it names: reported as one ``error:`` line, no traceback."""


class UsageFileError(UsageError, FileNotFoundError):
    """A file or folder named on the command line does not exist."""


#: Upstream default changed per model family (and LoRA mode), as diffusers' four text-to-image scripts set them:
#: (SD full fine-tune, SDXL full fine-tune, SD LoRA, SDXL LoRA) ← train_text_to_image{,_sdxl,_lora,_lora_sdxl}.py.
FAMILY_DEFAULTS: dict[str, tuple[Any, Any, Any, Any]] = {
    "resolution": (512, 1024, 512, 1024),
    "output_dir": ("sd-model-finetuned", "sdxl-model-finetuned", "sd-model-finetuned-lora", "sd-model-finetuned-lora"),
    "validation_epochs": (5, 1, 1, 1),
    "num_validation_images": (1, 4, 4, 4),  # train_text_to_image.py generates one image per validation prompt
}
#: diffusers.optimization.SchedulerType values (a test checks this list against diffusers).
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "piecewise_constant")
#: --report_to values and the module each needs.
TRACKERS = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "comet_ml": ("comet_ml",),
            "all": (), "none": ()}
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
    a("--train_data_dir", type=str, default=None,
      help="A folder of images (imagefolder layout, metadata.jsonl with captions). Ignored if --dataset_name is set.")
    a("--image_column", type=str, default="image", help="The column of the dataset containing an image.")
    a("--caption_column", type=str, default="text", help="The column containing a caption or a list of captions.")
    a("--max_train_samples", type=int, default=None, help="Truncate the number of training examples to this value.")
    a("--cache_dir", type=str, default=None, help="Where downloaded models and datasets are stored.")
    a("--dataloader_num_workers", type=int, default=0, help="Subprocesses for data loading (0: main process).")
    # --- images and buckets
    a("--resolution", type=int, default=None,
      help="CHANGED MEANING: the pixel budget of the buckets; every bucket has about resolution² pixels (sides "
           "multiples of --bucket_step) instead of every image being resized to a resolution² square. "
           "Default: SD 512 | SDXL 1024." + NO_DEFAULT)
    a("--center_crop", default=False, action="store_true",
      help="CHANGED: crops inside the bucket, not a square: centre-crop the small excess after resizing to cover "
           "the bucket (default: a random crop inside the bucket).")
    a("--random_flip", action="store_true", help="Randomly flip images horizontally (inside the bucket).")
    a("--image_interpolation_mode", type=str, default="lanczos",
      choices=["bicubic", "bilinear", "box", "hamming", "lanczos", "nearest", "nearest_exact"],
      help="Filter for resizing images (Pillow's; nearest/nearest_exact are refused: not antialiased).")
    from hf_arb.buckets.matching import METRICS
    from hf_arb.buckets.presets import PRESETS

    a("--bucket_preset", type=str, default=None, choices=PRESETS,
      help="Bucket table (all listed in docs/buckets.md): 'budget' (default; OneTrainer aspects scaled to "
           "--resolution²), 'novelai', 'sdxl', the model families' own 'pixart', 'sana' (--resolution picks the "
           "table), 'hunyuan_dit', 'flux_kontext', or the trainers' 'diffusers', 'onetrainer', 'kohya'. Fixed tables "
           "ignore --resolution and say so at start-up." + NO_DEFAULT)
    a("--aspect_ratio_buckets", type=str, default=None, metavar="H,W;H,W",
      help="Explicit buckets in diffusers' dreambooth format, height first, e.g. '1024,1024;768,1360' (instead of "
           "--bucket_preset).")
    a("--bucket_step", type=int, default=None,
      help="Bucket sides are multiples of this (budget, onetrainer, kohya: default 64; diffusers: its divisibility, "
           "default 16; fixed tables ignore it)." + NO_DEFAULT)
    a("--bucket_min_side", type=int, default=None,
      help="kohya: sd-scripts' --min_bucket_reso, the smallest bucket side (default 256)." + NO_DEFAULT)
    a("--bucket_max_side", type=int, default=None,
      help="kohya: sd-scripts' --max_bucket_reso, the largest bucket side, >= --resolution (default 1024)." + NO_DEFAULT)
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
    a("--optimizer", type=str, default="AdamW", help="AdamW (prodigy is refused: not supported by this script).")
    a("--prodigy_beta3", type=float, default=None, help="Refused: configures --optimizer prodigy.")
    a("--prodigy_decouple", type=bool, default=True, help="Refused unless True: configures --optimizer prodigy.")
    a("--prodigy_use_bias_correction", type=bool, default=True, help="Refused unless True: configures prodigy.")
    a("--prodigy_safeguard_warmup", type=bool, default=True, help="Refused unless True: configures prodigy.")
    a("--use_dora", action="store_true",
      help="LoRA: train DoRA adapters (peft use_dora), as the SDXL dreambooth script.")
    a("--upcast_before_saving", action="store_true",
      help="Accepted; always the case here: the adapters train and are saved in float32.")
    for flag in ("with_prior_preservation", "do_edm_style_training", "output_kohya_format"):
        a(f"--{flag}", action="store_true", help="Refused: not supported by this script (the error says why).")
    for flag, kind, default in (("class_data_dir", str, None), ("class_prompt", str, None),
                                ("prior_loss_weight", float, 1.0), ("num_class_images", int, 100),
                                ("sample_batch_size", int, 4), ("prior_generation_precision", str, None)):
        a(f"--{flag}", type=kind, default=default, help="Refused: prior preservation is not supported.")
    # --- packing (SD3 / Flux): NaViT packs of images at their own size instead of buckets (docs/packing.md)
    a("--packing", action="store_true",
      help="SD3/Flux: train packs of images at their own size and aspect (no bucket crop) in one token sequence "
           "per device and step, attention masked per image; replaces buckets and --train_batch_size.")
    a("--max_tokens", type=int, default=None,
      help="--packing: latent tokens per pack (per device per step); each image is also capped at "
           "min(this, (--resolution/16)^2) tokens. Default: (--resolution/16)^2." + NO_DEFAULT)
    # --- streaming (hf_arb.BucketedStream over annotated parquet shards; docs/training.md "Streaming")
    a("--streaming", action="store_true",
      help="Stream the annotated dataset (datasets streaming=True) through hf_arb.BucketedStream: no rank holds it.")
    a("--stream_buffer_size", type=int, default=4096, help="--streaming: rows buffered per rank.")
    a("--stream_on_overflow", choices=("error", "evict"), default="error",
      help="--streaming: when a scheduled bucket gets no batch within the buffer, stop (error) or drop old rows.")
    a("--stream_counts", type=str, default=None,
      help="--streaming: JSON file {bucket id: rows} (default: the Hub dataset card, else one pass over the bucket column).")
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
      help="Write every batch this rank trains on (step, bucket, shape, rows, loss) to <output_dir>/batches/rank<r>.jsonl.")
    a("--push_to_hub", action="store_true", help="Whether or not to push the model to the Hub.")
    a("--hub_token", type=str, default=None, help="The token to use to push to the Model Hub.")
    a("--hub_model_id", type=str, default=None, help="The name of the repository to keep in sync with output_dir.")
    a("--local_rank", type=int, default=-1, help="For distributed training: local_rank")
    return p


def detect_family(model: str) -> str:
    """'sd3' / 'flux' from ``model_index.json`` or the transformer config (:func:`hf_arb.families.detect_flow_family`),
    else 'sdxl' or 'sd' from a local pipeline's ``unet/config.json``; for a Hub id, from its name (``xl``)."""
    from hf_arb.families import detect_flow_family

    flow = detect_flow_family(model)
    if flow is not None:
        return flow
    config = Path(model) / "unet" / "config.json"
    if config.is_file():
        try:
            text_time = json.loads(config.read_text()).get("addition_embed_type") == "text_time"
        except (OSError, ValueError) as e:
            raise UsageError(f"--pretrained_model_name_or_path {model}: cannot read {config} ({e}).") from None
        return "sdxl" if text_time else "sd"
    return "sdxl" if "xl" in Path(model).name.lower() else "sd"


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
                raise UsageError(f"{flag} configures LoRA training: add --rank {DEFAULT_RANK} (or --lora), or drop {flag}.")
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
    if args.resolution_conditioning and args.family == "sdxl":
        raise UsageError("--resolution_conditioning is for SD 1.x / 2.x: SDXL UNets already take size/crop time ids. "
                         "Drop the flag.")
    if (args.offload_ema or args.foreach_ema) and not args.use_ema:
        raise UsageError("--offload_ema / --foreach_ema configure the EMA model: add --use_ema or drop them.")
    check_family_flags(args)
    check_streaming_flags(args)
    check_bucket_flags(args)
    check_packing_flags(args)
    check_dreambooth_flags(args)
    if args.max_pixels_per_batch is not None and (args.no_bucket_sync or args.streaming):
        raise UsageError(f"--max_pixels_per_batch needs every device in the same bucket at each step: drop "
                         f"{'--no_bucket_sync' if args.no_bucket_sync else '--streaming'} or --max_pixels_per_batch.")


#: BucketSet's parameter names in its error messages → this script's flags.
BUCKET_FLAG_NAMES = {"`resolution`": "--resolution", "`step`": "--bucket_step", "`max_aspect_error`": "--max_aspect_error",
                     "`metric`": "--bucket_metric", " (--resolution)": "", "max_side=": "--bucket_max_side ",
                     "resolution=": "--resolution ", "step=": "--bucket_step "}


def check_bucket_flags(args: argparse.Namespace) -> None:
    """--bucket_preset or --aspect_ratio_buckets (not both; default budget), the preset's --bucket_step default, and
    the table itself built once, so that a bad combination fails here, in flags."""
    from hf_arb.cli.buckets import in_flags
    from hf_arb.buckets.presets import PRESET_INFO

    if args.aspect_ratio_buckets is not None and args.bucket_preset is not None:
        raise UsageError(f"--aspect_ratio_buckets is a bucket table and --bucket_preset {args.bucket_preset} names "
                         "another: pass only one of them.")
    sides = [f"--bucket_{k}" for k in ("min_side", "max_side") if getattr(args, f"bucket_{k}") is not None]
    if sides and args.bucket_preset != "kohya":
        raise UsageError(f"{sides[0]} is a parameter of --bucket_preset kohya: add --bucket_preset kohya or drop "
                         f"{sides[0]}.")
    if args.aspect_ratio_buckets is None:
        args.bucket_preset = args.bucket_preset or "budget"
        if args.bucket_step is None:
            args.bucket_step = PRESET_INFO[args.bucket_preset].default_step
    try:
        bucket_set_from_args(args)
    except ValueError as err:
        flag = "--aspect_ratio_buckets" if args.aspect_ratio_buckets is not None else f"--bucket_preset {args.bucket_preset}"
        raise UsageError(f"{flag}: {in_flags(str(err), BUCKET_FLAG_NAMES).strip()}") from None


#: flags of the UNet (epsilon / v-prediction) objective, and their "not given" values
UNET_ONLY_FLAGS = {"snr_gamma": None, "dream_training": False, "prediction_type": None, "input_perturbation": 0,
                   "noise_offset": 0, "timestep_bias_strategy": "none", "resolution_conditioning": False,
                   "use_ema": False}
#: flags of the flow-matching (SD3 / Flux) objective, and their defaults
FLOW_ONLY_FLAGS = {"weighting_scheme": None, "logit_mean": 0.0, "logit_std": 1.0, "mode_scale": 1.29,
                   "precondition_outputs": None, "guidance_scale": 3.5, "max_sequence_length": None,
                   "shift_by_resolution": None, "lora_layers": None,
                   "lora_blocks": None}
FLOW_FAMILIES = ("sd3", "flux")  # = hf_arb.families.FLOW_FAMILIES (without importing it before --help answers)


def check_family_flags(args: argparse.Namespace) -> None:
    """A flag of the other objective is an error naming the model family (never silently ignored)."""
    flow = args.family in FLOW_FAMILIES
    for flag, unset in (UNET_ONLY_FLAGS if flow else FLOW_ONLY_FLAGS).items():
        if getattr(args, flag) != unset:
            raise UsageError(
                f"--{flag} applies to {'SD 1.x/2.x/SDXL UNets' if flow else 'SD3 / Flux (flow matching)'}, but "
                f"{args.pretrained_model_name_or_path} is {args.family.upper()}: drop --{flag}"
                + (" (SD3/Flux train with --weighting_scheme and --shift_by_resolution instead)." if flow else "."))
    if flow and args.max_sequence_length is not None and args.max_sequence_length < 1:
        raise UsageError(f"--max_sequence_length must be >= 1, got {args.max_sequence_length}.")


#: flags of diffusers' dreambooth LoRA scripts this script does not support, with their defaults and the reason
UNSUPPORTED_DREAMBOOTH_FLAGS = {
    "with_prior_preservation": (False, "prior preservation (class images generated and trained alongside) is not "
                                       "supported; train on a dataset that includes the class images instead"),
    "class_data_dir": (None, "prior preservation is not supported"), "class_prompt": (None, "prior preservation is "
                                                                                            "not supported"),
    "prior_loss_weight": (1.0, "prior preservation is not supported"),
    "num_class_images": (100, "prior preservation is not supported"),
    "sample_batch_size": (4, "it sizes prior preservation's class-image generation, which is not supported"),
    "prior_generation_precision": (None, "prior preservation is not supported"),
    "do_edm_style_training": (False, "EDM-style training (Playground v2.5) is not supported"),
    "output_kohya_format": (False, "kohya-format export is not supported; diffusers loads the saved "
                                   "pytorch_lora_weights.safetensors, and diffusers.utils.convert_state_dict_to_kohya "
                                   "converts it"),
    "prodigy_beta3": (None, "it configures --optimizer prodigy, which is not supported"),
    "prodigy_decouple": (True, "it configures --optimizer prodigy, which is not supported"),
    "prodigy_use_bias_correction": (True, "it configures --optimizer prodigy, which is not supported"),
    "prodigy_safeguard_warmup": (True, "it configures --optimizer prodigy, which is not supported"),
}


def check_dreambooth_flags(args: argparse.Namespace) -> None:
    """The dreambooth scripts' flags: a folder + one prompt, LoRA blocks and text-encoder options work; the rest
    (prior preservation, prodigy, EDM, kohya export) are refused in one line saying why."""
    for flag, (default, why) in UNSUPPORTED_DREAMBOOTH_FLAGS.items():
        if getattr(args, flag) != default:
            raise UsageError(f"--{flag} {getattr(args, flag)}: {why}. Drop --{flag}.")
    if args.optimizer.lower() != "adamw":
        raise UsageError(f"--optimizer {args.optimizer}: only AdamW is supported (with --use_8bit_adam for 8-bit "
                         "AdamW); prodigy is not. Pass --optimizer AdamW or drop it.")
    if args.instance_data_dir is not None and (args.dataset_name or args.train_data_dir):
        raise UsageError(f"--instance_data_dir {args.instance_data_dir} and --"
                         f"{'dataset_name' if args.dataset_name else 'train_data_dir'} both name the training data: "
                         "pass only one.")
    named_captions = getattr(args, "caption_column_given", False)  # --caption_column was on the command line
    if args.instance_data_dir is not None and args.instance_prompt is None and not named_captions:
        raise UsageError(f"--instance_data_dir {args.instance_data_dir} needs --instance_prompt (every image's "
                         "caption) or --caption_column (a caption column of the folder's metadata.jsonl).")
    if args.streaming and (args.instance_prompt is not None or args.instance_data_dir is not None):
        raise UsageError("--instance_data_dir / --instance_prompt are not supported with --streaming: write the "
                         "captions into the annotated shards and pass them with --train_data_dir.")
    if args.lora_blocks is not None:
        try:
            [int(b) for b in args.lora_blocks.split(",")]
        except ValueError:
            raise UsageError(f"--lora_blocks {args.lora_blocks!r}: expected comma-separated block indices, "
                             "e.g. 0,12.") from None
    for flag in ("text_encoder_lr", "adam_weight_decay_text_encoder"):
        if getattr(args, flag) is not None and not args.train_text_encoder:
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
    if args.stream_key_column is None:
        raise UsageError("--streaming needs --stream_key_column: an integer id column of the rows (e.g. `id`, "
                         "the row number written with the shards); it seeds each row's crop, flip and caption.")
    if args.stream_buffer_size < 1:
        raise UsageError(f"--stream_buffer_size must be >= 1, got {args.stream_buffer_size}.")
    if args.max_train_samples is not None:
        raise UsageError("--max_train_samples is not supported with --streaming: write fewer shards instead.")
    if args.stream_counts is not None and not Path(args.stream_counts).is_file():
        raise UsageFileError(f"--stream_counts {args.stream_counts}: no such file (JSON {{bucket id: rows}}).")


def check_packing_flags(args: argparse.Namespace) -> None:
    """--packing is for the flow transformers (a UNet has no token sequence) and excludes streaming / cached latents;
    --max_tokens needs --packing."""
    if not args.packing:
        if args.max_tokens is not None:
            raise UsageError("--max_tokens is the token budget of --packing: add --packing or drop --max_tokens.")
        return
    if args.family not in FLOW_FAMILIES:
        raise UsageError(f"--packing packs transformer tokens (SD3 / Flux), but {args.pretrained_model_name_or_path} "
                         f"is {args.family.upper()}, a UNet with no token sequence. Its analogue is a pixel budget "
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate without loading anything heavy; errors (:class:`UsageError`) name the flag and the fix.

    Family-dependent defaults (``FAMILY_DEFAULTS``) are filled from the model family (local ``unet/config.json``,
    else the Hub id's name) and the training mode; ``args.family`` records the family they were chosen for.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    args.caption_column_given = any(str(t).split("=")[0] == "--caption_column" for t in given)
    args.bucket_flags_given = [f"--{n}" for n in BUCKET_TABLE_FLAGS if getattr(args, n) != parser.get_default(n)]
    env_local_rank = int(os.environ.get("LOCAL_RANK", -1))
    if env_local_rank != -1 and env_local_rank != args.local_rank:
        args.local_rank = env_local_rank
    if args.dataset_name is None and args.train_data_dir is None and args.instance_data_dir is None:
        raise UsageError("Need either a dataset name or a training folder: pass --dataset_name or --train_data_dir "
                         "(or --instance_data_dir with --instance_prompt).")
    if args.non_ema_revision is None:
        args.non_ema_revision = args.revision
    if args.validation_prompt and not args.validation_prompts:
        args.validation_prompts = [args.validation_prompt]
    resolve_mode(args)
    args.family = detect_family(args.pretrained_model_name_or_path)
    column = (args.family != "sd") + 2 * args.lora  # SD3 / Flux take SDXL's (1024-pixel) defaults
    args.family_defaults = {}
    for name, values in FAMILY_DEFAULTS.items():
        if getattr(args, name) is None:
            value = values[column]
            if name == "output_dir" and args.family in FLOW_FAMILIES:
                value = f"{args.family}-model-finetuned" + ("-lora" if args.lora else "")
            setattr(args, name, value)
            args.family_defaults[name] = value
    if args.num_validation_images == 0:  # upstream's tests turn validation off this way
        args.validation_prompts = None
    check_values(args)
    return args


def check_environment(args: argparse.Namespace) -> None:
    """Checks that look at this machine (paths, installed packages, the device) — still before any model load."""
    import importlib.util

    hub_id = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
    for flag in ("pretrained_model_name_or_path", "pretrained_vae_model_name_or_path"):
        value = getattr(args, flag)
        if value is None:
            continue
        path = Path(value).expanduser()
        if path.is_dir():
            if not ((path / "model_index.json").exists() or (path / "unet").is_dir() or (path / "config.json").exists()):
                raise UsageError(f"--{flag} {value}: the folder is not a diffusers model (no model_index.json).")
        elif path.exists() or not hub_id.match(value) or value.count("/") > 1:
            raise UsageFileError(f"--{flag} {value}: no such model folder, and not a Hub id (like org/name).")
        else:  # a Hub id: a typo or an unreachable Hub is said now, not after the dataset and download retries
            from hf_arb.annotate.hub import hub_model_problem

            problem = hub_model_problem(value, revision=args.revision if flag == "pretrained_model_name_or_path" else None)
            if problem:
                raise UsageFileError(f"--{flag} {value}: {problem}")
    folder_flag = "instance_data_dir" if args.instance_data_dir is not None else "train_data_dir"
    if args.dataset_name is None and not Path(getattr(args, folder_flag)).is_dir():
        raise UsageFileError(f"--{folder_flag} {getattr(args, folder_flag)}: no such folder.")
    if args.dataset_name and args.dataset_name.startswith(("/", "./", "../", "~")) and not Path(
            args.dataset_name).expanduser().exists():
        raise UsageFileError(f"--dataset_name {args.dataset_name}: no such local dataset.")
    reports = [r.strip() for r in str(args.report_to).split(",")]
    for r in list(reports):
        needs = TRACKERS.get(r, ())
        if needs and not any(importlib.util.find_spec(m) for m in needs):
            if r == "wandb":  # as upstream, which raises for wandb only
                raise UsageError(f"--report_to {r} needs `pip install {needs[0]}` (not installed); or pass --report_to "
                                 "none.")
            # accelerate skips a tracker that is not installed, with a warning; so does this script, once
            logger.warning("--report_to %s: %s is not installed, so the run goes on without it (`pip install %s` to "
                           "log to it, or --report_to none to silence this).", r, needs[0], needs[0])
            reports.remove(r)
    args.report_to = ",".join(reports) or "none"
    for flag, module in (("use_8bit_adam", "bitsandbytes"), ("enable_xformers_memory_efficient_attention", "xformers"),
                         ("enable_npu_flash_attention", "torch_npu")):
        if getattr(args, flag) and importlib.util.find_spec(module) is None:
            hint = "this machine has no NPU" if module == "torch_npu" else f"`pip install {module}`"
            raise UsageError(f"--{flag} needs {module}, which is not installed ({hint}): drop --{flag}.")
    resolve_resume_dir(args)
    if args.mixed_precision in ("fp16", "bf16"):
        cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
        if not cpu:  # only now is torch worth importing
            import torch as _torch

            cpu = not _torch.cuda.is_available()
        if cpu and args.mixed_precision == "fp16":
            raise UsageError("--mixed_precision fp16 needs a GPU; this run is on the CPU: use bf16 or no.")
        if not cpu and args.mixed_precision == "bf16" and not _torch.cuda.is_bf16_supported():
            raise UsageError("--mixed_precision bf16 is not supported by this GPU: use fp16 or no.")


def resolve_resume_dir(args: argparse.Namespace) -> Path | None:
    """The checkpoint folder to resume from, or None; a missing or damaged one is an error (never a silent fresh
    start). ``latest`` skips incomplete or damaged checkpoints (with a warning naming them) for the newest complete one.
    """
    from hf_arb.train.checkpointing import REQUIRED, checkpoint_problems, find_resumable, list_checkpoints

    if not args.resume_from_checkpoint:
        return None  # (also called by check_environment: a missing checkpoint fails before anything loads)
    out = Path(args.output_dir)
    if getattr(args, "lora", False):  # LoRA checkpoints hold the adapter file, not a UNet folder
        model_dirs, model_files = (), ("pytorch_lora_weights.safetensors",)
    elif getattr(args, "family", "sd") in FLOW_FAMILIES:
        model_dirs, model_files = ("transformer",), ()
    else:
        model_dirs, model_files = ("unet", "unet_ema") if args.use_ema else ("unet",), ()
    required = REQUIRED
    if getattr(args, "streaming", False):  # no sampler state; the stream's per-rank files instead
        required = tuple(f for f in REQUIRED if not f.startswith("custom_checkpoint")) + ("stream_rank0.json",)
    if args.resume_from_checkpoint == "latest":
        path, skipped = find_resumable(out, STATE_FILE, model_dirs, model_files, required)
        if skipped:
            logger.warning("--resume_from_checkpoint latest: skipping incomplete or damaged checkpoint(s): %s",
                           "; ".join(skipped))
        if path is None:
            raise UsageFileError(
                f"--resume_from_checkpoint latest: no checkpoint-* folder in {out} can be resumed from"
                + (f" (skipped: {'; '.join(skipped)})" if skipped else "")
                + ". Drop the flag to start a new run, or point --output_dir at the run to resume."
            )
        return path
    path = Path(args.resume_from_checkpoint)
    if not path.is_dir() and path.name == str(path):  # a bare name (upstream's idiom): a folder of --output_dir
        path = out / path.name
    if not path.is_dir() or not (path / STATE_FILE).exists():  # a path is used as given, and named as given
        raise UsageFileError(
            f"--resume_from_checkpoint {args.resume_from_checkpoint!r}: {path} is not a checkpoint of this script "
            f"(missing folder or {STATE_FILE}). Available: {[d.name for d in list_checkpoints(out)] or 'none'}."
        )
    problems = checkpoint_problems(path, STATE_FILE, model_dirs, model_files, required)
    if problems:
        raise UsageError(
            f"Checkpoint {path} is damaged: {problems[0]}{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}"
            ". Resume from another checkpoint, or pass --resume_from_checkpoint latest to take the newest complete one."
        )
    return path


#: Flags a resume must repeat, as hf_arb_state.json records them (the sampler's plan and the step count depend on them).
RESUME_FLAGS = ("train_batch_size", "gradient_accumulation_steps")


def check_resume_flags(args: argparse.Namespace, resume_dir: Path | None) -> None:
    """Before anything loads: the checkpoint's folder name, step and batch flags must fit this run, said in flags."""
    if resume_dir is None:
        return
    saved = json.loads((resume_dir / STATE_FILE).read_text())
    named = re.fullmatch(r"checkpoint-(\d+)", resume_dir.name)
    if named and int(named.group(1)) != int(saved["global_step"]):
        raise UsageError(f"Checkpoint {resume_dir}: {STATE_FILE} says global_step {saved['global_step']}, but the "
                         f"folder is {resume_dir.name}; the file was edited or copied from another checkpoint. Resume "
                         "from another checkpoint (--resume_from_checkpoint latest takes the newest complete one).")
    if args.max_pixels_per_batch is not None or args.packing or args.streaming:
        return  # batch sizes come from the pixel budget / the packs; the stream checks its own state per rank
    procs = int(os.environ.get("WORLD_SIZE", "1"))
    was = {f: saved.get(f) for f in (*RESUME_FLAGS, "num_processes")}
    if None in was.values():
        return  # saved before these were recorded: the sampler's own state check still applies
    differ = [f for f in RESUME_FLAGS if was[f] != getattr(args, f)]
    global_was, global_now = was["train_batch_size"] * was["num_processes"], args.train_batch_size * procs
    if differ or global_was != global_now:
        plural = lambda n: f"{n} process{'es' if n != 1 else ''}"  # noqa: E731
        fix = " ".join(f"--{f} {was[f]}" for f in differ) or f"--train_batch_size {global_was // procs}"
        if global_was % procs and not differ:
            fix = f"{plural(was['num_processes'])} (--train_batch_size x processes must stay {global_was})"
        raise UsageError(
            f"Checkpoint {resume_dir} was trained with --train_batch_size {was['train_batch_size']} on "
            f"{plural(was['num_processes'])} (--gradient_accumulation_steps {was['gradient_accumulation_steps']}); "
            f"this run has --train_batch_size {args.train_batch_size} on {plural(procs)} "
            f"(--gradient_accumulation_steps {args.gradient_accumulation_steps}). Pass {fix} to resume it.")


def cli_parse(argv: list[str]) -> argparse.Namespace:
    """Parse + environment checks for the command line: a :class:`UsageError` exits with one ``error:`` line."""
    try:
        args = parse_args(argv)
        check_environment(args)
        return args
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)




# ========================================================================================= accelerator
def make_accelerator(args: argparse.Namespace) -> Any:
    """Accelerator with the project layout of diffusers' script and the optional DDP communication hook."""
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, ProjectConfiguration

    kwargs_handlers = []
    ddp: dict[str, Any] = {}
    if args.ddp_comm_hook != "no":
        state = {"matrix_approximation_rank": args.power_sgd_rank} if args.ddp_comm_hook == "power_sgd" else {}
        ddp.update(comm_hook=DDPCommunicationHookType(args.ddp_comm_hook), comm_state_option=state)
    if getattr(args, "train_text_encoder", False):  # SDXL's first encoder: the last layer's adapter gets no grad
        ddp["find_unused_parameters"] = True
    if ddp:
        kwargs_handlers.append(DistributedDataParallelKwargs(**ddp))
    report_to = None if args.report_to in (None, "none", "") else args.report_to
    project = ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, args.logging_dir))
    return Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=report_to,
        project_config=project,
        kwargs_handlers=kwargs_handlers,
        **stream_accelerator_kwargs(args),
    )


def check_process_count(accelerator: Any) -> None:
    """The launcher's process count (WORLD_SIZE, torch.distributed) must be accelerate's: `accelerate launch
    --multi_gpu` on a machine without GPUs starts processes that each think they are the only (main) one."""
    import torch.distributed as dist

    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if dist.is_available() and dist.is_initialized():
        launched = max(launched, dist.get_world_size())
    if launched > 1 and accelerator.num_processes != launched:
        raise UsageError(
            f"{launched} processes were launched (WORLD_SIZE={launched}) but accelerate sees "
            f"{accelerator.num_processes}, so each would train as the only one: on a machine without GPUs launch with "
            f"ACCELERATE_USE_CPU=1 torchrun --nproc_per_node {launched} train_text_to_image_arb.py ... "
            "(or accelerate launch --cpu ... for one process).")


def stream_accelerator_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """--streaming: every rank reads its own split (accelerate keeps item ``process_index`` of each step)."""
    if not getattr(args, "streaming", False):
        return {}
    from accelerate.utils import DataLoaderConfiguration

    return {"dataloader_config": DataLoaderConfiguration(dispatch_batches=False)}


def setup_logging(accelerator: Any, libraries: tuple[str, ...] = ("datasets", "transformers", "diffusers")) -> None:
    """Log format and library verbosity (quiet on non-main ranks; ``accelerator`` None: a single process). The
    script sets datasets' first and transformers'/diffusers' once the data is checked: importing diffusers takes
    seconds, data errors should not."""
    from hf_arb.logs import quiet_library_notes

    # libraries log warnings; our own loggers (the script's and hf_arb's) also say what they do, at INFO
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.WARNING)
    main = accelerator is None or accelerator.is_local_main_process
    for name in (logger.name, "hf_arb"):
        logging.getLogger(name).setLevel(logging.INFO if main else logging.WARNING)
    for name in libraries:
        lib = importlib.import_module(name)
        lib.utils.logging.set_verbosity_warning() if main else lib.utils.logging.set_verbosity_error()
    quiet_library_notes(libraries)


def agree_on_seed(args: argparse.Namespace, accelerator: Any, resume_dir: Path | None) -> int:
    """One seed for every rank: --seed, else the checkpoint's, else a random one broadcast from rank 0
    (``accelerator`` None: a single process)."""
    if resume_dir is not None:
        saved = json.loads((resume_dir / STATE_FILE).read_text())["seed"]
        if args.seed is not None and args.seed != saved:
            raise UsageError(
                f"--seed {args.seed} differs from the seed of the checkpoint being resumed ({saved}); an exact "
                f"resume needs the same seed. Pass --seed {saved} or drop --seed."
            )
        return int(saved)
    if args.seed is not None:
        return int(args.seed)
    box = [int.from_bytes(os.urandom(4), "little")]
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(box, from_process=0)
    return int(box[0])


def updated(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    """A copy of ``args`` with ``changes``: the parsed arguments are never mutated (the seed agreed on and the
    learning rate after ``--scale_lr`` live in the copy the run uses)."""
    return argparse.Namespace(**{**vars(args), **changes})


# ============================================================================================ models
@dataclass
class Models:
    """Everything loaded from the pretrained folder. ``sdxl`` is read from the UNet config. For SD3 / Flux, ``unet``
    holds the transformer (the trained denoiser), ``flow`` the family adapter (:mod:`hf_arb.families`) and
    ``flow_options`` the resolved flow-matching flags."""

    noise_scheduler: Any
    tokenizers: list[Any]
    text_encoders: list[Any]
    vae: Any
    unet: Any
    sdxl: bool
    ema_unet: Any = None
    trained_text_encoders: list[Any] | None = None  # LoRA --train_text_encoder: the prepared (wrapped) encoders
    flow: Any = None
    flow_options: Any = None

    @property
    def family(self) -> str:
        return self.flow.name if self.flow is not None else "sdxl" if self.sdxl else "sd"


def load_flow_models(args: argparse.Namespace) -> Models:
    """SD3 / Flux: the family adapter loads its parts; everything but the transformer is frozen."""
    from hf_arb.families import get_family

    family = get_family(args.family)
    parts = family.load(args.pretrained_model_name_or_path, revision=args.revision, variant=args.variant)
    if args.pretrained_vae_model_name_or_path:
        from diffusers import AutoencoderKL

        parts.vae = AutoencoderKL.from_pretrained(args.pretrained_vae_model_name_or_path, revision=args.revision,
                                                  variant=args.variant)
    options = family.options(parts.scheduler.config, parts.transformer, weighting_scheme=args.weighting_scheme,
                             logit_mean=args.logit_mean, logit_std=args.logit_std, mode_scale=args.mode_scale,
                             precondition_outputs=None if args.precondition_outputs is None
                             else bool(args.precondition_outputs), shift_by_resolution=args.shift_by_resolution,
                             guidance_scale=args.guidance_scale, max_sequence_length=args.max_sequence_length)
    parts.vae.requires_grad_(False)
    for te in parts.text_encoders:
        te.requires_grad_(False)
    transformer = parts.transformer
    transformer.train()
    if args.enable_xformers_memory_efficient_attention:
        transformer.enable_xformers_memory_efficient_attention()
    if args.enable_npu_flash_attention:
        transformer.enable_npu_flash_attention()
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return Models(parts.scheduler, parts.tokenizers, parts.text_encoders, parts.vae, transformer, False,
                  flow=family, flow_options=options)


def check_flow_buckets(models: Models, buckets: Any, args: argparse.Namespace) -> None:
    """SD3 / Flux: every bucket side must be a multiple of VAE factor x token patch (16), else a UsageError."""
    from hf_arb.families.flow import check_bucket_sizes

    factor = 2 ** (len(models.vae.config.block_out_channels) - 1)
    try:
        check_bucket_sizes(buckets.resolutions, factor, models.flow_options.token_patch)
    except ValueError as err:
        raise UsageError(f"{err} For this {models.family.upper()} model: --bucket_step "
                         f"{factor * models.flow_options.token_patch} (or a multiple of it).") from None


def load_models(args: argparse.Namespace) -> Models:
    """Load scheduler, tokenizer(s), text encoder(s), VAE and UNet; freeze all but the UNet (SD3 / Flux: the
    transformer, :func:`load_flow_models`)."""
    if args.family in FLOW_FAMILIES:
        return load_flow_models(args)
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
        from hf_arb.families.conditioning import add_resolution_conditioning

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
        models.ema_unet = EMAModel(ema_src.parameters(), model_cls=UNet2DConditionModel, model_config=ema_src.config,
                                   foreach=args.foreach_ema)
    if args.enable_xformers_memory_efficient_attention:
        from diffusers.utils.import_utils import is_xformers_available

        if not is_xformers_available():
            raise UsageError("xformers is not available. Install it or drop --enable_xformers_memory_efficient_attention.")
        unet.enable_xformers_memory_efficient_attention()
    if args.enable_npu_flash_attention:
        unet.enable_npu_flash_attention()
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    return models


def check_family(args: argparse.Namespace, models: Models) -> None:
    """Warn when family defaults were chosen for another family than the loaded UNet's (a Hub id's name misled)."""
    family = models.family
    if family != args.family and args.family_defaults:
        logger.warning("Defaults %s were chosen for %s, but the model is %s: pass these flags explicitly.",
                       ", ".join(f"--{k} {v}" for k, v in args.family_defaults.items()), args.family, family)


def register_checkpoint_hooks(accelerator: Any, models: Models) -> None:
    """Save the UNet (and EMA) in diffusers format inside accelerate checkpoints, and load them back (SD3 / Flux:
    the transformer, under ``transformer/``)."""
    if models.flow is not None:
        from hf_arb.families.flow import register_transformer_hooks

        register_transformer_hooks(accelerator, models.flow.transformer_class(),
                                   unwrap=lambda m: unwrap(accelerator, m))
        return
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


def make_optimizer(args: argparse.Namespace, params: Any) -> torch.optim.Optimizer:
    """AdamW (or bitsandbytes' 8-bit AdamW) over ``params``: the UNet's weights, or the LoRA parameters."""
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


# ================================================================================================ LoRA
def setup_lora(args: argparse.Namespace, models: Models, weight_dtype: torch.dtype) -> list[Any]:
    """Add LoRA adapters to the UNet (and, with --train_text_encoder, the text encoders of
    :func:`lora_text_encoders`); frozen base weights go to the mixed-precision dtype, the adapters stay float32.
    Returns the trainable parameters (with --train_text_encoder: optimizer parameter groups, the encoders' with
    --text_encoder_lr / --adam_weight_decay_text_encoder where given)."""
    from hf_arb.train.lora import TEXT_ENCODER_TARGET_MODULES, UNET_TARGET_MODULES, add_lora

    kw = {"rank": args.rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout, "dtype": weight_dtype,
          "use_dora": args.use_dora}
    targets: Any = UNET_TARGET_MODULES
    if models.flow is not None:  # diffusers' dreambooth_lora_sd3/flux targets, or --lora_layers
        targets = [m.strip() for m in args.lora_layers.split(",")] if args.lora_layers else models.flow.lora_target_modules
        if args.lora_blocks is not None:  # train_dreambooth_lora_sd3.py: those modules of these blocks only
            targets = [f"transformer_blocks.{int(b)}.{m}" for b in args.lora_blocks.split(",") for m in targets]
    params = add_lora(models.unet, target_modules=targets, **kw)
    if args.train_text_encoder:
        groups: list[Any] = [{"params": params}]  # the encoders' group: --learning_rate (scaled) unless told
        options = {k: v for k, v in (("lr", args.text_encoder_lr),
                                     ("weight_decay", args.adam_weight_decay_text_encoder)) if v is not None}
        for te in lora_text_encoders(models):
            groups.append({"params": add_lora(te, target_modules=TEXT_ENCODER_TARGET_MODULES, **kw), **options})
        return groups
    return params


def lora_text_encoders(models: Models) -> list[Any]:
    """The text encoders --train_text_encoder adapts: SD / SDXL all; SD3 its two CLIPs, Flux its CLIP (not T5), as
    diffusers' dreambooth LoRA scripts."""
    return models.text_encoders if models.flow is None else models.text_encoders[:models.flow.lora_text_encoders]


def register_lora_checkpoint_hooks(accelerator: Any, models: Models, args: argparse.Namespace) -> None:
    """Checkpoints hold only the adapters, as ``pytorch_lora_weights.safetensors`` (loadable by diffusers too);
    accelerate saves the optimizer, scheduler, sampler and RNG next to it. The prepared models arrive in the order
    they were prepared: the UNet, then the trained text encoders."""
    from hf_arb.train.lora import load_lora, save_lora

    cls = pipeline_class(models, args)
    denoiser = "unet" if models.flow is None else "transformer"

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


def save_final_lora(args: argparse.Namespace, accelerator: Any, models: Models, unet: Any, buckets: Any,
                    progress: Progress, validation_images: list[str], stats: dict[str, Any]) -> None:
    """Write ``pytorch_lora_weights.safetensors`` (no pipeline, as upstream), then validate by loading that file
    into a fresh base pipeline with ``load_lora_weights``, the way users will."""
    from hf_arb.train.lora import save_lora

    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    cls = pipeline_class(models, args)
    encoders = [accelerator.unwrap_model(te) for te in models.trained_text_encoders or []]
    save_lora(cls, args.output_dir, unwrap(accelerator, unet), encoders or None,
              denoiser="unet" if models.flow is None else "transformer")
    (Path(args.output_dir) / BUCKETS_FILE).write_text(json.dumps(buckets.to_dict(), indent=1))
    if args.validation_prompts:
        parts = {"vae": place(models.vae, dtype=torch.float32)} if args.pretrained_vae_model_name_or_path else {}
        pipe = cls.from_pretrained(args.pretrained_model_name_or_path, revision=args.revision, variant=args.variant,
                                   **parts)
        from hf_arb.logs import no_text_encoder_lora_note

        with no_text_encoder_lora_note() if not encoders else contextlib.nullcontext():  # expected: UNet-only LoRA
            pipe.load_lora_weights(args.output_dir)
        last = log_validation(args, accelerator, models, None, buckets, progress.global_step, torch.float32,
                              pipe=pipe, name=f"final-{progress.global_step:06d}")
        if last is not None:
            validation_images.append(str(last))
    finish_outputs(args, buckets, models, validation_images, stats)


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
        folder = args.train_data_dir if args.instance_data_dir is None else args.instance_data_dir
        ds = datasets.load_dataset("imagefolder", data_files={"train": os.path.join(folder, "**")},
                                   cache_dir=args.cache_dir)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UsageError(f"The dataset has no 'train' split; its splits are {list(ds)}.")
        ds = ds["train"]
    return instance_captions(args, ds)


def instance_captions(args: argparse.Namespace, ds: Any) -> Any:
    """The dreambooth scripts' data flags: ``--instance_prompt`` (without ``--caption_column``) is every image's
    caption; ``--repeats N`` repeats the rows N times (logged)."""
    import datasets
    import pyarrow as pa

    if args.instance_prompt is not None and not getattr(args, "caption_column_given", False):
        if args.caption_column in ds.column_names:
            ds = ds.remove_columns(args.caption_column)
        ds = ds.add_column(args.caption_column, pa.repeat(pa.scalar(args.instance_prompt), len(ds)))
        logger.info("--instance_prompt: every image's caption is %r.", args.instance_prompt)
    if args.repeats > 1:
        logger.info("--repeats %d: %d rows trained as %d.", args.repeats, len(ds), len(ds) * args.repeats)
        ds = datasets.concatenate_datasets([ds] * args.repeats)
    return ds


def check_columns(ds: Any, args: argparse.Namespace) -> None:
    for flag in ("image_column", "caption_column"):
        value = getattr(args, flag)
        if value not in ds.column_names:
            raise UsageError(f"--{flag} value '{value}' needs to be one of: {', '.join(ds.column_names)}")


def bucket_set_from_args(args: argparse.Namespace) -> Any:
    """The BucketSet of --bucket_preset / --aspect_ratio_buckets, --resolution, --bucket_step, --bucket_metric and
    --max_aspect_error."""
    return bucket_table_from_args(args)[0]


def bucket_table_from_args(args: argparse.Namespace) -> tuple[Any, list[str]]:
    """``(BucketSet, notes)``, built as ``hf-arb buckets`` builds it; ``notes`` say which flags the table ignores."""
    from hf_arb.cli.buckets import resolve_buckets

    sides = {k: v for k in ("min_side", "max_side") if (v := getattr(args, f"bucket_{k}", None)) is not None}
    return resolve_buckets(args.bucket_preset, args.aspect_ratio_buckets, resolution=args.resolution,
                           step=args.bucket_step, metric=args.bucket_metric, max_aspect_error=args.max_aspect_error,
                           **sides)


def log_bucket_notes(args: argparse.Namespace, notes: list[str]) -> None:
    """Say once that the preset ignores --resolution: a warning if it was given, else (a family default) info."""
    given = "resolution" not in getattr(args, "family_defaults", {})
    for note in notes:
        logger.log(logging.WARNING if given else logging.INFO, "--bucket_preset: %s", note)


def bucket_origin(args: argparse.Namespace) -> str:
    """Where the run's bucket table came from, for the model card."""
    if getattr(args, "buckets_from_dataset", False):
        return "the dataset's own bucket columns (the table it was annotated with)"
    if args.aspect_ratio_buckets is not None:
        return f"`--aspect_ratio_buckets {args.aspect_ratio_buckets}`"
    from hf_arb.buckets.presets import PRESET_INFO

    if PRESET_INFO[args.bucket_preset].default_resolution is None:
        return f"`--bucket_preset {args.bucket_preset}`, a fixed table"
    return f"`--bucket_preset {args.bucket_preset}` at `--resolution {args.resolution}`"


#: the flags that choose the bucket table (besides --resolution)
BUCKET_TABLE_FLAGS = ("bucket_preset", "aspect_ratio_buckets", "bucket_step", "bucket_metric", "max_aspect_error",
                      "bucket_min_side", "bucket_max_side")
#: skip reasons that depend on the bucket table (re-decided when rows are re-assigned; others are kept)
TABLE_SKIP_REASONS = ("aspect", "upscale")


def reassigned_columns(table: Any, *, config: str) -> Any:
    """``map`` function (the whole table at once): the bucket columns of an annotated dataset's sizes in another
    table; rows skipped for a reason of their own (unreadable, missing, ...) stay skipped with it."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from hf_arb import BucketSet
    from hf_arb.annotate.core import annotate_sizes

    reason = table.column("skip_reason")
    keep = pc.if_else(pc.is_in(reason, value_set=pa.array(TABLE_SKIP_REASONS)), pa.scalar(None, pa.string()), reason)
    return annotate_sizes(table.column("original_width").to_numpy(zero_copy_only=False),
                          table.column("original_height").to_numpy(zero_copy_only=False), BucketSet.from_json(config),
                          reasons=keep.to_numpy(zero_copy_only=False))


def annotated_dataset_buckets(args: argparse.Namespace, ds: Any, own: Any, main: bool) -> tuple[Any, Any]:
    """A dataset that carries bucket columns keeps them, unless bucket-table flags were passed and ask for another
    table: then its rows are re-assigned from their original_width/original_height (vectorised, no image opened).
    A flag that is not applied is named once (never silently ignored); ``args.buckets_from_dataset`` tells the card."""
    import datasets
    from hf_arb.buckets.schema import BUCKET_COLUMNS, bucket_features

    given = list(getattr(args, "bucket_flags_given", []))
    if "resolution" not in getattr(args, "family_defaults", {"resolution": None}):
        given.append("--resolution")
    args.buckets_from_dataset = True
    wanted = bucket_table_from_args(args)[0] if given else own
    if wanted == own:
        logger.info("Dataset already carries bucket columns: using its %d buckets as they are.", len(own))
        return ds, own
    if given == ["--resolution"]:  # no table flag: the dataset's own table wins, and the user hears it
        if main:
            logger.warning("--resolution %s is not applied: the dataset carries bucket columns (%d buckets, %s, ...) "
                           "and this run trains on them. To re-assign its rows at --resolution %s, also pass the "
                           "table, e.g. --bucket_preset budget.", args.resolution, len(own),
                           ", ".join(own.labels()[:3]), args.resolution)
        return ds, own
    sizes = ds.select_columns(["original_width", "original_height", "skip_reason"]).with_format("arrow")
    new = sizes.map(reassigned_columns, batched=True, batch_size=None, keep_in_memory=True,
                    features=bucket_features(wanted), remove_columns=sizes.column_names,
                    desc="Re-assigning buckets", fn_kwargs=dict(config=wanted.to_json())).with_format(None)
    ds = datasets.concatenate_datasets([ds.remove_columns(list(BUCKET_COLUMNS)), new], axis=1)
    args.buckets_from_dataset = False
    if main:
        kept = int((np.asarray(new.with_format("numpy")["bucket"]) >= 0).sum())
        logger.warning("The dataset's bucket columns (%d buckets) are not the table of %s (%d buckets): re-assigned "
                       "its %d rows from original_width/original_height (no image opened; %d kept). Drop those "
                       "flags to train on the dataset's own buckets.", len(own),
                       " ".join(f"{f} {getattr(args, f[2:])}" for f in given), len(wanted), len(ds), kept)
    return ds, wanted


def annotation_note(ds: Any, buckets: Any) -> str:
    """The annotation summary without its bucket table (the start-up report prints that, with the plan), its advice
    in this script's flags."""
    from hf_arb.annotate.map import summarize_annotation

    summary = summarize_annotation(ds, buckets)
    lines = [str(summary).split("\nrows per bucket", 1)[0]]
    for o in summary.outliers:
        t = f"{o.threshold:g}"
        fix = (f"  skip them with --max_aspect_error {t}" if o.kind == "aspect_error" else
               f"  skip them by annotating first: hf-arb annotate DATA --max-upscale {t} --output-dir DIR, then "
               "train with --dataset_name DIR")
        lines += [*str(o).splitlines()[:-1], fix]
    return "\n".join(lines)


def dataset_with_buckets(args: argparse.Namespace, accelerator: Any) -> tuple[Any, Any]:
    """Load, truncate, annotate (unless already annotated) and check that some rows are trainable.

    Returns ``(ds, buckets)``; ``ds`` keeps every row (``bucket == -1`` marks skipped ones, the sampler ignores
    them) so row indices stay those of the dataset.
    """
    from hf_arb import BucketSet, add_bucket_columns

    with accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext():
        ds = load_raw_dataset(args)
        check_columns(ds, args)
        if args.max_train_samples is not None:
            ds = ds.shuffle(seed=args.seed).select(range(min(args.max_train_samples, len(ds))))
        if "bucket" in ds.column_names:
            ds, buckets = annotated_dataset_buckets(args, ds, BucketSet.from_dataset(ds),
                                                    accelerator is None or accelerator.is_main_process)
        else:
            buckets, notes = bucket_table_from_args(args)
            if accelerator is None or accelerator.is_main_process:
                log_bucket_notes(args, notes)
            ds = add_bucket_columns(ds, buckets, image_column=args.image_column, show_summary=False)
            if accelerator is None or accelerator.is_main_process:  # once; startup_report prints the table
                print(annotation_note(ds, buckets), flush=True)
    ids = np.asarray(ds.with_format("numpy")["bucket"])
    if len(ds) == 0 or not (ids >= 0).any():
        reasons = {}
        if "skip_reason" in ds.column_names and len(ds):
            for r in ds["skip_reason"]:
                reasons[r] = reasons.get(r, 0) + 1
        raise UsageError(
            f"No trainable images: {len(ds)} rows, 0 assigned to a bucket (skip reasons: {reasons or 'none'}). "
            f"Loosen --max_aspect_error (now {args.max_aspect_error}), pick another --bucket_preset, or check the "
            "--image_column."
        )
    return ds, buckets


def check_plan(args: argparse.Namespace, ds: Any, num_processes: int) -> None:
    """With --bucket_leftover drop, some bucket must hold a full (global) batch, or the epoch has no step (a pixel
    budget and --packing: their samplers check their own plans)."""
    if args.bucket_leftover != "drop" or args.max_pixels_per_batch is not None or args.packing:
        return
    ids = np.asarray(ds.with_format("numpy")["bucket"])
    largest = int(np.bincount(ids[ids >= 0]).max()) if (ids >= 0).any() else 0
    need = args.train_batch_size * (1 if args.no_bucket_sync else num_processes)
    if largest < need:
        raise UsageError(
            f"The sampler yields no full batch per rank: the largest bucket has {largest} images, a step needs {need} "
            f"(--train_batch_size {args.train_batch_size} x {num_processes} processes). Lower --train_batch_size, "
            "use --bucket_leftover fill (or catch_all), or add images."
        )


#: the sampler's advice (hf_arb.sampling.report.remedies) in the script's flags
SAMPLER_FLAG_NAMES = {"BucketBatchSampler drops": "The epoch plan drops",
                      "`leftover=\"fill\"` or `\"catch_all\"`": "--bucket_leftover fill (or catch_all)",
                      "`leftover=\"fill\"`": "--bucket_leftover fill",
                      "a smaller `batch_size`": "a smaller --train_batch_size",
                      "a smaller batch per bucket": "a smaller --max_pixels_per_batch",
                      "fewer buckets": "fewer buckets (--bucket_preset, --aspect_ratio_buckets)",
                      ", `merge_small=True` (merge small buckets)": "",
                      "num_replicas ": "processes ", "× batch_size": "× --train_batch_size"}


#: A resolution that needs more than this upscale for at least half of the kept images is refused before training.
MAX_TYPICAL_UPSCALE = 8.0


def check_upscale(args: argparse.Namespace, ds: Any, buckets: Any) -> None:
    """Refuse a --resolution far above the images (the median kept image upscaled more than MAX_TYPICAL_UPSCALE x):
    each image would be enlarged that much in memory and the run would end blaming the images."""
    if not {"original_width", "original_height"} <= set(ds.column_names):
        return
    from hf_arb.annotate.summary import cover_scales

    cols = ds.select_columns(["bucket", "original_width", "original_height"]).with_format("arrow")[:]  # no decoding
    ids = cols.column("bucket").to_numpy()
    scale = cover_scales(ids, cols.column("original_width"), cols.column("original_height"), buckets)  # (n,)
    scale = scale[np.isfinite(scale)]
    if scale.size and float(np.median(scale)) > MAX_TYPICAL_UPSCALE:
        res = buckets.resolutions
        typical = int(np.median(np.sqrt(res[ids[ids >= 0], 0] * res[ids[ids >= 0], 1]) / np.median(scale)))
        side = max(args.bucket_step or 64, typical // (args.bucket_step or 64) * (args.bucket_step or 64))
        raise UsageError(
            f"--resolution {args.resolution}: the median image would be upscaled {np.median(scale):.0f}x to cover its "
            f"bucket ({int((scale > MAX_TYPICAL_UPSCALE).sum())} of {scale.size} kept images more than "
            f"{MAX_TYPICAL_UPSCALE:g}x, the most {scale.max():.0f}x); the resolution is too large for these images. "
            f"Pass a smaller --resolution, e.g. {side} (about their median side).")


def make_sampler(args: argparse.Namespace, ds: Any, buckets: Any, accelerator: Any) -> Any:
    """The global epoch plan over all ranks; a plain ``accelerator.prepare`` deals each rank its batches."""
    from hf_arb import BucketBatchSampler

    if args.packing:
        return make_pack_sampler(args, ds, accelerator)
    from hf_arb.cli.buckets import in_flags

    try:
        with warnings.catch_warnings(record=True) as caught:  # the library's advice, said once in flags below
            warnings.simplefilter("always", UserWarning)
            sampler = BucketBatchSampler(
                ds, args.train_batch_size, num_replicas=accelerator.num_processes,  # no rank=: prepare deals the plan
                seed=args.seed, shuffle=True, sync_buckets=not args.no_bucket_sync, leftover=args.bucket_leftover,
                return_keys=True, buckets=buckets, max_pixels_per_batch=args.max_pixels_per_batch,
                log_report=False,  # startup_report prints it
            )
    except ValueError as e:  # a pixel budget below a bucket's area, or no full batch: the flags to change
        if args.max_pixels_per_batch is None:
            if str(e).startswith("The epoch plan has zero batches"):
                raise UsageError(in_flags(str(e), SAMPLER_FLAG_NAMES)) from None
            raise
        raise UsageError(f"--max_pixels_per_batch {args.max_pixels_per_batch}: {e}") from None
    for w in caught:
        if not issubclass(w.category, UserWarning) or "Remedies:" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        elif accelerator.is_main_process:  # one line, in flags, without the warning's source line
            logger.warning("%s", in_flags(str(w.message), SAMPLER_FLAG_NAMES))
    return sampler


# ============================================================================================ packing
def make_pack_sampler(args: argparse.Namespace, ds: Any, accelerator: Any) -> Any:
    """--packing: every image at its own size (at most (--resolution/16)^2 tokens), packs of --max_tokens tokens."""
    from hf_arb import PackBatchSampler

    image_tokens = min(args.max_tokens, max(1, (args.resolution // 16) ** 2))
    try:
        return PackBatchSampler(ds, args.max_tokens, max_image_tokens=image_tokens,
                                num_replicas=accelerator.num_processes, rank=accelerator.process_index,
                                seed=args.seed, leftover="fill" if args.bucket_leftover == "fill" else "drop",
                                log_report=False)
    except ValueError as err:
        raise UsageError(f"--packing --max_tokens {args.max_tokens}: {err}") from None


def pack_schedule(args: argparse.Namespace, sampler: Any, num_processes: int) -> Schedule:
    """diffusers' step arithmetic over the real epochs: with packing, steps per epoch differ a little."""
    accum = args.gradient_accumulation_steps

    def updates(epoch: int) -> int:
        return math.ceil(sampler.steps_in(epoch) / accum)

    if args.max_train_steps is None:
        epochs = args.num_train_epochs
        steps = sum(updates(e) for e in range(epochs))
    else:
        steps, epochs, done = args.max_train_steps, 0, 0
        while done < steps:
            done, epochs = done + updates(epochs), epochs + 1
    return Schedule(sampler.steps_in(0), updates(0), steps, epochs, args.lr_warmup_steps * num_processes,
                    steps * num_processes)


def packed_model(args: argparse.Namespace, models: Models) -> Any:
    """What ``accelerator.prepare`` wraps: with --packing, a module whose forward is the packed loss, so that DDP
    synchronises the packed computation; else the denoiser itself."""
    if not args.packing:
        return models.unet
    from hf_arb.packing.loss import PackedFlowModel

    return PackedFlowModel(models.unet)


def unwrap(accelerator: Any, model: Any) -> Any:
    """The trained denoiser behind a prepared model (through a --packing wrapper)."""
    from hf_arb.packing.loss import denoiser

    return denoiser(accelerator.unwrap_model(model))


def packing_report(sampler: Any) -> str:
    """--packing's startup lines: this epoch's packs, padding and left-out rows, and the crop to the patch grid."""
    rep = sampler.report()
    ok = sampler.sizes.tokens > 0
    return (f"{rep.text()}\nimages at their own size: {int(ok.sum()):,} rows, mean "
            f"{sampler.sizes.tokens[ok].mean():,.0f} "
            f"tokens (cap {int(sampler.max_image_tokens):,}), mean crop to the 16 px grid "
            f"{100 * sampler.mean_crop_fraction():.2f}% of the area; pack budget {sampler.max_tokens:,} tokens")


def image_dataset(args: argparse.Namespace, ds: Any, buckets: Any) -> Any:
    from hf_arb import BucketedImageDataset

    return BucketedImageDataset(ds, buckets, image_column=args.image_column, caption_column=args.caption_column,
                                tokenizer=None, seed=args.seed, center_crop=args.center_crop,
                                random_flip=args.random_flip, resample=args.image_interpolation_mode,
                                on_bad_image=args.on_bad_image, bad_image_log=Path(args.output_dir) / SKIPPED_ROWS_FILE)


def build_dataloader(args: argparse.Namespace, accelerator: Any, ds: Any, buckets: Any, models: Models, sampler: Any,
                     schedule: Schedule, weight_dtype: torch.dtype) -> tuple[Any, Any]:
    """DataLoader over images (fitted to the batch's bucket) or, with --cache_latents, over cached latents.

    Returns ``(dataloader, cache index or None)``; the loader still has to go through ``accelerator.prepare``.
    """
    if args.cache_latents:
        from hf_arb.train.latent_dataset import CachedLatentDataset

        cache, index, repair = build_latent_cache(args, accelerator, ds, buckets, models, sampler, schedule,
                                                  weight_dtype)
        captions = ds.select_columns([args.caption_column])[args.caption_column]
        # re-encoding in a loader worker needs the VAE there: fine on CPU, not for a CUDA VAE in a forked worker
        in_process = args.dataloader_num_workers == 0 or accelerator.device.type == "cpu"
        dataset: Any = CachedLatentDataset(cache, index, captions, seed=args.seed, repair=repair if in_process else None)
        collate = CachedLatentDataset.collate
    else:
        index = None
        if args.packing:
            from hf_arb import PackedImageDataset

            dataset = PackedImageDataset(
                ds, sampler.sizes, image_column=args.image_column, caption_column=args.caption_column, seed=args.seed,
                center_crop=args.center_crop, random_flip=args.random_flip, resample=args.image_interpolation_mode,
                on_bad_image=args.on_bad_image, bad_image_log=Path(args.output_dir) / SKIPPED_ROWS_FILE)
        else:
            dataset = image_dataset(args, ds, buckets)
        collate = dataset.collate
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                         num_workers=args.dataloader_num_workers)
    return loader, index


# ============================================================================================ streaming
def stream_files(args: argparse.Namespace) -> list[str]:
    """The annotated parquet shards of --train_data_dir (for --streaming)."""
    files = sorted(str(f) for f in Path(args.train_data_dir).glob("*.parquet"))
    if not files:
        raise UsageError(f"--streaming --train_data_dir {args.train_data_dir}: no *.parquet shards there. Write the "
                         "annotated dataset as parquet shards (`hf-arb annotate ...`, then `ds.to_parquet`).")
    return files


def streaming_dataset(args: argparse.Namespace) -> tuple[Any, Any, np.ndarray]:
    """``(IterableDataset, BucketSet, rows per bucket)`` for --streaming; the data must carry bucket columns."""
    import datasets

    from hf_arb import BucketSet
    from hf_arb.sampling.stream_plan import as_counts

    files = stream_files(args) if args.dataset_name is None else None
    ds = datasets.load_dataset(args.dataset_name or "parquet", args.dataset_config_name, data_files=files,
                               data_dir=args.train_data_dir if args.dataset_name else None, split="train",
                               streaming=True, cache_dir=args.cache_dir)
    ds = ds.shuffle(seed=args.seed, buffer_size=1)  # shard order only: the stream's buffer mixes the rows
    columns = ds.column_names or list(ds.features or [])
    if "bucket" not in columns:
        raise UsageError(f"--streaming needs a dataset with bucket columns; {args.dataset_name or args.train_data_dir} "
                         f"has {columns}. Run `hf-arb annotate` first and stream the annotated shards.")
    for flag in ("image_column", "caption_column", "stream_key_column"):
        if getattr(args, flag) not in columns:
            raise UsageError(f"--{flag} value '{getattr(args, flag)}' needs to be one of: {', '.join(columns)}")
    key_type = getattr((ds.features or {}).get(args.stream_key_column), "dtype", None)
    if key_type is not None and not str(key_type).startswith(("int", "uint")):
        raise UsageError(f"--stream_key_column {args.stream_key_column} holds {key_type}, not integers: pass an integer "
                         "id column (e.g. the row number, added when writing the shards).")
    buckets = BucketSet.from_dataset(ds)
    if args.stream_counts is not None:
        counts = as_counts(json.loads(Path(args.stream_counts).read_text()), buckets)
    elif files is not None:  # local shards: the bucket column alone, vectorised
        import pyarrow.parquet as pq

        ids = np.concatenate([pq.read_table(f, columns=["bucket"]).column("bucket").to_numpy() for f in files])
        counts = np.bincount(ids[ids >= 0], minlength=len(buckets)).astype(np.int64)
    else:
        counts = hub_counts(args, ds, buckets)
    if counts.sum() == 0:
        raise UsageError("No trainable images: the stream's bucket column assigns no row to a bucket. Re-annotate "
                         "(`hf-arb annotate`) with a looser --max_aspect_error or another preset.")
    return ds, buckets, counts


def hub_counts(args: argparse.Namespace, ds: Any, buckets: Any) -> np.ndarray:
    """Rows per bucket from the dataset card (``hf_arb.push_to_hub``), else one pass over the bucket column."""
    from hf_arb.sampling.stream_plan import counts_from_card

    try:
        from huggingface_hub import DatasetCard

        return counts_from_card(DatasetCard.load(args.dataset_name), "train", buckets)
    except Exception as err:  # noqa: BLE001 -- no card, no hf_arb stats in it, offline: count instead (said, not silent)
        logger.warning("--streaming: no bucket counts from the card of %s (%s); counting the bucket column in one "
                       "pass (pass --stream_counts to skip it).", args.dataset_name, err)
    counts = np.zeros(len(buckets), dtype=np.int64)
    for batch in ds.select_columns(["bucket"]).iter(batch_size=65536):
        ids = np.asarray(batch["bucket"], dtype=np.int64)
        counts += np.bincount(ids[ids >= 0], minlength=len(buckets))[: len(buckets)]
    return counts


def build_stream_dataloader(args: argparse.Namespace, accelerator: Any, ds: Any, counts: np.ndarray) -> tuple[Any, Any]:
    """``(DataLoader, BucketedStream)``: one bucket per step on every rank, each rank reading its own split."""
    import hf_arb
    from hf_arb.sampling import StreamImageCollate

    collate = StreamImageCollate(args.stream_key_column, args.image_column, args.caption_column, seed=args.seed,
                                 center_crop=args.center_crop, random_flip=args.random_flip)
    return hf_arb.build_stream_loader(ds, args.train_batch_size, counts=counts, accelerator=accelerator,
                                      seed=args.seed, buffer_size=args.stream_buffer_size,
                                      on_overflow=args.stream_on_overflow, collate_fn=collate)


def stream_state_path(folder: Path | str, accelerator: Any) -> Path:
    return Path(folder) / f"stream_rank{accelerator.process_index}.json"


def stream_startup_report(accelerator: Any, buckets: Any, counts: np.ndarray, stream: Any, schedule: Schedule,
                          args: argparse.Namespace) -> None:
    """--streaming's first table: rows per bucket (from the counts), the stream's report, the step arithmetic."""
    if not accelerator.is_main_process:
        return
    lines = [f"{'bucket':>11} {'aspect':>7} {'rows':>9}"]
    for i in buckets.portrait_to_landscape():
        w, h = buckets.resolutions[i]
        lines.append(f"{w:>5} x {h:<5} {w / h:7.3f} {int(counts[i]) if i < len(counts) else 0:>9,}")
    print("\n".join(lines), flush=True)
    print(stream.report(), flush=True)
    print(f"***** Running training (streaming) *****\n  Num examples = {int(counts.sum())}\n"
          f"  Steps per epoch = {schedule.batches_per_epoch}\n  Num Epochs = {schedule.num_train_epochs}\n"
          f"  Instantaneous batch size per device = {args.train_batch_size}\n"
          f"  Total optimization steps = {schedule.max_train_steps}", flush=True)


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
        raise UsageError(
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

    from hf_arb.train import latents as lat

    cache = lat.LatentCache(args.latent_cache_dir or os.path.join(args.output_dir, "latent_cache"))
    vae = place(models.vae, accelerator.device, torch.float32)
    vae_id = lat.vae_fingerprint(vae)
    if args.image_interpolation_mode != "lanczos":  # another resize filter makes other latents
        vae_id = f"{vae_id}|{args.image_interpolation_mode}"
    ids = np.asarray(ds.with_format("numpy")["bucket"])
    rows = np.flatnonzero(ids >= 0)
    share = rows[lat.plan_share(len(rows), accelerator.process_index, accelerator.num_processes)]
    mine = dict(zip(share.tolist(), lat.content_hashes(ds, args.image_column, share.tolist(),
                                                                 show_progress=accelerator.is_local_main_process)))
    hashes_by_row: dict[int, str] = {}
    for part in gather_object([mine]) if accelerator.num_processes > 1 else [mine]:
        hashes_by_row.update(part)
    hashes = [hashes_by_row.get(i, "") for i in range(len(ds))]
    pairs = {(int(r), int(ids[r])) for r in rows}
    if args.bucket_leftover != "drop":  # leftovers may be trained at another bucket: read the all-ranks plan
        for epoch in range(schedule.num_train_epochs):
            plan = sampler.plan(epoch)  # (steps, world, batch): every rank's rows
            if hasattr(plan, "offsets"):  # --max_pixels_per_batch: a ragged plan (flat rows, a bucket per step)
                pairs.update(zip(plan.rows.tolist(), np.repeat(plan.buckets, np.diff(plan.offsets)).tolist()))
                continue
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
                   load_batch=load_batch, encode=encode, batch_size=args.train_batch_size,
                   show_progress=accelerator.is_local_main_process)
    accelerator.wait_for_everyone()
    mine = [(index.encoded, index.reused, index.repaired)]
    counts = gather_object(mine) if accelerator.num_processes > 1 else mine
    index.encoded, index.reused, index.repaired = (sum(c[i] for c in counts) for i in range(3))
    logger.info("Latent cache %s: encoded %d (%d of them damaged entries), reused %d entries (%d variant(s) per "
                "image) in %.1f s.", cache.root, index.encoded, index.repaired, index.reused, index.variants,
                time.perf_counter() - t0)
    place(models.vae, dtype=weight_dtype)
    return cache, index, latent_repair(cache, index, load_batch, models.vae)


def latent_repair(cache: Any, index: Any, load_batch: Any, vae: Any) -> Any:
    """``(row, bucket, epoch)`` → encode that cache entry again (an entry damaged while training; see hf_arb.train.latents)."""

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
        self.trained = models.trained_text_encoders  # LoRA on the encoders: forward through them with gradients

    def _encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.set_grad_enabled(self.trained is not None):
            return self._encode_inner(captions)

    def _encode_inner(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.models.flow is not None:  # SD3 / Flux: the family's own prompt encoding
            encoders = [*(self.trained or []), *self.models.text_encoders[len(self.trained or []):]]
            h, p = self.models.flow.encode_prompts(self.models.tokenizers, encoders, captions,
                                                   self.device, self.models.flow_options.max_sequence_length)
            return h.to(self.dtype), p.to(self.dtype)
        hidden, pooled = [], None
        for tok, te in zip(self.models.tokenizers, self.trained or self.models.text_encoders):
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
        pooled = None if self.memo[captions[0]][1] is None else torch.stack(
            [self.memo[c][1] for c in captions]).to(self.device)
        return hidden, pooled


# ============================================================================================ training
@dataclass
class Progress:
    """Counters saved with every checkpoint (``hf_arb_state.json``): optimizer steps, micro-batches trained
    (per rank; where the data resumes, via ``hf_arb.resume_dataloader``, and the noise stream's key) and the seed."""

    global_step: int = 0
    seed: int = 0
    micro_step: int = 0


def restore(accelerator: Any, resume_dir: Path | None, seed: int) -> Progress:
    """Load accelerate's state (UNet, optimizer, scheduler, sampler cursor, RNG) and our counters, if resuming."""
    if resume_dir is None:
        return Progress(seed=seed)
    accelerator.print(f"Resuming from checkpoint {resume_dir}")
    accelerator.load_state(str(resume_dir))
    saved = json.loads((resume_dir / STATE_FILE).read_text())
    return Progress(**{f.name: saved[f.name] for f in dataclasses.fields(Progress) if f.name in saved})


def restore_stream(accelerator: Any, stream: Any, resume_dir: Path, progress: Progress) -> None:
    """--streaming: this rank's stream state from the checkpoint; it must sit where the micro-batch counter is."""
    path = stream_state_path(resume_dir, accelerator)
    if not path.exists():
        raise UsageError(f"Checkpoint {resume_dir} has no {path.name}: it was not saved by a --streaming run (or with "
                         "another number of processes). Resume it without --streaming, or start a new run.")
    stream.load_state_dict(json.loads(path.read_text()))
    where = divmod(progress.micro_step, stream.steps_per_epoch)
    at_end = stream.step >= stream.steps_per_epoch  # saved after an epoch's last batch: the next epoch starts
    if (stream.epoch + at_end, 0 if at_end else stream.step) != where:
        raise ValueError(f"Checkpoint {resume_dir}: {path.name} is at epoch {stream.epoch} step {stream.step}, but "
                         f"{STATE_FILE}'s micro_step {progress.micro_step} is at epoch {where[0]} step {where[1]}.")


def check_resumed_step(args: argparse.Namespace, accelerator: Any, progress: Progress, sampler: Any, optimizer: Any,
                       resume_dir: Path | None) -> None:
    """The checkpoint's global_step must agree with its micro-batch counter and the optimizer's step count."""
    from hf_arb.train.checkpointing import expected_global_step

    if resume_dir is None:
        return
    locate = getattr(sampler, "locate", None)  # a BucketedStream (--streaming): every epoch is steps_per_epoch long
    epoch, position = locate(progress.micro_step) if locate else divmod(progress.micro_step, sampler.steps_per_epoch)
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
        raise UsageError(
            f"Checkpoint {resume_dir} is inconsistent: {STATE_FILE} says global_step {progress.global_step}, but its "
            f"micro_step {progress.micro_step} is at update {expected} (with --gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps}) and the optimizer at step {opt_step}. The file was edited or the "
            "flags differ from the run that saved it; resume with the same flags or from another checkpoint."
        )


def save_checkpoint(args: argparse.Namespace, accelerator: Any, progress: Progress,
                    stream_state: dict[str, Any] | None = None) -> Path:
    """accelerate's state (UNet, optimizer, LR scheduler, sampler, RNG) + our counters, written to a temporary
    folder, renamed into place once complete, and only then are old checkpoints pruned (see hf_arb.train.checkpointing)."""
    from hf_arb.train.checkpointing import publish_checkpoint, tmp_checkpoint_dir

    tmp = tmp_checkpoint_dir(args.output_dir, progress.global_step)
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)  # left by a killed run
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        flags = {f: getattr(args, f) for f in RESUME_FLAGS}  # read back by check_resume_flags
        (tmp / STATE_FILE).write_text(json.dumps({**progress.__dict__, **flags,
                                                  "num_processes": accelerator.num_processes}, indent=1))
    if stream_state is not None:  # --streaming: each rank's buffer and position (not accelerate's to save)
        stream_state_path(tmp, accelerator).write_text(json.dumps(stream_state))
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
        from hf_arb.families.conditioning import resolution_class_labels

        labels = resolution_class_labels(time_ids, resolution_dim).to(hidden.dtype)
        return unet(noisy, timesteps, hidden, class_labels=labels).sample
    return unet(noisy, timesteps, hidden).sample


def diffusion_loss(args: argparse.Namespace, models: Models, unet: Any, batch: dict[str, Any], text: TextEncoder,
                   gen: torch.Generator, weight_dtype: torch.dtype, resolution_dim: int | None) -> torch.Tensor:
    """The diffusers loss for one micro-batch: latents → noise → UNet → (SNR-weighted) MSE (SD3 / Flux: the
    flow-matching loss with the batch's resolution shift, :func:`hf_arb.families.flow.flow_loss`)."""
    if models.flow is not None and "grids" in batch:  # --packing: one pack of images at their own sizes
        from hf_arb.packing.family import packed_flow_step

        return packed_flow_step(models.flow, models.flow_options, unet, batch, models.vae, text, gen, weight_dtype,
                                args.max_tokens, args.proportion_empty_prompts)
    if models.flow is not None:
        from hf_arb.families.flow import flow_loss

        return flow_loss(models.flow, models.flow_options, unet, batch, models.vae, text, gen, weight_dtype,
                         args.proportion_empty_prompts)
    from diffusers.training_utils import compute_snr

    from hf_arb.families.conditioning import sdxl_time_ids
    from hf_arb.families.flow import posterior, sample_latents

    device, sched, vae = gen.device, models.noise_scheduler, models.vae
    mean, std = posterior(batch, vae, device)  # cached (latent_stats) or encoded now
    latents = sample_latents(mean, std, vae.config, gen).to(weight_dtype)
    bsz = latents.shape[0]
    noise = torch.randn(latents.shape, generator=gen, device=device, dtype=latents.dtype)
    if args.noise_offset:
        noise = noise + args.noise_offset * torch.randn((bsz, latents.shape[1], 1, 1), generator=gen, device=device,
                                                          dtype=latents.dtype)
    if args.timestep_bias_strategy == "none":
        timesteps = torch.randint(0, sched.config.num_train_timesteps, (bsz,), generator=gen, device=device).long()
    else:
        weights = timestep_bias_weights(args, sched.config.num_train_timesteps).to(device)
        timesteps = torch.multinomial(weights, bsz, replacement=True, generator=gen).long()
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
    if args.dream_training:
        noisy, target = dream_adjust(sched, timesteps, noise, noisy, target, args.dream_detail_preservation,
                                     lambda x: unet_forward(models, unet, x, timesteps, hidden, pooled, time_ids,
                                                            resolution_dim))
    pred = unet_forward(models, unet, noisy, timesteps, hidden, pooled, time_ids, resolution_dim)
    if args.snr_gamma is None:
        return F.mse_loss(pred.float(), target.float(), reduction="mean")
    snr = compute_snr(sched, timesteps)
    if sched.config.prediction_type == "v_prediction":
        snr = snr + 1
    weights = torch.clamp(snr, max=args.snr_gamma) / snr
    loss = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3)) * weights
    return loss.mean()


def timestep_bias_weights(args: argparse.Namespace, num_timesteps: int) -> torch.Tensor:
    """Sampling weights over ``num_timesteps`` for --timestep_bias_* (the SDXL script's options).

    ``earlier`` / ``later`` multiply the first / last ``portion`` of the timesteps by ``multiplier``; ``range``
    multiplies ``[begin, end)``. Returns a ``(num_timesteps,)`` probability vector.
    """
    weights = torch.ones(num_timesteps, dtype=torch.float64)
    count = int(args.timestep_bias_portion * num_timesteps)
    strategy = args.timestep_bias_strategy
    if strategy == "later":
        sel = slice(num_timesteps - count, num_timesteps)
    elif strategy == "earlier":
        sel = slice(0, count)
    elif strategy == "range":
        if args.timestep_bias_end > num_timesteps:
            raise UsageError(f"--timestep_bias_end {args.timestep_bias_end} exceeds the scheduler's "
                             f"{num_timesteps} training timesteps.")
        sel = slice(args.timestep_bias_begin, args.timestep_bias_end)
    else:
        sel = slice(0, 0)
    weights[sel] *= args.timestep_bias_multiplier
    return (weights / weights.sum()).float()


def dream_adjust(sched: Any, timesteps: torch.Tensor, noise: torch.Tensor, noisy: torch.Tensor, target: torch.Tensor,
                 detail_preservation: float, predict: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """DREAM (arXiv:2312.00210, Algorithm 3): shift the noisy input and the target by the model's own error.

    ``predict(noisy)`` is one UNet call (run without gradients); with ``sigma = sqrt(1 - alpha_bar_t)`` and
    ``delta = (noise - prediction) * sigma ** p``, returns ``(noisy + sigma * delta, target + delta)``.
    """
    if sched.config.prediction_type != "epsilon":
        raise UsageError("--dream_training supports epsilon prediction only: drop --prediction_type v_prediction.")
    alpha_bar = sched.alphas_cumprod.to(noisy.device)[timesteps].float()
    sigma = (1.0 - alpha_bar).sqrt().view(-1, *([1] * (noisy.ndim - 1)))
    with torch.no_grad():
        pred = predict(noisy)
    delta = (noise.float() - pred.float()) * sigma ** detail_preservation
    return (noisy.float() + sigma * delta).to(noisy.dtype), (target.float() + delta).to(target.dtype)


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
    if models.flow is not None:
        return models.flow.pipeline_class()
    if models.sdxl:
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline
    if args.resolution_conditioning:
        from hf_arb.families.conditioning import StableDiffusionResolutionPipeline

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
    if models.flow is not None:
        return build_flow_pipeline(args, models, unet, dtype, final=final)
    parts: dict[str, Any] = {"unet": unet}
    if not final:
        parts.update(vae=models.vae, text_encoder=models.text_encoders[0], tokenizer=models.tokenizers[0])
        if models.sdxl:
            parts.update(text_encoder_2=models.text_encoders[1], tokenizer_2=models.tokenizers[1])
        else:
            parts.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    elif args.pretrained_vae_model_name_or_path:
        parts["vae"] = place(models.vae, dtype=torch.float32)
    return cls.from_pretrained(args.pretrained_model_name_or_path, revision=args.revision, variant=args.variant,
                               dtype=dtype, **parts)


def build_flow_pipeline(args: argparse.Namespace, models: Models, transformer: Any, dtype: torch.dtype, *,
                        final: bool) -> Any:
    """SD3 / Flux: the stock pipeline around the trained transformer (validation reuses the loaded parts; see
    :func:`hf_arb.families.flow.stock_pipeline`)."""
    from hf_arb.families.flow import stock_pipeline

    parts: dict[str, Any] = {}
    if not final:
        names = ("", "_2", "_3")
        parts.update(vae=models.vae, **{f"text_encoder{n}": te for n, te in zip(names, models.text_encoders)},
                     **{f"tokenizer{n}": tok for n, tok in zip(names, models.tokenizers)})
    elif args.pretrained_vae_model_name_or_path:
        parts["vae"] = models.vae.to(torch.float32)
    return stock_pipeline(models.flow, models.flow_options, args.pretrained_model_name_or_path, transformer,
                          components=parts, revision=args.revision, variant=args.variant, dtype=dtype)


def log_validation(args: argparse.Namespace, accelerator: Any, models: Models, unet: Any, buckets: Any,
                   step: int, dtype: torch.dtype, *, pipe: Any = None, name: str | None = None) -> Path | None:
    """Generate every prompt at portrait / square / landscape buckets, save one grid PNG, log it to trackers.

    ``pipe``: a ready pipeline (the final LoRA check loads the saved adapter into the base model); by default one
    is built around ``unet`` (which carries the adapter in LoRA mode).
    """
    if not args.validation_prompts or not accelerator.is_main_process:
        return None
    pipe = (pipe or build_pipeline(args, models, unet, dtype)).to(accelerator.device)
    pipe.set_progress_bar_config(disable=True)
    shapes = validation_shapes(buckets)
    rows = []
    from tqdm.auto import tqdm

    bar = tqdm(total=len(args.validation_prompts) * len(shapes) * args.num_validation_images, unit="img",
               desc="Validation images", leave=False)  # under the Steps bar: gone once the grid is saved
    for i, prompt in enumerate(args.validation_prompts):
        row = []
        for w, h in shapes:
            for j in range(args.num_validation_images):
                bar.update()
                g = torch.Generator(device=accelerator.device).manual_seed(args.seed + 1000 * i + j)
                row.append(pipe(prompt, height=h, width=w, num_inference_steps=args.num_validation_inference_steps,
                                generator=g).images[0])
        rows.append(row)
    bar.close()
    grid = image_grid(rows)
    path = Path(args.output_dir) / "validation" / f"{name or f'step-{step:06d}'}.png"
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
#: model card per flow family: (tags, license, pipeline class)
FLOW_CARDS = {"sd3": (["sd3", "sd3-diffusers"], "other", "StableDiffusion3Pipeline"),
              "flux": (["flux", "flux-diffusers"], "other", "FluxPipeline")}


def save_model_card(args: argparse.Namespace, repo_id: str, buckets: Any, *, sdxl: bool,
                    images: list[str] | None = None, stats: dict[str, Any] | None = None,
                    family: str | None = None) -> Path:
    """Write ``README.md`` in output_dir: works with or without validation images and trackers. ``family``
    ("sd3" / "flux") selects the flow families' tags and pipeline class."""
    base = args.pretrained_model_name_or_path
    tags = ["stable-diffusion-xl" if sdxl else "stable-diffusion", "text-to-image", "diffusers",
            "diffusers-training", "aspect-ratio-bucketing", "hf_arb"]
    license_ = "creativeml-openrail-m"
    if family in FLOW_CARDS:
        tags = [*FLOW_CARDS[family][0], *tags[1:]]
        license_ = FLOW_CARDS[family][1]
    front = ["---", f"license: {license_}", f"base_model: {base}", "library_name: diffusers", "tags:"]
    front += [f"- {t}" for t in tags] + ["inference: true", "---", ""]
    labels = buckets.labels()
    body = [
        f"# {repo_id}", "",
        f"Fine-tuned from **{base}** with aspect-ratio bucketing (hf_arb's `train_text_to_image_arb.py`): each "
        "image was trained at close to its own aspect ratio, and every batch held one bucket shape.", "",
        f"* buckets: {len(labels)} ({', '.join(labels[:12])}{', ...' if len(labels) > 12 else ''}), "
        f"from {bucket_origin(args)}",
        f"* steps: {stats.get('global_step') if stats else args.max_train_steps}, batch size {args.train_batch_size} "
        f"per device, gradient accumulation {args.gradient_accumulation_steps}, learning rate {args.learning_rate}",
        f"* mixed precision: {(stats or {}).get('mixed_precision', args.mixed_precision)}; dataset: "
        f"{args.dataset_name or args.train_data_dir or args.instance_data_dir}", "",
    ]
    if getattr(args, "lora", False):
        body += [f"LoRA adapters (rank {args.rank}, alpha {args.lora_alpha or args.rank}) on the "
                 f"{'transformer' if family in FLOW_CARDS else 'UNet'}"
                 + (" and the text encoder(s)" if args.train_text_encoder else "")
                 + f", in `pytorch_lora_weights.safetensors`; load them into **{base}**.", ""]
    elif args.resolution_conditioning and not sdxl:
        body += ["The UNet takes SDXL-style size/crop conditioning. The folder carries its pipeline "
                 "(`pipeline.py`), which plain diffusers loads with `custom_pipeline` and `trust_remote_code`.", ""]
    if family in FLOW_CARDS and getattr(args, "shift_table", None):
        body += ["Per-bucket resolution shift (`mu` from each bucket's latent token count, as the pipeline "
                 "computes at inference):", "", "```", args.shift_table, "```", ""]
    body += ["## Use", "", "```python", *usage_snippet(args, repo_id, sdxl=sdxl, family=family,
                                                       shape=validation_shapes(buckets)[0]), "```", ""]
    if args.validation_prompts:
        body += ["## Validation", "", "Prompts: " + "; ".join(f"`{p}`" for p in args.validation_prompts), ""]
        body += [f"![validation]({Path(p).relative_to(args.output_dir).as_posix()})" for p in images or []]
        body += [""]
    if args.report_to not in (None, "none", ""):
        body += [f"Training curves were logged to {args.report_to} (project `{args.tracker_project_name}`).", ""]
    path = Path(args.output_dir) / "README.md"
    path.write_text("\n".join(front + body))
    return path


def usage_snippet(args: argparse.Namespace, repo_id: str, *, sdxl: bool, family: str | None = None,
                  shape: tuple[int, int] = (512, 768)) -> list[str]:
    """The model card's "Use" code: plain diffusers, no hf_arb (LoRA, custom pipeline, or the stock class).

    Always: imports, the lines that load ``pipe``, ``pipe = pipe.to("cuda", torch.float16)``, one generation (the
    tests run everything but the device line in a process where ``import hf_arb`` fails).
    """
    cls = "StableDiffusionXLPipeline" if sdxl else "StableDiffusionPipeline"
    if family in FLOW_CARDS:
        cls = FLOW_CARDS[family][2]
    if getattr(args, "lora", False):
        load = [f'pipe = {cls}.from_pretrained("{args.pretrained_model_name_or_path}")',
                f'pipe.load_lora_weights("{repo_id}")']
    elif args.resolution_conditioning and not sdxl and family not in FLOW_CARDS:  # the folder's own pipeline.py (no hf_arb needed)
        cls = "DiffusionPipeline"
        load = [f'pipe = DiffusionPipeline.from_pretrained("{repo_id}", custom_pipeline="{repo_id}", '
                'trust_remote_code=True)']
    else:
        load = [f'pipe = {cls}.from_pretrained("{repo_id}")']
    return ["import torch", f"from diffusers import {cls}", "", *load, 'pipe = pipe.to("cuda", torch.float16)',
            f'image = pipe("a photo", height={shape[1]}, width={shape[0]}).images[0]  # a trained bucket shape']


def saved_line(args: argparse.Namespace, *, sdxl: bool, family: str | None) -> str:
    """The run's last line: where the output is and how stock diffusers loads it (the card's snippet, one line)."""
    snippet = usage_snippet(args, args.output_dir, sdxl=sdxl, family=family)
    load = snippet[1:snippet.index('pipe = pipe.to("cuda", torch.float16)')]
    return f"Saved to {args.output_dir}: load it with " + "; ".join(line for line in load if line)


def save_final(args: argparse.Namespace, accelerator: Any, models: Models, unet: Any, buckets: Any,
               progress: Progress, validation_images: list[str], stats: dict[str, Any]) -> None:
    """Save the pipeline (stock diffusers class unless --resolution_conditioning), buckets, card, push."""
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    unet = unwrap(accelerator, unet)
    if models.ema_unet is not None:
        models.ema_unet.copy_to(unet.parameters())
    pipe = build_pipeline(args, models, unet, torch.float32, final=True)
    if args.prediction_type is not None:  # sample with the objective the UNet was trained on
        pipe.scheduler.register_to_config(prediction_type=args.prediction_type)
    pipe.save_pretrained(args.output_dir)
    if args.resolution_conditioning and not models.sdxl:  # loadable without hf_arb: the pipeline code goes along
        from hf_arb.families.conditioning import save_custom_pipeline

        save_custom_pipeline(args.output_dir)
    (Path(args.output_dir) / BUCKETS_FILE).write_text(json.dumps(buckets.to_dict(), indent=1))
    done = Path(args.output_dir) / "validation" / f"step-{progress.global_step:06d}.png"
    if not done.exists():  # the last epoch's validation may already show these weights
        last = log_validation(args, accelerator, models, unet, buckets, progress.global_step, torch.float32)
        if last is not None:
            validation_images.append(str(last))
    finish_outputs(args, buckets, models, validation_images, stats)


def finish_outputs(args: argparse.Namespace, buckets: Any, models: Models, validation_images: list[str],
                   stats: dict[str, Any]) -> None:
    """Model card in output_dir (always: it says how to load the folder), then the push if asked."""
    repo_id = args.output_dir
    if args.push_to_hub:
        from huggingface_hub import create_repo

        repo_id = create_repo(repo_id=args.hub_model_id or Path(args.output_dir).name, exist_ok=True,
                              token=args.hub_token).repo_id
    save_model_card(args, repo_id, buckets, sdxl=models.sdxl, images=validation_images, stats=stats,
                    family=models.family)
    print(saved_line(args, sdxl=models.sdxl, family=models.family), flush=True)
    if args.push_to_hub:
        from huggingface_hub import upload_folder

        upload_folder(repo_id=repo_id, folder_path=args.output_dir, commit_message="End of training",
                      ignore_patterns=["step_*", "epoch_*", "checkpoint-*", "latent_cache/*", "batches/*"],
                      token=args.hub_token)


def startup_report(accelerator: Any, ds: Any, buckets: Any, sampler: Any, schedule: Schedule,
                   args: argparse.Namespace, models: Models) -> None:
    """The table users look at first: buckets, rows per bucket, the sampler's report, the step arithmetic."""
    if not accelerator.is_main_process:
        return
    ids = np.asarray(ds.with_format("numpy")["bucket"])
    if args.packing:
        print(packing_report(sampler), flush=True)
        print(f"***** Running training ({models.family.upper()}, packed) *****\n"
              f"  Num examples = {int((sampler.sizes.tokens > 0).sum())}\n  Num Epochs = {schedule.num_train_epochs}\n"
              f"  One pack of <= {args.max_tokens} tokens per device and step "
              f"({sampler.report().mean_images_per_pack:.2f} images on average)\n"
              f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}\n"
              f"  Total optimization steps = {schedule.max_train_steps}", flush=True)
        return
    counts = np.bincount(ids[ids >= 0], minlength=len(buckets))
    sizes = getattr(sampler, "batch_sizes", None)  # --max_pixels_per_batch: {bucket: batch size per device}
    lines = [f"{'bucket':>11} {'aspect':>7} {'rows':>9}" + (f" {'batch':>6}" if sizes else "")]
    for i in buckets.portrait_to_landscape():
        w, h = buckets.resolutions[i]
        lines.append(f"{w:>5} x {h:<5} {w / h:7.3f} {int(counts[i]):>9,}" + (f" {sizes.get(int(i), '-'):>6}" if sizes else ""))
    lines.append(f"skipped: {int((ids < 0).sum()):,} of {len(ids):,} rows")
    print("\n".join(lines), flush=True)
    report = getattr(sampler, "report", None)
    if callable(report):
        print(report(), flush=True)
    per_device = sampler.per_rank_batch_size if sizes else args.train_batch_size
    total = per_device * accelerator.num_processes * args.gradient_accumulation_steps
    if models.flow is not None:
        print(flow_shift_report(models, buckets), flush=True)
    print(f"***** Running training ({models.family.upper()}) *****\n"
          f"  Num examples = {int((ids >= 0).sum())}\n  Num Epochs = {schedule.num_train_epochs}\n"
          f"  Instantaneous batch size per device = {per_device}"
          f"{f' (at most; per bucket with --max_pixels_per_batch {args.max_pixels_per_batch})' if sizes else ''}\n"
          f"  Total train batch size (w. parallel, distributed & accumulation) = {total}\n"
          f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}\n"
          f"  Total optimization steps = {schedule.max_train_steps}", flush=True)


def flow_shift_report(models: Models, buckets: Any) -> str:
    """SD3 / Flux: each bucket's image_seq_len and mu, and the shift training applies (hf_arb.families.shift's table)."""
    from hf_arb.families.flow import shift_report

    return shift_report(models.flow_options, buckets, 2 ** (len(models.vae.config.block_out_channels) - 1))


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


def place(module: Any, device: Any = None, dtype: torch.dtype | None = None) -> Any:
    """``module.to(device)``, and ``.to(dtype)`` only when the dtype changes (diffusers warns on every dtype cast,
    even a no-op one)."""
    if device is not None:
        module.to(device)
    if dtype is not None and module.dtype != dtype:
        module.to(dtype=dtype)
    return module


def main(argv: list[str] | argparse.Namespace | None = None) -> dict[str, Any]:
    """Run a training; returns the run statistics (also written to ``<output_dir>/hf_arb_run.json``).

    ``argv``: a command line (parsed and checked here) or arguments already through :func:`cli_parse`.
    """
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        args = parse_args(argv)
        check_environment(args)
    resume_dir = resolve_resume_dir(args)
    check_resume_flags(args, resume_dir)  # before the data and the models
    single = int(os.environ.get("WORLD_SIZE", "1")) <= 1
    if single:  # the data and the plan are checked before torch, accelerate or any model is loaded
        setup_logging(None, ("datasets",))
        args = updated(args, seed=agree_on_seed(args, None, resume_dir))
        if not args.streaming:
            ds, buckets = dataset_with_buckets(args, None)
            check_plan(args, ds, 1)
            check_upscale(args, ds, buckets)
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    accelerator = make_accelerator(args)
    check_process_count(accelerator)
    setup_logging(accelerator, ("datasets",))
    if not single:
        args = updated(args, seed=agree_on_seed(args, accelerator, resume_dir))
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)

    stream = None
    if args.streaming:  # a BucketedStream stands in for the sampler: steps per epoch, and where a resume is
        ds, buckets, counts = streaming_dataset(args)
        dataloader, stream = build_stream_dataloader(args, accelerator, ds, counts)
        sampler = stream
    else:
        if not single:
            ds, buckets = dataset_with_buckets(args, accelerator)
        check_plan(args, ds, accelerator.num_processes)  # the plan is checked before any model is loaded
        if not single:
            check_upscale(args, ds, buckets)
        sampler = make_sampler(args, ds, buckets, accelerator)
    schedule = compute_schedule(sampler.steps_per_epoch, gradient_accumulation_steps=args.gradient_accumulation_steps,
                                num_train_epochs=args.num_train_epochs, max_train_steps=args.max_train_steps,
                                lr_warmup_steps=args.lr_warmup_steps, num_processes=accelerator.num_processes)
    if args.packing:
        schedule = pack_schedule(args, sampler, accelerator.num_processes)
    from diffusers.optimization import get_scheduler

    setup_logging(accelerator, ("transformers", "diffusers"))
    models = load_models(args)
    check_family(args, models)
    if models.flow is not None and not args.packing:  # latent sizes the transformer can patch, per-bucket shift
        check_flow_buckets(models, buckets, args)
        args = updated(args, shift_table=flow_shift_report(models, buckets))
    encode_calls = count_calls(models.vae, "encode")
    weight_dtype = weight_dtype_of(accelerator)
    if args.lora:
        trainable = setup_lora(args, models, weight_dtype)
        register_lora_checkpoint_hooks(accelerator, models, args)
    else:
        trainable = list(models.unet.parameters())
        register_checkpoint_hooks(accelerator, models)
    if args.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.scale_lr:
        args = updated(args, learning_rate=args.learning_rate * args.gradient_accumulation_steps
                       * args.train_batch_size * accelerator.num_processes)
    optimizer = make_optimizer(args, trainable)

    if stream is None:
        dataloader, index = build_dataloader(args, accelerator, ds, buckets, models, sampler, schedule, weight_dtype)
    else:
        index = None
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=schedule.scheduler_warmup_steps,
                                 num_training_steps=schedule.scheduler_training_steps,
                                 num_cycles=args.lr_num_cycles, power=args.lr_power)
    # as diffusers' scripts: one plain prepare call; the sampler's global plan is dealt to the ranks by accelerate
    from hf_arb.sampling.accelerate import fill_deepspeed_micro_batch

    if stream is None:
        fill_deepspeed_micro_batch(accelerator, sampler)  # DeepSpeed cannot read a batch sampler's batch size
    if args.lora and args.train_text_encoder:
        unet, *encoders, optimizer, dataloader, lr_scheduler = accelerator.prepare(
            packed_model(args, models), *lora_text_encoders(models), optimizer, dataloader, lr_scheduler)
        models.trained_text_encoders = encoders
    else:
        unet, optimizer, dataloader, lr_scheduler = accelerator.prepare(packed_model(args, models), optimizer,
                                                                        dataloader, lr_scheduler)
    if stream is None:  # (the stream's state is per rank: save_checkpoint writes it beside accelerate's)
        accelerator.register_for_checkpointing(sampler)  # its plan check refuses a checkpoint of another dataset/seed
    if models.ema_unet is not None:
        models.ema_unet.to("cpu" if args.offload_ema else accelerator.device)
    for te in models.text_encoders[len(models.trained_text_encoders or []):]:  # the frozen ones
        place(te, accelerator.device, weight_dtype)
    place(models.vae, accelerator.device, torch.float32 if models.sdxl and not args.pretrained_vae_model_name_or_path
                  else weight_dtype)
    if accelerator.is_main_process and accelerator.trackers == [] and args.report_to not in (None, "none", ""):
        config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers(args.tracker_project_name, config)
    if stream is None:
        startup_report(accelerator, ds, buckets, sampler, schedule, args, models)
    else:
        stream_startup_report(accelerator, buckets, counts, stream, schedule, args)

    progress = restore(accelerator, resume_dir, args.seed)
    if stream is not None and resume_dir is not None:
        restore_stream(accelerator, stream, resume_dir, progress)
    check_resumed_step(args, accelerator, progress, sampler, optimizer, resume_dir)
    if resume_dir is not None and progress.global_step >= schedule.max_train_steps:
        logger.warning("%s is at step %d, at or past --max_train_steps %d: nothing is left to train, so its weights "
                       "are saved as the final output (diffusers' scripts would train one more step).", resume_dir.name,
                       progress.global_step, schedule.max_train_steps)
    resolution_dim = None
    if args.resolution_conditioning and not models.sdxl:
        from hf_arb.families.conditioning import resolution_embed_dim

        resolution_dim = resolution_embed_dim(accelerator.unwrap_model(unet))
    stats = train_loop(args, accelerator, models, unet, optimizer, lr_scheduler, dataloader, sampler, buckets,
                       schedule, progress, weight_dtype, resolution_dim, tqdm)
    stats.update(vae_encode_calls=encode_calls[0], latents_encoded=index.encoded if index else None,
                 latents_reused=index.reused if index else None,
                 latents_repaired=index.repaired if index else None,
                 bad_images=report_bad_images(args, accelerator), num_processes=accelerator.num_processes,
                 sdxl=models.sdxl, family=models.family, seed=args.seed, schedule=schedule.__dict__, lora=args.lora,
                 trainable_parameters=sum(p.numel() for g in trainable for p in (g["params"] if isinstance(g, dict)
                                                                                 else [g])),
                 mixed_precision=str(accelerator.mixed_precision))  # the real one (flag or accelerate config)
    if stream is not None:
        stats["stream_report"] = stream.report().to_dict()
    if args.packing:
        last_epoch = sampler.locate(max(progress.micro_step - 1, 0))[0]  # the epoch of the last trained pack
        stats["pack_reports"] = {e: sampler.report(e).to_dict() for e in range(last_epoch + 1)}
    finish = save_final_lora if args.lora else save_final
    finish(args, accelerator, models, unet, buckets, progress, stats.setdefault("validation_images", []), stats)
    if accelerator.is_main_process:
        (Path(args.output_dir) / STATS_FILE).write_text(json.dumps(stats, indent=1, default=str))
    accelerator.end_training()
    return stats


def report_bad_images(args: argparse.Namespace, accelerator: Any) -> int:
    """Rows whose image failed to decode during the run (and were replaced), from skipped_rows.jsonl; warns once."""
    from hf_arb.images.bad_images import read_bad_rows

    accelerator.wait_for_everyone()
    path = Path(args.output_dir) / SKIPPED_ROWS_FILE
    rows = read_bad_rows(path)
    if rows and accelerator.is_main_process:
        logger.warning("%d row(s) had images that could not be decoded and were replaced by rows of the same bucket; "
                       "see %s. Re-annotate with `hf-arb annotate ... --verify` to skip them up front.", len(rows), path)
    return len(rows)


def stream_print(accelerator: Any, stream: Any, when: str) -> None:
    if stream is not None and accelerator.is_main_process:
        print(f"[stream, {when}] {stream.report()}", flush=True)


def image_loss_weights(args: argparse.Namespace, sampler: Any) -> Any:
    """``weight(epoch, step_in_epoch) -> float``: the factor on a micro-batch's mean loss.

    With one batch size it is 1 (diffusers' loss). With ``--max_pixels_per_batch`` the micro-batches of an
    optimizer step differ in size; micro-step ``s`` of ``b_s`` images gets ``b_s · A / n`` (``A`` the
    accumulation steps, ``n`` the images per device in its accumulation window), so that after accelerate's
    division by ``A`` and DDP's mean over devices the step's gradient is the mean loss over all its images: every
    image weighs the same (:func:`hf_arb.sampling.batch_sizes.accumulation_weights`). All devices train the same
    bucket at each step, so ``n`` is the same on every device and needs no communication; it is a pure function of
    the plan, so a resumed run weights exactly as the uninterrupted one.
    """
    if args.max_pixels_per_batch is None or getattr(sampler, "batch_sizes", None) is None:
        return lambda epoch, step: 1.0
    from hf_arb.sampling.batch_sizes import accumulation_weights

    cache: dict[int, np.ndarray] = {}

    def weight(epoch: int, step: int) -> float:
        if epoch not in cache:
            cache.clear()
            cache[epoch] = accumulation_weights(sampler.step_batch_sizes(epoch), args.gradient_accumulation_steps)
        return float(cache[epoch][step])

    return weight


def train_loop(args: argparse.Namespace, accelerator: Any, models: Models, unet: Any, optimizer: Any,
               lr_scheduler: Any, dataloader: Any, sampler: Any, buckets: Any, schedule: Schedule,
               progress: Progress, weight_dtype: torch.dtype, resolution_dim: int | None, tqdm: Any) -> dict[str, Any]:
    """Epochs of bucketed batches; checkpoints mid-epoch resume with the same batches, crops and noise."""
    text = TextEncoder(models, accelerator.device, weight_dtype, cache=args.cache_text_embeddings)
    trained = [unet, *(models.trained_text_encoders or [])]
    params = [p for m in trained for p in m.parameters() if p.requires_grad]
    labels = {**dict(enumerate(buckets.labels())), -1: "pack"}  # --packing: a pack is not one bucket
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

    stream = sampler if getattr(sampler, "locate", None) is None else None  # --streaming: a BucketedStream
    loss_weight = image_loss_weights(args, sampler)
    if stream is None:
        first_loader, first_epoch = resume_dataloader(accelerator, dataloader, progress.micro_step)
    else:  # the stream resumes itself (load_state_dict); set_epoch keeps its position within the same epoch
        first_epoch = stream.epoch + (stream.step >= stream.steps_per_epoch)
        dataloader.set_epoch(first_epoch)
        first_loader = dataloader
    for epoch in range(first_epoch, schedule.num_train_epochs):  # a resumed run continues mid-epoch
        if progress.global_step >= schedule.max_train_steps:
            break
        if epoch == first_epoch:
            loader = first_loader
        else:
            dataloader.set_epoch(epoch)
            loader = dataloader
        stream_print(accelerator, stream, f"epoch {epoch} start")
        if args.packing and accelerator.is_main_process:  # each epoch packs differently: its padding and leftovers
            print(f"epoch {epoch} {sampler.report(epoch).text()}", flush=True)
        for batch in loader:
            micro = progress.micro_step  # this batch's index since the start of training (per rank)
            progress.micro_step += 1
            gen = micro_step_generator(args.seed, micro, accelerator.process_index, accelerator.device)
            batch = batch_captions(batch)
            bucket = -1 if args.packing else int(batch["buckets"][0])
            with accelerator.accumulate(*trained):
                loss = diffusion_loss(args, models, unet, batch, text, gen, weight_dtype, resolution_dim)
                weight = loss_weight(epoch, micro - epoch * schedule.batches_per_epoch)  # 1 but with a pixel budget
                avg = accelerator.gather(loss.detach().repeat(args.train_batch_size)).mean()
                train_loss += avg.item() * weight / args.gradient_accumulation_steps
                # (bucket, loss) of every rank: with --no_bucket_sync the ranks train different buckets
                pairs = accelerator.gather(torch.stack([torch.tensor(float(bucket), device=loss.device),
                                                        loss.detach().float()])[None])  # (world, 2)
                for b, value in pairs.tolist():
                    bucket_losses.setdefault(int(b), []).append(value)
                accelerator.backward(loss * weight if weight != 1.0 else loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if args.debug_loss:
                accelerator.log({f"loss_for_row{int(r)}": float(loss.detach()) for r in batch["rows"]},
                                step=progress.global_step)
            images_seen += len(batch["captions"]) * accelerator.num_processes
            if trace is not None:
                tensor = batch["latent_stats"] if "latent_stats" in batch else batch["pixel_values"]
                trace.write(json.dumps({"step": progress.global_step, "micro": micro, "epoch": epoch,
                                        "bucket": bucket, "label": labels[bucket],
                                        "shape": [list(t.shape) for t in tensor] if isinstance(tensor, list)
                                        else list(tensor.shape),
                                        "rows": [int(r) for r in batch["rows"]], "loss": float(loss.detach()),
                                        "time_ids_first": batch["original_sizes"][0].tolist()
                                        + batch["crop_top_lefts"][0].tolist() + batch["target_sizes"][0].tolist()})
                            + "\n")
                trace.flush()
            if not accelerator.sync_gradients:
                continue
            if models.ema_unet is not None:
                if args.offload_ema:
                    models.ema_unet.to(accelerator.device)
                models.ema_unet.step(unet.parameters())
                if args.offload_ema:
                    models.ema_unet.to("cpu")
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
                in_epoch = progress.micro_step - epoch * schedule.batches_per_epoch  # micro-batches trained this epoch
                save_checkpoint(args, accelerator, progress,
                                None if stream is None else stream.state_dict(step=in_epoch))
            if progress.global_step >= schedule.max_train_steps:
                break
        stream_print(accelerator, stream, f"epoch {epoch} end")
        if args.validation_prompts and (epoch + 1) % args.validation_epochs == 0:
            if models.ema_unet is not None:
                models.ema_unet.store(unet.parameters())
                models.ema_unet.copy_to(unet.parameters())
            path = log_validation(args, accelerator, models, unwrap(accelerator, unet), buckets,
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
    CLI_ARGS = cli_parse(sys.argv[1:])  # --help and argument errors: torch is not imported yet
    try:
        main(CLI_ARGS)
    except UsageError as err:  # mistakes in the command or its data: one line; anything else keeps its traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
