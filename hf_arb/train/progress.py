"""A run's counters and checkpoints: what ``hf_arb_state.json`` holds, restoring it with accelerate's state,
checking it, and saving a checkpoint atomically."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_arb.checks import UsageError
from hf_arb.lazy import LazyModule

from .environment import RESUME_FLAGS
from .files import STATE_FILE
from .flags.resume_flags import RECORD, shaping_flags

torch: Any = LazyModule("torch")  # loaded when a function needs it: --help and flag errors answer before torch
logger = logging.getLogger("train_text_to_image_arb")


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


def check_resumed_step(args: argparse.Namespace, accelerator: Any, progress: Progress, source: Any, optimizer: Any,
                       resume_dir: Path | None) -> None:
    """The checkpoint's global_step must agree with its micro-batch counter and the optimizer's step count.

    ``source``: what knows the epochs, with ``locate(micro_step)`` and ``steps_in(epoch)`` (the run's data source,
    or a sampler with both): the updates of each epoch are added up, so epochs of their own length count right."""
    if resume_dir is None:
        return
    epoch, position = source.locate(progress.micro_step)
    a = args.gradient_accumulation_steps  # an epoch's last update may hold fewer batches: hence the ceilings
    expected = sum(-(-source.steps_in(e) // a) for e in range(epoch)) + -(-position // a)
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
                    rank_files: dict[str, Any] | None = None) -> Path:
    """accelerate's state (UNet, optimizer, LR scheduler, sampler, RNG) + our counters, written to a temporary
    folder, renamed into place once complete, and only then are old checkpoints pruned (see hf_arb.train.checkpointing).

    ``rank_files``: ``{file name: JSON state}`` this rank writes beside them (a stream's state: not accelerate's to
    save; :meth:`hf_arb.train.sources.base.Source.rank_files`)."""
    from hf_arb.train.checkpointing import publish_checkpoint, tmp_checkpoint_dir

    tmp = tmp_checkpoint_dir(args.output_dir, progress.global_step)
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)  # left by a killed run
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        flags = {f: getattr(args, f) for f in RESUME_FLAGS}  # read back by check_resume_flags
        (tmp / STATE_FILE).write_text(json.dumps({**progress.__dict__, **flags,
                                                  "num_processes": accelerator.num_processes,
                                                  RECORD: shaping_flags(args)}, indent=1))  # see check_saved_flags
    for name, state in (rank_files or {}).items():
        (tmp / name).write_text(json.dumps(state))
    accelerator.wait_for_everyone()
    path = Path(args.output_dir) / f"checkpoint-{progress.global_step}"
    if accelerator.is_main_process:
        path = publish_checkpoint(tmp, args.checkpoints_total_limit)
    accelerator.wait_for_everyone()
    return path
