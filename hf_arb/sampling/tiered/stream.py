"""Several resolution tiers from a streaming dataset: :class:`TieredStream`, every rank in the same (tier, bucket).

The map-style :class:`~hf_arb.sampling.tiered.sampler.TieredBatchSampler` runs, for a step schedule (``mix``,
``curriculum``, ``progressive``), one *stream* of passes per tier and lets the schedule say which tier's stream the
next step comes from. A stream does the same with one :class:`~hf_arb.sampling.streaming.stream.BucketedStream` per
tier:

* tier ``t``'s stream reads the source with the row's bucket **in tier t** (``bucket`` rewritten to the combined id
  ``offsets[t] + b`` of :attr:`~hf_arb.sampling.tiered.plan.Tiers.offsets`, ``bucket_width``/``bucket_height`` to that
  bucket's size, from the stored size with :func:`~hf_arb.sampling.tiered.plan.tier_bucket_ids`; ``tier`` and
  ``tier_bucket`` added; rows not eligible there are skipped), with the rows per bucket of that tier as its counts,
  so its global bucket schedule is the single-tier one (:func:`~hf_arb.sampling.streaming.plan.stream_schedule`);
* global step ``g`` trains tier ``t`` at position ``i`` of its stream (:func:`~hf_arb.sampling.tiered.schedule.
  stream_positions`), i.e. step ``i mod S_t`` of the tier's pass ``i // S_t``: every rank computes the same (tier,
  bucket) for every step, and a tier that comes back continues where it stopped;
* an epoch of the tiered stream is ``steps_per_epoch`` global steps (default: the longest pass of a tier in use),
  as for the map-style sampler.

Resume: the state holds the global position and, per tier, its stream's state at the loop's step (the loader
reads ahead; each tier's stream keeps the history to describe an earlier step, its previous pass included).

``random`` (a tier per row and epoch) is not a step schedule: it streams with
:class:`~hf_arb.sampling.tiered.stream_draw.RandomTierStream` (one stream over every (tier, bucket), the epoch's
counts from the ``O(groups)`` random plan); :class:`TieredStream` refuses it, naming that class.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hf_arb.checks import check_nonneg, check_positive

from ..streaming.plan import stream_schedule
from ..streaming.stream import BucketedStream
from .plan import Tiers, tier_bucket_ids
from .schedule import TierSchedule, parse_resolution_schedule, stream_positions

STATE_VERSION = 1
#: the columns a tier's stream rewrites from the stored size (and the ``tier``, ``tier_bucket`` it adds)
TIER_COLUMNS = ("bucket", "bucket_width", "bucket_height", "tier", "tier_bucket")


class TierColumns:
    """``datasets`` batched map: the rows' bucket in tier ``tier`` from their stored size: ``bucket`` the combined
    id ``offsets[tier] + b`` (-1: not eligible), ``tier_bucket`` ``b``, ``bucket_width``/``bucket_height``."""

    def __init__(self, tiers: Tiers, tier: int, size_columns: tuple[str, str]) -> None:
        self.tiers, self.tier, self.size_columns = tiers, int(tier), size_columns

    def __call__(self, batch: Mapping[str, list]) -> dict[str, list]:
        w, h = (np.array([np.nan if v is None else v for v in batch[c]], np.float64) for c in self.size_columns)
        ids = tier_bucket_ids(w, h, self.tiers)[self.tier].astype(np.int64)  # (n,)
        res = self.tiers.bucket_sets[self.tier].resolutions[np.maximum(ids, 0)]  # (n, 2)
        ok = ids >= 0
        return {"bucket": np.where(ok, ids + int(self.tiers.offsets[self.tier]), -1).tolist(),
                "tier_bucket": ids.tolist(), "bucket_width": np.where(ok, res[:, 0], 0).tolist(),
                "bucket_height": np.where(ok, res[:, 1], 0).tolist(), "tier": [self.tier] * int(ids.size)}


def combined_counts(counts: Sequence[Any], tiers: Tiers) -> np.ndarray:
    """Per-tier counts (one ``(k_t,)`` array per tier) as one int64 ``(K,)`` array over the combined ids."""
    out = np.zeros(int(tiers.offsets[-1]), np.int64)
    for t, c in enumerate(counts):
        c = np.asarray(c, np.int64)
        out[int(tiers.offsets[t]) : int(tiers.offsets[t]) + c.size] = c
    return out


@dataclass(frozen=True)
class TieredStreamReport:
    """Position of a :class:`TieredStream` and each used tier's :class:`~hf_arb.sampling.streaming.plan.StreamReport`
    (of its current pass), keyed by resolution."""

    epoch: int
    step: int
    steps: int
    tiers: dict[int, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "steps": self.steps,
                "tiers": {str(r): rep.to_dict() for r, rep in self.tiers.items()}}

    def __str__(self) -> str:
        lines = [f"tiered stream, epoch {self.epoch}: step {self.step}/{self.steps}"]
        lines += [f"  tier {r}: {rep}" for r, rep in self.tiers.items()]
        return "\n".join(lines)


def tier_stream_counts(widths: Any, heights: Any, tiers: Tiers) -> list[np.ndarray]:
    """Rows per bucket of every tier from the stored sizes: one int64 ``(k_t,)`` array per tier (the counts a
    :class:`TieredStream` needs before it reads a row; ``hf-arb stats --resolution`` prints the same)."""
    ids = tier_bucket_ids(np.asarray(widths, np.float64), np.asarray(heights, np.float64), tiers)  # (T, n)
    return [np.bincount(ids[t][ids[t] >= 0].astype(np.int64), minlength=int(k)).astype(np.int64)
            for t, k in enumerate(tiers.num_buckets)]


class TieredStream(torch.utils.data.IterableDataset):
    """Full one-bucket batches of several resolution tiers from a streaming dataset, the same (tier, bucket) on
    every rank at every step, under a step schedule; yields like
    :class:`~hf_arb.sampling.streaming.stream.BucketedStream` (per step one item per rank, ``None`` for ranks this
    process does not read).

    Args:
        dataset: a ``datasets.IterableDataset`` with the stored sizes (``original_width``, ``original_height``).
        tiers: the :class:`~hf_arb.sampling.tiered.plan.Tiers`.
        schedule: a step schedule (``mix``, ``curriculum``, ``progressive``) or its ``--resolution_schedule`` text.
        batch_size: rows per batch per rank (one size for every tier: a stream takes no pixel budget).
        counts: rows per bucket of every tier (:func:`tier_stream_counts`), one ``(k_t,)`` array per tier, or
            one ``(K,)`` array over the combined ids.
        num_replicas, rank, seed: as :class:`~hf_arb.sampling.streaming.stream.BucketedStream`.
        steps_per_epoch: global steps per epoch (default: the longest pass of a tier in use).
        size_columns: the stored size columns.
        **stream_kwargs: the other :class:`~hf_arb.sampling.streaming.stream.BucketedStream` arguments (``buffer_size``,
            ``collate_fn``, ``history``, …), the same for every tier.
    """

    def __init__(self, dataset: Any, tiers: Tiers, schedule: TierSchedule | str, batch_size: int, *,
                 counts: Sequence[Any], num_replicas: int = 1, rank: int | None = None, seed: int = 0,
                 steps_per_epoch: int | None = None,
                 size_columns: tuple[str, str] = ("original_width", "original_height"), **stream_kwargs: Any) -> None:
        if isinstance(schedule, str):
            schedule = parse_resolution_schedule(schedule, tiers.resolutions)
        self.tiers, self.schedule = tiers, schedule.validate(tiers.num_tiers)
        if self.schedule.per_row:
            raise ValueError("TieredStream takes a step schedule (mix, curriculum, progressive): `random` draws a "
                             "tier per row and epoch; stream it with hf_arb.sampling.tiered.stream_draw."
                             "RandomTierStream (groups=stream_groups(widths, heights, tiers)).")
        flat = not len(counts) or np.isscalar(counts[0]) or np.ndim(counts[0]) == 0
        if flat and len(counts) == int(tiers.offsets[-1]):  # one array over the combined ids
            counts = [np.asarray(counts)[int(a) : int(b)] for a, b in zip(tiers.offsets[:-1], tiers.offsets[1:])]
        if len(counts) != tiers.num_tiers:
            raise ValueError(f"`counts` needs one array per tier ({tiers.num_tiers}), got {len(counts)}: pass "
                             "tier_stream_counts(widths, heights, tiers).")
        self.num_replicas, self.rank = check_positive("num_replicas", num_replicas), rank
        self.seed, self.batch_size = check_nonneg("seed", seed), check_positive("batch_size", batch_size)
        self.used = self.schedule.tiers_used(tiers.num_tiers)
        # the collate runs here, with the pass of the step's tier as its epoch (per-row crops follow the tier's pass)
        self.collate_fn = stream_kwargs.pop("collate_fn", None)
        self._make_args = (dataset, size_columns, counts, stream_kwargs)
        self.streams: dict[int, BucketedStream] = {}
        for t in self.used:
            self.streams[t] = self._make(t)
            if self.streams[t].steps_per_epoch == 0:
                raise ValueError(f"Tier {t} ({tiers.resolutions[t]}) has no full global batch in any bucket "
                                 f"({int(np.sum(counts[t]))} eligible rows, global batch {num_replicas} × "
                                 f"{batch_size}): use smaller batches, a larger max_upscale, or a schedule without it.")
        self.pass_steps = {t: s.steps_per_epoch for t, s in self.streams.items()}  # S_t
        self.steps_per_epoch = (check_positive("steps_per_epoch", steps_per_epoch) if steps_per_epoch is not None
                                else max(self.pass_steps.values()))
        self.epoch, self.step = 0, 0  # the next global step to produce is epoch * steps_per_epoch + step
        self._its: dict[int, Iterator[Any]] = {}
        self._previous: dict[int, BucketedStream] = {}  # each tier's stream of its previous pass (for state_dict)
        self._history: dict[int, dict[int, tuple[int, int]]] = {}  # global step -> {tier: (pass, step)}

    def _make(self, t: int) -> BucketedStream:
        """A fresh stream of tier ``t`` (at its pass 0)."""
        dataset, size_columns, counts, kwargs = self._make_args
        ds_t = dataset.map(TierColumns(self.tiers, t, size_columns), batched=True)
        only = [c if u == t else np.zeros_like(np.asarray(c)) for u, c in enumerate(counts)]  # this tier's slice
        return BucketedStream(ds_t, self.batch_size, counts=combined_counts(only, self.tiers),
                              num_replicas=self.num_replicas, rank=self.rank, seed=self.seed, **kwargs)

    # ------------------------------------------------------------------------------------------ the plan
    def __len__(self) -> int:
        return self.steps_per_epoch * self.num_replicas

    @property
    def ranks(self) -> list[int]:
        """The ranks whose split this process reads."""
        return list(range(self.num_replicas)) if self.rank is None else [self.rank]

    def step_tiers(self, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(tier, bucket)`` of every step of ``epoch`` (default: current): int64 ``(steps_per_epoch,)`` each."""
        e = self.epoch if epoch is None else check_nonneg("epoch", epoch)
        g = e * self.steps_per_epoch + np.arange(self.steps_per_epoch, dtype=np.int64)
        tiers, pos = stream_positions(self.schedule, self.seed, g)
        buckets = np.empty_like(tiers)
        for t in np.unique(tiers).tolist():
            sel = tiers == t
            q, s = np.divmod(pos[sel], self.pass_steps[t])
            buckets[sel] = [int(pass_schedule(self.streams[t], int(qq))[int(ss)]) - int(self.tiers.offsets[t])
                            for qq, ss in zip(q, s)]
        return tiers, buckets

    def steps_in(self, epoch: int) -> int:
        """Global steps of ``epoch`` (all the same: ``steps_per_epoch``)."""
        check_nonneg("epoch", epoch)
        return self.steps_per_epoch

    def report(self) -> TieredStreamReport:
        """The position and every used tier's stream report (its current pass)."""
        return TieredStreamReport(self.epoch, self.step, self.steps_per_epoch,
                                  {self.tiers.resolutions[t]: s.report() for t, s in self.streams.items()})

    def positions_at(self, global_step: int) -> dict[int, tuple[int, int]]:
        """``{tier: (pass, step in pass)}`` where each tier's stream stands before ``global_step`` (``O(steps)``)."""
        tiers = stream_positions(self.schedule, self.seed, np.arange(global_step, dtype=np.int64))[0]
        done = np.bincount(tiers, minlength=self.tiers.num_tiers)
        return {t: divmod(int(done[t]), self.pass_steps[t]) for t in self.used}

    # ------------------------------------------------------------------------------------------ iteration
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step; a no-op when it is the current epoch (a resumed position is kept
        when accelerate calls ``set_epoch`` at the start of iteration)."""
        epoch = check_nonneg("epoch", epoch)
        if epoch != self.epoch:
            self.epoch, self.step = epoch, 0

    def _seek(self, t: int, q: int, s: int) -> Iterator[Any]:
        """Tier ``t``'s stream standing at step ``s`` of its pass ``q``; its iterator (a fresh stream for a new
        pass; the finished one is kept, as a state may still describe its last steps)."""
        st = self.streams[t]
        if t in self._its and st.epoch == q and st.step <= s:
            it = self._its[t]
        else:
            if t in self._its:
                self._previous[t] = st
            st = self.streams[t] = self._make(t)
            st.set_epoch(q)
            it = self._its[t] = iter(st)
        while st.step < s:  # fast-forward by reading (only after a jump with set_epoch)
            for _ in range(self.num_replicas):
                next(it)
        return it

    def __iter__(self) -> Iterator[Any]:
        """The rest of the epoch: per step, one item per rank (``None`` for ranks this process does not read)."""
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        L = self.steps_per_epoch
        e = self.epoch
        while self.epoch == e and self.step < L:
            g = e * L + self.step
            t, pos = (int(x[0]) for x in stream_positions(self.schedule, self.seed, np.array([g])))
            q, s = divmod(pos, self.pass_steps[t])
            it = self._seek(t, q, s)
            self._history[g] = {u: (self.streams[u].epoch, self.streams[u].step) for u in self._its}
            while len(self._history) > 4 * self.streams[t].history:
                del self._history[min(self._history)]
            items = [next(it) for _ in range(self.num_replicas)]
            self.step += 1
            if self.collate_fn is not None:
                if hasattr(self.collate_fn, "set_epoch"):
                    self.collate_fn.set_epoch(q)
                items = [None if rows is None else self.collate_fn(rows) for rows in items]
            yield from items

    # ------------------------------------------------------------------------------------------ state
    def _config(self) -> dict[str, Any]:
        return {"tiers": self.tiers.fingerprint(), "max_upscale": float(self.tiers.max_upscale),
                "schedule": self.schedule.to_dict(), "steps_per_epoch": self.steps_per_epoch,
                "pass_steps": {str(t): n for t, n in self.pass_steps.items()}}

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The position after ``step`` steps of the current epoch the loop has *finished* (default: produced), with
        each tier stream's state there (JSON-serialisable).

        Raises:
            ValueError: ``step`` is ahead of the steps produced or further back than the streams' history.
        """
        step = self.step if step is None else int(step)
        if not 0 <= step <= self.step:
            raise ValueError(f"`step` must be in [0, {self.step}] (steps produced so far this epoch), got {step}.")
        g = self.epoch * self.steps_per_epoch + step
        at = self._history.get(g, {u: (self.streams[u].epoch, self.streams[u].step) for u in self._its})
        if step < self.step and g not in self._history:
            raise ValueError(f"`step` {step} is further back than the stream keeps (history): save the state within "
                             "`history` steps of the loader's position.")
        tiers = {}
        for t, (q, s) in at.items():
            src = self.streams[t] if self.streams[t].epoch == q else self._previous.get(t)
            if src is None or src.epoch != q:
                raise ValueError(f"Tier {t}'s stream moved past pass {q}: save the state within `history` steps.")
            tiers[str(t)] = src.state_dict(step=s)
        return {"version": STATE_VERSION, "kind": "tiered_stream", "config": self._config(), "epoch": self.epoch,
                "step": step, "tier_streams": tiers}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the remaining batches equal an uninterrupted run's.

        Raises:
            ValueError: a state of another kind, version or configuration (named), or one a tier stream refuses.
        """
        if not isinstance(state, Mapping) or state.get("kind") != "tiered_stream":
            raise ValueError(f"TieredStream.load_state_dict expected a tiered stream state (`stream.state_dict(step="
                             f"...)`), got {str(state)[:80]}.")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"Tiered stream state version {state.get('version')!r}, this version reads "
                             f"{STATE_VERSION}: resume with the hf_arb that saved it.")
        for name, ours in self._config().items():
            if state["config"].get(name) != ours:
                raise ValueError(f"Tiered stream state field `config.{name}` does not match: saved "
                                 f"{state['config'].get(name)!r}, this stream has {ours!r}. Build the stream with the "
                                 "checkpoint's tiers, schedule and steps_per_epoch.")
        self.epoch, self.step = check_nonneg("epoch", state["epoch"]), check_nonneg("step", state["step"])
        self._its, self._previous, self._history = {}, {}, {}
        for key, sub in state["tier_streams"].items():
            t = int(key)
            self.streams[t].load_state_dict(sub)
            self._its[t] = iter(self.streams[t])


def pass_schedule(stream: BucketedStream, q: int) -> np.ndarray:
    """The bucket schedule of pass ``q`` of a tier's stream, shape ``(S_t,)`` (pure: counts, seed, pass)."""
    return stream_schedule(stream.counts, stream.global_batch_size, stream.seed, q, order=stream.schedule_order,
                           batch_size=stream.batch_size)


def build_tiered_stream_loader(dataset: Any, tiers: Tiers, schedule: TierSchedule | str, batch_size: int, *,
                                counts: Any, accelerator: Any = None,
                                **stream_kwargs: Any) -> tuple[torch.utils.data.DataLoader, TieredStream]:
    """:func:`~hf_arb.sampling.streaming.stream.build_stream_loader` for several tiers: a ``DataLoader`` over a
    :class:`TieredStream` set up for ``accelerator`` (each process reads its own split with
    ``dispatch_batches=False``, else the main process reads every split).

    Raises:
        ValueError: the accelerator uses ``split_batches=True``.
    """
    world, rank = stream_ranks(accelerator)
    stream = TieredStream(dataset, tiers, schedule, batch_size, counts=counts, num_replicas=world, rank=rank,
                          **stream_kwargs)
    return torch.utils.data.DataLoader(stream, batch_size=1, collate_fn=first_item, num_workers=0), stream


def stream_ranks(accelerator: Any) -> tuple[int, int | None]:
    """``(world size, rank this process reads or None for every rank)`` of a tiered stream under ``accelerator``
    (each process reads its own split with ``dispatch_batches=False``, else the main process reads every split).

    Raises:
        ValueError: the accelerator uses ``split_batches=True``.
    """
    if accelerator is None:
        return 1, None
    world = int(accelerator.num_processes)
    if accelerator.split_batches:
        raise ValueError("A tiered stream does not support split_batches=True: give each rank its own batch "
                         "(DataLoaderConfiguration(split_batches=False)) with the per-rank `batch_size`.")
    dispatch = accelerator.dataloader_config.dispatch_batches
    return world, accelerator.process_index if (world > 1 and dispatch is False) else None


def first_item(items: list[Any]) -> Any:
    """The DataLoader's collate over single items (the stream yields whole batches)."""
    return items[0]


__all__ = ["TierColumns", "TieredStream", "TieredStreamReport", "build_tiered_stream_loader", "combined_counts",
           "stream_ranks", "tier_stream_counts"]
