"""What a restored sampler (its :class:`~hf_arb.sampling.resume.cursor.StepCursor`:
:class:`~hf_arb.sampling.sampler.BucketBatchSampler`, :class:`~hf_arb.sampling.tiered.sampler.TieredBatchSampler`,
:class:`~hf_arb.packing.PackBatchSampler`) does on its next accelerate pass.

A sampler restored by ``accelerator.load_state`` (``register_for_checkpointing``) holds the position its iterator
had reached, which runs *ahead* of the training loop: accelerate's loader reads one step ahead and a ``DataLoader``
with workers ``prefetch_factor × num_workers`` batches more. Only the loop's step counter, or torchdata's loader
(``use_stateful_dataloader=True``), knows what was trained. So on the first pass after a restore:

- **accelerate's checkpointing guide** (``accelerator.skip_first_batches(loader, k)``, ``k`` the loop's steps done
  in the epoch): the pass starts at the *first* step of the restored epoch (or of the epoch the loop set with
  ``set_epoch``), so accelerate's skip of ``k`` lands exactly on step ``k``; with ``dispatch_batches=True``, where
  accelerate's skip counts the sampler's batches (``W`` per step) rather than steps, the pass starts ``k × (W-1)``
  batches in, so the skip of ``k`` again lands on step ``k``. A ``k`` beyond what the restored sampler had handed out
  is refused (the counter is not the epoch's), except with ``dispatch_batches=True``: there only rank 0 iterates the
  sampler, so a refusal would stop rank 0 alone (the other ranks hang in accelerate's broadcast, or gloo aborts), and
  the count rank 0 saved depends on its read-ahead; the pass starts at step ``k`` on every rank and run, and the
  restore stays unresolved on every rank, so the next pass is decided in ``set_epoch``, which every rank runs;
- **a plain pass of the prepared loader** (no skip, no stateful loader) would restart the epoch (accelerate calls
  ``set_epoch`` first): refused before its first batch, naming ``hf_arb.resume_dataloader`` and
  ``skip_first_batches``; a restore at an epoch's start passes when the loader's epoch is the restored one;
- **the stateful loader**: torchdata restores the position itself, nothing changes;
- **``hf_arb.resume_dataloader``** sets the epoch from the counter and tells the sampler
  (:meth:`~hf_arb.sampling.resume.cursor.StepCursor.drop_restored_position`): nothing changes.

The pass is identified through accelerate's public objects only: ``GradientState().active_dataloader`` (the loader
being iterated; documented attribute), its ``batch_sampler`` chain (``SkipBatchSampler.skip_batches``,
``BatchSamplerShard.batch_sampler``: public constructor arguments) and ``use_stateful_dataloader``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

RESUME_FIX = ("resume with `train_dataloader, epoch = hf_arb.resume_dataloader(accelerator, train_dataloader, "
              "global_step)`, or with accelerate's `accelerator.skip_first_batches(train_dataloader, k)` (k = the "
              "steps your loop did in that epoch), or use DataLoaderConfiguration(use_stateful_dataloader=True)")


@dataclass(frozen=True)
class LoaderPass:
    """The accelerate loader iterating a sampler now.

    Attributes:
        stateful: torchdata's ``StatefulDataLoader`` underneath (it restores its own position).
        skipped: accelerate skips batches at the start of this pass (``skip_first_batches``).
        skip: how many (``SkipBatchSampler.skip_batches``, plus the loader's own ``skip_batches``).
        skip_counts_steps: the skip counts per-rank steps (behind ``BatchSamplerShard``), not the sampler's batches.
        dispatched: accelerate's ``DataLoaderDispatcher`` (``dispatch_batches=True``): only rank 0 reads the sampler,
            so nothing may be decided in this pass that the other ranks, which never see it, do not decide too.
        loader: the loader itself (a refused pass is ended with its public ``end()``, as accelerate ends a pass, so
            that it no longer counts as the active loader).
    """

    stateful: bool
    skipped: bool
    skip: int
    skip_counts_steps: bool
    loader: Any = None
    dispatched: bool = False

    def refuse(self, error: RuntimeError) -> RuntimeError:
        """End the refused pass (accelerate's ``begin()`` registered it) and return ``error`` to raise."""
        end = getattr(self.loader, "end", None)
        if callable(end):
            end()
        return error


@dataclass(frozen=True)
class Restored:
    """A restore not yet resolved by a pass: ``epoch`` and ``consumed`` as saved (``consumed`` may equal ``steps``,
    the epoch handed out), the epoch the loop set itself since (``set_epoch`` outside a pass), if any, and the
    sampler's class name (for the messages)."""

    epoch: int
    consumed: int
    steps: int
    explicit: int | None = None
    who: str = "BucketBatchSampler"

    def normalised(self) -> tuple[int, int]:
        """Where a plain pass would continue: ``(epoch, step)``, the next epoch once this one was handed out."""
        return (self.epoch + 1, 0) if self.consumed >= self.steps else (self.epoch, self.consumed)


@dataclass(frozen=True)
class Expect:
    """The restored epoch was served through ``skip_first_batches``; the next loader pass must be ``epoch``."""

    epoch: int
    who: str = "BucketBatchSampler"


Guard = Restored | Expect | None


def loader_pass(sampler: Any) -> LoaderPass | None:
    """The accelerate loader iterating ``sampler`` now, or None (no accelerate loader over it is being iterated)."""
    if "accelerate" not in sys.modules:
        return None
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, SkipBatchSampler
    from accelerate.state import GradientState

    loader = GradientState().active_dataloader
    if loader is None:
        return None
    chain, node = [], getattr(loader, "batch_sampler", None)
    while node is not sampler:
        if node is None or len(chain) > 4:
            return None  # the active loader iterates another sampler
        chain.append(node)
        node = getattr(node, "batch_sampler", None)
    skippers = [n for n in chain if isinstance(n, SkipBatchSampler)]
    own = int(getattr(loader, "skip_batches", 0) or 0)
    return LoaderPass(stateful=bool(getattr(loader, "use_stateful_dataloader", False)),
                      skipped=bool(skippers) or own > 0, skip=sum(int(n.skip_batches) for n in skippers) + own,
                      skip_counts_steps=any(isinstance(n, BatchSamplerShard) for n in chain), loader=loader,
                      dispatched=isinstance(loader, DataLoaderDispatcher))


def after_set_epoch(guard: Guard, epoch: int, ctx: LoaderPass | None) -> Guard:
    """The guard after ``set_epoch(epoch)``: by the loop itself (``ctx`` None) or by a prepared loader starting a pass.

    Raises:
        RuntimeError: a prepared loader's plain pass would restart a restored epoch or start another epoch than the
            restored one (before its first batch).
    """
    if guard is None:
        return None
    if ctx is None:  # the loop's own call: its epoch decides from now on
        return replace(guard, explicit=epoch) if isinstance(guard, Restored) else None
    if ctx.stateful or ctx.skipped:  # torchdata restores the position / a skip pass is decided at its start
        return None if ctx.stateful else guard
    try:
        check_plain_pass(guard, epoch)
    except RuntimeError as e:
        raise ctx.refuse(e) from None
    return None


def check_plain_pass(guard: Guard, epoch: int) -> None:
    """Refuse a plain pass of ``epoch`` that would silently restart or replay after a restore."""
    if isinstance(guard, Expect):
        if epoch != guard.epoch:
            raise RuntimeError(
                f"{guard.who}: the restored epoch {guard.epoch - 1} was served through skip_first_batches, "
                f"and the prepared loader now starts epoch {epoch} (accelerate counts passes from 0 in a new "
                f"process), not {guard.epoch}: call `train_dataloader.set_epoch(epoch)` with your loop's epoch "
                f"before iterating it, or resume with `hf_arb.resume_dataloader`, which does it.")
        return
    if not isinstance(guard, Restored):
        return
    e, step = guard.normalised()
    if guard.explicit is not None and guard.explicit != e:
        return  # the loop itself moved to another epoch (set_epoch warned if it differs from the restored one)
    if step > 0:
        raise RuntimeError(
            f"{guard.who} was restored mid-epoch (epoch {e}, {step} steps handed out, which runs ahead of "
            f"your loop's steps by accelerate's and the workers' read-ahead), and the prepared loader is now "
            f"iterated from the start of epoch {epoch}: that would silently restart the epoch. After "
            f"`accelerator.load_state`, {RESUME_FIX} (after a skip_first_batches pass of that epoch, call "
            f"`train_dataloader.set_epoch(epoch)` before this one).")
    if guard.explicit is None and epoch != e:
        raise RuntimeError(
            f"{guard.who} was restored at the start of epoch {e}, and the prepared loader now starts epoch "
            f"{epoch} (accelerate counts passes from 0 in a new process): call `train_dataloader.set_epoch({e})` "
            f"before iterating it, or {RESUME_FIX}.")


def pass_start(guard: Guard, ctx: LoaderPass | None, *, epoch: int,
               batches_per_step: int) -> tuple[Guard, tuple[int, int] | None]:
    """The guard after a pass of the sampler begins, and where that pass starts if the guard moves it.

    Args:
        guard: the sampler's guard.
        ctx: the accelerate loader iterating the sampler (None: iterated otherwise; the guard waits).
        epoch: the epoch the sampler's own cursor would serve.
        batches_per_step: batches the sampler yields per step (``W``; 1 with ``split_batches``).

    Returns:
        ``(new guard, (epoch, flat batch offset in the epoch) or None to leave the sampler's own start)``.

    Raises:
        RuntimeError: a plain pass that would restart or replay (:func:`check_plain_pass`), or a skip beyond the
            restored position (:func:`skip_pass_start`).
    """
    if ctx is None or guard is None:
        return guard, None
    if ctx.stateful:  # torchdata restores the position itself
        return None, None
    try:
        if not ctx.skipped:
            check_plain_pass(guard, epoch)
            return None, None
        return skip_pass_start(guard, ctx, batches_per_step=batches_per_step)
    except RuntimeError as e:
        raise ctx.refuse(e) from None


def skip_pass_start(guard: Guard, ctx: LoaderPass, *, batches_per_step: int) -> tuple[Guard, tuple[int, int] | None]:
    """Where a ``skip_first_batches`` pass after a restore starts, so accelerate's skip lands on the counter's step.

    Args:
        guard: the sampler's guard.
        ctx: the pass (``ctx.skipped``).
        batches_per_step: batches the sampler yields per step (``W``; 1 with ``split_batches``).

    Returns:
        ``(new guard, (epoch, flat batch offset in the epoch) or None to leave the sampler's own start)``.

    Raises:
        RuntimeError: the skip goes beyond the steps the restored sampler had handed out in that epoch.
    """
    if not isinstance(guard, Restored):
        return guard, None
    k = ctx.skip
    if guard.explicit is not None:
        epoch = guard.explicit
    else:
        epoch = guard.epoch if k > 0 else guard.normalised()[0]
        # dispatch_batches: rank 0 alone iterates the sampler, inside accelerate's fetch and before its broadcast, so a
        # refusal here would stop rank 0 only (the others wait in the broadcast: a hang, or gloo's abort on the next
        # mismatched collective), and the count it compares with is rank 0's read-ahead. The pass starts where k says,
        # a pure function of (state, k), the same on every run and rank (k past the epoch: an empty pass, which
        # accelerate refuses on every rank)
        if epoch == guard.epoch and k > guard.consumed and not ctx.dispatched:
            raise RuntimeError(
                f"accelerator.skip_first_batches(loader, {k}) after the sampler was restored at epoch {guard.epoch} "
                f"with {guard.consumed} steps handed out: your loop cannot have trained more steps of that epoch "
                f"than the sampler handed out. Pass the steps done in the epoch (global_step % "
                f"len(train_dataloader)), or {RESUME_FIX}.")
    # accelerate skips k of the sampler's batches when it iterates the sampler directly (dispatch_batches=True):
    # start k*(W-1) batches in so that the skip ends at step k (k*W batches); behind BatchSamplerShard k is steps
    offset = 0 if ctx.skip_counts_steps else k * (batches_per_step - 1)
    # dispatched: the other ranks keep the restored guard (their sampler never sees this pass), so rank 0 keeps it too
    # and every later decision (in set_epoch, which accelerate calls on every rank) is the same on all of them
    return (guard if ctx.dispatched else Expect(epoch + 1, guard.who)), (epoch, offset)
