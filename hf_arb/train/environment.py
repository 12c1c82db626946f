"""What the script checks and sets up on this machine before loading a model: paths, installed packages, the
device, the checkpoint to resume, the accelerator, logging and the seed every rank agrees on."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from hf_arb.checks import UsageError, UsageFileError
from hf_arb.families import get_family
from hf_arb.lazy import LazyModule

from .files import STATE_FILE
from .flags.arg_checks import TRACKERS

torch: Any = LazyModule("torch")  # loaded when a function needs it: --help and flag errors answer before torch
logger = logging.getLogger("train_text_to_image_arb")


def check_environment(args: argparse.Namespace) -> None:
    """Checks that look at this machine (paths, installed packages, the device) — still before any model load."""
    import importlib.util

    from .flags.versions import check_versions

    check_versions(args)  # a feature the installed versions break: refused; untested versions: one warning each

    hub_id = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
    for flag in ("pretrained_model_name_or_path", "pretrained_vae_model_name_or_path"):
        value = getattr(args, flag)
        if value is None:
            continue
        path = Path(value).expanduser()
        if path.is_dir():
            if not (
                (path / "model_index.json").exists() or (path / "unet").is_dir() or (path / "config.json").exists()
            ):
                raise UsageError(f"--{flag} {value}: the folder is not a diffusers model (no model_index.json).")
        elif path.exists() or not hub_id.match(value) or value.count("/") > 1:
            raise UsageFileError(f"--{flag} {value}: no such model folder, and not a Hub id (like org/name).")
        else:  # a Hub id: a typo or an unreachable Hub is said now, not after the dataset and download retries
            from hf_arb.annotate.hub import hub_model_problem

            problem = hub_model_problem(value,
                                        revision=args.revision if flag == "pretrained_model_name_or_path" else None)
            if problem:
                raise UsageFileError(f"--{flag} {value}: {problem}")
    folder_flag = "instance_data_dir" if args.instance_data_dir is not None else "train_data_dir"
    folder = getattr(args, folder_flag)  # None: --encoded_dataset alone (its source opens it)
    if getattr(args, "dataset_specs", None):  # --dataset_config: each dataset's folder or Hub id
        from .flags.dataset_config import check_spec_sources

        check_spec_sources(args.dataset_specs)
    elif args.dataset_name is None and folder is not None and not Path(folder).is_dir():
        raise UsageFileError(f"--{folder_flag} {getattr(args, folder_flag)}: no such folder.")
    if args.dataset_name:  # a mistyped path or id is said now, not after load_dataset's retries and traceback
        from hf_arb.annotate.hub import hub_dataset_problem

        if problem := hub_dataset_problem(args.dataset_name):
            raise UsageFileError(f"--dataset_name {args.dataset_name}: {problem}")
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
    from hf_arb.train.flags.resume_flags import check_saved_flags, newest_with_state  # issue 34: the flags it records

    if not args.resume_from_checkpoint:
        return None  # (also called by check_environment: a missing checkpoint fails before anything loads)
    out = Path(args.output_dir)
    if getattr(args, "lora", False):  # LoRA checkpoints hold the adapter file, not a UNet folder
        model_dirs, model_files = (), ("pytorch_lora_weights.safetensors",)
    else:  # the family's trained model folders (unet/ and unet_ema/, or transformer/)
        model_dirs, model_files = get_family(args.family).checkpoint_dirs(args), ()
    from .sources import source_class

    required = source_class(args).checkpoint_files(REQUIRED)  # a stream: its per-rank files, no sampler state
    if args.resume_from_checkpoint == "latest":
        check_saved_flags(args, newest_with_state(out, STATE_FILE), STATE_FILE)  # (a LoRA run's without --rank)
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
    check_saved_flags(args, path, STATE_FILE)
    problems = checkpoint_problems(path, STATE_FILE, model_dirs, model_files, required)
    if problems:
        raise UsageError(
            f"Checkpoint {path} is damaged: "
            f"{problems[0]}{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}"
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
    from .sources import source_class

    if args.max_pixels_per_batch is not None or not source_class(args).fixed_batches:
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


def make_accelerator(args: argparse.Namespace) -> Any:
    """Accelerator with the project layout of diffusers' script and the optional DDP communication hook."""
    from accelerate import Accelerator
    from accelerate.utils import (
        DataLoaderConfiguration,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        ProjectConfiguration,
    )

    from .sources import source_class

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
    project = ProjectConfiguration(project_dir=args.output_dir,
                                   logging_dir=os.path.join(args.output_dir, args.logging_dir))
    extra = source_class(args).accelerator_kwargs()  # --streaming: every rank reads its own split
    loading = extra.pop("dataloader_config", None) or DataLoaderConfiguration()
    loading.non_blocking = True  # host → GPU copies of the pinned batches overlap the step (no effect on the CPU)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=report_to,
        project_config=project,
        kwargs_handlers=kwargs_handlers,
        dataloader_config=loading,
        **extra,
    )
    multi = [f for f, on in (("--ddp_comm_hook " + args.ddp_comm_hook, args.ddp_comm_hook != "no"),
                             ("--no_bucket_sync", getattr(args, "no_bucket_sync", False))) if on]
    if multi and accelerator.num_processes == 1:  # (one process: it is the main one)
        logger.warning("%s: no effect with one process (it configures several; launch with accelerate launch "
                       "--num_processes N to use it).", ", ".join(multi))
    return accelerator


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


def start_accelerator(args: argparse.Namespace) -> Any:
    """The run's Accelerator, checked against the launcher's process count."""
    accelerator = make_accelerator(args)
    check_process_count(accelerator)
    return accelerator


def cuda_settings(args: argparse.Namespace, accelerator: Any) -> None:
    """The process-wide CUDA switches of the run's flags: ``--allow_tf32`` (TF32 matmuls, as upstream) and cuDNN
    attention off unless ``--cudnn_attention`` (PyTorch's ``scaled_dot_product_attention`` then picks flash or
    memory-efficient attention). Nothing to change on other devices."""
    import torch

    if args.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    if accelerator.device.type == "cuda" and not args.cudnn_attention:
        # benchmarks/bench_gpu.py, H200, torch 2.11: an illegal memory access in the full-size Flux.1 step
        torch.backends.cuda.enable_cudnn_sdp(False)


def one_process() -> bool:
    """Launched as one process (no WORLD_SIZE above 1): the data can be checked before accelerate starts."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1
