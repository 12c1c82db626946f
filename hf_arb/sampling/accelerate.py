"""Glue between the sampler and accelerate, through accelerate's public API only.

Nothing here is needed: ``accelerator.prepare(DataLoader(ds, batch_sampler=BucketBatchSampler(...)))`` works as
is, in every accelerate mode (see :mod:`hf_arb.sampling.sampler`). :func:`prepare_dataloader` is a convenience
that also checks the result and fills DeepSpeed's ``"auto"`` micro batch; :func:`resume_dataloader` is the
resume recipe in one call.
"""

from __future__ import annotations

import warnings
from typing import Any

from .resume.state import ResumableBatchSampler
from .sampler import BucketBatchSampler, RankBatchSampler
from .tiered.sampler import TierRankSampler


def find_sampler(dataloader: Any) -> ResumableBatchSampler:
    """The :class:`BucketBatchSampler` (or :class:`~hf_arb.sampling.tiered.sampler.TieredBatchSampler`,
    :class:`~hf_arb.packing.sampler.PackBatchSampler`) behind a (prepared
    or plain) ``DataLoader``."""
    bs = getattr(dataloader, "batch_sampler", None)
    for candidate in (bs, getattr(bs, "batch_sampler", None), getattr(dataloader, "sampler", None)):
        if isinstance(candidate, ResumableBatchSampler):
            return candidate
        if isinstance(candidate, (RankBatchSampler, TierRankSampler)):
            return candidate.parent
    raise TypeError(
        "Expected a DataLoader built with `batch_sampler=BucketBatchSampler(...)`, got batch_sampler "
        f"{type(bs).__name__}. Build it as `DataLoader(dataset, batch_sampler=sampler, collate_fn=...)`."
    )


def fill_deepspeed_micro_batch(accelerator: Any, sampler: BucketBatchSampler) -> None:
    """Set DeepSpeed's ``train_micro_batch_size_per_gpu: "auto"`` to the sampler's per-rank batch.

    DeepSpeed reads the micro batch from ``DataLoader.batch_size``, which is ``None`` with a batch sampler. Call
    this before ``accelerator.prepare``; it does nothing without DeepSpeed or when the config sets a number.
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.is_auto("train_micro_batch_size_per_gpu"):
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = sampler.per_rank_batch_size


def prepare_dataloader(accelerator: Any, dataloader: Any) -> Any:
    """``accelerator.prepare(dataloader)``, checked: the prepared loader must yield the plan's steps per rank.

    Also fills DeepSpeed's ``train_micro_batch_size_per_gpu: "auto"`` from the sampler's per-rank batch (DeepSpeed
    reads ``DataLoader.batch_size``, which is ``None`` with a batch sampler). Prepare the model, optimizer and
    scheduler in the same or another ``prepare`` call, as you like.

    Args:
        accelerator: an ``accelerate.Accelerator``.
        dataloader: a ``DataLoader`` whose ``batch_sampler`` is a :class:`BucketBatchSampler`.

    Returns:
        What ``accelerator.prepare(dataloader)`` returns.

    Raises:
        RuntimeError: the prepared loader would not yield ``sampler.steps_per_epoch`` batches per pass.
    """
    sampler = find_sampler(dataloader)
    fill_deepspeed_micro_batch(accelerator, sampler)
    prepared = accelerator.prepare(dataloader)
    if len(prepared) != sampler.steps_per_epoch:
        raise RuntimeError(
            f"After accelerator.prepare this rank would get {len(prepared)} batches per pass, but the plan has "
            f"{sampler.steps_per_epoch} steps per rank (sampler built for num_replicas={sampler.num_replicas}, "
            f"split_batches={sampler.split_batches}; accelerator: {accelerator.num_processes} processes, "
            f"split_batches={accelerator.split_batches}). Build the sampler with the accelerator's settings."
        )
    return prepared


def resume_dataloader(accelerator: Any, dataloader: Any, steps_done: int) -> tuple[Any, int]:
    """Position a prepared loader after ``steps_done`` steps per rank: the resume recipe in one call.

    Sets the loader's epoch (accelerate passes it on to the sampler) and, mid-epoch, returns
    ``accelerator.skip_first_batches(dataloader, step)`` for the rest of that epoch; the original ``dataloader`` is
    then set to the following epoch, so a loop that iterates it next (without calling ``set_epoch``) continues with
    the right epoch. Use it after ``accelerator.load_state`` with the step counter your checkpoint saved.

    Returns:
        ``(loader for the current epoch, epoch)``; iterate the original ``dataloader`` for later epochs.
    """
    sampler = find_sampler(dataloader)
    epoch, step = sampler.locate(steps_done)
    with warnings.catch_warnings():
        # the loop's step counter decides where training resumes; a sampler state restored by load_state may sit a
        # lookahead further (accelerate reads one batch ahead), in the next epoch: setting the counter's epoch here
        # is not the forgotten `set_epoch` that BucketBatchSampler warns about
        warnings.filterwarnings("ignore", message=r"set_epoch\(\d+\) after the sampler was restored",
                                category=UserWarning)
        sampler.drop_restored_position()  # the counter, not the restored position, places the passes
        dataloader.set_epoch(epoch)
    if not step:
        return dataloader, epoch
    from accelerate.data_loader import DataLoaderDispatcher

    if isinstance(dataloader, DataLoaderDispatcher) and not sampler.split_batches:
        step *= sampler.num_replicas  # the dispatcher's skip counts the W batches it concatenates per step
    rest = accelerator.skip_first_batches(dataloader, step)  # a new loader that starts at `epoch` and skips `step`
    return _ThenNextEpoch(rest, dataloader, epoch + 1), epoch


class _ThenNextEpoch:
    """Iterates ``rest`` (the remainder of an epoch), then sets ``dataloader`` to ``next_epoch`` so accelerate's
    pass counter of the original loader continues from there."""

    def __init__(self, rest: Any, dataloader: Any, next_epoch: int) -> None:
        self.rest, self.dataloader, self.next_epoch = rest, dataloader, next_epoch

    def __len__(self) -> int:
        return len(self.rest)

    def __iter__(self) -> Any:
        yield from self.rest
        self.dataloader.set_epoch(self.next_epoch)
