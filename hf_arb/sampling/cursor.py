"""The position of a step-planned batch sampler, and where its passes start (after ``set_epoch``, a restore, or
accelerate's ``skip_first_batches``).

:class:`~hf_arb.sampling.sampler.BucketBatchSampler` and :class:`~hf_arb.sampling.tiers.TieredBatchSampler` both
derive from :class:`StepCursor`, so both behave identically in every accelerate idiom: the same ``set_epoch`` rule,
the same exact ``skip_first_batches(loader, k)`` after ``accelerator.load_state``, the same one-line refusal of a
plain re-iteration after a mid-epoch restore (:mod:`~hf_arb.sampling.restore` decides; this module applies it).

A sampler using it provides ``_steps_in(epoch)`` (steps per rank of ``epoch``) and, per yielded step, calls
:meth:`StepCursor._handed_out`.
"""

from __future__ import annotations

import warnings

from hf_arb.checks import check_nonneg
from .restore import Guard, Restored, after_set_epoch, loader_pass, pass_start


class StepCursor:
    """Epoch, steps handed out, and the start of the next pass of a sampler whose plan is a pure function of
    ``(seed, epoch, step)``.

    Attributes (the cursor's own):
        _epoch, _consumed: the epoch of the next batch and the steps of it handed out.
        _start: where every pass starts until one hands out that epoch's last step (a restore) or until the next
            ``set_epoch`` (``_pinned``); None: the cursor.
        _start_id: bumped whenever ``_start`` is set, so that an abandoned older pass never clears a newer start.
        _guard: a restore not yet resolved by an accelerate pass (:mod:`~hf_arb.sampling.restore`).
        _restored_epoch: the restored epoch until the next ``set_epoch`` or pass (warns on a different one).
    """

    def _init_cursor(self) -> None:
        self._epoch, self._consumed = 0, 0
        self._restored_epoch: int | None = None
        self._guard: Guard = None
        self._start: tuple[int, int] | None = None
        self._pinned, self._start_id = False, 0

    def _steps_in(self, epoch: int) -> int:  # pragma: no cover - every sampler overrides it
        raise NotImplementedError

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Steps of the current epoch the sampler's iterator has handed out (its resume position)."""
        return self._consumed

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch (accelerate calls this through the prepared loader).

        Every pass from then on yields epoch ``epoch`` from its first batch until the next ``set_epoch`` (as
        ``DistributedSampler`` and accelerate's samplers do); only a sampler whose epoch is never set moves on to the
        next epoch by itself after a finished pass. A pass begun and abandoned (torchdata's ``StatefulDataLoader``
        builds and drops one when it restores a state saved at the end of a pass) thus never shifts the next one.

        After ``load_state_dict``, an epoch other than the restored one or the next warns (the loop probably forgot
        ``train_dataloader.set_epoch(epoch)``); a prepared loader's pass may be refused (:mod:`.restore`)."""
        epoch = check_nonneg("epoch", epoch)
        ctx = loader_pass(self)  # the accelerate pass calling, if any: it may be refused (restore.py)
        self._guard = after_set_epoch(self._guard, epoch, ctx)
        # the next epoch is what a loop sets after serving the rest of the restored one through skip_first_batches
        # (under dispatch_batches only rank 0 sees that pass: no rank may warn where another does not)
        if self._restored_epoch is not None and epoch not in (self._restored_epoch, self._restored_epoch + 1) and not (
                ctx and ctx.skipped):
            warnings.warn(f"set_epoch({epoch}) after the sampler was restored at epoch {self._restored_epoch}: the "
                          f"loader starts epoch {epoch}. If that is not what you want, call `train_dataloader.set_epoch("
                          "epoch)` with your loop's epoch before iterating (accelerate otherwise counts passes from 0 "
                          "in a new process).", UserWarning, stacklevel=2)
        self._restored_epoch = None
        self._epoch, self._consumed = epoch, 0
        self._start, self._pinned, self._start_id = (epoch, 0), True, self._start_id + 1

    def _pass_skip(self, batches_per_step: int) -> int:
        """Call at the start of ``__iter__`` (the global plan): if an accelerate ``skip_first_batches`` pass after a
        restore is iterating the sampler, move the start so that its skip lands on the loop's step; refuse a plain
        pass that would restart a restored epoch. Returns the batches of the first step to leave out (``k × (W-1)``
        batches in, with ``dispatch_batches=True``)."""
        at = self._epoch if self._start is None else self._start[0]
        self._guard, start = pass_start(self._guard, loader_pass(self), epoch=at, batches_per_step=batches_per_step)
        if start is None:
            return 0
        (step, skip), self._pinned, self._start_id = divmod(start[1], batches_per_step), False, self._start_id + 1
        self._start = (start[0], step)
        return skip

    def _begin_steps(self) -> tuple[int, int, int]:
        """Place the cursor for a new pass; returns ``(epoch, first step, id of the start)``."""
        self._restored_epoch = None
        if self._start is not None:  # set_epoch / load_state_dict: every pass starts there (see set_epoch)
            self._epoch, self._consumed = self._start
        elif self._consumed >= self._steps_in(self._epoch):  # the last pass finished: this one is the next epoch
            self._epoch, self._consumed = self._epoch + 1, 0
        return self._epoch, self._consumed, self._start_id

    def _handed_out(self, epoch: int, step: int, steps: int, start_id: int) -> None:
        """Step ``step`` of ``epoch`` (of ``steps``) is handed out by the pass begun with ``start_id``."""
        if self._epoch == epoch:
            self._consumed = step + 1
            if self._consumed == steps and not self._pinned and self._start_id == start_id:
                self._start = None  # a restored position is used up once its epoch is handed out

    def _restore_position(self, epoch: int, consumed: int) -> None:
        """``load_state_dict``'s position, validated: the next pass continues from it (unless ``set_epoch`` starts
        an epoch), and so does any pass begun after it until one hands out the rest of that epoch.

        Raises:
            ValueError: ``consumed`` exceeds the steps of ``epoch``.
        """
        steps = self._steps_in(epoch)
        if consumed > steps:
            raise ValueError(f"Sampler state field `batches_consumed` is {consumed}, more than the {steps} steps of "
                             f"epoch {epoch}: the state is corrupt. Pass what `sampler.state_dict()` returned.")
        self._guard = Restored(epoch, consumed, steps, who=type(self).__name__)
        if consumed == steps:
            epoch, consumed = epoch + 1, 0
        self._epoch, self._consumed, self._restored_epoch = epoch, consumed, epoch
        self._start, self._pinned, self._start_id = (epoch, consumed), False, self._start_id + 1

    def drop_restored_position(self) -> None:
        """The loop's step counter, not the restored position, places the next pass (resume_dataloader calls it)."""
        self._guard = None


__all__ = ["StepCursor"]
