"""Several datasets in one epoch plan: each dataset's exact share of an epoch, as *slots* (rows trained per epoch),
and the row map that lays them out for one global plan.

A dataset with ``repeats = r`` fills ``r × rows`` slots (every trainable row ``r`` times); datasets with weights
share the epoch's ``sum(rows)`` slots in proportion to their weights (largest remainders, so the slots add up
exactly). A dataset with ``q × rows + m`` slots trains every row ``q`` times and ``m`` of its rows once more, those
``m`` drawn by the seed (the same every epoch: the plan's inputs do not change between epochs).

The row map (:func:`slot_rows`) lists, for every slot, the row of the concatenated datasets it trains. A
:class:`~hf_arb.BucketBatchSampler` over the rows' buckets in that order plans every epoch as it plans one dataset —
the same bucket on every rank, every resume idiom, elastic resume — and :func:`dataset_counts` counts what each
dataset got from a plan. All functions are pure and vectorised (a loop over datasets, never over rows).
"""

from __future__ import annotations

import numpy as np


def epoch_slots(rows: np.ndarray, repeats: np.ndarray | None = None, weights: np.ndarray | None = None) -> np.ndarray:
    """Slots per epoch of every dataset, int64 ``(D,)``.

    Args:
        rows: trainable rows of every dataset, ``(D,)``.
        repeats: every row this many times per epoch, ``(D,)`` integers >= 1 (default 1).
        weights: instead, shares of the epoch (``(D,)``, > 0): the epoch keeps ``sum(rows)`` slots and dataset ``d``
            gets ``weights[d] / sum(weights)`` of them, rounded by largest remainder (ties to the first dataset).
    """
    rows = np.asarray(rows, np.int64)
    if weights is None:
        reps = np.ones_like(rows) if repeats is None else np.asarray(repeats, np.int64)
        if reps.shape != rows.shape or (reps < 1).any():
            raise ValueError(f"repeats must be integers >= 1, one per dataset; got {reps.tolist()}.")
        return rows * reps
    w = np.asarray(weights, np.float64)
    if w.shape != rows.shape or not (w > 0).all() or not np.isfinite(w).all():
        raise ValueError(f"weights must be finite and > 0, one per dataset; got {w.tolist()}.")
    w = np.where(rows > 0, w, 0.0)  # a dataset without a trainable row takes no share
    total = int(rows.sum())
    if total == 0:
        return np.zeros_like(rows)
    exact = w / w.sum() * total
    slots = np.floor(exact).astype(np.int64)
    short = total - int(slots.sum())
    order = np.lexsort((np.arange(rows.size), -(exact - slots)))  # largest remainder first, then dataset order
    slots[order[:short]] += 1
    return slots


def slot_rows(members: list[np.ndarray], slots: np.ndarray, seed: int) -> np.ndarray:
    """The row map: every slot's row, int64 ``(slots.sum(),)``, dataset after dataset.

    Args:
        members: every dataset's trainable rows (indices into the concatenated rows), in order.
        slots: :func:`epoch_slots`.
        seed: draws which rows of a dataset with ``q × rows + m`` slots train once more (seeded, per dataset).
    """
    parts = []
    for d, (rows, n) in enumerate(zip(members, np.asarray(slots, np.int64).tolist())):
        rows = np.asarray(rows, np.int64)
        if n == 0:
            continue
        if rows.size == 0:
            raise ValueError(f"Dataset {d} has {n} slots but no trainable row.")
        q, m = divmod(n, rows.size)
        parts.append(np.tile(rows, q))
        if m:
            rng = np.random.Generator(np.random.PCG64([int(seed), d, 0x5A4E]))
            parts.append(rows[np.sort(rng.permutation(rows.size)[:m])])
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def plan_slots(row_dataset: np.ndarray, bucket_ids: np.ndarray, num_datasets: int, *,
               repeats: np.ndarray | None = None, weights: np.ndarray | None = None,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Everything a plan over several datasets needs, from the concatenated rows.

    Args:
        row_dataset: every row's dataset, ``(R,)``; bucket_ids: every row's bucket (``-1``: skipped), ``(R,)``.
        repeats / weights / seed: as :func:`epoch_slots` and :func:`slot_rows`.

    Returns:
        ``(row_map, slots, trainable)``: every slot's row ``(N,)`` (a sampler plans ``bucket_ids[row_map]``), the
        slots and the trainable rows of every dataset ``(D,)``.
    """
    row_dataset, ids = np.asarray(row_dataset), np.asarray(bucket_ids)
    keep = ids >= 0
    members = [np.flatnonzero(keep & (row_dataset == d)) for d in range(num_datasets)]
    trainable = np.array([m.size for m in members], np.int64)
    slots = epoch_slots(trainable, repeats=repeats, weights=weights)
    return slot_rows(members, slots, seed), slots, trainable


def dataset_counts(slot_ids: np.ndarray, slot_dataset: np.ndarray, num_datasets: int) -> np.ndarray:
    """Rows each dataset trains in a plan: ``slot_ids`` (any shape; the sampler's rows, i.e. slots) counted by
    ``slot_dataset`` (every slot's dataset), int64 ``(num_datasets,)``."""
    ids = np.asarray(slot_ids, np.int64).ravel()
    return np.bincount(np.asarray(slot_dataset)[ids], minlength=num_datasets).astype(np.int64)


__all__ = ["dataset_counts", "epoch_slots", "plan_slots", "slot_rows"]
