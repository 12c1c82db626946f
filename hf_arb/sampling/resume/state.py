"""The sampler's resume state: small, JSON-serialisable, validated field by field on load.

The state is the torchdata ``state_dict`` / ``load_state_dict`` protocol's: the position of the sampler's
iterator (``epoch``, ``batches_consumed`` steps handed out in that epoch), plus everything the plan depends on
(seed, global batch, options, a fingerprint of the bucket ids) so that a state is never applied to a different
plan.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hf_arb.checks import check_nonneg

from .cursor import StepCursor


class ResumableBatchSampler:
    """What every hf_arb batch sampler is: a ``batch_sampler`` with ``set_epoch``, ``state_dict`` /
    ``load_state_dict`` (torchdata's protocol) and ``report()``, whose position is one
    :class:`~hf_arb.sampling.resume.cursor.StepCursor` (``self.cursor``, set by the subclass's ``__init__``).
    :class:`~hf_arb.sampling.BucketBatchSampler`, :class:`~hf_arb.sampling.tiered.sampler.TieredBatchSampler` and
    :class:`~hf_arb.packing.PackBatchSampler` derive from it, so :func:`~hf_arb.sampling.accelerate.find_sampler`
    finds any of them behind a prepared ``DataLoader`` without importing the packing floor."""

    cursor: StepCursor

    @property
    def sampler(self) -> ResumableBatchSampler:
        """This sampler: accelerate looks for ``set_epoch`` on ``batch_sampler.sampler`` (also behind its
        ``BatchSamplerShard``), so ``prepared_loader.set_epoch(e)`` reaches the cursor."""
        return self

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self.cursor.epoch

    @property
    def batches_consumed(self) -> int:
        """Steps of the current epoch the sampler's iterator has handed out (its resume position)."""
        return self.cursor.consumed

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch (:meth:`~hf_arb.sampling.resume.cursor.StepCursor.set_epoch`:
        every pass yields it until the next ``set_epoch``; after a restore another epoch warns)."""
        self.cursor.set_epoch(epoch)

    def drop_restored_position(self) -> None:
        """The loop's step counter, not the restored position, places the next pass (resume_dataloader calls it)."""
        self.cursor.drop_restored_position()


STATE_FORMAT = 1
# 2: counter-based (Feistel) permutations, O(buckets) state; bump whenever the same inputs would give a different plan:
# old states are then refused
PLAN_VERSION = 2


def _mismatch(name: str, saved: Any, ours: Any, fix: str) -> ValueError:
    return ValueError(f"Sampler state field `{name}` does not match: saved {saved!r}, this sampler has {ours!r}. {fix}")


def as_state_mapping(state: Any) -> Mapping[str, Any]:
    """Accept a state mapping or its JSON text; anything else is a clear error."""
    if isinstance(state, (str, bytes, bytearray)):
        try:
            state = json.loads(state)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"load_state_dict expected a sampler state (a dict from `sampler.state_dict()` or its JSON text), "
                f"got a string that is not JSON ({e.msg} at position {e.pos}): {str(state)[:60]!r}."
            ) from None
    if not isinstance(state, Mapping):
        raise TypeError(
            f"load_state_dict expected a sampler state (a dict from `sampler.state_dict()` or its JSON text), got "
            f"{type(state).__name__}: {repr(state)[:60]}. Pass what `sampler.state_dict()` returned."
        )
    return state


def sampler_state(sampler: Any) -> dict[str, Any]:
    """A :class:`~hf_arb.sampling.sampler.BucketBatchSampler`'s state (its ``state_dict()``)."""
    return {
        "format": STATE_FORMAT,
        "plan_version": PLAN_VERSION,
        "epoch": sampler.epoch,
        "batches_consumed": sampler.batches_consumed,
        "steps_per_epoch": sampler.steps_per_epoch,
        "seed": sampler.seed,
        "batch_size": sampler.per_rank_batch_size,
        "num_replicas": sampler.num_replicas,
        "global_batch_size": sampler.global_batch_size,
        "global_batch_sizes": (None if sampler.batch_sizes is None
                               else [sampler.num_replicas * b for b in sampler.batch_sizes.values()]),
        "options": {"shuffle": sampler.shuffle, "sync_buckets": sampler.sync_buckets, "leftover": sampler.leftover,
                    "catch_all_bucket": sampler.catch_all_bucket, "merge_small": sampler.merge_small},
        "fingerprint": sampler.fingerprint,
    }


def check_state(state: Mapping[str, Any], expected: Mapping[str, Any], *, per_rank_plan: bool) -> tuple[int, int]:
    """Validate a saved state against this sampler's ``expected`` state; return ``(epoch, batches_consumed)``.

    Args:
        state: the saved state.
        expected: this sampler's ``state_dict()`` (only the plan-defining fields are compared).
        per_rank_plan: the plan depends on ``batch_size`` and ``num_replicas`` separately (``sync_buckets=False``);
            a synchronised plan only depends on their product, so the process count may change (elastic resume).

    Raises:
        ValueError: the first field that differs, named, with the saved and the current value and the fix.
    """
    fmt = state.get("format")
    if fmt != STATE_FORMAT:
        raise ValueError(f"Sampler state field `format` is {fmt!r}, this version reads {STATE_FORMAT}. "
                         "Pass what `sampler.state_dict()` returned.")
    if state.get("plan_version") != PLAN_VERSION:
        raise _mismatch("plan_version", state.get("plan_version"), PLAN_VERSION,
                        "The state comes from an hf_arb version that orders batches differently; resume with that "
                        "version, or start the epoch afresh with `sampler.set_epoch(epoch)`.")
    checks = [
        ("fingerprint", "The bucket ids differ from the checkpointed run: resume on the same annotated dataset "
                        "(same rows, same order, same bucket set and merging)."),
        ("seed", "Build the sampler with the checkpoint's seed."),
        ("global_batch_sizes", ("Resume with the same global batch of every bucket (num_replicas × its batch size: "
                                "the same max_pixels_per_batch, or mapping, for the same total of processes).")),
        ("global_batch_size", "Resume with num_replicas × batch_size equal to the checkpointed run's."),
    ]
    if per_rank_plan:
        fix = "With sync_buckets=False the plan is per rank: keep the same processes and batch size."
        checks += [("batch_size", fix), ("num_replicas", fix)]
    for name, fix in checks:
        if state.get(name) != expected.get(name):
            raise _mismatch(name, state.get(name), expected[name], fix)
    saved_opts = state.get("options")
    if not isinstance(saved_opts, Mapping):
        raise _mismatch("options", saved_opts, dict(expected["options"]), "Pass what `sampler.state_dict()` returned.")
    for name, ours in expected["options"].items():
        if saved_opts.get(name) != ours:
            raise _mismatch(f"options.{name}", saved_opts.get(name), ours,
                            f"Build the sampler with {name}={saved_opts.get(name)!r}.")
    return check_nonneg("epoch", state.get("epoch")), check_nonneg("batches_consumed", state.get("batches_consumed"))
