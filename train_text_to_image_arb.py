#!/usr/bin/env python
"""Fine-tune Stable Diffusion 1.x / 2.x, SDXL, SD3 / SD3.5 or Flux.1, in full or with LoRA, with aspect-ratio bucketing.

This script takes the command line of diffusers' four ``examples/text_to_image`` scripts
(``train_text_to_image.py``, ``_sdxl.py``, ``_lora.py``, ``_lora_sdxl.py``: same flag names, defaults and
meanings) and trains every image at close to its own aspect ratio instead of a centre-cropped square: ``--resolution``
becomes the *pixel budget* of the buckets (about ``resolution²`` pixels per image), every batch holds one bucket shape,
and all processes take the same bucket at the same step.

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
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_arb.checks import UsageError
from hf_arb.lazy import LazyModule
from hf_arb.train.environment import (
    agree_on_seed,
    check_environment,
    check_resume_flags,
    cuda_settings,
    one_process,
    resolve_resume_dir,
    setup_logging,
    start_accelerator,
    updated,
)
from hf_arb.train.files import STATS_FILE
from hf_arb.train.flags.args import cli_parse, parse_args
from hf_arb.train.flags.upstream_flags import final_validation_args, offload_frozen, restore_frozen, validation_due
from hf_arb.train.models import (
    Models,
    batch_loss,
    count_calls,
    load_models,
    make_optimizer,
    place,
    register_lora_checkpoint_hooks,
    setup_lora,
    unwrap,
    weight_dtype_of,
)
from hf_arb.train.outputs import batch_captions, log_validation, report_bad_images, save_final, save_final_lora
from hf_arb.train.progress import Progress, check_resumed_step, restore, save_checkpoint
from hf_arb.train.schedule import Schedule, micro_step_generator
from hf_arb.train.signals import StopOnSignal, TrainingStopped, finish_stopped
from hf_arb.train.sources import build_source
from hf_arb.train.sources.base import Source

torch: Any = LazyModule("torch")  # --help and argument errors answer before torch is loaded
logger = logging.getLogger("train_text_to_image_arb")


# =============================================================================================== main
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
    accelerator = None if one_process() else start_accelerator(args)  # several: the main process reads data first
    setup_logging(accelerator, ("datasets",))
    args = updated(args, seed=agree_on_seed(args, accelerator, resume_dir))
    # the data source of the run's mode (map-style, stream, packed, tiered, with references), its data loaded and
    # its plan checked: in one process before torch, accelerate or any model is loaded
    source = build_source(args, accelerator)
    accelerator = accelerator or start_accelerator(args)
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    source.start(accelerator)  # the global plan (or this rank's stream): steps per epoch, where a resume is
    schedule = source.schedule(accelerator.num_processes)
    from diffusers.optimization import get_scheduler

    setup_logging(accelerator, ("transformers", "diffusers"))
    # by the family adapter: what the data already holds stays unloaded; the transformer quantized if asked
    models = load_models(args, source.frozen_parts(), weight_dtype_of(accelerator))
    family = models.family
    args = updated(args, family_report=source.check_model(models))  # bucket sizes the denoiser takes; flow: shifts
    encode_calls = count_calls(models.vae, "encode")
    weight_dtype = weight_dtype_of(accelerator)
    if args.lora:
        trainable = setup_lora(args, models, weight_dtype)
        register_lora_checkpoint_hooks(accelerator, models, args)
    else:
        trainable = list(models.unet.parameters())
        family.register_checkpoint_hooks(accelerator, models, unwrap=lambda m: unwrap(accelerator, m))
    cuda_settings(args, accelerator)  # --allow_tf32, --cudnn_attention
    if args.scale_lr:
        args = updated(args, learning_rate=args.learning_rate * args.gradient_accumulation_steps
                       * args.train_batch_size * accelerator.num_processes)
    optimizer = make_optimizer(args, trainable)

    dataloader = source.loader(accelerator, models, schedule, weight_dtype)  # --cache_latents: filled first
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=schedule.scheduler_warmup_steps,
                                 num_training_steps=schedule.scheduler_training_steps,
                                 num_cycles=args.lr_num_cycles, power=args.lr_power)
    # as diffusers' scripts: one plain prepare call; the sampler's global plan is dealt to the ranks by accelerate
    if args.lora and args.train_text_encoder:
        unet, *encoders, optimizer, dataloader, lr_scheduler = accelerator.prepare(
            source.model(models), *family.lora_text_encoders(models), optimizer, dataloader, lr_scheduler)
        models.trained_text_encoders = encoders
    else:
        unet, optimizer, dataloader, lr_scheduler = accelerator.prepare(source.model(models), optimizer,
                                                                        dataloader, lr_scheduler)
    source.register(accelerator)  # what accelerate checkpoints with the loader (a stream saves its own, per rank)
    if models.ema_unet is not None:
        models.ema_unet.to("cpu" if args.offload_ema else accelerator.device)
    device = None if args.offload else accelerator.device  # --offload: they stay on the CPU (offload_frozen)
    for te in models.text_encoders[len(models.trained_text_encoders or []):]:  # the frozen ones
        place(te, device, weight_dtype)
    place(models.vae, device, family.vae_dtype(args, weight_dtype))
    offload_frozen(args, models, accelerator.device)
    if accelerator.is_main_process and accelerator.trackers == [] and args.report_to not in (None, "none", ""):
        config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers(args.tracker_project_name, config)
    source.report(accelerator, schedule, models)

    progress = restore(accelerator, resume_dir, args.seed)
    source.restore(accelerator, resume_dir, progress)
    check_resumed_step(args, accelerator, progress, source, optimizer, resume_dir)
    if resume_dir is not None and progress.global_step >= schedule.max_train_steps:
        logger.warning("%s is at step %d, at or past --max_train_steps %d: nothing is left to train, so its weights "
                       "are saved as the final output (diffusers' scripts would train one more step).", resume_dir.name,
                       progress.global_step, schedule.max_train_steps)
    family.prepare_denoiser(args, models, accelerator.unwrap_model(unet))  # e.g. SD's resolution conditioning
    run = Run(args, accelerator, models, unet, optimizer, lr_scheduler, dataloader, source, schedule, progress,
              weight_dtype)
    stopper = StopOnSignal(args.checkpoint_on_signal)
    try:
        with stopper:  # Ctrl-C / SIGTERM: every rank stops after the same update (hf_arb.train.signals)
            stats = train_loop(run, tqdm, stopper)
    except TrainingStopped as stopped:  # one line: the last checkpoint and the command that resumes from it
        finish_stopped(args, accelerator, stopped, argv if isinstance(argv, list) else None)
        accelerator.end_training()
        return {"global_step": progress.global_step, "stopped_by_signal": stopped.stop.signum}
    stats.update(vae_encode_calls=encode_calls[0], **source.stats(progress.micro_step),
                 bad_images=report_bad_images(args, accelerator), num_processes=accelerator.num_processes,
                 family=family.name, seed=args.seed, schedule=schedule.__dict__, lora=args.lora,
                 trainable_parameters=sum(p.numel() for g in trainable for p in (g["params"] if isinstance(g, dict)
                                                                                 else [g])),
                 mixed_precision=str(accelerator.mixed_precision))  # the real one (flag or accelerate config)
    restore_frozen(args, models)  # --offload: the weights back in place, for the saved pipeline
    finish = save_final_lora if args.lora else save_final
    finish(final_validation_args(args), accelerator, models, unet, source.buckets, progress,  # --skip_final_inference
           stats.setdefault("validation_images", []), stats, rows=source.bucket_rows())
    if accelerator.is_main_process:
        (Path(args.output_dir) / STATS_FILE).write_text(json.dumps(stats, indent=1, default=str))
    accelerator.end_training()
    return stats


@dataclass
class Run:
    """What the training loop works with, prepared by :func:`main`."""

    args: argparse.Namespace
    accelerator: Any
    models: Models
    unet: Any  # the prepared denoiser (through accelerate's wrappers)
    optimizer: Any
    lr_scheduler: Any
    dataloader: Any  # prepared
    source: Source  # the run's data: its batches' buckets, checkpoint state, epochs and resume
    schedule: Schedule
    progress: Progress
    weight_dtype: Any


def train_loop(run: Run, tqdm: Any, stopper: StopOnSignal | None = None) -> dict[str, Any]:
    """Epochs of bucketed batches; checkpoints mid-epoch resume with the same batches, crops and noise."""
    args, accelerator, models, unet, source = run.args, run.accelerator, run.models, run.unet, run.source
    optimizer, lr_scheduler, schedule, progress, weight_dtype = (run.optimizer, run.lr_scheduler, run.schedule,
                                                                 run.progress, run.weight_dtype)
    text = source.text_encoder(models, accelerator.device, weight_dtype)  # memoised, or read from data
    trained = [unet, *(models.trained_text_encoders or [])]
    params = [p for m in trained for p in m.parameters() if p.requires_grad]
    labels = {**dict(enumerate(source.buckets.labels())), -1: "pack"}  # --packing: a pack is not one bucket
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
    loss_weight = source.loss_weights()
    augment = source.caption_augmenter(schedule)  # --shuffle_caption, ...: (seed, epoch, row), per dataset
    first_loader, first_epoch = source.resume(accelerator, run.dataloader, progress.micro_step)
    for epoch in range(first_epoch, schedule.num_train_epochs):  # a resumed run continues mid-epoch
        if progress.global_step >= schedule.max_train_steps:
            break
        if epoch == first_epoch:
            loader = first_loader
        else:
            run.dataloader.set_epoch(epoch)
            loader = run.dataloader
        source.epoch_begins(accelerator, epoch)
        for batch in loader:
            micro = progress.micro_step  # this batch's index since the start of training (per rank)
            progress.micro_step += 1
            gen = micro_step_generator(args.seed, micro, accelerator.process_index)
            batch = augment(batch_captions(batch), epoch)
            bucket = source.batch_bucket(batch)
            with accelerator.accumulate(*trained):
                loss = batch_loss(args, models, unet, batch, text, gen, weight_dtype)
                weight = loss_weight(micro)  # 1 but with a pixel budget
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
                                        "captions": list(batch["captions"]),
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
            logs.update(source.kind_losses(bucket_losses))  # clips: loss/stills, loss/clips (one key per kind)
            accelerator.log(logs, step=progress.global_step)
            bar.set_postfix(loss=f"{train_loss:.4f}", bucket=labels[bucket])
            train_loss, bucket_losses = 0.0, {}
            halt = stopper.agree(accelerator) if stopper else None  # every rank, every update: a signal any rank got
            if progress.global_step % args.checkpointing_steps == 0 or (halt and halt.checkpoint):
                save_checkpoint(args, accelerator, progress, source.rank_files(accelerator, progress.micro_step, epoch))
            if halt:
                raise TrainingStopped(halt, progress.global_step)
            if validation_due(args, progress.global_step):  # --validation_steps (train_dreambooth.py)
                path = log_validation(args, accelerator, models, unwrap(accelerator, unet), source.buckets,
                                      progress.global_step, weight_dtype, rows=source.bucket_rows())
                validation_images.extend([str(path)] if path else [])
            if progress.global_step >= schedule.max_train_steps:
                break
        source.epoch_ends(accelerator, epoch)
        if args.validation_prompts and (epoch + 1) % args.validation_epochs == 0:
            if models.ema_unet is not None:
                models.ema_unet.store(unet.parameters())
                models.ema_unet.copy_to(unet.parameters())
            path = log_validation(args, accelerator, models, unwrap(accelerator, unet), source.buckets,
                                  progress.global_step, weight_dtype, rows=source.bucket_rows())
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
        RESULT = main(CLI_ARGS)
        if RESULT.get("stopped_by_signal"):  # the shell's convention for a run ended by a signal: 128 + its number
            sys.exit(128 + RESULT["stopped_by_signal"])
    except UsageError as err:  # mistakes in the command or its data: one line; anything else keeps its traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
