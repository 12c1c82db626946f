"""The step arithmetic of a run, as diffusers' scripts count it (epochs, optimizer steps, warmup), and what each
micro-batch draws: its generator (a pure function of seed, micro step and rank) and its loss weight."""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hf_arb.checks import UsageError
from hf_arb.lazy import LazyModule

torch: Any = LazyModule("torch")  # loaded when a function needs it: --help and flag errors answer before torch
logger = logging.getLogger("train_text_to_image_arb")


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


def micro_step_generator(seed: int, micro_step: int, rank: int) -> torch.Generator:
    """A generator for one micro-batch's randomness (posterior sample, noise, timesteps, prompt dropout).

    A pure function of (seed, micro step, rank), so a resumed run draws exactly what the uninterrupted run drew,
    and cached and on-the-fly latents see the same noise. It is a CPU generator whatever the training device: the
    losses draw on the CPU and move the draws to the batch's device (:func:`hf_arb.families.flow.draw`), so a run
    draws the same noise on a GPU as on the CPU (a CUDA generator's stream differs) and a checkpoint resumes with
    the same draws on another device type.
    """
    state = np.random.SeedSequence([seed, micro_step, rank]).generate_state(2, dtype=np.uint32)
    g = torch.Generator()
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g


def image_loss_weights(args: argparse.Namespace, sampler: Any, per_bucket: bool = False) -> Any:
    """``weight(micro_step) -> float``: the factor on a micro-batch's mean loss (``micro_step``: batches this rank
    trained before it since the start; the sampler's ``locate`` gives its epoch and step, epochs of any length).

    With one batch size it is 1 (diffusers' loss). With ``--max_pixels_per_batch`` the micro-batches of an
    optimizer step differ in size; micro-step ``s`` of ``b_s`` images gets ``b_s · A / n`` (``A`` the
    accumulation steps, ``n`` the images per device in its accumulation window), so that after accelerate's
    division by ``A`` and DDP's mean over devices the step's gradient is the mean loss over all its images: every
    image weighs the same (:func:`hf_arb.sampling.batch_sizes.accumulation_weights`). All devices train the same
    bucket at each step, so ``n`` is the same on every device and needs no communication; it is a pure function of
    the plan, so a resumed run weights exactly as the uninterrupted one. ``per_bucket``: the source gave the sampler
    a batch size per bucket (a clip run's token budget), weighted the same way.
    """
    varied = getattr(sampler, "batch_sizes", None) is not None or hasattr(sampler, "step_tiers")  # tiers: per tier
    if (args.max_pixels_per_batch is None and not per_bucket) or not varied:
        return lambda micro: 1.0
    from hf_arb.sampling.planning.batch_sizes import accumulation_weights

    cache: dict[int, np.ndarray] = {}

    def weight(micro: int) -> float:
        epoch, step = sampler.locate(micro)
        if epoch not in cache:
            cache.clear()
            cache[epoch] = accumulation_weights(sampler.step_batch_sizes(epoch), args.gradient_accumulation_steps)
        return float(cache[epoch][step])

    return weight
