"""The ``random`` tier schedule from a stream: :class:`RandomTierStream`, OneTrainer's rule (each image trains at
one tier per epoch, drawn uniformly among the tiers it is eligible for) with every rank in the same (tier, bucket).

A stream cannot look a row up by index, but the ``O(groups)`` random plan of
:mod:`~hf_arb.sampling.tiered.draw` does not need to: it fixes, per epoch, how many rows of each *group* (rows with
the same bucket in every tier) train at each tier, from the group sizes alone, and which *positions* of a keyed
permutation ``φ_g`` of the group take each tier. The stream reuses that plan as it is:

* **Counts before reading.** The group sizes come from the stored sizes (:func:`stream_groups`, the same read of
  the ``original_width``/``original_height`` columns that the step schedules' counts take). Epoch ``e``'s rows per
  (tier, bucket) are :class:`~hf_arb.sampling.tiered.draw.RandomEpochIndex`'s ``count``, exact, so the epoch's
  global bucket schedule is the single-tier stream's over the combined ids
  (:func:`~hf_arb.sampling.streaming.plan.stream_schedule`): the same on every rank, a pure function of (sizes, seed,
  epoch), and each step's (tier, bucket) follows (:meth:`RandomTierStream.step_tiers`).
* **A row's tier on arrival.** Rank ``r`` of ``W`` reads its split in a deterministic order (the source's own
  order for the epoch; a resume replays it from the source's snapshots). The ``j``-th row of group ``g`` that rank
  ``r`` reads takes position ``p = j·W + r`` of the group, i.e. slot ``φ_g(p)`` of the plan, and trains at the tier
  whose slice ``[start_{g,t}, start_{g,t} + c_{g,t})`` holds that slot (:class:`TierAssigner`). The ranks' positions
  are disjoint, so no two rows take one slot and a row takes exactly one of its eligible tiers. One process
  (``W = 1``) reads every row of the group at positions ``0 … n_g - 1``: the epoch's rows per (tier, bucket) are the
  plan's exactly. With ``W > 1`` a rank whose split holds more than its share of a group (``p >= n_g``) does not
  train the extra rows this epoch (counted as ``skipped_unassigned``), and the slots a short rank leaves empty
  become that rank's counted repeats, as a single-tier stream's per-rank imbalance does.
* **State.** The per-group arrival counters of each rank (``O(groups)`` ints) travel with every source snapshot,
  so a resumed stream re-reads and re-assigns its buffered rows exactly and continues the counters where they were.

What it is not: the per-row hash :func:`~hf_arb.sampling.tiered.plan.random_tier_ids` (the packing sampler's), nor
the map-style plan's draw of *which* rows take a tier (here the arrival order picks the row for a slot; the law of
a row's tier is the same, uniform over its eligible tiers given ``φ_g``). A stream state is for the same world
size (as :class:`~hf_arb.sampling.streaming.stream.BucketedStream`'s).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..planning.feistel import FeistelPermutation
from ..streaming.stream import BucketedStream
from .draw import TIER_GROUP_ORDER, RandomEpochIndex, RowGroups, find_groups, key_radix, row_keys
from .plan import Tiers, tier_bucket_ids

SIZE_COLUMNS = ("original_width", "original_height")


@dataclass(frozen=True)
class GroupSizes:
    """The part of a :class:`~hf_arb.sampling.planning.index.RowIndex` the epoch's counts read: ``count``, rows per
    group, int64 ``(G,)`` (a stream never looks a row up by index)."""

    count: np.ndarray


def stream_groups(widths: Any, heights: Any, tiers: Tiers) -> RowGroups:
    """The :class:`~hf_arb.sampling.tiered.draw.RowGroups` of a stream from its stored sizes (``(n,)`` each), with
    only the group sizes as index (:class:`GroupSizes`).

    Raises:
        ValueError: no row is eligible in any tier.
    """
    ids = tier_bucket_ids(np.asarray(widths, np.float64), np.asarray(heights, np.float64), tiers)  # (T, n)
    buckets = find_groups(ids, tiers.num_buckets)  # (G, T)
    if not buckets.shape[0]:
        raise ValueError(f"No row is eligible in any tier {list(tiers.resolutions)} (max_upscale "
                         f"{tiers.max_upscale}): lower the resolutions or raise max_upscale.")
    g = group_of(ids, buckets, tiers)
    sizes = np.bincount(g[g >= 0], minlength=buckets.shape[0]).astype(np.int64)
    return RowGroups(buckets, GroupSizes(sizes), tiers.offsets)  # type: ignore[arg-type]


def group_of(ids: np.ndarray, buckets: np.ndarray, tiers: Tiers) -> np.ndarray:
    """Group of every row: ``ids`` int ``(T, m)`` (:func:`~hf_arb.sampling.tiered.plan.tier_bucket_ids`), ``buckets``
    int ``(G, T)`` → int64 ``(m,)``, ``-1`` for rows eligible nowhere or in no group of the plan."""
    radix = key_radix(tiers.num_buckets)
    keys = row_keys(buckets.T, radix)  # (G,) ascending (find_groups sorts by key)
    k = row_keys(ids, radix)  # (m,)
    g = np.minimum(np.searchsorted(keys, k), keys.size - 1)
    return np.where((keys[g] == k) & (k > 0), g, -1).astype(np.int64)


class TierAssigner:
    """One rank's tier draw for one epoch: rewrites a chunk's ``bucket`` (combined id ``offsets[t] + b``, ``-1``:
    not trained this epoch), ``tier``, ``tier_bucket``, ``bucket_width``, ``bucket_height`` from its stored sizes
    and the rank's per-group arrival counters :attr:`arrived` (int64 ``(G,)``), which it advances."""

    def __init__(self, tiers: Tiers, groups: RowGroups, plan: RandomEpochIndex, *, rank: int, world: int,
                 seed: int, epoch: int, size_columns: tuple[str, str] = SIZE_COLUMNS) -> None:
        self.tiers, self.groups, self.plan, self.rank, self.world = tiers, groups, plan, int(rank), int(world)
        self.key, self.size_columns = (int(seed), int(epoch)), size_columns
        self.arrived = np.zeros(groups.num_groups, np.int64)
        self.ends = plan.tier_start + plan.tier_counts  # (G, T) end of each tier's slice of the slots
        self.perms: dict[int, FeistelPermutation] = {}

    def perm(self, g: int) -> FeistelPermutation:
        """``φ_g``: the plan's permutation of group ``g`` (key ``(seed, epoch, TIER_GROUP_ORDER, g)``)."""
        if g not in self.perms:
            self.perms[g] = FeistelPermutation(int(self.groups.index.count[g]), (*self.key, TIER_GROUP_ORDER, g))
        return self.perms[g]

    def tiers_of(self, g: np.ndarray) -> np.ndarray:
        """The tier of the next rows of groups ``g`` (int ``(m,)``, in arrival order, ``-1``: no group): int64
        ``(m,)``, ``-1`` beyond the rank's share; advances :attr:`arrived`."""
        out = np.full(g.size, -1, np.int64)
        sel = np.flatnonzero(g >= 0)
        gs = g[sel]
        order = np.argsort(gs, kind="stable")
        first = np.flatnonzero(np.r_[True, gs[order][1:] != gs[order][:-1]]) if gs.size else np.empty(0, np.int64)
        occ = np.empty(gs.size, np.int64)
        occ[order] = np.arange(gs.size) - np.repeat(first, np.diff(np.r_[first, gs.size]))  # rank in the chunk
        p = (self.arrived[gs] + occ) * self.world + self.rank  # (m',) position of each row in its group
        np.add.at(self.arrived, gs, 1)
        for gg in np.unique(gs).tolist():
            here = np.flatnonzero((gs == gg) & (p < self.groups.index.count[gg]))
            slots = self.perm(gg)(p[here])
            out[sel[here]] = (slots[:, None] >= self.ends[gg][None, :]).sum(axis=1)  # slice holding the slot
        return out

    def __call__(self, chunk: Mapping[str, list]) -> dict[str, list]:
        """A chunk of ``IterableDataset.iter`` with the tier columns of this epoch's draw."""
        w, h = (np.array([np.nan if v is None else v for v in chunk[c]], np.float64) for c in self.size_columns)
        g = group_of(tier_bucket_ids(w, h, self.tiers), self.groups.buckets, self.tiers)
        t = self.tiers_of(g)
        ok = t >= 0
        b = np.where(ok, self.groups.buckets[np.maximum(g, 0), np.maximum(t, 0)], -1).astype(np.int64)
        res = np.zeros((t.size, 2), np.int64)
        for tt in np.unique(t[ok]).tolist():
            res[t == tt] = self.tiers.bucket_sets[tt].resolutions[b[t == tt]]
        comb = np.where(ok, self.tiers.offsets[np.maximum(t, 0)] + b, -1)
        return {**chunk, "bucket": comb.tolist(), "tier": t.tolist(), "tier_bucket": b.tolist(),
                "bucket_width": res[:, 0].tolist(), "bucket_height": res[:, 1].tolist()}


class AssignedSource:
    """A rank's split with its :class:`TierAssigner`: what :class:`~hf_arb.sampling.streaming.buffer.RankBuffer`
    reads (``iter(batch_size=...)``, ``state_dict()``); the state is the split's and the arrival counters."""

    def __init__(self, source: Any, assigner: TierAssigner) -> None:
        self.source, self.assigner = source, assigner

    def iter(self, batch_size: int) -> Any:
        for chunk in self.source.iter(batch_size=batch_size):
            yield self.assigner(chunk)

    def state_dict(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(), "arrived": self.assigner.arrived.tolist()}


class RandomTierStream(BucketedStream):
    """Full one-bucket batches of several tiers from a streaming dataset under the ``random`` schedule: each row
    at one tier per epoch, drawn uniformly among its eligible tiers, every rank in the same (tier, bucket) at every
    step (module docstring). Yields, resumes and reports like :class:`~hf_arb.sampling.streaming.stream.BucketedStream`
    over the combined (tier, bucket) ids; rows carry ``tier`` and ``tier_bucket``. Epochs differ in length a little
    (:meth:`steps_in`).

    Args:
        dataset: a ``datasets.IterableDataset`` with the stored sizes and a ``bucket`` column (rewritten).
        tiers: the :class:`~hf_arb.sampling.tiered.plan.Tiers`.
        batch_size: rows per batch per rank.
        groups: :func:`stream_groups` of the dataset's stored sizes (in any order).
        size_columns: the stored size columns.
        **stream_kwargs: the :class:`~hf_arb.sampling.streaming.stream.BucketedStream` arguments (``num_replicas``,
            ``rank``, ``seed``, ``buffer_size``, ``collate_fn``, …).
    """

    def __init__(self, dataset: Any, tiers: Tiers, batch_size: int, *, groups: RowGroups,
                 size_columns: tuple[str, str] = SIZE_COLUMNS, **stream_kwargs: Any) -> None:
        self.tiers, self.groups, self.size_columns = tiers, groups, size_columns
        self.plans: dict[int, RandomEpochIndex] = {}
        self.epoch_steps: dict[int, int] = {}  # steps_in's answers (a few ints per epoch)
        seed = int(stream_kwargs.get("seed", 0))
        super().__init__(dataset, batch_size, counts=self.epoch_plan(0, seed).count, **stream_kwargs)

    def epoch_plan(self, epoch: int, seed: int | None = None) -> RandomEpochIndex:
        """Epoch ``epoch``'s draw (the last few kept)."""
        if epoch not in self.plans:
            while len(self.plans) >= 4:
                del self.plans[min(self.plans)]
            self.plans[epoch] = RandomEpochIndex(self.groups, self.seed if seed is None else seed, epoch)
        return self.plans[epoch]

    def steps_in(self, epoch: int) -> int:
        """Global steps of ``epoch``: ``Σ count // global_batch`` over its (tier, bucket) counts."""
        if epoch not in self.epoch_steps:
            self.epoch_steps[int(epoch)] = int((self.epoch_plan(int(epoch)).count // self.global_batch_size).sum())
        return self.epoch_steps[int(epoch)]

    def step_tiers(self, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(tier, bucket)`` of every step of ``epoch`` (default: current), int64 ``(steps_in(epoch),)`` each: a
        pure function of the sizes, seed and epoch."""
        e = self.epoch if epoch is None else int(epoch)
        comb = self.schedule if e == self.epoch else self.schedule_of(e)
        t = np.searchsorted(self.tiers.offsets, comb, side="right") - 1
        return t.astype(np.int64), (comb - self.tiers.offsets[t]).astype(np.int64)

    def schedule_of(self, epoch: int) -> np.ndarray:
        """The combined id of every step of ``epoch``, int ``(steps_in(epoch),)``."""
        from ..streaming.plan import stream_schedule

        return stream_schedule(self.epoch_plan(epoch).count, self.global_batch_size, self.seed, epoch,
                               order=self.schedule_order, batch_size=self.batch_size)

    def report(self) -> Any:
        """:meth:`BucketedStream.report <hf_arb.sampling.streaming.stream.BucketedStream.report>` over the combined ids;
        with several ranks ``rows_unread`` is None (a group's rows beyond a rank's share are in
        ``rows_skipped_unassigned``)."""
        rep = super().report()
        return rep if self.num_replicas == 1 else replace(rep, rows_unread=None)

    # BucketedStream's hooks: the epoch's counts, the split with its assigner, the config
    def _make_schedule(self) -> np.ndarray:
        self.counts = self.epoch_plan(self.epoch).count
        return self.schedule_of(self.epoch)

    def _open(self, rank: int, epoch: int, state: Any) -> AssignedSource:
        src = super()._open(rank, epoch, None if state is None else state["source"])
        assigner = TierAssigner(self.tiers, self.groups, self.epoch_plan(epoch), rank=rank, world=self.num_replicas,
                                seed=self.seed, epoch=epoch, size_columns=self.size_columns)
        if state is not None:
            assigner.arrived = np.asarray(state["arrived"], np.int64)
        return AssignedSource(src, assigner)

    def _config(self) -> dict[str, Any]:
        config = super()._config()
        sizes = np.concatenate([self.groups.buckets.astype(np.int64).ravel(), self.groups.index.count])
        config["counts_sha1"] = hashlib.sha1(sizes.tobytes()).hexdigest()[:16]  # the groups: every epoch's counts
        config["tiers"] = {"fingerprint": self.tiers.fingerprint(), "schedule": "random"}
        return config


def build_random_stream_loader(dataset: Any, tiers: Tiers, batch_size: int, *, groups: RowGroups,
                               accelerator: Any = None, **stream_kwargs: Any) -> tuple[Any, RandomTierStream]:
    """:func:`~hf_arb.sampling.tiered.stream.build_tiered_stream_loader` for the ``random`` schedule: a
    ``DataLoader`` over a :class:`RandomTierStream` set up for ``accelerator``.

    Raises:
        ValueError: the accelerator uses ``split_batches=True``.
    """
    import torch

    from .stream import first_item, stream_ranks

    world, rank = stream_ranks(accelerator)
    stream = RandomTierStream(dataset, tiers, batch_size, groups=groups, num_replicas=world, rank=rank,
                              **stream_kwargs)
    return torch.utils.data.DataLoader(stream, batch_size=1, collate_fn=first_item, num_workers=0), stream


__all__ = ["AssignedSource", "GroupSizes", "RandomTierStream", "TierAssigner", "build_random_stream_loader",
           "group_of", "stream_groups"]
