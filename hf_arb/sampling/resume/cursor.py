"""The position of a step-planned batch sampler, and where its passes start (after ``set_epoch``, a restore, or
accelerate's ``skip_first_batches``).

Every resumable sampler — :class:`~hf_arb.sampling.sampler.BucketBatchSampler`,
:class:`~hf_arb.sampling.tiered.sampler.TieredBatchSampler` and :class:`~hf_arb.packing.PackBatchSampler` — holds
one :class:`StepCursor` (``sampler.cursor``), so all behave identically in every accelerate idiom: the same
``set_epoch`` rule, the same exact ``skip_first_batches(loader, k)`` after ``accelerator.load_state``, the same
one-line refusal of a plain re-iteration after a mid-epoch restore (:mod:`~hf_arb.sampling.resume.restore` decides;
this module applies it).

A sampler's pass calls :meth:`StepCursor.pass_skip` (from ``__iter__``), then :meth:`StepCursor.begin`, then
:meth:`StepCursor.handed_out` per yielded step; ``load_state_dict`` calls :meth:`StepCursor.restore`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from hf_arb.checks import check_nonneg

from .restore import Guard, Restored, after_set_epoch, loader_pass, pass_start


def locate(steps_done: int, steps_in: Callable[[int], int], steps_per_epoch: int | None = None) -> tuple[int, int]:
    """``(epoch, step in that epoch)`` after ``steps_done`` steps per rank since epoch 0: where a run resumes.

    Args:
        steps_done: steps per rank since epoch 0 (>= 0).
        steps_in: steps per rank of an epoch (walked epoch by epoch when epochs differ in length).
        steps_per_epoch: every epoch's steps when they are all equal (then ``O(1)``).
    """
    steps_done = check_nonneg("steps_done", steps_done)
    if steps_per_epoch is not None:
        return divmod(steps_done, steps_per_epoch)
    epoch = 0
    while steps_done >= steps_in(epoch):
        steps_done -= steps_in(epoch)
        epoch += 1
    return epoch, steps_done


class StepCursor:
    """Epoch, steps handed out, and the start of the next pass of a sampler whose plan is a pure function of
    ``(seed, epoch, step)``.

    Args:
        sampler: the sampler holding the cursor (the object an accelerate loader iterates: see
            :func:`~hf_arb.sampling.resume.restore.loader_pass`; its class name goes into the messages).
        steps_in: steps per rank of an epoch.
        state_name: how the messages name the sampler's state (``"Sampler"``, ``"Pack sampler"``).

    Attributes:
        epoch, consumed: the epoch of the next batch and the steps of it handed out (the resume position).
        start: where every pass starts until one hands out that epoch's last step (a restore) or until the next
            ``set_epoch`` (``pinned``); None: the cursor.
        start_id: bumped whenever ``start`` is set, so that an abandoned older pass never clears a newer start.
        guard: a restore not yet resolved by an accelerate pass (:mod:`~hf_arb.sampling.resume.restore`).
        restored_epoch: the restored epoch until the next ``set_epoch`` or pass (warns on a different one).
    """

    def __init__(self, sampler: Any, steps_in: Callable[[int], int], *, state_name: str = "Sampler") -> None:
        self.sampler, self.steps_in, self.state_name = sampler, steps_in, state_name
        self.epoch, self.consumed = 0, 0
        self.restored_epoch: int | None = None
        self.guard: Guard = None
        self.start: tuple[int, int] | None = None
        self.pinned, self.start_id = False, 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch (the sampler's ``set_epoch``; accelerate calls it through the
        prepared loader).

        Every pass from then on yields epoch ``epoch`` from its first batch until the next ``set_epoch`` (as
        ``DistributedSampler`` and accelerate's samplers do); only a sampler whose epoch is never set moves on to the
        next epoch by itself after a finished pass. A pass begun and abandoned (torchdata's ``StatefulDataLoader``
        builds and drops one when it restores a state saved at the end of a pass) thus never shifts the next one.

        After a restore, an epoch other than the restored one or the next warns (the loop probably forgot
        ``train_dataloader.set_epoch(epoch)``); a prepared loader's pass may be refused (:mod:`.restore`)."""
        epoch = check_nonneg("epoch", epoch)
        ctx = loader_pass(self.sampler)  # the accelerate pass calling, if any: it may be refused (restore.py)
        self.guard = after_set_epoch(self.guard, epoch, ctx)
        # the next epoch is what a loop sets after serving the rest of the restored one through skip_first_batches
        # (under dispatch_batches only rank 0 sees that pass: no rank may warn where another does not)
        if (self.restored_epoch is not None and epoch not in (self.restored_epoch, self.restored_epoch + 1)
                and not (ctx and ctx.skipped)):
            warnings.warn(f"set_epoch({epoch}) after the sampler was restored at epoch {self.restored_epoch}: the "
                          f"loader starts epoch {epoch}. If that is not what you want, call "
                          f"`train_dataloader.set_epoch("
                          "epoch)` with your loop's epoch before iterating (accelerate otherwise counts passes from 0 "
                          "in a new process).", UserWarning, stacklevel=3)
        self.restored_epoch = None
        self.epoch, self.consumed = epoch, 0
        self.start, self.pinned, self.start_id = (epoch, 0), True, self.start_id + 1

    def pass_skip(self, batches_per_step: int) -> int:
        """Call at the start of the sampler's ``__iter__`` (the global plan): if an accelerate ``skip_first_batches``
        pass after a restore is iterating the sampler, move the start so that its skip lands on the loop's step;
        refuse a plain pass that would restart a restored epoch. Returns the batches of the first step to leave out
        (``k × (W-1)`` batches in, with ``dispatch_batches=True``)."""
        at = self.epoch if self.start is None else self.start[0]
        self.guard, start = pass_start(self.guard, loader_pass(self.sampler), epoch=at,
                                       batches_per_step=batches_per_step)
        if start is None:
            return 0
        (step, skip), self.pinned, self.start_id = divmod(start[1], batches_per_step), False, self.start_id + 1
        self.start = (start[0], step)
        return skip

    def pass_steps(self) -> int:
        """Steps of the epoch the next pass serves: the restored one while a restore is unresolved (its ``steps``,
        though the cursor already points past a fully handed-out epoch), else the cursor's epoch."""
        from .restore import Restored

        return self.guard.steps if isinstance(self.guard, Restored) else self.steps_in(self.epoch)

    def begin(self) -> tuple[int, int, int]:
        """Place the cursor for a new pass; returns ``(epoch, first step, id of the start)``."""
        self.restored_epoch = None
        if self.start is not None:  # set_epoch / restore: every pass starts there (see set_epoch)
            self.epoch, self.consumed = self.start
        elif self.consumed >= self.steps_in(self.epoch):  # the last pass finished: this one is the next epoch
            self.epoch, self.consumed = self.epoch + 1, 0
        return self.epoch, self.consumed, self.start_id

    def handed_out(self, epoch: int, step: int, steps: int, start_id: int) -> None:
        """Step ``step`` of ``epoch`` (of ``steps``) is handed out by the pass begun with ``start_id``."""
        if self.epoch == epoch:
            self.consumed = step + 1
            if self.consumed == steps and not self.pinned and self.start_id == start_id:
                self.start = None  # a restored position is used up once its epoch is handed out

    def restore(self, epoch: int, consumed: int) -> None:
        """``load_state_dict``'s position, validated: the next pass continues from it (unless ``set_epoch`` starts
        an epoch), and so does any pass begun after it until one hands out the rest of that epoch.

        Raises:
            ValueError: ``consumed`` exceeds the steps of ``epoch``.
        """
        steps = self.steps_in(epoch)
        if consumed > steps:
            raise ValueError(f"{self.state_name} state field `batches_consumed` is {consumed}, more than the {steps} "
                             f"steps of epoch {epoch}: the state is corrupt. Pass what `sampler.state_dict()` "
                             "returned.")
        self.guard = Restored(epoch, consumed, steps, who=type(self.sampler).__name__)
        if consumed == steps:
            epoch, consumed = epoch + 1, 0
        self.epoch, self.consumed, self.restored_epoch = epoch, consumed, epoch
        self.start, self.pinned, self.start_id = (epoch, consumed), False, self.start_id + 1

    def drop_restored_position(self) -> None:
        """The loop's step counter, not the restored position, places the next pass (resume_dataloader calls it)."""
        self.guard = None


__all__ = ["StepCursor", "locate"]
