"""The tiered sampler's resume state: small, JSON-serialisable, validated field by field on load.

Besides the position (``epoch``, ``batches_consumed``) it holds everything the plan depends on: the schedule, the
tiers (resolution and bucket-set fingerprint of each), ``max_upscale``, the global batch of every (tier, bucket),
the seed, the options and a fingerprint of the rows' sizes. The process count is informative only: a plan depends
on ``num_replicas × batch`` alone, so a run may resume on another number of processes with the same global batches
(elastic resume).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_arb.checks import check_nonneg

TIER_STATE_FORMAT = 1
TIER_PLAN_VERSION = 1  # bump whenever the same inputs would give a different plan: old states are then refused
#: schedules whose plan changed since: ``random`` 2 = the per-group draw (tier_random) instead of a per-row hash
PLAN_VERSION_OF = {"random": 2}
_KIND = "tiered"


def tier_state(sampler: Any, epoch: int, consumed: int) -> dict[str, Any]:
    """A :class:`~hf_arb.sampling.tiered.sampler.TieredBatchSampler`'s state at ``(epoch, consumed)``."""
    return {
        "format": TIER_STATE_FORMAT,
        "kind": _KIND,
        "plan_version": plan_version(sampler.schedule.kind),
        "epoch": epoch,
        "batches_consumed": consumed,
        "steps_per_epoch": sampler.planned_steps,
        "seed": sampler.seed,
        "num_replicas": sampler.num_replicas,
        "schedule": sampler.schedule.to_dict(),
        "tiers": sampler.tiers.fingerprint(),
        "max_upscale": float(sampler.tiers.max_upscale),
        "global_batch_sizes": [(sampler.num_replicas * s).tolist() for s in sampler.tier_batch_sizes],
        "options": {"shuffle": sampler.shuffle, "leftover": sampler.leftover},
        "fingerprint": sampler.fingerprint,
    }


def plan_version(kind: str) -> int:
    """The plan version a state of schedule ``kind`` carries (:data:`TIER_PLAN_VERSION` unless changed since)."""
    return PLAN_VERSION_OF.get(kind, TIER_PLAN_VERSION)


_FIXES = {
    "kind": "This is not a TieredBatchSampler state (a BucketBatchSampler's?): load it into the sampler that saved it.",
    "tiers": "Build the sampler with the checkpoint's tiers (same resolutions, same preset and bucket sets).",
    "max_upscale": "Build the Tiers with the checkpoint's max_upscale.",
    # after the tiers and max_upscale, which it covers (it names the tier files): their own messages come first
    "fingerprint": "The rows' sizes differ from the checkpointed run: resume on the same dataset (same rows, same "
                   "order).",
    "schedule": "Build the sampler with the checkpoint's resolution schedule.",
    "plan_version": "The state comes from an hf_arb version that plans tiers differently (the `random` schedule's "
                    "plan is version 2 since its draw became per row group); resume with that version, or start "
                    "the epoch afresh with `sampler.set_epoch(epoch)`.",
    "seed": "Build the sampler with the checkpoint's seed.",
    "global_batch_sizes": "Resume with the same global batch of every (tier, bucket): num_replicas × its batch size "
                          "(the same max_pixels_per_batch or batch_size for the same total of processes).",
    "steps_per_epoch": "Build the sampler with the checkpoint's steps_per_epoch.",
}


def check_tier_state(state: Mapping[str, Any], expected: Mapping[str, Any]) -> tuple[int, int]:
    """Validate a saved state against this sampler's ``expected`` state; return ``(epoch, batches_consumed)``.

    Raises:
        ValueError: the first field that differs, named, with the saved and the current value and the fix.
    """
    if state.get("format") != TIER_STATE_FORMAT:
        raise ValueError(f"Sampler state field `format` is {state.get('format')!r}, this version reads "
                         f"{TIER_STATE_FORMAT}. Pass what `sampler.state_dict()` returned.")
    for name, fix in _FIXES.items():
        if state.get(name) != expected.get(name):
            raise ValueError(f"Sampler state field `{name}` does not match: saved {state.get(name)!r}, this sampler "
                             f"has {expected.get(name)!r}. {fix}")
    opts = state.get("options")
    if not isinstance(opts, Mapping):
        raise ValueError(f"Sampler state field `options` is {opts!r}, not a mapping. Pass what "
                         "`sampler.state_dict()` returned.")
    for name, ours in expected["options"].items():
        if opts.get(name) != ours:
            raise ValueError(f"Sampler state field `options.{name}` does not match: saved {opts.get(name)!r}, this "
                             f"sampler has {ours!r}. Build the sampler with {name}={opts.get(name)!r}.")
    return check_nonneg("epoch", state.get("epoch")), check_nonneg("batches_consumed", state.get("batches_consumed"))


__all__ = ["PLAN_VERSION_OF", "TIER_PLAN_VERSION", "TIER_STATE_FORMAT", "check_tier_state", "plan_version",
           "tier_state"]
