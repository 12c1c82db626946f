"""Resolution schedules of a multi-resolution (tiered) run: which tier trains at every step, as pure functions.

A :class:`TierSchedule` is small, JSON-serialisable (:meth:`TierSchedule.to_dict`, stored in the sampler state) and
one of four kinds:

* ``random`` — OneTrainer's rule: every epoch, every image trains at one tier drawn uniformly among the tiers it
  is eligible for (its size needs no more than the allowed upscale there). Per row, per epoch, drawn in
  ``O(groups)`` per epoch for groups of rows with the same buckets (:mod:`~hf_arb.sampling.tiered.draw`).
* ``mix`` — weights per tier: tier ``t`` trains a ``w_t / Σw`` share of the steps, exactly within every block of
  :data:`MIX_BLOCK` steps (stratified: the block's multiset of tiers is fixed, its order a keyed permutation). This
  is Open-Sora's per-resolution keep probabilities expressed as shares of the steps, with ``O(tiers)`` state.
* ``curriculum`` — step ranges per tier, e.g. ``"0-2000:512,2000-:1024"`` (SimpleTuner's start/end steps).
* ``progressive`` — a curriculum through every tier in ascending resolution, switching at given steps
  (256 → 512 → 1024).

Except ``random``, a schedule maps a global step ``g`` (steps since the run began, over epochs) to a tier and the
position of ``g`` in that tier's own *stream* of steps (:func:`stream_positions`): every tier runs its own
epochs back to back, whatever the other tiers do, so a tier that comes back continues where it stopped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..planning.feistel import FeistelPermutation

SCHEDULES = ("random", "mix", "curriculum", "progressive")
MIX_BLOCK = 1000  #: steps per block of the ``mix`` schedule: each tier's share is exact within every block
TIER_MIX = 30  #: stream tag of the ``mix`` order (entropy ``(seed, block, TIER_MIX)``; hf_arb.rng's tags are < 30)
_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d*)\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class TierSchedule:
    """Which tier trains when.

    Attributes:
        kind: one of :data:`SCHEDULES`.
        weights: ``mix``: one non-negative weight per tier (shape ``(T,)``), not all zero.
        phases: ``curriculum`` / ``progressive``: ``(start, end, tier)`` triples, contiguous from step 0, the last
            one open-ended (``end`` None): steps ``[start, end)`` train ``tier``.
    """

    kind: str
    weights: tuple[float, ...] = ()
    phases: tuple[tuple[int, int | None, int], ...] = ()

    @property
    def per_row(self) -> bool:
        """True for ``random``: the tier is drawn per row and epoch, not per step."""
        return self.kind == "random"

    def tiers_used(self, num_tiers: int) -> list[int]:
        """The tiers this schedule ever trains (ascending)."""
        if self.kind == "random":
            return list(range(num_tiers))
        if self.kind == "mix":
            return [t for t, w in enumerate(self.weights) if w > 0]
        return sorted({t for _, _, t in self.phases})

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (what the sampler state stores)."""
        return {"kind": self.kind, "weights": list(self.weights), "phases": [list(p) for p in self.phases]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], num_tiers: int) -> TierSchedule:
        """Inverse of :meth:`to_dict`, validated against ``num_tiers`` tiers."""
        if not isinstance(d, Mapping) or d.get("kind") not in SCHEDULES:
            raise ValueError(f"A tier schedule must be a dict with `kind` in {SCHEDULES}, got {d!r}.")
        sched = cls(str(d["kind"]), tuple(float(w) for w in d.get("weights") or ()),
                    tuple((int(a), None if b is None else int(b), int(t)) for a, b, t in d.get("phases") or ()))
        return sched.validate(num_tiers)

    def validate(self, num_tiers: int) -> TierSchedule:
        """``self`` if consistent with ``num_tiers`` tiers, else a ValueError naming the value and the fix."""
        if self.kind not in SCHEDULES:
            raise ValueError(f"Unknown resolution schedule {self.kind!r}: use one of {SCHEDULES}.")
        if self.kind == "mix":
            w = np.asarray(self.weights, dtype=np.float64)
            if w.shape != (num_tiers,) or not np.all(np.isfinite(w) & (w >= 0)) or w.sum() <= 0:
                raise ValueError(f"`mix` needs one weight >= 0 per tier ({num_tiers}), not all 0, got "
                                 f"{list(self.weights)}. E.g. mix_schedule([1, 3]) for 1/4 of the steps at tier 0.")
        if self.kind in ("curriculum", "progressive"):
            check_phases(self.phases, num_tiers)
        return self


def check_phases(phases: Sequence[tuple[int, int | None, int]], num_tiers: int) -> None:
    """Phases must start at 0, be contiguous, end open-ended and name existing tiers; else a ValueError."""
    if not phases:
        raise ValueError("A curriculum needs at least one phase, e.g. '0-2000:512,2000-:1024'.")
    expect = 0
    for i, (a, b, t) in enumerate(phases):
        label = f"{a}-{'' if b is None else b}"
        if a != expect:
            raise ValueError(f"Curriculum phase {label} starts at step {a}, but the previous phase ends at {expect}: "
                             f"phases must be contiguous from step 0. Start it at {expect}.")
        if not 0 <= t < num_tiers:
            raise ValueError(f"Curriculum phase {label} names tier {t}, but there are {num_tiers} tiers.")
        if b is None and i != len(phases) - 1:
            raise ValueError(f"Curriculum phase {label} is open-ended but not the last one: give it an end step.")
        if b is not None and b <= a:
            raise ValueError(f"Curriculum phase {a}-{b} is empty or reversed: its end must exceed its start.")
        expect = b if b is not None else -1
    if phases[-1][1] is not None:
        raise ValueError(f"The last curriculum phase ends at step {phases[-1][1]}: leave it open-ended "
                         f"(e.g. '{phases[-1][0]}-:…') so that every step has a tier.")


# ------------------------------------------------------------------------------------------------ constructors
def random_schedule() -> TierSchedule:
    """OneTrainer's rule: a tier per image per epoch, uniform among the tiers the image is eligible for."""
    return TierSchedule("random")


def mix_schedule(weights: Sequence[float]) -> TierSchedule:
    """Tier ``t`` trains a ``weights[t] / sum(weights)`` share of the steps (exact per :data:`MIX_BLOCK` steps)."""
    return TierSchedule("mix", tuple(float(w) for w in weights))


def curriculum_schedule(phases: Sequence[tuple[int, int | None, int]]) -> TierSchedule:
    """Steps ``[start, end)`` of each ``(start, end, tier)`` phase train ``tier`` (the last ``end`` is None)."""
    return TierSchedule("curriculum",
                        phases=tuple((int(a), None if b is None else int(b), int(t)) for a, b, t in phases))


def progressive_schedule(switch_steps: Sequence[int]) -> TierSchedule:
    """Tier 0 until ``switch_steps[0]``, tier 1 until ``switch_steps[1]``, …, the last tier after (``T - 1``
    switch steps for ``T`` tiers in ascending resolution, e.g. 256 → 512 → 1024)."""
    bounds = [0, *[int(s) for s in switch_steps]]
    phases = [(bounds[i], bounds[i + 1], i) for i in range(len(bounds) - 1)] + [(bounds[-1], None, len(bounds) - 1)]
    return TierSchedule("progressive", phases=tuple(phases))


# ------------------------------------------------------------------------------------------------ parser
def _tier_of(text: str, resolutions: Sequence[int], where: str) -> int:
    try:
        r = int(text)
    except ValueError:
        r = -1
    if r not in resolutions:
        raise ValueError(f"--resolution_schedule {where}: {text!r} is not one of the run's resolutions "
                         f"{list(resolutions)}. Use one of them (the tiers of --resolution).")
    return list(resolutions).index(r)


def parse_resolution_schedule(text: str, resolutions: Sequence[int]) -> TierSchedule:
    """Parse a ``--resolution_schedule`` value for tiers of base ``resolutions`` (e.g. ``[512, 1024]``).

    Forms: ``random``; ``mix:512:1,1024:3`` (weights); ``curriculum:0-2000:512,2000-:1024`` (or the ranges alone);
    ``progressive:2000`` (one switch step per tier after the first, tiers in ascending resolution).

    Raises:
        ValueError: naming the offending value and the form to use.
    """
    res = [int(r) for r in resolutions]
    s = str(text).strip()
    kind, _, body = s.partition(":")
    kind = kind.strip().lower()
    if kind not in SCHEDULES and _RANGE.match(s.split(",")[0]):
        kind, body = "curriculum", s
    if kind == "random":
        if body.strip():
            raise ValueError(f"--resolution_schedule {s!r}: `random` takes no value. Use 'random'.")
        return random_schedule().validate(len(res))
    if kind == "mix":
        weights = [0.0] * len(res)
        for item in filter(None, (x.strip() for x in body.split(","))):
            r, _, w = item.partition(":")
            try:
                weight = float(w)
            except ValueError:
                weight = -1.0
            if not (weight >= 0 and np.isfinite(weight)):
                raise ValueError(f"--resolution_schedule mix item {item!r}: the weight must be a number >= 0. Use "
                                 f"e.g. 'mix:{res[0]}:1,{res[-1]}:3'.")
            weights[_tier_of(r.strip(), res, f"mix item {item!r}")] = weight
        if sum(weights) <= 0:
            raise ValueError(f"--resolution_schedule {s!r}: give at least one positive weight, e.g. "
                             f"'mix:{res[0]}:1,{res[-1]}:3'.")
        return mix_schedule(weights).validate(len(res))
    if kind == "curriculum":
        phases = []
        for item in filter(None, (x.strip() for x in body.split(","))):
            m = _RANGE.match(item)
            if m is None:
                raise ValueError(f"--resolution_schedule curriculum item {item!r} is not 'start-end:resolution'. "
                                 f"Use e.g. '0-2000:{res[0]},2000-:{res[-1]}'.")
            a, b = int(m[1]), (int(m[2]) if m[2] else None)
            phases.append((a, b, _tier_of(m[3], res, f"curriculum item {item!r}")))
        return curriculum_schedule(phases).validate(len(res))
    if kind == "progressive":
        try:
            steps = [int(x) for x in body.split(",") if x.strip()]
        except ValueError:
            steps = None
        if steps is None or len(steps) != len(res) - 1 or sorted(set(steps)) != steps or (steps and steps[0] <= 0):
            example = ",".join(str(2000 * (i + 1)) for i in range(len(res) - 1))
            raise ValueError(f"--resolution_schedule {s!r}: `progressive` needs {len(res) - 1} increasing switch "
                             f"step(s) > 0 for the tiers {sorted(res)}. Use e.g. 'progressive:{example}'.")
        if res != sorted(res):
            raise ValueError(f"`progressive` trains the tiers in ascending resolution, but --resolution is {res}. "
                             f"List them ascending: {','.join(map(str, sorted(res)))}.")
        return progressive_schedule(steps).validate(len(res))
    raise ValueError(f"--resolution_schedule {s!r}: unknown schedule {kind!r}. Use one of 'random', "
                     f"'mix:{res[0]}:1,{res[-1]}:3', 'curriculum:0-2000:{res[0]},2000-:{res[-1]}', "
                     f"'progressive:2000'.")


# ------------------------------------------------------------------------------------------------ step -> tier
def mix_counts(weights: Sequence[float], block: int = MIX_BLOCK) -> np.ndarray:
    """Steps per tier in a block of ``block`` steps: int64 ``(T,)`` summing to ``block`` (largest remainders)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * block  # (T,)
    counts = np.floor(exact).astype(np.int64)
    rest = block - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:rest]] += 1
    return counts


def mix_block(weights: Sequence[float], seed: int, block_id: int, block: int = MIX_BLOCK) -> tuple[np.ndarray,
                                                                                                      np.ndarray]:
    """Tier of every step of one block and its rank among that tier's steps of the block: int64 ``(block,)`` each."""
    counts = mix_counts(weights, block)
    base = np.repeat(np.arange(counts.size), counts)  # (block,) the block's multiset of tiers
    tiers = base[FeistelPermutation(block, (seed, block_id, TIER_MIX))(np.arange(block))]  # (block,)
    order = np.argsort(tiers, kind="stable")
    rank = np.empty(block, np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank[order] = np.arange(block) - starts[tiers[order]]
    return tiers, rank


def stream_positions(schedule: TierSchedule, seed: int, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tier and position in that tier's stream of global ``steps`` (int array ``(m,)``): int64 ``(m,)`` each.

    ``curriculum``/``progressive``: the phase containing the step, and the steps that tier trained in earlier phases
    plus the offset in this one (``O(phases)``). ``mix``: block ``g // MIX_BLOCK`` holds ``c_t`` steps of tier ``t``,
    so the position is ``block · c_t`` plus the step's rank in its block (``O(MIX_BLOCK)`` per block touched).
    """
    g = np.asarray(steps, dtype=np.int64)
    if schedule.kind == "mix":
        counts = mix_counts(schedule.weights)
        tiers, pos = np.empty_like(g), np.empty_like(g)
        blocks = g // MIX_BLOCK
        for b in np.unique(blocks).tolist():
            sel = blocks == b
            bt, br = mix_block(schedule.weights, seed, b)
            p = g[sel] - b * MIX_BLOCK
            tiers[sel], pos[sel] = bt[p], b * counts[bt[p]] + br[p]
        return tiers, pos
    if schedule.kind in ("curriculum", "progressive"):
        starts = np.array([a for a, _, _ in schedule.phases], np.int64)  # (P,)
        lengths = [(b - a) if b is not None else 0 for a, b, _ in schedule.phases]
        ptier = np.array([t for _, _, t in schedule.phases], np.int64)  # (P,)
        before = np.array([sum(n for n, t2 in zip(lengths[:i], ptier[:i]) if t2 == ptier[i])
                           for i in range(len(lengths))], np.int64)  # (P,) steps of the same tier in earlier phases
        phase = np.searchsorted(starts, g, side="right") - 1  # (m,)
        return ptier[phase], g - starts[phase] + before[phase]
    raise ValueError(f"stream_positions is for step schedules; {schedule.kind!r} draws a tier per row and epoch.")


__all__ = ["MIX_BLOCK", "SCHEDULES", "TierSchedule", "curriculum_schedule", "mix_block", "mix_counts",
           "mix_schedule", "parse_resolution_schedule", "progressive_schedule", "random_schedule",
           "stream_positions"]
